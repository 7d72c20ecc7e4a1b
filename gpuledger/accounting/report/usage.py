"""The usage report over a period, grouped by account, user, partition, GPU model or node (issue 6).

Jobs are selected by the period rule (``report.period``). Every sum is ``math.fsum`` over the job (or per-GPU)
records, so the totals row is exactly the sum of the records.
"""

from __future__ import annotations

import json
import math
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

from gpuledger.accounting.charge import allocated_gpu_seconds, physical_gpus
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.grid import GridIntensity
from gpuledger.accounting.report.period import ALL_TIME, Period
from gpuledger.accounting.report.settings import ReportSettings
from gpuledger.accounting.report.tables import exact_csv, fmt_optional, plain_table
from gpuledger.accounting.report.units import JOULES_PER_KWH, SECONDS_PER_HOUR
from gpuledger.schema.records import JobRecord, JobUsage

GROUP_BY: tuple[str, ...] = ("account", "user", "partition", "model", "node")
TOTAL = "TOTAL"


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
    slurm_gpu_hours: float = 0.0  # Slurm-allocated GPU-hours (elapsed x GPUs) of the jobs Slurm knows
    unmeasured_gpu_hours: float = 0.0  # of those, allocated GPU-hours no agent observed (charged by the rule)


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


class _GroupColumns:
    """One group's per-record values as one interleaved column of C doubles (``values``, N_COLUMNS per record).

    Each record is read once, in ledger order, and its numbers copied into contiguous memory with one ``extend``;
    every sum is then one math.fsum over a strided slice (exact reconciliation). Grouping references instead
    (lists of records, re-read per quantity) made a million-record report several times slower: the records of
    one group lie scattered in memory.
    """

    __slots__ = ("values", "co2e_kg", "waits", "jobs", "unmeasured", "job_keys")

    def __init__(self) -> None:
        self.values = array("d")
        self.co2e_kg, self.waits = array("d"), array("d")
        self.jobs = self.unmeasured = 0
        self.job_keys: set[tuple[str, str]] = set()  # by node only: a job on several GPUs of a node is one job there


# Column order in _GroupColumns.values. HBM_WEIGHTED and HBM_SECONDS are 0 where HBM is not reported (adding 0
# leaves an fsum exact).
# SLURM_S and UNMEASURED_S: Slurm-allocated GPU-seconds of the job and the part no agent observed (0 for a job
# without a scheduler record). By node they are the node's share of the job's allocation, on a record of their own
# (0 on the per-GPU usage records), so that the node rows add up to the totals row (see _node_allocation).
ALLOCATED_S, ACTIVE_S, ENERGY_J, HBM_WEIGHTED, HBM_SECONDS, PRICED_S, SLURM_S, UNMEASURED_S, N_COLUMNS = range(9)


# Group key of a (record, usage) unit; usage is the per-GPU record when grouping by node. Inline conditionals:
# this runs once per record.
GROUP_KEY: dict[str, Callable[[Any, JobUsage | None], str]] = {
    "account": lambda r, u: r.account if r is not None and r.account else "(unknown)",
    "user": lambda r, u: r.user if r is not None and r.user else "(unknown)",
    "partition": lambda r, u: r.partition if r is not None and r.partition else "(unknown)",
    "model": lambda r, u: (u.model if u is not None and u.model
                           else r.gpu_model if r is not None and r.gpu_model else "(unknown)"),
    "node": lambda r, u: (u.host if u is not None
                          else r.hosts[0] if r is not None and len(r.hosts) == 1 else "(unknown)"),
}


