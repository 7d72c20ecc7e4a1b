"""Where the ledger is, for every command: one resolver, one ``--ledger-url`` option, one way to open it.

The ledger is PostgreSQL (``postgresql://...``, shared by several collectors) or a SQLite file; without a URL it is
the embedded SQLite store of the data directory (``<data-dir>/gpuledger.sqlite``), as it always was. Precedence,
highest first:

1. ``--ledger-url URL`` on the command line;
2. the environment variable ``GPULEDGER_LEDGER_URL``;
3. ``url`` in the ``[ledger]`` table of the configuration file (``<data-dir>/gpuledger.toml``, or ``--config``),
   a relative SQLite path there being relative to the file::

       [ledger]
       url = "postgresql://gpuledger@db.example.org/gpuledger"   # the password: a libpq password file, not here

4. none: the embedded store.

A bad URL (empty, an unknown scheme, a malformed one) is refused in one line naming where it came from. Outputs
(reports, feeds, keys) stay in the data directory whatever the ledger.

A query never creates a ledger: :func:`open_ledger` without ``create`` exits 2 when there is no SQLite file, or
when the PostgreSQL database holds no gpuledger tables, and 1 when the server cannot be reached. A PostgreSQL server
that refuses the URL (no such database or role, credentials refused, a pg_hba.conf that does not let the user in)
and a SQLite file that cannot be opened (not a database, read-only to this user, written by a newer gpuledger) are
one line naming the ledger and why, exit 2: restarting a unit cannot fix them (:func:`database_failures`,
:func:`sqlite_problem`); the systemd units do not restart on 2 (``RestartPreventExitStatus=2``).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import typer

from gpuledger.collector.config import ConfigError, read_toml
from gpuledger.collector.db import DatabaseConfigError, DatabaseUnavailable, is_postgres_url, open_database, redact
from gpuledger.collector.migrations import LedgerTooNew
from gpuledger.output import fail
from gpuledger.schema.text import ascii_int

if TYPE_CHECKING:
    from gpuledger.collector.store import Store

ENV_NAME = "GPULEDGER_LEDGER_URL"
FLAG = "--ledger-url"
TABLE = "ledger"
STORE_NAME = "gpuledger.sqlite"  # the embedded store inside the data directory
LEDGER_TABLE = "jobs"  # a database holding this table is a gpuledger ledger (every schema version has it)
_SQLITE_PREFIX = "sqlite://"

LedgerUrlOpt = Annotated[str | None, typer.Option(
    FLAG, metavar="URL", show_default=False,
    help=f"The ledger: postgresql://... or a SQLite file [default: ${ENV_NAME}, else url in the [ledger] table of "
         "the config file, else <data-dir>/gpuledger.sqlite]. Put a PostgreSQL password in a libpq password file "
         "(PGPASSFILE), not in the URL.")]


class LedgerUrlError(ValueError):
    """A ledger URL that cannot be used; the message names where it came from (flag, variable, file and key)."""


def _port_ok(host: str) -> bool:
    """One host of a libpq URL's host list (``h1:5432,h2:5433``: libpq tries them in turn, how a site names a
    primary and its standbys) has no port, or a valid one."""
    _, colon, port = host.rpartition("]")[2].rpartition(":")  # an IPv6 address is bracketed: [::1]:5432
    return not colon or not port or (0 < (ascii_int(port) or 0) < 65536)


def check_ledger_url(value: str, source: str, base: Path | None = None) -> str:
    """``value`` as the ledger URL: a PostgreSQL URL as given, or the path of a SQLite file (``sqlite://`` stripped;
    relative to ``base`` when one is given). ``source`` names where it came from for the error."""
    text = value.strip()
    if not text or text == _SQLITE_PREFIX:
        raise LedgerUrlError(f"{source}: empty ledger URL (unset it for the data directory's embedded store)")
    if is_postgres_url(text):
        if not all(_port_ok(host) for host in urlsplit(text).netloc.rsplit("@", 1)[-1].split(",")):
            raise LedgerUrlError(f"{source}: bad port in ledger URL {redact(text)}")
        return text
    if text.startswith(_SQLITE_PREFIX):
        text = text.removeprefix(_SQLITE_PREFIX)
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        raise LedgerUrlError(f"{source}: unknown scheme {scheme!r} in ledger URL {redact(text)} "
                             "(use postgresql://... or the path of a SQLite file)")
    path = Path(text).expanduser()
    return str(base / path if base is not None and not path.is_absolute() else path)


def resolve_ledger_url(flag: str | None, data_dir: Path, config: Path | None = None,
                       env: Mapping[str, str] | None = None) -> str | None:
    """The ledger URL (see the module docstring): ``flag`` (``--ledger-url``), else the environment, else the
    ``[ledger]`` table of ``config`` (``<data_dir>/gpuledger.toml`` when None; read only when needed, and then an
    explicit one must exist), else None (the embedded store). Raises LedgerUrlError or ConfigError."""
    if flag is not None:
        return check_ledger_url(flag, FLAG)
    env = os.environ if env is None else env
    if ENV_NAME in env:
        return check_ledger_url(env[ENV_NAME], ENV_NAME)
    path = config if config is not None else data_dir / "gpuledger.toml"
    if config is None and not path.exists():
        return None
    table = read_toml(path).get(TABLE)
    if table is None:
        return None
    if not isinstance(table, dict):
        raise LedgerUrlError(f"{path}: [{TABLE}] must be a table")
    unknown = sorted(set(table) - {"url"})
    if unknown:  # a misspelt url would silently mean another ledger
        raise LedgerUrlError(f"{path}: {TABLE}.{unknown[0]}: unknown setting (the [{TABLE}] table takes url)")
    if "url" not in table:
        return None
    if not isinstance(table["url"], str):
        raise LedgerUrlError(f"{path}: {TABLE}.url: must be a string")
    return check_ledger_url(table["url"], f"{path}: {TABLE}.url", base=path.parent)


def cli_ledger_url(flag: str | None, data_dir: Path, config: Path | None = None) -> str | None:
    """:func:`resolve_ledger_url` for a command: a bad URL or configuration is one line and exit 2."""
    try:
        return resolve_ledger_url(flag, data_dir, config)
    except (LedgerUrlError, ConfigError) as e:
        fail(str(e))


def sqlite_path(ledger_url: str | None, data_dir: Path) -> Path | None:
    """The SQLite file of the ledger (None for PostgreSQL)."""
    if is_postgres_url(ledger_url):
        return None
    return Path(ledger_url) if ledger_url else data_dir / STORE_NAME


def ledger_label(ledger_url: str | None, data_dir: Path) -> str:
    """The ledger for messages: its SQLite file, or its URL without a password."""
    path = sqlite_path(ledger_url, data_dir)
    return str(path) if path is not None else redact(str(ledger_url))


def ledger_exists(ledger_url: str | None, data_dir: Path) -> bool:
    """Whether there is a ledger to read: the SQLite file exists, or the PostgreSQL database has gpuledger's tables
    (connecting creates nothing). Raises DatabaseUnavailable when the server cannot be reached, DatabaseConfigError
    when it refuses the URL."""
    path = sqlite_path(ledger_url, data_dir)
    if path is not None:
        return path.exists()
    db = open_database(str(ledger_url))
    try:
        return db.has_table(LEDGER_TABLE)
    finally:
        db.close()


@contextmanager
def database_failures() -> Iterator[None]:
    """A command's block that opens or uses the ledger's database (or the audit log in it): the one rule for how it
    ends when that fails, in one line. Exit 2 for what only a change of configuration fixes (the server refuses
    the URL: DatabaseConfigError; a ledger written by a newer gpuledger), 1 for what may pass (the server down or
    unreachable: DatabaseUnavailable): a service manager restarts after 1, not after 2."""
    try:
        yield
    except DatabaseConfigError as e:
        fail(str(e))
    except DatabaseUnavailable as e:
        fail(str(e), code=1)
    except LedgerTooNew as e:  # the message names the ledger; only a newer gpuledger opens it
        fail(str(e))


def sqlite_problem(exc: sqlite3.Error, path: str | os.PathLike[str], what: str) -> tuple[str, int]:
    """Why the SQLite file ``path`` (``what``: "a gpuledger ledger", "an audit log") could not be opened, in one
    line, and the exit status: 1 while another process holds it (trying again helps), else 2 (a file or a
    permission to fix, which a restart cannot)."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code (SQLITE_READONLY_* are SQLITE_READONLY)
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return f"{path}: {exc} (another process holds it; try again)", 1
    if code == sqlite3.SQLITE_READONLY:
        return (f"cannot write {path}: permission denied to this user on it or its directory, or a read-only file "
                f"system ({exc}); run as the user that owns it"), 2
    if code in (sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM):
        return f"cannot open {path}: {exc} (check that it is a file and the permissions on it and its directory)", 2
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return f"{path}: not {what} ({exc})", 2
    return f"{path}: {exc}", 1


