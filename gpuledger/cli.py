"""The `gpuledger` command: one root that mounts every part's sub-commands, plus the demo."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # newer typer carries its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer depends on click
    from click import exceptions as click_exc  # type: ignore[no-redef, import-not-found, unused-ignore]

from gpuledger.accounting import cli as acct
from gpuledger.accounting.report_cli import audit_app, report_app
from gpuledger.agent.cli import app as agent_app
from gpuledger.collector.cli import app as collector_app
from gpuledger.collector.ledger_cli import app as ledger_app
from gpuledger.dashboards.cli import app as dashboards_app
from gpuledger.output import error, unexpected

app = typer.Typer(
    name="gpuledger",
    help="Measure what GPU jobs really use; turn it into accounting, audit reports and Slurm priority.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(agent_app, name="agent", help="Node agent: sample GPUs, attribute jobs, /metrics, push.")
app.add_typer(collector_app, name="collector", help="Collector: ingest, aggregate per job, store.")
app.add_typer(ledger_app, name="ledger", help="The ledger's schema: status and migrations (SQLite or PostgreSQL).")
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


def _plain_help(typer_app: typer.Typer) -> None:
    """Help as plain text, everywhere: help strings quote TOML tables and defaults in brackets ([collector],
    [default: 8470]), which rich markup would swallow, and plain text pipes and greps cleanly."""
    typer_app.rich_markup_mode = None
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _plain_help(group.typer_instance)


_plain_help(app)


def _finite(callback: Callable[..., Any] | None) -> Callable[..., Any]:
    """An option's callback that first refuses NaN and the infinities (one rule for every number any command
    takes: a poll of NaN seconds never fires, ``--since inf`` overflowed into a traceback), then runs ``callback``."""
    def check(ctx: Any, param: Any, value: Any) -> Any:
        for v in value if isinstance(value, list | tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise click_exc.BadParameter(f"must be a finite number, got {v}", ctx=ctx, param=param)
        return value if callback is None else callback(ctx, param, value)
    return check


def _finite_numbers(command: Any) -> Any:
    """``command`` and its sub-commands with every parameter behind :func:`_finite`."""
    for param in command.params:
        param.callback = _finite(param.callback)
    for sub in getattr(command, "commands", {}).values():
        _finite_numbers(sub)
    return command


def run(argv: Sequence[str] | None = None) -> int:
    """The `gpuledger` command without the process exit: returns the exit code. Every error is one line on stderr:
    2 for bad input (a bad flag or value, NaN or an infinity for a number, a missing file), 1 for a failure; never a
    traceback (GPULEDGER_DEBUG=1 lets an unexpected exception through with its traceback)."""
    command = _finite_numbers(typer.main.get_command(app))
    try:
        rv = command.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="gpuledger",
                          standalone_mode=False)
    except click_exc.NoArgsIsHelpError as e:  # `gpuledger report`: show what there is
        sys.stdout.write(e.ctx.get_help() + "\n")
        return 0
    except click_exc.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "gpuledger"
        error(f"{where}: {e.format_message()} (see `{where} --help`)")
        return 2
    except click_exc.ClickException as e:
        error(e.format_message())
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        return 130
    except BrokenPipeError:  # `gpuledger ... | head`: the reader has what it wanted
        return 0
    except Exception as e:  # noqa: BLE001 - where an unexpected error becomes a line and exit 1
        return unexpected(e)
    return rv if isinstance(rv, int) else 0


def main() -> None:
    """Entry point of the `gpuledger` script."""
    code = run()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so a closed pipe stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


if __name__ == "__main__":
    main()
