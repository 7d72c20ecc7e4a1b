"""Signed report manifests: what a report is, what it was computed from, and the audit log's head when signed.

``<report>.manifest.json`` holds the manifest and an Ed25519 signature over its canonical JSON. The manifest
names the key that signed it (``key_id``), the report's SHA-256, the audit head (tree size and root: a signed
tree head like a checkpoint), and ``input_records``: the Merkle root over the leaf hashes of exactly the job and
usage entries the report used, with their entry numbers, so an auditor can check that those entries, as they are
in the log now, are what the report was computed from.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.accounting.audit.binding import inputs_root, parse_ranges
from gpuledger.accounting.audit.checkpoint import SignedHead
from gpuledger.accounting.audit.keys import SigningKey, TrustedKeys
from gpuledger.collector.auditlog import AuditLog, Entry, VerifyResult, canonical_json, merkle, plain

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


def verify_report(report_path: str | os.PathLike[str], trusted: TrustedKeys, result: VerifyResult) -> ReportCheck:
    """Signature (with a trusted key), report digest, and the input records as the log holds them now.

    The audit head it returns goes to ``checkpoint.check_heads`` with the other signed heads.
    """
    report_path = Path(report_path)
    mpath = manifest_path(report_path)
    out = ReportCheck()
    try:
        doc = json.loads(mpath.read_text())
        manifest, sig = doc["manifest"], base64.b64decode(doc["signature"], validate=True)
        kid = manifest.get("key_id")
    except FileNotFoundError:
        out.problems.append(f"{mpath}: no manifest beside the report")
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        out.problems.append(f"{mpath}: unreadable manifest: {type(e).__name__}: {e}")
        return out
    key = trusted.get(kid) if isinstance(kid, str) else None
    if key is None:
        out.problems.append(f"{mpath}: signed by key {kid!r}, which is neither the pinned key nor linked to it by the "
                            "keyring (a replaced key pair, or pass that key's --public-key)")
    elif not key.verifies(sig, canonical_json(manifest).encode()):
        out.problems.append(f"{mpath}: the signature does not match the manifest (manifest altered)")
    else:
        at, head = manifest.get("created_at"), manifest.get("audit_head")
        size = head.get("size") if isinstance(head, dict) else None
        why = trusted.term_problem(key.key_id, at if isinstance(at, (int, float)) else None,
                                   size if type(size) is int else None)
        if why is not None:
            out.problems.append(f"{mpath}: {why}")
    signed = not out.problems
    try:
        if hashlib.sha256(report_path.read_bytes()).hexdigest() != manifest["report"]["sha256"]:
            out.problems.append(f"{report_path}: content differs from the signed digest (report altered)")
        head = manifest["audit_head"]
        size, root = int(head["size"]), bytes.fromhex(head["root"])
        rec = manifest["input_records"]
        seqs = parse_ranges(rec["entries"])
    except FileNotFoundError:
        out.problems.append(f"{report_path}: report file not found")
        return out
    except (KeyError, TypeError, ValueError) as e:
        out.problems.append(f"{mpath}: manifest lacks a field or holds a bad value: {type(e).__name__}: {e}")
        return out
    if not signed:
        return out
    out.head = SignedHead(f"report {report_path.name}", size, root, manifest.get("created_at"), kid)
    leaves = result.levels[0] if result.levels else []
    if seqs and seqs[-1] > len(leaves):
        return out  # beyond what verifies: the log's own problem is reported
    if merkle.root_of([leaves[s - 1] for s in seqs]).hex() != rec.get("root"):
        out.problems.append(f"{mpath}: the {len(seqs)} input records it names (entries {rec['entries'][:60]}) "
                            "no longer hash to the signed inputs root (entries changed)")
    return out
