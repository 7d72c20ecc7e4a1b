"""Stable keyed pseudonyms for user names (the audit log and exports never hold user names in clear).

A pseudonym is ``"u-" + HMAC-SHA256(key, user name)[:16 hex]``: stable across runs and exports (the same user
always gets the same pseudonym, so per-user totals stay comparable) but not reversible without the key, and not
guessable from a list of user names without the key (a plain hash would be). The key is 32 random bytes in
``<data-dir>/pseudonym.key`` (mode 0600), created on first use. Deleting the key unlinks every pseudonym ever
issued from its user. It lives in the collector because the collector writes job records to the audit log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from gpuledger.collector.auditlog.files import private_dir

KEY_NAME = "pseudonym.key"
PREFIX = "u-"


def load_or_create_key(data_dir: str | os.PathLike[str]) -> bytes:
    """The data dir's pseudonymization key; created (O_EXCL, mode 0600) when absent, so two first users race
    safely: the loser reads the winner's key."""
    path = Path(data_dir) / KEY_NAME
    private_dir(data_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) < 16:
            raise ValueError(f"{path}: pseudonymization key has {len(key)} bytes, expected 32") from None
        return key
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


class Pseudonymizer:
    """``p(user) -> "u-<16 hex>"``; pseudonyms (and None) map to themselves, so applying it twice is harmless."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("pseudonymization key must have at least 16 bytes")
        self._key = key
        self._cache: dict[str, str] = {}

    @classmethod
    def for_data_dir(cls, data_dir: str | os.PathLike[str]) -> Pseudonymizer:
        return cls(load_or_create_key(data_dir))

    def __call__(self, user: str) -> str:
        out = self._cache.get(user)
        if out is None:
            if is_pseudonym(user):
                out = user
            else:
                out = PREFIX + hmac.new(self._key, user.encode(), hashlib.sha256).hexdigest()[:16]
            self._cache[user] = out
        return out


def is_pseudonym(name: str) -> bool:
    return len(name) == len(PREFIX) + 16 and name.startswith(PREFIX) and all(c in "0123456789abcdef" for c in name[2:])
