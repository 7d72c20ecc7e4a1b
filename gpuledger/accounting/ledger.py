"""The ledger: Slurm's job records joined with the agents' measurements.

A job seen by only one side is kept and flagged (``only``), never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuledger.collector.ledger_store import LedgerReader
from gpuledger.schema.records import JobRecord, JobUsage


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    job_id: str
    record: JobRecord | None
    usage: JobUsage | None

    @property
    def only(self) -> str | None:
        """'scheduler' when no measurement exists, 'measured' when Slurm does not know the job, else None."""
        if self.usage is None:
            return "scheduler"
        if self.record is None:
            return "measured"
        return None

    @property
    def account(self) -> str:
        return (self.record.account if self.record and self.record.account else "(unknown)")

    @property
    def user(self) -> str:
        return (self.record.user if self.record and self.record.user else "(unknown)")


def join(records: Iterable[JobRecord], usages: Iterable[JobUsage]) -> list[LedgerEntry]:
    by_rec = {r.job_id: r for r in records}
    by_use = {u.job_id: u for u in usages}
    ids = sorted(set(by_rec) | set(by_use), key=_job_sort_key)
    return [LedgerEntry(j, by_rec.get(j), by_use.get(j)) for j in ids]


def load(store: LedgerReader) -> list[LedgerEntry]:
    return join(store.jobs(), store.job_usage())


def _job_sort_key(job_id: str) -> tuple[int, str]:
    head = job_id.split("_", 1)[0]
    return (int(head), job_id) if head.isdigit() else (1 << 62, job_id)
