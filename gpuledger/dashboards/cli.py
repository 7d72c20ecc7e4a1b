"""``gpuledger dashboards ...``: the packaged Grafana dashboards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuledger.dashboards.export import ExportError, export
from gpuledger.output import fail, note, os_error

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
        fail(str(e))
    except OSError as e:
        fail(os_error(e) if e.filename is not None else f"{dest}: {os_error(e)}", 1)
    for path in done.written:
        typer.echo(str(path))
    note(f"{len(done.written)} written, {len(done.unchanged)} unchanged, in {dest}")
