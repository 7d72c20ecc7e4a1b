"""Job records into the audit log: what the collector (POST /api/v1/jobs) and `jobs import` append before the
records are stored, so nothing is charged that the log has not seen."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from gpuledger.collector.auditlog.log import AuditLog, open_audit_log
from gpuledger.schema.records import JobRecord


def open_log(data_dir: str | os.PathLike[str], pseudonymize: bool = True, ledger_url: str | None = None) -> AuditLog:
    """The audit log of the ledger at ``ledger_url`` (see ``open_audit_log``: without one, the data dir's file);
    user names written as keyed pseudonyms (the ledger's key: ``collector.pseudonym.ledger_key``)."""
    alias = None
    if pseudonymize:
        from gpuledger.collector.pseudonym import Pseudonymizer

        alias = Pseudonymizer.for_ledger(ledger_url, data_dir)
    return open_audit_log(ledger_url, data_dir, user_alias=alias)


def job_key(r: JobRecord) -> str:
    """The log key of a job's record: a newer record of the same job supersedes the older."""
    return f"job:{r.cluster}/{r.job_id}"


def job_data(log: AuditLog, r: JobRecord) -> dict[str, Any]:
    """A job record as the log keeps it: user pseudonymized, no uid (personal data)."""
    d = r.to_dict()
    d["user"] = log.alias(r.user)
    d["uid"] = None
    return d


def record_job_records(log: AuditLog, records: Iterable[JobRecord]) -> int:
    """Append a ``job_record`` entry per record that is new or changed; returns how many were appended."""
    return len(log.append_many(("job_record", job_data(log, r), r.job_id, job_key(r)) for r in records))
