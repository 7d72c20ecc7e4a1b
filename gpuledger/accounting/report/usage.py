"""The usage report over a period, grouped by account, user, partition, GPU model or node (issue 6).

Jobs are selected by the period rule (``report.period``; a requeued job's runs each in the period it ended, each
with its own allocation, unmeasured time and prices, the job counted once in a period). Every grouping reads a
job's per-GPU usage records and its Slurm allocation per node and model (``report.allocation``), so every grouping
has the same totals; the cost covers every allocated GPU-hour, measured or not, and never more than Slurm
allocated (``billed_gpu_hours``).
Every sum is ``math.fsum`` over those records, so the totals row is exactly the sum of the records.
"""

from __future__ import annotations

import json
import math
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import chain
from typing import Any

from gpuledger.accounting.charge import allocation, bounded_weight
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.allocation import allocation_cells
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.grid import GridIntensity
from gpuledger.accounting.report.period import ALL_TIME, Period, job_end, run_parts
from gpuledger.accounting.report.settings import ReportSettings
from gpuledger.accounting.report.tables import exact_csv, fmt_optional, plain_table
from gpuledger.accounting.report.units import JOULES_PER_KWH, SECONDS_PER_HOUR
from gpuledger.schema.records import JobUsage

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
    # the GPU-hours the cost prices: observed, at most Slurm's allocation of the job, plus the unmeasured ones
    billed_gpu_hours: float = 0.0


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

    __slots__ = ("values", "co2e_kg", "waits", "jobs", "unmeasured")

    def __init__(self) -> None:
        self.values = array("d")
        self.co2e_kg, self.waits = array("d"), array("d")
        self.jobs = self.unmeasured = 0


# Column order in _GroupColumns.values. HBM_WEIGHTED and HBM_SECONDS are 0 where HBM is not reported (adding 0
# leaves an fsum exact). A job's per-GPU usage records carry the measured columns; its Slurm allocation goes on
# records of its own (``report.allocation``: per node and model), with SLURM_S and UNMEASURED_S, the allocated
# GPU-seconds and the part no agent observed, and PRICED_S's and BILLED_S's shares for that unmeasured part, so
# that the rows of every grouping add up to the same totals row. PRICED_S is GPU-seconds x price per GPU-hour;
# BILLED_S the GPU-seconds it prices.
(ALLOCATED_S, ACTIVE_S, ENERGY_J, HBM_WEIGHTED, HBM_SECONDS, PRICED_S, BILLED_S, SLURM_S, UNMEASURED_S,
 N_COLUMNS) = range(10)


# Group key of a measured GPU record or an allocation cell of a job: its scheduler (or agent) record, the host and
# the GPU model ("" unknown). Inline conditionals: this runs once per record.
GROUP_KEY: dict[str, Callable[[Any, str, str], str]] = {
    "account": lambda r, h, m: r.account if r is not None and r.account else "(unknown)",
    "user": lambda r, h, m: r.user if r is not None and r.user else "(unknown)",
    "partition": lambda r, h, m: r.partition if r is not None and r.partition else "(unknown)",
    "model": lambda r, h, m: m or (r.gpu_model if r is not None and r.gpu_model else "(unknown)"),
    "node": lambda r, h, m: h,
}
_SPLIT = ("model", "node")  # the groupings whose key follows a job's GPUs rather than its record


