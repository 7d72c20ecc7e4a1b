"""The collector's HTTP API: an asyncio server (uvloop when installed) parsing with httptools.

One thread runs the event loop and every connection on it: an idle keep-alive connection costs a file
descriptor and a few KiB, not a thread, so a fleet of thousands of nodes can each hold one. Blocking work
runs on the loop only where it costs less than a hand-off to a thread: the endpoints (they read the store under its
lock, write the audit log) run in a bounded thread pool, /metrics in a thread of its own (it answers during a
ledger stall: ``_LedgerReadings``); a large or compressed body is
validated in a small parser pool, an agent's usual small one on the loop; a batch is made durable in a group
commit of every batch waiting, which the loop runs itself on an embedded (SQLite) ledger and the store's
committer thread on PostgreSQL (``_ingest``). ``max_inflight`` ingest slots bound the batches held at once.

Bad input always gets a 4xx with ``{"error": ...}`` naming the problem; an unexpected failure in one
request gets a 500 for that request only and the server keeps serving. A batch is answered 2xx only
once the group commit that holds it is durable. Routes live in one table (``ROUTES``) that the OpenAPI
document is checked against.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import inspect
import json
import logging
import math
import resource
import signal
import socket
import sqlite3
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from email.message import Message
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import httptools
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from gpuledger.collector.auditlog import AuditLog, open_log, record_job_records
from gpuledger.collector.auth import Access, Authenticator, AuthError, Principal
from gpuledger.collector.db import SQLITE, DatabaseFull, DatabaseUnavailable
from gpuledger.collector.limits import (
    IDLE_TIMEOUT_S,
    LEDGER_TIMEOUT_S,
    LISTEN_BACKLOG,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_PAGE,
    MAX_PER_HOST,
    MAX_SERIES_POINTS,
    MAX_URL_BYTES,
    REQUEST_TIMEOUT_S,
)
from gpuledger.collector.openapi import openapi_document
from gpuledger.collector.series_remote import SeriesUnavailable
from gpuledger.collector.series_store import SeriesReader
from gpuledger.collector.store import (
    MIN_QUERY_STEP_S,
    BatchRefused,
    IngestResult,
    QueryRangeError,
    Store,
    StoreFull,
    query_range,
)
from gpuledger.collector.validate import (
    DEFAULT_LIMITS,
    MAX_BODY_BYTES,
    Batch,
    BatchError,
    Limits,
    is_name,
    parse_batch,
    parse_jobs,
)
from gpuledger.schema.text import ascii_int

log = logging.getLogger(__name__)

FEED_NAME = "priority-feed.json"  # written by accounting (`gpuledger priority feed`); only read here

# (method, path) -> (CollectorServer method, who may call it)
ROUTES: dict[tuple[str, str], tuple[str, Access]] = {
    ("POST", "/api/v1/samples"): ("post_samples", "node"),
    ("GET", "/api/v1/jobs"): ("get_jobs", "read"),
    ("POST", "/api/v1/jobs"): ("post_jobs", "admin"),
    ("GET", "/api/v1/usage"): ("get_usage", "read"),
    ("GET", "/api/v1/totals"): ("get_totals", "read"),
    ("GET", "/api/v1/series"): ("get_series", "read"),
    ("GET", "/api/v1/priority"): ("get_priority", "read"),
    ("GET", "/api/v1/openapi.json"): ("get_openapi", "public"),
    ("GET", "/metrics"): ("get_metrics", "public"),
    ("GET", "/healthz"): ("get_health", "public"),
}


@dataclass
class Request:
    query: dict[str, list[str]]
    headers: Message
    principal: Principal | None
    read_body: Callable[[], bytes]


@dataclass
class Reply:
    status: int
    payload: Any
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class FeedError(Exception):
    """The priority feed file exists but cannot be read as a feed."""


def read_feed(path: Path) -> dict[str, Any]:
    """The feed document; FileNotFoundError when absent, FeedError when unreadable."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise FeedError(f"priority feed {path} is unreadable: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("associations"), list):
        raise FeedError(f"priority feed {path} has no 'associations' list")
    return doc


class _FeedGauges:
    """Fairshare and site factor per association, read from the feed file at each scrape. /metrics is open,
    so user names are published only where the operator says so (``user_labels``); otherwise only the
    accounts' own rows, labelled by account."""

    def __init__(self, path: Path | None, user_labels: bool = False) -> None:
        self.path = path
        self.user_labels = user_labels

    def describe(self) -> list[Metric]:
        return []  # registering must not read the file

    def collect(self) -> Iterator[Metric]:
        if self.path is None:
            return
        try:
            doc = read_feed(self.path)
        except (FileNotFoundError, FeedError):
            return  # no feed, no gauges: a stale value would be worse than none
        names = ("account", "user") if self.user_labels else ("account",)
        fs = GaugeMetricFamily("gpuledger_fairshare_ratio", "Measured fairshare per association (0..1), from the "
                               "priority feed.", labels=names)
        sf = GaugeMetricFamily("gpuledger_site_factor", "Slurm site factor per association, from the priority feed.",
                               labels=names)
        for a in doc["associations"]:
            if not isinstance(a, dict) or not isinstance(a.get("account"), str):
                continue
            user = a.get("user") or ""
            if not isinstance(user, str) or (user and not self.user_labels):
                continue
            labels = [a["account"], user] if self.user_labels else [a["account"]]
            for family, key in ((fs, "fairshare"), (sf, "site_factor")):
                v = a.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    family.add_metric(labels, float(v))
        yield fs
        yield sf
        gen = doc.get("generated_at")
        if isinstance(gen, (int, float)) and not isinstance(gen, bool):
            yield GaugeMetricFamily("gpuledger_priority_feed_generated_timestamp_seconds",
                                    "When accounting wrote the priority feed (unix time).", value=float(gen))


LEDGER_READ_S = 0.25  # a scrape waits this long at most for the figures it reads of the ledger (see _LedgerReadings)
FIRST_LEDGER_READ_S = 5.0  # ... or this long when none were read yet (a busy machine's first scrape has them too)


