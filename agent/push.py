"""Push sample batches to the collector over HTTP (a sink for :class:`agent.sampler.Agent`).

Each batch carries ``(agent_id, seq)`` so the collector can drop a batch it has already seen (a retry).
``seq`` starts from the wall clock in microseconds, so a restarted agent never reuses an old number;
numbers may have gaps (a failed batch burns its number unless it is re-sent with :meth:`send`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from agent.records import GpuSample

_BODY_EXCERPT = 500  # characters of an error response kept in the exception


class PushError(RuntimeError):
    """A batch did not reach the collector: ``status`` is the HTTP status (None when no response came)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class HttpPusher:
    """POSTs ``{"agent_id", "seq", "host", "samples": [...]}`` as JSON to the collector's samples endpoint."""

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
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"pusher: url must be http(s)://..., got {url!r}")
        if not agent_id:
            raise ValueError("pusher: agent_id must not be empty")
        self.url = url
        self.agent_id = agent_id
        self.host = host
        self._headers: dict[str, str] = dict(headers or {})
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._own_client = client is None
        # One client for the agent's life: keep-alive spares a TCP (and TLS) handshake per batch.
        self._client = client if client is not None else httpx.Client(timeout=timeout)
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

    def send(self, seq: int, samples: Sequence[GpuSample]) -> None:
        """Send a batch under a given sequence number (a spool re-sends with the original one)."""
        payload: dict[str, Any] = {
            "agent_id": self.agent_id,
            "seq": seq,
            "host": self.host,
            "samples": [s.to_dict() for s in samples],
        }
        try:
            # NaN/inf are not JSON: fail here, naming the batch, rather than send what the collector rejects.
            body_bytes = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise PushError(f"batch {seq} for {self.url} cannot be encoded as JSON: {exc}") from exc
        try:
            response = self._client.post(
                self.url, content=body_bytes, headers={"Content-Type": "application/json", **self._headers}
            )
        except httpx.HTTPError as exc:
            raise PushError(f"push of batch {seq} to {self.url} failed: {type(exc).__name__}: {exc}") from exc
        if not 200 <= response.status_code < 300:
            body = response.text[:_BODY_EXCERPT]
            raise PushError(
                f"push of batch {seq} to {self.url} rejected: HTTP {response.status_code}: {body}",
                status=response.status_code,
                body=body,
            )
        self.batches_sent += 1

    def close(self) -> None:
        if self._own_client:
            self._client.close()
