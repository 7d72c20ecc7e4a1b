"""The one database seam under the ledger, the chunk series store and the audit log: embedded SQLite (the
default) or PostgreSQL (a ledger shared by several collectors, kept by a site's DBAs).

Code above this module writes one SQL dialect, SQLite's portable subset, and never branches on the engine:

- placeholders ``?``; no ``%`` needs escaping (translated for psycopg here);
- DDL types ``TEXT``, ``INTEGER`` (64-bit), ``REAL`` (a double: PostgreSQL's ``REAL`` is 32-bit, so it becomes
  ``DOUBLE PRECISION``, or stored totals would lose bits), ``BLOB`` (``BYTEA``); ``WITHOUT ROWID`` is dropped
  for PostgreSQL. An ``INTEGER PRIMARY KEY`` an insert leaves out is assigned in insertion order (SQLite's
  rowid; a PostgreSQL identity column). DDL goes through :meth:`Database.script`;
- upserts as ``INSERT ... ON CONFLICT (key) DO UPDATE SET c=excluded.c`` (:func:`upsert`), never
  ``INSERT OR REPLACE``; sums as ``COALESCE(SUM(x), 0)``, never ``TOTAL``; reserved words (``end``) quoted;
- :meth:`Database.snapshot` reads several statements from one consistent state without blocking writers;
  :meth:`Database.reader` gives a thread a connection of its own for long reads while another thread writes
  (SQLite: a second connection to the file; PostgreSQL: the pool, which is thread-safe);
- :meth:`Database.lock` serialises a critical section across processes inside a transaction (SQLite's
  ``BEGIN IMMEDIATE`` already does; PostgreSQL takes a transaction-scoped advisory lock);
  :meth:`Database.try_lock` takes a lock for a longer task made of several transactions, or says it is taken
  (PostgreSQL: a session advisory lock; SQLite: a lock file next to the database);
- ``INSERT ... RETURNING`` works on both (SQLite >= 3.35).

:func:`open_database` takes a path or ``sqlite:///path`` for SQLite, ``postgresql://...`` for PostgreSQL.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import select
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from itertools import chain
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

SQLITE, POSTGRESQL = "sqlite", "postgresql"
MAX_LIST_VALUES = 500  # values bound in one statement's IN (...) or VALUES list: well under SQLite's limit
# PostgreSQL, per session. A collector frozen inside a transaction (a VM stall, SIGSTOP) holds its row locks; without
# these, every other collector waiting on one of them would wait for ever, and its whole ingest behind it. A lock
# wait past LOCK_TIMEOUT fails the statement (DatabaseBusy: the agent retries); a transaction idle past
# IDLE_IN_TRANSACTION_TIMEOUT is ended by the server (rolled back), which releases what it held.
LOCK_TIMEOUT = "5s"
IDLE_IN_TRANSACTION_TIMEOUT = "60s"
# PostgreSQL, client side (libpq), on every connection: a link that goes silent (a partition, a failover that leaves
# the old primary's address dead) is otherwise noticed only when the kernel stops retransmitting (net.ipv4.tcp_retries2:
# about 15 minutes), and the store's committer, every batch behind it, waits that long. A connection waiting for an
# answer probes its peer after TCP_KEEPALIVE_IDLE_S of silence, every TCP_KEEPALIVE_INTERVAL_S; one whose probes or
# data stay unacknowledged TCP_USER_TIMEOUT_S is dropped (on Linux the user timeout decides for the probes too,
# elsewhere TCP_KEEPALIVE_COUNT of them), and its statement fails (DatabaseUnavailable: 503, the agent resends, and a
# batch whose COMMIT did reach the server is then a duplicate). A live server that is slow to answer (a COMMIT waiting
# for a synchronous standby) acknowledges both, so these never cut a wait for it: the collector's ledger_timeout_s
# answers that request 503 instead (collector.server). A URL that sets one of these keeps its own.
TCP_KEEPALIVE_IDLE_S = 10
TCP_KEEPALIVE_INTERVAL_S = 5
TCP_KEEPALIVE_COUNT = 3
TCP_USER_TIMEOUT_S = 30


class DatabaseUnavailable(Exception):
    """The database cannot be reached (server down, connection lost): nothing was written; try again later."""


class DatabaseBusy(DatabaseUnavailable):
    """A lock this transaction needs is held past ``LOCK_TIMEOUT`` (another collector stalled inside a transaction):
    nothing was written; the other statements of a group may well succeed without this one's."""


