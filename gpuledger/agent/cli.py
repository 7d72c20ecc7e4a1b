"""``gpuledger agent ...``: sample GPUs once, list which sources work here, or run the agent daemon.

Only this module turns errors into exit codes; everything it calls raises or returns.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
from typing import Any

import typer

from gpuledger.agent.sources import SOURCES, make_source
from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.simulated import LOADS
from gpuledger.output import FORMAT_HELP, Column, Format, emit, fail, fixed, gib, percent, to_csv
from gpuledger.schema import limits as collector_limits
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample
from gpuledger.schema.text import NotText, read_text

app = typer.Typer(help="GPU node agent: read GPUs (nvml, dcgm, dcgm-exporter, simulated), expose and push samples.",
                  no_args_is_help=True)


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


def _with_mig_uuids(stages: list[Any], source: Any) -> list[Any]:
    """The mappers told the opened source's MIG instance UUIDs (NVML's), so that a mapping file or table may name
    an instance by its own UUID (samples carry the GPU's UUID and the instance id)."""
    mig_uuids = getattr(source, "mig_uuids", None)
    for stage in stages:
        if mig_uuids is not None and hasattr(stage, "mig_uuids"):
            stage.mig_uuids = mig_uuids
    return stages


MAPPER_HELP = "job mapper(s), applied in order: slurm-cgroup, mapping-dir, static (repeat the option for several)"
LOAD_HELP = (f"simulated source: the node's workload, one of {', '.join(LOADS)} (mixed: training, inference, a "
             "stalling loader and an idle GPU, like the demo); busy GPUs carry simulated job ids [default: free]")
# /metrics listens on every interface by default so that a central Prometheus can scrape it. It is read-only and
# unauthenticated and shows this node's GPU activity and job ids: keep it inside the cluster network (firewall),
# or pass --metrics-addr 127.0.0.1 behind a local proxy (docs/deploy.md).
METRICS_ADDR_HELP = ("address for /metrics; 0.0.0.0 (all interfaces) so Prometheus can scrape it. It is "
                     "unauthenticated and shows GPU activity and job ids: firewall it to the monitoring hosts, "
                     "or use 127.0.0.1")


def _join(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


# The table for people: percentages, GiB, W, kJ, °C. JSON and CSV carry every field in SI units and ratios.
SAMPLE_COLUMNS = (
    Column("host", "host", left=True), Column("gpu", "gpu_index"), Column("mig", "mig", left=True),
    Column("model", "model", left=True), Column("util", "gpu_util_ratio", percent),
    Column("sm", "sm_active_ratio", percent), Column("occ", "sm_occupancy_ratio", percent),
    Column("dram", "dram_bw_ratio", percent), Column("tensor", "tensor_active_ratio", percent),
    Column("mem GiB", "mem_used_bytes", gib), Column("power W", "power_watts", fixed(1)),
    Column("energy kJ", "energy_joules", fixed(1, 1e-3)), Column("temp C", "temp_celsius", fixed(0)),
    Column("jobs", "job_ids", _join, left=True), Column("pids", "pids", _join, left=True),
    Column("uuid", "gpu_uuid", left=True),
)


def print_samples(samples: list[GpuSample], fmt: Format) -> None:
    records = [s.to_dict() for s in samples]
    if fmt is Format.csv:  # every field; lists joined by ";" so that a cell stays a cell
        typer.echo(to_csv([Column(k, k) for k in SAMPLE_FIELDS],
                          [{k: (";".join(map(str, v)) if isinstance(v, list) else v) for k, v in r.items()}
                           for r in records]), nl=False)
    else:
        emit(fmt, records, SAMPLE_COLUMNS, title=f"{len(samples)} GPU sample(s)")


@app.command()
def once(
    source: str = typer.Option("nvml", "--source", "-s", help=f"one of: {', '.join(SOURCES)}"),
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL (for --source dcgm-exporter)"),
    fmt: Format = typer.Option(Format.json, "--format", "-f", help=FORMAT_HELP),
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
    agent = Agent(src, _with_mig_uuids(stages, src))
    try:
        if getattr(src, "name", "") == "nvml":
            # GPM rates need a window: take the first GPM sample now and report the 200 ms after it.
            src.sample()
            time.sleep(0.2)
        samples = agent.tick()
    finally:
        agent.close()
    print_samples(samples, fmt)


@app.command()
def sources(
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL to try"),
    fmt: Format = typer.Option(Format.table, "--format", "-f", help=FORMAT_HELP),
) -> None:
    """Say which GPU sources work on this host, and why the others do not."""
    rows: list[dict[str, Any]] = []
    for name in SOURCES:
        try:
            src = make_source(name, **_source_options(name, url, None, 1, 0))
            src.open()
            src.close()
        except typer.BadParameter as exc:
            rows.append({"source": name, "works": False, "why_not": exc.format_message()})
        except SourceUnavailable as exc:
            rows.append({"source": name, "works": False, "why_not": str(exc)})
        except Exception as exc:  # noqa: BLE001 - report any failure as "does not work", with its text
            rows.append({"source": name, "works": False, "why_not": f"{type(exc).__name__}: {exc}"})
        else:
            rows.append({"source": name, "works": True, "why_not": ""})
    emit(fmt, rows, (Column("source", "source", left=True), Column("works", "works", lambda w: "yes" if w else "no"),
                     Column("why not", "why_not", left=True)), title="GPU sources")


def _check_listen(addr: str, port: int) -> None:
    try:
        socket.create_server((addr, port)).close()
    except OSError as exc:
        fail(f"/metrics cannot listen on {addr}:{port}: {exc.strerror or exc} (--metrics-port, --metrics-addr)",
             code=1)


@app.command()
def run(
    source: str = typer.Option("nvml", "--source", "-s", help=f"one of: {', '.join(SOURCES)}"),
    url: str | None = typer.Option(None, help="dcgm-exporter /metrics URL (for --source dcgm-exporter)"),
    collector: list[str] = typer.Option([], help="collector base URL (http://host:8470 or host:8470) to push each "
                                        "batch to; repeat for fail-over collectors, tried in order"),
    metrics_port: int | None = typer.Option(9445, min=0, max=65535, help="serve /metrics on this port (0: any free "
                                            "port)"),
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
    max_batch_samples: int = typer.Option(collector_limits.MAX_SAMPLES, min=1, help="samples in one batch at most "
                                          "(larger pushes go as several, of whole cycles): the collector's "
                                          "max_samples; lower it to match a collector set lower"),
    max_batch_bytes: int = typer.Option(collector_limits.MAX_BODY_BYTES, min=1, help="bytes of one batch's body "
                                        "before compression at most: the collector's max_body_bytes; lower it to "
                                        "match a collector set lower"),
    max_gpu_jobs: int = typer.Option(collector_limits.MAX_SAMPLE_JOB_IDS, min=1, help="job ids one GPU's sample "
                                     "carries at most: the collector's max_job_ids; a GPU shared by more jobs is "
                                     "sent without them (measured, charged to no job); set it to match the "
                                     "collector's"),
    wire: str = typer.Option("msgpack", help="body encoding: msgpack (columns as raw bytes) or json"),
    cluster: str | None = typer.Option(None, help="Slurm cluster this host is in, sent with every batch so that "
                                       "jobs are told apart by (cluster, job id) (default: ClusterName from "
                                       "$SLURM_CONF or /etc/slurm/slurm.conf, else none)"),
) -> None:
    """Run the agent: sample every --interval, serve /metrics, push batches to --collector."""
    from gpuledger.agent.exposition import serve_metrics  # noqa: PLC0415
    from gpuledger.agent.sampler import Agent  # noqa: PLC0415

    if interval <= 0:
        raise typer.BadParameter("--interval must be positive")
    if metrics_port:  # before anything is opened or created (the spool): the address must be free
        _check_listen(metrics_addr, metrics_port)
    node = host or socket.gethostname()
    stages = _stages(mapper, mapping_dir)
    src = _open_source(source, url, node, gpus, seed, load)  # samples carry the host the agent pushes as
    stages = _with_mig_uuids(stages, src)
    sinks: list[Any] = []
    delivery: Any = None  # the sink that says what reached the collector
    if collector:
        from gpuledger.agent.push import BatchLimits, DirectSink, HttpPusher  # noqa: PLC0415

        if token_file:
            try:
                token = read_text(token_file).strip()
            except (OSError, NotText) as exc:
                raise typer.BadParameter(f"--token-file: {exc}") from exc
            if not token:  # else every batch would go without an Authorization header, refused for ever
                raise typer.BadParameter(f"{token_file} holds no token (empty or only whitespace)",
                                         param_hint="--token-file")
        if wire not in ("msgpack", "json"):
            raise typer.BadParameter(f"--wire must be msgpack or json, got {wire!r}")
        from gpuledger.agent.slurm import local_cluster_name  # noqa: PLC0415

        limits = BatchLimits(samples=max_batch_samples, body_bytes=max_batch_bytes, gpu_jobs=max_gpu_jobs)
        try:
            pusher = HttpPusher(collector, agent_id or node, node, token=token, verify=ca_cert or True, fmt=wire,
                                cluster=local_cluster_name() if cluster is None else cluster, limits=limits)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--collector") from None
        except OSError as exc:  # the pusher loads --ca-cert now, at startup, not at its first push (SSLError: OSError)
            if not ca_cert:
                raise
            raise typer.BadParameter(f"{ca_cert}: not a readable PEM CA bundle ({exc.strerror or exc})",
                                     param_hint="--ca-cert") from None
        sink: Any = DirectSink(pusher)
        if spool_dir:
            from gpuledger.agent.spool import Spool, SpoolingPusher  # noqa: PLC0415

            try:
                sink = SpoolingPusher(pusher, Spool(spool_dir, max_bytes=spool_max_bytes), fmt=wire).start()
            except (OSError, ValueError) as exc:
                raise typer.BadParameter(str(exc), param_hint="--spool-dir") from None
        delivery = sink
        if push_every > 1:
            from gpuledger.agent.push import Batcher  # noqa: PLC0415

            sink = Batcher(sink, push_every, limits)
        sinks.append(sink)
    agent = Agent(src, stages, sinks=sinks)
    stop = threading.Event()
    server = None
    previous: dict[int, Any] = {}
    try:
        if metrics_port is not None:
            try:
                server = serve_metrics(agent, metrics_port, metrics_addr)
            except OSError as exc:
                fail(f"/metrics cannot listen on {metrics_addr}:{metrics_port}: {exc.strerror or exc}", code=1)
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
    if delivery is not None:
        typer.echo(f"collector: {delivery.summary()}")
        if duration > 0 and agent.ticks_total and not delivery.delivered():
            typer.echo(f"error: nothing could be delivered to {', '.join(collector)} in {duration:g} s", err=True)
            raise typer.Exit(1)


if __name__ == "__main__":
    app()