class _LedgerReadings:
    """What /metrics says of the ledger, read through the store (its size, the counter anomalies; ``add``: other
    collectors that read the ledger, the series shipper's backlog): read afresh at a scrape, in a thread of its own,
    for LEDGER_READ_S at most. Behind a commit that stalls (it holds the store's lock) or a link gone silent the scrape
    answers the figures last read, and ``gpuledger_collector_ledger_readings_age_seconds`` says how old they are; one
    read at a time, so scrapes never pile threads up behind the store. Nothing read yet: the first scrape waits
    FIRST_LEDGER_READ_S for them, and answers none of them if they are not read by then."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._extra: list[Any] = []
        self._guard = threading.Lock()
        self._families: list[Metric] = []
        self._read_at: float | None = None  # time.monotonic() of the figures in _families
        self._reading: threading.Event | None = None  # set when the read in progress ends

    def add(self, collector: Any) -> None:
        """Another prometheus_client collector whose ``collect`` reads the ledger."""
        self._extra.append(collector)

    def _read(self, done: threading.Event) -> None:
        try:
            families = [
                GaugeMetricFamily("gpuledger_collector_store_size_bytes", "Embedded store size on disk.",
                                  value=float(self.store.size_bytes())),
                CounterMetricFamily("gpuledger_collector_energy_counter_anomalies",
                                    "Intervals whose energy counter went backwards or jumped beyond the power limit "
                                    "(charged from the power integral instead), over all GPUs.",
                                    value=float(self.store.counter_anomalies())),
            ]
            compacted = self.store.last_compaction()
            if compacted is not None:
                families.append(GaugeMetricFamily(
                    "gpuledger_collector_last_compaction_timestamp_seconds",
                    "When a compaction of the ledger last completed (unix time), whichever process ran it: alert when "
                    "it is older than a few compact_interval_s (a compactor refused or gone, raw samples piling up).",
                    value=compacted))
            for collector in self._extra:
                families.extend(collector.collect())
            with self._guard:
                self._families, self._read_at = families, time.monotonic()
        except Exception as e:  # the ledger away: the figures last read stand, their age says so
            log.warning("metrics: cannot read the ledger's figures (the last ones read are answered): %s", e)
        finally:
            with self._guard:
                self._reading = None
            done.set()

    def collect(self) -> Iterator[Metric]:
        with self._guard:
            done = self._reading
            if done is None:
                done = self._reading = threading.Event()
                threading.Thread(target=self._read, args=(done,), name="collector-metrics-read", daemon=True).start()
        done.wait(LEDGER_READ_S if self._read_at is not None else FIRST_LEDGER_READ_S)
        with self._guard:
            families, read_at = self._families, self._read_at
        yield from families
        if read_at is not None:
            yield GaugeMetricFamily(
                "gpuledger_collector_ledger_readings_age_seconds",
                "How old the figures of this exposition read from the ledger are (store size, counter anomalies, "
                f"series backlog): a scrape waits for them {LEDGER_READ_S:g} s at most, then answers the last ones "
                "read.",
                value=time.monotonic() - read_at)


class _Metrics:
    """The collector's metrics, and ``registry``, what /metrics answers.

    In one process (``shared_dir`` None) the gauges read their values at scrape time. In one worker of several
    (``collector.worker``), a scrape lands on any of them and must describe them all: ``shared_dir`` is
    prometheus_client's multiprocess directory, and this process must have set ``values.ValueClass`` to a
    ``MultiProcessValue`` before this is built. Every process then writes its counters, histogram and gauges to
    files of its own there, and ``registry`` reads all the files (``MultiProcessCollector``): counters and the
    histogram summed over every worker that ever ran (a dead worker's files stay, so a sum never goes back), the
    gauges of one process's state (requests in flight, ingest depth, frozen objects) summed over the live ones
    (``livesum``; the supervisor removes a dead worker's), written as they change (``in_flight``, ``ingest_depth``;
    ``refresh`` for the frozen count), and how long a batch has waited for its commit, the most of the live ones
    (``livemax``, written by ``refresh``). What describes the ledger rather than a process (its size, the counter
    anomalies, the feed) is read at scrape time by whichever worker answers (``ledger``: ``_LedgerReadings``, never
    waiting on the store past a short bound)."""

    def __init__(self, store: Store, feed: Path | None, in_flight: Callable[[], int],
                 ingest_depth: Callable[[], int], commit_wait: Callable[[], float], stalled: Callable[[], bool],
                 user_labels: bool = False, shared_dir: str | Path | None = None) -> None:
        shared = shared_dir is not None
        if shared and not getattr(values.ValueClass, "_multiprocess", False):
            raise ValueError("shared metrics need prometheus_client's multiprocess values: set "
                             "prometheus_client.values.ValueClass = MultiProcessValue() before any metric is built")
        self.registry = CollectorRegistry(auto_describe=True)
        r = None if shared else self.registry  # shared: this process's values are in its files, read from there
        self.accepted = Counter("gpuledger_collector_samples_accepted", "Samples stored and aggregated.", registry=r)
        self.rejected = Counter(
            "gpuledger_collector_samples_rejected",
            "Samples not stored, by reason (duplicate, too_late, invalid, future, forbidden, ...).",
            ["reason"], registry=r,
        )
        self.batches_accepted = Counter("gpuledger_collector_batches_accepted", "Batches committed.", registry=r)
        self.batches_rejected = Counter(
            "gpuledger_collector_batches_rejected", "Requests refused with a 4xx (or 503), by status and reason.",
            ["status", "reason"], registry=r,
        )
        self.deduplicated = Counter(
            "gpuledger_collector_batches_deduplicated", "Batches acknowledged but seen before.", registry=r
        )
        self.errors = Counter("gpuledger_collector_internal_errors", "Requests answered 500.", registry=r)
        self.latency = Histogram(
            "gpuledger_collector_ingest_latency_seconds", "Time to validate, store and commit one batch.", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        # whether batches waiting together share a commit, and how long the ledger takes to make them durable
        self.group_batches = Histogram(
            "gpuledger_collector_group_commit_batches", "Batches in one group commit (one transaction).", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.group_seconds = Histogram(
            "gpuledger_collector_group_commit_seconds",
            "Time one group commit's transaction took, to durable (a slow disk or ledger shows here first).",
            registry=r, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        gauges = (("gpuledger_collector_requests_in_flight", "HTTP requests being handled now.", in_flight),
                  ("gpuledger_collector_ingest_queue_depth",
                   "Ingest requests in flight (validating, waiting for or holding the store).", ingest_depth),
                  ("gpuledger_collector_gc_frozen_objects", "Objects moved out of the garbage collector's full passes "
                   "(collector.gcfreeze); flat unless frozen cycles leak.", gc.get_freeze_count))
        # the ledger stalling shows here (what /healthz answers 503 for): alert on stalled, or on the wait
        waits = (("gpuledger_collector_ledger_commit_wait_seconds", "How long the oldest batch still waiting for its "
                  "commit has waited (0: none waits); past ledger_timeout_s the ledger stalls.", commit_wait),
                 ("gpuledger_collector_ledger_stalled", "1 while a batch has waited for its commit past "
                  "ledger_timeout_s (batches and reads are refused 503, /healthz too), else 0.",
                  lambda: float(stalled())))
        # shared: set by the server as its counts change (and refresh()); None in one process, where they are read
        self.in_flight: Gauge | None = None
        self.ingest_depth: Gauge | None = None
        self._refreshed: list[tuple[Gauge, Callable[[], float]]] = []  # shared: written by refresh()
        if shared:
            MultiProcessCollector(self.registry, str(shared_dir))
            self.in_flight, self.ingest_depth, frozen = (
                Gauge(name, doc, multiprocess_mode="livesum", registry=None) for name, doc, _ in gauges)
            self._refreshed = [(frozen, gauges[2][2]), *(
                (Gauge(name, doc, multiprocess_mode="livemax", registry=None), read) for name, doc, read in waits)]
            self.refresh()
        else:
            for name, doc, read in (*gauges, *waits):
                Gauge(name, doc, registry=r).set_function(read)
        r = self.registry
        r.register(_FeedGauges(feed, user_labels))
        self.ledger = _LedgerReadings(store)
        r.register(self.ledger)

    def observe_group_commit(self, batches: int, seconds: float) -> None:
        """A ``Store.commit_observers`` entry: one group commit of ``batches`` that took ``seconds``."""
        self.group_batches.observe(batches)
        self.group_seconds.observe(seconds)

    def refresh(self) -> None:
        """Shared: writes this process's frozen-object count, which changes in the GC freezer's own thread, and its
        oldest commit's wait, which grows by itself (at each scrape this process answers, and by the worker every few
        seconds)."""
        for gauge, read in self._refreshed:
            gauge.set(read())

    def render(self) -> bytes:
        """The /metrics exposition."""
        self.refresh()
        return generate_latest(self.registry)


def tls_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


HANDLER_THREADS = 32  # endpoints other than ingest at once (reads mostly wait on the store's lock or a remote series)
LOOP_PARSE_BYTES = 64 * 1024  # a batch body up to this size (uncompressed) is validated on the loop: see post_samples
COMMIT_RETRY_S = 0.0005  # how soon the loop tries to commit again after another process had the ledger's write lock
PARSE_THREADS = 4  # larger or compressed bodies are validated in these (CPU work under the GIL: more would not help)
LINGER_S = 2.0  # after an answer that closes, what the client still sends is read (and dropped) this long at most
STOP_GRACE_S = 5.0  # stop() lets requests being handled finish this long (an ingest its commit) before cutting them


class CollectorServer:
    """``start()`` serves in a background thread; ``url`` says where; ``stop()`` shuts down.

    ``auth`` (None or an Authenticator without tokens: open), ``tls`` (an SSLContext: HTTPS),
    ``priority_feed`` (the file GET /api/v1/priority and the fairshare gauges read), ``max_inflight``
    (ingest requests validating or storing at once before 503; a request takes its slot only once its body
    has arrived), ``max_per_host`` (concurrent ingest requests of one node token, or one client address when
    auth is off, before 429, counted from the headers on: slow bodies of one node cannot starve the
    others), ``request_timeout_s`` (headers and body of one request; also a TLS handshake),
    ``idle_timeout_s`` (keep-alive), ``ledger_timeout_s`` (how long a batch waits for its commit, and a read behind
    a commit that stalls, before 503; /healthz answers 503 meanwhile: ``_committed``), ``max_connections`` (open at
    once; beyond, new ones are closed), ``limits`` (what one batch may hold, checked while decoding),
    ``metrics_user_labels`` (publish user names in the fairshare gauges of the open /metrics), ``series`` (where
    GET /api/v1/series reads: the store, or ``collector.victoriametrics.VmSeriesReader``, whose failures are answered
    502/503).

    One of several workers on one port (``collector.worker``): ``reuse_port`` binds with SO_REUSEPORT, so each
    worker has a listening socket of its own on the port and the kernel spreads new connections over them;
    ``metrics_dir`` is the workers' prometheus_client multiprocess directory (see ``_Metrics``). The limits
    (``max_inflight``, ``max_per_host``, ``max_connections``) are then each worker's.

    ``metrics_port``: /metrics also on that port of ``host`` (plain HTTP, GET /metrics only; 0: any free port), served
    by threads of its own (:class:`_MetricsListener`), so a scrape is answered while the event loop is saturated (a
    fleet reconnecting after a restart), when an operator most needs to look.
    """

    def __init__(
        self,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = MAX_BODY_BYTES,
        clock: Callable[[], float] = time.time,
        auth: Authenticator | None = None,
        tls: ssl.SSLContext | None = None,
        priority_feed: Path | None = None,
        max_inflight: int = 256,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        audit_log: AuditLog | None = None,
        ledger_timeout_s: float = LEDGER_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_per_host: int = MAX_PER_HOST,
        max_connections: int = MAX_CONNECTIONS,
        limits: Limits = DEFAULT_LIMITS,
        metrics_user_labels: bool = False,
        max_series_points: int = MAX_SERIES_POINTS,
        max_page: int = MAX_PAGE,
        series: SeriesReader | None = None,
        reuse_port: bool = False,
        metrics_dir: str | Path | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.store = store
        self.series = store if series is None else series  # GET /api/v1/series reads this (series_url: VictoriaMetrics)
        self._audit = audit_log  # None: the data dir's log, opened at the first POST /api/v1/jobs
        self._audit_lock = threading.Lock()
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.auth = auth or Authenticator()
        self.priority_feed = priority_feed
        self.max_inflight = max_inflight
        self.max_per_host = max_per_host
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.ledger_timeout_s = ledger_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_series_points = max_series_points
        self.max_page = max_page
        self.limits = limits if max_body_bytes == MAX_BODY_BYTES else replace(limits, max_body_bytes=max_body_bytes)
        # Counts and connections are touched on the loop thread only; the gauges read them from a handler thread.
        self._in_flight_n = 0  # _in_flight
        self._ingesting_n = 0  # _ingesting
        self._per_host: dict[str, int] = {}
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # requests being handled
        # when the first of _committing was handed in (None: none waits); written on the loop, read by any thread
        self._oldest_commit_at: float | None = None
        self.metrics = _Metrics(store, priority_feed, lambda: self._in_flight, lambda: self._ingesting,
                                self._commit_wait_s, lambda: self._ledger_stall() is not None, metrics_user_labels,
                                shared_dir=metrics_dir)
        store.commit_observers.append(self.metrics.observe_group_commit)  # removed by stop()
        self._tls = tls
        # Bound here, as before serving: `url` is known at once, and connections made before the loop runs wait
        # in the backlog.
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG, reuse_port=reuse_port)
        self._address = self._sock.getsockname()[:2]
        self._render_lock = threading.Lock()  # one scrape renders at a time, whichever port it came on
        self._metrics_listener = None if metrics_port is None else _MetricsListener(
            (host, metrics_port), self._render_metrics, reuse_port)
        self._handlers = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="collector-handler")
        self._parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="collector-parse")
        # /metrics renders here, never behind reads that wait on the store in the handler pool
        self._scrapes = ThreadPoolExecutor(1, thread_name_prefix="collector-metrics")
        self._commit_inline = store.db.dialect == SQLITE  # see _ingest
        self._waiting: list[tuple[Batch, asyncio.Future[IngestResult]]] = []  # batches for the next inline commit
        # batches handed to a commit, until it settles (on the loop; in arrival order): commit -> (time.monotonic()
        # handed in, the request's answer, the batch); and the timer that answers those past ledger_timeout_s
        self._committing: dict[asyncio.Future[IngestResult],
                               tuple[float, asyncio.Future[IngestResult], Batch]] = {}
        self._commit_timer: asyncio.TimerHandle | None = None
        self._loop = _new_loop()
        self._loop.set_exception_handler(_loop_error)
        self._stop_requested = self._loop.create_future()
        self._listener: asyncio.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._runner: threading.Thread | None = None  # the thread running the loop
        self._loop_done = threading.Event()
        self._shut = False
        self._thread: threading.Thread | None = None

    # Requests being handled, and ingest requests among them (the metrics' gauges). One worker of several writes
    # each change to its shared gauge: the other workers' scrapes read it from there.
    @property
    def _in_flight(self) -> int:
        return self._in_flight_n

    @_in_flight.setter
    def _in_flight(self, n: int) -> None:
        self._in_flight_n = n
        if self.metrics.in_flight is not None:
            self.metrics.in_flight.set(n)

    @property
    def _ingesting(self) -> int:
        return self._ingesting_n

    @_ingesting.setter
    def _ingesting(self, n: int) -> None:
        self._ingesting_n = n
        if self.metrics.ingest_depth is not None:
            self.metrics.ingest_depth.set(n)

    @property
    def url(self) -> str:
        host, port = self._address
        return f"{'https' if self._tls else 'http'}://{host}:{port}"

    @property
    def metrics_url(self) -> str | None:
        """The dedicated /metrics listener's URL (``metrics_port``); None without one."""
        if self._metrics_listener is None:
            return None
        host, port = self._metrics_listener.socket.getsockname()[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> CollectorServer:
        self._thread = threading.Thread(target=self._run, name="collector-http", daemon=True)
        self._runner = self._thread
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serves in this thread until stop() (from another thread) or until a SIGINT or SIGTERM handler raises
        (the CLI's raise KeyboardInterrupt); after that, stop() finishes the shutdown here."""
        self._runner = threading.current_thread()
        with _signals_on_loop(self._loop):
            self._run()

    def stop(self) -> None:
        """Closes the listener and every connection and joins the serving thread: requests being handled get
        STOP_GRACE_S to finish (a batch its commit, or its 503 at ledger_timeout_s), then what still waits is
        answered 503 (``stopping``). It never waits for the ledger beyond that: a commit still in progress goes on in
        the store, whose ``close`` bounds it."""
        if self._loop.is_closed():
            return
        if self._runner is not None and self._runner is not threading.current_thread():
            self._loop.call_soon_threadsafe(self._request_stop)
            self._loop_done.wait(STOP_GRACE_S + 5)
        elif self._serving is not None and not self._serving.done():  # serve_forever was interrupted here
            self._request_stop()
            self._loop.run_until_complete(self._serving)
        else:  # never served, or the serving task ended by an exception of its own
            self._loop.run_until_complete(self._shutdown())
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()
        if self._audit is not None:
            self._audit.close()
        if self._metrics_listener is not None:
            self._metrics_listener.close()
        with contextlib.suppress(ValueError):  # (stopped before)
            self.store.commit_observers.remove(self.metrics.observe_group_commit)

    def _run(self) -> None:
        _raise_open_files_limit()
        if self._metrics_listener is not None:
            threading.Thread(target=self._metrics_listener.serve_forever, name="collector-metrics-listener",
                             daemon=True).start()
        self._serving = self._loop.create_task(self._serve())
        try:
            self._loop.run_until_complete(self._serving)
        finally:
            self._loop_done.set()

    async def _serve(self) -> None:
        self._listener = await self._loop.create_server(
            lambda: _Connection(self), sock=self._sock, backlog=LISTEN_BACKLOG, ssl=self._tls,
            # a slow or silent client's handshake cannot hold its connection longer than a request may take
            ssl_handshake_timeout=self.request_timeout_s if self._tls else None)
        await self._stop_requested
        await self._shutdown()

    def _request_stop(self) -> None:
        if not self._stop_requested.done():
            self._stop_requested.set_result(None)

    async def _shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True  # from now on every answer closes its connection
        if self._listener is not None:
            self._listener.close()
        else:
            self._sock.close()
        for conn in list(self._connections):
            if not conn.busy:
                conn.abort()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for conn in list(self._connections):
            conn.abort()
        if self._listener is not None:
            await self._listener.wait_closed()
        for pool in (self._handlers, self._parsers, self._scrapes):
            pool.shutdown(wait=False, cancel_futures=True)

    # -- the request's way to its endpoint (on the loop) ------------------------------------------------------
    def _hold_node(self, principal: Principal | None) -> str | None:
        """Counts an ingest request against its node from its headers on (until it is answered): one node's slow
        bodies cannot take every slot. Without auth there is no node to count by (behind NAT or a proxy one
        address is many nodes); the request deadline still bounds them. BatchError 429 beyond max_per_host."""
        if principal is None or principal.role != "node":
            return None
        who = principal.name
        held = self._per_host.get(who, 0)
        if held >= self.max_per_host:
            raise BatchError(429, f"{held} ingest requests of {who} in flight (limit {self.max_per_host}); "
                             "retry later", "overloaded")
        self._per_host[who] = held + 1
        return who

    def _release_node(self, who: str) -> None:
        left = self._per_host.pop(who) - 1
        if left:
            self._per_host[who] = left

    async def _answer(self, name: str, req: Request) -> tuple[Reply, bytes]:
        """Runs endpoint ``name``: a coroutine endpoint on the loop, any other in the handler pool, where its
        answer is encoded too (a page of 10,000 rows is milliseconds of JSON the loop should not spend)."""
        endpoint = getattr(self, name)
        if inspect.iscoroutinefunction(endpoint):
            return _encode(await endpoint(req), name)
        answer = self._loop.run_in_executor(self._handlers, lambda: _encode(endpoint(req), name))
        wait = self.ledger_timeout_s
        while True:  # an endpoint waits on the store's lock: behind a commit that stalls, ledger_timeout_s at most
            try:
                return await asyncio.wait_for(asyncio.shield(answer), wait)
            except TimeoutError:
                if answer.done():  # done in the turn the wait ran out (or the endpoint's own TimeoutError)
                    return answer.result()
                stalled = self._ledger_stall()
                if stalled is not None:
                    answer.cancel()  # (one still queued never runs; a running one finishes unheard)
                    raise BatchError(503, stalled, "ledger_stalled") from None
                # a slow read, or a commit not yet overdue: look again when the oldest commit would be
                waited = self._commit_wait_s()
                wait = max(self.ledger_timeout_s - waited, 0.01) if waited else self.ledger_timeout_s

    def _refusal(self, e: AuthError | BatchError) -> Reply:
        """The answer to a refused request, counted by status and reason."""
        m = self.metrics
        if isinstance(e, AuthError):
            m.batches_rejected.labels(str(e.status), "unauthorized" if e.status == 401 else "forbidden").inc()
            headers = {"WWW-Authenticate": 'Bearer realm="gpuledger"'} if e.status == 401 else {}
            return Reply(e.status, {"error": e.message}, headers=headers)
        m.batches_rejected.labels(str(e.status), e.reason).inc()
        if e.samples:
            m.rejected.labels(e.reason).inc(e.samples)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
        if e.status == 507:
            headers = {"Retry-After": "30"}
        # reason: machine-readable (an agent keeps a "future" batch: its clock, not the batch, is wrong); job: the
        # index of the job record refused (an agent sends the batch again without it)
        answer: dict[str, object] = {"error": e.message, "reason": e.reason}
        if e.job is not None:
            answer["job"] = e.job
        return Reply(e.status, answer, headers=headers)

    # -- endpoints ----------------------------------------------------------------------------
    async def post_samples(self, req: Request) -> Reply:
        host = req.principal.name if req.principal is not None else None
        body = req.read_body()  # arrived in full under the request deadline; no ingest slot was held meanwhile
        t0 = time.perf_counter()
        stalled = self._ledger_stall()
        if stalled is not None:  # refused before it is parsed or queued: a stall does not fill memory with batches
            raise BatchError(503, stalled, "ledger_stalled")
        if self._ingesting >= self.max_inflight:
            raise BatchError(503, f"{self._ingesting} ingest requests in flight (limit {self.max_inflight}); "
                             "retry later", "overloaded")
        self._ingesting += 1
        try:
            # Validation is CPU work wherever it runs (the GIL). On the loop it costs least for the fleet's pushes:
            # at 2,000 nodes (bench/http_layer.py) 0.41 ms of CPU per request and a p99 of 2.1-2.4 ms, against
            # 0.50 ms and 2.8-3.1 ms when handed to a thread. A large or compressed body goes to a thread all the
            # same: a 20,000-sample JSON batch takes 30 ms to validate, which the loop would take from every
            # connection, and a compressed body's decoded size is known only once decoded.
            encoding = req.headers.get("Content-Encoding", "")
            parse = functools.partial(parse_batch, body, req.headers.get("Content-Type", "application/json"),
                                      self.clock(), None, encoding, allowed_host=host, limits=self.limits,
                                      allowed_cluster=None if req.principal is None else req.principal.cluster)
            if len(body) <= LOOP_PARSE_BYTES and not encoding:
                batch = parse()
            else:
                batch = await self._loop.run_in_executor(self._parsers, parse)
            result = await self._ingest(batch)
        finally:
            self._ingesting -= 1
        self.metrics.latency.observe(time.perf_counter() - t0)  # (what it stored is counted by _commit_settled)
        answer = {
            "accepted": result.accepted,
            "duplicate": result.duplicate_batch,
            "duplicate_samples": result.duplicate_samples,
            "too_late": result.too_late,
        }
        if result.too_late:
            # Never a 200 for samples not stored: the agent counts this batch as refused (and logs it). The
            # batch's other samples are stored, and its key recorded, so a resend is a duplicate.
            return Reply(422, {**answer, "reason": "too_late", "error": (
                f"{result.too_late} sample(s) of batch agent_id={batch.agent_id!r} seq={batch.seq} are behind their "
                f"GPU's aggregation window ({self.store.agg.window_s:g} s before its newest sample) and were not "
                f"stored; {result.accepted} were (is this node's clock behind?)")})
        return Reply(200, answer)

    async def _ingest(self, batch: Batch) -> IngestResult:
        """Stores one parsed batch durably: in a group commit, awaited until it is durable. On an embedded
        (SQLite) ledger the loop itself commits the batches that arrived since its last commit, once the requests
        being read have been read (``_commit_waiting``): a hand-off to another thread costs more CPU than the
        commit saves by overlapping, and two threads take turns at the GIL. A PostgreSQL ledger's commit waits on
        the network, so the store's committer thread does it (``Store.submit``). The request waits for it
        ``ledger_timeout_s`` at most (``_committed``)."""
        with _write_refusals(batch.n_samples):
            try:
                if not self._commit_inline:
                    return await self._committed(asyncio.wrap_future(self.store.submit(batch), loop=self._loop),
                                                 batch)
                done: asyncio.Future[IngestResult] = self._loop.create_future()
                self._waiting.append((batch, done))
                if len(self._waiting) == 1:
                    self._loop.call_soon(self._commit_waiting)
                return await self._committed(done, batch)
            except BatchRefused as e:  # 409: its key was stored with other content; 422: too many GPUs
                raise BatchError(409 if e.reason == "conflict" else 422, str(e), e.reason, batch.n_samples) from None

    def _committed(self, commit: asyncio.Future[IngestResult], batch: Batch) -> asyncio.Future[IngestResult]:
        """The request's answer for ``batch``: ``commit``'s outcome, or once the batch has waited ledger_timeout_s for
        it a 503 (``_commits_overdue``); one timer for every request, not one each (ingest's hot path).

        The commit goes on after that 503. It may still store the batch: its key is stored with it, so the agent's
        resend (the same body) is answered as a duplicate, and the batch is counted once, as committed
        (``_commit_settled``: the samples counters count what the ledger committed, whenever it did, answered or not).
        Or it fails, and the resend stores it.
        Nothing is answered 2xx before its commit is durable. Not PostgreSQL's statement_timeout: cancelling a COMMIT
        that waits for a synchronous standby leaves it committed on the primary, not replicated, and reports success
        (a warning only), so the batch would be acknowledged without the copy on the standby that HA relies on."""
        answer: asyncio.Future[IngestResult] = self._loop.create_future()
        now = time.monotonic()
        if not self._committing:
            self._oldest_commit_at = now
        self._committing[commit] = (now, answer, batch)
        commit.add_done_callback(self._commit_settled)
        if self._commit_timer is None:
            self._commit_timer = self._loop.call_later(self.ledger_timeout_s, self._commits_overdue)
        return answer

    def _commit_settled(self, commit: asyncio.Future[IngestResult]) -> None:
        """``commit`` is durable, or failed: what it stored is counted (answered or not: a batch answered 503 whose
        commit went in is counted here, once; its resend is a duplicate), and its request gets the outcome, unless it
        was answered 503 meanwhile."""
        _, answer, _ = self._committing.pop(commit)
        oldest = next(iter(self._committing.values()), None)
        self._oldest_commit_at = None if oldest is None else oldest[0]
        if not commit.cancelled() and commit.exception() is None:
            self._count_committed(commit.result())
        if answer.done():  # answered 503 already, or its request is gone (the server stops): no one waits for it
            if not commit.cancelled():
                commit.exception()  # (retrieved: asyncio would log an outcome no one read)
        elif commit.cancelled():
            answer.cancel()
        elif (exc := commit.exception()) is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(commit.result())

    def _count_committed(self, result: IngestResult) -> None:
        m = self.metrics
        if result.duplicate_batch:
            m.deduplicated.inc()
        else:
            m.batches_accepted.inc()
        m.accepted.inc(result.accepted)
        if result.duplicate_samples:
            m.rejected.labels("duplicate").inc(result.duplicate_samples)
        if result.too_late:
            m.rejected.labels("too_late").inc(result.too_late)

    def _commits_overdue(self) -> None:
        """Answers 503 every request whose batch has waited ledger_timeout_s for its commit; runs again when the next
        one's time is up."""
        self._commit_timer = None
        now, late = time.monotonic(), 0
        for since, answer, batch in self._committing.values():  # in arrival order
            if answer.done():  # answered before (its commit is still on)
                continue
            if since + self.ledger_timeout_s > now + 0.001:  # (a timer may fire within the loop clock's millisecond)
                self._commit_timer = self._loop.call_later(since + self.ledger_timeout_s - now, self._commits_overdue)
                break
            late += 1
            answer.set_exception(BatchError(  # (no samples counted as refused: the commit may yet store them)
                503, f"the ledger did not commit batch agent_id={batch.agent_id!r} seq={batch.seq} within "
                f"ledger_timeout_s = {self.ledger_timeout_s:g} s; retry later (if it commits meanwhile, the resend is "
                "answered as a duplicate)", "ledger_timeout"))
        if late:
            log.error("%d batch(es) waited %g s for their commit (the ledger stalls?): answered 503", late,
                      self.ledger_timeout_s)

    def _commit_wait_s(self) -> float:
        """How long the oldest batch still waiting for its commit has waited; 0 when none waits. Any thread."""
        since = self._oldest_commit_at
        return 0.0 if since is None else max(time.monotonic() - since, 0.0)

    def _ledger_stall(self) -> str | None:
        """Why requests are refused while the oldest batch still waiting for its commit has waited past
        ledger_timeout_s (the ledger stalls: a synchronous standby gone, a link gone silent); None otherwise. Any
        thread (the stalled gauge)."""
        waited = self._commit_wait_s()
        if waited <= self.ledger_timeout_s:
            return None
        return (f"the ledger has not committed a batch for {waited:.0f} s (ledger_timeout_s = "
                f"{self.ledger_timeout_s:g} s); retry later")

    def _commit_waiting(self) -> None:
        """One group commit (on the loop) of every batch waiting; settles their futures. While another process
        commits into the ledger (workers sharing a SQLite file), the loop serves on and tries again shortly."""
        if not self.store.ready_to_commit():
            self._loop.call_later(COMMIT_RETRY_S, self._commit_waiting)
            return
        waiting, self._waiting = self._waiting, []
        outcomes = self.store.ingest_group([batch for batch, _ in waiting])
        for (_, done), outcome in zip(waiting, outcomes):
            if done.done():  # (settled only here; its request waits on an answer of its own: _committed)
                continue
            if isinstance(outcome, Exception):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

    def post_jobs(self, req: Request) -> Reply:
        records = parse_jobs(req.read_body(), req.headers.get("Content-Type", "application/json"),
                             self.limits.max_body_bytes, req.headers.get("Content-Encoding", ""))
        with _write_refusals():  # the ledger's or the audit log's disk full, the ledger away: as for samples
            with self._audit_lock:
                if self._audit is None:
                    # the embedded store's directory; a PostgreSQL ledger has none: its server is given audit_log
                    assert self.store.path is not None, "a server on a PostgreSQL ledger needs audit_log"
                    self._audit = open_log(self.store.path.parent)
                audit = self._audit
            # in the audit log before it is stored, so before it is charged; as stored (merged with what was there)
            changed = self.store.put_jobs(records, before_store=lambda merged: record_job_records(audit, merged))
        return Reply(200, {"received": len(records), "changed": changed})

    def get_jobs(self, req: Request) -> Reply:
        _only(req.query, "limit", "offset")
        offset, limit = self._page_range(req)
        records, total = self.store.jobs_page(offset, limit)
        return self._page([j.to_dict() for j in records], total, offset, limit)

    def get_usage(self, req: Request) -> Reply:
        _only(req.query, "job", "per_gpu", "limit", "offset")
        job = _text(req.query, "job")
        per_gpu = _flag(req.query, "per_gpu")
        offset, limit = self._page_range(req)
        usage, total = self.store.job_usage_page(job, per_gpu, offset, limit)
        return self._page([u.to_dict() for u in usage], total, offset, limit)

    def _page_range(self, req: Request) -> tuple[int, int]:
        """(``offset``, ``limit``) of a paged answer; ``limit`` at most max_page. The store reads only that page."""
        limit = _int(req.query, "limit", self.max_page)
        if not 0 < limit <= self.max_page:
            raise BatchError(400, f"query parameter 'limit' must be 1..{self.max_page}, got {limit}")
        return _int(req.query, "offset", 0), limit

    @staticmethod
    def _page(page: list[Any], total: int, offset: int, limit: int) -> Reply:
        """One page of rows; ``X-Total-Count`` says how many there are and ``X-Next-Offset`` where the next page
        starts, when there is one."""
        headers = {"X-Total-Count": str(total)}
        if offset + limit < total:
            headers["X-Next-Offset"] = str(offset + limit)
        return Reply(200, page, headers=headers)

    def get_totals(self, req: Request) -> Reply:
        _only(req.query, "start", "end")
        start, end = _float(req.query, "start"), _float(req.query, "end")
        _query_range(start, end)
        return Reply(200, self.store.totals(start, end))

    def get_series(self, req: Request) -> Reply:
        """One GPU's samples or rollup buckets in [start, end]; the store picks the tier by range and retention.

        An answer never holds more than ``max_series_points`` points: a range that would (raw samples without a
        step over more than that many seconds, or a step too fine for the range) is answered in buckets of
        (end - start) / (max_series_points - 1) seconds (each point says its step)."""
        _only(req.query, "host", "uuid", "start", "end", "step", "mig")
        host, uuid = _text(req.query, "host"), _text(req.query, "uuid")
        start, end = _float(req.query, "start"), _float(req.query, "end")
        if not host or not uuid or start is None or end is None:
            raise BatchError(400, "series needs the query parameters host, uuid, start and end (unix seconds)")
        step = _query_range(start, end, _float(req.query, "step"))
        mig = _text(req.query, "mig")
        # buckets are aligned to multiples of the step, so [start, end] meets up to (end - start) / step + 2 of them:
        # at this step no more than max_series_points
        # (in whole milliseconds, up: the series databases' resolution, so that they answer the same buckets)
        coarsest = max(math.ceil((end - start) / max(self.max_series_points - 1, 1) * 1000) / 1000, MIN_QUERY_STEP_S)
        if step is not None:
            step = max(step, coarsest)
        elif end - start > self.max_series_points:  # raw samples (1 Hz or more) would exceed the limit
            step = coarsest
        try:
            points = self.series.series(host, uuid, start, end, step=step, mig=mig)
            if step is None and len(points) > self.max_series_points:  # raw samples denser than the limit allows
                points = self.series.series(host, uuid, start, end, step=coarsest * 1.0001, mig=mig)
        except SeriesUnavailable as e:  # VictoriaMetrics away (503) or answering an error (502)
            return Reply(e.status, {"error": str(e), "reason": "series_unavailable"},
                         headers={"Retry-After": "5"} if e.status == 503 else {})
        return Reply(200, [p.to_dict() for p in points[:self.max_series_points]])

    def get_priority(self, req: Request) -> Reply:
        if self.priority_feed is None:
            return Reply(404, {"error": "no priority feed configured for this collector"})
        try:
            return Reply(200, read_feed(self.priority_feed))
        except FileNotFoundError:
            return Reply(404, {"error": f"no priority feed at {self.priority_feed} yet: accounting writes it "
                                        "(`gpuledger priority feed --data-dir <data-dir>`)"})
        except FeedError as e:
            return Reply(503, {"error": str(e)})

    def get_openapi(self, req: Request) -> Reply:
        return Reply(200, openapi_document())

    async def get_metrics(self, req: Request) -> Reply:
        """In a thread of its own, not the handler pool (whose threads may all wait on the store behind a stalled
        commit); what it reads of the ledger it waits for a moment at most (``_LedgerReadings``): /metrics answers
        during a stall, when it is looked at."""
        return Reply(200, await self._loop.run_in_executor(self._scrapes, self._render_metrics), CONTENT_TYPE_LATEST)

    def _render_metrics(self) -> bytes:
        with self._render_lock:
            return self.metrics.render()

    async def get_health(self, req: Request) -> Reply:
        """200; 503 while a batch has waited for its commit past ledger_timeout_s (``_ledger_stall``), until that
        commit ends. On the loop: it waits for neither the store nor a handler thread."""
        stalled = self._ledger_stall()
        if stalled is not None:
            return Reply(503, {"status": "unavailable", "reason": "ledger_stalled", "error": stalled},
                         headers={"Retry-After": "1"})
        return Reply(200, {"status": "ok"})


# -- the transport ---------------------------------------------------------------------------------------------
_METHODS = sorted({m for m, _ in ROUTES})
_PHRASES = {s.value: s.phrase for s in HTTPStatus}
_IDLE, _HEAD, _BODY, _BUSY = "idle", "head", "body", "busy"  # where a connection is in its current request


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # optional: the standard loop serves the same, at about twice the CPU per request
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Failed TLS handshakes and clients that vanish lose their connection, not the server: a debug line, no
    traceback."""
    exc = context.get("exception")
    if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
        log.debug("%s: %s", context.get("message"), exc)
    else:
        loop.default_exception_handler(context)


@contextlib.contextmanager
def _signals_on_loop(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """SIGINT's and SIGTERM's Python handlers called by the loop between its callbacks, not wherever the signal
    lands: a KeyboardInterrupt they raise then stops the loop, where inside a connection's callback uvloop would
    take it for that connection's failure (and the signal would be lost)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    moved = {sig: h for sig, h in handlers.items() if callable(h)}
    for sig, handler in moved.items():
        loop.add_signal_handler(sig, handler, sig, None)
    try:
        yield
    finally:
        for sig, handler in moved.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def _raise_open_files_limit() -> None:
    """A connection per node is a file descriptor per node: the soft limit (often 1,024) goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, e)


def _encode(reply: Reply, what: str) -> tuple[Reply, bytes]:
    p = reply.payload
    try:  # NaN/Infinity are not JSON: a value like that is a bug, answered as one
        return reply, p if isinstance(p, bytes) else json.dumps(p, allow_nan=False).encode()
    except ValueError:
        log.exception("answer of %s is not JSON", what)
        reply = Reply(500, {"error": "internal error: the answer is not representable as JSON"})
        return reply, json.dumps(reply.payload).encode()


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> str:
    return formatdate(second, usegmt=True)


def _response(reply: Reply, body: bytes, close: bool) -> bytes:
    """Status line, headers and body in one buffer: one write, so no part waits for the ACK of another."""
    lines = [f"HTTP/1.1 {reply.status} {_PHRASES.get(reply.status, '')}", "Server: gpuledger-collector",
             f"Date: {_http_date(int(time.time()))}", f"Content-Type: {reply.content_type}",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in reply.headers.items()]
    if close:
        lines.append("Connection: close")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1") + body


def _head_end(tail: bytes, data: bytes, pos: int) -> int:
    """Where in ``data`` the head that ``tail`` (its last bytes so far) ends, just past its blank line; -1: not yet."""
    if tail:  # the blank line may straddle two reads
        i = (tail + data[pos:pos + 3]).find(b"\r\n\r\n")
        if i >= 0:
            return pos + i + 4 - len(tail)
    i = data.find(b"\r\n\r\n", pos)
    return i + 4 if i >= 0 else -1


class _Incoming:
    """What has arrived of one request."""

    __slots__ = ("url", "fields", "head_bytes", "tail", "head_done", "method", "path", "query", "headers", "name",
                 "principal", "keep_alive", "body", "body_left", "counted", "node")

    def __init__(self) -> None:
        self.url = bytearray()
        self.fields: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.tail = b""
        self.head_done = False
        self.method = self.path = self.query = self.name = ""
        self.headers = Message()
        self.principal: Principal | None = None
        self.keep_alive = True
        self.body: list[bytes] = []
        self.body_left = 0
        self.counted = False  # in the requests-in-flight gauge
        self.node: str | None = None  # counted against this node's max_per_host


SCRAPE_TIMEOUT_S = 10.0  # a metrics-port connection silent this long is closed
MAX_SCRAPES = 8  # metrics-port connections served at once; more are closed at once (no scraper needs more)


class _MetricsListener(ThreadingHTTPServer):
    """GET /metrics on a port of its own (``CollectorServer(metrics_port=...)``), a thread per connection: nothing
    here waits for the event loop, whose queue a saturated collector lets grow to seconds. Anything but GET /metrics
    is 404. Bounded: at most MAX_SCRAPES connections (threads) at once, each closed after SCRAPE_TIMEOUT_S of
    silence."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], render: Callable[[], bytes], reuse_port: bool) -> None:
        self.render = render
        self.reuse_port = reuse_port
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(address, _MetricsHandler)
        self._served = threading.Event()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_bind(self) -> None:
        if self.reuse_port:  # each worker of several binds the one metrics port, as it binds the collector's
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._served.set()
        super().serve_forever(poll_interval)

    def close(self) -> None:
        if self._served.is_set():
            self.shutdown()
        self.server_close()


class _MetricsHandler(BaseHTTPRequestHandler):
    server: _MetricsListener
    timeout = SCRAPE_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if urlsplit(self.path).path != "/metrics":
            body, status, kind = b'{"error": "only GET /metrics is served on this port"}\n', 404, "application/json"
        else:
            try:
                body, status, kind = self.server.render(), 200, CONTENT_TYPE_LATEST
            except Exception:  # a scrape's failure is its own: logged, answered 500, the listener serves on
                log.exception("GET /metrics on the metrics port failed")
                body, status, kind = b'{"error": "internal error"}\n', 500, "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass  # a scrape every 15 s is not news


class _Connection(asyncio.Protocol):
    """One client connection, one request at a time.

    httptools parses each request's head (a parser per request, fed up to the head's blank line, never
    beyond); the body is framed here by Content-Length. Once a request is complete, reading pauses until it is
    answered: what arrived beyond it (pipelined requests) waits in ``pending``, so a connection never holds
    more than one read beyond the request being handled. Two clocks: ``idle_timeout_s`` between requests, then
    ``request_timeout_s`` from a request's first byte to its last."""

    transport: asyncio.Transport  # from connection_made on, before any other call

    def __init__(self, server: CollectorServer) -> None:
        self.server = server
        self.loop = server._loop
        self.peer = "?"
        self.state = _IDLE
        self.rq = _Incoming()
        self.parser = httptools.HttpRequestParser(self)
        self.pending = b""
        self.timer: asyncio.TimerHandle | None = None
        self.reading = self.writable = True
        self.eof = False  # the client sends no more
        self.closing = False

    @property
    def busy(self) -> bool:
        """A complete request is being handled (its answer is still to be written)."""
        return self.state is _BUSY

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if peer else "?"
        server = self.server
        if len(server._connections) >= server.max_connections:  # the agent retries; the others keep their slots
            log.warning("%d connections open (limit %d): closing a new one from %s", len(server._connections),
                        server.max_connections, self.peer)
            self.close()
            return
        server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # asyncio and uvloop set it on TCP already; a response must never wait for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm(server.idle_timeout_s, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server._connections.discard(self)
        self._disarm()
        if not self.busy:  # a request cut short gives its counts back; one being handled does when answered
            self._settle(self.rq)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.busy:  # what a transport delivers just after pause_reading
            self.pending += data
            return
        self._consume(data)

    def eof_received(self) -> bool:
        """The client sends no more (it may still read): what it sent is answered, a body cut short with a 400,
        then the connection closes. Over TLS the transport closes at once, whatever this returns."""
        if self.closing:
            return False
        self.eof = True
        if not self.busy:
            self._end_of_input()
        return self.server._tls is None

    def pause_writing(self) -> None:  # the client is not reading its answers: read no more of its requests
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        if self.state is _IDLE and not self.reading:
            self._read_on()

    # -- httptools callbacks (they only record: the decisions are taken once the parser returns)
    def on_url(self, url: bytes) -> None:
        self.rq.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.rq.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.rq.head_done = True

    # -- reading
    def _consume(self, data: bytes) -> None:
        pos = 0
        while pos < len(data) and not self.busy and not self.closing:
            if self.state is _IDLE:  # a request's first byte: its deadline replaces the idle clock
                self.state = _HEAD
                self._arm(self.server.request_timeout_s, self._deadline_passed)
            pos = self._feed_head(data, pos) if self.state is _HEAD else self._feed_body(data, pos)
        if self.closing:
            return
        if pos < len(data):
            self.pending = data[pos:]
        if self.eof and not self.busy:
            self._end_of_input()
        elif self.state is _IDLE:
            self._arm(self.server.idle_timeout_s, self._idle_expired)

    def _end_of_input(self) -> None:
        rq = self.rq
        if self.state is _BODY:
            got = sum(map(len, rq.body))
            error = BatchError(400, f"body ended after {got} of {got + rq.body_left} bytes", "malformed")
            self._refuse(self.server._refusal(error), True)
        elif not self.closing:
            self.close()

    def _feed_head(self, data: bytes, pos: int) -> int:
        rq = self.rq
        end = _head_end(rq.tail, data, pos)
        stop = len(data) if end < 0 else end
        rq.head_bytes += stop - pos
        if rq.head_bytes > MAX_HEAD_BYTES:
            self._refuse(Reply(431, {"error": f"request line and headers exceed {MAX_HEAD_BYTES} bytes"}), True)
            return stop
        chunk = data[pos:stop]
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserCallbackError as e:  # our callbacks only record: what they raised is ours
            raise (e.__context__ or e) from None
        except httptools.HttpParserUpgrade:  # Upgrade or CONNECT: the head is parsed; the upgrade is ignored
            pass
        except httptools.HttpParserError as e:
            self._refuse(Reply(400, {"error": f"malformed request: {e}"}), True)
            return stop
        if rq.head_done:
            self._on_head()
        elif end < 0:
            rq.tail = (rq.tail + chunk[-3:])[-3:]
        else:  # a blank line before the request line (RFC 9112 2.2 lets a server skip it)
            rq.tail = b""
        return stop

    def _feed_body(self, data: bytes, pos: int) -> int:
        rq = self.rq
        stop = min(len(data), pos + rq.body_left)
        rq.body.append(data[pos:stop])
        rq.body_left -= stop - pos
        if not rq.body_left:
            self._dispatch()
        return stop

    def _on_head(self) -> None:
        """The head has arrived: refuse what the head alone settles (leaving the body unread), else read the body."""
        rq, server = self.rq, self.server
        rq.method = self.parser.get_method().decode()
        rq.keep_alive = self.parser.should_keep_alive()
        self.parser = httptools.HttpRequestParser(self)  # the next request's head starts afresh
        if len(rq.fields) > MAX_HEADERS:
            return self._refuse(Reply(431, {"error": f"more than {MAX_HEADERS} header fields"}), True)
        if len(rq.url) > MAX_URL_BYTES:
            return self._refuse(Reply(414, {"error": f"URL longer than {MAX_URL_BYTES} bytes"}), True)
        h = rq.headers
        for name, value in rq.fields:
            h[name.decode("latin-1")] = value.decode("latin-1")
        url = urlsplit(rq.url.decode("latin-1"))
        rq.path, rq.query = url.path, url.query
        # A refused request's body is left unread: the connection cannot go on after it.
        close = rq.method == "POST" or "Transfer-Encoding" in h or int(h.get("Content-Length") or 0) > 0
        if rq.method not in _METHODS:
            allowed = ", ".join(_METHODS)
            # a HEAD answer never carries a body
            payload = b"" if rq.method == "HEAD" else {"error": f"method {rq.method} not supported; use {allowed}"}
            return self._refuse(Reply(405, payload, headers={"Allow": allowed}), True)
        route = ROUTES.get((rq.method, rq.path))
        if route is None:
            allowed = ", ".join(sorted(m for m, p in ROUTES if p == rq.path))
            if allowed:
                reply = Reply(405, {"error": f"{rq.method} not allowed on {rq.path}; use {allowed}"},
                              headers={"Allow": allowed})
            else:
                reply = Reply(404, {"error": f"no such endpoint: {rq.method} {rq.path}"})
            return self._refuse(reply, close)
        rq.name, access = route
        rq.counted = True
        server._in_flight += 1
        try:
            rq.principal = server.auth.authorize(h.get("Authorization"), access, f"{rq.method} {rq.path}")
            if rq.name == "post_samples":
                rq.node = server._hold_node(rq.principal)
            rq.body_left = self._body_length()
        except (AuthError, BatchError) as e:
            return self._refuse(server._refusal(e), close)
        if not rq.body_left:
            return self._dispatch()
        if h.get("Expect", "").lower() == "100-continue":  # curl waits a second for this before a large body
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.state = _BODY

    def _body_length(self) -> int:
        """The body's length, from the head alone: 411 without Content-Length on a POST or for a chunked body, 413
        above the limit (refused before a byte of the body is kept)."""
        h = self.rq.headers
        if "Transfer-Encoding" in h:
            raise BatchError(411, "chunked bodies are not accepted: send Content-Length", "malformed")
        length = h.get("Content-Length")
        if length is None:
            if self.rq.method == "POST":
                raise BatchError(411, "Content-Length required", "malformed")
            return 0
        n = int(length)  # httptools has checked that it is a number
        limit = self.server.limits.max_body_bytes
        if n > limit:
            raise BatchError(413, f"body of {n} bytes exceeds the limit of {limit}", "too_large")
        return n

    # -- answering
    def _dispatch(self) -> None:
        """The request is complete: on to its endpoint; nothing more is read until it is answered."""
        self.state = _BUSY
        self._disarm()
        if self.reading:
            self.transport.pause_reading()
            self.reading = False
        rq = self.rq
        body = rq.body[0] if len(rq.body) == 1 else b"".join(rq.body)
        req = Request(parse_qs(rq.query), rq.headers, rq.principal, lambda: body)
        task = self.loop.create_task(self._handle(rq, req))
        self.server._tasks.add(task)
        task.add_done_callback(self.server._tasks.discard)

    async def _handle(self, rq: _Incoming, req: Request) -> None:
        server = self.server
        close = not rq.keep_alive
        try:
            reply, body = await server._answer(rq.name, req)
        except BatchError as e:
            reply, body = _encode(server._refusal(e), rq.name)
            # an overloaded collector sheds the connection too: the agent comes back after Retry-After
            close = close or (e.status in (429, 503) and e.reason == "overloaded")
        except asyncio.CancelledError:
            if not server._shut:
                raise
            # cut by stop() after STOP_GRACE_S (a batch still waiting for its commit, a read behind it): a 503, so the
            # agent keeps the batch and resends it (if its commit goes in meanwhile, the resend is a duplicate)
            reply, body = _encode(server._refusal(BatchError(503, "the collector is stopping; retry later",
                                                             "stopping")), rq.name)
            close = True
        except Exception:  # one bad request must never take the server down
            log.exception("internal error on %s %s", rq.method, rq.path)
            server.metrics.errors.inc()
            reply, body = _encode(Reply(500, {"error": "internal error"}), rq.name)
            close = True
        finally:
            self._settle(rq)
        self._send(reply, body, close)
        if not self.closing:
            self._new_request()
            self._read_on()

    def _refuse(self, reply: Reply, close: bool) -> None:
        """Answers the current request at once, from its head alone (no endpoint runs)."""
        self._settle(self.rq)
        _, body = _encode(reply, "a refusal")
        self._send(reply, body, close or not self.rq.keep_alive)
        self._new_request()

    def _send(self, reply: Reply, body: bytes, close: bool) -> None:
        if self.closing:  # the client went away: nothing left to tell it
            return
        close = close or self.server._shut
        self.transport.write(_response(reply, body, close))
        log.debug('%s "%s %s" %d', self.peer, self.rq.method, self.rq.path, reply.status)
        if close:
            self._linger()

    def _settle(self, rq: _Incoming) -> None:
        """Gives back what a request holds until it is answered: its place in the in-flight count and in its
        node's."""
        if rq.counted:
            rq.counted = False
            self.server._in_flight -= 1
        if rq.node is not None:
            self.server._release_node(rq.node)
            rq.node = None

    def _new_request(self) -> None:
        self.state = _IDLE
        self.rq = _Incoming()

    def _read_on(self) -> None:
        """Between requests: reads again, starting with what was read beyond the last request."""
        if not self.writable:  # resume_writing comes back here; a client reading nothing is closed when idle
            self._arm(self.server.idle_timeout_s, self._idle_expired)
            return
        if not self.reading:
            self.transport.resume_reading()
            self.reading = True
        data, self.pending = self.pending, b""
        self._consume(data)

    # -- clocks and closing
    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _idle_expired(self) -> None:
        self.timer = None
        self.close()

    def _deadline_passed(self) -> None:
        self.timer = None
        if self.state is _BODY:  # its head came in: tell the client why
            self._refuse(Reply(408, {"error": f"request not received within {self.server.request_timeout_s:g} s"}),
                         True)
        else:
            self.close()

    def close(self) -> None:
        """Closes once what is written has gone out."""
        self.closing = True
        self.transport.close()

    def _linger(self) -> None:
        """Closes after an answer, reading and dropping what the client still sends (a refused body) until it
        stops or for LINGER_S: a close with bytes unread resets the connection, and the reset can destroy the
        answer before the client has read it."""
        self.closing = True
        if not self.transport.can_write_eof():  # TLS
            self.transport.close()
            return
        self.transport.write_eof()  # the answer, then the end of the stream
        if not self.reading:
            self.transport.resume_reading()
            self.reading = True
        self._arm(LINGER_S, self.transport.close)

    def abort(self) -> None:
        """Closes now (the server is stopping)."""
        self.closing = True
        self.transport.abort()


@contextlib.contextmanager
def _write_refusals(samples: int = 0) -> Iterator[None]:
    """A write (a batch's, job records') whose failure :func:`_write_refusal` answers; anything else goes on up."""
    try:
        yield
    except Exception as e:
        refusal = _write_refusal(e, samples)
        if refusal is None:
            raise
        raise refusal from None


def _write_refusal(e: Exception, samples: int = 0) -> BatchError | None:
    """How a write the ledger or the audit log failed is answered, a batch's and job records' alike: a full disk 507
    (Retry-After; reads go on), the ledger away 503, a value it cannot hold 422 (final: validation should have refused
    it, and a 5xx would have the agent resend it for good); None for anything else (a 500)."""
    if isinstance(e, (StoreFull, DatabaseFull)) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
        log.error("disk full, writes refused with 507 until there is room (reads go on): %s", e)
        return BatchError(507, f"the collector's disk is full; retry later ({e})", "disk_full", samples)
    if isinstance(e, DatabaseUnavailable):  # StoreUnavailable among them
        log.error("ledger unavailable, write refused with 503 (the agent retries): %s", e)
        return BatchError(503, f"the ledger cannot be reached; retry later ({e})", "ledger_unavailable", samples)
    psycopg = sys.modules.get("psycopg")  # loaded where the ledger is PostgreSQL
    if isinstance(e, (sqlite3.DataError, UnicodeEncodeError, OverflowError)) or (
            psycopg is not None and isinstance(e, psycopg.DataError)):
        log.error("the ledger cannot store a value of a write (refused with 422): %s", e, exc_info=e)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return BatchError(422, f"the ledger cannot store a value of this request ({first})", "unstorable", samples)
    return None


def _only(q: Mapping[str, list[str]], *names: str) -> None:
    """Every query parameter is one the endpoint knows, given once (a typo is a 400, not silently ignored)."""
    unknown = sorted(set(q) - set(names))
    if unknown:
        raise BatchError(400, f"unknown query parameter(s) {unknown}; this endpoint takes {sorted(names)}")
    twice = sorted(k for k, v in q.items() if len(v) > 1)
    if twice:
        raise BatchError(400, f"query parameter(s) {twice} given more than once")


def _text(q: Mapping[str, list[str]], name: str) -> str | None:
    v = q.get(name, [None])[0]
    if v is not None and len(v) > 1024:
        raise BatchError(400, f"query parameter {name!r} is longer than 1024 characters")
    if v and not is_name(v):  # a name (job, host, GPU) holds none: a NUL would fail inside PostgreSQL, a 500
        raise BatchError(400, f"query parameter {name!r} must not contain control characters, got {v[:40]!r}")
    return v or None


def _flag(q: Mapping[str, list[str]], name: str) -> bool:
    v = q.get(name, ["0"])[0].lower()
    if v not in ("0", "1", "true", "false", "yes", "no"):
        raise BatchError(400, f"query parameter {name!r} must be true or false (1/0, yes/no), got {v!r}")
    return v in ("1", "true", "yes")


def _int(q: Mapping[str, list[str]], name: str, default: int) -> int:
    if name not in q:
        return default
    v = q[name][0]
    n = ascii_int(v) if len(v) <= 12 else None
    if n is None:
        raise BatchError(400, f"query parameter {name!r} must be a non-negative integer, got {v[:40]!r}")
    return n


def _query_range(start: float | None, end: float | None, step: float | None = None) -> float | None:
    """The store's rules of a queried range (``store.query_range``, which the CLI applies too) as a 400."""
    try:
        return query_range(start, end, step, name=lambda n: f"query parameter {n!r}")
    except QueryRangeError as e:
        raise BatchError(400, str(e)) from None


def _float(q: Mapping[str, list[str]], name: str) -> float | None:
    """A number parameter as given (NaN and infinities too: ``_query_range`` refuses them, naming the range)."""
    if name not in q:
        return None
    v = q[name][0]
    try:
        return float(v)
    except ValueError:
        raise BatchError(400, f"query parameter {name!r} must be a number, got {v[:40]!r}") from None
