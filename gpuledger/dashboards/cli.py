"""``gpuledger dashboards ...``: the packaged Grafana dashboards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuledger.dashboards.export import ExportError, export

app = typer.Typer(help="Grafana dashboards shipped with gpuledger.", no_args_is_help=True)


@app.command("export")
def export_command(
    dest: Annotated[Path, typer.Argument(help="folder to write the dashboards and provisioning files into")],
    force: Annotated[bool, typer.Option("--force", help="overwrite files that differ")] = False,
) -> None:
    """Write the dashboards (DIR/influxdb, DIR/prometheus) and Grafana provisioning files (DIR/provisioning)."""
    try:
        done = export(dest, overwrite=force)
    except ExportError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:
        typer.echo(f"error: {e.filename or dest}: {e.strerror}", err=True)
        raise typer.Exit(1) from None
    for path in done.written:
        typer.echo(str(path))
    typer.echo(f"{len(done.written)} written, {len(done.unchanged)} unchanged, in {dest}", err=True)