def usage_report(
    entries: Iterable[LedgerEntry],
    by: str = "account",
    period: Period = ALL_TIME,
    settings: ReportSettings | None = None,
    per_gpu: Mapping[str, Sequence[JobUsage]] | None = None,
    now: float | None = None,
) -> UsageReport:
    """Per-group usage of the jobs that ended in ``period`` (the period rule of ``report.period``: a job still
    running counts at ``now``, default the clock, with its allocation so far, so only in a period not over yet).

    Every grouping reads a job's per-GPU usage records (the entry's, else ``per_gpu``'s by job id, else its
    job-level record) and its Slurm allocation split per node and model (``report.allocation``), so a job on
    several nodes or GPU models is split by where and on what its GPU-seconds were spent; it then counts once in
    each group it touched (the job counts of the rows may add up to more than the totals row's; every GPU-hour,
    energy and cost column adds up, to the same totals in every grouping). ``by="node"`` needs ``per_gpu``.
    A GPU-hour costs its model's price as fairshare weighs it (``charge.bounded_weight``: Slurm's typed gres over
    a name the node gives), allocated GPU-hours no agent observed included (:func:`_unmeasured_price`). A job
    Slurm allocated GPUs to is billed its observed GPU-hours up to that allocation (observed beyond it, within the
    scope's slack or by clock skew, is scaled down across its GPUs), plus the unmeasured ones: its Slurm
    GPU-hours exactly. Every sum is ``math.fsum`` over the records, so the totals row is exactly the sum of the
    records. A price table without ``default`` that prices none of the models met is refused (ReportError
    naming the model and a job): a bill that leaves GPU-hours out is never made silently.
    Emissions: kWh x the constant factor, or per record kWh x the grid intensity's mean over its interval.
    """
    if by not in GROUP_BY:
        raise ReportError(f"--by {by!r}: expected one of {', '.join(GROUP_BY)}")
    if by == "node" and per_gpu is None:
        raise ReportError("a report by node needs the per-GPU usage records (per_gpu)")
    settings = settings or ReportSettings()
    entries = entries if isinstance(entries, Sequence) else list(entries)
    group_key = GROUP_KEY[by]
    split = by in _SPLIT
    grid = settings.grid
    priced = settings.priced
    prices: dict[str, float] = {}  # by measured model
    slurm_prices: dict[str, float] = {}  # by Slurm's name for the GPU (a gres type)
    unpriced: dict[str, str] = {}  # a model no price covers -> the first job it was met on
    node_models: dict[str, str] | None = None

    def price_of(model: str, gres: bool = False) -> float:
        cache = slurm_prices if gres else prices
        known = cache.get(model)
        if known is None:
            price = settings.gpu_hour_price(model, gres)
            if price is None:
                unpriced.setdefault(model, entry.label)
                price = 0.0  # refused below
            known = cache[model] = price
        return known

    def node_model(host: str) -> str | None:
        nonlocal node_models
        if node_models is None:  # only for unmeasured GPU-time: one pass over the report's GPU records
            node_models = _node_models(entries, per_gpu)
        return node_models.get(host)

    groups: dict[str, _GroupColumns] = {}
    everything = _GroupColumns()
    n_jobs = 0
    start, end = period.start, period.end
    now = time.time() if now is None else now
    alloc_now = min(end, now)  # a running job's allocation so far
    for entry in entries:
        if entry.record is not None and entry.record.earlier_runs:
            # requeued: each run counts in the period it ended (report.period), each with its own allocation,
            # unmeasured time and prices (one part per run)
            if not entry.gpus and per_gpu is not None and per_gpu.get(entry.job_id):
                entry = replace(entry, gpus=tuple(per_gpu[entry.job_id]))
            parts: Sequence[LedgerEntry] = [part for part, counted in run_parts(entry, period, now) if counted]
            if not parts:
                continue
        else:
            ended = job_end(entry, now)
            if ended is None or ended < start or ended >= end:
                continue
            parts = (entry,)
        # the job counts once: its queue wait (a requeued job's latest run's, whose submission alone is kept)
        record, timing = entry.described, parts[-1].described
        n_jobs += 1
        wait = (timing.start - timing.submit
                if timing is not None and timing.start is not None and timing.submit is not None else None)
        unmeasured = parts[0].usage is None if len(parts) == 1 else all(p.usage is None for p in parts)
        if wait is not None:
            everything.waits.append(wait)
        if unmeasured:
            everything.unmeasured += 1
        if split:
            touched: set[str] = set()  # the groups the job counts in, by node or model
        else:
            # the job's one group (inlined: this runs once per job record)
            key = group_key(record, "", "")
            found = groups.get(key)
            cols = found if found is not None else groups.setdefault(key, _GroupColumns())
            cols.jobs += 1
            if wait is not None:
                cols.waits.append(wait)
            if unmeasured:
                cols.unmeasured += 1
        for part in parts:
            usage = part.usage
            # charge.allocation(), inlined for a finished job without TRES (this runs once per job record)
            slurm_rec = part.record
            if (slurm_rec is not None and slurm_rec.start is not None and slurm_rec.end is not None
                    and not slurm_rec.tres and not slurm_rec.earlier_runs):
                slurm_s = max(0.0, min(slurm_rec.end, alloc_now) - slurm_rec.start) * (slurm_rec.gpus or 0)
                alloc: dict[str, float] | None = ({slurm_rec.gpu_model or "": slurm_s} if (slurm_rec.gpus or 0) > 0
                                                  else {})
            else:
                alloc = allocation(slurm_rec, alloc_now)
                slurm_s = math.fsum(alloc.values()) if alloc else 0.0
            observed = usage.allocated_gpu_seconds if usage is not None else 0.0
            missing = max(0.0, slurm_s - observed)
            # never more GPU-time than Slurm allocated the job (a job it gave no GPUs is billed as measured)
            scale = slurm_s / observed if 0.0 < slurm_s < observed else 1.0
            # the entry's own per-GPU records where the ledger joined them (its job, its cluster; held to the
            # scheduler's record: ``scope``), else those given by job id
            gpu_usages = ((part.gpus or (per_gpu.get(part.job_id) if per_gpu is not None else None) or (usage,))
                          if usage is not None else ())
            if part.gap_shares:
                _add_gap_energy(groups, part, gpu_usages, group_key, grid)
            if split:
                _add_split(groups, part, gpu_usages, alloc, slurm_s, missing, scale, wait, unmeasured, touched,
                           group_key, price_of, node_model, settings)
                continue
            typed = alloc is not None and any(alloc)  # Slurm named the job's GPU model: the price rule reads it
            # the job's allocation (and the price of what nobody measured there: per node and model where that
            # could differ) and the GPU-time the cost prices (``scale`` above) ride on its last usage record, or on
            # a record of its own: one record per job mostly
            tail = (0.0, observed, 0.0, 0.0)  # a job Slurm allocated no GPUs: billed as measured
            if slurm_s > 0.0 or not gpu_usages:
                unmeasured_cost = 0.0
                if priced and missing > 0.0:
                    unmeasured_cost = math.fsum(
                        short * _unmeasured_price(host, model, gpu_usages, alloc, typed, price_of, node_model)
                        for (host, model), (_, short) in allocation_cells(slurm_rec, alloc, gpu_usages,
                                                                          missing).items()
                        if short > 0.0)
                tail = (unmeasured_cost, slurm_s if slurm_s > 0.0 else observed, slurm_s, missing)
                if not gpu_usages:
                    cols.values.extend((0.0, 0.0, 0.0, 0.0, 0.0, *tail))
            last = len(gpu_usages) - 1
            for i, u in enumerate(gpu_usages):  # _add_usage() and _price(), inlined for the common path
                alloc_s, energy, dram = u.allocated_gpu_seconds, u.energy_joules, u.dram_bw_mean
                price = 0.0
                if priced:
                    price = (bounded_weight(u.model, alloc, price_of) if typed
                             else prices.get(u.model) or price_of(u.model))
                cost, billed, job_s, job_missing = tail if i == last else (0.0, 0.0, 0.0, 0.0)
                cols.values.extend((alloc_s, u.sm_active_gpu_seconds, energy, 0.0 if dram is None else dram * alloc_s,
                                    0.0 if dram is None else alloc_s, alloc_s * scale * price + cost, billed, job_s,
                                    job_missing))
                if grid is not None:
                    cols.co2e_kg.append(energy / JOULES_PER_KWH * grid.mean(u.first_ts, u.last_ts) / 1000.0)
    if unpriced:
        raise ReportError("report.price_per_gpu_hour has no price for GPU model "
                          + ", ".join(f"{m or '(unknown)'!r} (job {job})" for m, job in sorted(unpriced.items()))
                          + " and no `default`: add its price, or a `default` (0 bills the unlisted models at 0)")
    rows = [_usage_row(k, [cols], cols.jobs, cols.waits, cols.unmeasured, settings)
            for k, cols in sorted(groups.items())]
    # The totals: one fsum over every record (not a sum of rounded group sums), so they reconcile exactly.
    total = _usage_row(TOTAL, list(groups.values()), n_jobs, everything.waits, everything.unmeasured, settings)
    return UsageReport(by, period, rows, total, settings.currency)


