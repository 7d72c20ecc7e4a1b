"""What every accounting command shares: the data directory, config and ledger options, the one-line failure, and
opening the ledger (one definition for the jobs/fairshare/priority and the report/audit commands)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpuledger.collector.ledger_url import STORE_NAME, LedgerUrlOpt, cli_ledger_url, open_ledger
from gpuledger.output import fail

if TYPE_CHECKING:
    from gpuledger.accounting.ledger import LedgerEntry
    from gpuledger.collector.auditlog.log import AuditLog
    from gpuledger.collector.store import Store

__all__ = ["CONFIG_NAME", "STORE_NAME", "ConfigOpt", "DataDir", "LedgerUrl", "cli_ledger_url", "fail_exit",
           "open_audit", "open_store", "read_ledger"]

CONFIG_NAME = "gpuledger.toml"

DataDir = Annotated[
    Path,
    typer.Option("--data-dir", envvar="GPULEDGER_DATA_DIR", help="Where the embedded store and outputs live."),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML configuration (default: <data-dir>/gpuledger.toml).")
]
# --ledger-url, declared once in collector.ledger_url (the collector's commands take it too); a command resolves it
# with cli_ledger_url(flag, data_dir, config) and passes the URL on (None: the data dir's embedded store)
LedgerUrl = LedgerUrlOpt


def fail_exit(msg: str, code: int = 2) -> typer.Exit:
    """``raise fail_exit(...)``: one line on stderr (gpuledger.output.fail), exit 2 bad input or 1 a failure."""
    try:
        fail(msg, code)
    except typer.Exit as e:
        return e
    raise AssertionError("gpuledger.output.fail always raises")  # pragma: no cover


def open_store(ledger_url: str | None, data_dir: Path) -> Store:
    """The ledger for a query; a missing one is bad input (exit 2), never created by a query."""
    return open_ledger(ledger_url, data_dir)


def open_audit(data_dir: Path, ledger_url: str | None) -> AuditLog:
    """The ledger's audit log (``open_log``); a data dir whose pseudonymization key contradicts a shared ledger's
    is bad input (exit 2)."""
    from gpuledger.collector.auditlog.jobs import open_log

    try:
        return open_log(data_dir, ledger_url=ledger_url)
    except ValueError as e:
        raise fail_exit(str(e)) from None


def read_ledger(ledger_url: str | None, data_dir: Path) -> list[LedgerEntry]:
    """The ledger's entries (scheduler records joined with measured usage), the store closed again."""
    from gpuledger.accounting.ledger import load

    store = open_store(ledger_url, data_dir)
    try:
        return load(store)
    finally:
        store.close()
