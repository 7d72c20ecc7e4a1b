"""Reconciliation with Slurm: what an auditor signs.

Per account, node and GPU model, over a period:

- ``slurm_gpu_hours``: Slurm-allocated GPU-hours (elapsed x GPUs) of the jobs that ended in the period (the
  period rule of ``report.period``), split over nodes and GPU models as ``report usage`` splits them
  (``report.allocation``: sacct's AllocTRES is the job's total, not per node); a requeued job run by run, each run
  in the period it ended, its allocation over its own hosts and against what was measured in it (the columns
  below likewise),
- ``observed_gpu_hours``: GPU-hours in which an agent saw the job on that node's GPUs,
- ``coverage`` = observed / Slurm-allocated, ``unmeasured_gpu_hours``: a row's share of its jobs' allocated -
  observed (never below 0), so the totals are the jobs' own (``jobs list``, ``report usage``),
- ``out_of_scope_gpu_hours``: GPU-hours an agent observed for the job on that node's GPUs outside Slurm's record
  of it (``accounting.scope``: a host the record does not list, times outside it, a MIG GPU counted twice):
  measured, never charged,
- ``outside_period_gpu_hours``: of the period's jobs' observed + out of scope GPU-hours, those outside the period's
  hours (a job counts whole in the period it ended, so one that started before it brings earlier hours), and
  ``other_periods_gpu_hours``: GPU-hours inside the period's hours of jobs (runs) counted in another period, or in
  none yet (still running), on the rows of their accounts. Both from each GPU's usage records: a record whose samples
  all lie inside or all outside the period's hours counts whole on its side; those crossing an edge of the period
  share what the collector's hour buckets of that GPU hold for jobs in the period's hours less the records lying
  inside, by their sample spans (``scope``'s even spread), so the two columns are exact wherever a GPU has at most
  one crossing record, and their difference always. So, per period, observed + out of scope - outside the period
  + other periods + unattributed = the collector's observed GPU-hours over the period's hours (``collector
  totals``); a note gives the difference where the usage records and the hour buckets disagree,
- on rows of account ``(no job)``: ``unattributed_gpu_hours``, GPU-time the collector observed with no job on the
  GPU, and ``unattributed_energy_kwh``, the energy the collector charged to no job (``gpu_energy``: its hourly
  buckets' energy minus their jobs' energy, exact, not estimated) less the gap energy that Slurm's records
  reassign to jobs (``accounting.gaps``). Both over the period's hour buckets (``ledger_store.hour_span``: from
  the one holding its start up to, not including, the one holding its end). A physical GPU counts
  once: a MIG GPU's instances are summed with its whole-GPU key (the instances' GPU-seconds are slice fractions,
  the whole-GPU key carries the physical GPU's observed time and energy),
- ``reassigned_energy_kwh``: on a job's account row, the gap energy Slurm's record reassigned to it on that node
  and GPU, the part of each gap's time inside the period's hour buckets (the collector spreads a gap's energy over its
  hours evenly); never more than that GPU's unattributed energy in the period. Reassigned + still unattributed
  = the collector's unattributed energy,
- ``counter_anomalies``: energy-counter intervals not trusted (steps back, implausible jumps), per physical GPU
  from the collector's hourly buckets; None only when the collector's per-GPU energy was not given.

A GPU model is the measured one; a Slurm GRES type joins the measured model it names (``charge.gres_names``:
``nvidia_h200`` names ``NVIDIA H200``), else, on a node, the measured model no type of the job names (a node that
misnames its GPU), else stands as it is; an untyped allocation joins the node's measured models.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any

from gpuledger.accounting.charge import allocation
from gpuledger.accounting.gaps import GapAttribution
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.allocation import allocation_cells
from gpuledger.accounting.report.period import (
    ALL_TIME,
    Period,
    not_ended_note,
    run_parts,
)
from gpuledger.accounting.report.tables import exact_csv, fmt_optional, plain_table
from gpuledger.accounting.report.units import JOULES_PER_KWH, SECONDS_PER_HOUR
from gpuledger.collector.ledger_store import hour_span
from gpuledger.schema.records import split_gpu_id

NO_JOB = "(no job)"
TOTAL = "TOTAL"


@dataclass(frozen=True, slots=True)
class ReconcileRow:
    account: str
    node: str
    model: str
    jobs: int
    slurm_gpu_hours: float
    observed_gpu_hours: float
    coverage: float | None
    unmeasured_gpu_hours: float
    out_of_scope_gpu_hours: float
    unattributed_gpu_hours: float
    unattributed_energy_kwh: float | None  # None without the collector's per-GPU energy
    reassigned_energy_kwh: float = 0.0
    counter_anomalies: int | None = None
    outside_period_gpu_hours: float = 0.0  # of the period's jobs' observed + out of scope, outside its hours
    other_periods_gpu_hours: float = 0.0  # inside the period's hours, of jobs counted in another period or none


@dataclass(frozen=True, slots=True)
class Reconciliation:
    period: Period
    rows: list[ReconcileRow]
    total: ReconcileRow
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"period": self.period.to_dict(), "rows": [asdict(r) for r in self.rows], "total": asdict(self.total),
                "notes": list(self.notes)}


class _Acc:
    __slots__ = ("jobs", "slurm", "observed", "unmeasured", "cut", "outside", "other", "idle", "idle_j", "gap_j",
                 "anomalies")

    def __init__(self) -> None:
        self.jobs: set[tuple[str, str]] = set()
        self.slurm: list[float] = []
        self.observed: list[float] = []
        self.unmeasured: list[float] = []
        self.cut: list[float] = []  # out of scope
        self.outside: list[float] = []  # the period's jobs' GPU-seconds outside its hours
        self.other: list[float] = []  # other jobs' GPU-seconds inside its hours
        self.idle: list[float] = []
        self.idle_j: list[float] = []
        self.gap_j: list[float] = []
        self.anomalies: list[int] | None = None


def reconcile(entries: Iterable[LedgerEntry], gpu_hours: Iterable[Mapping[str, Any]], period: Period = ALL_TIME,
              now: float | None = None, gpu_energy: Iterable[Mapping[str, Any]] | None = None,
              gaps: GapAttribution | None = None) -> Reconciliation:
    """The reconciliation of the ledger's entries with the collector's per-GPU hourly totals over the period:
    ``gpu_hours`` and ``gpu_energy`` of the store, and the store's gaps as ``gaps.reassign`` attributed them."""
    now = time.time() if now is None else now
    entries = list(entries)
    gpu_hours = list(gpu_hours)
    lo, hi = _hours(period)
    acc: dict[tuple[str, str, str], _Acc] = {}
    # every job's usage records that may hold GPU-seconds in the period's hours or belong to its jobs, per GPU
    stored: dict[tuple[str, str], list[_Stored]] = {}

    def cell(account: str, node: str, model: str) -> _Acc:
        a = acc.get((account, node, model))
        if a is None:
            a = acc[(account, node, model)] = _Acc()
        return a

    # a requeued job run by run: each run's allocation on its own hosts against what was measured in it
    for e, counted in (part for whole in entries for part in run_parts(whole, period, now)):
        if not counted:  # its records inside the period's hours only (most jobs have none: a cheap look first)
            spans = [(c.usage.first_ts, c.usage.last_ts) for c in e.out_of_scope]
            if e.usage is not None:
                spans.append((e.usage.first_ts, e.usage.last_ts))
            if not any(first < hi and last >= lo for first, last in spans):
                continue
        for r in _stored(e, counted):
            if counted or (r.first < hi and r.last >= lo):
                stored.setdefault((r.host, split_gpu_id(r.gpu)[0]), []).append(r)
        if not counted:
            continue
        account = e.account
        gpus = e.measured
        # observed, per node and model
        observed: dict[tuple[str, str], float] = {}
        for u in gpus:
            key = (u.host, u.model or "(unknown)")
            observed[key] = observed.get(key, 0.0) + u.allocated_gpu_seconds
        # Slurm's allocation per node and model, as `report usage` splits it; its unmeasured part adds up to the
        # job's (allocated - observed, as `jobs list` counts it)
        allocated: dict[tuple[str, str], tuple[float, float]] = {}
        alloc = allocation(e.record, min(now, period.end))
        if alloc:
            seen = e.usage.allocated_gpu_seconds if e.usage is not None else 0.0
            missing = max(0.0, math.fsum(alloc.values()) - seen)
            for (h, m), cell_s in allocation_cells(e.record, alloc, gpus, missing).items():
                allocated[(h, m or "(unknown)")] = cell_s
        for node, model in set(observed) | set(allocated):
            a = cell(account, node, model)
            a.jobs.add(e.key)
            a.observed.append(observed.get((node, model), 0.0))
            if (node, model) in allocated:
                s, short = allocated[(node, model)]
                a.slurm.append(s)
                a.unmeasured.append(short)
        for c in e.out_of_scope:  # measured for the job where Slurm's record does not put it: kept in view
            a = cell(account, c.usage.host, c.usage.model or "(unknown)")
            a.jobs.add(e.key)
            a.cut.append(c.gpu_seconds)
    # per physical GPU (host, uuid): a MIG GPU's instance keys and its whole-GPU key are one GPU
    physical: dict[tuple[str, str], list[float]] = {}  # -> [observed s, job-carrying s]
    models: dict[tuple[str, str], str] = {}  # the whole-GPU key's model, else an instance's
    for g in gpu_hours:
        gpu = (g["host"], g["gpu_uuid"])
        p = physical.setdefault(gpu, [0.0, 0.0])
        p[0] += g["observed_gpu_seconds"]
        p[1] += g["job_gpu_seconds"]
        if g["model"] and (gpu not in models or not g.get("mig")):
            models[gpu] = g["model"]

    def model_of(gpu: tuple[str, str]) -> str:
        return models.get(gpu) or "(unknown)"

    for gpu, (obs, busy) in sorted(physical.items()):
        if obs - busy > 0:
            cell(NO_JOB, gpu[0], model_of(gpu)).idle.append(obs - busy)
    for gpu, records in stored.items():
        held = physical[gpu][1] if gpu in physical else None
        for r, inside in zip(records, _in_hours(records, lo, hi, held), strict=True):
            a = cell(r.account, r.host, r.model)
            if r.counted:
                a.outside.append(r.seconds - inside)
            elif inside > 0:
                a.other.append(inside)
    reassigned = _reassigned_in_period(gaps, period) if gaps is not None else {}
    accounts = {e.key: e.account for e in entries}
    if gpu_energy is not None:
        for g in gpu_energy:
            gpu = (g["host"], g["gpu_uuid"])
            unattributed = max(0.0, g["unattributed_energy_joules"])
            given = reassigned.get(gpu, {})
            # never more than the GPU's unattributed energy in the period's hours
            scale = min(1.0, unattributed / math.fsum(given.values())) if given else 1.0
            for job, joules in sorted(given.items()):
                cell(accounts.get(job, "(unknown)"), gpu[0], model_of(gpu)).gap_j.append(joules * scale)
            if unattributed > 0 or g["counter_anomalies"]:
                idle = cell(NO_JOB, gpu[0], model_of(gpu))
                idle.idle_j.append(max(0.0, unattributed - math.fsum(j * scale for j in given.values())))
                idle.anomalies = (idle.anomalies or []) + [int(g["counter_anomalies"])]
        for a in acc.values():
            a.anomalies = a.anomalies or []
    rows = [_row(k, [a]) for k, a in sorted(acc.items())]
    total = _row((TOTAL, "", ""), list(acc.values()))
    notes: tuple[str, ...] = (
        "multi-node allocations are split evenly over their nodes (by GPU count where every GPU was measured); "
        "each Slurm GPU type goes first to the GPUs measured as the model it names, its unmeasured rest to the "
        "nodes' shortfalls",
        "observed + out of scope - outside the period + other periods + unattributed = the collector's observed "
        "GPU-hours over the period's hours (collector totals); outside the period and other periods split the "
        "usage records crossing the period's edges by their sample spans where one GPU has several",
        "unattributed energy: the collector's energy charged to no job, less gap energy reassigned to the jobs "
        "Slurm says held the node's GPUs (reassigned kWh, on the job's account)")
    collector = math.fsum(obs for obs, _ in physical.values()) / SECONDS_PER_HOUR
    balance = (total.observed_gpu_hours + total.out_of_scope_gpu_hours - total.outside_period_gpu_hours
               + total.other_periods_gpu_hours + total.unattributed_gpu_hours)
    if abs(balance - collector) > 1e-9 * max(1.0, collector):
        notes += (f"observed + out of scope - outside the period + other periods + unattributed is {balance:.6f} "
                  f"GPU-h, the collector's observed GPU-hours over the period's hours {collector:.6f}: usage records "
                  "and hour buckets disagree (records of GPUs or hours the collector's buckets do not hold, or more "
                  "job time in a GPU's buckets than it observed)",)
    if (unended := not_ended_note(entries, period, now)) is not None:
        notes += (unended,)
    if gpu_energy is None:
        notes += ("no per-GPU energy from the collector: energy and counter anomalies left empty",)
    return Reconciliation(period, rows, total, notes)


