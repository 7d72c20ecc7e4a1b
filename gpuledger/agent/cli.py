"""``gpuledger agent ...``: sample GPUs once, list which sources work here, or run the agent daemon.

Only this module turns errors into exit codes; everything it calls raises or returns.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import sys
import threading
import time
from enum import StrEnum
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from gpuledger.agent.sources import SOURCES, make_source
from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.simulated import LOADS
from gpuledger.schema.records import GpuSample

app = typer.Typer(help="GPU node agent: read GPUs (nvml, dcgm, dcgm-exporter, simulated), expose and push samples.",
                  no_args_is_help=True)


class OutputFormat(StrEnum):
    json = "json"
    table = "table"


def _source_options(source: str, url: str | None, host: str | None, gpus: int, seed: int,
                    load: str | None = None) -> dict[str, Any]:
    if source == "simulated":
        if load is not None and load not in LOADS:
            raise typer.BadParameter(f"unknown load {load!r}; known: {', '.join(LOADS)}", param_hint="--load")
        return {"host": host or "sim-node", "gpus": gpus, "seed": seed, "load": load}
    if load is not None:
        raise typer.BadParameter("only the simulated source takes a load", param_hint="--load")
    if source == "dcgm-exporter":
        if not url:
            raise typer.BadParameter("--url (the exporter's /metrics URL) is required for --source dcgm-exporter")
        return {"url": url, "host": host}
    return {"host": host}


def _open_source(source: str, url: str | None, host: str | None, gpus: int, seed: int,
                 load: str | None = None) -> Any:
    if source not in SOURCES:
        raise typer.BadParameter(f"unknown source {source!r}; known: {', '.join(sorted(SOURCES))}")
    src = make_source(source, **_source_options(source, url, host, gpus, seed, load))
    try:
        src.open()
    except SourceUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    return src


def _stages(mapper: list[str], mapping_dir: str | None) -> list[Any]:
    """Job mappers in the order given, then the MIG energy split (a no-op on GPUs without MIG)."""
    from gpuledger.agent.mappers import MAPPERS, make_mapper  # noqa: PLC0415
    from gpuledger.agent.mig import MigEnergySplitter  # noqa: PLC0415

    out: list[Any] = []
    for name in mapper:
        if name not in MAPPERS:
            raise typer.BadParameter(f"unknown job mapper {name!r}; known: {', '.join(sorted(MAPPERS))}")
        if name == "mapping-dir":
            if not mapping_dir:
                raise typer.BadParameter("--mapping-dir is required for --mapper mapping-dir")
            out.append(make_mapper(name, path=mapping_dir))
        else:
            out.append(make_mapper(name))
    return out + [MigEnergySplitter()]


MAPPER_HELP = "job mapper(s), applied in order: slurm-cgroup, mapping-dir, static (repeat the option for several)"
LOAD_HELP = (f"simulated source: the node's workload, one of {', '.join(LOADS)} (mixed: training, inference, a "
             "stalling loader and an idle GPU, like the demo); busy GPUs carry simulated job ids [default: free]")
# /metrics listens on every interface by default so that a central Prometheus can scrape it. It is read-only and
# unauthenticated and shows this node's GPU activity and job ids: keep it inside the cluster network (firewall),
# or pass --metrics-addr 127.0.0.1 behind a local proxy (docs/deploy.md).
METRICS_ADDR_HELP = ("address for /metrics; 0.0.0.0 (all interfaces) so Prometheus can scrape it. It is "
                     "unauthenticated and shows GPU activity and job ids: firewall it to the monitoring hosts, "
                     "or use 127.0.0.1")


def _fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def render_table(samples: list[GpuSample]) -> Table:
    t = Table(title=f"{len(samples)} GPU sample(s)")
    for col in ("host", "gpu", "mig", "model", "util", "sm", "occ", "dram", "tensor", "mem GiB", "power W",
                "energy kJ", "temp C", "jobs", "pids"):
        t.add_column(col)
    for s in samples:
        mem = "-" if s.mem_used_bytes is None else f"{s.mem_used_bytes / 2**30:.1f}"
        if s.mem_total_bytes is not None:
            mem += f"/{s.mem_total_bytes / 2**30:.1f}"
        t.add_row(s.host, str(s.gpu_index), s.mig or "", s.model, _fmt(s.gpu_util_ratio), _fmt(s.sm_active_ratio),
                  _fmt(s.sm_occupancy_ratio), _fmt(s.dram_bw_ratio), _fmt(s.tensor_active_ratio), mem,
                  _fmt(s.power_watts, digits=1), _fmt(s.energy_joules, 1e-3, 1), _fmt(s.temp_celsius, digits=0),
                  ",".join(s.job_ids), ",".join(map(str, s.pids)))
    return t


@app.command()
def once(
    source: str = typer.Option("nvml", "--source", "-s", help=f"one of: {', '.join(SOURCES)}"),
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL (for --source dcgm-exporter)"),
    fmt: OutputFormat = typer.Option(OutputFormat.json, "--format", "-f", help="json or table"),
    host: str | None = typer.Option(None, help="host name to record (default: this host's name)"),
    gpus: int = typer.Option(8, help="simulated source: number of GPUs"),
    seed: int = typer.Option(0, help="simulated source: random seed"),
    load: str | None = typer.Option(None, help=LOAD_HELP, show_default=False),
    mapper: list[str] = typer.Option([], "--mapper", "-m", help=MAPPER_HELP),
    mapping_dir: str | None = typer.Option(None, help="directory written by the Slurm prolog (mapping-dir)"),
) -> None:
    """Run one sampling cycle and print it (JSON: a list of samples with the record's field names)."""
    from gpuledger.agent.sampler import Agent  # noqa: PLC0415 - sub-command imports stay lazy

    stages = _stages(mapper, mapping_dir)
    src = _open_source(source, url, host, gpus, seed, load)
    agent = Agent(src, stages)
    try:
        if getattr(src, "name", "") == "nvml":
            # GPM rates need a window: take the first GPM sample now and report the 200 ms after it.
            src.sample()
            time.sleep(0.2)
        samples = agent.tick()
    finally:
        agent.close()
    if fmt is OutputFormat.json:
        typer.echo(json.dumps([s.to_dict() for s in samples], indent=2))
    else:
        Console(width=None if sys.stdout.isatty() else 200).print(render_table(samples))


@app.command()
def sources(
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL to try"),
) -> None:
    """Say which GPU sources work on this host, and why the others do not."""
    table = Table(title="GPU sources")
    for col in ("source", "works", "why not"):
        table.add_column(col)
    for name in SOURCES:
        try:
            src = make_source(name, **_source_options(name, url, None, 1, 0))
            src.open()
            src.close()
        except typer.BadParameter as exc:
            table.add_row(name, "no", str(exc))
        except SourceUnavailable as exc:
            table.add_row(name, "no", str(exc))
        except Exception as exc:  # noqa: BLE001 - report any failure as "does not work", with its text
            table.add_row(name, "no", f"{type(exc).__name__}: {exc}")
        else:
            table.add_row(name, "yes", "")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@app.command()
def run(
    source: str = typer.Option("nvml", "--source", "-s", help=f"one of: {', '.join(SOURCES)}"),
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL (for --source dcgm-exporter)"),
    collector: str | None = typer.Option(None, help="collector samples URL to push each batch to"),
    metrics_port: int | None = typer.Option(9445, help="serve /metrics on this port (0: any free port)"),
    metrics_addr: str = typer.Option("0.0.0.0", help=METRICS_ADDR_HELP),
    interval: float = typer.Option(10.0, help="seconds between sampling cycles"),
    host: str | None = typer.Option(None, help="host name to record (default: this host's name)"),
    agent_id: str | None = typer.Option(None, help="agent id sent to the collector (default: host name)"),
    gpus: int = typer.Option(8, help="simulated source: number of GPUs"),
    seed: int = typer.Option(0, help="simulated source: random seed"),
    load: str | None = typer.Option(None, help=LOAD_HELP, show_default=False),
    duration: float = typer.Option(0.0, min=0.0, help="run for this many seconds: duration / interval cycles, "
                                   "rounded up (0: run until SIGTERM/SIGINT)"),
    mapper: list[str] = typer.Option([], "--mapper", "-m", help=MAPPER_HELP),
    mapping_dir: str | None = typer.Option(None, help="directory written by the Slurm prolog (mapping-dir)"),
    token_file: str | None = typer.Option(None, help="file holding this node's bearer token for the collector"),
    token: str | None = typer.Option(None, envvar="GPULEDGER_AGENT_TOKEN", show_default=False,
                                     help="bearer token (prefer --token-file or the environment: argv is public)"),
    spool_dir: str | None = typer.Option(None, help="keep unsent batches here and deliver them in order "
                                         "when the collector is back (survives agent restarts)"),
    spool_max_bytes: int = typer.Option(256 * 2**20, help="spool bound in bytes; beyond it the oldest are dropped"),
    ca_cert: str | None = typer.Option(None, help="CA bundle (PEM) to verify an https collector with"),
    push_every: int = typer.Option(1, min=1, help="push every N sampling cycles (fewer, larger batches)"),
    wire: str = typer.Option("msgpack", help="body encoding: msgpack (columns as raw bytes) or json"),
) -> None:
    """Run the agent: sample every --interval, serve /metrics, push batches to --collector."""
    from gpuledger.agent.exposition import serve_metrics  # noqa: PLC0415
    from gpuledger.agent.sampler import Agent  # noqa: PLC0415

    if interval <= 0:
        raise typer.BadParameter("--interval must be positive")
    node = host or socket.gethostname()
    stages = _stages(mapper, mapping_dir)
    src = _open_source(source, url, node, gpus, seed, load)  # samples carry the host the agent pushes as
    sinks: list[Any] = []
    if collector:
        from gpuledger.agent.push import HttpPusher  # noqa: PLC0415

        if token_file:
            try:
                token = open(token_file).read().strip()
            except OSError as exc:
                raise typer.BadParameter(f"--token-file: {exc}") from exc
        if wire not in ("msgpack", "json"):
            raise typer.BadParameter(f"--wire must be msgpack or json, got {wire!r}")
        pusher = HttpPusher(collector, agent_id or node, node, token=token, verify=ca_cert or True, fmt=wire)
        sink: Any = pusher
        if spool_dir:
            from gpuledger.agent.spool import Spool, SpoolingPusher  # noqa: PLC0415

            sink = SpoolingPusher(pusher, Spool(spool_dir, max_bytes=spool_max_bytes), fmt=wire).start()
        if push_every > 1:
            from gpuledger.agent.push import Batcher  # noqa: PLC0415

            sink = Batcher(sink, push_every)
        sinks.append(sink)
    agent = Agent(src, stages, sinks=sinks)
    stop = threading.Event()
    server = None
    previous: dict[int, Any] = {}
    try:
        if metrics_port is not None:
            server = serve_metrics(agent, metrics_port, metrics_addr)
            typer.echo(f"serving /metrics on {metrics_addr}:{server.port}")
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: stop.set())
        # Cycles start at 0, interval, 2 x interval, ... while before --duration: counted, not timed, so a
        # slow cycle never adds one.
        cycles = math.ceil(duration / interval - 1e-9) if duration > 0 else None
        agent.run(interval, stop, max_ticks=cycles)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if server is not None:
            server.shutdown()
        agent.close()
    typer.echo(f"stopped after {agent.ticks_total} cycle(s); errors: {agent.errors_total}")


if __name__ == "__main__":
    app()
