"""What every accounting command shares: the data directory and config options, the one-line failure, and
opening the embedded store (one definition for the jobs/fairshare/priority and the report/audit commands)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpuledger.output import fail

if TYPE_CHECKING:
    from gpuledger.accounting.ledger import LedgerEntry
    from gpuledger.collector.store import Store

STORE_NAME = "gpuledger.sqlite"
CONFIG_NAME = "gpuledger.toml"

DataDir = Annotated[
    Path,
    typer.Option("--data-dir", envvar="GPULEDGER_DATA_DIR", help="Where the embedded store and outputs live."),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="TOML configuration (default: <data-dir>/gpuledger.toml).")
]


def fail_exit(msg: str, code: int = 2) -> typer.Exit:
    """``raise fail_exit(...)``: one line on stderr (gpuledger.output.fail), exit 2 bad input or 1 a failure."""
    try:
        fail(msg, code)
    except typer.Exit as e:
        return e
    raise AssertionError("gpuledger.output.fail always raises")  # pragma: no cover


def open_store(data_dir: Path) -> Store:
    """The embedded store of ``data_dir``; a missing one is bad input (exit 2), never created by a query."""
    from gpuledger.collector.store import Store

    path = data_dir / STORE_NAME
    if not path.exists():
        raise fail_exit(f"no gpuledger store at {path} (run `gpuledger demo` or a collector first, or pass --data-dir)")
    return Store(path)


def read_ledger(data_dir: Path) -> list[LedgerEntry]:
    """The ledger of ``data_dir`` (scheduler records joined with measured usage), the store closed again."""
    from gpuledger.accounting.ledger import load

    store = open_store(data_dir)
    try:
        return load(store)
    finally:
        store.close()
