"""Push sample batches to the collector over HTTP (a sink for :class:`agent.sampler.Agent`).

Each batch carries ``(agent_id, seq)`` so the collector can drop a batch it has already seen (a retry).
``seq`` starts from the wall clock in microseconds, so a restarted agent never reuses an old number;
numbers may have gaps (a failed batch burns its number unless it is re-sent with :meth:`send`).
"""

from __future__ import annotations

import gzip
import json
import math
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx
import msgpack
import zstandard

from gpuledger.schema.records import GpuSample, JobRecord
from gpuledger.schema.wire import to_series

_BODY_EXCERPT = 500  # characters of an error response kept in the exception
CONTENT_TYPES = {"json": "application/json", "msgpack": "application/msgpack"}


def _floats(s: GpuSample) -> list[Any]:
    return [getattr(s, f) for f in s.__slots__ if isinstance(getattr(s, f), float)] + list(s.job_shares)


def _verify(verify: str | bool) -> ssl.SSLContext | bool:
    # httpx deprecates verify=<path>; a context built from the CA file says the same thing.
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


class PushError(RuntimeError):
    """A batch did not reach the collector: ``status`` is the HTTP status (None when no response came)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class EncodeError(ValueError):
    """A batch that cannot be encoded (NaN, a sample of another host): the collector would reject it."""


def encode_batch(agent_id: str, host: str, seq: int, samples: Sequence[GpuSample], jobs: Sequence[JobRecord] = (),
                 fmt: str = "json", compress: str | None = None, layout: str = "series", cluster: str = "") -> bytes:
    """A batch's request body: ``fmt`` json or msgpack, ``compress`` None, gzip or zstd; ``layout`` series
    (columns per GPU, ``agent.wire``: what agents send; complete columns as raw bytes in msgpack) or samples
    (one object a sample). Raises EncodeError for what the collector would refuse, ValueError for bad options."""
    if layout not in ("series", "samples"):
        raise ValueError(f"unknown layout {layout!r} (series or samples)")
    if fmt not in CONTENT_TYPES:
        raise ValueError(f"unknown format {fmt!r} (json or msgpack)")
    if compress not in (None, "gzip", "zstd"):
        raise ValueError(f"unknown compression {compress!r} (gzip or zstd)")
    payload: dict[str, Any] = {"agent_id": agent_id, "seq": seq, "host": host}
    if cluster:  # optional on the wire: collectors before it was added refuse unknown fields, so only when set
        payload["cluster"] = cluster
    try:
        if layout == "series":
            payload["series"] = to_series(samples, host, binary=fmt == "msgpack")
        else:
            if any(isinstance(v, float) and not math.isfinite(v) for s in samples for v in _floats(s)):
                raise ValueError("NaN or infinite value")
            payload["samples"] = [s.to_wire() for s in samples]
        if jobs:  # job metadata rides along with the next batch (spooled with it, so never ahead of it)
            # a record describes the job this host runs: it lists the host (the collector refuses one without)
            payload["jobs"] = [(r if host in r.hosts else replace(r, hosts=(*r.hosts, host))).to_dict() for r in jobs]
        if fmt == "json":
            # NaN/inf are not JSON: fail here, naming the batch, rather than send what the collector rejects.
            body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode()
        else:
            body = msgpack.packb(payload, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise EncodeError(str(exc)) from exc
    if compress == "gzip":
        body = gzip.compress(body, compresslevel=5)
    elif compress == "zstd":
        body = zstandard.ZstdCompressor(level=3).compress(body)
    return body


class HttpPusher:
    """POSTs batches ``{"agent_id", "seq", "host", "series": [...]}`` (``agent.wire``) to the collector's samples
    endpoint: JSON by default, msgpack (with raw binary columns) where :meth:`post` is told so."""

    def __init__(
        self,
        url: str,
        agent_id: str,
        host: str,
        timeout: float = 10.0,
        seq_start: int | None = None,
        client: httpx.Client | None = None,
        token: str | None = None,
        headers: Mapping[str, str] | None = None,
        verify: str | bool = True,
        fmt: str = "json",
        cluster: str = "",
    ) -> None:
        if fmt not in CONTENT_TYPES:
            raise ValueError(f"pusher: fmt must be json or msgpack, got {fmt!r}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"pusher: url must be http(s)://..., got {url!r}")
        if not agent_id:
            raise ValueError("pusher: agent_id must not be empty")
        self.url = url
        self.fmt = fmt  # what write() sends: json, or msgpack with complete columns as raw bytes (the agent's)
        self.agent_id = agent_id
        self.host = host
        self.cluster = cluster  # the Slurm cluster this host is in, sent with every batch ("" = not named)
        self._jobs: dict[str, JobRecord] = {}  # job metadata waiting for the next batch
        self._jobs_lock = threading.Lock()
        self._headers: dict[str, str] = dict(headers or {})
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._own_client = client is None
        # One client for the agent's life: keep-alive spares a TCP (and TLS) handshake per batch.
        # verify: True (system CAs), a CA bundle path (a self-signed collector), or False (tests only).
        self._client = client if client is not None else httpx.Client(timeout=timeout, verify=_verify(verify))
        self._lock = threading.Lock()
        self._next_seq = time.time_ns() // 1000 if seq_start is None else int(seq_start)
        self.batches_sent = 0

    def next_seq(self) -> int:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def write(self, samples: Sequence[GpuSample]) -> int:
        """Send one batch under a new sequence number; returns that number. Raises PushError."""
        seq = self.next_seq()
        self.send(seq, samples)
        return seq

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        """Job metadata (new or changed) to send with the next batch."""
        with self._jobs_lock:
            self._jobs.update((r.job_id, r) for r in records)

    def bump_seq(self, at_least: int) -> None:
        """Never hand out a number below ``at_least`` (a spool's batches already hold the ones before)."""
        with self._lock:
            self._next_seq = max(self._next_seq, at_least)

    def encode(self, seq: int, samples: Sequence[GpuSample], fmt: str = "json", compress: str | None = None,
               layout: str = "series") -> bytes:
        """The request body of a batch (see :func:`encode_batch`), with the job metadata waiting for it."""
        with self._jobs_lock:
            jobs, self._jobs = self._jobs, {}
        try:
            return encode_batch(self.agent_id, self.host, seq, samples, list(jobs.values()), fmt, compress, layout,
                                self.cluster)
        except EncodeError as exc:
            raise PushError(f"batch {seq} for {self.url} cannot be encoded as {fmt.upper()}: {exc}") from exc

    def send(self, seq: int, samples: Sequence[GpuSample]) -> None:
        """Send a batch under a given sequence number (in ``fmt``)."""
        self.post(seq, self.encode(seq, samples, self.fmt), self.fmt)

    def post(self, seq: int, body: bytes, fmt: str = "json", compress: str | None = None) -> None:
        """POST an encoded batch; returns on a 2xx, else raises PushError (``status`` None: no response)."""
        headers = {"Content-Type": CONTENT_TYPES[fmt], **self._headers}
        if compress:
            headers["Content-Encoding"] = compress
        try:
            response = self._client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise PushError(f"push of batch {seq} to {self.url} failed: {type(exc).__name__}: {exc}") from exc
        if not 200 <= response.status_code < 300:
            text = response.text[:_BODY_EXCERPT]
            raise PushError(
                f"push of batch {seq} to {self.url} rejected: HTTP {response.status_code}: {text}",
                status=response.status_code,
                body=text,
            )
        self.batches_sent += 1

    def close(self) -> None:
        if self._own_client:
            self._client.close()


class Batcher:
    """A sink that hands ``every`` ticks' samples to ``sink`` at once: sample every 10 s, push every minute.

    Fewer, larger batches cost the collector one durable commit each instead of one per tick. ``flush()`` (and
    ``close()``) push what is held; a failed push leaves the samples with the inner sink's own error handling.
    """

    def __init__(self, sink: Any, every: int) -> None:
        if every < 1:
            raise ValueError(f"push every {every!r} ticks: must be >= 1")
        self.sink = sink
        self.every = every
        self._held: list[GpuSample] = []
        self._ticks = 0

    def write(self, samples: Sequence[GpuSample]) -> None:
        self._held.extend(samples)
        self._ticks += 1
        if self._ticks >= self.every:
            self.flush()

    def flush(self) -> None:
        held, self._held, self._ticks = self._held, [], 0
        if held:
            self.sink.write(held)

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        write_jobs = getattr(self.sink, "write_jobs", None)
        if write_jobs is not None:
            write_jobs(records)

    def stats(self) -> dict[str, int] | None:  # the spool's figures, when the inner sink spools
        inner = getattr(self.sink, "stats", None)
        return inner() if callable(inner) else None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            close = getattr(self.sink, "close", None)
            if close is not None:
                close()
