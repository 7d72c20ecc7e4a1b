"""``gpuledger collector compact|set-settings|series|totals``: the store's tiers (and the settings its processes
share) from the command line, on the ledger that ``collector.ledger_url`` resolves (the data directory's embedded
store by default)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.ledger_url import STORE_NAME, LedgerUrlOpt, cli_ledger_url, ledger_label, open_ledger
from gpuledger.collector.series_store import TIER_NAMES
from gpuledger.collector.store import AGREED_OPTIONS, QueryRangeError, Store, query_range, setting_text
from gpuledger.collector.worker import compaction_options, store_options
from gpuledger.output import fail, note

app = typer.Typer(help="Maintain and query the store's tiers.", no_args_is_help=True)

DB_NAME = STORE_NAME  # the embedded store's file inside --data-dir
# --data-dir and --config of every collector command (collector.cli imports them)
DataDir = typer.Option(Path("./gpuledger-data"), "--data-dir", envvar="GPULEDGER_DATA_DIR",
                       help="Directory of the embedded store, the audit log and the outputs.")
ConfigFile = typer.Option(None, "--config", help="TOML file whose [ledger] table may name the ledger "
                          "(default: <data-dir>/gpuledger.toml if present).")


def open_configured(url: str | None, data_dir: Path, config: Path | None, *, compacts: bool = False,
                    adopt_settings: bool = False) -> Store:
    """The existing ledger at ``url`` (exit 2 without one: a query never creates it), opened with the
    ``[collector]`` settings (file < GPULEDGER_COLLECTOR_*) that ``collector serve`` opens it with: under the
    built-in defaults a compaction would expire samples the configured retention keeps and roll up minutes the
    configured late window may still change. The settings every process on the ledger shares (``AGREED_SETTINGS``,
    the retention among them) are checked against the ledger's (exit 2 when they differ) where the command
    ``compacts`` (those compaction reads; the power caps it leaves to the ledger) or records them all
    (``adopt_settings``); a query reads with the ledger's, whatever the configuration here says."""
    try:
        settings = load_settings(data_dir, config)
    except (ConfigError, OSError) as e:
        fail(str(e))
    checked = AGREED_OPTIONS if adopt_settings else compaction_options(settings) if compacts else {}
    options = {k: v for k, v in store_options(settings).items() if k not in AGREED_OPTIONS or k in checked}
    return open_ledger(url, data_dir, adopt_settings=adopt_settings, **options)


def _open(data_dir: Path, config: Path | None, ledger_url: str | None, **kwargs: bool) -> Store:
    return open_configured(cli_ledger_url(ledger_url, data_dir, config), data_dir, config, **kwargs)


def _query_range(start: float | None, end: float | None, step: float | None = None) -> float | None:
    """The store's rules of a queried range (``store.query_range``, the API's too), exit 2 naming the option."""
    try:
        return query_range(start, end, step, name=lambda n: f"--{n}")
    except QueryRangeError as e:
        fail(str(e))


COMPACT_AHEAD_S = 86400.0  # --now may run this far ahead of the clock, no further (retention deletes by it)


