"""Signed notes, the text format of Go's golang.org/x/mod/sumdb/note that sigstore and C2SP tlog checkpoints use.

A note is UTF-8 text ending in a newline, a blank line, then one signature line per signer::

    <text>\\n
    \\n
    \\u2014 <key name> <base64(key hash (4 bytes) || Ed25519 signature (64 bytes))>\\n

The signature is over the text (with its final newline). The key hash is the first 4 bytes of
SHA-256(key name || "\\n" || 0x01 || 32-byte Ed25519 public key), 0x01 naming Ed25519, so a Go ``note`` verifier
given the key as ``<name>+<hash hex>+<base64(0x01 || key)>`` (``verifier_key``) accepts these notes.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuledger.collector.auditlog import AuditError

if TYPE_CHECKING:  # cryptography is imported where a key is used, not when this module is
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG_ED25519 = b"\x01"
DASH = "\u2014 "


def key_hash(name: str, raw_public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + ALG_ED25519 + raw_public).digest()[:4]


def verifier_key(name: str, raw_public: bytes) -> str:
    """The key in Go note's verifier-key text form."""
    return f"{name}+{key_hash(name, raw_public).hex()}+{base64.b64encode(ALG_ED25519 + raw_public).decode()}"


def _check_name(name: str) -> None:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise AuditError(f"key name {name!r}: must be non-empty, without spaces or '+'")


def sign(text: str, name: str, private_key: Ed25519PrivateKey) -> str:
    """``text`` (ending in a newline, no blank line) signed by ``name``'s key, as a note."""
    from cryptography.hazmat.primitives import serialization

    _check_name(name)
    if not text.endswith("\n") or "\n\n" in text:
        raise AuditError("note text must end with a newline and hold no blank line")
    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = private_key.sign(text.encode())
    return f"{text}\n{DASH}{name} {base64.b64encode(key_hash(name, raw) + sig).decode()}\n"


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    hash: bytes  # the 4-byte key hash
    sig: bytes


@dataclass(frozen=True, slots=True)
class Note:
    text: str
    signatures: tuple[Signature, ...]


def parse(note: str, where: str = "note") -> Note:
    """Split a note into text and signature lines; AuditError (naming ``where``) when it is not a note."""
    if not note.endswith("\n"):
        raise AuditError(f"{where}: not a signed note (no final newline)")
    i = note.rfind("\n\n")
    if i < 0:
        raise AuditError(f"{where}: not a signed note (no blank line before the signatures)")
    text, lines = note[: i + 1], note[i + 2:].splitlines()
    sigs = []
    for n, line in enumerate(lines, 1):
        if not line.startswith(DASH):
            raise AuditError(f"{where}: signature line {n} does not start with an em dash")
        parts = line[len(DASH):].split(" ")
        if len(parts) != 2:
            raise AuditError(f"{where}: signature line {n} is not '\u2014 NAME SIGNATURE'")
        try:
            blob = base64.b64decode(parts[1], validate=True)
        except ValueError:
            raise AuditError(f"{where}: signature line {n} is not base64") from None
        if len(blob) != 4 + 64:
            raise AuditError(f"{where}: signature line {n} holds {len(blob)} bytes, an Ed25519 signature 68")
        sigs.append(Signature(parts[0], blob[:4], blob[4:]))
    if not sigs:
        raise AuditError(f"{where}: no signature")
    return Note(text, tuple(sigs))


def verified_by(note: Note, keys: Iterable[tuple[str, bytes, Ed25519PublicKey]]) -> str | None:
    """The key id of the first of ``keys`` ((key id, raw public key, Ed25519PublicKey)) that signed the note."""
    from cryptography.exceptions import InvalidSignature

    data = note.text.encode()
    for s in note.signatures:
        for kid, raw, pub in keys:
            if key_hash(s.name, raw) != s.hash:
                continue
            try:
                pub.verify(s.sig, data)
            except InvalidSignature:
                continue
            return kid
    return None
