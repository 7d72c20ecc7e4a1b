"""Signing keys outside the data directory, key ids, and the keyring that keeps old reports verifiable.

The private key is an Ed25519 PEM file the admin places (default ``$XDG_CONFIG_HOME/gpuledger/audit-signing.key``,
``GPULEDGER_AUDIT_KEY`` overrides), never in the data directory: whoever rewrites the log must not also hold the
key that signs its checkpoints. It is written 0600 and refused when group or others can read it; its public key
(``.pub`` beside it) is written 0644 whatever the umask. A key id is ``ed25519:`` + the first 16 hex digits of
SHA-256 of the raw public key; manifests and checkpoints name the key that signed them.

Rotation (``keygen --force`` over an existing key) writes a record into the keyring beside the key
(``audit-keyring.json``) and into the audit log: the retired and the new public key, each signing the record.
A verifier that pins one key trusts exactly the keys reachable from it through such records, so reports signed
before a rotation still verify against the new pinned key, and a record forged without either private key is
ignored wherever it sits.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuledger.collector.auditlog import AuditError, AuditLog, canonical_json
from gpuledger.collector.auditlog.files import private_dir

if TYPE_CHECKING:  # cryptography is imported where a key is used, not when this module is
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PRIVATE_KEY_NAME = "audit-signing.key"
KEYRING_NAME = "audit-keyring.json"
KEYRING_FORMAT = "gpuledger-audit-keyring/1"
ENV_KEY = "GPULEDGER_AUDIT_KEY"
KEY_NAME = "gpuledger-audit"  # the signer's name in checkpoints (a signed note's key name)


def default_private_key_path() -> Path:
    env = os.environ.get(ENV_KEY)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpuledger" / PRIVATE_KEY_NAME


def public_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.stem + ".pub")


def raw_public(pub: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class PublicKey:
    key_id: str
    raw: bytes
    key: Ed25519PublicKey

    @classmethod
    def from_raw(cls, raw: bytes) -> PublicKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return cls(key_id(raw), raw, Ed25519PublicKey.from_public_bytes(raw))

    def verifies(self, sig: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.key.verify(sig, data)
            return True
        except InvalidSignature:
            return False


@dataclass(frozen=True)
class SigningKey:
    path: Path
    private: Ed25519PrivateKey
    public: PublicKey

    @property
    def key_id(self) -> str:
        return self.public.key_id


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """The private key at ``path``; refused when group or others may read it (it would not be a secret)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
        pem = p.read_bytes()
    except FileNotFoundError:
        raise AuditError(f"{p}: no signing key (run `gpuledger audit keygen`, or set {ENV_KEY})") from None
    except OSError as e:
        raise AuditError(f"{p}: cannot read the signing key: {e.strerror}") from None
    if mode & 0o077:
        raise AuditError(f"{p}: private key is readable by group or others (mode {mode:04o}); run chmod 600 {p}")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise AuditError(f"{p}: not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditError(f"{p}: not an Ed25519 key")
    return SigningKey(p, key, PublicKey.from_raw(raw_public(key.public_key())))


def load_public_key(path: str | os.PathLike[str]) -> PublicKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path)
    try:
        key = serialization.load_pem_public_key(p.read_bytes())
    except FileNotFoundError:
        raise AuditError(f"{p}: no public key there") from None
    except OSError as e:
        raise AuditError(f"{p}: cannot read the public key: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise AuditError(f"{p}: not a PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AuditError(f"{p}: not an Ed25519 public key")
    return PublicKey.from_raw(raw_public(key))


def _write(path: Path, data: bytes, mode: int) -> None:
    """Atomically replace ``path`` with a file created ``mode`` (exact: the umask cannot widen or narrow it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class KeygenResult:
    private: Path
    public: Path
    key_id: str
    rotation: dict[str, Any] | None  # the keyring record when an older key was retired


def keygen(path: str | os.PathLike[str] | None = None, *, force: bool = False,
           now: float | None = None) -> KeygenResult:
    """Create an Ed25519 key pair at ``path`` (default: the config dir). Over an existing key only with ``force``:
    that is a rotation, recorded in the keyring beside the key (append its record to the audit log too)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv = Path(path) if path is not None else default_private_key_path()
    pub = public_path(priv)
    old: SigningKey | None = None
    if priv.exists():
        if not force:
            raise FileExistsError(f"{priv} exists; keep it (reports signed with it verify against it) or pass --force "
                                  "to rotate (old reports stay verifiable through the keyring)")
        old = load_signing_key(priv)
    private_dir(priv.parent)
    key = Ed25519PrivateKey.generate()
    new = SigningKey(priv, key, PublicKey.from_raw(raw_public(key.public_key())))
    rotation = None
    if old is not None:
        rotation = rotation_record(old, new, time.time() if now is None else now)
        add_to_keyring(keyring_path(priv), rotation)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write(priv, pem, 0o600)
    _write(pub, key.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)
    return KeygenResult(priv, pub, new.key_id, rotation)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def keyring_path(private_path: Path) -> Path:
    return private_path.with_name(KEYRING_NAME)


def _rotation_body(old: PublicKey, new: PublicKey, at: float) -> dict[str, Any]:
    return {"retired": {"key_id": old.key_id, "public_key": base64.b64encode(old.raw).decode()},
            "successor": {"key_id": new.key_id, "public_key": base64.b64encode(new.raw).decode()},
            "retired_at": at}


def rotation_record(old: SigningKey, new: SigningKey, at: float) -> dict[str, Any]:
    """Both keys sign the record: trust flows from either one to the other."""
    body = _rotation_body(old.public, new.public, at)
    msg = canonical_json(body).encode()
    return {**body, "signatures": {"retired": base64.b64encode(old.private.sign(msg)).decode(),
                                   "successor": base64.b64encode(new.private.sign(msg)).decode()}}


def add_to_keyring(path: Path, record: Mapping[str, Any]) -> None:
    records = read_keyring(path) if path.exists() else []
    private_dir(path.parent)
    keyring = {"format": KEYRING_FORMAT, "rotations": [*records, dict(record)]}
    _write(path, (json.dumps(keyring, indent=2) + "\n").encode(), 0o644)


def read_keyring(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != KEYRING_FORMAT or not isinstance(doc.get("rotations"), list):
            raise ValueError(f"not a {KEYRING_FORMAT} document")
        return list(doc["rotations"])
    except OSError as e:
        raise AuditError(f"{path}: cannot read the keyring: {e.strerror}") from None
    except (ValueError, AttributeError) as e:
        raise AuditError(f"{path}: not a keyring: {e}") from None


class TrustedKeys:
    """The pinned keys and every key a rotation record links to them, signed by the side already trusted.

    A key is trusted for what it signed during its term only: from the rotation that made it (when one did) to
    the rotation that retired it. A retired key may have been kept or leaked (why one rotates), so a signature
    of it dated after its retirement, or not dated at all, is not taken as its (``term_problem``)."""

    def __init__(self, pinned: Iterable[PublicKey], rotations: Iterable[Mapping[str, Any]] = (),
                 retired_in: Mapping[str, int] | None = None) -> None:
        self._keys = {k.key_id: k for k in pinned}
        self._retired_in = dict(retired_in or {})  # key id -> the audit entry that records its retirement
        self.pinned = tuple(self._keys)
        parsed = [r for r in (_parse_rotation(x) for x in rotations) if r is not None]
        changed = True
        while changed:
            changed = False
            for old, new, msg, sig_old, sig_new, _ in parsed:
                if (new.key_id in self._keys and old.key_id not in self._keys
                        and self._keys[new.key_id].verifies(sig_new, msg)):
                    self._keys[old.key_id] = old
                    changed = True
                if (old.key_id in self._keys and new.key_id not in self._keys
                        and self._keys[old.key_id].verifies(sig_old, msg)):
                    self._keys[new.key_id] = new
                    changed = True
        # terms from the records both keys signed (the retired key's own word, and its successor's)
        self._retired: dict[str, float] = {}
        self._created: dict[str, float] = {}
        for old, new, msg, sig_old, sig_new, at in parsed:
            if old.verifies(sig_old, msg) and new.verifies(sig_new, msg) and old.key_id in self._keys:
                self._retired[old.key_id] = min(at, self._retired.get(old.key_id, at))
                self._created[new.key_id] = min(at, self._created.get(new.key_id, at))

    def get(self, kid: str) -> PublicKey | None:
        return self._keys.get(kid)

    def keys(self) -> list[PublicKey]:
        return list(self._keys.values())

    def term_problem(self, kid: str, signed_at: float | None, size: int | None = None) -> str | None:
        """Why a signature of key ``kid`` dated ``signed_at`` over a tree of ``size`` entries falls outside the
        key's term (None: inside). Dates are whole seconds (a checkpoint's time line), so the second the key was
        made in counts as its term; a tree that holds the entry recording the key's retirement was signed after it,
        whatever date it states."""
        retired, created = self._retired.get(kid), self._created.get(kid)
        if retired is not None and signed_at is None:
            return f"signed by key {kid}, retired at {_iso(retired)}, and not dated (a retired key's word counts " \
                   "only for what it signed before)"
        if retired is not None and signed_at is not None and signed_at > retired:
            return f"signed by key {kid}, retired at {_iso(retired)}, but dated {_iso(signed_at)} (after its " \
                   "retirement: forged with a retired key?)"
        if created is not None and signed_at is not None and signed_at < math.floor(created):
            return f"signed by key {kid}, made at {_iso(created)}, but dated {_iso(signed_at)} (before the key existed)"
        at = self._retired_in.get(kid)
        if retired is not None and at is not None and size is not None and size >= at:
            return (f"signed by key {kid}, retired at {_iso(retired)}, over {size} entries: audit entry {at} records "
                    "that retirement (signed after it: forged with a retired key?)")
        return None

    def keys_at(self, signed_at: float | None, size: int | None = None) -> list[PublicKey]:
        """The keys whose term covers ``signed_at`` (and a tree of ``size`` entries)."""
        return [k for k in self._keys.values() if self.term_problem(k.key_id, signed_at, size) is None]

    def __bool__(self) -> bool:
        return bool(self._keys)


def _parse_rotation(r: Mapping[str, Any]) -> tuple[PublicKey, PublicKey, bytes, bytes, bytes, float] | None:
    try:
        old = PublicKey.from_raw(base64.b64decode(r["retired"]["public_key"], validate=True))
        new = PublicKey.from_raw(base64.b64decode(r["successor"]["public_key"], validate=True))
        at = r["retired_at"]
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            return None
        body = _rotation_body(old, new, at)
        sigs = r["signatures"]
        return (old, new, canonical_json(body).encode(), base64.b64decode(sigs["retired"], validate=True),
                base64.b64decode(sigs["successor"], validate=True), float(at))
    except (KeyError, TypeError, ValueError, AuditError):
        return None  # a malformed record links nothing


def trusted_keys(public_keys: Iterable[str | os.PathLike[str]], log: AuditLog | None = None,
                 keyrings: Iterable[str | os.PathLike[str]] = ()) -> TrustedKeys:
    """Pinned public keys, extended by rotation records from the keyring files and the audit log."""
    pinned = [load_public_key(p) for p in public_keys]
    rotations: list[Mapping[str, Any]] = []
    for k in keyrings:
        if Path(k).exists():
            rotations += read_keyring(Path(k))
    retired_in: dict[str, int] = {}
    if log is not None:
        for e in log.entries(kind="key_rotation"):
            if isinstance(e.data, dict):
                rotations.append(e.data)
                r = _parse_rotation(e.data)
                if r is not None and r[0].verifies(r[3], r[2]) and r[1].verifies(r[4], r[2]):  # both keys signed it
                    retired_in.setdefault(r[0].key_id, e.seq)
    return TrustedKeys(pinned, rotations, retired_in)
