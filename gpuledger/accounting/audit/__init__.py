"""The tamper-evident audit trail, on top of the Merkle log in ``collector.auditlog``.

Modules by responsibility: ``keys`` (signing keys outside the data directory, key ids, keyring and rotation),
``note`` (the signed-note text format), ``checkpoint`` (signed tree heads, and proving the log extends them),
``manifest`` (signed report manifests bound to their input records), ``binding`` (store rows against their
logged records: refusing store edits, explicit corrections), ``recorders`` (what accounting appends),
``chain`` (fairshare entries logged as deltas on the one before, and reading any entry's full inputs), ``explain``
(how a site factor was derived), ``verify`` (all checks together for `audit verify`).
"""

from gpuledger.accounting.audit.binding import (
    FINAL_AFTER_S,
    Bound,
    StoreChange,
    StoreDamaged,
    bind,
    gap_key,
    hours_key,
    inputs_root,
    usage_key,
)
from gpuledger.accounting.audit.checkpoint import (
    CheckpointRejected,
    SignedHead,
    check_heads,
    make_checkpoint,
    open_checkpoint,
    parse_checkpoint,
)
from gpuledger.accounting.audit.explain import Explanation, Step, explain
from gpuledger.accounting.audit.keys import (
    KEY_NAME,
    PRIVATE_KEY_NAME,
    SigningKey,
    TrustedKeys,
    default_private_key_path,
    keygen,
    keyring_path,
    load_public_key,
    load_signing_key,
    public_path,
    trusted_keys,
)
from gpuledger.accounting.audit.manifest import MANIFEST_SUFFIX, code_version, sign_report, verify_report
from gpuledger.accounting.audit.recorders import (
    JobCharge,
    job_charges,
    record_fairshare,
    record_priority_change,
    record_priority_changes,
    record_usage,
)
from gpuledger.accounting.audit.verify import Verdict, verify_all
from gpuledger.collector.auditlog import (
    AUDIT_NAME,
    KINDS,
    AuditError,
    AuditLog,
    Entry,
    EntryDamaged,
    Problem,
    VerifyResult,
    canonical_json,
    open_audit_log,
    open_log,
    plain,
    record_job_records,
)

__all__ = [
    "AUDIT_NAME", "FINAL_AFTER_S", "KEY_NAME", "KINDS", "MANIFEST_SUFFIX", "PRIVATE_KEY_NAME", "AuditError", "AuditLog",
    "Bound", "CheckpointRejected", "Entry", "EntryDamaged", "Explanation", "JobCharge", "Problem", "SignedHead",
    "SigningKey", "Step", "StoreChange", "StoreDamaged", "TrustedKeys", "Verdict", "VerifyResult", "bind",
    "canonical_json", "check_heads", "code_version",
    "default_private_key_path", "explain", "gap_key", "hours_key", "inputs_root", "job_charges", "keygen",
    "keyring_path", "load_public_key",
    "load_signing_key", "make_checkpoint", "open_audit_log", "open_checkpoint", "open_log", "parse_checkpoint", "plain",
    "public_path",
    "record_fairshare", "record_job_records", "record_priority_change", "record_priority_changes", "record_usage",
    "sign_report", "trusted_keys",
    "usage_key", "verify_all", "verify_report",
]
