"""Reconciliation with Slurm: what an auditor signs.

Per account, node and GPU model, over a period:

- ``slurm_gpu_hours``: Slurm-allocated GPU-hours (elapsed x GPUs) of the jobs that ended in the period (the
  period rule of ``report.period``); a multi-node job's allocation is split evenly over its nodes (sacct's
  AllocTRES is the job's total, not per node),
- ``observed_gpu_hours``: GPU-hours in which an agent saw the job on that node's GPUs,
- ``coverage`` = observed / Slurm-allocated, ``unmeasured_gpu_hours`` = allocated - observed (never below 0),
- on rows of account ``(no job)``: ``unattributed_gpu_hours``, GPU-time the collector observed with no job on the
  GPU, and ``unattributed_energy_kwh``, its energy. Both come from the collector's hourly buckets of the GPUs
  (whole hours starting in the period). The store keeps energy per GPU-hour, not split by job, so the
  unattributed energy is the hour's energy x its unallocated share of observed time (power assumed even within
  the hour); jobs measured only by agents appear with account from the agent's metadata or ``(unknown)``.
- ``counter_anomalies``: energy-counter events (steps back, implausible jumps) need the collector to store
  them; this ledger does not yet, so the column is None (never a made-up 0).

A GPU model is the measured one; a Slurm GRES type (``h200``) joins the measured model that contains it
(``NVIDIA H200``), else stands as it is.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpuledger.accounting.charge import allocation
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.period import ALL_TIME, Period, job_end
from gpuledger.accounting.report.tables import exact_csv, fmt_optional, plain_table
from gpuledger.accounting.report.units import JOULES_PER_KWH, SECONDS_PER_HOUR

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
    unattributed_gpu_hours: float
    unattributed_energy_kwh: float
    counter_anomalies: int | None = None


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
    __slots__ = ("jobs", "slurm", "observed", "unmeasured", "idle", "idle_j")

    def __init__(self) -> None:
        self.jobs: set[tuple[str, str]] = set()
        self.slurm: list[float] = []
        self.observed: list[float] = []
        self.unmeasured: list[float] = []
        self.idle: list[float] = []
        self.idle_j: list[float] = []


def _model_for(gres: str, measured: Iterable[str]) -> str:
    low = gres.lower()
    for m in measured:
        if m and low and low in m.lower():
            return m
    return gres or next((m for m in measured if m), "") or "(unknown)"


def reconcile(entries: Iterable[LedgerEntry], gpu_hours: Iterable[Mapping[str, Any]], period: Period = ALL_TIME,
              now: float | None = None) -> Reconciliation:
    """The reconciliation of the ledger's entries and the collector's per-GPU hourly totals (``gpu_hours`` of
    the store over the period) for ``period``."""
    now = time.time() if now is None else now
    acc: dict[tuple[str, str, str], _Acc] = {}

    def cell(account: str, node: str, model: str) -> _Acc:
        a = acc.get((account, node, model))
        if a is None:
            a = acc[(account, node, model)] = _Acc()
        return a

    for e in entries:
        t = job_end(e)
        if t is None or not period.start <= t < period.end:
            continue
        account = e.account
        measured_models = [u.model for u in e.measured]
        # observed, per node and model
        observed: dict[tuple[str, str], float] = {}
        if e.usage is not None:
            for u in e.measured:
                key = (u.host, u.model or "(unknown)")
                observed[key] = observed.get(key, 0.0) + u.allocated_gpu_seconds
        # Slurm's allocation, per node and model
        allocated: dict[tuple[str, str], float] = {}
        alloc = allocation(e.record, min(now, period.end))
        if alloc is not None:
            hosts = (e.record.hosts if e.record is not None else ()) or ("(unknown)",)
            for gres, seconds in alloc.items():
                model = _model_for(gres, measured_models)
                for h in hosts:
                    allocated[(h, model)] = allocated.get((h, model), 0.0) + seconds / len(hosts)
        for node, model in set(observed) | set(allocated):
            a = cell(account, node, model)
            a.jobs.add(e.key)
            o = observed.get((node, model), 0.0)
            a.observed.append(o)
            if (node, model) in allocated:
                s = allocated[(node, model)]
                a.slurm.append(s)
                a.unmeasured.append(max(0.0, s - o))
    for g in gpu_hours:
        idle_s = max(0.0, g["observed_gpu_seconds"] - g["job_gpu_seconds"])
        if idle_s <= 0:
            continue
        a = cell(NO_JOB, g["host"], g["model"] or "(unknown)")
        a.idle.append(idle_s)
        share = idle_s / g["observed_gpu_seconds"] if g["observed_gpu_seconds"] > 0 else 0.0
        a.idle_j.append(g["energy_joules"] * share)
    rows = [_row(k, [a]) for k, a in sorted(acc.items())]
    total = _row((TOTAL, "", ""), list(acc.values()))
    notes = ("multi-node allocations are split evenly over their nodes",
             "unattributed energy = each GPU-hour's energy x its share of observed time with no job",
             "counter anomalies are not stored by this collector: column left empty")
    return Reconciliation(period, rows, total, notes)


def _row(key: tuple[str, str, str], accs: list[_Acc]) -> ReconcileRow:
    def hours(name: str) -> float:
        return math.fsum(v for a in accs for v in getattr(a, name)) / SECONDS_PER_HOUR

    slurm, observed = hours("slurm"), hours("observed")
    return ReconcileRow(
        account=key[0], node=key[1], model=key[2], jobs=len(set().union(*(a.jobs for a in accs))) if accs else 0,
        slurm_gpu_hours=slurm, observed_gpu_hours=observed, coverage=observed / slurm if slurm > 0 else None,
        unmeasured_gpu_hours=hours("unmeasured"), unattributed_gpu_hours=hours("idle"),
        unattributed_energy_kwh=math.fsum(v for a in accs for v in a.idle_j) / JOULES_PER_KWH,
        counter_anomalies=None,
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
    ("Unattributed GPU-h", lambda r: fmt_optional(r.unattributed_gpu_hours, ".3f")),
    ("Unattributed kWh", lambda r: fmt_optional(r.unattributed_energy_kwh, ".3f")),
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