PriceOf = Callable[[str, bool], float]  # (model, Slurm's gres type?) -> price per GPU-hour


def _price(model: str, alloc: Mapping[str, float] | None, typed: bool, price_of: PriceOf) -> float:
    """A measured GPU-hour's price on ``model``: fairshare's weight rule (``charge.bounded_weight``) over the
    prices; without a Slurm model to read, the model's own (cached) price, which is what the rule gives."""
    return bounded_weight(model, alloc, price_of) if typed else price_of(model, False)


def _unmeasured_price(host: str, model: str, gpu_usages: Sequence[JobUsage], alloc: Mapping[str, float] | None,
                      typed: bool, price_of: PriceOf, node_model: Callable[[str], str | None]) -> float:
    """The price of GPU-time Slurm allocated on ``host`` that no agent observed (an allocation cell of
    ``report.allocation``, ``model`` as it names it): where the job's GPUs measured that model there, as those
    GPUs; else at the node's measured model where the report's GPU records know it (other jobs measured there),
    held to Slurm's typed gres as a measured GPU (``charge.bounded_weight``: to the cell's own gres type where it
    stands under one, so an hour Slurm allocated as one type is never billed as another's); else at Slurm's name
    for it (its gres type; ``default`` when untyped)."""
    for u in gpu_usages:
        if u.model == model and u.host == host:
            return bounded_weight(model, alloc, price_of) if typed else price_of(model, False)
    node = node_model(host)
    if node is not None:
        return bounded_weight(node, {model: 1.0} if model and alloc and model in alloc else alloc, price_of)
    return price_of(model, bool(model))


