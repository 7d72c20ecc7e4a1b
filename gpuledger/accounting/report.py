"""Usage reports: per job, grouped per account and user, and over a period grouped by account, user, partition,
GPU model or node; idle jobs. Pure: rows in, rows out; rendering apart (HTML in ``accounting.html``)."""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
import tomllib
from array import array
from itertools import chain
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.schema.records import JobUsage

HOUR = 3600.0
KWH = 3.6e6  # joules per kWh


@dataclass(frozen=True, slots=True)
class JobRow:
    job_id: str
    user: str
    account: str
    gpus: int
    gpu_hours: float
    sm_active_gpu_hours: float
    hbm_mean: float | None
    energy_kwh: float
    efficiency: float | None
    only: str | None  # which side alone saw the job (see LedgerEntry.only)


@dataclass(frozen=True, slots=True)
class GroupRow:
    account: str
    user: str | None  # None on the account subtotal row
    jobs: int
    gpu_hours: float
    sm_active_gpu_hours: float
    efficiency: float | None
    energy_kwh: float


def job_rows(entries: Iterable[LedgerEntry]) -> list[JobRow]:
    rows = []
    for e in entries:
        u = e.usage
        gpus = u.gpus if u else (e.record.gpus or 0 if e.record else 0)
        rows.append(
            JobRow(
                job_id=e.job_id,
                user=e.user,
                account=e.account,
                gpus=gpus,
                gpu_hours=u.allocated_gpu_seconds / HOUR if u else 0.0,
                sm_active_gpu_hours=u.sm_active_gpu_seconds / HOUR if u else 0.0,
                hbm_mean=u.dram_bw_mean if u else None,
                energy_kwh=u.energy_joules / KWH if u else 0.0,
                efficiency=u.efficiency if u else None,
                only=e.only,
            )
        )
    return rows


def by_account_user(rows: Sequence[JobRow]) -> list[GroupRow]:
    """Account subtotal rows, each followed by its users' rows; sorted by name."""
    out: list[GroupRow] = []
    for account in sorted({r.account for r in rows}):
        acc_rows = [r for r in rows if r.account == account]
        out.append(_group(account, None, acc_rows))
        for user in sorted({r.user for r in acc_rows}):
            out.append(_group(account, user, [r for r in acc_rows if r.user == user]))
    return out


def _group(account: str, user: str | None, rows: Sequence[JobRow]) -> GroupRow:
    gh = sum(r.gpu_hours for r in rows)
    ah = sum(r.sm_active_gpu_hours for r in rows)
    return GroupRow(account, user, len(rows), gh, ah, ah / gh if gh > 0 else None, sum(r.energy_kwh for r in rows))