def usage_report(
    entries: Iterable[LedgerEntry],
    by: str = "account",
    period: Period = ALL_TIME,
    settings: ReportSettings | None = None,
    per_gpu: Mapping[str, Sequence[JobUsage]] | None = None,
) -> UsageReport:
    """Per-group usage of the jobs that ended in ``period`` (the period rule of ``report.period``).

    ``by="node"`` needs ``per_gpu`` (job id -> its per-GPU usage records) so that a job spanning nodes is split
    by where its GPU-seconds were spent, and its Slurm allocation over the nodes Slurm lists (``_node_allocation``);
    a job then counts once in each node's job count (so the job counts of the node rows may add up to more than
    the totals row's; every GPU-hour, energy and cost column adds up). Every sum is ``math.fsum`` over the job (or
    per-GPU) records, so the totals row is exactly the sum of the records.
    Emissions: kWh x the constant factor, or per record kWh x the grid intensity's mean over its interval.
    """
    if by not in GROUP_BY:
        raise ReportError(f"--by {by!r}: expected one of {', '.join(GROUP_BY)}")
    if by == "node" and per_gpu is None:
        raise ReportError("a report by node needs the per-GPU usage records (per_gpu)")
    settings = settings or ReportSettings()
    group_key = GROUP_KEY[by]
    grid = settings.grid
    priced = settings.priced
    prices: dict[str, float] = {}
    groups: dict[str, _GroupColumns] = {}
    everything = _GroupColumns()
    n_jobs = 0
    start, end = period.start, period.end
    alloc_now = min(end, time.time())  # a running job's allocation so far
    for entry in entries:
        record, usage = entry.described, entry.usage
        # period.job_end(), inlined: this runs once per job record
        ended = record.end if record is not None and record.end is not None else (
            usage.last_ts if usage is not None else None)
        if ended is None or ended < start or ended >= end:
            continue
        n_jobs += 1
        if entry.gap_shares:
            _add_gap_energy(groups, entry, group_key(record, usage), by == "node", grid)
        wait = (record.start - record.submit
                if record is not None and record.start is not None and record.submit is not None else None)
        if wait is not None:
            everything.waits.append(wait)
        if usage is None:
            everything.unmeasured += 1
        # charge.allocated_gpu_seconds(), inlined for a finished job (this runs once per job record)
        slurm_rec = entry.record
        if slurm_rec is None or slurm_rec.start is None:
            slurm_s = 0.0
        elif slurm_rec.end is not None and not slurm_rec.tres:
            slurm_s = max(0.0, min(slurm_rec.end, alloc_now) - slurm_rec.start) * (slurm_rec.gpus or 0)
        else:
            slurm_s = allocated_gpu_seconds(slurm_rec, alloc_now) or 0.0
        missing = slurm_s - usage.allocated_gpu_seconds if usage is not None else slurm_s
        if missing < 0.0:
            missing = 0.0
        if per_gpu is not None and by == "node":
            # the entry's own per-GPU records where the ledger joined them (its job, its cluster; held to the
            # scheduler's record: ``scope``), else those given by job id
            gpu_usages = (entry.gpus or per_gpu.get(entry.job_id) or (usage,)) if usage is not None else ()
            _add_by_node(groups, entry, gpu_usages, wait, slurm_s, missing, grid, priced, prices, settings)
            continue
        key = group_key(record, usage)
        cols = groups.get(key)
        if cols is None:
            cols = groups[key] = _GroupColumns()
        cols.jobs += 1
        if wait is not None:
            cols.waits.append(wait)
        if usage is None:
            cols.unmeasured += 1
            if slurm_s:
                cols.values.extend((0.0, 0.0, 0.0, 0.0, 0.0, 0.0, slurm_s, missing))
            continue
        # _add_usage(), inlined for the common path: this runs once per job record
        alloc, energy, dram = usage.allocated_gpu_seconds, usage.energy_joules, usage.dram_bw_mean
        price = 0.0
        if priced:
            model = usage.model or (record.gpu_model if record is not None and record.gpu_model else "")
            known = prices.get(model)
            if known is None:
                known = prices[model] = settings.gpu_hour_price(model)
            price = known
        cols.values.extend((alloc, usage.sm_active_gpu_seconds, energy, 0.0 if dram is None else dram * alloc,
                            0.0 if dram is None else alloc, alloc * price if priced else 0.0,
                            slurm_s, missing))
        if grid is not None:
            cols.co2e_kg.append(energy / JOULES_PER_KWH * grid.mean(usage.first_ts, usage.last_ts) / 1000.0)
    rows = [_usage_row(k, [cols], cols.jobs, cols.waits, cols.unmeasured, settings)
            for k, cols in sorted(groups.items())]
    # The totals: one fsum over every record (not a sum of rounded group sums), so they reconcile exactly.
    total = _usage_row(TOTAL, list(groups.values()), n_jobs, everything.waits, everything.unmeasured, settings)
    return UsageReport(by, period, rows, total, settings.currency)


