"""The collector's store: the ledger and the series store in one database, aggregation kept in step.

Two parts behind two protocols (so either can move to another backend without touching aggregation):

- the ledger (``collector.ledger_store``: jobs, per-job and per-GPU usage, hourly buckets, batch ids
  for dedupe; read through ``LedgerReader``),
- the series store (``collector.series_store``: chunks, tiers, compaction, series queries; read through
  ``SeriesReader``).

:class:`Store` owns the database both share (``collector.db``: an embedded SQLite file, the default, or
PostgreSQL), the aggregation (``collector.aggregate``) and the lock. Ingest is one transaction over both parts:
a batch is stored whole (samples, usage, batch id) or not at all. Opening the store applies the ledger's pending
migrations (``collector.migrations``).

Several collectors may share one PostgreSQL ledger (or, for tests, one SQLite file), and any of them may take
any host's batch. Each group commit claims its hosts in sorted order (``LedgerStore.claim_hosts``: a host's
generation, bumped under its row lock, so two collectors never write one host at once and never deadlock).
A generation other than the one this collector wrote last + 1 means another collector wrote the host since:
its in-memory state of the host is dropped and restored from the ledger inside the same transaction, so the
sums go on exactly where the other collector left them. What decides what is counted (the late window, the gap
rule, the dedupe horizon, the power caps) and how long the series are kept (the tiers' retention) is the ledger's
(``AGREED_SETTINGS``), recorded by the first store given it: a store given other values refuses to open
(SettingsMismatch), so no process seals, expires or prunes what another still needs, and a host's energy is the same
whichever collector took its batch.

The aggregation keeps each GPU's totals and newest sample in memory; the rest of its late-sample window is
read back from the series store when a late sample needs it (``Aggregator(load_window=...)``). It is bounded:
a host's GPUs are restored from the stored samples and totals when a batch of that host arrives (so a restart
restores nothing up front and never peaks above steady state), and evicted once the host has sent nothing for
``idle_evict_s`` (totals are in the ledger, samples in the series store: nothing is lost, and a later batch
restores them exactly).
At most ``max_gpus_per_host`` GPUs (and MIG instances) per host.

With ``series_outbox`` (the collector's ``series_url``), the series store is ``collector.series_outbox``'s
``OutboxSeriesStore``: the chunks as before, and each batch's samples queued for VictoriaMetrics in the same
transaction (a ``SeriesShipper`` drains the queue).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any, cast

from gpuledger.collector.aggregate import (
    DEFAULT_MAX_GAP_S,
    DEFAULT_POWER_CAP_W,
    AddCounts,
    Aggregator,
    GpuKey,
    HourAcc,
    HourKey,
    UsageAcc,
    UsageKey,
)
from gpuledger.collector.auditlog.files import private_file
from gpuledger.collector.db import (
    SQLITE,
    Database,
    DatabaseBusy,
    DatabaseConfigError,
    DatabaseFull,
    DatabaseUnavailable,
    is_postgres_url,
    open_database,
    upsert,
)
from gpuledger.collector.ledger_store import GPU_TOTAL_FIELDS, SqlLedger, gpu_totals
from gpuledger.collector.migrations import META_FORMAT, migrate
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.collector.series_outbox import OutboxSeriesStore
from gpuledger.collector.series_store import TIERS, ChunkSeriesStore, Retention, SeriesStore, StaleCompaction
from gpuledger.collector.sinks import Sink
from gpuledger.collector.validate import Batch, as_sample
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample, JobRecord, JobUsage

log = logging.getLogger(__name__)
_UUID = operator.attrgetter("gpu_uuid")

STORE_NAME = "gpuledger.sqlite"  # the embedded store in a data directory
COMPACTION_LOCK = "compaction"  # one collector compacts a shared ledger at a time
# meta key: when a compaction of the ledger last completed (unix time), whichever process ran it; /metrics shows it, so
# a compactor that stopped (refused its settings, crashed for good, a cron job gone) is seen before the disk fills
COMPACTED_AT = "compacted_at"


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


class StoreUnavailable(DatabaseUnavailable):
    """The ledger's database cannot be reached (PostgreSQL down, the connection lost, a SQLite file locked by
    another process for too long): nothing of the batch was stored; the next one succeeds once it is back."""


class StoreStalled(StoreUnavailable):
    """:meth:`Store.close` gave the commit in progress its bound and it is still waiting for the ledger (a synchronous
    standby gone, a link gone silent): the database is left open to it, and the batches in it and behind it were
    not acknowledged. Whether the ledger commits them is unknown here; their agents resend them, and a resend of one
    it did commit is answered as a duplicate."""


LOCK_POLL_S = 0.1  # a thread waiting for the store's lock looks this often whether the store closed meanwhile


class _StoreLock:
    """The store's lock (reentrant), entered with ``with``. Once the store is closing (``Store.closing``), a thread
    that waits for it past the close's deadline gives up with StoreUnavailable: behind a commit that stalls, a read
    (or the series shipper) would otherwise wait as long as the ledger does, and keep the process from ending.
    (``acquire`` with a timeout returns as soon as the lock is free: no delay while it is merely contended.)"""

    def __init__(self, url: str) -> None:
        self._rlock = threading.RLock()
        self._url = url
        self.give_up_at: float | None = None  # time.monotonic(): set by Store.closing

    def __enter__(self) -> None:
        while not self._rlock.acquire(timeout=LOCK_POLL_S):
            if self.give_up_at is not None and time.monotonic() >= self.give_up_at:
                raise StoreUnavailable(f"store {self._url} is closing and its commit in progress does not end")

    def __exit__(self, *exc: object) -> None:
        self._rlock.release()


class _BatchRaced(Exception):
    """A batch's key appeared in the ledger between its dedupe check and its commit (written by a collector that
    did not claim the host): the group is rolled back and committed again, where the batch is a duplicate."""


MAX_QUERY_TIME_S = 1e11  # seconds: unix times until the year 5138, steps up to 3,000 years
MIN_QUERY_STEP_S = 1e-3  # no bucket finer than a millisecond (a finer step only multiplies empty buckets)


class QueryRangeError(ValueError):
    """A query's time range or step out of bounds; the message names the parameter as its caller spells it."""


def query_range(start: float | None, end: float | None, step: float | None = None,
                name: Callable[[str], str] = repr) -> float | None:
    """The rules of every time range the store is queried over (GET /api/v1/series and /api/v1/totals,
    ``gpuledger collector series|totals``): ``start`` and ``end`` unix seconds in 0..MAX_QUERY_TIME_S, ``end`` not
    before ``start``, ``step`` in (0, MAX_QUERY_TIME_S] (None: not given). Returns the step to query with: at least
    MIN_QUERY_STEP_S (a finer bucket holds nothing more; near zero its arithmetic overflows). QueryRangeError
    otherwise, naming the parameter by ``name`` (``"start"`` -> ``"query parameter 'start'"``, ``"--start"``)."""
    for param, v in (("start", start), ("end", end)):
        if v is not None and not 0 <= v <= MAX_QUERY_TIME_S:  # NaN fails too
            raise QueryRangeError(f"{name(param)} must be unix seconds in 0..{MAX_QUERY_TIME_S:g}, got {v!r}")
    if start is not None and end is not None and end < start:
        raise QueryRangeError(f"{name('end')} ({end!r}) is before {name('start')} ({start!r})")
    if step is None:
        return None
    if not 0 < step <= MAX_QUERY_TIME_S:
        raise QueryRangeError(f"{name('step')} must be positive seconds, at most {MAX_QUERY_TIME_S:g}, got {step!r}")
    return max(step, MIN_QUERY_STEP_S)