def _hours(period: Period) -> tuple[float, float]:
    """The period's hour buckets as a time range: ``hour_span``'s, unbounded as infinities."""
    first, stop = hour_span(period.start if math.isfinite(period.start) else None,
                            period.end if math.isfinite(period.end) else None)
    return (-math.inf if first is None else first, math.inf if stop is None else stop)


@dataclass(frozen=True, slots=True)
class _Stored:
    """A job's usage record of one GPU as the collector stored it (what ``scope`` charged and what it cut)."""

    account: str
    counted: bool  # the job counts in the period
    host: str
    gpu: str
    model: str
    first: float
    last: float
    seconds: float


def _stored(e: LedgerEntry, counted: bool) -> list[_Stored]:
    """The entry's per-GPU usage records (its job-level one where none were loaded) as stored: the parts ``scope``
    kept and cut of each GPU joined again, their spans and GPU-seconds."""
    parts: dict[tuple[str, str], list[Any]] = {}  # -> [model, first, last, seconds]
    for u, seconds in chain(((u, u.allocated_gpu_seconds) for u in e.measured),
                            ((c.usage, c.gpu_seconds) for c in e.out_of_scope)):
        p = parts.get((u.host, u.gpu_uuid))
        if p is None:
            parts[(u.host, u.gpu_uuid)] = [u.model or "(unknown)", u.first_ts, u.last_ts, [seconds]]
        else:
            p[1], p[2] = min(p[1], u.first_ts), max(p[2], u.last_ts)
            p[3].append(seconds)
    return [_Stored(e.account, counted, h, g, m, first, last, math.fsum(s))
            for (h, g), (m, first, last, s) in parts.items()]