def _add_by_node(groups: dict[str, _GroupColumns], entry: LedgerEntry, gpu_usages: Sequence[JobUsage],
                 wait: float | None, slurm_s: float, missing: float, grid: GridIntensity | None, priced: bool,
                 prices: dict[str, float], settings: ReportSettings) -> None:
    """One job into the node groups: its per-GPU usage records where they were measured, and its Slurm allocation
    (``slurm_s``, of it ``missing`` unmeasured) as ``_node_allocation`` splits it. The job counts once on every node
    it touched, measured or only allocated there."""
    record = entry.described

    def node(host: str) -> _GroupColumns:
        cols = groups.get(host)
        if cols is None:
            cols = groups[host] = _GroupColumns()
        if entry.key not in cols.job_keys:
            cols.job_keys.add(entry.key)
            cols.jobs += 1
            if wait is not None:
                cols.waits.append(wait)
            if not gpu_usages:
                cols.unmeasured += 1
        return cols

    for gpu_usage in gpu_usages:
        _add_usage(node(gpu_usage.host), record, gpu_usage, grid, priced, prices, settings)
    if slurm_s > 0.0 or (not gpu_usages and entry.record is not None):
        for host, (share, short) in _node_allocation(entry.record, gpu_usages, slurm_s, missing).items():
            node(host).values.extend((0.0, 0.0, 0.0, 0.0, 0.0, 0.0, share, short))


def _node_allocation(record: JobRecord | None, gpu_usages: Sequence[JobUsage], slurm_s: float,
                     missing: float) -> dict[str, tuple[float, float]]:
    """A job's Slurm allocation per node: host -> (allocated, unmeasured) GPU-seconds; they add up to ``slurm_s``
    and ``missing``, the job's own figures, as in every other grouping.

    sacct's AllocTRES is the job's total, so it is split over the nodes its record lists (else the nodes the agents
    measured it on, else "(unknown)") evenly, as ``report reconcile`` splits it, unless the agents saw every one of
    those nodes' GPUs: then by their GPU count (``--gpus=3`` over 2 nodes is 2 + 1). A node's unmeasured part is its
    shortfall (its share less what the agents observed there), scaled so that they add up to the job's unmeasured
    GPU-seconds: a node observed beyond its even share does not make another node's shortfall count twice."""
    hosts = tuple(dict.fromkeys(record.hosts if record is not None else ())) or tuple(
        dict.fromkeys(u.host for u in gpu_usages)) or ("(unknown)",)
    observed: dict[str, float] = {}
    gpus: dict[str, set[str]] = {}
    for u in gpu_usages:
        observed[u.host] = observed.get(u.host, 0.0) + u.allocated_gpu_seconds
        gpus.setdefault(u.host, set()).add(u.gpu_uuid)
    n_seen = sum(len(g) for g in gpus.values())
    # "*": a job-level record (no per-GPU records loaded) says nothing of the GPUs per node
    if (len(hosts) > 1 and record is not None and set(gpus) == set(hosts) and all("*" not in g for g in gpus.values())
            and n_seen == physical_gpus(record)):
        shares = {h: slurm_s * len(gpus[h]) / n_seen for h in hosts}
    else:
        shares = {h: slurm_s / len(hosts) for h in hosts}
    short = {h: max(0.0, s - observed.get(h, 0.0)) for h, s in shares.items()}
    total_short = math.fsum(short.values())
    if total_short != missing:
        scale = missing / total_short if total_short > 0.0 else 0.0
        short = {h: v * scale for h, v in short.items()}
    return {h: (shares[h], short[h]) for h in hosts}


def _add_gap_energy(groups: dict[str, _GroupColumns], entry: LedgerEntry, key: str, by_node: bool,
                    grid: GridIntensity | None) -> None:
    """A job's reassigned gap energy (``gaps``) into its group (by node: the gap's host), as an energy-only
    record (no GPU-seconds: nothing observed the gap); the totals row sums the groups."""
    for share in entry.gap_shares:
        cols = groups.setdefault(share.host if by_node else key, _GroupColumns())
        cols.values.extend((0.0, 0.0, share.energy_joules, 0.0, 0.0, 0.0, 0.0, 0.0))
        if grid is not None:
            cols.co2e_kg.append(share.energy_joules / JOULES_PER_KWH * grid.mean(share.start, share.end) / 1000.0)


def _add_usage(cols: _GroupColumns, record: Any, usage: JobUsage, grid: GridIntensity | None, priced: bool,
               prices: dict[str, float], settings: ReportSettings) -> None:
    """Copy one usage record's numbers into the group's columns (inlined in usage_report's common path)."""
    alloc, energy, dram = usage.allocated_gpu_seconds, usage.energy_joules, usage.dram_bw_mean
    price = 0.0
    if priced:
        model = usage.model or (record.gpu_model if record is not None and record.gpu_model else "")
        known = prices.get(model)
        if known is None:
            known = prices[model] = settings.gpu_hour_price(model)
        price = known
    cols.values.extend((alloc, usage.sm_active_gpu_seconds, energy, 0.0 if dram is None else dram * alloc,
                        0.0 if dram is None else alloc, alloc * price, 0.0, 0.0))
    if grid is not None:
        cols.co2e_kg.append(energy / JOULES_PER_KWH * grid.mean(usage.first_ts, usage.last_ts) / 1000.0)


