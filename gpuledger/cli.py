"""The `gpuledger` command: one root that mounts every part's sub-commands, plus the demo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuledger.accounting import cli as acct
from gpuledger.accounting.report_cli import audit_app, report_app
from gpuledger.agent.cli import app as agent_app
from gpuledger.collector.cli import app as collector_app
from gpuledger.dashboards.cli import app as dashboards_app

app = typer.Typer(
    name="gpuledger",
    help="Measure what GPU jobs really use; turn it into accounting, audit reports and Slurm priority.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(agent_app, name="agent", help="Node agent: sample GPUs, attribute jobs, /metrics, push.")
app.add_typer(collector_app, name="collector", help="Collector: ingest, aggregate per job, store.")
app.add_typer(acct.fairshare_app, name="fairshare")
app.add_typer(report_app, name="report")
app.add_typer(audit_app, name="audit")
app.add_typer(acct.priority_app, name="priority")
app.add_typer(acct.jobs_app, name="jobs")
app.add_typer(dashboards_app, name="dashboards")


@app.command()
def demo(
    data_dir: acct.DataDir = Path("gpuledger-data"),
    nodes: Annotated[int, typer.Option(min=1, help="simulated GPU nodes")] = 4,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs per node")] = 8,
    hours: Annotated[float, typer.Option(min=0.05, help="simulated hours")] = 1.0,
    step: Annotated[float, typer.Option(min=1.0, help="sampling interval, simulated seconds")] = 10.0,
    seed: int = 0,
) -> None:
    """Run the main job end to end on the embedded default: simulated agents -> collector -> accounting."""
    from gpuledger.demo import DemoDirError, main

    try:
        main(data_dir, nodes=nodes, gpus=gpus, hours=hours, step=step, seed=seed)
    except DemoDirError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