MAX_GPUS_PER_HOST = 256  # GPUs and MIG instances one host may have (8 GPUs x 7 instances is 64)
DEDUPE_HORIZON_S = 7 * 86400.0  # batch keys are kept this long: an agent resending later is counted twice
# Settings every process that ingests into or compacts one ledger must share, with their defaults: a late window or
# gap rule shorter in one process than in another seals minutes the other still accepts and expires raw rows it still
# reads back (Aggregator.read_floor); a shorter dedupe horizon prunes batch keys the other still dedupes by; other
# power caps (Aggregator.cap_w: the most a counter delta or the power integral may count) give a host's energy another
# value depending on which collector took its batch; a shorter retention of a tier (RETENTION_SETTINGS) deletes series
# the other keeps and serves (the read floor protects what is counted, not what dashboards and queries read). The
# ledger's ``meta`` table holds them (``setting.<name>``: JSON, a float as its repr, per-model caps with sorted keys,
# null for a tier kept for good), written by the first store given them (Store._agree).
AgreedValue = float | dict[str, float] | None  # seconds or watts; power_caps: watts per GPU model; None: kept for good
AGREED_SETTINGS: dict[str, AgreedValue] = {"window_s": 600.0, "max_gap_s": DEFAULT_MAX_GAP_S,
                                           "dedupe_horizon_s": DEDUPE_HORIZON_S, "power_cap_w": DEFAULT_POWER_CAP_W,
                                           "power_caps": {}, "raw_retention_s": Retention().raw_s,
                                           "minute_retention_s": Retention().minute_s,
                                           "hour_retention_s": Retention().hour_s}
# The agreed settings a Store's ``retention`` carries: name -> Retention's field (the collector's settings of the same
# names, where 0 is None). The rollup tiers may be kept for good (None), a value like any other; raw samples may not.
RETENTION_SETTINGS = {"raw_retention_s": "raw_s", "minute_retention_s": "minute_s", "hour_retention_s": "hour_s"}
# Store's keyword arguments that carry agreed settings (what a query leaves to the ledger)
AGREED_OPTIONS = frozenset(AGREED_SETTINGS.keys() - RETENTION_SETTINGS.keys() | {"retention"})
SET_SETTINGS_COMMAND = "gpuledger collector set-settings"


class Unrecorded(enum.Enum):
    """A setting the ledger has not recorded (``Store.recorded_settings``' value before): None is a value, a tier kept
    for good."""

    UNRECORDED = "unrecorded"


UNRECORDED = Unrecorded.UNRECORDED


def _agreed_value(name: str, value: Any) -> AgreedValue:
    """A setting as compared and recorded: a float (None: a tier kept for good), or (``power_caps``) a mapping of model
    name to float, whose key order does not matter."""
    if isinstance(AGREED_SETTINGS[name], dict):
        return {str(k): float(v) for k, v in dict(value).items()}
    return None if value is None else float(value)


def _given_value(name: str, value: Any) -> AgreedValue:
    """A setting given to a store, as :func:`_agreed_value`. One no process may run with is InvalidSetting (one line
    naming the setting and the value), before it is compared with the ledger's: a mismatch would tell the operator
    to share a value that is wrong anywhere. (``Aggregator`` and ``Retention.check`` keep their own checks, the
    reference for what the aggregation and the tiers run with, as they are built without a store too; this one only
    puts the refusal first. ``CollectorSettings`` refuses the same in a configuration file, naming the file.)"""
    for_good = name in RETENTION_SETTINGS and name != "raw_retention_s"  # a rollup tier may be kept for good (None)
    try:
        agreed = _agreed_value(name, value)
    except (TypeError, ValueError):  # not a number, or not a mapping of numbers
        shown, valid = repr(value), False
    else:
        numbers = list(agreed.values()) if isinstance(agreed, dict) else [agreed]
        shown, valid = setting_text(agreed), all(
            for_good if v is None else math.isfinite(v) and (v >= 0 if name == "window_s" else v > 0) for v in numbers)
    if not valid:
        rule = (f"finite {'watts' if name.startswith('power_cap') else 'seconds'} "
                f"{'at least' if name == 'window_s' else 'above'} 0")
        rule = f"a mapping of GPU model to {rule}" if name == "power_caps" else (
            f"{rule}, or None (kept for good)" if for_good else rule)
        raise InvalidSetting(f"{name} = {shown} is invalid: it must be {rule}")
    return agreed


def setting_text(value: AgreedValue | Unrecorded) -> str:
    """A setting in a one-line message: a number as short as it is exact, a mapping as ``{"model": watts, ...}`` by
    name, ``forever`` for a tier kept for good."""
    def number(v: float) -> str:
        if v.is_integer() and abs(v) < 1e15:  # seconds as configured: 2592000, not 2.592e+06
            return str(int(v))
        return f"{v:g}" if float(f"{v:g}") == v else repr(v)

    if value is UNRECORDED:
        return "unset"
    if value is None:
        return "forever"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {number(v)}" for k, v in sorted(value.items())) + "}"
    return number(value)


class SettingsMismatch(DatabaseConfigError):
    """A store opened with an agreed setting (AGREED_SETTINGS) other than the ledger's: it would change what the
    ledger's other collectors and compactors count or keep. A command exits 2 (a DatabaseConfigError)."""


class InvalidSetting(DatabaseConfigError):
    """A store given an agreed setting no process may run with (a negative or infinite power cap, ...): refused before
    it is compared with the ledger's. A command exits 2 (a DatabaseConfigError)."""


@dataclass(frozen=True, slots=True)
class CompactStats:
    rolled_minutes: int = 0
    rolled_hours: int = 0
    merged_chunks: int = 0
    deleted_chunks: int = 0
    job_summaries: int = 0
    skipped: bool = False  # another collector was compacting the shared ledger
    split_chunks: int = 0  # batches' host chunks split into their GPUs' chunks


class _Pending:
    """A batch waiting for a group commit, and its outcome (``future``, once settled: a batch handed to ``submit``;
    ``ingest_group`` reads ``result`` and ``error`` instead)."""

    __slots__ = ("batch", "future", "result", "error", "accepted")

    def __init__(self, batch: Batch, future: Future[IngestResult] | None = None) -> None:
        self.batch = batch
        self.future = future
        self.result: IngestResult | None = None
        self.error: Exception | None = None
        self.accepted: list[GpuSample] = []

    def settle(self) -> None:
        if self.future is None:
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            assert self.result is not None
            self.future.set_result(self.result)


COMPACTION_STEP_S = 0.02  # about how long one compaction transaction holds the store's lock (ingest waits)
HOST_SPLIT_CHUNKS = 64  # a host's batches' host chunks are split once this many (or half a window) wait (_compact)
COMPACTION_CPU_SHARE = 0.15  # of one core, at most, for compaction's planning (it yields the GIL the rest)
ROLLUP_EVERY_MINUTES = 10  # an active GPU's final minutes are rolled up this many at a time (see _compact)
_STEP_BUFFER = 256  # planned compaction writes kept before they are applied (bounds memory: merged chunks)


