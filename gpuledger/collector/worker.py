"""One serving process of the collector: what ``collector serve`` serves with, and its entry point as one worker of
several.

:class:`Collector` is what one process serves with, built from the collector's settings: its Store on the ledger,
the sinks, the audit log, the GC freezer, RemoteSeries (``series_url``) and the CollectorServer. ``collector serve``
builds one in its own process (``workers = 1``); with ``workers`` > 1 it becomes a supervisor
(``collector.supervisor``) that runs ``python -m gpuledger.collector.worker`` that many times.

A worker reads its settings as one JSON line on standard input (as the compactor does: nothing secret, a PostgreSQL
password or a token, on a command line) and builds a Collector bound with SO_REUSEPORT to the collector's port: each
worker listens on a socket of its own, the kernel spreads new connections over them, an agent's keep-alive
connection stays with one worker, and a host whose agent reconnects to another is restored there from the ledger
(``Store``: ``claim_hosts``). Once it listens it writes one JSON line on standard output, ``{"url": ..., "port":
...}`` (with port 0 the supervisor starts the others on the first one's port). Its metrics go to the supervisor's
multiprocess directory (``server._Metrics``): any worker's /metrics describes them all. It stops on SIGTERM or
SIGINT, and when its standard input ends: its supervisor is gone, however it went (SIGKILL included). A worker that
cannot start says why in one line on standard error and exits with the status ``serve`` would (2: bad
configuration, a PostgreSQL server that refuses the ledger's URL; 1: a failure such as an unreachable ledger).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from prometheus_client import Counter, values
from prometheus_client.core import Metric

from gpuledger.collector.auditlog import open_log
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.config import CollectorSettings
from gpuledger.collector.db import DatabaseConfigError
from gpuledger.collector.gcfreeze import GcFreezer
from gpuledger.collector.ledger_url import database_failures, open_ledger
from gpuledger.collector.series_outbox import RemoteSeries, ShipperMetrics
from gpuledger.collector.server import FEED_NAME, STOP_GRACE_S, CollectorServer, tls_context
from gpuledger.collector.store import Store, StoreStalled, StoreUnavailable
from gpuledger.output import fail, unexpected

log = logging.getLogger(__name__)

REFRESH_S = 5.0  # a worker's figures that change in other threads reach the shared metrics this often


def compaction_options(settings: CollectorSettings) -> dict[str, Any]:
    """What compaction reads of the collector's settings, as :class:`Store` (and ``CompactorProcess``) keyword
    arguments: the late window and gap (which minutes are final), the tiers' retention, the dedupe horizon."""
    return {"window_s": settings.window_s, "max_gap_s": settings.max_gap_s, "retention": settings.retention(),
            "dedupe_horizon_s": settings.dedupe_horizon_s}


def store_options(settings: CollectorSettings) -> dict[str, Any]:
    """:class:`Store`'s keyword arguments from the collector's settings (all but ``sinks``): what ``collector serve``
    opens the ledger with, and so every command that opens it (a compaction under other settings would expire or
    roll up what the collector still needs; ``collector compact`` leaves out the power caps, which only ingest counts
    by)."""
    return {**compaction_options(settings), "power_cap_w": settings.power_cap_w, "power_caps": settings.power_caps,
            "max_gpus_per_host": settings.max_gpus_per_host, "series_outbox": bool(settings.series_url)}