def _in_hours(records: list[_Stored], lo: float, hi: float, busy: float | None) -> list[float]:
    """Each of one physical GPU's usage records' GPU-seconds inside the hour buckets [lo, hi) (a sample's interval
    counts in the bucket holding the sample): whole or none for a record whose samples all lie on one side; the
    records crossing an edge share ``busy`` (the GPU's job-carrying seconds in those buckets, where the collector
    gave them) less the records inside, in proportion to the part of their spans inside, none beyond its own."""
    out = [0.0] * len(records)
    crossing: list[int] = []
    for i, s in enumerate(records):
        if lo <= s.first and s.last < hi:
            out[i] = s.seconds
        elif s.first < hi and s.last >= lo:
            crossing.append(i)
    if not crossing:
        return out
    est = {i: records[i].seconds * (min(records[i].last, hi) - max(records[i].first, lo))
           / (records[i].last - records[i].first) for i in crossing}
    if busy is None:
        for i, x in est.items():
            out[i] = x
        return out
    target = min(max(0.0, busy - math.fsum(out)), math.fsum(records[i].seconds for i in crossing))
    while est:  # in proportion, none beyond its record: the records that would exceed it take all of it
        weight = math.fsum(est.values())
        scale = target / weight if weight > 0 else 0.0
        full = [i for i, x in est.items() if weight <= 0 or x * scale >= records[i].seconds]
        if not full:
            for i, x in est.items():
                out[i] = x * scale
            break
        for i in full:
            out[i] = records[i].seconds
            target -= records[i].seconds
            del est[i]
    return out


