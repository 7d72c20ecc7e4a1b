"""``gpuledger ledger status|migrate``: where a ledger's schema stands, and bringing it up to date.

The ledger is the one every command uses (``collector.ledger_url``: ``--ledger-url``, ``GPULEDGER_LEDGER_URL``,
the ``[ledger]`` table of ``--config``), else the embedded store of ``--data-dir``. Neither command creates a SQLite
store (a mistyped directory is exit 2); a PostgreSQL database must exist (its DBA creates it), ``migrate`` creates
the tables in it. A collector applies pending migrations itself when it opens the ledger; ``migrate`` does it ahead,
e.g. before collectors of a new release start. Errors are one line (``collector.ledger_url.database_failures``):
exit 2 for bad input (a bad ledger URL, no store, a SQLite file that is not a database or that this user cannot open
or write, a PostgreSQL server that refuses the URL: no such database or role, credentials refused; a ledger written
by a newer gpuledger), 1 when the server cannot be reached. ``status`` never writes: it opens the ledger read-only
(``db.open_database(read_only=True)``), so it works on a file and directory this user may only read (an auditor's
copy, a read-only mount), creates no file beside a SQLite ledger and takes no lock a running collector waits for.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from gpuledger.collector.db import POSTGRESQL, Database, open_database
from gpuledger.collector.ledger_url import LedgerUrlOpt, cli_ledger_url, database_failures, sqlite_path, sqlite_problem
from gpuledger.collector.migrations import LATEST, Status, migrate, status
from gpuledger.output import FORMAT_HELP, Column, Format, emit, fail

app = typer.Typer(help="The ledger's schema: status and migrations (SQLite or PostgreSQL).", no_args_is_help=True)

DataDir = Annotated[Path, typer.Option("--data-dir", envvar="GPULEDGER_DATA_DIR",
                                       help="Directory of the embedded store (used without --ledger-url).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML file whose [ledger] table may name the ledger "
                                                "(default: <data-dir>/gpuledger.toml if present).")]


FormatOpt = Annotated[Format, typer.Option("--format", help=FORMAT_HELP)]
T = TypeVar("T")


def _on_ledger(ledger_url: str | None, data_dir: Path, config: Path | None, action: Callable[[Database], T],
               read_only: bool = False) -> tuple[T, Database]:
    """``action`` on the ledger's database (``--ledger-url`` resolved; opened read-only for an action that only
    reads), which is closed again; never a new SQLite file. Exit 2 for no ledger, one written by a newer gpuledger
    or a server that refuses the URL, 1 when it cannot be reached (``database_failures``, as every other command)."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = sqlite_path(url, data_dir)
    if path is not None and not path.is_file():
        fail(f"no gpuledger store at {path} (run a collector or `gpuledger demo` first, or pass --data-dir or "
             "--ledger-url)")
    try:
        with database_failures():
            db = open_database(str(url) if path is None else path, read_only=read_only)
            try:
                return action(db), db
            finally:
                db.close()
    except sqlite3.Error as e:  # (path is the SQLite file: PostgreSQL raises its own errors)
        fail(*sqlite_problem(e, str(path), "a gpuledger ledger"))


def _state(st: Status) -> list[dict]:
    rows: list[dict] = []
    for a in st.applied:
        rows.append({"version": a.version, "name": a.name, "state": "newer" if a.version > LATEST else "applied",
                     "applied_at": datetime.fromtimestamp(a.applied_at, UTC).isoformat(timespec="seconds")})
    rows += [{"version": m.version, "name": m.name, "state": "pending", "applied_at": None} for m in st.pending]
    return sorted(rows, key=lambda r: r["version"])


@app.command("status")
def status_cmd(
    data_dir: DataDir = Path("gpuledger-data"),
    ledger_url: LedgerUrlOpt = None,
    config: ConfigOpt = None,
    fmt: FormatOpt = Format.table,
) -> None:
    """The ledger's backend, URL (without a password), and its applied, pending and unknown (newer) migrations."""
    st, db = _on_ledger(ledger_url, data_dir, config, status, read_only=True)
    rows = _state(st)
    doc = {"backend": db.dialect, "url": db.url, "latest_known": LATEST, "meta_format": st.meta_format,
           "applied": [r["version"] for r in rows if r["state"] != "pending"],
           "pending": [r["version"] for r in rows if r["state"] == "pending"],
           "newer": [r["version"] for r in rows if r["state"] == "newer"], "migrations": rows}
    if fmt is Format.table:
        sys.stdout.write(f"backend  {db.dialect}\nledger   {db.url}\n\n")
    emit(fmt, rows, [Column("version", "version"), Column("name", "name", left=True),
                     Column("state", "state", left=True), Column("applied at (UTC)", "applied_at", left=True)],
         json_doc=doc)
    if st.unknown and fmt is Format.table:
        sys.stdout.write(f"\nthis ledger was written by a newer gpuledger (migrations up to {st.unknown[-1].version}; "
                         f"this one knows {LATEST}): upgrade gpuledger\n")


@app.command("migrate")
def migrate_cmd(
    data_dir: DataDir = Path("gpuledger-data"),
    ledger_url: LedgerUrlOpt = None,
    config: ConfigOpt = None,
    fmt: FormatOpt = Format.table,
) -> None:
    """Apply the pending migrations (in one transaction, under the ledger's migrations lock); prints them."""
    applied, db = _on_ledger(ledger_url, data_dir, config, migrate)
    if fmt is Format.json:
        typer.echo(json.dumps({"backend": db.dialect, "url": db.url, "latest": LATEST,
                               "applied": [{"version": m.version, "name": m.name} for m in applied]}, indent=2))
        return
    if fmt is Format.csv:
        emit(fmt, [{"version": m.version, "name": m.name} for m in applied],
             [Column("version", "version"), Column("name", "name")])
        return
    where = f"{'PostgreSQL' if db.dialect == POSTGRESQL else 'SQLite'} ledger {db.url}"
    for m in applied:
        typer.echo(f"applied {m.version}: {m.name}")
    typer.echo(f"{where}: up to date (migration {LATEST})" if not applied else
               f"{where}: {len(applied)} migration(s) applied, now at {LATEST}")
