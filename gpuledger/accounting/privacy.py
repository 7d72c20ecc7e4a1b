"""Personal data: a retention period for the ledger; the keyed pseudonyms it uses are ``collector.pseudonym``.

Retention: :func:`apply_retention` replaces user name and uid in the store's job records that ended more than N
days ago by the pseudonym. The audit log never holds user names in clear (``collector.auditlog.open_log``), so it
needs no rewriting, and its hash chain stays intact.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.collector.pseudonym import KEY_NAME, PREFIX, Pseudonymizer, is_pseudonym, load_or_create_key  # noqa: F401
from gpuledger.schema.records import JobRecord


def apply_retention(
    store_path: str | os.PathLike[str], pseudonymize: Pseudonymizer, days: float, now: float | None = None
) -> int:
    """Pseudonymize user name (and drop the uid) in job records that ended more than ``days`` ago.

    Works on the collector's SQLite store directly (its ``jobs`` table: ``cluster, job_id, source, data`` with
    ``data`` the JobRecord's JSON), one transaction. Jobs without an end are still running and kept. Returns the number
    of records changed; running it again changes none.
    """
    if not days >= 0:
        raise ValueError(f"retention days must be >= 0, got {days!r}")
    cutoff = (time.time() if now is None else now) - days * 86400.0
    path = Path(store_path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no gpuledger store")
    from gpuledger.collector.store import SqliteStore

    SqliteStore(path).close()  # an older store is migrated to today's tables first
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout=10000")
        db.execute("BEGIN IMMEDIATE")
        changed = []
        try:
            for job_id, cluster, source, data in db.execute("SELECT job_id, cluster, source, data FROM jobs").fetchall():
                try:
                    d = json.loads(data)
                except ValueError as e:
                    raise ValueError(f"{path}: job {job_id}@{cluster}: record is not JSON: {e}") from None
                end, user = d.get("end"), d.get("user")
                if end is None or end >= cutoff or ((user is None or is_pseudonym(user)) and d.get("uid") is None):
                    continue
                d["user"] = None if user is None else pseudonymize(user)
                d["uid"] = None
                changed.append((json.dumps(d, sort_keys=True), job_id, cluster, source))
            db.executemany("UPDATE jobs SET data=? WHERE job_id=? AND cluster=? AND source=?", changed)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return len(changed)
    finally:
        db.close()


def pseudonymize_entries(entries: Iterable[LedgerEntry], alias: Callable[[str], str]) -> list[LedgerEntry]:
    """The same entries with user names replaced by ``alias(user)`` and uids dropped (for every export)."""
    def hide(r: JobRecord | None) -> JobRecord | None:
        if r is not None and (r.user is not None or r.uid is not None):
            r = replace(r, user=None if r.user is None else alias(r.user), uid=None)
        return r

    return [replace(e, record=hide(e.record), agent_record=hide(e.agent_record)) for e in entries]