def to_json(rows: Sequence[JobRow] | Sequence[GroupRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)


def to_csv(rows: Sequence[JobRow] | Sequence[GroupRow]) -> str:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return buf.getvalue()


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


JOB_COLUMNS: list[tuple[str, Callable[[JobRow], str]]] = [
    ("Job", lambda r: r.job_id + ("*" if r.only else "")),
    ("User", lambda r: r.user),
    ("Account", lambda r: r.account),
    ("GPUs", lambda r: str(r.gpus)),
    ("GPU-h", lambda r: _fmt(r.gpu_hours, ".2f")),
    ("SM-active GPU-h", lambda r: _fmt(r.sm_active_gpu_hours, ".2f")),
    ("Mean HBM", lambda r: _fmt(r.hbm_mean, ".0%")),
    ("Energy kWh", lambda r: _fmt(r.energy_kwh, ".2f")),
    ("Efficiency", lambda r: _fmt(r.efficiency, ".0%")),
]

GROUP_COLUMNS: list[tuple[str, Callable[[GroupRow], str]]] = [
    ("Account", lambda r: r.account if r.user is None else ""),
    ("User", lambda r: r.user or ""),
    ("Jobs", lambda r: str(r.jobs)),
    ("GPU-h allocated", lambda r: _fmt(r.gpu_hours, ".2f")),
    ("GPU-h SM-active", lambda r: _fmt(r.sm_active_gpu_hours, ".2f")),
    ("Efficiency", lambda r: _fmt(r.efficiency, ".0%")),
    ("Energy kWh", lambda r: _fmt(r.energy_kwh, ".2f")),
]


def rich_table(title: str, columns, rows):  # -> rich.table.Table
    from rich.table import Table

    t = Table(title=title)
    for name, _ in columns:
        t.add_column(name, justify="left" if name in ("Job", "User", "Account") else "right")
    for r in rows:
        t.add_row(*(f(r) for _, f in columns))
    return t


def plain_table(columns, rows) -> str:
    """A fixed-width text table (for files and pipes)."""
    cells = [[name for name, _ in columns]] + [[f(r) for _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells) + "\n"


# =====================================================================================================================
# Usage reports over a period, grouped by account, user, partition, GPU model or node (issue 6).
#
# Period rule: a job belongs to the period in which it ENDED (scheduler end time; for a job still running or unknown
# to the scheduler, its last measurement), and is counted whole there. So consecutive periods partition the jobs,
# every job is charged once, and a period's totals are exactly the sum of its job records; a job spanning a month
# boundary lands in the month it ended (no proration). Times are UTC.
# =====================================================================================================================

GROUP_BY: tuple[str, ...] = ("account", "user", "partition", "model", "node")
TOTAL = "TOTAL"


class ReportError(ValueError):
    """Bad report input (a date, a setting, a CSV line); the message names what and where."""


@dataclass(frozen=True, slots=True)
class Period:
    start: float  # inclusive, unix seconds
    end: float  # exclusive
    label: str

    def to_dict(self) -> dict[str, Any]:
        # an open end is None: JSON (and the signed manifest) has no infinity
        return {"label": self.label, "start": self.start if math.isfinite(self.start) else None,
                "end": self.end if math.isfinite(self.end) else None,
                "start_iso": _iso(self.start), "end_iso": _iso(self.end), "rule": "job counted whole in the period it ended"}


ALL_TIME = Period(-math.inf, math.inf, "all")


def _iso(t: float) -> str | None:
    return datetime.fromtimestamp(t, timezone.utc).isoformat() if math.isfinite(t) else None


def parse_time(text: str, what: str = "time") -> float:
    """``YYYY-MM-DD`` (UTC midnight), an ISO 8601 date-time (UTC unless it carries an offset), or unix seconds."""
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise ReportError(f"{what} {text!r}: expected YYYY-MM-DD, an ISO 8601 date-time or unix seconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def parse_period(period: str | None = None, start: str | None = None, end: str | None = None) -> Period:
    """``period`` as ``YYYY``, ``YYYY-MM`` or ``YYYY-MM-DD`` (UTC), or ``start``/``end`` (end exclusive)."""
    if period is not None:
        if start is not None or end is not None:
            raise ReportError("give either --period or --from/--to, not both")
        parts = period.strip().split("-")
        try:
            nums = [int(p) for p in parts]
            if len(nums) == 1:
                a, b = datetime(nums[0], 1, 1), datetime(nums[0] + 1, 1, 1)
            elif len(nums) == 2:
                y, m = nums
                a, b = datetime(y, m, 1), datetime(y + (m == 12), m % 12 + 1, 1)
            elif len(nums) == 3:
                a = datetime(*nums)
                b = datetime.fromordinal(a.toordinal() + 1)
            else:
                raise ValueError
        except ValueError:
            raise ReportError(f"period {period!r}: expected YYYY, YYYY-MM or YYYY-MM-DD") from None
        utc = timezone.utc
        return Period(a.replace(tzinfo=utc).timestamp(), b.replace(tzinfo=utc).timestamp(), period.strip())
    a = parse_time(start, "--from") if start is not None else -math.inf
    b = parse_time(end, "--to") if end is not None else math.inf
    if not a < b:
        raise ReportError(f"--from {start} is not before --to {end}")
    return Period(a, b, f"{start or '...'} to {end or '...'}")


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


# -- settings: the [report] table of gpuledger.toml --------------------------------------------------------------------
REPORT_CONFIG_DOC = """\
[report]                         # all optional
currency = "EUR"                 # shown next to costs
price_per_kwh = 0.25             # energy price
co2e_kg_per_kwh = 0.35           # constant grid emission factor (kg CO2e per kWh)
grid_intensity_csv = "grid.csv"  # or a time series (relative to the data dir): rows `time,g_co2e_per_kwh`,
                                 # time as unix seconds or ISO 8601; overrides the constant factor
idle_threshold = 0.05            # a GPU whose mean SM activity is below this is idle (report idle, job notes)
retention_days = 365             # job records that ended longer ago get pseudonymous user names
[report.price_per_gpu_hour]      # price per allocated GPU-hour by model: exact name, else a case-insensitive
default = 1.0                    # substring of the model ("H200" matches "NVIDIA H200"), else `default`
"H200" = 3.2
[report.rules]                   # efficiency notes of `report job` (see accounting.jobreport.Rules)
"""


@dataclass(frozen=True, slots=True)
class GridIntensity:
    """A step function of grid carbon intensity (g CO2e/kWh): each value holds until the next time.

    Before the first point the first value holds, after the last point the last one (documented clamping).
    """

    times: tuple[float, ...]
    values: tuple[float, ...]
    cum: tuple[float, ...]  # integral of the step function from times[0] to times[i]

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float]], where: str = "grid intensity") -> GridIntensity:
        if not points:
            raise ReportError(f"{where}: no data points")
        pts = sorted(points)
        times = tuple(t for t, _ in pts)
        if len(set(times)) != len(times):
            raise ReportError(f"{where}: duplicate time in the series")
        vals = tuple(v for _, v in pts)
        cum = [0.0]
        for i in range(1, len(pts)):
            cum.append(cum[-1] + vals[i - 1] * (times[i] - times[i - 1]))
        return cls(times, vals, tuple(cum))

    @classmethod
    def from_csv(cls, text: str, where: str = "grid intensity CSV") -> GridIntensity:
        points: list[tuple[float, float]] = []
        first = True
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            header, first = first, False
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != 2:
                raise ReportError(f"{where} line {n}: expected `time,g_co2e_per_kwh`, got {line!r}")
            try:
                value = float(cells[1])
            except ValueError:
                if header:
                    continue  # the first line may be a header
                raise ReportError(f"{where} line {n}: intensity {cells[1]!r} is not a number") from None
            if not (math.isfinite(value) and value >= 0):
                raise ReportError(f"{where} line {n}: intensity {value!r} must be a finite number >= 0")
            t = parse_time(cells[0], f"{where} line {n}: time")
            points.append((t, value))
        return cls.from_points(points, where)

    def _integral_to(self, t: float) -> float:
        ts = self.times
        if t <= ts[0]:
            return (t - ts[0]) * self.values[0]
        i = bisect.bisect_right(ts, t) - 1
        return self.cum[i] + self.values[i] * (t - ts[i])

    def mean(self, a: float, b: float) -> float:
        """Time-weighted mean intensity over [a, b] (the value at a when b <= a)."""
        if b <= a:
            i = max(bisect.bisect_right(self.times, a) - 1, 0)
            return self.values[i]
        return (self._integral_to(b) - self._integral_to(a)) / (b - a)


