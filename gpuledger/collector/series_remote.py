"""What the series databases ``series_url`` can name have in common (VictoriaMetrics, ``collector.victoriametrics``;
InfluxDB 1.x, ``collector.influxdb``): their errors, what the shipper needs of one (:class:`SeriesTarget`) and the
millisecond grid their readers bucket on."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from gpuledger.collector.series_store import bucket_step

Chunk = tuple[str, str, str, bytes]  # a queued raw chunk: (host, gpu_uuid, mig or "", chunk)


class SeriesUnavailable(Exception):
    """The series database cannot be reached or timed out (HTTP 503 to our clients: try again later)."""

    status = 503


class SeriesBackendError(SeriesUnavailable):
    """The series database answered with an error (``upstream``: its HTTP status) or something unreadable
    (``upstream`` 0); HTTP 502 to our clients."""

    status = 502

    def __init__(self, message: str, upstream: int = 0) -> None:
        super().__init__(message)
        self.upstream = upstream


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters (error messages end up in JSON answers and logs)."""
    return " ".join(text.split())[:limit]


class SeriesTarget(Protocol):
    """Where ``collector.series_outbox.SeriesShipper`` ships queued chunks. ``post`` raises SeriesUnavailable
    (retried) or SeriesBackendError (retried unless ``upstream`` is a 4xx other than 408: then dropped)."""

    name: str  # for log lines: "VictoriaMetrics", "InfluxDB"
    url: str

    def render(self, chunks: Iterable[Chunk]) -> tuple[bytes, int]:
        """The request body of ``chunks`` and the number of samples they hold."""
        ...

    def post(self, body: bytes) -> None: ...

    def problems(self) -> list[str]:
        """What the server's settings get wrong for the collector (logged once, after the first shipment)."""
        ...

    def close(self) -> None: ...


def ms_step(tier: int, step: float | None) -> float:
    """The bucket width the local store would use for ``step`` in ``tier``, rounded up to whole milliseconds
    (the series databases' time resolution as the collector writes them)."""
    return math.ceil(bucket_step(tier, step) * 1000 - 1e-6) / 1000
