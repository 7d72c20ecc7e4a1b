"""Signed checkpoints of the audit log, and proving that the log still extends them.

A checkpoint is a signed note in the C2SP tlog-checkpoint layout (origin, tree size, base64 root hash), with two
extension lines, ``time <RFC 3339 UTC>`` and ``key <key id>``::

    gpuledger-audit
    1000000
    <base64 root>
    time 2026-11-30T20:00:00Z
    key ed25519:0123456789abcdef

    \u2014 gpuledger-audit <base64 signature>

An admin ships each checkpoint off the machine (syslog, another host, object storage with object lock).
``check_heads`` takes signed tree heads (checkpoints, and the audit heads that signed report manifests carry)
and the log as recomputed from its entries, and says which heads the log no longer extends: the first one by
tree size, and the range of entries that changed (after the largest head that still verifies, up to it).
"""

from __future__ import annotations

import base64
import calendar
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuledger.accounting.audit import note
from gpuledger.accounting.audit.keys import KEY_NAME, SigningKey, TrustedKeys
from gpuledger.collector.auditlog import AuditError, AuditLog, LogDamaged, Problem, VerifyResult, merkle


@dataclass(frozen=True, slots=True)
class SignedHead:
    """A tree head someone signed: ``source`` says which (a checkpoint file, a report's manifest)."""

    source: str
    size: int
    root: bytes
    time: float | None = None
    key_id: str | None = None

    def label(self) -> str:
        when = f", {iso_utc(self.time)}" if self.time is not None else ""
        return f"{self.source} (size {self.size}{when})"


def iso_utc(t: float) -> str:
    """RFC 3339 UTC to the second: the checkpoint's time line, and how explain shows times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def make_checkpoint(log: AuditLog, key: SigningKey, now: float | None = None, origin: str = KEY_NAME) -> str:
    """Sign the log's current tree head. The root is read from the stored subtree hashes (O(log n))."""
    size, root_hex = log.head()
    try:
        root = log.root(size)
    except LogDamaged as e:
        raise AuditError(f"{log.location}: {e}; run `gpuledger audit verify`") from None
    if root.hex() != root_hex:
        raise AuditError(f"{log.location}: the stored head and the stored tree disagree; run `gpuledger audit verify`")
    t = time.time() if now is None else now
    text = (f"{origin}\n{size}\n{base64.b64encode(root).decode()}\ntime {iso_utc(t)}\nkey {key.key_id}\n")
    return note.sign(text, origin, key.private)


def parse_checkpoint(text: str, source: str) -> tuple[SignedHead, note.Note]:
    """The head a checkpoint states (its signature unchecked); AuditError naming ``source`` when malformed."""
    n = note.parse(text, source)
    lines = n.text.splitlines()
    if len(lines) < 3:
        raise AuditError(f"{source}: a checkpoint needs origin, tree size and root hash lines")
    try:
        size = int(lines[1])
        if size < 0 or lines[1] != str(size):
            raise ValueError
    except ValueError:
        raise AuditError(f"{source}: line 2: tree size {lines[1]!r} is not a decimal number") from None
    try:
        root = base64.b64decode(lines[2], validate=True)
    except ValueError:
        root = b""
    if len(root) != 32:
        raise AuditError(f"{source}: line 3: {lines[2]!r} is not a base64 SHA-256 root hash")
    t, kid = None, None
    for line in lines[3:]:
        if line.startswith("time "):
            try:
                t = float(calendar.timegm(time.strptime(line[5:], "%Y-%m-%dT%H:%M:%SZ")))
            except ValueError:
                raise AuditError(f"{source}: {line!r} is not 'time YYYY-MM-DDTHH:MM:SSZ'") from None
        elif line.startswith("key "):
            kid = line[4:]
    return SignedHead(source, size, root, t, kid), n


def open_checkpoint(text: str, source: str, trusted: TrustedKeys) -> SignedHead:
    """A checkpoint whose signature verifies with a trusted key, else AuditError saying why (tampered: exit 1)."""
    head, n = parse_checkpoint(text, source)
    if note.verified_by(n, [(k.key_id, k.raw, k.key) for k in trusted.keys_at(head.time, head.size)]) is not None:
        return head
    signer = note.verified_by(n, [(k.key_id, k.raw, k.key) for k in trusted.keys()])
    if signer is not None:  # a trusted key, but not for what the checkpoint states (its time, its tree)
        raise CheckpointRejected(f"{source}: {trusted.term_problem(signer, head.time, head.size)}")
    raise CheckpointRejected(f"{source}: the signature does not verify with the pinned key or a key the keyring "
                             "links to it (forged, altered, or signed by another key)")


class CheckpointRejected(AuditError):
    """A checkpoint or manifest that parses but whose signature does not verify: evidence of tampering."""


@dataclass(frozen=True, slots=True)
class HeadCheck:
    head: SignedHead
    ok: bool
    problem: Problem | None = None


def check_heads(log: AuditLog, result: VerifyResult, heads: Iterable[SignedHead]) -> list[HeadCheck]:
    """Per head, smallest tree first: does the log (as recomputed from its entries) extend it?

    A head the log extends is also proven the RFC 9162 way: a consistency proof from the stored subtree hashes,
    checked against the head's root and today's root. For the first head it does not extend, the problem names
    the range of entries that changed: after the largest smaller head that still verifies, up to the head's size.
    """
    ordered: Sequence[SignedHead] = sorted(heads, key=lambda h: h.size)
    out: list[HeadCheck] = []
    good = 0  # size of the largest head verified so far
    good_label = ""
    for h in ordered:
        n = result.entries  # the prefix recomputed from entries that read back as entries
        problem = None
        if h.size > result.entries and result.ok:
            problem = Problem(result.entries + 1, f"missing (deleted): {h.label()} covers {h.size} entries, the log "
                              f"holds {result.entries}", h.size)
        elif h.size <= n:
            if result.root_at(h.size) != h.root:
                lo = good + 1
                since = f"; entries 1..{good} still verify against {good_label}" if good else ""
                problem = Problem(lo, f"changed: the log no longer extends {h.label()}{since}", h.size)
            elif result.ok and h.size and not _proof_holds(log, h, result):
                problem = Problem(1, f"the stored tree gives no valid consistency proof from {h.label()}", h.size)
        else:
            continue  # beyond what verifies locally: the local problem is the first one
        out.append(HeadCheck(h, problem is None, problem))
        if problem is None and h.size >= good:
            good, good_label = h.size, h.label()
    return out


def _proof_holds(log: AuditLog, h: SignedHead, result: VerifyResult) -> bool:
    try:
        proof = log.consistency_proof(h.size, result.entries)
    except (LogDamaged, AuditError):
        return False
    return merkle.verify_consistency(h.size, result.entries, h.root, result.root, proof)
