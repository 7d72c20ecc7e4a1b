"""Per-job rows (the ledger as a table) and per account/user subtotals."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpuledger.accounting.charge import allocated_gpu_seconds
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.tables import Rows, fmt_optional
from gpuledger.accounting.report.units import JOULES_PER_KWH, SECONDS_PER_HOUR


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
    cluster: str = ""
    seen_by: str = "both"  # both | slurm | agent (LedgerEntry.seen_by)
    slurm_gpu_hours: float | None = None  # Slurm-allocated (elapsed x GPUs); None without a scheduler record
    coverage: float | None = None  # observed / Slurm-allocated GPU-time
    unmeasured_gpu_hours: float = 0.0  # Slurm-allocated GPU-time no agent observed
    # observed outside Slurm's record of the job (another host, other times, a MIG GPU counted twice: ``scope``),
    # measured but not charged; its reasons comma-separated
    out_of_scope_gpu_hours: float = 0.0
    out_of_scope_kwh: float = 0.0
    out_of_scope_reasons: str = ""


@dataclass(frozen=True, slots=True)
class GroupRow:
    account: str
    user: str | None  # None on the account subtotal row
    jobs: int
    gpu_hours: float
    sm_active_gpu_hours: float
    efficiency: float | None
    energy_kwh: float


def job_rows(entries: Iterable[LedgerEntry], now: float | None = None) -> Rows[JobRow]:
    now = time.time() if now is None else now
    rows = Rows(JobRow)  # CSV of no jobs still has its header
    for e in entries:
        u = e.usage
        slurm_s = allocated_gpu_seconds(e.record, now)
        observed = u.allocated_gpu_seconds if u else 0.0
        gpus = e.record.gpus if e.record and e.record.gpus is not None else (u.gpus if u else 0)
        rows.append(
            JobRow(
                job_id=e.job_id,
                user=e.user,
                account=e.account,
                gpus=gpus,
                gpu_hours=u.allocated_gpu_seconds / SECONDS_PER_HOUR if u else 0.0,
                sm_active_gpu_hours=u.sm_active_gpu_seconds / SECONDS_PER_HOUR if u else 0.0,
                hbm_mean=u.dram_bw_mean if u else None,
                energy_kwh=e.energy_joules / JOULES_PER_KWH,  # with reassigned gap energy
                efficiency=u.efficiency if u else None,
                only=e.only,
                cluster=e.cluster,
                seen_by=e.seen_by,
                slurm_gpu_hours=None if slurm_s is None else slurm_s / SECONDS_PER_HOUR,
                coverage=observed / slurm_s if slurm_s else None,
                unmeasured_gpu_hours=0.0 if slurm_s is None else max(0.0, slurm_s - observed) / SECONDS_PER_HOUR,
                out_of_scope_gpu_hours=e.out_of_scope_gpu_seconds / SECONDS_PER_HOUR,
                out_of_scope_kwh=e.out_of_scope_energy_joules / JOULES_PER_KWH,
                out_of_scope_reasons=",".join(e.out_of_scope_reasons),
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


JOB_COLUMNS: list[tuple[str, Callable[[JobRow], str]]] = [
    ("Job", lambda r: r.job_id + (f"@{r.cluster}" if r.cluster else "") + ("*" if r.only else "")),
    ("Seen by", lambda r: r.seen_by),
    ("User", lambda r: r.user),
    ("Account", lambda r: r.account),
    ("GPUs", lambda r: str(r.gpus)),
    ("Slurm GPU-h", lambda r: fmt_optional(r.slurm_gpu_hours, ".2f")),
    ("GPU-h", lambda r: fmt_optional(r.gpu_hours, ".2f")),
    ("Coverage", lambda r: fmt_optional(r.coverage, ".0%")),
    ("Unmeasured GPU-h", lambda r: fmt_optional(r.unmeasured_gpu_hours, ".2f")),
    ("SM-active GPU-h", lambda r: fmt_optional(r.sm_active_gpu_hours, ".2f")),
    ("Mean HBM", lambda r: fmt_optional(r.hbm_mean, ".0%")),
    ("Energy kWh", lambda r: fmt_optional(r.energy_kwh, ".2f")),
    ("Efficiency", lambda r: fmt_optional(r.efficiency, ".0%")),
    ("Out of scope GPU-h", lambda r: f"{r.out_of_scope_gpu_hours:.2f}"
     + (f" ({r.out_of_scope_reasons})" if r.out_of_scope_reasons else "")),
]

GROUP_COLUMNS: list[tuple[str, Callable[[GroupRow], str]]] = [
    ("Account", lambda r: r.account if r.user is None else ""),
    ("User", lambda r: r.user or ""),
    ("Jobs", lambda r: str(r.jobs)),
    ("GPU-h allocated", lambda r: fmt_optional(r.gpu_hours, ".2f")),
    ("GPU-h SM-active", lambda r: fmt_optional(r.sm_active_gpu_hours, ".2f")),
    ("Efficiency", lambda r: fmt_optional(r.efficiency, ".0%")),
    ("Energy kWh", lambda r: fmt_optional(r.energy_kwh, ".2f")),
]
