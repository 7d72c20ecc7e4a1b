"""The audit log's core: canonical JSON, RFC 9162 Merkle hashing and proofs, the append-only log (SQLite or
PostgreSQL), and the job-record recorder the collector needs. It sits in the collector (below accounting) because
the collector records posted job records before they are stored; accounting's audit package builds checkpoints,
keys, signed reports and explanations on top."""

from gpuledger.collector.auditlog.canonical import AuditError, canonical_json, plain
from gpuledger.collector.auditlog.jobs import job_data, job_key, open_log, record_job_records
from gpuledger.collector.auditlog.log import (
    AUDIT_NAME,
    AUDIT_SCHEMA,
    KINDS,
    AuditLog,
    Entry,
    EntryDamaged,
    LogDamaged,
    Problem,
    VerifyResult,
    open_audit_log,
)

__all__ = ["AUDIT_NAME", "AUDIT_SCHEMA", "KINDS", "AuditError", "AuditLog", "Entry", "EntryDamaged", "LogDamaged",
           "Problem", "VerifyResult", "canonical_json", "job_data", "job_key", "open_audit_log", "open_log", "plain",
           "record_job_records"]
