"""What the series databases ``series_url`` can name have in common (VictoriaMetrics, ``collector.victoriametrics``;
InfluxDB 1.x, ``collector.influxdb``): their errors, what the shipper needs of one (:class:`SeriesTarget`) and the
millisecond grid their readers bucket on."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import httpx

from gpuledger.collector.db import redact
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series_store import RAW, TIERS, bucket_step, tier_for_step
from gpuledger.schema.records import GpuSample

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


class SeriesHttpClient:
    """The HTTP side both series databases share: ``url`` (for messages, without a password), a thread-safe
    client, and answers sorted into SeriesUnavailable (unreachable, timed out, 429/503: retried) and
    SeriesBackendError (any other non-2xx, ``upstream`` its status)."""

    name = ""  # "VictoriaMetrics", "InfluxDB"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = redact(url.rstrip("/"))
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:  # refused, reset, timed out
            raise SeriesUnavailable(f"{self.name} at {self.url} unreachable: {type(e).__name__}: "
                                    f"{one_line(str(e)) or 'no answer'}") from None
        if r.status_code in (429, 503):
            raise SeriesUnavailable(f"{self.name} at {self.url} is overloaded (HTTP {r.status_code}): "
                                    f"{one_line(r.text)}")
        self._unavailable(r)
        if not 200 <= r.status_code < 300:
            raise SeriesBackendError(f"{self.name} at {self.url} answered HTTP {r.status_code} to {path}: "
                                     f"{one_line(r.text)}", r.status_code)
        return r

    def _unavailable(self, r: httpx.Response) -> None:
        """Raise SeriesUnavailable for an error answer of this database that waiting can cure."""

    def close(self) -> None:
        self._http.close()


def ms_step(tier: int, step: float | None) -> float:
    """The bucket width the local store would use for ``step`` in ``tier``, rounded up to whole milliseconds
    (the series databases' time resolution as the collector writes them)."""
    return math.ceil(bucket_step(tier, step) * 1000 - 1e-6) / 1000


class RemoteSeriesReader:
    """What a ``SeriesReader`` over a series database does whatever its query language: pick the tier as the local
    store would, read raw samples or buckets (``_raw``, ``_buckets``: the subclass's queries on its ``selector``
    of one GPU), and turn an answer not shaped as documented into SeriesBackendError (502). The answers are
    ``ChunkSeriesStore.series``'s with every tier complete (see each backend's module for what differs)."""

    name = ""  # for messages: "VictoriaMetrics", "InfluxDB"
    url = ""

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        tier = tier_for_step(list(TIERS), step) if tier is None else tier
        selector = self._selector(host, gpu_uuid, mig or "")
        try:
            if tier == RAW and not step:
                return self._raw(host, gpu_uuid, mig or None, selector, start, end)
            # whole buckets, the last one too, as the local store answers them (SqlSeriesStore.series)
            width = bucket_step(tier, step)
            end = math.nextafter((math.floor(end / width) + 1) * width, -math.inf)
            return self._buckets(selector, tier, start, end, step)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:  # not shaped as documented
            raise SeriesBackendError(f"{self.name} at {self.url}: unreadable answer "
                                     f"({type(e).__name__}: {one_line(str(e))})") from None

    def tiers(self) -> list[dict]:
        return []  # the database keeps raw points for its own retention; it has no tiers to report

    def _selector(self, host: str, gpu_uuid: str, mig: str) -> str:
        raise NotImplementedError

    def _raw(self, host: str, uuid: str, mig: str | None, selector: str, start: float, end: float
             ) -> list[GpuSample]:
        raise NotImplementedError

    def _buckets(self, selector: str, tier: int, start: float, end: float, step: float | None
                 ) -> list[RollupPoint]:
        raise NotImplementedError
