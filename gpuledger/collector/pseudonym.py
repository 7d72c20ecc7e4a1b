"""Stable keyed pseudonyms for user names (the audit log and exports never hold user names in clear).

A pseudonym is ``"u-" + HMAC-SHA256(key, user name)[:16 hex]``: stable across runs and exports (the same user
always gets the same pseudonym, so per-user totals stay comparable) but not reversible without the key, and not
guessable from a list of user names without the key (a plain hash would be). The key is 32 random bytes in
``<data-dir>/pseudonym.key`` (mode 0600), created on first use. Deleting the key unlinks every pseudonym ever
issued from its user. It lives in the collector because the collector writes job records to the audit log.

A PostgreSQL ledger keeps its key in its own database (table ``pseudonym_key``; :func:`ledger_key`): every
collector and command sharing the ledger, from whatever data dir, then pseudonymizes alike, and the shared audit
log holds one pseudonym per user. The database holds the users' names in its job records already, so the key
there tells its readers nothing new.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from gpuledger.collector.auditlog.files import private_dir
from gpuledger.collector.db import is_postgres_url, open_database, redact

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


_LEDGER_KEY = "CREATE TABLE IF NOT EXISTS pseudonym_key (id INTEGER PRIMARY KEY, value BLOB NOT NULL);"


def ledger_key(ledger_url: str | None, data_dir: str | os.PathLike[str]) -> bytes:
    """The pseudonymization key of the ledger at ``ledger_url``: a PostgreSQL ledger's, kept in its database, or
    (no URL, or an embedded ledger) the data dir's (:func:`load_or_create_key`).

    The first user of a PostgreSQL ledger stores the data dir's key file if there is one (pseudonyms it issued
    before stay valid), or a new random key; later users read it. A data dir whose key file differs is refused
    (ValueError): pseudonyms issued with it would not match the ledger's."""
    if not is_postgres_url(ledger_url):
        return load_or_create_key(data_dir)
    assert ledger_url is not None
    path = Path(data_dir) / KEY_NAME
    local = path.read_bytes() if path.is_file() else None
    db = open_database(ledger_url)
    try:
        with db.transaction():
            db.script(_LEDGER_KEY)
            db.execute("INSERT INTO pseudonym_key (id, value) VALUES (1, ?) ON CONFLICT (id) DO NOTHING",
                       (local if local is not None else secrets.token_bytes(32),))
            key = bytes(db.execute("SELECT value FROM pseudonym_key WHERE id = 1").fetchone()[0])
    finally:
        db.close()
    if local is not None and local != key:
        raise ValueError(f"{path}: pseudonymization key differs from the one the ledger {redact(ledger_url)} keeps "
                         "(every user of a shared ledger pseudonymizes with the ledger's); move this file away")
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

    @classmethod
    def for_ledger(cls, ledger_url: str | None, data_dir: str | os.PathLike[str]) -> Pseudonymizer:
        """The ledger's pseudonymizer (see :func:`ledger_key`)."""
        return cls(ledger_key(ledger_url, data_dir))

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