def open_ledger(ledger_url: str | None, data_dir: Path, *, create: bool = False, **settings: Any) -> Store:
    """The store for a command (``collector.store.open_store``; ``settings`` are its keyword arguments). Without
    ``create`` (a query) there must be a ledger already: none is one line and exit 2, never a new empty store. An
    unreachable PostgreSQL is one line and exit 1; one that refuses the URL, a SQLite file that cannot be opened, or a
    ledger of a newer gpuledger, one line and exit 2 (:func:`database_failures`, :func:`sqlite_problem`)."""
    from gpuledger.collector.store import open_store

    label = ledger_label(ledger_url, data_dir)
    try:
        with database_failures():
            if not create and not ledger_exists(ledger_url, data_dir):
                if is_postgres_url(ledger_url):
                    fail(f"{label}: not a gpuledger ledger (run `gpuledger ledger migrate` or a collector first)")
                fail(f"no gpuledger store at {label} (run `gpuledger demo` or a collector first, or pass --data-dir "
                     f"or {FLAG})")
            path = sqlite_path(ledger_url, data_dir)
            if create and path is not None and not path.parent.is_dir():
                fail(f"ledger {label}: no directory {path.parent}")
            return open_store(ledger_url, data_dir, **settings)
    except sqlite3.Error as e:  # (only a SQLite ledger raises these: label is its file)
        fail(*sqlite_problem(e, label, "a gpuledger ledger"))


def ledger_fingerprint(ledger_url: str | None, data_dir: Path) -> tuple[object, ...]:
    """A value that changes when job records or usage are written (what ``priority watch`` polls). SQLite: (mtime,
    size) of the file and its WAL. PostgreSQL, which has no file to look at: the newest batch's arrival (indexed)
    and the number of job records, so a new batch or job shows; a job record changed in place without either shows
    at the watcher's next resync. Raises DatabaseUnavailable when the server cannot be reached, DatabaseConfigError
    when it refuses the URL."""
    path = sqlite_path(ledger_url, data_dir)
    if path is not None:
        out: list[tuple[int, int] | None] = []
        for suffix in ("", "-wal"):
            try:
                st = os.stat(str(path) + suffix)
                out.append((st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)
    db = open_database(str(ledger_url))
    try:
        return tuple(db.execute("SELECT (SELECT MAX(received) FROM batch_keys), (SELECT COUNT(*) FROM jobs)")
                     .fetchone())
    finally:
        db.close()
