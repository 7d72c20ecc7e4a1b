"""``gpuledger collector ...``: run the collector, read job usage from the ledger (``collector.ledger_url``)."""

from __future__ import annotations

import signal
import socket
import ssl
from pathlib import Path
from typing import Any

import typer

from gpuledger.collector.auditlog.files import private_dir
from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.config import CollectorSettings, ConfigError, load_settings
from gpuledger.collector.db import redact
from gpuledger.collector.ledger_url import STORE_NAME, LedgerUrlOpt, cli_ledger_url, ledger_label
from gpuledger.collector.server import tls_context
from gpuledger.collector.store_cli import ConfigFile, DataDir, open_configured
from gpuledger.collector.supervisor import METRICS_DIR, Supervisor, WorkerFailed
from gpuledger.collector.worker import Collector, compaction_options
from gpuledger.output import FORMAT_HELP, Column, Format, emit, error, fail, fixed, gib, note, percent

app = typer.Typer(help="The central collector: ingest agents' batches, aggregate per job, store series.",
                  no_args_is_help=True)


def store_path(data_dir: Path) -> Path:
    """The embedded store of ``data_dir`` (the ledger when no ledger URL is given)."""
    return data_dir / STORE_NAME


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command()
def serve(
    data_dir: Path = DataDir,
    config: Path | None = typer.Option(None, "--config", help="TOML file whose [collector] table configures this "
                                       "(default: <data-dir>/gpuledger.toml if present)."),
    host: str | None = typer.Option(None, help="Address to listen on [default: 127.0.0.1]."),
    port: int | None = typer.Option(None, help="Port to listen on, 0 picks a free one [default: 8470]."),
    workers: str | None = typer.Option(None, "--workers", help="Ingest processes sharing the port and the ledger: a "
                                       "number, or auto (one per CPU this process may use, at most 8) [default: 1]."),
    window: float | None = typer.Option(None, help="Seconds a late sample may trail its GPU's newest and still "
                                        "count [default: 600]."),
    max_gap: float | None = typer.Option(None, help="Longer intervals between samples are gaps [default: 60]."),
    tokens_file: Path | None = typer.Option(None, help="TOML file of tokens ([tokens] host = token, admin_tokens, "
                                            "read_tokens); no tokens anywhere: authentication off."),
    tls_cert: Path | None = typer.Option(None, help="PEM certificate: serve HTTPS (with --tls-key)."),
    tls_key: Path | None = typer.Option(None, help="PEM private key of --tls-cert."),
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """Serve the ingest and query API until interrupted (settings: file < GPULEDGER_COLLECTOR_* < flags)."""
    try:
        settings = load_settings(data_dir, config, overrides={
            "host": host, "port": port, "workers": workers, "window_s": window, "max_gap_s": max_gap,
            "tokens_file": tokens_file, "tls_cert": tls_cert, "tls_key": tls_key,
        })
        tls = tls_context(settings.tls_cert, settings.tls_key) if settings.tls_cert and settings.tls_key else None
    except (ConfigError, OSError, ssl.SSLError) as e:
        fail(str(e))
    url = cli_ledger_url(ledger_url, data_dir, config)
    try:
        sinks = settings.sinks() if settings.workers == 1 else []  # workers build their own
    except ValueError as e:
        fail(str(e))
    # Nothing is created before we know it can run: the address must be free and the data dir a directory.
    try:
        socket.create_server((settings.host, settings.port)).close()
    except OSError as e:
        fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", code=1)
    if data_dir.exists() and not data_dir.is_dir():
        fail(f"--data-dir {data_dir} is not a directory")
    try:
        private_dir(data_dir)
    except OSError as e:
        fail(f"--data-dir {data_dir}: {e.strerror or e}", code=1)
    if settings.workers > 1:
        _supervise(settings, data_dir, url)
    else:
        _serve_here(settings, data_dir, url, tls, sinks)


def _serve_here(settings: CollectorSettings, data_dir: Path, url: str | None, tls: ssl.SSLContext | None,
                sinks: list[Any]) -> None:
    """``serve`` in this process (``workers = 1``), compaction in a child unless ``compaction = "thread"``."""
    collector = Collector.open(settings, data_dir, url, tls, sinks, compact=settings.compaction == "thread")
    compactor = None
    if settings.compaction == "process":
        compactor = CompactorProcess.beside(collector.store, url or store_path(data_dir), settings.compact_interval_s)
        compactor.start()
    # SIGTERM (systemd, kill) stops as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    typer.echo(_listening(settings, collector.server.url, url, data_dir))
    try:
        collector.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        try:
            collector.close()  # exits 1 for a ledger stalled at shutdown: the compactor is stopped all the same
        finally:
            if compactor is not None:
                compactor.stop()


def _supervise(settings: CollectorSettings, data_dir: Path, url: str | None) -> None:
    """``serve`` as ``settings.workers`` worker processes and a compactor (``collector.supervisor``); exits with the
    status of a worker that cannot start."""
    compactor = CompactorProcess(str(url or store_path(data_dir)), interval_s=settings.compact_interval_s,
                                 **compaction_options(settings))
    # what the workers need, on their standard input: the settings as validated here (tokens included), not re-read
    worker = {"settings": settings.model_dump(mode="json", exclude_unset=True), "data_dir": str(data_dir),
              "ledger_url": url}
    supervisor = Supervisor(settings.workers, worker, settings.port, compactor, data_dir / METRICS_DIR)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: supervisor.request_stop(signum))
    try:
        listening = supervisor.start()
        if listening is not None:
            typer.echo(_listening(settings, listening, url, data_dir))
            supervisor.run()
    except WorkerFailed as e:
        if e.message is not None:
            error(e.message)
        raise typer.Exit(e.status) from None
    finally:
        supervisor.stop()