@dataclass
class Collector:
    """What one collector process serves with; :meth:`close` stops and closes it all."""

    store: Store
    server: CollectorServer
    freezer: GcFreezer
    remote: RemoteSeries | None
    sinks: Sequence[Any]
    shared_shipper: SharedShipperMetrics | None = None  # the shipper's counters, one worker of several

    @classmethod
    def open(cls, settings: CollectorSettings, data_dir: Path, ledger_url: str | None, tls: ssl.SSLContext | None,
             sinks: Sequence[Any], *, port: int | None = None, reuse_port: bool = False,
             metrics_dir: str | Path | None = None, compact: bool = False) -> Collector:
        """The audit log, the store (its background thread compacting only with ``compact``: otherwise a compactor
        process does), the GC freezer, RemoteSeries and the server on ``port`` (default: the settings'), bound with
        ``reuse_port``, metrics shared through ``metrics_dir`` (one worker of several). Ends like a command
        (``output.fail``) when the audit log, the ledger or the address cannot be opened."""
        # the ledger's audit log (beside a PostgreSQL ledger, in its database): posted job records go there first
        with database_failures():  # the first to connect to a PostgreSQL ledger: refused for good 2, away 1
            try:
                audit_log = open_log(data_dir, ledger_url=ledger_url)
            except DatabaseConfigError:
                raise
            except ValueError as e:  # a pseudonymization key that contradicts the shared ledger's
                fail(str(e))
        store = open_ledger(ledger_url, data_dir, create=True, sinks=sinks, **store_options(settings))
        store.start_background(settings.compact_interval_s, compact=compact)
        freezer = GcFreezer().start()
        # series in VictoriaMetrics or InfluxDB: the store's outbox is shipped there, and series are answered from there
        remote = RemoteSeries(store.series_store, settings.series_url, settings.series_api, settings.series_database,
                              read_timeout_s=settings.request_timeout_s) if settings.series_url else None
        port = settings.port if port is None else port
        try:
            server = CollectorServer(
                store, audit_log=audit_log, host=settings.host, port=port, max_body_bytes=settings.max_body_bytes,
                auth=Authenticator(settings.tokens, settings.admin_tokens, settings.read_tokens), tls=tls,
                priority_feed=settings.priority_feed or data_dir / FEED_NAME, max_inflight=settings.max_inflight,
                max_per_host=settings.max_per_host, request_timeout_s=settings.request_timeout_s,
                ledger_timeout_s=settings.ledger_timeout_s,
                idle_timeout_s=settings.idle_timeout_s, limits=settings.limits(),
                max_series_points=settings.max_series_points, max_page=settings.max_page,
                metrics_user_labels=settings.metrics_user_labels, series=remote.reader if remote else None,
                reuse_port=reuse_port, metrics_dir=metrics_dir, metrics_port=settings.metrics_port,
            )
        except OSError as e:  # taken since serve checked it was free
            also = "" if settings.metrics_port is None else f" or its metrics_port {settings.metrics_port}"
            fail(f"cannot listen on {settings.host}:{port}{also}: {e.strerror or e}", code=1)
        shared_shipper = None
        if remote is not None:
            shared_shipper = None if metrics_dir is None else SharedShipperMetrics(remote.metrics)
            server.metrics.ledger.add(shared_shipper or remote.metrics)  # (its backlog is read from the ledger)
        return cls(store, server, freezer, remote, sinks, shared_shipper)

    def refresh_metrics(self) -> None:
        """One worker of several: writes what changed in other threads since to the shared metrics."""
        self.server.metrics.refresh()
        if self.shared_shipper is not None:
            self.shared_shipper.sync()

    def close(self) -> None:
        """Stops serving (requests still waiting are answered 503 after STOP_GRACE_S: ``CollectorServer.stop``), then
        gives the commit in progress until ledger_timeout_s after the stop began (at least STOP_GRACE_S) to end. A
        ledger that stalls past that ends the process like a failed command: one line saying the ledger was stalled
        at shutdown, exit status 1; nothing unacknowledged is claimed stored (the agents resend it)."""
        bound_s = max(self.server.ledger_timeout_s, STOP_GRACE_S)
        deadline = time.monotonic() + bound_s
        self.store.closing(bound_s)  # what waits for the store past that gives up, the series shipper's flush too
        self.server.stop()
        self.freezer.stop()
        stalled: StoreStalled | None = None
        try:
            if self.remote is not None:  # what it cannot ship in a few seconds stays queued for the next start
                try:
                    self.remote.close()
                except StoreUnavailable as e:  # behind a stalled commit: its queue stays for the next start
                    log.warning("series shipper not flushed at shutdown: %s", e)
            # (a second at least: an idle committer takes a moment to see the close)
            self.store.close(timeout_s=max(deadline - time.monotonic(), 1.0))
        except StoreStalled as e:
            stalled = e
        finally:
            for sink in self.sinks:  # flush what is buffered for InfluxDB
                sink.close()
        if stalled is not None:
            fail(str(stalled), code=1)


