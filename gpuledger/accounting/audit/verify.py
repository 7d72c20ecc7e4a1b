"""`audit verify` as a library call: the log recomputed from its entries, checked against every signed head
(checkpoints given by the admin, checkpoints kept beside the log, the audit heads of signed reports), and every
logged charge recomputed from the logged records it names (``explain.charge_problems``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpuledger.accounting.audit.checkpoint import (
    CheckpointRejected,
    HeadCheck,
    SignedHead,
    check_heads,
    open_checkpoint,
)
from gpuledger.accounting.audit.explain import charge_problems
from gpuledger.accounting.audit.keys import TrustedKeys
from gpuledger.accounting.audit.manifest import verify_report
from gpuledger.collector.auditlog import AuditLog, Problem, VerifyResult


@dataclass
class Verdict:
    result: VerifyResult
    heads: list[HeadCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the first bad entry or range first, then the rest
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_all(
    log: AuditLog,
    trusted: TrustedKeys | None,
    checkpoints: Iterable[tuple[str, str]] = (),
    reports: Iterable[str | os.PathLike[str]] = (),
) -> Verdict:
    """``checkpoints``: (source, text) pairs; a malformed one raises AuditError (bad input), one whose signature
    does not verify is a problem (tampered). Needs ``trusted`` keys when there is anything signed to check."""
    result = log.verify()
    v = Verdict(result)
    ranked: list[tuple[int, str]] = []
    if result.problem is not None:
        ranked.append((result.problem.first, str(result.problem)))
    else:  # an intact log whose charges its own records do not recompute to (what `audit explain` shows DIFFERS)
        ranked += charge_problems(log)
    heads: list[SignedHead] = []
    given = list(checkpoints)
    for source, text in given:
        if trusted is None:
            raise ValueError("checkpoints need a public key to verify them")
        try:
            heads.append(open_checkpoint(text, source, trusted))
        except CheckpointRejected as e:
            ranked.append((0, str(e)))
    kept = log.saved_checkpoints()
    if trusted is None and kept:
        v.notes.append(f"{len(kept)} checkpoint(s) kept in the log not checked: no public key (pass --public-key)")
    if trusted is not None:
        for i, text in enumerate(kept, 1):
            try:
                heads.append(open_checkpoint(text, f"checkpoint kept in the log #{i}", trusted))
            except Exception as e:  # noqa: BLE001 - a kept checkpoint is a hint, never the verdict's input
                v.notes.append(f"ignored: {e}")
    for rp in reports:
        if trusted is None:
            raise ValueError("reports need a public key to verify them")
        rc = verify_report(rp, trusted, result)
        ranked += [(0, p) for p in rc.problems]
        if rc.head is not None:
            heads.append(rc.head)
    v.heads = check_heads(log, result, heads)
    ranked += [(h.problem.first, str(h.problem)) for h in v.heads if h.problem is not None]
    v.problems = [msg for _, msg in sorted(ranked, key=lambda x: x[0])]
    return v


def first_problem(v: Verdict) -> Problem | None:
    """The earliest entry or range any check names (for callers that want the numbers, not the text)."""
    found = [h.problem for h in v.heads if h.problem is not None]
    if v.result.problem is not None:
        found.append(v.result.problem)
    return min(found, key=lambda p: (p.first, p.last or p.first), default=None)


def read_checkpoints(paths: Iterable[Path]) -> list[tuple[str, str]]:
    out = []
    for p in paths:
        try:
            out.append((str(p), p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise FileNotFoundError(f"{p}: cannot read the checkpoint: {e}") from None
    return out
