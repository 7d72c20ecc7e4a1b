"""Test set-up that differs between the ledger engines (triggers, commit counts); the tests themselves do not."""

from __future__ import annotations

from collections.abc import Callable


def fail_inserts(store, table: str, when: str, message: str) -> None:
    """Make inserts into ``table`` whose new row satisfies ``when`` (SQL over ``NEW``) fail with ``message``: a write
    that breaks a transaction half-way, on either engine. :func:`allow_inserts` undoes it."""
    if store.db.dialect == "sqlite":
        store.db.execute(f"CREATE TRIGGER boom BEFORE INSERT ON {table} WHEN {when} "
                         f"BEGIN SELECT RAISE(ABORT, '{message}'); END")
        return
    store.db.execute(f"CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF {when} THEN "
                     f"RAISE EXCEPTION '{message}'; END IF; RETURN NEW; END $$")
    store.db.execute(f"CREATE TRIGGER boom BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION boom()")


def allow_inserts(store, table: str) -> None:
    store.db.execute(f"DROP TRIGGER boom{'' if store.db.dialect == 'sqlite' else ' ON ' + table}")
    if store.db.dialect != "sqlite":
        store.db.execute("DROP FUNCTION boom()")


def commit_counter(store) -> Callable[[], int]:
    """A function giving how many write transactions the store's database committed since this call (SQLite: its
    COMMIT statements; PostgreSQL: transaction ids assigned, one per writing transaction, in a cluster run without
    autovacuum, whose ANALYZE takes ids too: tests.servers.PostgresServer)."""
    if store.db.dialect == "sqlite":
        commits: list[str] = []
        store.db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        return lambda: len(commits)
    xid = lambda: int(store.db.execute("SELECT txid_current()").fetchone()[0])  # noqa: E731 - itself one
    start = xid()
    return lambda: xid() - start - 1
