"""Accounting results into the configured InfluxDB: the ``fairshare`` measurement (each user association's
fairshare and site factor, and every association's usage) and ``job_usage`` points with the ledger's records.

The writer is the collector's (:class:`gpuledger.collector.sinks.influx.InfluxSink`, configured by the
``[collector]`` table's ``influx_*`` settings); this module only chooses what to write and says whether it arrived.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.sinks.influx import fairshare_lines, job_usage_lines

# A command waits this long for InfluxDB, not the collector's patient minutes of retries.
CLI_RETRIES = 2
CLI_TIMEOUT_S = 10.0


class InfluxPublishError(RuntimeError):
    """InfluxDB did not take every line; the message says how many and why."""


class InfluxNotConfigured(InfluxPublishError):
    """No ``influx_url`` (or an invalid ``[collector]`` table): bad input, not a failure of InfluxDB."""


def fairshare_points(rows: Iterable[Any], feed: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Points for :func:`fairshare_lines`: the feed's user associations (fairshare, site factor, usage) and every
    account's own row (its raw and effective usage, and its fairshare where the algorithm gives accounts one)."""
    points: list[dict[str, Any]] = [dict(e) for e in feed]
    for r in rows:
        if r.user is None:
            points.append({"account": r.account, "user": None, "fairshare": r.fairshare, "raw_usage": r.raw_usage,
                           "effective_usage": r.effective_usage})
    return points


def job_points(entries: Iterable[LedgerEntry]) -> tuple[list[Any], dict[str, Any]]:
    """The measured jobs' summaries and their scheduler records, for :func:`job_usage_lines`."""
    usage = [e.usage for e in entries if e.usage is not None]
    records = {e.job_id: e.record for e in entries if e.record is not None}
    return usage, records


def publish(data_dir: Path, config: Path | None, lines: Sequence[str]) -> str:
    """Write ``lines`` to the InfluxDB configured for ``data_dir``; return where they went. Raises
    InfluxPublishError unless every line was written."""
    try:
        settings = load_settings(data_dir, config)
    except ConfigError as e:
        raise InfluxNotConfigured(str(e)) from None
    where = f"{settings.influx_url} ({settings.influx_api})"
    sink = settings.influx_sink(max_retries=CLI_RETRIES, backoff_s=0.5, timeout_s=CLI_TIMEOUT_S)
    if sink is None:
        path = config or data_dir / "gpuledger.toml"
        raise InfluxNotConfigured(f"no InfluxDB configured: set influx_url in the [collector] table of {path}")
    try:
        sink.write_lines(list(lines))
    finally:
        sink.close(timeout_s=CLI_TIMEOUT_S * (CLI_RETRIES + 2))
    if sink.stats.written_lines != len(lines):
        raise InfluxPublishError(f"InfluxDB {where} took {sink.stats.written_lines} of {len(lines)} points: "
                                 f"{sink.stats.last_error or 'no answer'}")
    return where


def fairshare_to_influx(data_dir: Path, config: Path | None, rows: Iterable[Any],
                        feed: Iterable[Mapping[str, Any]], ts: float) -> str:
    points = fairshare_points(rows, feed)
    return publish(data_dir, config, fairshare_lines(points, ts))


def jobs_to_influx(data_dir: Path, config: Path | None, entries: Iterable[LedgerEntry]) -> str:
    usage, records = job_points(entries)
    return publish(data_dir, config, job_usage_lines(usage, records))
