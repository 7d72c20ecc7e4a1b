"""The collector's store: the ledger and the series store in one SQLite file, aggregation kept in step.

Two parts behind two protocols (so either can move to another backend without touching aggregation):

- the ledger (``collector.ledger_store``: jobs, per-job and per-GPU usage, hourly buckets, batch ids
  for dedupe; read through ``LedgerReader``),
- the series store (``collector.series_store``: chunks, tiers, compaction, series queries; read through
  ``SeriesReader``).

:class:`SqliteStore` owns the connection both share, the aggregation (``collector.aggregate``) and the
lock. Ingest is one transaction over both parts: a batch is stored whole (samples, usage, batch id) or
not at all.

The aggregation keeps a window per GPU in memory. It is bounded: a host's windows are restored from the
stored samples and totals when a batch of that host arrives (so a restart restores nothing up front and
never peaks above steady state), and evicted once the host has sent nothing for ``idle_evict_s`` (totals
are in the ledger, samples in the series store: nothing is lost, and a later batch restores them exactly).
At most ``max_gpus_per_host`` GPUs (and MIG instances) per host.

With ``series_outbox`` (the collector's ``series_url``), the series store is ``collector.series_outbox``'s
``OutboxSeriesStore``: the chunks as before, and each batch's samples queued for VictoriaMetrics in the same
transaction (a ``SeriesShipper`` drains the queue).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuledger.collector.aggregate import DEFAULT_MAX_GAP_S, DEFAULT_POWER_CAP_W, AddCounts, Aggregator, GpuKey
from gpuledger.collector.auditlog.files import private_file
from gpuledger.collector.ledger_store import GPU_TOTAL_FIELDS, SqliteLedger, migrate_v2, needs_migration
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.collector.series_outbox import OutboxSeriesStore
from gpuledger.collector.series_store import TIERS, Retention, SeriesStore, SqliteSeriesStore
from gpuledger.collector.sinks import Sink
from gpuledger.collector.sqlite_db import connect, transaction
from gpuledger.collector.validate import Batch, as_sample
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample, JobRecord, JobUsage

log = logging.getLogger(__name__)
_UUID = operator.attrgetter("gpu_uuid")

SCHEMA_VERSION = 3  # 3: jobs keyed by (cluster, job_id), agents' job records apart (ledger_store)
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicate_samples: int = 0
    too_late: int = 0
    duplicate_batch: bool = False


class BatchRefused(Exception):
    """A batch the store will not take, found before anything of it was written (its group commits without
    it); ``reason`` is a short label."""

    reason = "refused"


class BatchConflict(BatchRefused):
    """A batch whose key (host, agent_id, seq) was stored before with different content (an agent that lost
    its state and reuses numbers, or a forgery): it is not stored, the first one stands."""

    reason = "conflict"


class TooManyGpus(BatchRefused):
    """A batch that would give its host more GPUs (and MIG instances) than ``max_gpus_per_host``: a node
    inventing GPU uuids must not grow the collector's memory and tables without bound."""

    reason = "gpu_limit"


class StoreFull(Exception):
    """The disk (or the file system's quota) is full: nothing of the batch was stored; reads still work and
    the next batch succeeds once there is room again."""


MAX_GPUS_PER_HOST = 256  # GPUs and MIG instances one host may have (8 GPUs x 7 instances is 64)
DEDUPE_HORIZON_S = 7 * 86400.0  # batch keys are kept this long: an agent resending later is counted twice


@dataclass(frozen=True, slots=True)
class CompactStats:
    rolled_minutes: int = 0
    rolled_hours: int = 0
    merged_chunks: int = 0
    deleted_chunks: int = 0
    job_summaries: int = 0


class _Pending:
    """A batch waiting for a group commit, and its outcome."""

    __slots__ = ("batch", "done", "result", "error", "accepted")

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.done = threading.Event()
        self.result: IngestResult | None = None
        self.error: Exception | None = None
        self.accepted: list[GpuSample] = []


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                                               or "disk is full" in str(exc))


