"""Versioned migrations of the ledger's tables, the same on SQLite and PostgreSQL.

``schema_migrations (version, name, applied_at)`` lists the migrations a ledger has had. The store applies the
pending ones when it opens the ledger (:func:`migrate`), in one transaction under the ledger's ``migrations``
lock, so two collectors starting together apply each migration once; ``gpuledger ledger migrate`` does the
same by hand and ``gpuledger ledger status`` shows where a ledger stands (:func:`status`).

SQLite stores written before migrations were versioned carry a format number in ``meta`` (``schema``: 1, 2 or 3;
migration 3 makes it 4, which those releases refuse).
They are brought to today's tables without losing data: a v2 ledger is converted (``ledger_store.migrate_v2``,
found by its layout, before the versioned migrations), then migration 1 creates what was added since (CREATE
IF NOT EXISTS: what a store has is kept). (A v1 store's raw ``samples`` table
is the series store's: the store repacks it into chunks after the ledger migrations.) A ledger with a migration
this code does not know, or a ``meta`` format above 4, was written by a newer gpuledger: refused
(:class:`LedgerTooNew`), before anything is written.

Accumulator fields added to the aggregation become columns on every open (``ledger_store.add_columns``): they
need no migration of their own. Anything else that changes a table is a new :class:`Migration` at the end of
:data:`MIGRATIONS`; a migration is never edited once released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuledger.collector.db import Database
from gpuledger.collector.ledger_store import HOSTS_TABLE, SCHEMA, add_columns, migrate_v2, needs_migration

log = logging.getLogger(__name__)

META_TABLE = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
# The ``meta`` format number this code writes: 4 from migration 3 on. Releases before versioned migrations read
# formats 1-3 and would open a ledger with migrations they do not know (a rollback after an upgrade) without a word;
# they refuse 4.
META_FORMAT = 4
LEGACY_FORMATS = (1, 2, 3, META_FORMAT)  # what it reads (and migrates)
_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
  version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"""
LOCK = "migrations"


class LedgerTooNew(RuntimeError):
    """The ledger was written by a newer gpuledger than this one (a migration or format it does not know)."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Database], None]  # runs inside the migrating transaction


def _legacy_v2(db: Database) -> bool:
    """Convert a v2 ledger (its layout: usage without a cluster column) to today's tables; whether it was one.
    Found by its layout, not by a version, so it runs whatever ``schema_migrations`` says."""
    if not needs_migration(db):
        return False
    migrate_v2(db)
    db.script(SCHEMA)  # the tables v3 added
    db.execute("UPDATE meta SET value=? WHERE key='schema' AND value='2'", (str(META_FORMAT),))
    return True


def _ledger_tables(db: Database) -> None:
    db.script(META_TABLE)
    db.script(SCHEMA)
    # a new store is of today's format; a v1 store keeps "1" until the store has repacked its samples
    db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO NOTHING", (str(META_FORMAT),))


def _hosts(db: Database) -> None:
    db.script(HOSTS_TABLE)


def _versioned_format(db: Database) -> None:
    # a v1 store keeps "1" until the store has repacked its samples (it writes META_FORMAT then)
    db.execute("UPDATE meta SET value=? WHERE key='schema' AND value='3'", (str(META_FORMAT),))


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "ledger tables: jobs by (cluster, job id), usage per GPU, hourly buckets, gaps, batch keys",
              _ledger_tables),
    Migration(2, "hosts: each host's write generation (several collectors on one ledger)", _hosts),
    Migration(3, "meta format 4: releases before versioned migrations refuse the ledger", _versioned_format),
)
LATEST = MIGRATIONS[-1].version


@dataclass(frozen=True, slots=True)
class Applied:
    version: int
    name: str
    applied_at: float  # unix seconds


@dataclass(frozen=True, slots=True)
class Status:
    applied: list[Applied]  # in version order, unknown (newer) ones included
    pending: list[Migration]
    meta_format: int | None  # the legacy ``meta`` format number, None for a ledger without one

    @property
    def unknown(self) -> list[Applied]:
        """Applied migrations this code does not know: the ledger is newer than this gpuledger."""
        return [a for a in self.applied if a.version > LATEST]


def _meta_format(db: Database) -> int | None:
    if not db.has_table("meta"):
        return None
    row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
    return None if row is None else int(row[0])


def status(db: Database) -> Status:
    """Where ``db`` stands; reads only."""
    applied = []
    if db.has_table("schema_migrations"):
        applied = [Applied(int(v), n, float(t)) for v, n, t in
                   db.execute("SELECT version, name, applied_at FROM schema_migrations ORDER BY version").fetchall()]
    done = {a.version for a in applied}
    return Status(applied, [m for m in MIGRATIONS if m.version not in done], _meta_format(db))


def check_known(db: Database, st: Status) -> None:
    """Raise :class:`LedgerTooNew` for a ledger written by a newer gpuledger."""
    if st.unknown:
        newest = st.unknown[-1]
        raise LedgerTooNew(f"ledger {db.url} has migration {newest.version} ({newest.name!r}); this gpuledger knows "
                           f"migrations up to {LATEST}: upgrade gpuledger to open it")
    if st.meta_format is not None and st.meta_format not in LEGACY_FORMATS:
        raise LedgerTooNew(f"ledger {db.url}: store schema {st.meta_format}, this gpuledger reads {META_FORMAT} "
                           f"(and migrates 1 to 3); use a gpuledger release that knows schema {st.meta_format}")


def migrate(db: Database, clock: Callable[[], float] = time.time) -> list[Migration]:
    """Apply the pending migrations (and columns for new accumulator fields) in one transaction under the
    ledger's migrations lock; returns those applied (none when up to date). Idempotent. Call inside the
    caller's transaction to add its own schema work under the same lock (the store does, for its series)."""
    with db.transaction():
        db.lock(LOCK)  # first: two collectors starting at once must not both create or alter a table
        db.script(_TABLE)
        st = status(db)
        check_known(db, st)
        if db.has_table("meta") and _legacy_v2(db):
            log.info("%s: ledger converted from schema 2 (jobs keyed by cluster and job id)", db.url)
        for m in st.pending:
            m.apply(db)
            db.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                       (m.version, m.name, clock()))
        add_columns(db)
    return st.pending
