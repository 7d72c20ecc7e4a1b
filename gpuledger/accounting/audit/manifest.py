"""Signed report manifests: what a report is, what it was computed from, and the audit log's head when signed.

``<report>.manifest.json`` holds the manifest and an Ed25519 signature over its canonical JSON. The manifest
names the key that signed it (``key_id``), the report's SHA-256, the audit head (tree size and root: a signed
tree head like a checkpoint), and ``input_records``: the Merkle root over the leaf hashes of exactly the job and
usage entries the report used, with their entry numbers, so an auditor can check that those entries, as they are
in the log now, are what the report was computed from. ``inputs`` says what else the figures depend on (a usage
report: its resolved prices, CO2e factor and grid intensity series; see ``report_cli.bound_settings``).

Verification reads nothing of a manifest but its key id before the signature verifies, and the entry numbers it
names one at a time, within the signed head: an altered manifest costs no more than its own size.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.accounting.audit.binding import inputs_root
from gpuledger.accounting.audit.checkpoint import SignedHead
from gpuledger.accounting.audit.keys import SigningKey, TrustedKeys
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry, VerifyResult, canonical_json, merkle, plain

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "gpuledger-report-manifest/2"


def code_version() -> dict[str, str]:
    """The installed package version and a digest of the accounting, collector and agent sources."""
    from importlib import metadata

    try:
        version = metadata.version("gpuledger")
    except metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for pkg in ("agent", "collector", "accounting"):
        for p in sorted((root / pkg).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return {"package": version, "sources_sha256": h.hexdigest()}


def manifest_path(report_path: str | os.PathLike[str]) -> Path:
    p = Path(report_path)
    return p.with_name(p.name + MANIFEST_SUFFIX)


def sign_report(
    report_path: str | os.PathLike[str],
    key: SigningKey,
    log: AuditLog,
    *,
    inputs: Mapping[str, Any],
    period: Mapping[str, Any],
    used: Sequence[Entry],
    now: float | None = None,
) -> Path:
    """Write ``<report>.manifest.json`` for a report computed from the records of the entries ``used``."""
    report_path = Path(report_path)
    size, root = log.head()
    manifest = {
        "format": MANIFEST_FORMAT,
        "key_id": key.key_id,
        "report": {"name": report_path.name, "sha256": hashlib.sha256(report_path.read_bytes()).hexdigest()},
        "inputs": dict(inputs),
        "input_records": inputs_root(used),
        "period": dict(period),
        "code_version": code_version(),
        "audit_head": {"size": size, "root": root},
        "created_at": time.time() if now is None else now,
    }
    sig = key.private.sign(canonical_json(manifest).encode())
    out = manifest_path(report_path)
    signed = {"manifest": plain(manifest), "signature": base64.b64encode(sig).decode()}
    out.write_text(json.dumps(signed, indent=2) + "\n")
    return out


@dataclass
class ReportCheck:
    problems: list[str] = field(default_factory=list)
    head: SignedHead | None = None  # the signed audit head, when the signature verifies


def open_manifest(report_path: str | os.PathLike[str], trusted: TrustedKeys) -> tuple[dict[str, Any] | None, list[str]]:
    """The manifest beside a report when a trusted key signed it (else None), and why it is not to be trusted
    (tampering: no manifest, an unknown key, a signature that does not verify, a signature outside the key's
    term). Nothing of a manifest is read further before its signature verifies. A file that is no manifest at all
    is bad input: AuditError, naming the file."""
    mpath = manifest_path(report_path)
    try:
        text = mpath.read_bytes()
    except FileNotFoundError:
        return None, [f"{mpath}: no manifest beside the report"]
    except OSError as e:
        raise AuditError(f"{mpath}: cannot read the manifest: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
        manifest, sig = doc["manifest"], base64.b64decode(doc["signature"], validate=True)
        if not isinstance(manifest, dict):
            raise TypeError(f"'manifest' is {type(manifest).__name__}, not an object")
        signed = canonical_json(manifest).encode()
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nesting deeper than JSON needs
        why = f"{type(e).__name__}: {e}" if not isinstance(e, RecursionError) else "nested too deeply"
        raise AuditError(f"{mpath}: not a report manifest ({why})") from None
    kid = manifest.get("key_id")
    key = trusted.get(kid) if isinstance(kid, str) else None
    if key is None:
        return None, [f"{mpath}: signed by key {kid!r:.80}, which is neither the pinned key nor linked to it by the "
                      "keyring (a replaced key pair, or pass that key's --public-key)"]
    if not key.verifies(sig, signed):
        return None, [f"{mpath}: the signature does not match the manifest (manifest altered)"]
    at, head = manifest.get("created_at"), manifest.get("audit_head")
    size = head.get("size") if isinstance(head, dict) else None
    outside = trusted.term_problem(key.key_id, at if isinstance(at, (int, float)) else None,
                                   size if type(size) is int else None)
    if outside is not None:
        return None, [f"{mpath}: {outside}"]
    return manifest, []


def entry_numbers(text: str, last: int) -> Iterator[int]:
    """The entry numbers of an ``input_records.entries`` text (``1-5,7,9-12``: ascending, as ``inputs_root`` writes
    them), one at a time, each checked to be within 1..``last`` (a signed head's size): a range never costs more
    than the entries it may name. ValueError names the first bad part."""
    prev = 0
    for part in text.split(","):
        a, dash, b = part.partition("-")
        if not (a.isascii() and a.isdigit() and (not dash or (b.isascii() and b.isdigit()))):
            raise ValueError(f"entry range {part[:40]!r} is not N or N-M")
        lo, hi = int(a), int(b) if dash else int(a)
        if not prev < lo <= hi <= last:
            raise ValueError(f"entry range {part[:40]!r} is not ascending within the signed head's 1..{last}")
        yield from range(lo, hi + 1)
        prev = hi


def verify_report(report_path: str | os.PathLike[str], trusted: TrustedKeys, result: VerifyResult) -> ReportCheck:
    """Signature (with a trusted key), report digest, and the input records as the log holds them now.

    The audit head it returns goes to ``checkpoint.check_heads`` with the other signed heads. A signed manifest
    that does not say what :func:`sign_report` writes is bad input (AuditError).
    """
    report_path = Path(report_path)
    mpath = manifest_path(report_path)
    out = ReportCheck()
    manifest, out.problems = open_manifest(report_path, trusted)
    if manifest is None:
        return out
    try:
        if hashlib.sha256(report_path.read_bytes()).hexdigest() != manifest["report"]["sha256"]:
            out.problems.append(f"{report_path}: content differs from the signed digest (report altered)")
        head = manifest["audit_head"]
        size, root = int(head["size"]), bytes.fromhex(head["root"])
        rec = manifest["input_records"]
        ranges, count, inputs_root_hex = rec["entries"], int(rec["count"]), rec["root"]
        if not isinstance(ranges, str):
            raise TypeError("input_records.entries is not text")
    except FileNotFoundError:
        out.problems.append(f"{report_path}: report file not found")
        return out
    except (KeyError, TypeError, ValueError) as e:
        raise AuditError(f"{mpath}: the signed manifest lacks a field or holds a bad value "
                         f"({type(e).__name__}: {e})") from None
    out.head = SignedHead(f"report {report_path.name}", size, root, manifest.get("created_at"), manifest["key_id"])
    leaves = result.levels[0] if result.levels else []
    named: list[bytes] = []
    try:
        for seq in entry_numbers(ranges, size) if ranges else ():
            if seq > len(leaves):
                return out  # beyond what the log holds: check_heads reports the log shorter than the signed head
            named.append(leaves[seq - 1])
    except ValueError as e:
        raise AuditError(f"{mpath}: the signed manifest's input records: {e}") from None
    if len(named) != count:
        raise AuditError(f"{mpath}: the signed manifest's input records name {len(named)} entries, "
                         f"not the {count} it counts")
    if merkle.root_of(named).hex() != inputs_root_hex:
        out.problems.append(f"{mpath}: the {count} input records it names (entries {ranges[:60]}) "
                            "no longer hash to the signed inputs root (entries changed)")
    return out
