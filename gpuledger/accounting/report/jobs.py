"""Per-job rows (the ledger as a table) and per account/user subtotals."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.accounting.report.tables import fmt_optional
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
                gpu_hours=u.allocated_gpu_seconds / SECONDS_PER_HOUR if u else 0.0,
                sm_active_gpu_hours=u.sm_active_gpu_seconds / SECONDS_PER_HOUR if u else 0.0,
                hbm_mean=u.dram_bw_mean if u else None,
                energy_kwh=u.energy_joules / JOULES_PER_KWH if u else 0.0,
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


JOB_COLUMNS: list[tuple[str, Callable[[JobRow], str]]] = [
    ("Job", lambda r: r.job_id + ("*" if r.only else "")),
    ("User", lambda r: r.user),
    ("Account", lambda r: r.account),
    ("GPUs", lambda r: str(r.gpus)),
    ("GPU-h", lambda r: fmt_optional(r.gpu_hours, ".2f")),
    ("SM-active GPU-h", lambda r: fmt_optional(r.sm_active_gpu_hours, ".2f")),
    ("Mean HBM", lambda r: fmt_optional(r.hbm_mean, ".0%")),
    ("Energy kWh", lambda r: fmt_optional(r.energy_kwh, ".2f")),
    ("Efficiency", lambda r: fmt_optional(r.efficiency, ".0%")),
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
