"""Jobs that held GPUs mostly idle."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.tables import Rows, fmt_optional
from gpuledger.accounting.report.units import SECONDS_PER_HOUR
from gpuledger.schema.records import JobUsage


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
) -> Rows[IdleRow]:
    """Jobs that held GPUs mostly idle, worst (most idle GPU-hours) first.

    A GPU of a job is idle when its mean SM activity over the job is below ``threshold``; a job is listed when
    its idle GPUs hold at least ``min_share`` of its allocated GPU-time. Without per-GPU records the job as a
    whole is judged by its mean SM activity.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ReportError(f"idle threshold {threshold!r} must lie in 0..1")
    out = Rows(IdleRow)  # CSV of no idle jobs still has its header
    for e in entries:
        u = e.usage
        if u is None or u.allocated_gpu_seconds <= 0:
            continue
        gpus = e.gpus or (per_gpu or {}).get(e.job_id) or [u]  # the entry's own (its cluster; ``scope``) first
        idle = [g for g in gpus
                if (g.sm_active_mean if g.sm_active_mean is not None else _efficiency_or_zero(g)) < threshold]
        idle_s = math.fsum(g.allocated_gpu_seconds for g in idle)
        share = idle_s / u.allocated_gpu_seconds
        if idle and share >= min_share:
            n_idle = sum(g.gpus for g in idle)
            out.append(IdleRow(e.job_id, e.user, e.account, u.gpus, n_idle, u.allocated_gpu_seconds / SECONDS_PER_HOUR,
                               idle_s / SECONDS_PER_HOUR, share, u.efficiency))
    out.sort(key=lambda r: (-r.idle_gpu_hours, r.job_id))
    return out


def _efficiency_or_zero(u: JobUsage) -> float:
    e = u.efficiency
    return 0.0 if e is None else e


IDLE_COLUMNS: list[tuple[str, Callable[[IdleRow], str]]] = [
    ("Job", lambda r: r.job_id),
    ("User", lambda r: r.user),
    ("Account", lambda r: r.account),
    ("GPUs", lambda r: str(r.gpus)),
    ("Idle GPUs", lambda r: str(r.idle_gpus)),
    ("GPU-h alloc", lambda r: fmt_optional(r.allocated_gpu_hours, ".2f")),
    ("GPU-h idle", lambda r: fmt_optional(r.idle_gpu_hours, ".2f")),
    ("Idle share", lambda r: fmt_optional(r.idle_share, ".0%")),
    ("Efficiency", lambda r: fmt_optional(r.efficiency, ".1%")),
]