@dataclass(frozen=True, slots=True)
class ReportSettings:
    currency: str = ""
    price_per_kwh: float = 0.0
    price_per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    co2e_kg_per_kwh: float | None = None
    grid: GridIntensity | None = None
    idle_threshold: float = 0.05
    retention_days: float | None = None
    rules: Mapping[str, float] = field(default_factory=dict)

    @property
    def priced(self) -> bool:
        return bool(self.price_per_gpu_hour) or self.price_per_kwh > 0

    def gpu_hour_price(self, model: str) -> float:
        p = self.price_per_gpu_hour
        if model in p:
            return p[model]
        low = model.lower()
        for name, v in p.items():
            if name != "default" and name.lower() in low:
                return v
        return p.get("default", 0.0)


_REPORT_KEYS = {"currency", "price_per_kwh", "price_per_gpu_hour", "co2e_kg_per_kwh", "grid_intensity_csv",
                "idle_threshold", "retention_days", "rules"}


def report_settings(config: Mapping[str, Any], base_dir: str | Path = ".", where: str = "<config>") -> ReportSettings:
    """Validate the ``[report]`` table of a parsed gpuledger.toml (see REPORT_CONFIG_DOC)."""
    t = config.get("report", {})
    if not isinstance(t, Mapping):
        raise ReportError(f"{where}: [report] must be a table")
    unknown = sorted(set(t) - _REPORT_KEYS)
    if unknown:
        raise ReportError(f"{where}: report.{unknown[0]}: unknown setting (known: {', '.join(sorted(_REPORT_KEYS))})")

    def num(key: str, value: Any, lo: float = 0.0, hi: float = math.inf) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
            raise ReportError(f"{where}: report.{key}: expected a number in [{lo}, {hi}], got {value!r}")
        return float(value)

    prices = t.get("price_per_gpu_hour", {})
    if not isinstance(prices, Mapping):
        raise ReportError(f"{where}: report.price_per_gpu_hour must be a table of model = price")
    rules = t.get("rules", {})
    if not isinstance(rules, Mapping):
        raise ReportError(f"{where}: report.rules must be a table")
    grid = None
    if "grid_intensity_csv" in t:
        p = Path(base_dir) / str(t["grid_intensity_csv"])
        try:
            grid = GridIntensity.from_csv(p.read_text(), str(p))
        except OSError as e:
            raise ReportError(f"{where}: report.grid_intensity_csv: cannot read {p}: {e.strerror}") from None
    currency = t.get("currency", "")
    if not isinstance(currency, str):
        raise ReportError(f"{where}: report.currency must be text")
    return ReportSettings(
        currency=currency,
        price_per_kwh=num("price_per_kwh", t.get("price_per_kwh", 0.0)),
        price_per_gpu_hour={str(k): num(f"price_per_gpu_hour.{k}", v) for k, v in prices.items()},
        co2e_kg_per_kwh=num("co2e_kg_per_kwh", t["co2e_kg_per_kwh"]) if "co2e_kg_per_kwh" in t else None,
        grid=grid,
        idle_threshold=num("idle_threshold", t.get("idle_threshold", 0.05), 0.0, 1.0),
        retention_days=num("retention_days", t["retention_days"]) if "retention_days" in t else None,
        rules={str(k): num(f"rules.{k}", v) for k, v in rules.items()},
    )


