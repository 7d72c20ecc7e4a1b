"""Series in InfluxDB 1.x (``series_url`` with ``series_api = "influxdb"``): what the collector ships there, and
reading it back as the store would.

**What is stored**: the InfluxDB sink's line protocol (``collector.sinks.influx.sample_lines``, its one
definition; docs/schema.md): measurement ``gpu``, a point per sample with every reported numeric field, ``jobs``
and ``xid_errors`` (counts), tagged ``host``, ``gpu`` (the index), ``uuid``, ``model``, ``mig`` (empty ones
omitted); measurement ``gpu_job``, a point per sample and job holding the GPU, tagged ``host``, ``uuid``, ``mig``,
``jobid``, with ``share`` (the agent's, or the equal split where the sample gives none: ``share_reported`` says
which) and the GPU's main readings. The InfluxDB dashboards (``dashboards/influxdb``) therefore read it as they
read the sink's. A sample's XID codes, ``processes`` and ``source`` are not stored there (the local store keeps
them for its raw retention).

**Precision**: timestamps are milliseconds (``precision=ms``); floats are written with Python's ``repr`` and
integers as int64, which InfluxDB keeps exactly: values come back bit for bit (integers beyond int64 are left
out, as the sink does).

**Resends**: InfluxDB keeps one point per measurement, tag set and timestamp; a point written again replaces the
fields it carries. A shipment resent after a crash or a timeout (the outbox ships at least once) therefore stores
nothing twice, with no setting on the server.

**Reads**: :class:`InfluxSeriesReader` answers ``SeriesReader.series`` in the local store's shape with InfluxQL:
raw samples from ``SELECT *`` of ``gpu`` joined with ``gpu_job``'s shares; buckets from one ``GROUP BY
time(<step>ms)`` of count, sum, min and max per field (InfluxDB's intervals start at multiples of the step since
the epoch, as the store's buckets), with the tier and step the store would pick when every tier is complete.
Steps are rounded up to whole milliseconds; the last bucket holds the samples up to ``end`` (the local store's
rolled-up rows reach to their own end: the two agree when ``end`` is a row's last millisecond).
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterable
from typing import Any

import httpx

from gpuledger.collector.chunks import decode_samples
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series_remote import (
    Chunk,
    RemoteSeriesReader,
    SeriesBackendError,
    SeriesHttpClient,
    SeriesUnavailable,
    ms_step,
    one_line,
)
from gpuledger.collector.series_store import TIER_NAMES
from gpuledger.collector.sinks.influx import FLOAT_FIELDS, INT_FIELDS, sample_lines
from gpuledger.schema.records import GpuSample

GPU, GPU_JOB = "gpu", "gpu_job"  # the sink's measurements
_STATS = ("n", "sum", "min", "max")
_INTS = frozenset(INT_FIELDS)
_FIELDS = (*FLOAT_FIELDS, *INT_FIELDS)


def write_body(chunks: Iterable[Chunk]) -> tuple[bytes, int]:
    """Line protocol (millisecond timestamps) of raw chunks ``(host, gpu_uuid, mig, chunk)``; returns
    (body, samples). The chunks are rendered together: a MIG GPU's whole-GPU row is told by its instances' rows of
    the same instant, which are in other chunks of the same outbox row (``sample_lines``)."""
    rows = [r for host, uuid, mig, blob in chunks for r in decode_samples(blob, host, uuid, mig or None)]
    lines = sample_lines(rows)
    return ("\n".join(lines) + "\n").encode() if lines else b"", len(rows)


def ident(name: str) -> str:
    """An InfluxQL identifier (double-quoted)."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def literal(value: str) -> str:
    """An InfluxQL string literal (single-quoted)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def stored_tag(value: str) -> str:
    """A tag value as InfluxDB 1.x stores what the sink writes: its line protocol unescapes only ``\\,``, ``\\=``
    and ``\\ `` in tags, so an escaped backslash stays two; a line break (which a tag cannot hold) is a space."""
    return value.replace("\\", "\\\\").replace("\n", " ").replace("\r", " ")


def original_tag(stored: str) -> str:
    """The inverse of :func:`stored_tag` (but for line breaks)."""
    return stored.replace("\\\\", "\\")


class InfluxDB(SeriesHttpClient):
    """One database of an InfluxDB 1.x server (its /write and /query API under ``url``; user and password, if
    any, in the URL). Thread-safe; a ``series_remote.SeriesTarget``."""

    name = "InfluxDB"

    def __init__(self, url: str, database: str, timeout_s: float = 30.0) -> None:
        super().__init__(url, timeout_s)
        self.database = database

    def _unavailable(self, r: httpx.Response) -> None:
        if r.status_code == 404 and "database not found" in r.text:  # not malformed: shipped once it exists
            raise SeriesUnavailable(f"InfluxDB at {self.url} has no database {self.database!r} "
                                    f"(CREATE DATABASE {ident(self.database)}): {one_line(r.text)}")

    def write(self, body: bytes) -> None:
        """POST line protocol (millisecond timestamps) to /write, gzipped (raises SeriesUnavailable, or
        SeriesBackendError: refused, including a partial write)."""
        self._request("POST", "/write", params={"db": self.database, "precision": "ms"},
                      content=gzip.compress(body, 1), headers={"Content-Encoding": "gzip"})

    def query(self, q: str) -> dict[str, Any]:
        """The result of one InfluxQL statement ``q`` (several would hide an error's cause behind "not
        executed"), times in epoch milliseconds; an error, or an answer cut short (``max-row-limit``), raises
        SeriesBackendError."""
        r = self._request("POST", "/query", data={"db": self.database, "q": q, "epoch": "ms"})
        try:
            doc = r.json()
            (res,) = doc["results"]
            if not isinstance(res, dict):
                raise TypeError("a result is no object")
        except (ValueError, KeyError, TypeError) as e:
            raise SeriesBackendError(f"InfluxDB at {self.url}: unreadable answer ({one_line(str(e))})") from None
        if "error" in res:
            raise SeriesBackendError(f"InfluxDB at {self.url}: {one_line(str(res['error']))}")
        if res.get("partial") or any(s.get("partial") for s in res.get("series") or ()):
            raise SeriesBackendError(f"InfluxDB at {self.url} cut the answer short (its max-row-limit)")
        return res

    # -- what the shipper needs (series_remote.SeriesTarget) --------------------------------------------------
    def render(self, chunks: Iterable[Chunk]) -> tuple[bytes, int]:
        return write_body(chunks)

    def post(self, body: bytes) -> None:
        self.write(body)

    def problems(self) -> list[str]:
        res = self.query("SHOW DATABASES")
        names = {row[0] for s in res.get("series", ()) for row in s.get("values") or ()}
        if self.database not in names:
            return [f"no database {self.database!r}: shipments wait until it exists "
                    f"(CREATE DATABASE {ident(self.database)})"]
        return []


def _rows(result: dict[str, Any]) -> Iterable[tuple[dict[str, str], dict[str, Any]]]:
    """(tags, row as {column: value}) of each row of one statement's result."""
    for s in result.get("series") or ():
        columns, tags = s["columns"], s.get("tags") or {}
        for values in s.get("values") or ():
            yield tags, dict(zip(columns, values))


class InfluxSeriesReader(RemoteSeriesReader):
    """``SeriesReader`` over InfluxDB 1.x with InfluxQL (``RemoteSeriesReader``). Raises SeriesUnavailable
    (unreachable, timed out, overloaded) or SeriesBackendError (an error answer); never blocks ingest."""

    name = "InfluxDB"

    def __init__(self, db: InfluxDB) -> None:
        self.db, self.url = db, db.url

    def _selector(self, host: str, gpu_uuid: str, mig: str) -> str:
        # an absent tag (a whole GPU's mig) equals '' in InfluxQL
        return " AND ".join(f'"{tag}" = {literal(stored_tag(value))}'
                            for tag, value in (("host", host), ("uuid", gpu_uuid), ("mig", mig)))

    def close(self) -> None:
        self.db.close()

    def _raw(self, host: str, uuid: str, mig: str | None, where: str, start: float, end: float) -> list[GpuSample]:
        span = f"time >= {math.floor(start * 1000) - 1}ms AND time <= {math.ceil(end * 1000) + 1}ms"
        gpu = self.db.query(f"SELECT * FROM {ident(GPU)} WHERE {where} AND {span}")
        jobs = self.db.query(f'SELECT "share", "share_reported" FROM {ident(GPU_JOB)} WHERE {where} AND {span} '
                             'GROUP BY "jobid"')
        per_job: dict[int, dict[str, tuple[float, bool]]] = {}
        for tags, row in _rows(jobs):
            per_job.setdefault(row["time"], {})[original_tag(tags["jobid"])] = (float(row["share"]),
                                                                                bool(row["share_reported"]))
        out = []
        for _, row in _rows(gpu):
            ts = row["time"] / 1000.0
            if not start <= ts <= end:
                continue
            values: dict[str, Any] = {f: int(v) if f in _INTS else float(v)
                                      for f in _FIELDS if (v := row.get(f)) is not None}
            held = per_job.get(row["time"], {})
            job_ids = tuple(sorted(held))
            shares = tuple(held[j][0] for j in job_ids) if job_ids and all(held[j][1] for j in job_ids) else ()
            out.append(GpuSample(ts=ts, host=host, gpu_uuid=uuid, mig=mig, gpu_index=int(row.get("gpu") or 0),
                                 model=original_tag(row.get("model") or ""), job_ids=job_ids, job_shares=shares,
                                 **values))
        return sorted(out, key=lambda s: s.ts)

    def _buckets(self, where: str, tier: int, start: float, end: float, step: float | None) -> list[RollupPoint]:
        step = ms_step(tier, step)
        step_ms = round(step * 1000)
        first = math.floor(start / step)
        lo_ms = first * step_ms
        stop_ms = math.floor(end * 1000) + 1  # the samples up to end
        if stop_ms <= lo_ms:
            return []
        stats = ", ".join(f'{fn}({ident(f)}) AS {ident(f"{stat}:{f}")}' for f in _FIELDS
                          for stat, fn in zip(_STATS, ("count", "sum", "min", "max")))
        res = self.db.query(
            f'SELECT count("xid_errors") AS "samples", {stats} FROM {ident(GPU)} WHERE {where} AND time >= {lo_ms}ms '
            f"AND time < {stop_ms}ms GROUP BY time({step_ms}ms) fill(none)")
        out = []
        for _, row in _rows(res):
            values = {}
            for f in _FIELDS:
                n = row.get(f"n:{f}")
                if n:
                    values[f] = (int(n), float(row[f"sum:{f}"]), float(row[f"min:{f}"]), float(row[f"max:{f}"]))
            samples = int(row.get("samples") or 0)
            if samples or values:
                k = (row["time"] - lo_ms) // step_ms
                out.append(RollupPoint((first + k) * step, step, samples, values, TIER_NAMES[tier]))
        return sorted(out, key=lambda p: p.ts)