@app.command()
def compact(
    data_dir: Path = DataDir,
    now: float | None = typer.Option(None, help="Apply retention as of this unix time (default: now; at most a "
                                     "day ahead of the clock)."),
    config: Path | None = ConfigFile,
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """Roll up closed minutes and hours, merge small chunks, drop data past retention (idempotent)."""
    latest = time.time() + COMPACT_AHEAD_S
    if now is not None and not 0 <= now <= latest:  # NaN fails too; a time in ms would expire every raw sample
        fail(f"--now must be unix seconds, at most a day ahead of the clock ({latest:.0f}), got {now!r}")
    store = _open(data_dir, config, ledger_url, compacts=True)
    try:
        st = store.compact(now, all_host_chunks=True)
        store.checkpoint()
        typer.echo(json.dumps({"split_host_chunks": st.split_chunks, "rolled_minutes": st.rolled_minutes,
                               "rolled_hours": st.rolled_hours, "merged_chunks": st.merged_chunks,
                               "deleted_chunks": st.deleted_chunks,
                               "tiers": store.tiers(), "size_bytes": store.size_bytes()}, indent=2))
    finally:
        store.close()


@app.command("set-settings")
def set_settings(
    data_dir: Path = DataDir,
    config: Path | None = ConfigFile,
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """Record this configuration's window_s, max_gap_s, dedupe_horizon_s, power_cap_w, power_caps and the tiers'
    retention (raw_retention_s, minute_retention_s, hour_retention_s as the local store applies them: with series_url,
    those it derives) in the ledger: the values every collector and compactor on it must share (one opened with others
    refuses to start). Stop them all first, run this, then start them with the new configuration."""
    store = _open(data_dir, config, ledger_url, adopt_settings=True)
    try:
        for name, (before, now) in store.recorded_settings.items():
            note(f"{name}: {setting_text(before)} -> {setting_text(now)}")
        typer.echo(json.dumps(store.agreed_settings, indent=2))
    finally:
        store.close()


@app.command()
def series(
    host: str = typer.Argument(..., help="Host name."),
    gpu_uuid: str = typer.Argument(..., help="GPU UUID."),
    start: float = typer.Option(..., help="Unix seconds (negative: seconds before now)."),
    end: float | None = typer.Option(None, help="Unix seconds (default now)."),
    step: float | None = typer.Option(None, help="Bucket seconds (1 ms at least); picks the 1m or 1h tier when "
                                      "coarse enough."),
    mig: str | None = typer.Option(None, help="MIG instance."),
    tier: str | None = typer.Option(None, help="Force a tier: raw, 1m or 1h."),
    data_dir: Path = DataDir,
    config: Path | None = ConfigFile,
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """One GPU's samples or rollup buckets as JSON lines (the tier is picked by range and retention)."""
    now = time.time()
    start = now + start if start < 0 else start
    step = _query_range(start, now if end is None else end, step)
    forced = None
    if tier is not None:
        names = {v: k for k, v in TIER_NAMES.items()}
        if tier not in names:
            raise typer.BadParameter(f"tier must be one of {sorted(names)}", param_hint="--tier")
        forced = names[tier]
    url = cli_ledger_url(ledger_url, data_dir, config)
    store = open_configured(url, data_dir, config)
    try:
        if (host, gpu_uuid, mig or "") not in set(store.gpus()):
            known = sorted(u for h, u, _ in store.gpus() if h == host)
            fail(f"no GPU {gpu_uuid}{' MIG ' + mig if mig else ''} on host {host!r} in {ledger_label(url, data_dir)}"
                 + (f"; that host has {', '.join(known)}" if known else "; `gpuledger collector usage --per-gpu` "
                    "lists the GPUs measured"))
        points = store.series(host, gpu_uuid, start, now if end is None else end, step=step, mig=mig, tier=forced)
    finally:
        store.close()
    if not points:
        note(f"no data for {host} {gpu_uuid} between {start:.0f} and {now if end is None else end:.0f}")
    for p in points:
        typer.echo(json.dumps(p.to_dict()))


@app.command()
def totals(
    data_dir: Path = DataDir,
    start: float | None = typer.Option(None, help="Unix seconds: from the hour holding it."),
    end: float | None = typer.Option(None, help="Unix seconds: up to, not including, the hour holding it."),
    config: Path | None = ConfigFile,
    ledger_url: LedgerUrlOpt = None,
) -> None:
    """Cluster totals (GPU-seconds observed, allocated, SM-active; energy) and the tiers' sizes, over whole hours:
    the hour buckets from the one holding --start up to, not including, the one holding --end (adjacent ranges
    partition the hours; a range inside one hour sums none). The answer's "hours_start" and "hours_end" name the
    buckets summed; "last_compaction" says when a compaction of the ledger last completed (unix time, or null)."""
    _query_range(start, end)
    store = _open(data_dir, config, ledger_url)
    try:
        typer.echo(json.dumps({**store.totals(start, end), "tiers": store.tiers(), "size_bytes": store.size_bytes(),
                               "last_compaction": store.last_compaction()}, indent=2))
    finally:
        store.close()