def load_report_settings(data_dir: str | Path, config: str | Path | None = None) -> ReportSettings:
    """From ``config`` or ``<data-dir>/gpuledger.toml`` (defaults when the default file is absent)."""
    path = Path(config) if config is not None else Path(data_dir) / "gpuledger.toml"
    if not path.exists():
        if config is not None:
            raise ReportError(f"{path}: configuration file not found")
        return ReportSettings()
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ReportError(f"{path}: invalid TOML: {e}") from None
    return report_settings(data, path.parent, str(path))


# -- the grouped usage report ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class UsageRow:
    group: str  # the group's name; TOTAL on the totals row
    jobs: int
    allocated_gpu_hours: float
    sm_active_gpu_hours: float
    efficiency: float | None  # SM-active / allocated
    hbm_mean: float | None  # HBM bandwidth utilisation, weighted by allocated GPU-time where reported
    energy_kwh: float
    co2e_kg: float | None  # None: no emission factor configured
    cost: float | None  # None: no prices configured
    idle_gpu_hours: float  # allocated but SM-idle: allocated - SM-active GPU-hours
    queue_wait_mean_h: float | None  # start - submit, over the jobs whose Slurm record has both
    queue_wait_jobs: int
    unmeasured_jobs: int  # jobs Slurm knows that have no measurement (counted, zero usage)


@dataclass(frozen=True, slots=True)
class UsageReport:
    by: str
    period: Period
    rows: list[UsageRow]  # sorted by group
    total: UsageRow
    currency: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"by": self.by, "period": self.period.to_dict(), "currency": self.currency,
                "rows": [asdict(r) for r in self.rows], "total": asdict(self.total)}


class _Cols:
    """One group's per-record values as one interleaved column of C doubles (``vals``, NCOL per record).

    Each record is read once, in ledger order, and its numbers copied into contiguous memory with one ``extend``;
    every sum is then one math.fsum over a strided slice (exact reconciliation). Grouping references instead
    (lists of records, re-read per quantity) made a million-record report several times slower: the records of
    one group lie scattered in memory.
    """

    __slots__ = ("vals", "co2", "wait", "jobs", "unmeasured", "ids")

    def __init__(self) -> None:
        self.vals = array("d")
        self.co2, self.wait = array("d"), array("d")
        self.jobs = self.unmeasured = 0
        self.ids: set[str] = set()  # by node only: a job on several GPUs of a node is one job there