def _node_models(entries: Iterable[LedgerEntry], per_gpu: Mapping[str, Sequence[JobUsage]] | None
                 ) -> dict[str, str]:
    """Each node's GPU model as the entries' usage records (as :func:`usage_report` reads them) measured it: the
    model with the most observed GPU-seconds there (ties by name)."""
    seconds: dict[tuple[str, str], float] = {}
    for e in entries:
        job_level = (e.usage,) if e.usage is not None else ()
        for u in e.gpus or (per_gpu.get(e.job_id) if per_gpu is not None else None) or job_level:
            if u.model and u.host != "*":
                seconds[(u.host, u.model)] = seconds.get((u.host, u.model), 0.0) + u.allocated_gpu_seconds
    best: dict[str, tuple[float, str]] = {}
    for (host, model), s in seconds.items():
        if (s, model) > best.get(host, (-1.0, "")):
            best[host] = (s, model)
    return {host: model for host, (_, model) in best.items()}


def _add_usage(cols: _GroupColumns, u: JobUsage, price: float, scale: float, grid: GridIntensity | None) -> None:
    """One measured GPU (or job-level) usage record into a group's columns, its GPU-seconds billed x ``scale``
    (at most the job's Slurm allocation) at ``price`` per GPU-hour."""
    alloc_s, energy, dram = u.allocated_gpu_seconds, u.energy_joules, u.dram_bw_mean
    billed = alloc_s * scale
    cols.values.extend((alloc_s, u.sm_active_gpu_seconds, energy, 0.0 if dram is None else dram * alloc_s,
                        0.0 if dram is None else alloc_s, billed * price, billed, 0.0, 0.0))
    if grid is not None:
        cols.co2e_kg.append(energy / JOULES_PER_KWH * grid.mean(u.first_ts, u.last_ts) / 1000.0)