def _reassigned_in_period(gaps: GapAttribution, period: Period) -> dict[tuple[str, str], dict[tuple[str, str], float]]:
    """Per physical GPU, per job: reassigned gap energy inside the period's hour buckets (even over each share)."""
    lo, hi = _hours(period)
    out: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
    for s in gaps.shares:
        inside = max(0.0, min(hi, s.end) - max(lo, s.start))
        if inside <= 0 or s.end <= s.start:
            continue
        per_job = out.setdefault((s.host, s.gpu_uuid), {})
        job = (s.cluster, s.job_id)
        per_job[job] = per_job.get(job, 0.0) + s.energy_joules * inside / (s.end - s.start)
    return out


def _row(key: tuple[str, str, str], accs: list[_Acc]) -> ReconcileRow:
    def hours(name: str) -> float:
        return math.fsum(v for a in accs for v in getattr(a, name)) / SECONDS_PER_HOUR

    slurm, observed = hours("slurm"), hours("observed")
    anomalies = [a.anomalies for a in accs]
    known = not any(x is None for x in anomalies)  # the collector's per-GPU energy was given
    return ReconcileRow(
        account=key[0], node=key[1], model=key[2], jobs=len(set().union(*(a.jobs for a in accs))) if accs else 0,
        slurm_gpu_hours=slurm, observed_gpu_hours=observed, coverage=observed / slurm if slurm > 0 else None,
        unmeasured_gpu_hours=hours("unmeasured"), out_of_scope_gpu_hours=hours("cut"),
        outside_period_gpu_hours=hours("outside"), other_periods_gpu_hours=hours("other"),
        unattributed_gpu_hours=hours("idle"),
        unattributed_energy_kwh=math.fsum(v for a in accs for v in a.idle_j) / JOULES_PER_KWH if known else None,
        reassigned_energy_kwh=math.fsum(v for a in accs for v in a.gap_j) / JOULES_PER_KWH,
        counter_anomalies=sum(sum(x or ()) for x in anomalies) if known else None,
    )