# Column order in _Cols.vals. hbm_w/hbm_s are 0 where HBM is not reported (adding 0 leaves an fsum exact).
ALLOC, ACTIVE, ENERGY, HBM_W, HBM_S, PRICED, NCOL = range(7)


# Group key of a (record, usage) unit; usage is the per-GPU record when grouping by node. Inline conditionals:
# this runs once per record.
_KEYS: dict[str, Callable[[Any, JobUsage | None], str]] = {
    "account": lambda r, u: r.account if r is not None and r.account else "(unknown)",
    "user": lambda r, u: r.user if r is not None and r.user else "(unknown)",
    "partition": lambda r, u: r.partition if r is not None and r.partition else "(unknown)",
    "model": lambda r, u: u.model if u is not None and u.model else (r.gpu_model if r is not None and r.gpu_model else "(unknown)"),
    "node": lambda r, u: u.host if u is not None else (r.hosts[0] if r is not None and len(r.hosts) == 1 else "(unknown)"),
}


def usage_report(
    entries: Iterable[LedgerEntry],
    by: str = "account",
    period: Period = ALL_TIME,
    settings: ReportSettings | None = None,
    per_gpu: Mapping[str, Sequence[JobUsage]] | None = None,
) -> UsageReport:
    """Per-group usage of the jobs that ended in ``period`` (see the period rule above).

    ``by="node"`` needs ``per_gpu`` (job id -> its per-GPU usage records) so that a job spanning nodes is split
    by where its GPU-seconds were spent; a job then counts once in each node's job count. Every sum is
    ``math.fsum`` over the job (or per-GPU) records, so the totals row is exactly the sum of the records.
    Emissions: kWh x the constant factor, or per record kWh x the grid intensity's mean over its interval.
    """
    if by not in GROUP_BY:
        raise ReportError(f"--by {by!r}: expected one of {', '.join(GROUP_BY)}")
    if by == "node" and per_gpu is None:
        raise ReportError("a report by node needs the per-GPU usage records (per_gpu)")
    settings = settings or ReportSettings()
    keyf = _KEYS[by]
    node = by == "node"
    grid = settings.grid
    priced = settings.priced
    prices: dict[str, float] = {}
    groups: dict[str, _Cols] = {}
    tot = _Cols()
    n_jobs = 0
    a, b = period.start, period.end
    for e in entries:
        r, u0 = e.record, e.usage
        t = r.end if r is not None and r.end is not None else (u0.last_ts if u0 is not None else None)  # job_end()
        if t is None or t < a or t >= b:
            continue
        n_jobs += 1
        wait = r.start - r.submit if r is not None and r.start is not None and r.submit is not None else None
        if wait is not None:
            tot.wait.append(wait)
        if u0 is None:
            tot.unmeasured += 1
        if node and u0 is not None:
            # a job counts once per node; its per-GPU records split its numbers among the nodes
            for u in per_gpu.get(e.job_id) or (u0,):  # type: ignore[union-attr]
                c = groups.get(u.host)
                if c is None:
                    c = groups[u.host] = _Cols()
                if e.job_id not in c.ids:
                    c.ids.add(e.job_id)
                    c.jobs += 1
                    if wait is not None:
                        c.wait.append(wait)
                _add(c, r, u, grid, priced, prices, settings)
            continue
        key = keyf(r, u0)
        c = groups.get(key)
        if c is None:
            c = groups[key] = _Cols()
        c.jobs += 1
        if wait is not None:
            c.wait.append(wait)
        if u0 is None:
            c.unmeasured += 1
            continue
        # _add(), inlined for the common path: this runs once per job record
        alloc, energy, d = u0.allocated_gpu_seconds, u0.energy_joules, u0.dram_bw_mean
        if priced:
            model = u0.model or (r.gpu_model if r is not None and r.gpu_model else "")
            price = prices.get(model)
            if price is None:
                price = prices[model] = settings.gpu_hour_price(model)
        c.vals.extend((alloc, u0.sm_active_gpu_seconds, energy, 0.0 if d is None else d * alloc,
                       0.0 if d is None else alloc, alloc * price if priced else 0.0))
        if grid is not None:
            c.co2.append(energy / KWH * grid.mean(u0.first_ts, u0.last_ts) / 1000.0)
    rows = [_usage_row(k, [c], c.jobs, c.wait, c.unmeasured, settings) for k, c in sorted(groups.items())]
    # The totals: one fsum over every record (not a sum of rounded group sums), so they reconcile exactly.
    total = _usage_row(TOTAL, list(groups.values()), n_jobs, tot.wait, tot.unmeasured, settings)
    return UsageReport(by, period, rows, total, settings.currency)


