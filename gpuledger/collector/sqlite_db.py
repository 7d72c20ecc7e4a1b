"""The collector's SQLite connection and its one way of running a transaction.

The ledger and the series store share one connection (one file), so a batch's samples, usage and batch
id commit in one transaction: stored whole or not at all.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager


def connect(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """A connection in WAL mode that commits durably; transactions are explicit (see :func:`transaction`)."""
    # isolation_level=None: we issue BEGIN/COMMIT ourselves so one batch is one transaction.
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")  # WAL + FULL: a commit survives power loss
    db.execute("PRAGMA busy_timeout=10000")
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (which is re-raised)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