RECONCILE_COLUMNS: list[tuple[str, Callable[[ReconcileRow], str]]] = [
    ("Account", lambda r: r.account),
    ("Node", lambda r: r.node),
    ("Model", lambda r: r.model),
    ("Jobs", lambda r: str(r.jobs)),
    ("Slurm GPU-h", lambda r: fmt_optional(r.slurm_gpu_hours, ".3f")),
    ("Observed GPU-h", lambda r: fmt_optional(r.observed_gpu_hours, ".3f")),
    ("Coverage", lambda r: fmt_optional(r.coverage, ".1%")),
    ("Unmeasured GPU-h", lambda r: fmt_optional(r.unmeasured_gpu_hours, ".3f")),
    ("Out of scope GPU-h", lambda r: fmt_optional(r.out_of_scope_gpu_hours, ".3f")),
    ("Outside period GPU-h", lambda r: fmt_optional(r.outside_period_gpu_hours, ".3f")),
    ("Other periods GPU-h", lambda r: fmt_optional(r.other_periods_gpu_hours, ".3f")),
    ("Unattributed GPU-h", lambda r: fmt_optional(r.unattributed_gpu_hours, ".3f")),
    ("Unattributed kWh", lambda r: fmt_optional(r.unattributed_energy_kwh, ".3f")),
    ("Gap kWh to jobs", lambda r: fmt_optional(r.reassigned_energy_kwh, ".3f")),
    ("Counter anomalies", lambda r: "-" if r.counter_anomalies is None else str(r.counter_anomalies)),
]


def reconcile_csv(rec: Reconciliation) -> str:
    """One line per row and a final TOTAL line, floats at full precision (``repr``)."""
    return exact_csv([*rec.rows, rec.total])


def reconcile_json(rec: Reconciliation) -> str:
    return json.dumps(rec.to_dict(), indent=2)


def reconcile_text(rec: Reconciliation) -> str:
    title = f"Reconciliation with Slurm, period {rec.period.label}"
    return (title + "\n\n" + plain_table(RECONCILE_COLUMNS, [*rec.rows, rec.total]) + "\n"
            + "\n".join(f"note: {n}" for n in rec.notes) + "\n")