def _add(c: _Cols, r: Any, u: JobUsage, grid: GridIntensity | None, priced: bool, prices: dict[str, float],
         settings: ReportSettings) -> None:
    """Copy one usage record's numbers into the group's columns (inlined in usage_report's common path)."""
    alloc, energy, d = u.allocated_gpu_seconds, u.energy_joules, u.dram_bw_mean
    price = 0.0
    if priced:
        model = u.model or (r.gpu_model if r is not None and r.gpu_model else "")
        price = prices.get(model)  # type: ignore[assignment]
        if price is None:
            price = prices[model] = settings.gpu_hour_price(model)
    c.vals.extend((alloc, u.sm_active_gpu_seconds, energy, 0.0 if d is None else d * alloc, 0.0 if d is None else alloc,
                   alloc * price))
    if grid is not None:
        c.co2.append(energy / KWH * grid.mean(u.first_ts, u.last_ts) / 1000.0)


def _usage_row(key: str, cs: list[_Cols], jobs: int, wait: Sequence[float], unmeasured: int,
               settings: ReportSettings) -> UsageRow:
    def fsum(col: int) -> float:
        return math.fsum(chain.from_iterable(c.vals[col::NCOL] for c in cs))

    alloc_s, active_s, hbm_s, energy_j = fsum(ALLOC), fsum(ACTIVE), fsum(HBM_S), fsum(ENERGY)
    kwh = energy_j / KWH
    if settings.grid is not None:
        co2: float | None = math.fsum(chain.from_iterable(c.co2 for c in cs))
    elif settings.co2e_kg_per_kwh is not None:
        co2 = kwh * settings.co2e_kg_per_kwh
    else:
        co2 = None
    return UsageRow(
        group=key,
        jobs=jobs,
        allocated_gpu_hours=alloc_s / HOUR,
        sm_active_gpu_hours=active_s / HOUR,
        efficiency=active_s / alloc_s if alloc_s > 0 else None,
        hbm_mean=fsum(HBM_W) / hbm_s if hbm_s > 0 else None,
        energy_kwh=kwh,
        co2e_kg=co2,
        cost=fsum(PRICED) / HOUR + kwh * settings.price_per_kwh if settings.priced else None,
        idle_gpu_hours=max(alloc_s - active_s, 0.0) / HOUR,
        queue_wait_mean_h=math.fsum(wait) / len(wait) / HOUR if wait else None,
        queue_wait_jobs=len(wait),
        unmeasured_jobs=unmeasured,
    )


def usage_columns(by: str, currency: str = "") -> list[tuple[str, Callable[[UsageRow], str]]]:
    cost = f"Cost {currency}".rstrip()
    return [
        (by.capitalize(), lambda r: r.group),
        ("Jobs", lambda r: str(r.jobs)),
        ("GPU-h alloc", lambda r: _fmt(r.allocated_gpu_hours, ".2f")),
        ("GPU-h SM-active", lambda r: _fmt(r.sm_active_gpu_hours, ".2f")),
        ("Efficiency", lambda r: _fmt(r.efficiency, ".1%")),
        ("Mean HBM", lambda r: _fmt(r.hbm_mean, ".1%")),
        ("Energy kWh", lambda r: _fmt(r.energy_kwh, ".2f")),
        ("CO2e kg", lambda r: _fmt(r.co2e_kg, ".2f")),
        (cost, lambda r: _fmt(r.cost, ".2f")),
        ("Idle GPU-h", lambda r: _fmt(r.idle_gpu_hours, ".2f")),
        ("Mean wait h", lambda r: _fmt(r.queue_wait_mean_h, ".2f")),
    ]


