"""The collector's HTTP API on the standard library's threading server.

Bad input always gets a 4xx with ``{"error": ...}`` naming the problem; an unexpected failure in one
request gets a 500 for that request only and the server keeps serving. A batch is answered 2xx only
after ``store.ingest`` has committed it durably. Routes live in one table (``ROUTES``) that the OpenAPI
document is checked against.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuledger.collector.auditlog import AuditLog, open_log, record_job_records
from gpuledger.collector.auth import Access, Authenticator, AuthError, Principal
from gpuledger.collector.limits import (
    IDLE_TIMEOUT_S,
    LISTEN_BACKLOG,
    MAX_CONNECTIONS,
    MAX_PAGE,
    MAX_PER_HOST,
    MAX_SERIES_POINTS,
    REQUEST_TIMEOUT_S,
)
from gpuledger.collector.openapi import openapi_document
from gpuledger.collector.series_remote import SeriesUnavailable
from gpuledger.collector.series_store import SeriesReader
from gpuledger.collector.store import BatchRefused, Store, StoreFull, StoreUnavailable
from gpuledger.collector.validate import DEFAULT_LIMITS, MAX_BODY_BYTES, BatchError, Limits, parse_batch, parse_jobs

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


class _StoreCounters:
    """Counters kept in the store (they survive restarts): read at scrape time."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("gpuledger_collector_energy_counter_anomalies",
                                "Intervals whose energy counter went backwards or jumped beyond the power limit "
                                "(charged from the power integral instead), over all GPUs.")
        c.add_metric([], float(self.store.counter_anomalies()))
        yield c