class SqliteStore:
    """The embedded default store. Thread-safe: one lock serialises all access to the connection.

    Reads go to ``ledger`` (a ``LedgerReader``) and ``series_store`` (a ``SeriesReader``); the methods of
    the same names here take the lock and delegate. ``sinks`` (e.g. ``collector.sinks.influx.InfluxSink``)
    get every committed batch's accepted samples and, at most once per ``summary_interval_s`` per job and
    at each compaction, the jobs' updated usage; they must only enqueue (they run under the store's lock).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        window_s: float = 600.0,
        max_gap_s: float = DEFAULT_MAX_GAP_S,
        clock: Callable[[], float] = time.time,
        cache_limit: int = 200_000,
        retention: Retention = Retention(),
        sinks: Sequence[Sink] = (),
        summary_interval_s: float = 60.0,
        power_cap_w: float = DEFAULT_POWER_CAP_W,
        power_caps: Mapping[str, float] | None = None,
        dedupe_horizon_s: float = DEDUPE_HORIZON_S,
        idle_evict_s: float | None = None,
        max_gpus_per_host: int = MAX_GPUS_PER_HOST,
        series_outbox: bool = False,
    ) -> None:
        retention.check(window_s)
        # Batch keys older than this are pruned at compaction (a day of 1,000 nodes pushing every 10 s is
        # 8.6 million keys): the horizon must exceed how long an agent may hold a batch (its spool), or a batch
        # resent after it is counted twice.
        self.dedupe_horizon_s = dedupe_horizon_s
        # a host silent this long (collector time) leaves memory: by default two windows, so a host that
        # pauses for less than its window keeps its windows
        self.idle_evict_s = 2 * max(window_s, max_gap_s) if idle_evict_s is None else idle_evict_s
        self._last_seen: dict[str, float] = {}  # host in memory -> collector time of its last batch
        self._next_eviction = -math.inf
        self.max_gpus_per_host = max_gpus_per_host
        self._host_gpus: dict[str, int] = {}  # host in memory -> its GPUs (and MIG instances)
        self.path = Path(path)
        private_file(self.path)  # user names and uids: readable by the collector's account only
        self.retention = retention
        self.sinks = list(sinks)
        self.summary_interval_s = summary_interval_s
        self._clock = clock
        self._cache_limit = cache_limit
        self._lock = threading.RLock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Pending] = []  # batches handed in, waiting for the next group commit
        self._pending_jobs: set[str] = set()
        self._summary_sent: dict[str, float] = {}
        self._compactor: threading.Thread | None = None
        self._compactor_stop = threading.Event()
        self._db = connect(self.path)
        row = None
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone():
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is not None and int(row[0]) not in (1, 2, SCHEMA_VERSION):
            raise RuntimeError(f"{self.path}: store schema {row[0]}, this collector reads {SCHEMA_VERSION} "
                               f"(and migrates 1 and 2); use a gpuledger release that knows schema {row[0]}")
        self._db.executescript(_META)
        if needs_migration(self._db):
            with transaction(self._db) as db:
                migrate_v2(db)
                db.execute("UPDATE meta SET value=? WHERE key='schema' AND value='2'", (str(SCHEMA_VERSION),))
            log.info("%s: ledger migrated to schema %d (jobs keyed by cluster and job id)", self.path, SCHEMA_VERSION)
        self.ledger = SqliteLedger(self._db)
        chunk_store = SqliteSeriesStore(self._db, retention)
        self.series_store: SeriesStore = chunk_store
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        row = self._db.execute("SELECT value FROM meta WHERE key='sample_fields'").fetchone()
        stored = tuple(json.loads(row[0])) if row else SAMPLE_FIELDS
        if SAMPLE_FIELDS[: len(stored)] != stored:
            raise RuntimeError(f"{self.path}: raw samples were written with fields {stored}, not a prefix of today's")
        if self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "1":
            with transaction(self._db) as db:
                chunk_store.repack_v1_samples(stored)
                db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('sample_fields', ?)", (json.dumps(SAMPLE_FIELDS),))
        if series_outbox:  # series_url: every batch's samples are also queued for VictoriaMetrics, in its transaction
            self.series_store = OutboxSeriesStore(chunk_store, self._db, self._lock)
        self.agg = Aggregator(window_s, max_gap_s, load_usage=self.ledger.load_usage, load_hour=self.ledger.load_hour,
                              power_cap_w=power_cap_w, power_caps=power_caps)
        self._restore()

    def _restore(self) -> None:
        """Forget the in-memory aggregation: each host's windows are rebuilt from committed state when a batch
        of that host arrives (``_ensure_windows``)."""
        self.agg.reset()
        self._last_seen.clear()
        self._host_gpus.clear()

    def _ensure_windows(self, gpu_keys: set[tuple]) -> None:
        """Restore every stored GPU of the hosts in ``gpu_keys`` not in memory (their windows: recent samples plus
        the one before, and totals). A host's GPUs come back together: the aggregation's rules may join a GPU
        and its MIG instances. TooManyGpus (before anything changes) when new GPUs would take a host over
        ``max_gpus_per_host``."""
        hosts = {k[0] for k in gpu_keys}
        load = {h: self.ledger.host_gpu_totals(h) for h in hosts if h not in self._last_seen}
        for host in hosts:
            known = len(load[host]) if host in load else self._host_gpus[host]
            stored = {k for k, _ in load[host]} if host in load else None
            new = sum(1 for k in gpu_keys if k[0] == host and k not in self.agg.gpus
                      and (stored is None or k not in stored))
            if known + new > self.max_gpus_per_host:
                raise TooManyGpus(f"host {host!r} has {known} GPUs and MIG instances stored; {new} new ones would "
                                  f"pass the limit of {self.max_gpus_per_host}")
        watermark = GPU_TOTAL_FIELDS.index("watermark")
        now = self._clock()
        for rows in load.values():
            for gpu_key, totals in rows:
                floor = totals[watermark] - self.agg.window_s
                self.agg.restore_gpu(gpu_key, totals, segments=self.series_store.window(gpu_key, floor))
        for host in hosts:
            self._last_seen[host] = now
            self._host_gpus[host] = len({k for k in self.agg.gpus if k[0] == host} | {k for k in gpu_keys
                                                                                      if k[0] == host})

    def _evict_idle(self) -> None:
        """Drop the windows of hosts silent for ``idle_evict_s`` (called after a commit: nothing is dirty); a
        walk over every GPU, so at most every tenth of that interval."""
        now = self._clock()
        if now < self._next_eviction:
            return
        self._next_eviction = now + self.idle_evict_s / 10
        cutoff = now - self.idle_evict_s
        idle = {h for h, t in self._last_seen.items() if t < cutoff}
        if not idle:
            return
        for host in idle:
            del self._last_seen[host]
            self._host_gpus.pop(host, None)
        for gpu_key in [k for k in self.agg.gpus if k[0] in idle]:
            del self.agg.gpus[gpu_key]  # the window map's entry; totals and samples are stored

    # -- writes -------------------------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Store and aggregate a validated batch durably; idempotent per (host, agent_id, seq). Returns only
        after the commit that holds it. Raises BatchRefused (BatchConflict: a known key with other content;
        TooManyGpus), StoreFull when the disk is full.

        Group commit: callers on other threads hand their batches in; whoever takes the lock commits every
        batch waiting at that moment in one transaction (one fsync) and wakes their callers. A batch that
        fails on its own (a conflict) is answered alone; one that breaks the transaction sends the others of
        its group through one at a time, so it never costs them their commit."""
        item = _Pending(batch)
        with self._queue_lock:
            self._queue.append(item)
        while not item.done.is_set():
            with self._lock:
                if item.done.is_set():
                    break  # committed by the writer before us
                with self._queue_lock:
                    group, self._queue = self._queue, []
                if group:
                    self._commit_group(group)
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _commit_group(self, group: list[_Pending]) -> None:
        """One transaction for every batch of ``group`` (called with the lock held); sets each one's outcome."""
        try:
            with transaction(self._db):
                for it in group:
                    try:
                        it.result, it.accepted = self._add_batch(it.batch)
                    except BatchRefused as exc:  # found before anything of it was written
                        it.error = exc
                jobs = self._flush()
        except Exception as exc:
            # The in-memory aggregation (and the GPUs' clusters) already moved; put them back to what is committed.
            self.ledger.reload_clusters()
            self._restore()
            if len(group) > 1 and not _disk_full(exc):
                for it in group:  # find the one that breaks the transaction; the others still commit
                    it.error, it.result = None, None
                    self._commit_group([it])
                return
            err: Exception = StoreFull(f"store {self.path}: {exc}") if _disk_full(exc) else exc
            for it in group:
                it.error, it.result = err, None
                it.done.set()
            return
        try:
            if len(self.agg.usage) + len(self.agg.hours) > self._cache_limit:
                self.agg.drop_caches()
            self._evict_idle()
            if self.sinks:
                for it in group:
                    if it.accepted:
                        for sink in self.sinks:
                            sink.write(it.accepted)
                self._pending_jobs |= jobs
                self._emit_summaries(force=False)
        finally:  # committed: each caller gets its answer whatever a sink does
            for it in group:
                it.done.set()

    def _add_batch(self, batch: Batch) -> tuple[IngestResult, list[GpuSample]]:
        """Aggregate one batch and write its samples and key inside the group's transaction; returns its result
        and (when there are sinks) its accepted samples as GpuSamples."""
        seen = self.ledger.batch_seen(batch.host, batch.agent_id, batch.seq)
        if seen is not None:
            if seen and batch.digest and seen != batch.digest:
                raise BatchConflict(f"batch agent_id={batch.agent_id!r} seq={batch.seq} of host {batch.host!r} "
                                    "was stored before with different content; the first one stands "
                                    "(an agent reusing sequence numbers lost its state)")
            return IngestResult(0, duplicate_batch=True), []
        # rows: GpuSamples or the fast path's structs with the same fields (no GpuSample built per sample);
        # series are folded and packed a column at a time unless a GPU's samples must go one by one
        rows = list(batch.rows)
        self._ensure_windows({(s.host, s.gpu_uuid, s.mig or "") for s in (*batch.series, *rows)})
        folded: list[Series]
        if rows:  # both layouts in one batch (only through the Python API): all one by one
            folded, rest = [], [r for s in batch.series for r in s.rows()]
        else:
            folded, rest = self.agg.add_series(list(batch.series))
        counts, accepted = self.agg.add_many(rows + rest) if rows or rest else (AddCounts(), [])
        self.series_store.write_samples(accepted)
        self.series_store.write_series(folded)
        cluster = batch.cluster
        uuids = set(map(_UUID, rows))
        uuids.update(map(_UUID, batch.series))
        self.ledger.note_gpus(cluster, [(batch.host, u) for u in uuids])
        if batch.jobs:
            # an agent's job metadata is kept only for jobs whose samples came from its host
            job_ids = {j for r in (*rows, *batch.series) for j in r.job_ids}
            self.ledger.add_agent_jobs(batch.jobs, batch.host, cluster, job_ids)
        n_accepted = counts.accepted + sum(s.n for s in folded)
        self.ledger.record_batch(batch.host, batch.agent_id, batch.seq, batch.digest, self._clock(), n_accepted)
        out = [as_sample(s) for s in accepted] + [r for s in folded for r in s.rows()] if self.sinks else []
        return IngestResult(n_accepted, counts.duplicate, counts.too_late), out

    def _flush(self) -> set[str]:
        """Write the dirty accumulators to the ledger; returns the job ids whose usage changed."""
        usage, gpus, hours = self.agg.take_dirty()
        agg = self.agg
        self.ledger.write_aggregates(((k, agg.usage[k].values()) for k in usage),
                                     ((k, agg.gpus[k].totals()) for k in gpus),
                                     ((k, agg.hours[k].values()) for k in hours))
        self.ledger.write_gaps(agg.take_gaps())
        return {k[0] for k in usage}

    def _emit_summaries(self, force: bool) -> int:
        """Hand the sinks the usage of jobs that changed, at most once per interval per job."""
        if not self.sinks or not self._pending_jobs:
            return 0
        now = time.monotonic()
        due = sorted(j for j in self._pending_jobs
                     if force or now - self._summary_sent.get(j, -math.inf) >= self.summary_interval_s)
        if not due:
            return 0
        rows = []
        for job in due:
            rows.extend(self.ledger.job_usage(job))
            self._summary_sent[job] = now
        self._pending_jobs.difference_update(due)
        records = {r.job_id: r for r in self.ledger.jobs_by_id(due)}
        for sink in self.sinks:
            sink.write_job_usage(rows, records)
        return len(rows)

    def put_jobs(self, records: Iterable[JobRecord],
                 before_store: Callable[[list[JobRecord]], object] | None = None) -> int:
        """Insert or merge the scheduler's job records; returns how many are new or changed (a re-import, in
        any sacct format, changes none). ``before_store`` sees them as they will be stored, first (the audit
        log appends them there)."""
        with self._lock:
            return self.ledger.put_jobs(records, before_store)

    def merge_jobs(self, records: Iterable[JobRecord],
                   before_store: Callable[[list[JobRecord]], object] | None = None) -> list[JobRecord]:
        """Like :meth:`put_jobs`; returns the new or changed records as stored (merged)."""
        with self._lock:
            return self.ledger.merge_jobs(records, before_store)

    # -- compaction: rollups, merging, retention ----------------------------------------------
    def compact(self, now: float | None = None) -> CompactStats:
        """Apply the tiers: roll up closed minutes and hours, merge small chunks, drop expired data.

        Idempotent; each GPU's rollup and each merge is its own transaction, so ingest waits at most
        for one of them, and a crash leaves either the old or the new state.
        """
        now = self._clock() if now is None else now
        with self._lock:  # every stored GPU, in memory or not
            at = GPU_TOTAL_FIELDS.index("watermark")
            watermarks = {gpu_key: totals[at] for gpu_key, totals in self.ledger.gpu_totals()}
        minutes = hours = 0
        for gpu_key, watermark in sorted(watermarks.items()):
            with self._lock:
                # minutes before (newest sample - window) can no longer receive a late sample: final
                rolled_minutes, rolled_hours = self.series_store.roll_up(gpu_key, watermark - self.agg.window_s)
            minutes, hours = minutes + rolled_minutes, hours + rolled_hours
        merged = 0
        for tier in TIERS:
            with self._lock:
                groups = self.series_store.mergeable_groups(tier, now)
            for group in groups:
                with self._lock:
                    merged += self.series_store.merge(group)
        with self._lock:
            deleted = self.series_store.expire(now)
            self.ledger.prune_batches(now - self.dedupe_horizon_s)
            summaries = self._emit_summaries(force=True)
        return CompactStats(minutes, hours, merged, deleted, summaries)

    def start_background(self, interval_s: float = 300.0) -> None:
        """Run :meth:`compact` every ``interval_s`` seconds in a daemon thread until :meth:`close`."""
        if self._compactor is not None:
            return
        self._compactor_stop.clear()

        def loop() -> None:
            while not self._compactor_stop.wait(interval_s):
                try:
                    self.compact()
                except Exception:  # keep compacting later; the store itself is consistent
                    log.exception("compaction failed")

        self._compactor = threading.Thread(target=loop, name="store-compact", daemon=True)
        self._compactor.start()

    def stop_background(self) -> None:
        if self._compactor is not None:
            self._compactor_stop.set()
            self._compactor.join()
            self._compactor = None

    # -- reads (LedgerReader and SeriesReader, under the lock) ---------------------------------
    def jobs(self) -> list[JobRecord]:
        with self._lock:
            return self.ledger.jobs()

    def job_records(self) -> list[tuple[JobRecord, str]]:
        """Every job record with its source, ``slurm`` or ``agent``."""
        with self._lock:
            return self.ledger.job_records()

    def job_usage(self, job_id: str | None = None, per_gpu: bool = False,
                  cluster: str | None = None) -> list[JobUsage]:
        """Usage per job (summed over its GPUs) or per (job, host, GPU); jobs are (cluster, job_id)."""
        with self._lock:
            return self.ledger.job_usage(job_id, per_gpu, cluster)

    def busy_hours(self, since: float | None = None) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
        """Per GPU: (hour start, GPU-seconds that carried a job) of its hour buckets (``SqliteLedger.busy_hours``)."""
        with self._lock:
            return self.ledger.busy_hours(since)

    def gpu_hours(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per GPU over whole hours in [start, end): observed and job-carrying GPU-seconds, energy."""
        with self._lock:
            return self.ledger.gpu_hours(start, end)

    def totals(self, start: float | None = None, end: float | None = None) -> dict:
        """Cluster totals. With a range, whole hours are counted: buckets whose hour starts in [start, end)."""
        with self._lock:
            return self.ledger.totals(start, end)

    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per physical GPU: energy, the part charged to jobs, unattributed energy, counter anomalies."""
        with self._lock:
            return self.ledger.gpu_energy(start, end)

    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Gap records that ended in [start, end) (see ``SqliteLedger.energy_gaps``)."""
        with self._lock:
            return self.ledger.energy_gaps(start, end)

    def counter_anomalies(self) -> int:
        with self._lock:
            return self.ledger.counter_anomalies()
    def gpus(self) -> list[GpuKey]:
        """Every GPU the store holds totals for: (host, GPU UUID, MIG instance or "")."""
        with self._lock:
            return [key for key, _ in self.ledger.gpu_totals()]

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        """One GPU's data with start <= ts <= end, in time order (see ``SqliteSeriesStore.series``)."""
        with self._lock:
            return self.series_store.series(host, gpu_uuid, start, end, step=step, mig=mig, tier=tier)

    def tiers(self) -> list[dict]:
        """Per tier: chunks, rows and bytes stored, oldest and newest time (for the CLI and metrics)."""
        with self._lock:
            return self.series_store.tiers()

    def batches_seen(self) -> int:
        with self._lock:
            return self.ledger.batches_seen()

    def size_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += os.path.getsize(str(self.path) + suffix)
            except OSError:
                pass
        return total

    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (what ``size_bytes`` then measures)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.stop_background()
        with self._lock:
            self._db.close()


def open_store(ledger_url: str | None, data_dir: str | os.PathLike[str], **settings: object) -> SqliteStore:
    """The collector's store: the ledger at ``ledger_url`` (``postgresql://...``) or, without one, the embedded
    SQLite file ``<data_dir>/gpuledger.sqlite``. ``settings`` are the store's keyword arguments."""
    if ledger_url and "://" in ledger_url and not ledger_url.startswith("sqlite://"):
        raise NotImplementedError("PostgreSQL ledger: being built (issue #16)")  # replaced by the PostgreSQL port
    path = Path(ledger_url.removeprefix("sqlite://")) if ledger_url else Path(data_dir) / "gpuledger.sqlite"
    return SqliteStore(path, **settings)  # type: ignore[arg-type]