class DatabaseConfigError(ValueError):
    """The database server answered and refuses this configuration: no such database, an unknown role, credentials
    it does not accept, a connection its pg_hba.conf does not allow. Nothing can succeed until the configuration
    changes (a restart cannot help): a command exits 2 (``collector.ledger_url.database_failures``)."""


class DatabaseFull(Exception):
    """The database's disk (or quota) is full: nothing of the failed transaction was written."""


class Rows(Protocol):
    """What :meth:`Database.execute` returns: a cursor's reading side."""

    rowcount: int

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Database(Protocol):
    dialect: str
    url: str  # for messages: a PostgreSQL password is never in it

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Rows: ...
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int: ...  # rows changed, in all
    def transaction(self) -> Any: ...  # context manager; nested use joins the outer transaction
    def ready_to_write(self) -> bool: ...  # whether a transaction would start now, without waiting for a writer
    def snapshot(self) -> Any: ...  # context manager: reads see one state while writers go on; joins a transaction
    def reader(self) -> AbstractContextManager[Database]: ...  # another connection, for another thread's reads
    def lock(self, name: str) -> None: ...
    def try_lock(self, name: str) -> AbstractContextManager[bool]: ...
    def script(self, ddl: str) -> None: ...
    def columns(self, table: str) -> list[str]: ...
    def has_table(self, table: str) -> bool: ...
    def close(self) -> None: ...


def upsert(table: str, columns: Sequence[str], key: Sequence[str], rows: int = 1) -> str:
    """``INSERT INTO table (columns) VALUES (?, ...), ... ON CONFLICT (key) DO UPDATE SET`` every other column (or
    ``DO NOTHING`` when all columns are the key), for ``rows`` rows (of distinct keys: PostgreSQL refuses one
    statement that updates a row twice): valid in both dialects."""
    cols = ", ".join(_ident(c) for c in columns)
    rest = [c for c in columns if c not in key]
    action = ("DO UPDATE SET " + ", ".join(f"{_ident(c)}=excluded.{_ident(c)}" for c in rest)) if rest else "DO NOTHING"
    values = ",".join([f"({', '.join('?' * len(columns))})"] * rows)
    return f"INSERT INTO {table} ({cols}) VALUES {values} ON CONFLICT ({', '.join(_ident(c) for c in key)}) {action}"