def _usage_row(key: str, groups: list[_GroupColumns], jobs: int, waits: Sequence[float], unmeasured: int,
               settings: ReportSettings) -> UsageRow:
    def fsum(column: int) -> float:
        return math.fsum(chain.from_iterable(g.values[column::N_COLUMNS] for g in groups))

    alloc_s, active_s, hbm_s, energy_j = fsum(ALLOCATED_S), fsum(ACTIVE_S), fsum(HBM_SECONDS), fsum(ENERGY_J)
    kwh = energy_j / JOULES_PER_KWH
    if settings.grid is not None:
        co2: float | None = math.fsum(chain.from_iterable(g.co2e_kg for g in groups))
    elif settings.co2e_kg_per_kwh is not None:
        co2 = kwh * settings.co2e_kg_per_kwh
    else:
        co2 = None
    return UsageRow(
        group=key,
        jobs=jobs,
        allocated_gpu_hours=alloc_s / SECONDS_PER_HOUR,
        sm_active_gpu_hours=active_s / SECONDS_PER_HOUR,
        efficiency=active_s / alloc_s if alloc_s > 0 else None,
        hbm_mean=fsum(HBM_WEIGHTED) / hbm_s if hbm_s > 0 else None,
        energy_kwh=kwh,
        co2e_kg=co2,
        cost=fsum(PRICED_S) / SECONDS_PER_HOUR + kwh * settings.price_per_kwh if settings.priced else None,
        idle_gpu_hours=max(alloc_s - active_s, 0.0) / SECONDS_PER_HOUR,
        queue_wait_mean_h=math.fsum(waits) / len(waits) / SECONDS_PER_HOUR if waits else None,
        queue_wait_jobs=len(waits),
        unmeasured_jobs=unmeasured,
        # by node each node holds its share of a job's allocation (_node_allocation), so the rows add up here too
        slurm_gpu_hours=fsum(SLURM_S) / SECONDS_PER_HOUR,
        unmeasured_gpu_hours=fsum(UNMEASURED_S) / SECONDS_PER_HOUR,
    )


def usage_columns(by: str, currency: str = "") -> list[tuple[str, Callable[[UsageRow], str]]]:
    cost = f"Cost {currency}".rstrip()
    return [
        (by.capitalize(), lambda r: r.group),
        ("Jobs", lambda r: str(r.jobs)),
        ("GPU-h alloc", lambda r: fmt_optional(r.allocated_gpu_hours, ".2f")),
        ("GPU-h SM-active", lambda r: fmt_optional(r.sm_active_gpu_hours, ".2f")),
        ("Efficiency", lambda r: fmt_optional(r.efficiency, ".1%")),
        ("Mean HBM", lambda r: fmt_optional(r.hbm_mean, ".1%")),
        ("Energy kWh", lambda r: fmt_optional(r.energy_kwh, ".2f")),
        ("CO2e kg", lambda r: fmt_optional(r.co2e_kg, ".2f")),
        (cost, lambda r: fmt_optional(r.cost, ".2f")),
        ("Idle GPU-h", lambda r: fmt_optional(r.idle_gpu_hours, ".2f")),
        ("Slurm GPU-h", lambda r: fmt_optional(r.slurm_gpu_hours, ".2f")),
        ("Unmeasured GPU-h", lambda r: fmt_optional(r.unmeasured_gpu_hours, ".2f")),
        ("Mean wait h", lambda r: fmt_optional(r.queue_wait_mean_h, ".2f")),
    ]


def usage_report_csv(rep: UsageReport) -> str:
    """One line per group and a final TOTAL line; full float precision (``repr``) so the CSV reconciles too."""
    return exact_csv([*rep.rows, rep.total], {"group": rep.by})


def usage_report_json(rep: UsageReport) -> str:
    return json.dumps(rep.to_dict(), indent=2)


def usage_report_text(rep: UsageReport) -> str:
    title = f"GPU usage by {rep.by}, period {rep.period.label} (jobs counted in the period they ended)"
    return title + "\n\n" + plain_table(usage_columns(rep.by, rep.currency), [*rep.rows, rep.total])
