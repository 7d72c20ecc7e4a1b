"""``gpuledger collector ...``: run the collector, read job usage from the embedded store."""

from __future__ import annotations

import json
import signal
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from collector.server import CollectorServer
from collector.store import SqliteStore

app = typer.Typer(help="The central collector: ingest agents' batches, aggregate per job, store series.",
                  no_args_is_help=True)

DB_NAME = "gpuledger.sqlite"
DataDir = typer.Option(Path("./gpuledger-data"), "--data-dir", envvar="GPULEDGER_DATA_DIR",
                       help="Directory of the embedded store.")


def store_path(data_dir: Path) -> Path:
    return data_dir / DB_NAME


class Format(str, Enum):
    table = "table"
    json = "json"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    data_dir: Path = DataDir,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8470, help="Port to listen on (0 picks a free one)."),
    window: float = typer.Option(600.0, help="Seconds a late sample may trail its GPU's newest and still count."),
    max_gap: float = typer.Option(300.0, help="Longer intervals between samples are gaps (not observed)."),
) -> None:
    """Serve the ingest and query API until interrupted."""
    store = SqliteStore(store_path(data_dir), window_s=window, max_gap_s=max_gap)
    server = CollectorServer(store, host=host, port=port)
    # SIGTERM (systemd, kill) stops as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    typer.echo(f"collector listening on {server.url}, store {store.path}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        store.close()


@app.command()
def usage(
    data_dir: Path = DataDir,
    job: str | None = typer.Option(None, "--job", help="Only this job id."),
    per_gpu: bool = typer.Option(False, "--per-gpu", help="One row per job and GPU."),
    fmt: Format = typer.Option(Format.table, "--format", help="table or json."),
) -> None:
    """Print measured job usage from the store."""
    path = store_path(data_dir)
    if not path.exists():
        typer.echo(f"no store at {path} (set --data-dir or GPULEDGER_DATA_DIR)", err=True)
        raise typer.Exit(2)
    store = SqliteStore(path)
    try:
        rows = store.job_usage(job, per_gpu=per_gpu)
    finally:
        store.close()
    if fmt is Format.json:
        typer.echo(json.dumps([u.to_dict() for u in rows], indent=2))
        return
    t = Table(title=f"GPU job usage ({path})")
    for col in ("job", "host", "GPU", "GPUs", "GPU-h", "SM-active GPU-h", "eff.", "mean HBM", "energy kWh", "peak mem GB"):
        t.add_column(col, justify="left" if col in ("job", "host", "GPU") else "right")
    for u in rows:
        eff = u.efficiency
        t.add_row(
            u.job_id, u.host, u.gpu_uuid, str(u.gpus), f"{u.allocated_gpu_seconds / 3600:.3f}",
            f"{u.sm_active_gpu_seconds / 3600:.3f}", "-" if eff is None else f"{eff:.0%}",
            "-" if u.dram_bw_mean is None else f"{u.dram_bw_mean:.2f}", f"{u.energy_joules / 3.6e6:.3f}",
            "-" if u.mem_used_peak_bytes is None else f"{u.mem_used_peak_bytes / 1e9:.1f}",
        )
    Console().print(t)
