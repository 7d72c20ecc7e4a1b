"""The collector's HTTP API on the standard library's threading server.

Bad input always gets a 4xx with ``{"error": ...}`` naming the problem; an unexpected failure in one
request gets a 500 for that request only and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from collector.store import SqliteStore
from collector.validate import MAX_BODY_BYTES, BatchError, parse_batch, parse_jobs

log = logging.getLogger(__name__)


class _Metrics:
    def __init__(self, store: SqliteStore) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.accepted = Counter("gpuledger_collector_samples_accepted", "Samples stored and aggregated.", registry=r)
        self.rejected = Counter(
            "gpuledger_collector_samples_rejected", "Samples not stored, by reason.", ["reason"], registry=r
        )
        self.batches_rejected = Counter(
            "gpuledger_collector_batches_rejected", "Requests refused with a 4xx, by HTTP status.", ["status"], registry=r
        )
        self.deduplicated = Counter(
            "gpuledger_collector_batches_deduplicated", "Batches acknowledged but seen before.", registry=r
        )
        self.latency = Histogram(
            "gpuledger_collector_ingest_latency_seconds", "Time to validate, store and commit one batch.", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        size = Gauge("gpuledger_collector_store_size_bytes", "Embedded store size on disk.", registry=r)
        size.set_function(store.size_bytes)


class CollectorServer:
    """``start()`` serves in a background thread; ``url`` says where; ``stop()`` shuts down."""

    def __init__(
        self,
        store: SqliteStore,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = MAX_BODY_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.metrics = _Metrics(store)
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> CollectorServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="collector-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- endpoints (return status, body) ------------------------------------------------------
    def post_samples(self, body: bytes, content_type: str, content_encoding: str) -> tuple[int, dict[str, Any]]:
        t0 = time.perf_counter()
        batch = parse_batch(body, content_type, self.clock(), self.max_body_bytes, content_encoding)
        result = self.store.ingest(batch)
        m = self.metrics
        m.latency.observe(time.perf_counter() - t0)
        if result.duplicate_batch:
            m.deduplicated.inc()
        m.accepted.inc(result.accepted)
        if result.duplicate_samples:
            m.rejected.labels("duplicate").inc(result.duplicate_samples)
        if result.too_late:
            m.rejected.labels("too_late").inc(result.too_late)
        return 200, {
            "accepted": result.accepted,
            "duplicate": result.duplicate_batch,
            "duplicate_samples": result.duplicate_samples,
            "too_late": result.too_late,
        }

    def post_jobs(self, body: bytes, content_type: str, content_encoding: str) -> tuple[int, dict[str, Any]]:
        records = parse_jobs(body, content_type, self.max_body_bytes, content_encoding)
        return 200, {"received": len(records), "changed": self.store.put_jobs(records)}


def _make_handler(server: CollectorServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "gpuledger-collector"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                self.close_connection = True
                raise BatchError(411, "Content-Length required")
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                raise BatchError(400, f"bad Content-Length {length!r}") from None
            if n > server.max_body_bytes:
                self.close_connection = True  # the unread body makes the connection unusable
                raise BatchError(413, f"body of {n} bytes exceeds the limit of {server.max_body_bytes}")
            return self.rfile.read(n)

        def _guard(self, fn: Callable[[], tuple[int, Any]]) -> None:
            try:
                status, payload = fn()
                self._send(status, payload)
            except BatchError as e:
                server.metrics.batches_rejected.labels(str(e.status)).inc()
                self._send(e.status, {"error": e.message})
            except Exception:  # one bad request must never take the server down
                log.exception("internal error on %s %s", self.command, self.path)
                self.close_connection = True
                self._send(500, {"error": "internal error"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            path = urlsplit(self.path).path
            ctype = self.headers.get("Content-Type", "application/json")
            cenc = self.headers.get("Content-Encoding", "")
            if path == "/api/v1/samples":
                self._guard(lambda: server.post_samples(self._body(), ctype, cenc))
            elif path == "/api/v1/jobs":
                self._guard(lambda: server.post_jobs(self._body(), ctype, cenc))
            else:
                self.close_connection = True
                self._send(404, {"error": f"no such endpoint: POST {path}"})

        def do_GET(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            q = parse_qs(url.query)
            if url.path == "/api/v1/usage":
                job = q.get("job", [None])[0]
                per_gpu = q.get("per_gpu", ["0"])[0].lower() in ("1", "true", "yes")
                self._guard(lambda: (200, [u.to_dict() for u in server.store.job_usage(job, per_gpu)]))
            elif url.path == "/api/v1/jobs":
                self._guard(lambda: (200, [j.to_dict() for j in server.store.jobs()]))
            elif url.path == "/api/v1/totals":
                self._guard(lambda: (200, server.store.totals(_float(q, "start"), _float(q, "end"))))
            elif url.path == "/metrics":
                self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
            elif url.path == "/healthz":
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": f"no such endpoint: GET {url.path}"})

    return Handler


def _float(q: dict[str, list[str]], name: str) -> float | None:
    if name not in q:
        return None
    try:
        return float(q[name][0])
    except ValueError:
        raise BatchError(400, f"query parameter {name!r} must be a number (unix seconds)") from None
