"""Personal data: stable keyed pseudonyms for user names, and a retention period for the ledger.

A pseudonym is ``"u-" + HMAC-SHA256(key, user name)[:16 hex]``: stable across runs and exports (the same user
always gets the same pseudonym, so per-user totals stay comparable) but not reversible without the key, and not
guessable from a list of user names without the key (a plain hash would be). The key is 32 random bytes in
``<data-dir>/pseudonym.key`` (mode 0600), created on first use. Deleting the key unlinks every pseudonym ever
issued from its user.

Retention: :func:`apply_retention` replaces user name and uid in the store's job records that ended more than N
days ago by the pseudonym. The audit log never holds user names in clear (``accounting.audit.open_log``), so it
needs no rewriting, and its hash chain stays intact.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from gpuledger.accounting.ledger import LedgerEntry

KEY_NAME = "pseudonym.key"
PREFIX = "u-"


def load_or_create_key(data_dir: str | os.PathLike[str]) -> bytes:
    """The data dir's pseudonymization key; created (O_EXCL, mode 0600) when absent, so two first users race
    safely: the loser reads the winner's key."""
    path = Path(data_dir) / KEY_NAME
    Path(data_dir).mkdir(parents=True, exist_ok=True)
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


def apply_retention(
    store_path: str | os.PathLike[str], pseudonymize: Pseudonymizer, days: float, now: float | None = None
) -> int:
    """Pseudonymize user name (and drop the uid) in job records that ended more than ``days`` ago.

    Works on the collector's SQLite store directly (its ``jobs`` table: ``job_id, cluster, data`` with ``data``
    the JobRecord's JSON), one transaction. Jobs without an end are still running and kept. Returns the number
    of records changed; running it again changes none.
    """
    if not days >= 0:
        raise ValueError(f"retention days must be >= 0, got {days!r}")
    cutoff = (time.time() if now is None else now) - days * 86400.0
    path = Path(store_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no gpuledger store")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout=10000")
        db.execute("BEGIN IMMEDIATE")
        changed = []
        try:
            for job_id, cluster, data in db.execute("SELECT job_id, cluster, data FROM jobs").fetchall():
                try:
                    d = json.loads(data)
                except ValueError as e:
                    raise ValueError(f"{path}: job {job_id}@{cluster}: record is not JSON: {e}") from None
                end, user = d.get("end"), d.get("user")
                if end is None or end >= cutoff or ((user is None or is_pseudonym(user)) and d.get("uid") is None):
                    continue
                d["user"] = None if user is None else pseudonymize(user)
                d["uid"] = None
                changed.append((json.dumps(d, sort_keys=True), job_id, cluster))
            db.executemany("UPDATE jobs SET data=? WHERE job_id=? AND cluster=?", changed)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return len(changed)
    finally:
        db.close()


def pseudonymize_entries(entries: Iterable[LedgerEntry], alias: Callable[[str], str]) -> list[LedgerEntry]:
    """The same entries with user names replaced by ``alias(user)`` and uids dropped (for every export)."""
    out = []
    for e in entries:
        r = e.record
        if r is not None and (r.user is not None or r.uid is not None):
            r = replace(r, user=None if r.user is None else alias(r.user), uid=None)
        out.append(LedgerEntry(e.job_id, r, e.usage))
    return out
