"""Report periods and the period rule.

A job belongs to the period in which it ENDED (scheduler end time; for a job still running or unknown to the
scheduler, its last measurement), and is counted whole there. So consecutive periods partition the jobs, every
job is charged once, and a period's totals are exactly the sum of its job records; a job spanning a month
boundary lands in the month it ended (no proration). Times are UTC.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.errors import ReportError


@dataclass(frozen=True, slots=True)
class Period:
    start: float  # inclusive, unix seconds
    end: float  # exclusive
    label: str

    def to_dict(self) -> dict[str, Any]:
        # an open end is None: JSON (and the signed manifest) has no infinity
        return {"label": self.label, "start": self.start if math.isfinite(self.start) else None,
                "end": self.end if math.isfinite(self.end) else None,
                "start_iso": iso_utc(self.start), "end_iso": iso_utc(self.end),
                "rule": "job counted whole in the period it ended"}


ALL_TIME = Period(-math.inf, math.inf, "all")


def iso_utc(t: float) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat() if math.isfinite(t) else None


def parse_time(text: str, what: str = "time") -> float:
    """``YYYY-MM-DD`` (UTC midnight), an ISO 8601 date-time (UTC unless it carries an offset), or unix seconds;
    refused unless it is a UTC date-time of the years 1 to 9999, so that nothing later fails to print it."""
    s = text.strip()
    try:
        t = float(s)
    except ValueError:
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:
            raise ReportError(f"{what} {text!r}: expected YYYY-MM-DD, an ISO 8601 date-time or unix seconds") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        t = dt.timestamp()  # an offset can carry year 1 or 9999 out of range in UTC
    if not math.isfinite(t):
        raise ReportError(f"{what} {text!r}: not a finite time")
    try:
        iso_utc(t)
    except (ValueError, OverflowError, OSError):
        raise ReportError(f"{what} {text!r}: out of range (a time of the years 1 to 9999 UTC)") from None
    return t


PERIOD_FORMS = "YYYY-MM, YYYY-MM-DD..YYYY-MM-DD (both days included), last-30d (or YYYY, YYYY-MM-DD)"
_PERIOD = re.compile(r"(?P<y>\d{4})(?:-(?P<m>\d{2})(?:-(?P<d>\d{2}))?)?")
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_LAST = re.compile(r"last-(?P<n>[1-9]\d{0,4})d")
_DAY_S = 86400.0


def _utc(dt: datetime) -> float:
    return dt.replace(tzinfo=UTC).timestamp()


def _day(text: str, period: str) -> datetime:
    if not _DAY.fullmatch(text):
        raise ReportError(f"period {period!r}: {text!r} is not a YYYY-MM-DD day")
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ReportError(f"period {period!r}: {text!r} is not a day of the calendar") from None


def parse_period(period: str | None = None, start: str | None = None, end: str | None = None,
                 now: float | None = None) -> Period:
    """``period`` (see ``PERIOD_FORMS``; UTC, whole days; ``last-Nd`` ends at ``now``), or ``start``/``end`` (end
    exclusive)."""
    if period is not None:
        if start is not None or end is not None:
            raise ReportError("give either --period or --from/--to, not both")
        text = period.strip()
        label = text
        if (m := _LAST.fullmatch(text)) is not None:
            until = time.time() if now is None else now
            return Period(until - int(m["n"]) * _DAY_S, until, label)
        if ".." in text:
            first, _, last = text.partition("..")
            a, z = _day(first, text), _day(last, text)
            if z < a:
                raise ReportError(f"period {period!r}: {last} is before {first}")
            return Period(_utc(a), _utc(z) + _DAY_S, label)
        m = _PERIOD.fullmatch(text)
        if m is None or int(m["y"]) < 1970:
            raise ReportError(f"period {period!r}: expected {PERIOD_FORMS}")
        y, mo, d = int(m["y"]), m["m"], m["d"]
        try:
            if mo is None:
                a, b = datetime(y, 1, 1), datetime(y + 1, 1, 1)
            elif d is None:
                mm = int(mo)
                a, b = datetime(y, mm, 1), datetime(y + (mm == 12), mm % 12 + 1, 1)
            else:
                a = datetime(y, int(mo), int(d))
                b = datetime.fromordinal(a.toordinal() + 1)
        except ValueError:
            raise ReportError(f"period {period!r}: not a month or day of the calendar") from None
        return Period(_utc(a), _utc(b), label)
    if start is None and end is None:
        return ALL_TIME
    since = parse_time(start, "--from") if start is not None else -math.inf
    until = parse_time(end, "--to") if end is not None else math.inf
    if not since < until:
        raise ReportError(f"--from {start} is not before --to {end}")
    return Period(since, until, f"{start or '...'} to {end or '...'}")


def job_end(e: LedgerEntry) -> float | None:
    """When a job counts: the scheduler's end, else its last measurement (running or unknown to Slurm)."""
    r, u = e.record, e.usage
    if r is not None and r.end is not None:
        return r.end
    return u.last_ts if u is not None else None


def in_period(entries: Iterable[LedgerEntry], period: Period) -> list[LedgerEntry]:
    a, b = period.start, period.end
    out = []
    for e in entries:
        t = job_end(e)
        if t is not None and a <= t < b:
            out.append(e)
    return out
