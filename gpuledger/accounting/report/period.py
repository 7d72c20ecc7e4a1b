"""Report periods and the period rule.

A job belongs to the period in which it ENDED, and is counted whole there (:func:`job_end`): Slurm's end time;
for a job Slurm knows that has no end yet (it is running), the report's ``now``, so that it counts only in a period
not over yet (one ending after now), with its allocation so far, and never in a closed one: a closed period's
report is the same whenever it is made, and the job counts in the period it ends; for a job Slurm does not know,
its last measurement (a running job's record, which `priority watch` imports, makes Slurm know it while it runs).
A requeued job (``JobRecord.earlier_runs``) counts run by run (:func:`run_ends`): each earlier run whole in the
period it ended, the latest by the rule above, each with its own measured usage (``scope.in_runs``: a usage
record's share inside the run's window on its host), its allocation (``charge.allocation_runs``' span of it, at
the latest run's GPUs), unmeasured time and prices (:func:`part_in_runs`); so a requeue does not change the report
of the period an earlier run ended in, and the job counts once in each period one of its runs ended in.
So consecutive periods partition the runs, every run is charged once in the closed periods, and a period's totals
are exactly the sum of its job records; a job (run) spanning a month boundary lands in the month it ended (no
proration). Times are UTC. A job only agents measured that still runs at a period's end shows it only once its
samples after the end are in the ledger: a report made within ``SETTLE_S`` of the end says how many it may count
that way (:func:`not_ended_note`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gpuledger.accounting.audit.binding import FINAL_AFTER_S
from gpuledger.accounting.ledger import LedgerEntry, sum_usage
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.scope import in_runs, nearest_run

# How long after a period's end the last measurement of a job only agents measured may still move past it (the job
# ran on): the collector's late window (a sample may trail its GPU's newest by FINAL_AFTER_S and still count, and
# after it the audit log takes usage as final) plus an agent's push cadence (--interval 10 s x --push-every, and
# the push's retries and backoff while a collector restarts: 5 minutes).
SETTLE_S = FINAL_AFTER_S + 300.0


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


def job_end(e: LedgerEntry, now: float | None = None) -> float | None:
    """When a job counts (the period rule of every report): Slurm's end; for a job Slurm knows that started and
    has no end (running; or recorded while pending, with usage measured since), ``now`` (default: the clock), so
    it counts in no closed period; for a job Slurm does not know, its last measurement; None (in no period) for a
    job that never started."""
    r = e.record
    if r is not None:
        if r.end is not None:
            return r.end
        if r.start is None and e.usage is None:
            return None
        return time.time() if now is None else now
    return e.usage.last_ts if e.usage is not None else None


def run_ends(e: LedgerEntry, now: float) -> list[float]:
    """When each run of the job counts (the period rule): a requeued job's earlier runs' ends, oldest first, then
    its latest run's :func:`job_end` where that run started (the runs as ``scope.job_runs`` numbers them); a job
    never requeued: its :func:`job_end`, or nothing (it never started)."""
    r = e.record
    if r is None or not r.earlier_runs:
        t = job_end(e, now)
        return [] if t is None else [t]
    ends = [end for _, end, _ in r.earlier_runs]
    if r.start is not None:
        ends.append(r.end if r.end is not None else now)  # job_end of a run that started
    return ends


def runs_in(e: LedgerEntry, period: Period, now: float) -> list[int]:
    """The runs of the job (positions in :func:`run_ends`) that count in ``period``."""
    return [i for i, t in enumerate(run_ends(e, now)) if period.start <= t < period.end]


def part_in_runs(e: LedgerEntry, runs: Collection[int], now: float) -> LedgerEntry:
    """A requeued job's entry as far as it is some of its runs (positions in :func:`run_ends`): its record of
    those runs (the latest of them gives the start, end and hosts, the others are its earlier runs; the GPUs and
    the rest are the job's latest run's, which Slurm's record keeps), each measured usage record's part in them
    (``scope.in_runs``), the job-level record their sum, and the measurements out of scope and the gap energy
    whose nearest run (``scope.nearest_run``) is one of them. ``e`` itself for all its runs."""
    r = e.record
    if r is None or len(runs) == len(run_ends(e, now)):
        return e
    latest = len(r.earlier_runs)
    earlier = tuple(r.earlier_runs[i] for i in sorted(runs) if i < latest)
    if latest in runs:
        record = replace(r, earlier_runs=earlier)
    else:
        (start, end, hosts), earlier = earlier[-1], earlier[:-1]
        # a run that was requeued, as Slurm's record of it says; its submission and GPUs are not kept
        record = replace(r, start=start, end=end, hosts=hosts, earlier_runs=earlier, state="REQUEUED",
                         exit_code=None, submit=None, gpu_uuids=(), gpu_indexes=())
    gpus = tuple(p for u in e.gpus if (p := in_runs(r, u, runs, now)) is not None)
    if e.gpus:
        usage = sum_usage(list(gpus)) if gpus else None
    else:
        usage = in_runs(r, e.usage, runs, now) if e.usage is not None else None
    return replace(e, record=record, usage=usage, gpus=gpus,
                   out_of_scope=tuple(c for c in e.out_of_scope
                                      if nearest_run(r, c.usage.first_ts, c.usage.last_ts, now) in runs),
                   gap_shares=tuple(g for g in e.gap_shares if nearest_run(r, g.start, g.end, now) in runs))


def run_parts(e: LedgerEntry, period: Period, now: float) -> list[tuple[LedgerEntry, bool]]:
    """The job run by run: each run's part (:func:`part_in_runs`; a job never requeued, the entry itself) and
    whether it counts in ``period`` (the period rule, :func:`run_ends`)."""
    r = e.record
    if r is None or not r.earlier_runs:
        t = job_end(e, now)
        return [(e, t is not None and period.start <= t < period.end)]
    return [(part_in_runs(e, (i,), now), period.start <= t < period.end) for i, t in enumerate(run_ends(e, now))]


def period_part(e: LedgerEntry, period: Period, now: float) -> LedgerEntry | None:
    """What of the job counts in ``period`` (:func:`runs_in`): the entry, its part in the runs that ended there
    (:func:`part_in_runs`), or None."""
    r = e.record
    if r is None or not r.earlier_runs:  # one run: inlined, this runs once per job
        t = job_end(e, now)
        return e if t is not None and period.start <= t < period.end else None
    runs = runs_in(e, period, now)
    return part_in_runs(e, runs, now) if runs else None


def in_period(entries: Iterable[LedgerEntry], period: Period, now: float | None = None) -> list[LedgerEntry]:
    """What of each job counts in ``period`` (:func:`period_part`)."""
    now = time.time() if now is None else now
    return [p for e in entries if (p := period_part(e, period, now)) is not None]


def not_ended_note(entries: Iterable[LedgerEntry], period: Period, now: float | None = None) -> str | None:
    """What the period rule (:func:`run_ends`) did with the jobs whose end is not final, or None when there are
    none: the jobs Slurm shows running that started before the period's end (counted up to ``now`` in a period not
    over yet, else left out), and, in a report made less than ``SETTLE_S`` after the period's end, the jobs Slurm
    does not know last measured within ``SETTLE_S`` of it (counted at their last measurement, but they may still
    be running)."""
    now = time.time() if now is None else now
    entries = list(entries)
    notes = []
    running = [e for e in entries if (r := e.record) is not None and r.end is None and r.start is not None
               and r.start < period.end]
    n = len(running)
    if n and period.start <= now < period.end:
        notes.append(f"{n} job(s) still running (no end in Slurm's records) are counted with their allocation up to "
                     "now, as the period is still open: once it has ended, a job counts only in the period it ends")
    elif n:
        # a requeued one's earlier runs that ended in the period count here all the same (run_ends)
        requeued = sum(1 for e in running if e.record is not None and e.record.earlier_runs
                       and any(period.start <= t < period.end for t in run_ends(e, now)))
        notes.append(f"{n} job(s) that started before the period's end have no end in Slurm's records (running, or "
                     "not imported since they ended) and are not counted: each counts whole in the period it ends"
                     + (f" (of them, {requeued} requeued job(s) count here with the earlier runs that ended in the "
                        "period)" if requeued else ""))
    if period.end <= now < period.end + SETTLE_S:
        since = max(period.start, period.end - SETTLE_S)
        unsettled = sum(1 for e in entries if e.record is None and (t := job_end(e, now)) is not None
                        and since <= t < period.end)
        if unsettled:
            notes.append(
                f"{unsettled} job(s) Slurm has no record of were last measured within {SETTLE_S / 60:g} min of the "
                f"period's end, which is less than that ago: they count here at their last measurement, but may "
                f"still be running (their ends are not final until {iso_utc(period.end + SETTLE_S)})")
    return "; ".join(notes) or None