class _Metrics:
    def __init__(self, store: Store, feed: Path | None, in_flight: Callable[[], int],
                 ingest_depth: Callable[[], int], user_labels: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        size = Gauge("gpuledger_collector_store_size_bytes", "Embedded store size on disk.", registry=r)
        size.set_function(store.size_bytes)
        g = Gauge("gpuledger_collector_requests_in_flight", "HTTP requests being handled now.", registry=r)
        g.set_function(in_flight)
        g = Gauge("gpuledger_collector_ingest_queue_depth",
                  "Ingest requests in flight (validating, waiting for or holding the store).", registry=r)
        g.set_function(ingest_depth)
        g = Gauge("gpuledger_collector_gc_frozen_objects", "Objects moved out of the garbage collector's full passes "
                  "(collector.gcfreeze); flat unless frozen cycles leak.", registry=r)
        g.set_function(gc.get_freeze_count)
        r.register(_FeedGauges(feed, user_labels))
        r.register(_StoreCounters(store))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    max_connections = MAX_CONNECTIONS

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.connections = 0
        self._conn_lock = threading.Lock()
        super().__init__(*a, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:  # a thread per connection: thousands more would exhaust memory; the agent retries
            log.warning("%d connections open (limit %d): closing a new one from %s", self.connections,
                        self.max_connections, client_address[0] if client_address else "?")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self.connections -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Failed TLS handshakes, clients that vanish: the request is lost, the server is not; no traceback spam.
        log.debug("connection from %s failed", client_address, exc_info=True)


class _DeadlineReader(io.RawIOBase):
    """A connection's reads under two clocks: up to ``idle_s`` for the first byte of a request (an idle
    keep-alive connection), then ``request_s`` for the whole request from that byte on, headers and body
    together: a client dripping a byte a second cannot hold its thread (or anything else) for longer."""

    def __init__(self, sock: Any, idle_s: float, request_s: float) -> None:
        self.sock, self.idle_s, self.request_s = sock, idle_s, request_s
        self.deadline: float | None = None  # None: between requests

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.deadline is None:
            self.sock.settimeout(self.idle_s)
            n = self.sock.recv_into(b)
            self.deadline = time.monotonic() + self.request_s
            return n
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


def tls_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


class CollectorServer:
    """``start()`` serves in a background thread; ``url`` says where; ``stop()`` shuts down.

    ``auth`` (None or an Authenticator without tokens: open), ``tls`` (an SSLContext: HTTPS),
    ``priority_feed`` (the file GET /api/v1/priority and the fairshare gauges read), ``max_inflight``
    (ingest requests validating or storing at once before 503; a request takes its slot only once its body
    has arrived), ``max_per_host`` (concurrent ingest requests of one node token, or one client address when
    auth is off, before 429, counted from the headers on: slow bodies of one node cannot starve the
    others), ``request_timeout_s`` (headers and body of one request), ``idle_timeout_s`` (keep-alive),
    ``limits`` (what one batch may hold, checked while decoding), ``metrics_user_labels`` (publish user
    names in the fairshare gauges of the open /metrics), ``series`` (where GET /api/v1/series reads: the store, or
    ``collector.victoriametrics.VmSeriesReader``, whose failures are answered 502/503).
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
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_per_host: int = MAX_PER_HOST,
        max_connections: int = MAX_CONNECTIONS,
        limits: Limits = DEFAULT_LIMITS,
        metrics_user_labels: bool = False,
        max_series_points: int = MAX_SERIES_POINTS,
        max_page: int = MAX_PAGE,
        series: SeriesReader | None = None,
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
        self.max_series_points = max_series_points
        self.max_page = max_page
        self.limits = limits if max_body_bytes == MAX_BODY_BYTES else replace(limits, max_body_bytes=max_body_bytes)
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self._ingesting = 0
        self._per_host: dict[str, int] = {}
        self.metrics = _Metrics(store, priority_feed, lambda: self._in_flight, lambda: self._ingesting,
                                metrics_user_labels)
        self._httpd = _HTTPServer((host, port), _make_handler(self, request_timeout_s, idle_timeout_s))
        self._httpd.max_connections = max_connections
        self._tls = tls
        if tls is not None:
            # The handshake runs in the request's thread (see Handler.setup), not in the accepting loop,
            # so a slow or silent client cannot stall everyone else.
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        if isinstance(host, bytes):
            host = host.decode()
        return f"{'https' if self._tls else 'http'}://{host}:{port}"

    def start(self) -> CollectorServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="collector-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._audit is not None:
            self._audit.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _count(self, attr: str, delta: int) -> None:
        with self._count_lock:
            setattr(self, attr, getattr(self, attr) + delta)

    # -- endpoints ----------------------------------------------------------------------------
    def post_samples(self, req: Request) -> Reply:
        host = req.principal.name if req.principal is not None else None
        # Per node token: one node's slow bodies cannot take every slot. Without auth there is no node to
        # count by (behind NAT or a proxy one address is many nodes); the request deadline still bounds them.
        who = host if req.principal is not None and req.principal.role == "node" else None
        if who is not None:
            with self._count_lock:
                held = self._per_host.get(who, 0)
                if held >= self.max_per_host:
                    raise BatchError(429, f"{held} ingest requests of {who} in flight (limit {self.max_per_host}); "
                                     "retry later", "overloaded")
                self._per_host[who] = held + 1
        try:
            body = req.read_body()  # under the request deadline; no ingest slot is held while it arrives
            t0 = time.perf_counter()
            with self._count_lock:
                if self._ingesting >= self.max_inflight:
                    raise BatchError(503, f"{self._ingesting} ingest requests in flight (limit {self.max_inflight}); "
                                     "retry later", "overloaded")
                self._ingesting += 1
            try:
                batch = parse_batch(body, req.headers.get("Content-Type", "application/json"), self.clock(), None,
                                    req.headers.get("Content-Encoding", ""), allowed_host=host, limits=self.limits)
                try:
                    result = self.store.ingest(batch)  # returns only after the durable commit
                except BatchRefused as e:  # 409: its key was stored with other content; 422: too many GPUs
                    raise BatchError(409 if e.reason == "conflict" else 422, str(e), e.reason,
                                     batch.n_samples) from None
                except StoreFull as e:
                    log.error("disk full, batches refused with 507 until there is room (reads go on): %s", e)
                    raise BatchError(507, f"the collector's disk is full; retry later ({e})", "disk_full",
                                     batch.n_samples) from None
                except StoreUnavailable as e:
                    log.error("ledger unavailable, batch refused with 503 (the agent retries): %s", e)
                    raise BatchError(503, f"the ledger cannot be reached; retry later ({e})", "ledger_unavailable",
                                     batch.n_samples) from None
            finally:
                self._count("_ingesting", -1)
        finally:
            if who is not None:
                with self._count_lock:
                    left = self._per_host.pop(who) - 1
                    if left:
                        self._per_host[who] = left
        m = self.metrics
        m.latency.observe(time.perf_counter() - t0)
        if result.duplicate_batch:
            m.deduplicated.inc()
        else:
            m.batches_accepted.inc()
        m.accepted.inc(result.accepted)
        if result.duplicate_samples:
            m.rejected.labels("duplicate").inc(result.duplicate_samples)
        if result.too_late:
            m.rejected.labels("too_late").inc(result.too_late)
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

    def post_jobs(self, req: Request) -> Reply:
        records = parse_jobs(req.read_body(), req.headers.get("Content-Type", "application/json"),
                             self.limits.max_body_bytes, req.headers.get("Content-Encoding", ""))
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
        start, end = _time(req.query, "start"), _time(req.query, "end")
        if start is not None and end is not None and end < start:
            raise BatchError(400, f"query parameter 'end' ({end}) is before 'start' ({start})")
        return Reply(200, self.store.totals(start, end))

    def get_series(self, req: Request) -> Reply:
        """One GPU's samples or rollup buckets in [start, end]; the store picks the tier by range and retention.

        An answer never holds more than ``max_series_points`` points: a range that would (raw samples without a
        step over more than that many seconds, or a step too fine for the range) is answered in buckets of
        (end - start) / max_series_points seconds (each point says its step)."""
        _only(req.query, "host", "uuid", "start", "end", "step", "mig")
        host, uuid = _text(req.query, "host"), _text(req.query, "uuid")
        start, end = _time(req.query, "start"), _time(req.query, "end")
        if not host or not uuid or start is None or end is None:
            raise BatchError(400, "series needs the query parameters host, uuid, start and end (unix seconds)")
        if end < start:
            raise BatchError(400, f"query parameter 'end' ({end}) is before 'start' ({start})")
        step = _float(req.query, "step")
        if step is not None and not 0 < step <= _MAX_TIME:
            raise BatchError(400, f"query parameter 'step' must be positive and at most {_MAX_TIME:g} s, got {step!r}")
        mig = _text(req.query, "mig")
        coarsest = max((end - start) / self.max_series_points, _MIN_STEP_S)
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

    def get_metrics(self, req: Request) -> Reply:
        return Reply(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)

    def get_health(self, req: Request) -> Reply:
        return Reply(200, {"status": "ok"})


def _make_handler(server: CollectorServer, timeout_s: float, idle_s: float) -> type[BaseHTTPRequestHandler]:
    methods = {m for m, _ in ROUTES}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "gpuledger-collector"
        timeout = idle_s
        # The status line and headers go out in one write, the body in another: with Nagle on, the body waits
        # for the client's delayed ACK of the headers (up to 40 ms a request on keep-alive connections).
        disable_nagle_algorithm = True

        def setup(self) -> None:
            super().setup()
            if isinstance(self.connection, ssl.SSLSocket):
                self.connection.settimeout(timeout_s)
                self.connection.do_handshake()
            self._reader = _DeadlineReader(self.connection, idle_s, timeout_s)
            self.rfile = io.BufferedReader(self._reader, self.rbufsize if self.rbufsize > 0 else 65536)

        def handle_one_request(self) -> None:
            self._reader.deadline = None  # the next request's clock starts at its first byte
            try:
                super().handle_one_request()
            except TimeoutError:  # a deadline passed while headers trickled in: drop the connection
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, reply: Reply) -> None:
            p = reply.payload
            try:  # NaN/Infinity are not JSON: a value like that is a bug, answered as one
                data = p if isinstance(p, bytes) else json.dumps(p, allow_nan=False).encode()
            except ValueError:
                log.exception("answer to %s is not JSON", self.path)
                reply = Reply(500, {"error": "internal error: the answer is not representable as JSON"})
                data = json.dumps(reply.payload).encode()
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(data)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away: nothing left to tell it
                self.close_connection = True

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                self.close_connection = True
                raise BatchError(411, "Content-Length required", "malformed")
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                raise BatchError(400, f"bad Content-Length {length!r}", "malformed") from None
            limit = server.limits.max_body_bytes
            if n > limit:
                self.close_connection = True  # the unread body makes the connection unusable
                raise BatchError(413, f"body of {n} bytes exceeds the limit of {limit}", "too_large")
            data = self.rfile.read(n)
            if len(data) < n:
                self.close_connection = True
                raise BatchError(400, f"body ended after {len(data)} of {n} bytes", "malformed")
            return data

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            route = ROUTES.get((method, url.path))
            if route is None:
                if method == "POST":
                    self.close_connection = True  # its body is unread
                allowed = sorted(m for m, p in ROUTES if p == url.path)
                if allowed:
                    self._send(Reply(405, {"error": f"{method} not allowed on {url.path}; use {', '.join(allowed)}"},
                                     headers={"Allow": ", ".join(allowed)}))
                else:
                    self._send(Reply(404, {"error": f"no such endpoint: {method} {url.path}"}))
                return
            name, access = route
            server._count("_in_flight", 1)
            try:
                self._handle(method, url.path, url.query, name, access)
            finally:
                server._count("_in_flight", -1)

        def _handle(self, method: str, path: str, query: str, name: str, access: Access) -> None:
            m = server.metrics
            try:
                principal = server.auth.authorize(self.headers.get("Authorization"), access, f"{method} {path}")
                req = Request(parse_qs(query), self.headers, principal, self._body)
                reply = getattr(server, name)(req)
            except AuthError as e:
                if method == "POST":
                    self.close_connection = True  # refused before its body was read
                m.batches_rejected.labels(str(e.status), "unauthorized" if e.status == 401 else "forbidden").inc()
                headers = {"WWW-Authenticate": 'Bearer realm="gpuledger"'} if e.status == 401 else {}
                self._send(Reply(e.status, {"error": e.message}, headers=headers))
            except BatchError as e:
                m.batches_rejected.labels(str(e.status), e.reason).inc()
                if e.samples:
                    m.rejected.labels(e.reason).inc(e.samples)
                if e.status in (429, 503) and e.reason == "overloaded":
                    self.close_connection = True  # the body may be unread
                headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
                if e.status == 507:
                    headers = {"Retry-After": "30"}
                # reason: machine-readable (an agent keeps a "future" batch: its clock, not the batch, is wrong)
                self._send(Reply(e.status, {"error": e.message, "reason": e.reason}, headers=headers))
            except TimeoutError:
                self.close_connection = True
                self._send(Reply(408, {"error": f"request not received within {timeout_s:g} s"}))
            except Exception:  # one bad request must never take the server down
                log.exception("internal error on %s %s", method, path)
                m.errors.inc()
                self.close_connection = True
                self._send(Reply(500, {"error": "internal error"}))
            else:
                self._send(reply)

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            self._dispatch("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def _other(self) -> None:
            self.close_connection = True
            allowed = ", ".join(sorted(methods))
            self._send(Reply(405, {"error": f"method {self.command} not supported; use {allowed}"},
                             headers={"Allow": allowed}))

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other  # noqa: N815

        def do_HEAD(self) -> None:  # noqa: N802 - a 405 without a body (HEAD answers never carry one)
            self.close_connection = True
            self.send_response(405)
            self.send_header("Allow", ", ".join(sorted(methods)))
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


_MAX_TIME = 1e11  # seconds: unix times until the year 5138, steps up to 3,000 years
_MIN_STEP_S = 1e-3  # no bucket finer than a millisecond (a finer step only multiplies empty buckets)


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
    if not v.isdigit() or len(v) > 12:
        raise BatchError(400, f"query parameter {name!r} must be a non-negative integer, got {v[:40]!r}")
    return int(v)


def _time(q: Mapping[str, list[str]], name: str) -> float | None:
    v = _float(q, name)
    if v is not None and not 0 <= v <= _MAX_TIME:
        raise BatchError(400, f"query parameter {name!r} must be unix seconds in 0..{_MAX_TIME:g}, got {v!r}")
    return v


def _float(q: Mapping[str, list[str]], name: str) -> float | None:
    if name not in q:
        return None
    try:
        v = float(q[name][0])
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise BatchError(400, f"query parameter {name!r} must be a finite number (unix seconds)")
    return v