def _add_split(groups: dict[str, _GroupColumns], entry: LedgerEntry, gpu_usages: Sequence[JobUsage],
               alloc: Mapping[str, float] | None, slurm_s: float, missing: float, scale: float, wait: float | None,
               unmeasured: bool, touched: set[str], group_key: Callable[[Any, str, str], str], price_of: PriceOf,
               node_model: Callable[[str], str | None], settings: ReportSettings) -> None:
    """One job (or one run of a requeued job: its part, ``report.period``) into the groups of its GPUs' nodes or
    models: each usage record where it was measured (billed x ``scale``), and its Slurm allocation (``slurm_s``, of
    it ``missing`` unmeasured) per node and model (``allocation_cells``), the unmeasured part at its price
    (:func:`_unmeasured_price`). The job counts once in every group it touched, measured or only allocated there
    (``touched``: the groups it counts in already; ``wait`` and ``unmeasured``: the job's)."""
    record, priced, typed = entry.described, settings.priced, alloc is not None and any(alloc)

    def group(host: str, model: str) -> _GroupColumns:
        key = group_key(record, host, model)
        cols = groups.get(key)
        if cols is None:
            cols = groups[key] = _GroupColumns()
        if key not in touched:
            touched.add(key)
            cols.jobs += 1
            if wait is not None:
                cols.waits.append(wait)
            if unmeasured:
                cols.unmeasured += 1
        return cols

    for u in gpu_usages:
        _add_usage(group(u.host, u.model), u, _price(u.model, alloc, typed, price_of) if priced else 0.0, scale,
                   settings.grid)
    if slurm_s > 0.0 or not gpu_usages:
        for (host, model), (share, short) in allocation_cells(entry.record, alloc, gpu_usages, missing).items():
            price = (_unmeasured_price(host, model, gpu_usages, alloc, typed, price_of, node_model)
                     if priced and short > 0.0 else 0.0)
            group(host, model).values.extend((0.0, 0.0, 0.0, 0.0, 0.0, short * price, short, share, short))


def _add_gap_energy(groups: dict[str, _GroupColumns], entry: LedgerEntry, gpu_usages: Sequence[JobUsage],
                    group_key: Callable[[Any, str, str], str], grid: GridIntensity | None) -> None:
    """A job's reassigned gap energy (``gaps``) into the group of the gap's host and GPU (its model as measured,
    else the job's), as an energy-only record (no GPU-seconds: nothing observed the gap); the totals row sums the
    groups."""
    models = {(u.host, u.gpu_uuid): u.model for u in gpu_usages}
    fallback = entry.usage.model if entry.usage is not None else ""
    for share in entry.gap_shares:
        key = group_key(entry.described, share.host, models.get((share.host, share.gpu_uuid), fallback))
        cols = groups.setdefault(key, _GroupColumns())
        cols.values.extend((0.0, 0.0, share.energy_joules, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        if grid is not None:
            cols.co2e_kg.append(share.energy_joules / JOULES_PER_KWH * grid.mean(share.start, share.end) / 1000.0)


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
        # each node or model holds its share of a job's allocation (report.allocation), so the rows add up here too
        slurm_gpu_hours=fsum(SLURM_S) / SECONDS_PER_HOUR,
        unmeasured_gpu_hours=fsum(UNMEASURED_S) / SECONDS_PER_HOUR,
        billed_gpu_hours=fsum(BILLED_S) / SECONDS_PER_HOUR,
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
        ("Billed GPU-h", lambda r: fmt_optional(r.billed_gpu_hours, ".2f")),
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
