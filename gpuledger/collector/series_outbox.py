"""Shipping series to VictoriaMetrics or InfluxDB (``series_url``): a transactional outbox in the store, drained by
a thread.

With ``series_url`` the store wraps its chunk store in :class:`OutboxSeriesStore`. Every batch's raw samples go to
the chunks, which the aggregation's restores read (``window``), and, in the same transaction, to the
``series_outbox`` table: a sample is committed with its batch and queued, or neither. :class:`SeriesShipper`
reads the oldest queued rows (at most ``batch_rows`` rows holding ``batch_samples`` samples: memory stays
bounded however long the series database was away), posts them to it (a ``series_remote.SeriesTarget``:
VictoriaMetrics' /api/v1/import, ``collector.victoriametrics``, or InfluxDB's /write, ``collector.influxdb``) and
deletes them only once it answered 2xx. A crash or a timeout between the two ships them again: at least once,
never lost. InfluxDB overwrites a point written again (same measurement, tags and time), so a resend is harmless
there; VictoriaMetrics holds each point twice unless it deduplicates, so start it with
``-dedup.minScrapeInterval=1ms`` (docs/deploy.md; the shipper logs a warning when it is not).

While the series database is away, ingest goes on and the queue grows on disk, never in memory. Retries back off
from ``backoff_s``, doubling up to ``backoff_max_s``, and one log line marks each change between shipping and
failing. A shipment the database refuses as malformed (4xx other than 408/429: retrying cannot help) is logged,
dropped and counted.

Collectors sharing a ledger (PostgreSQL) queue into its one outbox, each in its batches' transactions. The queue
is split into ``SHIP_SLOTS`` slots by row id, and a slot is shipped by one shipper at a time
(:meth:`OutboxSeriesStore.shipping`, a ``Database.try_lock``): each shipper drains every slot it can lock, so one
collector ships everything alone, several ship in parallel without sending a row twice, and a slot whose
shipper died is taken over (the lock dies with its holder).

The collector's /metrics shows the queue (:class:`ShipperMetrics`):
``gpuledger_collector_series_backlog_samples``, ``gpuledger_collector_series_lag_seconds``
(age of the oldest queued batch), ``gpuledger_collector_series_shipped_samples_total``,
``gpuledger_collector_series_ship_failures_total`` and ``gpuledger_collector_series_dropped_samples_total``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import msgpack
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuledger.collector.aggregate import GpuKey, WindowSegment
from gpuledger.collector.chunks import encode_samples, encode_series_many
from gpuledger.collector.db import Database
from gpuledger.collector.influxdb import InfluxDB, InfluxSeriesReader
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.collector.series_remote import SeriesBackendError, SeriesTarget, SeriesUnavailable
from gpuledger.collector.series_store import MergeGroup, Retention, SeriesStore
from gpuledger.collector.victoriametrics import VictoriaMetrics, VmSeriesReader
from gpuledger.schema.records import GpuSample

log = logging.getLogger(__name__)

# id: random, so collectors sharing a PostgreSQL ledger queue rows at once without a shared counter (the order
# shipped is the order written, which the series databases do not need either). (written, samples) covers the
# shipper's oldest-first reads and the backlog's sum without reading the blobs.
SCHEMA = """
CREATE TABLE IF NOT EXISTS series_outbox (
  id INTEGER PRIMARY KEY, written REAL NOT NULL, samples INTEGER NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS series_outbox_written ON series_outbox (written, samples, id);
"""
SHIP_SLOTS = 4  # shippers that can drain one outbox at once (one per collector)


def local_retention(window_s: float, raw_s: float | None = None) -> Retention:
    """What the local chunk store keeps when a series database holds the series: raw samples for ``raw_s``, by
    default the least Retention.check allows (the aggregation window plus a chunk's hour). That is all restores
    need: compaction drops only raw samples it rolled up, and it never rolls up a GPU's window (minutes
    close only once they are older than the GPU's newest sample less the window), so a GPU's window and newest
    sample, from which its next interval starts however long it was silent, stay whatever their age.
    Rollups: compaction still builds them before raw samples go, and drops them an hour after their chunk's
    span (a day's chunk of minutes, a month's of hours); nothing reads them, the series database answers. The chunk
    spans stay the defaults, so chunks written before series_url was set keep their meaning.

    What it returns is the retention the ledger records and compares (``store.RETENTION_SETTINGS``), derived or not:
    every process on the ledger must derive the same (series_url set in all or none, the same window_s and
    raw_retention_s), and ``collector set-settings`` with another window_s records the raw retention it derives."""
    return Retention(raw_s=window_s + Retention().raw_chunk_s if raw_s is None else raw_s,
                     minute_s=3600.0, hour_s=3600.0)


@dataclass(frozen=True, slots=True)
class Queued:
    """One outbox row: a batch's raw chunks, ``samples`` samples."""

    id: int
    samples: int
    data: bytes

    def chunks(self) -> list[tuple[str, str, str, bytes]]:
        return [(h, u, m, blob) for h, u, m, blob in msgpack.unpackb(self.data, raw=False)]


class OutboxSeriesStore:
    """A ``SeriesStore`` that writes through ``inner`` (the chunk store) and queues the same samples in the
    outbox, on ``db`` in the caller's transaction. ``lock`` is the store's: the shipper's reads and deletes take
    it (an embedded ledger's one connection serves ingest too). Reads and compaction are ``inner``'s.

    Several collectors on one ledger queue into one outbox; one shipper at a time ships a slot (:meth:`shipping`)."""

    def __init__(self, inner: SeriesStore, db: Database, lock: threading.RLock,
                 clock: Callable[[], float] = time.time) -> None:
        self.inner, self._db, self._lock, self._clock = inner, db, lock, clock
        db.script(SCHEMA)

    # -- writes (under the store's lock, in its transaction) ----------------------------------------------------
    def _queue(self, chunks: list[list[Any]], samples: int) -> None:
        if chunks:
            self._db.execute("INSERT INTO series_outbox (id, written, samples, data) VALUES (?,?,?,?)",
                             (secrets.randbits(63), self._clock(), samples, msgpack.packb(chunks)))

    def write_samples(self, samples: list[GpuSample]) -> None:
        self.inner.write_samples(samples)
        per_gpu: dict[tuple[str, str, str], list[GpuSample]] = {}  # a MIG GPU's rows alternate with its instances'
        for s in samples:
            per_gpu.setdefault((s.host, s.gpu_uuid, s.mig or ""), []).append(s)
        # one outbox row: a MIG GPU's instant (its whole-GPU row and its instances') is shipped, and rendered, together
        self._queue([[*key, encode_samples(rows)] for key, rows in per_gpu.items()], len(samples))

    def write_series(self, series: list[Series]) -> None:
        self.inner.write_series(series)
        blobs = encode_series_many(series)
        self._queue([[s.host, s.gpu_uuid, s.mig or "", b] for s, b in zip(series, blobs)], sum(s.n for s in series))

    def write_host_series(self, series: list[Series]) -> None:
        self.write_series(series)  # one chunk a GPU: the shipper sends chunks of one GPU each

    # -- the chunk store's part ------------------------------------------------------------------------------------
    def window(self, gpu_key: GpuKey, floor: float) -> list[WindowSegment]:
        return self.inner.window(gpu_key, floor)

    def newest(self, host: str, gpu_keys: Iterable[GpuKey]) -> dict[GpuKey, list[WindowSegment]]:
        return self.inner.newest(host, gpu_keys)

    def roll_up(self, gpu_key: GpuKey, final_before: float) -> tuple[int, int]:
        return self.inner.roll_up(gpu_key, final_before)

    def mergeable_groups(self, tier: int, now: float) -> list[MergeGroup]:
        return self.inner.mergeable_groups(tier, now)

    def merge(self, group: MergeGroup) -> int:
        return self.inner.merge(group)

    def expire(self, now: float) -> int:
        return self.inner.expire(now)

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        return self.inner.series(host, gpu_uuid, start, end, step=step, mig=mig, tier=tier)

    def tiers(self) -> list[dict]:
        return self.inner.tiers()

    # -- the shipper's side (takes the store's lock) ------------------------------------------------------------
    def shipping(self, slot: int) -> AbstractContextManager[bool]:
        """The lock of the outbox's ``slot`` for a block, if no other shipper holds it: yields whether it was
        taken, never waits (two shippers would post the same rows twice)."""
        return self._db.try_lock(f"series-shipper-{slot}")

    def take(self, max_rows: int, max_samples: int, slot: int | None = None) -> list[Queued]:
        """The oldest queued rows (of ``slot``, or of all): at most ``max_rows``, and no more once they hold
        ``max_samples`` (at least one)."""
        where, args = ("WHERE id % ? = ? ", (SHIP_SLOTS, slot)) if slot is not None else ("", ())
        with self._lock:
            rows = self._db.execute(f"SELECT id, samples, data FROM series_outbox {where}ORDER BY written, id LIMIT ?",
                                    (*args, max_rows)).fetchall()
        out: list[Queued] = []
        total = 0
        for row_id, samples, data in rows:
            if out and total + samples > max_samples:
                break
            out.append(Queued(row_id, samples, bytes(data)))
            total += samples
        return out

    def ack(self, rows: list[Queued]) -> None:
        """Forget ``rows`` (shipped, or refused for good). By id, not by position: on a shared ledger another
        collector's row written earlier may commit after :meth:`take` read the queue, and must stay queued."""
        if not rows:
            return
        with self._lock, self._db.transaction() as db:
            db.execute(f"DELETE FROM series_outbox WHERE id IN ({','.join('?' * len(rows))})", [r.id for r in rows])

    def backlog(self) -> tuple[int, float | None]:
        """(samples queued, when the oldest queued row was written or None). It sums the queue's index (each
        /metrics scrape): cheap while the series database keeps up, a scan of the index after a long outage."""
        with self._lock:
            samples, oldest = self._db.execute(
                "SELECT COALESCE(SUM(samples), 0), MIN(written) FROM series_outbox").fetchone()
        return int(samples), oldest

    def queued(self) -> bool:
        """Whether anything is queued now (uncached)."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM series_outbox LIMIT 1").fetchone() is not None


@dataclass
class ShipperStats:
    shipped_samples: int = 0
    failures: int = 0  # attempts that failed and were retried
    dropped_samples: int = 0  # refused by the series database as malformed
    failing_since: float | None = None
    last_error: str = ""


class SeriesShipper:
    """Drains an :class:`OutboxSeriesStore` into ``target`` in a daemon thread (see the module's docstring):
    every ``interval_s`` while the queue is empty, at once while it is not."""

    def __init__(self, outbox: OutboxSeriesStore, target: SeriesTarget, *, batch_rows: int = 256,
                 batch_samples: int = 10_000, interval_s: float = 1.0, backoff_s: float = 0.5,
                 backoff_max_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.outbox, self.target = outbox, target
        self.batch_rows, self.batch_samples = batch_rows, batch_samples
        self.interval_s, self.backoff_s, self.backoff_max_s = interval_s, backoff_s, backoff_max_s
        self.stats = ShipperStats()
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._idle = threading.Event()  # set while the outbox was found empty
        self._checked = False
        self._thread = threading.Thread(target=self._run, name="series-shipper", daemon=True)

    def start(self) -> SeriesShipper:
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = self.backoff_s
        while not self._stop.is_set():
            try:
                shipped = 0
                for slot in range(SHIP_SLOTS):
                    with self.outbox.shipping(slot) as mine:
                        rows = self.outbox.take(self.batch_rows, self.batch_samples, slot) if mine else []
                        if rows:
                            self._ship(rows)
                            shipped += len(rows)
                if not shipped:  # nothing queued, or other collectors' shippers are at it
                    self._idle.set()
                    self._wake.wait(self.interval_s)
                    self._wake.clear()
                    continue
                self._idle.clear()
                delay = self.backoff_s
            except SeriesUnavailable as e:
                self._failed(str(e))
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_max_s)
            except Exception as e:  # a bug or the ledger going away: log it, keep the thread alive
                self._failed(f"{type(e).__name__}: {e}")
                log.debug("series shipper error", exc_info=True)
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_max_s)

    def _ship(self, rows: list[Queued]) -> None:
        body, samples = self.target.render(c for r in rows for c in r.chunks())
        try:
            if body:
                self.target.post(body)
        except SeriesBackendError as e:
            if not 400 <= e.upstream < 500 or e.upstream == 408:
                raise  # a server error or an unreadable answer: retried
            log.error("%s refused %d samples (%d queued rows); dropped, retrying cannot help: %s",
                      self.target.name, samples, len(rows), e)
            self.stats.dropped_samples += samples
        else:
            self.stats.shipped_samples += samples
        self.outbox.ack(rows)
        self._recovered()

    def _failed(self, error: str) -> None:
        self.stats.failures += 1
        self.stats.last_error = error
        if self.stats.failing_since is None:
            self.stats.failing_since = self._clock()
            log.warning("shipping series to %s failed, retrying with backoff (ingest goes on; samples wait in "
                        "the store): %s", self.target.name, error)

    def _recovered(self) -> None:
        if self.stats.failing_since is not None:
            log.info("shipping series to %s again after %.0f s of failures", self.target.name,
                     self._clock() - self.stats.failing_since)
            self.stats.failing_since = None
        if not self._checked:
            self._checked = True
            try:
                for problem in self.target.problems():
                    log.warning("%s at %s: %s", self.target.name, self.target.url, problem)
            except SeriesUnavailable as e:
                log.warning("%s at %s: cannot read its settings (%s)", self.target.name, self.target.url, e)

    def notify(self) -> None:
        """Ship now rather than at the next interval (e.g. after a batch was committed)."""
        self._wake.set()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far was shipped (or dropped); True if the outbox emptied in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._idle.clear()
            self._wake.set()
            if self._idle.wait(min(0.2, max(0.0, deadline - time.monotonic()))) and not self.outbox.queued():
                return True
        return not self.outbox.queued()

    def close(self, timeout_s: float = 5.0) -> None:
        """Ship what is queued for up to ``timeout_s`` (the rest stays queued for the next start), then stop."""
        if self._thread.is_alive() and self.stats.failing_since is None:
            self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s + 30)
        self.target.close()


class ShipperMetrics:
    """The shipper's figures for the collector's /metrics (a prometheus_client collector)."""

    def __init__(self, shipper: SeriesShipper, clock: Callable[[], float] = time.time) -> None:
        self.shipper, self._clock = shipper, clock

    def collect(self) -> Iterator[Metric]:
        st = self.shipper.stats
        waiting, oldest = self.shipper.outbox.backlog()
        yield GaugeMetricFamily("gpuledger_collector_series_backlog_samples",
                                "Samples committed but not yet in the series database (series_url).",
                                value=float(waiting))
        yield GaugeMetricFamily("gpuledger_collector_series_lag_seconds",
                                "Age of the oldest batch not yet in the series database (0: none waiting).",
                                value=0.0 if oldest is None else max(0.0, self._clock() - oldest))
        yield CounterMetricFamily("gpuledger_collector_series_shipped_samples",
                                  "Samples shipped to the series database.", value=float(st.shipped_samples))
        yield CounterMetricFamily("gpuledger_collector_series_ship_failures",
                                  "Shipments to the series database that failed and are retried.",
                                  value=float(st.failures))
        yield CounterMetricFamily("gpuledger_collector_series_dropped_samples",
                                  "Samples the series database refused as malformed (dropped).",
                                  value=float(st.dropped_samples))


SERIES_APIS = ("victoriametrics", "influxdb")  # what series_api names (collector.config)


class RemoteSeries:
    """Everything ``series_url`` switches on besides the store's outbox: the shipper draining it into the series
    database (``api``: one of SERIES_APIS; ``database``: InfluxDB's), started here, the reader GET /api/v1/series
    answers from (``read_timeout_s`` per request) and the shipper's metrics."""

    def __init__(self, series_store: SeriesStore, url: str, api: str = "victoriametrics", database: str = "gpuledger",
                 read_timeout_s: float = 30.0, **shipper: Any) -> None:
        if not isinstance(series_store, OutboxSeriesStore):
            raise TypeError("series_url: open the store with series_outbox=True")
        target: SeriesTarget
        self.reader: InfluxSeriesReader | VmSeriesReader
        if api == "influxdb":
            target = InfluxDB(url, database)
            self.reader = InfluxSeriesReader(InfluxDB(url, database, timeout_s=read_timeout_s))
        elif api == "victoriametrics":
            target = VictoriaMetrics(url)
            self.reader = VmSeriesReader(VictoriaMetrics(url, timeout_s=read_timeout_s))
        else:
            raise ValueError(f"series_api must be one of {', '.join(SERIES_APIS)}, got {api!r}")
        self.shipper = SeriesShipper(series_store, target, **shipper).start()
        self.metrics = ShipperMetrics(self.shipper)

    def close(self) -> None:
        """Ship what is queued for a few seconds (the rest waits for the next start) and stop."""
        self.shipper.close()
        self.reader.close()