def _listening(settings: CollectorSettings, server_url: str, url: str | None, data_dir: Path) -> str:
    auth = "on" if settings.auth_enabled else "off (no tokens configured)"
    influx = f", InfluxDB sink {settings.influx_url} ({settings.influx_api})" if settings.influx_url else ""
    series = ""
    if settings.series_api == "influxdb" and settings.series_url:
        series = f", series in InfluxDB {redact(settings.series_url)} database {settings.series_database!r}"
    elif settings.series_url:
        series = f", series in VictoriaMetrics {redact(settings.series_url)}"
    workers = f", {settings.workers} workers" if settings.workers > 1 else ""
    return (f"collector listening on {server_url}, ledger {ledger_label(url, data_dir)}, auth {auth}{influx}{series}"
            f"{workers}")


USAGE_COLUMNS = (
    Column("job", "job_id", left=True), Column("host", "host", left=True), Column("GPU", "gpu_uuid", left=True),
    Column("GPUs", "gpus"), Column("GPU-h", "allocated_gpu_seconds", fixed(3, 1 / 3600)),
    Column("SM-active GPU-h", "sm_active_gpu_seconds", fixed(3, 1 / 3600)), Column("eff.", "efficiency", percent),
    Column("mean HBM", "dram_bw_mean", percent), Column("energy kWh", "energy_joules", fixed(3, 1 / 3.6e6)),
    Column("peak mem GiB", "mem_used_peak_bytes", gib),
)


@app.command()
def usage(
    data_dir: Path = DataDir,
    job: str | None = typer.Option(None, "--job", help="Only this job id."),
    per_gpu: bool = typer.Option(False, "--per-gpu", help="One row per job and GPU."),
    fmt: Format = typer.Option(Format.table, "--format", help=FORMAT_HELP),
    config: Path | None = ConfigFile,
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """Print measured job usage from the ledger."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = ledger_label(url, data_dir)
    store = open_configured(url, data_dir, config)
    try:
        rows = store.job_usage(job, per_gpu=per_gpu)
    finally:
        store.close()
    if job is not None and not rows:
        fail(f"job {job}: no measurements in {path}")
    if not rows:
        note(f"no measured jobs in {path} yet")
    emit(fmt, [u.to_dict() for u in rows], USAGE_COLUMNS, title=f"GPU job usage ({path})")


# The store's maintenance and query commands (compact, series, totals) sit beside serve and usage.
from gpuledger.collector import store_cli  # noqa: E402

app.registered_commands.extend(store_cli.app.registered_commands)
