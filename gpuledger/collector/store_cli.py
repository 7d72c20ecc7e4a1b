"""``gpuledger collector compact|series|totals``: the embedded store's tiers from the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from gpuledger.collector.series_store import TIER_NAMES
from gpuledger.collector.store import SqliteStore

app = typer.Typer(help="Maintain and query the embedded store's tiers.", no_args_is_help=True)

DB_NAME = "gpuledger.sqlite"  # the collector's store file inside --data-dir
DataDir = typer.Option(Path("./gpuledger-data"), "--data-dir", envvar="GPULEDGER_DATA_DIR",
                       help="Directory of the embedded store.")


def _open(data_dir: Path) -> SqliteStore:
    path = data_dir / DB_NAME
    if not path.exists():
        typer.echo(f"no store at {path} (set --data-dir or GPULEDGER_DATA_DIR)", err=True)
        raise typer.Exit(2)
    return SqliteStore(path)


@app.command()
def compact(
    data_dir: Path = DataDir,
    now: float | None = typer.Option(None, help="Apply retention as of this unix time (default: now)."),
) -> None:
    """Roll up closed minutes and hours, merge small chunks, drop data past retention (idempotent)."""
    store = _open(data_dir)
    try:
        st = store.compact(now)
        store.checkpoint()
        typer.echo(json.dumps({"rolled_minutes": st.rolled_minutes, "rolled_hours": st.rolled_hours,
                               "merged_chunks": st.merged_chunks, "deleted_chunks": st.deleted_chunks,
                               "tiers": store.tiers(), "size_bytes": store.size_bytes()}, indent=2))
    finally:
        store.close()


@app.command()
def series(
    host: str = typer.Argument(..., help="Host name."),
    gpu_uuid: str = typer.Argument(..., help="GPU UUID."),
    start: float = typer.Option(..., help="Unix seconds (negative: seconds before now)."),
    end: float | None = typer.Option(None, help="Unix seconds (default now)."),
    step: float | None = typer.Option(None, help="Bucket seconds; picks the 1m or 1h tier when coarse enough."),
    mig: str | None = typer.Option(None, help="MIG instance."),
    tier: str | None = typer.Option(None, help="Force a tier: raw, 1m or 1h."),
    data_dir: Path = DataDir,
) -> None:
    """One GPU's samples or rollup buckets as JSON lines (the tier is picked by range and retention)."""
    now = time.time()
    start = now + start if start < 0 else start
    forced = None
    if tier is not None:
        names = {v: k for k, v in TIER_NAMES.items()}
        if tier not in names:
            raise typer.BadParameter(f"tier must be one of {sorted(names)}")
        forced = names[tier]
    store = _open(data_dir)
    try:
        for p in store.series(host, gpu_uuid, start, now if end is None else end, step=step, mig=mig, tier=forced):
            typer.echo(json.dumps(p.to_dict()))
    finally:
        store.close()


@app.command()
def totals(
    data_dir: Path = DataDir,
    start: float | None = typer.Option(None, help="Unix seconds: whole hours from here."),
    end: float | None = typer.Option(None, help="Unix seconds."),
) -> None:
    """Cluster totals (GPU-seconds observed, allocated, SM-active; energy) and the tiers' sizes."""
    store = _open(data_dir)
    try:
        typer.echo(json.dumps({**store.totals(start, end), "tiers": store.tiers(), "size_bytes": store.size_bytes()},
                              indent=2))
    finally:
        store.close()