class _Pacer:
    """Keeps a thread's CPU to ``share`` of one core: after each slice of ``slice_s`` of its CPU time it sleeps
    long enough. Compaction plans in Python beside the ingest threads; a thread that never sleeps holds the GIL
    for its full switch interval (5 ms) each time another thread wants it back, and a request that gives the
    GIL up a few dozen times (socket, SQLite) then waits that long each time. At 2,000 nodes (16,000 GPUs)
    compaction needs about a tenth of a core on average (merging each row once); the share spreads the waves
    (every GPU's open interval filling at once) instead of letting them take the GIL from ingest."""

    def __init__(self, share: float, slice_s: float = 0.002) -> None:
        self._share = share
        self._slice_s = slice_s
        self._since = time.thread_time()

    def __call__(self) -> None:
        worked = time.thread_time() - self._since
        if worked >= self._slice_s:
            time.sleep(worked * (1.0 - self._share) / self._share)
            self._since = time.thread_time()


class _Steps:
    """Compaction's planned writes, applied under the store's lock in short transactions: each one once no batch
    waits for a commit (``Store._compaction_step``), and each takes planned writes until about ``step_s`` of
    work is done (many GPUs a transaction, one commit for them all, never a long hold). A plan found stale
    (``StaleCompaction``) rolls its step back; what the step held is planned again by the next compaction."""

    def __init__(self, store: Store, step_s: float) -> None:
        self._store = store
        self._step_s = step_s
        self._ops: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []

    def add(self, apply: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """``apply`` writes inside a step's transaction; ``done`` gets its result once that step committed."""
        self._ops.append((apply, done))
        if len(self._ops) >= _STEP_BUFFER:
            self.flush()

    def flush(self) -> None:
        while self._ops:
            self._step()

    def _step(self) -> None:
        results: list[Any] = []
        try:
            with self._store._compaction_step(), self._store.db.transaction():
                end = time.monotonic() + self._step_s
                for apply, _ in self._ops:
                    results.append(apply())
                    if time.monotonic() >= end:
                        break
        except StaleCompaction as exc:
            log.warning("compaction: %s; the step is rolled back, planned again next time", exc)
            del self._ops[:len(results) + 1]
            return
        for (_, done), result in zip(self._ops, results):
            done(result)
        del self._ops[:len(results)]


def _ignore(result: object) -> None:
    """A compaction step's ``done`` for writes whose result nothing counts."""


def _database(target: Database | str | os.PathLike[str]) -> Database:
    """``target`` as a database: a PostgreSQL URL is connected to, a SQLite path (or ``sqlite://`` URL) opened
    (created mode 0600: user names and uids are readable by the collector's account only)."""
    if not isinstance(target, (str, os.PathLike)):
        return target
    text = os.fspath(target)
    if is_postgres_url(text):
        return open_database(text)
    path = text.removeprefix("sqlite://")
    if "://" in path:
        raise ValueError(f"ledger URL {text.split('://', 1)[0]}://...: use postgresql://... or a SQLite file path")
    private_file(path)
    return open_database(path)


def _rounds(group: list[_Pending]) -> list[list[_Pending]]:
    """A group's batches (sorted by host) in rounds of distinct hosts: a host's first batch in the first round,
    its second (a resend, a spool's backlog) in the second, ...; a host's batches keep their order."""
    rounds: list[list[_Pending]] = []
    seen: dict[str, int] = {}
    for it in group:
        r = seen.get(it.batch.host, 0)
        seen[it.batch.host] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(it)
    return rounds


_RACE_RETRIES = 3  # a group rolled back by _BatchRaced is committed again at most this often


class Store:
    """The collector's store over a database (``collector.db``): a ``Database``, or a SQLite path or
    PostgreSQL URL to open (see :func:`open_store`). Thread-safe: one lock serialises this store's use of it.

    Reads go to ``ledger`` (a ``LedgerReader``) and ``series_store`` (a ``SeriesReader``); the methods of
    the same names here take the lock and delegate. ``sinks`` (e.g. ``collector.sinks.influx.InfluxSink``)
    get every committed batch's accepted samples and, at most once per ``summary_interval_s`` per job and
    at each compaction, the jobs' updated usage; they must only enqueue (they run under the store's lock).
    ``window_s``, ``max_gap_s``, ``dedupe_horizon_s``, ``power_cap_w``, ``power_caps`` and ``retention``'s tiers
    (RETENTION_SETTINGS; its chunk spans are this store's) must be the ledger's (:meth:`_agree`; None: whatever the
    ledger holds); ``adopt_settings`` makes those given the ledger's instead (``collector set-settings``).
    """

    def __init__(
        self,
        db: Database | str | os.PathLike[str],
        window_s: float | None = None,
        max_gap_s: float | None = None,
        clock: Callable[[], float] = time.time,
        cache_limit: int = 200_000,
        retention: Retention | None = None,
        sinks: Sequence[Sink] = (),
        summary_interval_s: float = 60.0,
        power_cap_w: float | None = None,
        power_caps: Mapping[str, float] | None = None,
        dedupe_horizon_s: float | None = None,
        idle_evict_s: float | None = None,
        max_gpus_per_host: int = MAX_GPUS_PER_HOST,
        series_outbox: bool = False,
        adopt_settings: bool = False,
    ) -> None:
        self._last_seen: dict[str, float] = {}  # host in memory -> collector time of its last batch
        self._next_eviction = -math.inf
        self.max_gpus_per_host = max_gpus_per_host
        self._host_gpus: dict[str, int] = {}  # host in memory -> its GPUs (and MIG instances)
        # host -> the generation this store last wrote it at (LedgerStore.claim_hosts); a host not here has no
        # state in memory
        self._generation: dict[str, int] = {}
        # hosts of the group being committed that the ledger holds nothing of (no GPU stored): their usage and hour
        # accumulators are not looked up (a fleet's first pushes after a restart, or new nodes, are all such hosts)
        self._unstored_hosts: set[str] = set()
        self.sinks = list(sinks)
        self.summary_interval_s = summary_interval_s
        self._clock = clock
        self._cache_limit = cache_limit
        self._lock = _StoreLock(str(db) if isinstance(db, (str, os.PathLike)) else db.url)
        self._queue_ready = threading.Condition()
        self._queue: list[_Pending] = []  # batches handed in, waiting for the next group commit
        self._committer: threading.Thread | None = None  # commits them (started by the first submit)
        self._closing = False
        # called after each group commit that stored its batches, with (batches, seconds the transaction took),
        # on the committing thread once their callers have their answers: the server's group-commit metrics
        self.commit_observers: list[Callable[[int, float], None]] = []
        self._pending_jobs: set[str] = set()
        self._summary_sent: dict[str, float] = {}
        self._compactor: threading.Thread | None = None
        self._compactor_stop = threading.Event()
        self._rolled_to: dict[GpuKey, int] = {}  # GPU -> the minute its last roll-up made final (compact)
        self._watermarks: dict[GpuKey, float] = {}  # GPU -> its newest sample's time at the last compaction
        try:
            self._db = _database(db)
        except DatabaseUnavailable as exc:
            raise StoreUnavailable(str(exc)) from exc
        self.url = self._db.url  # for messages: a SQLite file's path or a PostgreSQL URL without its password
        path = getattr(self._db, "path", None)
        self.path: Path | None = Path(path) if self._db.dialect == SQLITE and path is not None else None
        given = {name: value for name, value in {"window_s": window_s, "max_gap_s": max_gap_s,
                                                  "dedupe_horizon_s": dedupe_horizon_s, "power_cap_w": power_cap_w,
                                                  "power_caps": power_caps}.items() if value is not None}
        if retention is not None:  # its tiers are given whole: None in one is a value (kept for good)
            given.update({name: getattr(retention, field) for name, field in RETENTION_SETTINGS.items()})
        try:
            self.agreed_settings = self._open(retention, series_outbox, given, adopt_settings)
        except BaseException as exc:
            self._db.close()
            if isinstance(exc, DatabaseUnavailable) and not isinstance(exc, StoreUnavailable):
                raise StoreUnavailable(str(exc)) from exc
            raise
        # Batch keys older than this are pruned at compaction (a day of 1,000 nodes pushing every 10 s is
        # 8.6 million keys): the horizon must exceed how long an agent may hold a batch (its spool), or a batch
        # resent after it is counted twice.
        self.dedupe_horizon_s = self.agreed_settings["dedupe_horizon_s"]
        # a host silent this long (collector time) leaves memory: by default two windows, so a host that
        # pauses for less than its window keeps its windows
        self.idle_evict_s = 2 * max(self.agg.window_s, self.agg.max_gap_s) if idle_evict_s is None else idle_evict_s
        self._restore()

    @property
    def db(self) -> Database:
        """The database the ledger and the series store share (SQLite or PostgreSQL)."""
        return self._db

    def _open(self, retention: Retention | None, series_outbox: bool, given: Mapping[str, Any],
              adopt: bool) -> dict[str, Any]:
        """Bring the database up to date in one transaction under the migrations lock (two collectors opening one
        ledger at once take turns): the ledger's migrations, the agreed settings (:meth:`_agree`, returned) and the
        retention they make (``self.retention``), the series store's tables, the raw sample layout; then the
        aggregation: a setting it (or the retention) refuses rolls back what ``_agree`` recorded."""
        db = self._db
        with db.transaction():
            applied = migrate(db)
            agreed = self._agree(given, adopt)
            self.retention = retention = dataclasses.replace(
                retention or Retention(), **{field: agreed[name] for name, field in RETENTION_SETTINGS.items()})
            chunk_store = ChunkSeriesStore(db, retention)
            self._chunks = chunk_store  # what compaction plans and writes through, whatever wraps it for ingest
            self.series_store: SeriesStore = chunk_store
            row = db.execute("SELECT value FROM meta WHERE key='sample_fields'").fetchone()
            stored = tuple(json.loads(row[0])) if row else SAMPLE_FIELDS
            if SAMPLE_FIELDS[: len(stored)] != stored:
                raise RuntimeError(f"{self.url}: raw samples were written with fields {stored}, "
                                   "not a prefix of today's")
            if db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "1":
                chunk_store.repack_v1_samples(stored)  # a v1 store's raw samples table, into chunks
                db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(META_FORMAT),))
            db.execute(upsert("meta", ("key", "value"), ("key",)), ("sample_fields", json.dumps(SAMPLE_FIELDS)))
            if series_outbox:  # series_url: each batch's samples also queued for VictoriaMetrics, in its transaction
                # (it only enters the lock: ``with``)
                self.series_store = OutboxSeriesStore(chunk_store, db, cast(threading.RLock, self._lock))
            retention.check(agreed["window_s"])
            self.ledger = SqlLedger(db)
            # load_window: a GPU's window stays in the series store, only its newest sample in memory (bounded memory)
            self.agg = Aggregator(agreed["window_s"], agreed["max_gap_s"], load_usage=self._load_usages,
                                  load_hour=self._load_hours, power_cap_w=agreed["power_cap_w"],
                                  power_caps=agreed["power_caps"], load_window=self.series_store.window)
        for m in applied:
            log.info("%s: ledger migration %d applied: %s", self.url, m.version, m.name)
        return agreed

    def _agree(self, given: Mapping[str, Any], adopt: bool) -> dict[str, Any]:
        """The AGREED_SETTINGS this store runs with (under the migrations lock). Each given one (a key of ``given``)
        must be valid (InvalidSetting otherwise, before anything is compared); it is recorded in the ledger if it
        holds none yet (a ledger of an earlier version: the retention), and must equal the ledger's otherwise
        (SettingsMismatch naming each that differs) unless ``adopt`` (``gpuledger collector set-settings``: every
        other process stopped) records it instead. One not given is the ledger's, else the default (recording
        nothing: a query never decides them)."""
        db = self._db
        # name -> (the ledger's before, now)
        self.recorded_settings: dict[str, tuple[AgreedValue | Unrecorded, AgreedValue]] = {}
        stored: dict[str, AgreedValue] = {}
        for key, text in db.execute("SELECT key, value FROM meta WHERE key LIKE 'setting.%'").fetchall():
            name = key.removeprefix("setting.")
            if name in AGREED_SETTINGS:  # float() reads a float's repr as earlier versions wrote it, inf included
                stored[name] = _agreed_value(name, json.loads(text) if text == "null" or isinstance(
                    AGREED_SETTINGS[name], dict) else text)
        values = {name: _given_value(name, value) for name, value in given.items()}
        agreed: dict[str, Any] = {}
        differ: list[str] = []
        for name, default in AGREED_SETTINGS.items():
            if name not in values:
                agreed[name] = stored.get(name, _agreed_value(name, default))  # a copy: no store changes the default
                continue
            agreed[name] = value = values[name]
            before = stored.get(name, UNRECORDED)
            if before is not UNRECORDED and before != value and not adopt:
                differ.append(f"{name} = {setting_text(value)} here, {setting_text(before)} in the ledger")
            elif before != value:
                db.execute(upsert("meta", ("key", "value"), ("key",)),
                           (f"setting.{name}", json.dumps(value, sort_keys=True)))
                self.recorded_settings[name] = (before, value)
        if differ:
            raise SettingsMismatch(
                f"ledger {self.url}: {'; '.join(differ)}: every collector and compactor on a ledger must share it "
                f"(to change it, stop them all and run `{SET_SETTINGS_COMMAND}`)")
        return agreed

    def _restore(self) -> None:
        """Forget the in-memory aggregation: each host's windows are rebuilt from committed state when a batch
        of that host arrives (``_ensure_windows``)."""
        self.agg.reset()
        self._last_seen.clear()
        self._host_gpus.clear()
        self._generation.clear()  # the claims of a rolled-back transaction never happened

    def _claim_hosts(self, hosts: Iterable[str]) -> None:
        """Claim each host a group writes, in sorted order (the one lock order of every collector: none waits for
        another in a cycle). A host another collector wrote since this one did is forgotten here, so
        ``_ensure_windows`` restores it from the ledger: it is locked now, nobody else can move it on."""
        for host, generation in sorted(self.ledger.claim_hosts(sorted(hosts)).items()):
            last = self._generation.get(host)
            if last != generation - 1:
                if last is not None:  # only then is anything of the host in memory (see _generation)
                    self.agg.forget_host(host)
                    self._last_seen.pop(host, None)
                    self._host_gpus.pop(host, None)
                self.ledger.forget_host(host)
            self._generation[host] = generation

    def _ensure_windows(self, gpu_keys: set[tuple]) -> None:
        """Restore every stored GPU of the hosts in ``gpu_keys`` not in memory: its totals and its newest sample, where
        its next interval starts (the aggregation keeps no more of a GPU between batches; a late sample reads the rest
        of its window back, ``Aggregator(load_window=...)``). A host's GPUs come back together: the aggregation's
        rules may join a GPU and its MIG instances. TooManyGpus (before anything changes) when new GPUs would take a
        host over ``max_gpus_per_host``."""
        hosts = {k[0] for k in gpu_keys}
        load = {h: self.ledger.host_gpu_totals(h) for h in hosts if h not in self._last_seen}
        grows: set[str] = set()  # hosts whose count of GPUs in memory may change with this batch
        absent = [k for k in gpu_keys if k not in self.agg.gpus]  # (none, once a host's GPUs are all in memory)
        for host in hosts:
            known = len(load[host]) if host in load else self._host_gpus[host]
            stored = {k for k, _ in load[host]} if host in load else None
            new = sum(1 for k in absent if k[0] == host and (stored is None or k not in stored))
            if known + new > self.max_gpus_per_host:
                raise TooManyGpus(f"host {host!r} has {known} GPUs and MIG instances stored; {new} new ones would "
                                  f"pass the limit of {self.max_gpus_per_host}")
            if new or stored is not None:
                grows.add(host)
        now = self._clock()
        for host, rows in load.items():
            if not rows:
                # A host's usage and hour rows are written in the transactions that write its GPUs' totals, and no
                # GPU row is ever deleted: none stored, nothing of the host is (the host is claimed: locked).
                self._unstored_hosts.add(host)
                continue
            newest = self.series_store.newest(host, [gpu_key for gpu_key, _ in rows])
            sealed = self._chunks.sealed(host)  # what compaction made final
            for gpu_key, totals in rows:
                self.agg.restore_gpu(gpu_key, totals, segments=newest[gpu_key],
                                     sealed_until=sealed.get(gpu_key, -math.inf))
        for host in hosts:
            self._last_seen[host] = now
        for host in grows:  # only the batch's keys (a walk over every GPU in memory cost O(fleet) a batch)
            keys = {k for k in gpu_keys if k[0] == host}
            keys |= {(h, u, "") for h, u, m in keys if m}  # the whole-GPU key aggregation makes for a MIG GPU
            before = {k for k, _ in load[host]} if host in load else None
            self._host_gpus[host] = (len(before | keys) if before is not None
                                     else self._host_gpus[host] + sum(1 for k in keys if k not in self.agg.gpus))

    def _load_usages(self, keys: list[UsageKey]) -> dict[UsageKey, UsageAcc]:
        """The aggregation's ``load_usage``: the ledger's, except for hosts it holds nothing of."""
        unstored = self._unstored_hosts
        wanted = [k for k in keys if k[1] not in unstored] if unstored else keys
        return self.ledger.load_usages(wanted) if wanted else {}

    def _load_hours(self, keys: list[HourKey]) -> dict[HourKey, HourAcc]:
        """The aggregation's ``load_hour``: the ledger's, except for hosts it holds nothing of."""
        unstored = self._unstored_hosts
        wanted = [k for k in keys if k[0] not in unstored] if unstored else keys
        return self.ledger.load_hours(wanted) if wanted else {}

    def _evict_idle(self) -> None:
        """Drop the windows and accumulators of hosts silent for ``idle_evict_s``, and hour accumulators past
        (called after a commit: nothing is dirty); a walk over every GPU, so at most every tenth of that
        interval."""
        now = self._clock()
        if now < self._next_eviction:
            return
        self._next_eviction = now + self.idle_evict_s / 10
        cutoff = now - self.idle_evict_s
        idle = {h for h, t in self._last_seen.items() if t < cutoff}
        for host in idle:
            del self._last_seen[host]
            self._host_gpus.pop(host, None)
        if idle:
            self.agg.evict(idle)  # windows, usage and hours: totals, sums and samples are stored
        self.agg.drop_past_hours()

    # -- writes -------------------------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Store and aggregate a validated batch durably; idempotent per (host, agent_id, seq). Returns only
        after the commit that holds it. Raises BatchRefused (BatchConflict: a known key with other content;
        TooManyGpus), StoreFull when the disk is full, StoreUnavailable when the ledger cannot be reached."""
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Future[IngestResult]:
        """Hand a validated batch to the group commit; the future settles as :meth:`ingest` returns or raises.

        Group commit: a committer thread takes every batch waiting and commits them in one transaction (one
        fsync), then settles their futures; batches handed in meanwhile wait for the next one. A batch that fails
        on its own (a conflict) is answered alone; one that breaks the transaction sends the others of its group
        through one at a time, so it never costs them their commit."""
        item = _Pending(batch, Future())
        with self._queue_ready:
            if self._closing:
                raise StoreUnavailable(f"store {self.url} is closed")
            self._queue.append(item)
            self._queue_ready.notify()
            if self._committer is None:
                self._committer = threading.Thread(target=self._commit_loop, name="store-commit", daemon=True)
                self._committer.start()
        assert item.future is not None
        return item.future

    def ready_to_commit(self) -> bool:
        """Whether a group commit would start now, without waiting for another process's (``Database.ready_to_write``:
        the collector's workers on one SQLite file take turns); the calling thread's next one then goes ahead."""
        return self._db.ready_to_write()

    def ingest_group(self, batches: Sequence[Batch]) -> list[IngestResult | Exception]:
        """Commit ``batches`` as one group on the calling thread, waiting for nothing else: each one's result, or
        the exception :meth:`ingest` would raise for it. For a caller that gathers batches itself (the server's
        event loop, on an embedded ledger: no thread hand-off per batch, no thread competing for the GIL)."""
        group = [_Pending(b) for b in batches]
        with self._lock:
            self._commit_group(group)
        return [it.result if it.error is None else it.error for it in group]  # type: ignore[misc]

    def _commit_loop(self) -> None:
        while True:
            with self._queue_ready:
                while not self._queue and not self._closing:
                    self._queue_ready.wait()
                if not self._queue:
                    return  # closing, and nothing left to commit
            group: list[_Pending] = []
            try:
                with self._lock:  # then whatever waits by now: batches that came while compaction held the lock too
                    with self._queue_ready:
                        group, self._queue = self._queue, []
                    self._commit_group(group)
            except BaseException as exc:  # never leave a caller waiting (nor the thread dead without a word)
                log.exception("group commit failed")
                for it in group:
                    if it.future is not None and not it.future.done():
                        it.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))

    def _commit_group(self, group: list[_Pending], races: int = 0) -> None:
        """One transaction for every batch of ``group`` (called with the lock held); sets each one's outcome.
        Batches go by host (stable: a host's batches keep their order), after their hosts are claimed."""
        group = sorted(group, key=lambda it: it.batch.host)
        began = time.perf_counter()
        self._unstored_hosts.clear()  # (a group that ended in an exception of another kind may have left some)
        try:
            with self._db.transaction():
                self._claim_hosts({it.batch.host for it in group})
                for batches in _rounds(group):
                    self._add_round(batches)
                jobs = self._flush()
        except Exception as exc:
            self._unstored_hosts.clear()
            # The in-memory aggregation already moved; put it back to what is committed (the GPUs' clusters are
            # re-read when each host is claimed again).
            self._restore()
            for it in group:
                it.error, it.result = None, None
            if isinstance(exc, _BatchRaced) and races < _RACE_RETRIES:
                self._commit_group(group, races + 1)  # the raced batch is now a duplicate
                return
            # a lock held too long is one host's (another collector stalled holding it): the others still commit
            lost = isinstance(exc, (DatabaseFull, DatabaseUnavailable)) and not isinstance(exc, DatabaseBusy)
            if len(group) > 1 and not lost:
                for it in group:  # find the one that breaks the transaction; the others still commit
                    self._commit_group([it])
                return
            err: Exception = exc
            if isinstance(exc, DatabaseFull):
                err = StoreFull(f"store {self.url}: {exc}")
            elif isinstance(exc, DatabaseUnavailable):
                err = StoreUnavailable(str(exc))
            for it in group:
                it.error, it.result = err, None
                it.settle()
            return
        took = time.perf_counter() - began
        self._unstored_hosts.clear()  # committed: what the ledger holds of them is in memory now
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
                it.settle()
            for observe in self.commit_observers:
                try:
                    observe(len(group), took)
                except Exception:  # a metric never fails a commit
                    log.exception("group commit observer %r failed", observe)

    def _add_round(self, group: list[_Pending]) -> None:
        """Aggregate batches of distinct hosts and write their samples and keys inside the group's transaction;
        sets each one's result and (when there are sinks) its accepted samples as GpuSamples, or its error
        (BatchRefused: found before anything of it was written). Their series are folded together (one matrix
        row a GPU: ``Aggregator.add_series``); hosts share no aggregation state, so this is what folding them one
        batch after the other gives."""
        live: list[_Pending] = []
        seen = self.ledger.batches_seen_of([(it.batch.host, it.batch.agent_id, it.batch.seq) for it in group])
        for it in group:
            it.error = None
            try:
                if self._seen_before(it, seen):
                    continue
                rows = it.batch.rows
                self._ensure_windows({(s.host, s.gpu_uuid, s.mig or "") for s in (*it.batch.series, *rows)})
            except BatchRefused as exc:
                it.error = exc
                continue
            live.append(it)
        # rows: GpuSamples or the fast path's structs with the same fields (no GpuSample built per sample);
        # series are folded and packed a column at a time unless a GPU's samples must go one by one. A batch with
        # both layouts (only through the Python API) goes one by one.
        folded, rest = self.agg.add_series([s for it in live if not it.batch.rows for s in it.batch.series])
        # what goes sample by sample may be behind its GPU's newest, where a seal refuses it (the fold takes only
        # series newer than it)
        self._read_seals(self._behind([*rest, *(r for it in live if it.batch.rows
                                                for r in (*it.batch.rows, *(x for s in it.batch.series
                                                                            for x in s.rows())))]))
        folded_by_host: dict[str, list[Series]] = {}
        for s in folded:
            folded_by_host.setdefault(s.host, []).append(s)
        rest_by_host: dict[str, list[GpuSample]] = {}
        for r in rest:
            rest_by_host.setdefault(r.host, []).append(r)
        for it in live:
            batch = it.batch
            rows = list(batch.rows)
            if rows:
                rows += [r for s in batch.series for r in s.rows()]
            else:
                rows = rest_by_host.get(batch.host, [])
            mine = folded_by_host.get(batch.host, [])
            # the agent's columns as one host chunk (compaction splits it into the GPUs' chunks); others a GPU each.
            # Stored before the rest is folded: a GPU whose later series go sample by sample reads its window back.
            # (an empty list writes nothing: not handed on)
            wired = [s for s in mine if s.wire is not None]
            if wired:
                self.series_store.write_host_series(wired)
            if len(wired) < len(mine):
                self.series_store.write_series([s for s in mine if s.wire is None])
            counts, accepted = self.agg.add_many(rows) if rows else (AddCounts(), [])
            if accepted:
                self.series_store.write_samples(accepted)
            cluster = batch.cluster
            uuids = set(map(_UUID, batch.rows))
            uuids.update(map(_UUID, batch.series))
            self.ledger.note_gpus(cluster, [(batch.host, u) for u in uuids])
            if batch.jobs:
                # an agent's job metadata is kept only for jobs whose samples came from its host
                job_ids = {j for r in (*batch.rows, *batch.series) for j in r.job_ids}
                self.ledger.add_agent_jobs(batch.jobs, batch.host, cluster, job_ids)
            n_accepted = counts.accepted + sum(s.n for s in mine)
            it.result = IngestResult(n_accepted, counts.duplicate, counts.too_late)
            it.accepted = [as_sample(s) for s in accepted] + [r for s in mine for r in s.rows()] if self.sinks else []
        now = self._clock()
        keys = [(it.batch.host, it.batch.agent_id, it.batch.seq, it.batch.digest, now, it.result.accepted)
                for it in live if it.result is not None]
        if self.ledger.record_batches(keys) != len(keys):
            raise _BatchRaced(f"a key of {len(keys)} batches of hosts {sorted({k[0] for k in keys})[:5]} was stored "
                              "meanwhile")

    def _behind(self, rows: Iterable[Any]) -> set[str]:
        """The hosts of ``rows`` (samples left for the per-sample path) with one at or behind its GPU's newest in
        memory (a late one, or a resend): only there can a seal refuse a sample."""
        gpus = self.agg.gpus
        out: set[str] = set()
        for r in rows:
            g = gpus.get((r.host, r.gpu_uuid, r.mig or ""))
            if g is not None and r.ts <= g.watermark:
                out.add(r.host)
        return out

    def _read_seals(self, hosts: Iterable[str]) -> None:
        """The seals of ``hosts``' GPUs, read after the hosts' claim in this transaction (a compaction's seal holds
        the same lock, ``_seal``): a sample before one is too late, whatever this store's window."""
        gpus = self.agg.gpus
        for host in hosts:
            for gpu_key, until in self._chunks.sealed(host).items():
                g = gpus.get(gpu_key)
                if g is not None and until > g.sealed_until:
                    g.sealed_until = until

    @staticmethod
    def _seen_before(it: _Pending, stored: Mapping[tuple[str, str, int], bytes]) -> bool:
        """Whether the ledger holds the batch's key (``stored``: the round's keys found, with their digests; its
        result is then set: a duplicate); BatchConflict when it holds it with other content."""
        batch = it.batch
        seen = stored.get((batch.host, batch.agent_id, batch.seq))
        if seen is None:
            return False
        if seen and batch.digest and len(seen) == len(batch.digest) and seen != batch.digest:  # (same form)
            raise BatchConflict(f"batch agent_id={batch.agent_id!r} seq={batch.seq} of host {batch.host!r} "
                                "was stored before with different content; the first one stands "
                                "(an agent reusing sequence numbers lost its state)")
        it.result, it.accepted = IngestResult(0, duplicate_batch=True), []
        return True

    def _flush(self) -> set[str]:
        """Write the dirty accumulators to the ledger; returns the job ids whose usage changed."""
        usage, gpus, hours = self.agg.take_dirty_values()
        self.ledger.write_aggregates(usage, gpus, hours)
        self.ledger.write_gaps(self.agg.take_gaps())
        return {k[0] for k, _ in usage}

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
    def compact(self, now: float | None = None, all_host_chunks: bool = False) -> CompactStats:
        """Apply the tiers: split batches' host chunks into their GPUs' chunks, roll up closed minutes and hours,
        merge small chunks, drop expired data. Closed minutes are those a late window (this store's ``window_s``)
        behind a GPU's newest sample; they are sealed before they are rolled up, and from then on every collector
        on the ledger refuses a sample there as too late, whatever its own window (``ChunkSeriesStore.seal``). A
        host's host chunks wait until they are many or reach half a window behind its newest sample
        (``all_host_chunks``: split every one now, as an operator's compaction does).

        Idempotent. A pass plans from reads through a connection of its own (``Database.reader``), outside the
        store's lock, then writes in short transactions (about ``COMPACTION_STEP_S`` of work each, many GPUs'
        roll-ups or merges in one), each taken once no ingest batch waits for a commit: ingest waits at most for
        one step, and a crash leaves each step's GPUs in either the old or the new state. On a ledger shared by several
        collectors one compacts at a time (the ledger's compaction lock): while another one holds it, this one
        only hands its sinks their summaries (``skipped``).
        """
        now = self._clock() if now is None else now
        with self._db.try_lock(COMPACTION_LOCK) as mine:
            if mine:
                return self._compact(now, all_host_chunks)
        with self._lock:
            return CompactStats(job_summaries=self._emit_summaries(force=True), skipped=True)

    def _compact(self, now: float, all_host_chunks: bool) -> CompactStats:
        # Every read goes through a connection of its own (Database.reader), outside the store's lock: planning
        # a pass reads every GPU's totals, groups every chunk and decodes what it rolls up or merges, which held
        # ingest's commits for as long. Only the planned writes take the lock, in short steps (_Steps).
        counts = {"minutes": 0, "hours": 0, "merged": 0, "deleted": 0, "split": 0}

        def rolled(gpu_key: GpuKey, minute: int, written: tuple[int, int]) -> None:
            self._rolled_to[gpu_key] = minute
            counts["minutes"] += written[0]
            counts["hours"] += written[1]

        def add(name: str, n: int) -> None:
            counts[name] += n

        steps = _Steps(self, COMPACTION_STEP_S)
        pace = _Pacer(COMPACTION_CPU_SHARE)
        started = time.monotonic()
        with self._db.reader() as rdb:
            reader = self._chunks.on(rdb)
            with rdb.snapshot():
                at = GPU_TOTAL_FIELDS.index("watermark")
                watermarks = {gpu_key: totals[at] for gpu_key, totals in gpu_totals(rdb)}  # every stored GPU
            seen, self._watermarks = self._watermarks, watermarks
            # Batches' host chunks become their GPUs' chunks first, a host's once they reach half a window behind
            # its newest sample (or are many): its GPUs' chunks then hold many rows, and the minutes rolled up below
            # (final: a window behind) are in them. (Raw reads see host chunks too, so this is only a matter of
            # cost.) ``all_host_chunks``: every host's, now.
            newest: dict[str, float] = {}
            for (host, _, _), watermark in watermarks.items():
                newest[host] = max(newest.get(host, -math.inf), watermark)
            hosts = (reader.split_hosts() if all_host_chunks
                     else reader.split_hosts(newest, self.agg.window_s / 2, HOST_SPLIT_CHUNKS))
            for host in hosts:
                for split in reader.plan_host_splits(host):
                    steps.add(partial(self._chunks.apply_host_split, split), partial(add, "split"))
                pace()
            steps.flush()
            due: list[tuple[GpuKey, int]] = []  # GPUs to roll up, each with the minute it rolls up to
            for gpu_key, watermark in sorted(watermarks.items()):
                # minutes before (newest sample - window) are final (sealed below, then no late sample is taken)
                minute = math.floor((watermark - self.agg.window_s) / 60.0)
                last = self._rolled_to.get(gpu_key)
                if last is not None and (minute == last or (
                        minute - last < ROLLUP_EVERY_MINUTES and seen.get(gpu_key) != watermark)):
                    # nothing became final, or a GPU still sending has fewer than ROLLUP_EVERY_MINUTES final
                    # minutes not rolled up (a roll-up costs about the same for one minute as for ten; queries
                    # summarise what is not rolled up from raw samples); a GPU gone quiet is rolled up at once
                    continue
                due.append((gpu_key, minute))
            # Seal before reading: a roll-up read after the seal committed holds every sample its minutes will have,
            # however long the ingesting process's late window is (it may differ from this one's: a `serve --window`
            # flag `collector compact` does not see, a restart with a longer one). Each seal locks its host as a
            # batch's claim does: a batch with samples behind its GPU's newest reads the seals after its claim
            # (_read_seals; Aggregator.add refuses what is before them), so it commits before the seal, and the
            # roll-up reads it, or it sees the seal.
            for host, gpus in groupby(due, key=lambda d: d[0][0]):
                horizons = [(gpu_key, minute * 60.0) for gpu_key, minute in gpus]
                steps.add(partial(self._seal, host, horizons), _ignore)
            steps.flush()
            for gpu_key, minute in due:
                plan = reader.plan_roll_up(gpu_key, minute * 60.0)
                if plan.changes:
                    steps.add(partial(self._chunks.apply_roll_up, plan), partial(rolled, gpu_key, minute))
                else:
                    self._rolled_to[gpu_key] = minute
                pace()
            steps.flush()
            # a GPU still sending (its newest sample moved since the last pass): its raw intervals close by that
            # sample - the late window as well as by the clock
            active = {k: w - self.agg.window_s for k, w in watermarks.items() if k in seen and seen[k] != w}
            for tier in TIERS:
                for group in reader.mergeable_groups(tier, now, active):
                    merge = reader.plan_merge(group)
                    if merge is not None:
                        steps.add(partial(self._chunks.apply_merge, merge), partial(add, "merged"))
                    pace()
            steps.flush()
            floors = {k: self.agg.read_floor(w) for k, w in watermarks.items()}  # what the aggregation reads back
            for expiry in reader.plan_expiry(now, floors):  # after the roll-ups: what they made expirable goes too
                steps.add(partial(self._chunks.apply_expiry, expiry), partial(add, "deleted"))
            steps.flush()
        with self._lock:
            with self._db.transaction():
                self.ledger.prune_batches(now - self.dedupe_horizon_s)
                self._db.execute(upsert("meta", ("key", "value"), ("key",)), (COMPACTED_AT, repr(self._clock())))
            summaries = self._emit_summaries(force=True)
        log.info("compaction: %d host chunks split, %d GPUs, %d minutes and %d hours rolled up, %d chunks merged away, "
                 "%d expired, in %.1f s", counts["split"], len(watermarks), counts["minutes"], counts["hours"],
                 counts["merged"], counts["deleted"], time.monotonic() - started)
        return CompactStats(counts["minutes"], counts["hours"], counts["merged"], counts["deleted"], summaries,
                            split_chunks=counts["split"])

    def _seal(self, host: str, horizons: list[tuple[GpuKey, float]]) -> None:
        """Seal a host's GPUs' samples before their horizons (in a compaction step's transaction), holding the host's
        lock as a batch's claim does (without moving its generation: a collector holding the host keeps it, and
        reads the seals when a batch brings samples behind a GPU's newest, ``_read_seals``)."""
        self.ledger.lock_hosts([host])
        self._chunks.seal(horizons)

    @contextmanager
    def _compaction_step(self) -> Iterator[None]:
        """The lock for one compaction step, taken once no batch waits for a commit (or after 50 ms): the lock
        is not fair, and a compactor releasing and retaking it step after step kept ingest waiting for seconds."""
        end = time.monotonic() + 0.05
        while self._queue and time.monotonic() < end:
            time.sleep(0.001)
        with self._lock:
            yield

    def start_background(self, interval_s: float = 300.0, compact: bool = True) -> None:
        """Every ``interval_s`` seconds until :meth:`close`, in a daemon thread: :meth:`compact`, or with ``compact``
        false (compaction runs elsewhere: ``collector.compactor``) only hand the sinks the jobs' updated usage."""
        if self._compactor is not None:
            return
        self._compactor_stop.clear()

        def loop() -> None:
            while not self._compactor_stop.wait(interval_s):
                try:
                    if compact:
                        self.compact()
                    else:
                        with self._lock:
                            self._emit_summaries(force=True)
                except Exception:  # keep compacting later; the store itself is consistent
                    log.exception("compaction failed" if compact else "job summaries failed")

        self._compactor = threading.Thread(target=loop, name="store-compact", daemon=True)
        self._compactor.start()

    def stop_background(self, timeout_s: float | None = None) -> None:
        """Stops the background thread; waits ``timeout_s`` at most for it (None: until it ends). A pass stuck behind
        a stalled commit ends when the store closes (``_StoreLock``)."""
        if self._compactor is not None:
            self._compactor_stop.set()
            self._compactor.join(timeout_s)
            if self._compactor.is_alive():  # a long pass, or one stuck behind the ledger (a daemon thread)
                log.warning("store %s: the compaction pass in progress did not end within %s s", self.url, timeout_s)
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

    def jobs_page(self, offset: int, limit: int) -> tuple[list[JobRecord], int]:
        """A page of :meth:`jobs` and how many there are (``SqlLedger.jobs_page``)."""
        with self._lock:
            return self.ledger.jobs_page(offset, limit)

    def job_usage_page(self, job_id: str | None, per_gpu: bool, offset: int, limit: int
                       ) -> tuple[list[JobUsage], int]:
        """A page of :meth:`job_usage` and how many there are (``SqlLedger.job_usage_page``)."""
        with self._lock:
            return self.ledger.job_usage_page(job_id, per_gpu, offset, limit)

    def busy_hours(self, since: float | None = None) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
        """Per GPU: (hour start, GPU-seconds that carried a job) of its hour buckets (``SqlLedger.busy_hours``)."""
        with self._lock:
            return self.ledger.busy_hours(since)

    def gpu_hours(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per GPU over the whole hours of [start, end) (``ledger_store.hour_span``): observed and job-carrying
        GPU-seconds, energy."""
        with self._lock:
            return self.ledger.gpu_hours(start, end)

    def totals(self, start: float | None = None, end: float | None = None) -> dict:
        """Cluster totals over whole hours: the hour buckets from the one holding ``start`` up to, not including, the
        one holding ``end`` (adjacent ranges partition the hours; a range inside one hour sums none); the answer's
        ``hours_start`` and ``hours_end`` name the buckets summed (``SqlLedger.totals``)."""
        with self._lock:
            return self.ledger.totals(start, end)

    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per physical GPU over the whole hours of [start, end) (``ledger_store.hour_span``): energy, the part
        charged to jobs, unattributed energy, counter anomalies."""
        with self._lock:
            return self.ledger.gpu_energy(start, end)

    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Gap records that ended in [start, end) (see ``SqlLedger.energy_gaps``)."""
        with self._lock:
            return self.ledger.energy_gaps(start, end)

    def counter_anomalies(self) -> int:
        with self._lock:
            return self.ledger.counter_anomalies()

    def last_compaction(self) -> float | None:
        """When a compaction of the ledger last completed (unix time, by the clock of the store that ran it), or None
        if none has since this version: one skipped because another collector held the ledger's compaction lock
        records nothing (that one records its own)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (COMPACTED_AT,)).fetchone()
        return None if row is None else float(row[0])

    def gpus(self) -> list[GpuKey]:
        """Every GPU the store holds totals for: (host, GPU UUID, MIG instance or "")."""
        with self._lock:
            return [key for key, _ in self.ledger.gpu_totals()]

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        """One GPU's data with start <= ts <= end, in time order (see ``ChunkSeriesStore.series``)."""
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
        """Bytes on disk: the SQLite file plus its WAL, or the PostgreSQL database's size."""
        if self.path is None:
            with self._lock:
                return int(self._db.execute("SELECT pg_database_size(current_database())").fetchone()[0])
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += os.path.getsize(str(self.path) + suffix)
            except OSError:
                pass
        return total

    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (what ``size_bytes`` then measures); SQLite only
        (PostgreSQL checkpoints by itself)."""
        if self.path is None:
            return
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def closing(self, timeout_s: float) -> None:
        """The store is about to close: from ``timeout_s`` on, threads waiting for its lock give up (StoreUnavailable)
        rather than wait for a commit that does not end (what :meth:`close` with this bound gives it)."""
        deadline = time.monotonic() + timeout_s
        if self._lock.give_up_at is None or deadline < self._lock.give_up_at:
            self._lock.give_up_at = deadline

    def close(self, timeout_s: float | None = None) -> None:
        """Commits what was handed in and closes the database. ``timeout_s``: how long the commit in progress may
        still take (None: as long as it takes; threads waiting for the store's lock give up then, ``closing``); past
        it, StoreStalled, and the database stays open to the stuck commit (the process can end: the committer is a
        daemon thread)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if timeout_s is not None:
            self.closing(timeout_s)
        # the committer first (its last group), while the compaction pass in progress ends: both within the bound
        with self._queue_ready:
            self._closing = True
            self._queue_ready.notify()
            queued = len(self._queue)
        self.stop_background(timeout_s)
        stalled = StoreStalled(
            f"the ledger {self.url} was stalled at shutdown: its commit in progress (and {queued} batch(es) queued "
            f"behind it) did not end within {timeout_s} s; none of them was acknowledged: the agents resend them (a "
            "resend of one the ledger committed meanwhile is answered as a duplicate)")
        if self._committer is not None:
            self._committer.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if self._committer.is_alive():
                raise stalled
        try:
            with self._lock:
                self._db.close()
        except StoreUnavailable as e:  # a compaction step holds the lock behind a commit that does not end
            raise stalled from e


def open_store(ledger_url: str | None, data_dir: str | os.PathLike[str], **settings: Any) -> Store:
    """The collector's store: the ledger at ``ledger_url`` (``postgresql://...``, or a SQLite file's path or
    ``sqlite://`` URL) or, without one, the embedded SQLite file ``<data_dir>/gpuledger.sqlite``. ``settings`` are
    the store's keyword arguments. Raises ValueError for another URL scheme, DatabaseUnavailable when PostgreSQL
    cannot be reached (StoreUnavailable, a DatabaseUnavailable), LedgerTooNew (``collector.migrations``) for a
    ledger of a newer gpuledger."""
    return Store(ledger_url or Path(data_dir) / STORE_NAME, **settings)