class Upserts:
    """:func:`upsert` of many rows of distinct keys, a few statements for them all: SQLite's ``executemany`` binds,
    steps and resets one statement a row, while one statement of k rows is one step. Statements of 2^j rows (at most
    ``MAX_LIST_VALUES`` values each), so every count is a few of the same few statements (cached by the drivers)."""

    def __init__(self, table: str, columns: Sequence[str], key: Sequence[str]) -> None:
        per = 1 << ((MAX_LIST_VALUES // len(columns)).bit_length() - 1)  # the largest power of two that fits
        self.sizes = [1 << j for j in range(per.bit_length() - 1, -1, -1)]
        self.statements = {k: upsert(table, columns, key, k) for k in self.sizes}

    def write(self, db: Database, rows: Sequence[Sequence[Any]]) -> None:
        """Insert ``rows`` (each ``columns``' values; distinct keys), or update the rows with their keys: in one
        transaction (the caller's, where it has one)."""
        at, total = 0, len(rows)
        if not total:
            return
        with db.transaction():
            for k in self.sizes:
                sql = self.statements[k]
                while total - at >= k:
                    db.execute(sql, list(chain.from_iterable(rows[at:at + k])))
                    at += k


_RESERVED = {"end", "user", "order", "group", "offset", "limit"}


def _ident(name: str) -> str:
    return f'"{name}"' if name.lower() in _RESERVED else name


def statements(script: str) -> list[str]:
    """A DDL script's statements (split on ``;``: DDL here never holds one inside a literal)."""
    return [s.strip() for s in script.split(";") if s.strip()]


# -- SQLite --------------------------------------------------------------------------------------------------------
def _sqlite_error(exc: sqlite3.Error, url: str) -> Exception:
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL or "disk is full" in str(exc):
        return DatabaseFull(str(exc))
    if code == sqlite3.SQLITE_BUSY:  # another process held the write lock past busy_timeout: try again later
        return DatabaseUnavailable(f"SQLite ledger {url}: {exc} (another process held it too long)")
    return exc


def _lock_key(name: str) -> int:
    """A lock name as PostgreSQL's 64-bit advisory lock key."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _read_only_uri(path: Path) -> str:
    """The URI that opens the SQLite file ``path`` read-only and creates nothing beside it. A WAL database a writer
    has open has its -wal and -shm files: read through them (``mode=ro``: the shared read lock of WAL mode, which a
    writer never waits for). Without a -wal (every connection closed: all of it is in the main file), ``mode=ro``
    would create -wal and -shm where the directory is writable (root, the owner), and leave them: the file is read as
    ``immutable`` (no locks, no -shm), as of its state at the open; a collector starting meanwhile writes to a new
    -wal, which this read does not see."""
    uri = f"file:{quote(str(path.absolute()))}?mode=ro"
    return uri if Path(f"{path}-wal").exists() else f"{uri}&immutable=1"


class SqliteDatabase:
    """One connection in WAL mode, durable commits (``synchronous=FULL``); transactions are ``BEGIN IMMEDIATE``,
    so a writer holds the file's one write lock for its whole transaction (even against other processes).
    Not thread-safe by itself: its users serialise access (the collector's store holds a lock)."""

    dialect = SQLITE

    def __init__(self, path: str | os.PathLike[str], read_only: bool = False) -> None:
        """``read_only``: for a query, which must work where this user may only read the file (an auditor's copy, a
        read-only mount), and never writes, creates a file or takes a lock a writer waits for (see _read_only_uri)."""
        self.path = Path(path)
        self.url = str(self.path)
        self.read_only = read_only
        self._writer: int | None = None  # the writers' lock file (see transaction), opened when first needed
        self._writer_held: int | None = None  # the thread that took it with ready_to_write, for its next transaction
        # isolation_level=None: BEGIN/COMMIT are ours, so one batch is one transaction
        if read_only:
            self.conn = sqlite3.connect(_read_only_uri(self.path), uri=True, isolation_level=None,
                                        check_same_thread=False)
            self.conn.execute("PRAGMA busy_timeout=10000")
            return
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA busy_timeout=10000")
        self._wal(deadline=time.monotonic() + 10.0)
        self.conn.execute("PRAGMA synchronous=FULL")  # WAL + FULL: a commit survives power loss

    def _wal(self, deadline: float) -> None:
        """WAL mode. Switching a new file to it is refused at once (SQLITE_BUSY, no busy handler) while another
        connection opens the same file: two collectors starting together. Tried again until ``deadline``."""
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Rows:
        try:
            return self.conn.execute(sql, args)  # type: ignore[return-value]  # rowcount is read-only there
        except sqlite3.Error as exc:
            raise _sqlite_error(exc, self.url) from exc

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        try:
            return self.conn.executemany(sql, rows).rowcount
        except sqlite3.Error as exc:
            raise _sqlite_error(exc, self.url) from exc

    @contextmanager
    def _begun(self, begin: str) -> Iterator[SqliteDatabase]:
        """``begin`` ... COMMIT, rolled back on any exception (re-raised); inside a transaction, joins it."""
        if self.conn.in_transaction:
            yield self
            return
        self.execute(begin)
        try:
            yield self
            self.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise

    @contextmanager
    def transaction(self) -> Iterator[SqliteDatabase]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (re-raised); inside one, joins it.

        Writers queue on a lock file (``<file>-writer.lock``) before BEGIN IMMEDIATE: the kernel wakes the next one
        as the last one lets go. SQLite's own wait for its write lock polls, sleeping 1, 2, 5, 10, 15 ... ms
        between tries, so a process writing often beside another (the collector's workers, its compactor) lost
        milliseconds at every turn."""
        if self.conn.in_transaction:
            yield self
            return
        if self._writer_held != threading.get_ident():  # (held: taken by ready_to_write, for this transaction)
            fcntl.flock(self._writer_fd(), fcntl.LOCK_EX)
        self._writer_held = None
        try:
            with self._begun("BEGIN IMMEDIATE"):
                yield self
        finally:
            fcntl.flock(self._writer_fd(), fcntl.LOCK_UN)

    def ready_to_write(self) -> bool:
        """Take the writers' lock if no other writer has it (never waits), for this thread's next transaction; False
        when another has it. For a caller that must not block (an event loop): it tries again soon, and serves
        meanwhile."""
        if self._writer_held == threading.get_ident():
            return True
        try:
            fcntl.flock(self._writer_fd(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._writer_held = threading.get_ident()
        return True

    def _writer_fd(self) -> int:
        if self._writer is None:
            self._writer = os.open(f"{self.path}-writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
        return self._writer

    def snapshot(self) -> AbstractContextManager[SqliteDatabase]:
        """A read transaction (deferred BEGIN: in WAL mode the first read fixes the state it sees, writers go on);
        inside a transaction, joins it."""
        return self._begun("BEGIN")

    @contextmanager
    def reader(self) -> Iterator[SqliteDatabase]:
        """A second connection to the same file for the block, for a thread that reads while another one writes
        through this one (a connection is not shared between threads; in WAL mode its reads never wait for the
        writer, nor the writer for them). Reads only: a write there would take the file's write lock."""
        other = SqliteDatabase(self.path, read_only=self.read_only)
        try:
            yield other
        finally:
            other.close()

    def lock(self, name: str) -> None:
        """Nothing to do: BEGIN IMMEDIATE holds the database's write lock already."""

    @contextmanager
    def try_lock(self, name: str) -> Iterator[bool]:
        """``name``'s lock file next to the database (``<file>-<name>.lock``), locked for the block if no other
        holder (process or connection) has it: yields whether it was taken, never waits. The kernel releases it
        when its holder dies."""
        fd = os.open(f"{self.path}-{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    def script(self, ddl: str) -> None:
        for statement in statements(ddl):  # one by one: executescript would commit an open transaction
            self.execute(statement)

    def columns(self, table: str) -> list[str]:
        return [r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")]

    def has_table(self, table: str) -> bool:
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?",
                                 (table,)).fetchone() is not None

    def close(self) -> None:
        self.conn.close()
        if self._writer is not None:
            os.close(self._writer)
            self._writer = None


# -- PostgreSQL ----------------------------------------------------------------------------------------------------
_TYPES = [(re.compile(r"\bREAL\b"), "DOUBLE PRECISION"), (re.compile(r"\bBLOB\b"), "BYTEA"),
          (re.compile(r"\bINTEGER PRIMARY KEY\b"), "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
          (re.compile(r"\bINTEGER\b"), "BIGINT"), (re.compile(r"\s*\bWITHOUT ROWID\b"), "")]


def pg_ddl(statement: str) -> str:
    """A DDL statement of the portable dialect as PostgreSQL reads it (types, no WITHOUT ROWID)."""
    for pattern, repl in _TYPES:
        statement = pattern.sub(repl, statement)
    return statement


def redact(url: str) -> str:
    """``url`` without its password (for messages and ``ledger status``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


# A connection's start-up refused for a reason only a change of configuration fixes (DatabaseConfigError), and what to
# say, by the SQLSTATE of the server's refusal (_startup). Any other refusal may pass (53300 too many connections,
# 57P03 the server starting up): DatabaseUnavailable, as a server that is down.
_REFUSALS = {
    "3D000": "no such database [3D000]: create it, or fix the URL",
    "28000": "the server does not let this role in [28000]: no such role (create it, or fix the user in the URL), "
             "one that may not log in, or a pg_hba.conf that does not let it connect from here",
    "28P01": "the server refused the credentials [28P01]: fix the user or its password (a libpq password file, "
             "PGPASSFILE)",
    "42501": "the role may not connect to this database [42501]: GRANT CONNECT",
}
# Where no SQLSTATE came, the failure's text decides, in English, the only language recognised: libpq's own refusals,
# which the server never sent (a password libpq has none to send, SSL the server does not offer, a URL libpq does
# not parse; in this process's language, English unless its locale translates libpq); and the server's messages for
# the refusals above, for a libpq whose trace does not show the start-up (older than 14) or a platform without
# PQtrace (not Linux). Those, from a server whose lc_messages translates them, stay DatabaseUnavailable (exit 1).
_REFUSALS_BY_TEXT = [(re.compile(pattern), problem) for pattern, problem in (
    (r'database ".*" does not exist', _REFUSALS["3D000"]),
    (r'role ".*" does not exist|pg_hba\.conf|is not permitted to log in', _REFUSALS["28000"]),
    (r"authentication failed for user", _REFUSALS["28P01"]),
    (r"permission denied for database|does not have CONNECT privilege", _REFUSALS["42501"]),
    (r"no password supplied|password is required", "the server asks for a password and none is given: put it in a "
                                                    "libpq password file (PGPASSFILE)"),
    (r"SSL was required|server does not support SSL",
     "the URL's sslmode asks for SSL, which the server does not offer"),
    (r"invalid (\w+ )?value|invalid connection option|invalid URI", "the URL is invalid"),
)]
# The server's ErrorResponse in libpq's trace (PQtrace, libpq >= 14): its fields S, V, C (the SQLSTATE), M ... in order
_TRACED_ERROR = re.compile(r'^B\t\d+\tErrorResponse\t.*? C "([0-9A-Z]{5})"', re.M)


def _config_problem(sqlstate: str | None, reason: str) -> str | None:
    """What to fix when a connection's start-up failed for good: by the server's SQLSTATE where it sent one, else
    by the failure's text (see _REFUSALS_BY_TEXT); None when it may pass."""
    if sqlstate is not None:
        return _REFUSALS.get(sqlstate)
    return next((problem for pattern, problem in _REFUSALS_BY_TEXT if pattern.search(reason)), None)


def _startup(url: str, options: dict[str, Any], timeout_s: float) -> tuple[str | None, str] | None:
    """Connect to ``url`` (with libpq ``options``) once and hang up: None when it connected, else the SQLSTATE of the
    server's refusal (None where it sent none) and the failure in one line. Each of the URL's hosts in turn,
    ``timeout_s`` for each, as psycopg.connect does; but psycopg keeps no SQLSTATE of a failed start-up (libpq has
    only its message, in the server's lc_messages language), so the server's ErrorResponse is read from libpq's trace
    of the exchange (kept in memory: it holds the authentication messages). Raises psycopg.ProgrammingError for a URL
    that does not parse, OperationalError when no host name resolves."""
    from psycopg.conninfo import conninfo_attempts, conninfo_to_dict, make_conninfo

    failures = []
    for attempt in conninfo_attempts(conninfo_to_dict(url, **options)):
        failure = _startup_attempt(make_conninfo("", **attempt), timeout_s)
        if failure is None:
            return None
        failures.append(failure)
    return failures[-1][0], "; ".join(" ".join(reason.split()) for _, reason in failures)


def _startup_attempt(conninfo: str, timeout_s: float) -> tuple[str | None, str] | None:
    """One host of _startup."""
    from psycopg import pq

    pgconn = pq.PGconn.connect_start(conninfo.encode())
    # psycopg's trace() fdopen()s the descriptor and PQuntrace() flushes but never fcloses the stream: its descriptor
    # is closed here, and the stream (empty) is left
    trace = os.memfd_create("gpuledger-pg-startup") if sys.platform == "linux" else None
    traced = ""
    try:
        if trace is not None:
            pgconn.trace(trace)
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        deadline = time.monotonic() + timeout_s
        while pgconn.status != pq.ConnStatus.BAD:
            polled = pgconn.connect_poll()
            if polled == pq.PollingStatus.OK:
                return None
            if polled == pq.PollingStatus.FAILED:
                break
            if time.monotonic() >= deadline:
                return None, f"connection to {pgconn.host.decode(errors='replace')} failed: timeout expired"
            waiting = select.poll()
            waiting.register(pgconn.socket, select.POLLIN if polled == pq.PollingStatus.READING else select.POLLOUT)
            waiting.poll(max(0.0, deadline - time.monotonic()) * 1000)
        reason = pgconn.get_error_message()
    finally:
        if trace is not None:
            pgconn.untrace()
        pgconn.finish()
        if trace is not None:
            traced = os.pread(trace, 1 << 20, 0).decode(errors="replace")
            os.close(trace)
    codes = _TRACED_ERROR.findall(traced)
    return (codes[-1] if codes else None), reason


def _tcp_bounds(url: str) -> dict[str, int]:
    """libpq's keepalive and TCP user timeout parameters (see TCP_USER_TIMEOUT_S), but for those ``url`` sets."""
    from psycopg.conninfo import conninfo_to_dict

    bounds = {"keepalives": 1, "keepalives_idle": TCP_KEEPALIVE_IDLE_S, "keepalives_interval": TCP_KEEPALIVE_INTERVAL_S,
              "keepalives_count": TCP_KEEPALIVE_COUNT, "tcp_user_timeout": TCP_USER_TIMEOUT_S * 1000}  # (libpq: ms)
    given = conninfo_to_dict(url)
    return {k: v for k, v in bounds.items() if k not in given}


class _Fetched:
    """Rows read whole (the connection went back to the pool): a cursor's reading side."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self._i = 0
        self.rowcount = rowcount

    def fetchone(self) -> Any:
        if self._i >= len(self._rows):
            return None
        self._i += 1
        return self._rows[self._i - 1]

    def fetchall(self) -> list[Any]:
        out, self._i = self._rows[self._i:], len(self._rows)
        return out

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class PostgresDatabase:
    """A psycopg 3 connection pool. A transaction binds one pooled connection to the calling thread until it
    ends; a statement outside one borrows a connection for itself (autocommit) and reads its rows whole.
    ``schema`` puts this part's tables in their own PostgreSQL schema (the audit log next to the ledger).
    Thread-safe."""

    dialect = POSTGRESQL

    def __init__(self, url: str, schema: str | None = None, min_size: int = 1, max_size: int = 8,
                 connect_timeout_s: float = 10.0, read_only: bool = False) -> None:
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise DatabaseUnavailable(f"PostgreSQL ledger {redact(url)}: psycopg is not installed") from exc
        self._psycopg = psycopg
        self.url = redact(url)
        self.schema = schema
        self._local = threading.local()
        self._sql: dict[str, str] = {}

        def configure(conn: Any) -> None:
            conn.autocommit = True
            conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_TIMEOUT}'")
            if read_only:  # the server refuses a write (a query's bug) rather than make it
                conn.execute("SET default_transaction_read_only = on")
            if schema:
                if not read_only:
                    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                conn.execute(f'SET search_path TO "{schema}"')

        # one connection first: an unreachable server fails now, with the server's reason, not the pool's; a refusal
        # only a change of configuration can fix (no such database, bad credentials) as DatabaseConfigError
        try:
            options: dict[str, Any] = {"connect_timeout": int(connect_timeout_s), **_tcp_bounds(url)}
            failed = _startup(url, options, connect_timeout_s)
        except psycopg.ProgrammingError as exc:  # the URL's parameters do not parse
            raise DatabaseConfigError(f"PostgreSQL ledger {self.url}: the URL is invalid ({exc})") from exc
        except psycopg.Error as exc:  # no host name resolves
            raise DatabaseUnavailable(f"PostgreSQL ledger {self.url}: cannot connect: {exc}") from exc
        if failed is not None:
            sqlstate, reason = failed
            problem = _config_problem(sqlstate, reason)
            if problem is not None:
                raise DatabaseConfigError(f"PostgreSQL ledger {self.url}: {problem} ({reason})")
            raise DatabaseUnavailable(f"PostgreSQL ledger {self.url}: cannot connect: {reason}")
        self._pool = ConnectionPool(url, min_size=min_size, max_size=max_size, configure=configure, open=False,
                                    timeout=connect_timeout_s, kwargs=options)
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except Exception as exc:
            self._pool.close()
            raise DatabaseUnavailable(f"PostgreSQL ledger {self.url}: cannot connect ({exc})") from exc

    def _translate(self, sql: str) -> str:
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("%", "%%").replace("?", "%s")
        return out

    def _error(self, exc: Exception) -> Exception:
        errors = self._psycopg.errors
        if isinstance(exc, errors.DiskFull):
            return DatabaseFull(str(exc).strip())
        if isinstance(exc, errors.LockNotAvailable):
            return DatabaseBusy(f"PostgreSQL ledger {self.url}: a lock waited on for {LOCK_TIMEOUT} (another "
                                "collector stalled in a transaction?)")
        if isinstance(exc, self._psycopg.OperationalError) and not isinstance(exc, errors.QueryCanceled):
            # the first line: the server's CONTEXT lines name our statement, not the reason
            return DatabaseUnavailable(f"PostgreSQL ledger {self.url}: {str(exc).strip().splitlines()[0]}")
        return exc

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Rows:
        conn = getattr(self._local, "conn", None)
        # without arguments psycopg substitutes nothing: the statement goes as written
        query, params = (self._translate(sql), args) if args else (sql, None)
        try:
            if conn is not None:
                return conn.execute(query, params)
            with self._pool.connection() as c:
                cur = c.execute(query, params)
                return _Fetched(cur.fetchall() if cur.description else [], cur.rowcount)
        except Exception as exc:
            raise self._error(exc) from exc

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        if not rows:
            return 0
        with self.transaction():
            try:
                cur = self._local.conn.cursor()
                cur.executemany(self._translate(sql), rows)
                return cur.rowcount  # psycopg >= 3.1: the sum over the rows
            except Exception as exc:
                raise self._error(exc) from exc

    def ready_to_write(self) -> bool:
        """Always: writers of a PostgreSQL ledger wait on the rows they write (hosts' claims), not on the database."""
        return True

    @contextmanager
    def transaction(self) -> Iterator[PostgresDatabase]:
        """One pooled connection for the transaction, committed at the end, rolled back on any exception
        (re-raised, as DatabaseFull or DatabaseUnavailable where that is what happened); inside one, joins it."""
        if getattr(self._local, "conn", None) is not None:
            yield self
            return
        try:
            with self._pool.connection() as conn, conn.transaction():
                self._local.conn = conn
                try:
                    yield self
                finally:
                    self._local.conn = None
        except (DatabaseFull, DatabaseUnavailable):
            raise
        except self._psycopg.Error as exc:
            raise self._error(exc) from exc
        except Exception as exc:
            if type(exc).__name__ == "PoolTimeout":
                raise DatabaseUnavailable(f"PostgreSQL ledger {self.url}: no connection ({exc})") from exc
            raise

    @contextmanager
    def snapshot(self) -> Iterator[PostgresDatabase]:
        """A REPEATABLE READ, READ ONLY transaction: every statement sees the state of its first one, writers go
        on; inside a transaction, joins it."""
        if getattr(self._local, "conn", None) is not None:
            yield self
            return
        with self.transaction():
            self.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield self

    @contextmanager
    def reader(self) -> Iterator[PostgresDatabase]:
        """This database: its pool is thread-safe, and a thread's transaction (or snapshot) takes a connection
        of its own."""
        yield self

    def lock(self, name: str) -> None:
        """A transaction-scoped advisory lock on ``name``, held until the transaction ends (call inside one)."""
        assert getattr(self._local, "conn", None) is not None, "lock() outside a transaction"
        self.execute("SELECT pg_advisory_xact_lock(?)", (_lock_key(f"{self.schema or ''}:{name}"),))

    @contextmanager
    def try_lock(self, name: str) -> Iterator[bool]:
        """A session advisory lock on ``name`` for the block, on a pooled connection held that long, if no other
        session has it: yields whether it was taken, never waits. The server releases it if the session dies."""
        key = _lock_key(f"{self.schema or ''}:{name}:session")
        try:
            with self._pool.connection() as conn:
                got = bool(conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0])
                try:
                    yield got
                finally:
                    if got and not conn.closed:
                        conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        except self._psycopg.Error as exc:
            raise self._error(exc) from exc

    def script(self, ddl: str) -> None:
        with self.transaction():
            for statement in statements(ddl):
                self.execute(pg_ddl(statement))

    def columns(self, table: str) -> list[str]:
        rows = self.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                            "current_schema() AND table_name = ? ORDER BY ordinal_position", (table,))
        return [r[0] for r in rows.fetchall()]

    def has_table(self, table: str) -> bool:
        row = self.execute("SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema() "
                           "AND table_name = ?", (table,)).fetchone()
        return row is not None

    def close(self) -> None:
        self._pool.close()


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and urlsplit(str(url)).scheme in ("postgresql", "postgres")


def open_database(url: str | os.PathLike[str], schema: str | None = None, read_only: bool = False) -> Database:
    """``postgresql://...`` (or ``postgres://``): a PostgreSQL pool (tables in ``schema`` when given); a path or
    ``sqlite:///path``: that SQLite file. ``read_only``: for a query that must never write (SQLite: opened read-only,
    creating nothing; PostgreSQL: read-only sessions)."""
    text = str(url)
    if is_postgres_url(text):
        return PostgresDatabase(text, schema=schema, read_only=read_only)
    if text.startswith("sqlite://"):
        text = urlsplit(text).path
    if "://" in text:
        raise ValueError(f"ledger URL {redact(text)!r}: use postgresql://... or a SQLite file path")
    return SqliteDatabase(text, read_only=read_only)