def usage_report_csv(rep: UsageReport) -> str:
    """One line per group and a final TOTAL line; full float precision (``repr``) so the CSV reconciles too."""
    buf = io.StringIO()
    names = [f.name for f in UsageRow.__dataclass_fields__.values()]  # type: ignore[attr-defined]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([rep.by if n == "group" else n for n in names])
    for r in [*rep.rows, rep.total]:
        w.writerow(["" if (v := getattr(r, n)) is None else repr(v) if isinstance(v, float) else v for n in names])
    return buf.getvalue()


def usage_report_json(rep: UsageReport) -> str:
    return json.dumps(rep.to_dict(), indent=2)


def usage_report_text(rep: UsageReport) -> str:
    title = f"GPU usage by {rep.by}, period {rep.period.label} (jobs counted in the period they ended)"
    return title + "\n\n" + plain_table(usage_columns(rep.by, rep.currency), [*rep.rows, rep.total])


# -- idle jobs ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class IdleRow:
    job_id: str
    user: str
    account: str
    gpus: int
    idle_gpus: int  # GPUs whose mean SM activity was below the threshold
    allocated_gpu_hours: float
    idle_gpu_hours: float  # allocated GPU-hours of those idle GPUs
    idle_share: float
    efficiency: float | None


def idle_jobs(
    entries: Iterable[LedgerEntry],
    per_gpu: Mapping[str, Sequence[JobUsage]] | None = None,
    threshold: float = 0.05,
    min_share: float = 0.5,
) -> list[IdleRow]:
    """Jobs that held GPUs mostly idle, worst (most idle GPU-hours) first.

    A GPU of a job is idle when its mean SM activity over the job is below ``threshold``; a job is listed when
    its idle GPUs hold at least ``min_share`` of its allocated GPU-time. Without per-GPU records the job as a
    whole is judged by its mean SM activity.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ReportError(f"idle threshold {threshold!r} must lie in 0..1")
    out = []
    for e in entries:
        u = e.usage
        if u is None or u.allocated_gpu_seconds <= 0:
            continue
        gpus = (per_gpu or {}).get(e.job_id) or [u]
        idle = [g for g in gpus if (g.sm_active_mean if g.sm_active_mean is not None else _eff(g)) < threshold]
        idle_s = math.fsum(g.allocated_gpu_seconds for g in idle)
        share = idle_s / u.allocated_gpu_seconds
        if idle and share >= min_share:
            n_idle = sum(g.gpus for g in idle)
            out.append(IdleRow(e.job_id, e.user, e.account, u.gpus, n_idle, u.allocated_gpu_seconds / HOUR,
                               idle_s / HOUR, share, u.efficiency))
    out.sort(key=lambda r: (-r.idle_gpu_hours, r.job_id))
    return out


def _eff(u: JobUsage) -> float:
    e = u.efficiency
    return 0.0 if e is None else e


IDLE_COLUMNS: list[tuple[str, Callable[[IdleRow], str]]] = [
    ("Job", lambda r: r.job_id),
    ("User", lambda r: r.user),
    ("Account", lambda r: r.account),
    ("GPUs", lambda r: str(r.gpus)),
    ("Idle GPUs", lambda r: str(r.idle_gpus)),
    ("GPU-h alloc", lambda r: _fmt(r.allocated_gpu_hours, ".2f")),
    ("GPU-h idle", lambda r: _fmt(r.idle_gpu_hours, ".2f")),
    ("Idle share", lambda r: _fmt(r.idle_share, ".0%")),
    ("Efficiency", lambda r: _fmt(r.efficiency, ".1%")),
]


# -- privacy in exports ------------------------------------------------------------------------------------------------
def pseudonymize_entries(entries: Iterable[LedgerEntry], alias: Callable[[str], str]) -> list[LedgerEntry]:
    """The same entries with user names replaced by ``alias(user)`` and uids dropped (for every export)."""
    import dataclasses

    out = []
    for e in entries:
        r = e.record
        if r is not None and (r.user is not None or r.uid is not None):
            r = dataclasses.replace(r, user=None if r.user is None else alias(r.user), uid=None)
        out.append(LedgerEntry(e.job_id, r, e.usage))
    return out