class SharedShipperMetrics:
    """RemoteSeries' metrics in one worker of several. The queue's gauges read the database, so the worker a scrape
    lands on answers them for all; the shipper's counters count this process's shipments, so they are copied into
    multiprocess counters of the same names (:meth:`sync`, every REFRESH_S), which every worker's /metrics sums."""

    def __init__(self, metrics: ShipperMetrics) -> None:
        self.metrics = metrics
        self._counters: dict[str, tuple[Counter, float]] = {}  # name -> (shared counter, the value copied so far)
        self.sync()

    def sync(self) -> None:
        for family in self.metrics.collect():
            if family.type != "counter":
                continue
            value = family.samples[0].value
            counter, copied = self._counters.get(family.name) or (
                Counter(family.name, family.documentation, registry=None), 0.0)
            counter.inc(value - copied)
            self._counters[family.name] = (counter, value)

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.metrics.collect() if family.type != "counter")


def share_metrics(metrics_dir: str) -> None:
    """Metrics of this process go to files in ``metrics_dir`` (prometheus_client's multiprocess mode): set before
    any metric is built, which reads ``values.ValueClass`` when it is."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    values.ValueClass = values.MultiProcessValue()


class _StopOnce:
    """SIGTERM and SIGINT: the first raises KeyboardInterrupt (the worker stops cleanly wherever it is), later ones
    are ignored (a supervisor forwarding a Ctrl-C the worker got too must not cut the clean stop short)."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt


def _watch(fd: int) -> None:
    """Stops this worker when its standard input (``fd``, read raw: a thread blocked in a buffered read would hold
    the buffer's lock at interpreter shutdown) ends: the supervisor closed it, or is gone."""
    while os.read(fd, 4096):  # the supervisor writes nothing more; a read returns only at its end
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _refresh(collector: Collector) -> None:
    while True:
        time.sleep(REFRESH_S)
        try:
            collector.refresh_metrics()
        except Exception as e:  # the ledger away (the shipper's backlog is read there): the next turn catches up
            log.warning("cannot refresh the shared metrics: %s", e)


def run(doc: dict[str, Any]) -> None:
    """Builds the worker ``doc`` describes (``settings``: the collector's, as the supervisor validated them;
    ``data_dir``, ``ledger_url``, ``port``, ``metrics_dir``), reports where it listens on standard output and
    serves until stopped."""
    settings = CollectorSettings.model_validate(doc["settings"])
    try:
        tls = tls_context(settings.tls_cert, settings.tls_key) if settings.tls_cert and settings.tls_key else None
        sinks = settings.sinks()
    except (OSError, ssl.SSLError, ValueError) as e:
        fail(str(e))
    collector = Collector.open(settings, Path(doc["data_dir"]), doc["ledger_url"], tls, sinks, port=doc["port"],
                               reuse_port=True, metrics_dir=doc["metrics_dir"])
    try:
        threading.Thread(target=_refresh, args=(collector,), name="metrics-refresh", daemon=True).start()
        port = collector.server.url.rsplit(":", 1)[1]
        sys.stdout.write(json.dumps({"url": collector.server.url, "port": int(port)}) + "\n")
        sys.stdout.flush()
        collector.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        collector.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING,
                        format=f"gpuledger collector worker[{os.getpid()}]: %(levelname)s %(message)s")
    stop = _StopOnce()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        line = sys.stdin.buffer.readline()
        if not line:
            return
        doc = json.loads(line)
        share_metrics(doc["metrics_dir"])
        threading.Thread(target=_watch, args=(sys.stdin.fileno(),), name="supervisor-watch", daemon=True).start()
        run(doc)
    except KeyboardInterrupt:  # stopped while starting
        pass
    except typer.Exit as e:  # output.fail said why
        sys.exit(e.exit_code)
    except Exception as e:  # as the gpuledger command does: one line, exit 1
        sys.exit(unexpected(e))


if __name__ == "__main__":
    main()
