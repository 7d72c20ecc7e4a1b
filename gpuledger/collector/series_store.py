"""The series store: every GPU's samples over time, in compressed chunks, in three tiers.

Raw samples sit in compressed columnar chunks (``collector.chunks``; one row per GPU per batch at
ingest, merged per GPU per ``raw_chunk_s`` interval by compaction); 1-minute and 1-hour rollups use
the same chunk format (``collector.rollup``). Tiers (``Retention``): raw chunks for ``raw_s`` (7 days),
1-minute rollups for ``minute_s`` (90 days), 1-hour rollups for good. Compaction rolls up every GPU's
closed minutes (older than its newest sample minus the late window) once it has sealed them (``seal``: ingest
refuses a later arrival there as too late, whatever late window the ingesting process has, so no late sample can
still change them), merges small chunks, then drops what retention allows; raw data is never dropped before it is
rolled up. Each compaction step is planned from reads alone (``plan_*``, on any connection: the store plans
through one of its own, ``on``) and applied in a transaction that checks the plan still holds (``apply_*``);
every step is idempotent.

What the rest of the code reads is :class:`SeriesReader`; what the collector's store writes through is
:class:`SeriesStore`. :class:`ChunkSeriesStore` keeps the chunks in a ``collector.db`` database, SQLite or
PostgreSQL alike (one portable dialect); it shares the collector's database with the ledger, so ingest writes
both in one transaction. Chunks are read in key order (bucket, then first time), so sums over rows come out
bit-for-bit the same on either engine. It is not thread-safe by itself: ``collector.store.Store``
serialises access (its compaction plans through a copy bound to another connection).
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any, Protocol

import msgpack
import numpy as np

from gpuledger.agent.mig import GPU_READINGS, NO_READINGS
from gpuledger.collector import rollup
from gpuledger.collector.aggregate import PAIR_FLOATS, GpuKey, WindowSegment
from gpuledger.collector.chunks import (
    LIGHT_MAX_ROWS,
    NUMERIC_FIELDS,
    HostPart,
    column_list,
    columns_as_floats,
    decode_columns,
    decode_host_chunk,
    encode_host_chunk,
    encode_samples,
    encode_series_many,
    join_parts,
    merge_chunks,
    merge_columns,
    samples_of,
    series_columns,
)
from gpuledger.collector.db import MAX_LIST_VALUES, Database, upsert
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.schema.records import GpuSample

RAW, MINUTE, HOUR = 0, 1, 2
TIERS = (RAW, MINUTE, HOUR)
TIER_NAMES = {RAW: "raw", MINUTE: "1m", HOUR: "1h"}
RESOLUTION = {RAW: 0.0, MINUTE: 60.0, HOUR: 3600.0}
MERGE_OPEN_AT = 64  # an open interval's batch chunks are merged once there are this many (see mergeable_groups)
MERGE_MAX_ROWS = 512  # raw chunks this large are not merged (see mergeable_groups)
OPEN_MERGE_MAX_ROWS = LIGHT_MAX_ROWS  # an open interval merges only chunks this small (batches as they came)
_Columns = tuple[int, dict[str, tuple[str, Any, np.ndarray | None]]]  # a decoded chunk: rows, columns
_sample_time = operator.attrgetter("ts")
_sample_gpu = operator.attrgetter("host", "gpu_uuid", "mig")
_sample_gpu_order = operator.attrgetter("host", "gpu_uuid")  # not mig: None and str do not compare

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
  tier INTEGER NOT NULL, host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, bucket REAL NOT NULL,
  t_min REAL NOT NULL, t_max REAL NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS chunks_key ON chunks (tier, host, gpu_uuid, mig, bucket, t_min);
CREATE TABLE IF NOT EXISTS rollup_state (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, tier INTEGER NOT NULL, until REAL NOT NULL,
  PRIMARY KEY (host, gpu_uuid, mig, tier)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS expired (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, tier INTEGER NOT NULL, until REAL NOT NULL,
  PRIMARY KEY (host, gpu_uuid, mig, tier)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sealed (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, until REAL NOT NULL,
  PRIMARY KEY (host, gpu_uuid, mig)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS host_chunks (
  id INTEGER PRIMARY KEY, host TEXT NOT NULL, t_min REAL NOT NULL, t_max REAL NOT NULL, n INTEGER NOT NULL,
  data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS host_chunks_by_host ON host_chunks (host, t_min);
"""
# sealed: a GPU's samples before ``until`` are final: compaction seals them before it reads them to roll them up
# (``seal``), and ingest refuses a later arrival there as too late (``sealed``), whatever late window either has.
# host_chunks: raw samples of one batch (one host, several GPUs; chunks.encode_host_chunk), one row a batch, as
# ingest writes them; compaction splits them into the GPUs' raw chunks (plan_host_splits). Every raw read sees
# both. id: assigned in insertion order, so each insert appends to the table (a random id costs SQLite three
# times as much: every insert lands on another page).
HOST_SPLIT_MAX_ROWS = 200_000  # samples one split plan decodes at most (bounds compaction's memory)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each tier is kept (seconds; None = for good) and how much time one chunk spans."""

    raw_s: float = 7 * 86400.0
    minute_s: float | None = 90 * 86400.0
    hour_s: float | None = None
    raw_chunk_s: float = 3600.0
    minute_chunk_s: float = 86400.0
    hour_chunk_s: float = 30 * 86400.0

    def keep(self, tier: int) -> float | None:
        return (self.raw_s, self.minute_s, self.hour_s)[tier]

    def span(self, tier: int) -> float:
        return (self.raw_chunk_s, self.minute_chunk_s, self.hour_chunk_s)[tier]

    def check(self, window_s: float) -> None:
        if self.raw_s < window_s + self.raw_chunk_s:
            raise ValueError(f"raw retention {self.raw_s} s must cover the late window ({window_s} s) plus one chunk "
                             f"({self.raw_chunk_s} s): the aggregation rebuilds its window from raw samples")
        for tier in (MINUTE, HOUR):
            if self.span(tier) % RESOLUTION[tier] or self.span(tier) <= 0:
                raise ValueError(f"{TIER_NAMES[tier]} chunk span must be a positive multiple of {RESOLUTION[tier]} s")
        if self.raw_chunk_s <= 0:
            raise ValueError("raw chunk span must be positive")
        keeps = [k for k in (self.minute_s, self.hour_s) if k is not None]
        if any(k <= 0 for k in keeps):
            raise ValueError("retentions must be positive (None keeps a tier for good)")


@dataclass(frozen=True, slots=True)
class MergeGroup:
    """One GPU's chunks of one tier and interval that compaction merges into one."""

    tier: int
    gpu_key: GpuKey
    bucket: float
    max_rows: int  # only chunks with fewer rows take part


@dataclass(frozen=True, slots=True)
class RollUpPlan:
    """What one GPU's roll-up writes: its rollup chunks and, per tier, its state as read and as it becomes."""

    gpu_key: GpuKey
    states: tuple[tuple[int, float | None, float], ...]  # (tier, rolled up until as read, until after)
    chunks: list[tuple]  # chunk rows to insert
    minutes: int
    hours: int

    @property
    def changes(self) -> bool:
        return bool(self.chunks) or any(read != after for _, read, after in self.states)


@dataclass(frozen=True, slots=True)
class MergePlan:
    """One group's merged chunk and the chunks (by first time) it replaces."""

    key: tuple  # (tier, host, gpu_uuid, mig, bucket)
    t_mins: tuple[float, ...]
    chunk: tuple  # the merged chunk's row


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Host chunks of one host (by id) and the GPUs' raw chunks their rows become."""

    ids: tuple[int, ...]
    chunks: list[tuple]  # chunk rows to insert


@dataclass(frozen=True, slots=True)
class ExpiryPlan:
    """A GPU's chunks of one tier that retention lets go: every interval up to ``last_bucket``."""

    tier: int
    gpu_key: GpuKey
    last_bucket: float


class StaleCompaction(Exception):
    """A compaction plan whose reads no longer hold when it is applied (its transaction is rolled back; the
    next compaction plans again)."""


class SeriesReader(Protocol):
    """The query side: what the API, the CLI and the job report read."""

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]: ...

    def tiers(self) -> list[dict]: ...


class SeriesStore(SeriesReader, Protocol):
    """What the collector's store writes and compacts through (called with its lock held)."""

    def write_samples(self, samples: list[GpuSample]) -> None: ...
    def write_series(self, series: list[Series]) -> None: ...
    def write_host_series(self, series: list[Series]) -> None: ...
    def window(self, gpu_key: GpuKey, floor: float) -> list[WindowSegment]: ...
    def newest(self, host: str, gpu_keys: Iterable[GpuKey]) -> dict[GpuKey, list[WindowSegment]]: ...
    def roll_up(self, gpu_key: GpuKey, final_before: float) -> tuple[int, int]: ...
    def mergeable_groups(self, tier: int, now: float) -> list[MergeGroup]: ...
    def merge(self, group: MergeGroup) -> int: ...
    def expire(self, now: float) -> int: ...


def tier_for_step(complete: list[int], step: float | None) -> int:
    """Among ``complete`` tiers (finest first), the coarsest whose resolution is at most ``step``, else the finest."""
    fit = [t for t in complete if RESOLUTION[t] <= step] if step else []
    return fit[-1] if fit else complete[0]


def bucket_step(tier: int, step: float | None) -> float:
    """The bucket width a query of ``tier`` answers in: ``step`` (default the tier's resolution) rounded up to a
    multiple of the resolution."""
    res = RESOLUTION[tier]
    out = float(step) if step else res
    return math.ceil(out / res - 1e-9) * res if res else out


def _intervals(ts: np.ndarray, span: float) -> list[tuple[int, int, float]]:
    """(start, end, interval start) of each run of time-sorted ``ts`` within one raw interval of ``span``
    (the interval of every sample at once: the same value as math.floor(ts / span) * span)."""
    starts = np.floor(ts / span) * span
    cuts = [0, *(np.flatnonzero(starts[1:] != starts[:-1]) + 1).tolist(), len(ts)]
    return [(i, j, float(starts[i])) for i, j in zip(cuts, cuts[1:])]


_STATE_COLUMNS = ("host", "gpu_uuid", "mig", "tier", "until")
_STATE_KEY = ("host", "gpu_uuid", "mig", "tier")
_SET_ROLLUP_STATE = upsert("rollup_state", _STATE_COLUMNS, _STATE_KEY)
# how far a GPU's tier is gone only grows (a later expire never moves it back)
_EXPIRED_UNTIL = upsert("expired", _STATE_COLUMNS, _STATE_KEY) + " WHERE excluded.until > expired.until"
# a seal only moves forward (a sample refused once stays refused)
_SEAL = upsert("sealed", ("host", "gpu_uuid", "mig", "until"), ("host", "gpu_uuid", "mig")) + \
    " WHERE excluded.until > sealed.until"
_INSERT_CHUNK = ("INSERT INTO chunks (tier, host, gpu_uuid, mig, bucket, t_min, t_max, n, data) "
                 "VALUES (?,?,?,?,?,?,?,?,?)")
_CHUNK_ORDER = " ORDER BY bucket, t_min"  # the unique index's order: the same rows in the same order on any engine


class ChunkSeriesStore:
    """Series in the collector's database (tables ``chunks``, ``rollup_state``, ``expired``), SQLite or
    PostgreSQL."""

    def __init__(self, db: Database, retention: Retention = Retention()) -> None:
        self._db = db
        self.retention = retention
        db.script(SCHEMA)

    def on(self, db: Database) -> ChunkSeriesStore:
        """This store through another connection to its database (``Database.reader``: compaction plans there)."""
        other = copy.copy(self)
        other._db = db
        return other

    def repack_v1_samples(self, fields: tuple[str, ...]) -> None:
        """Schema 1 kept one msgpack row per sample (table ``samples``); repack them into chunks and drop
        the table (inside the caller's transaction)."""
        groups: dict[tuple, list[GpuSample]] = {}
        for (data,) in self._db.execute("SELECT data FROM samples ORDER BY host, gpu_uuid, mig, ts"):
            sample = GpuSample.from_dict(dict(zip(fields, msgpack.unpackb(data, raw=False))))
            groups.setdefault(self._chunk_key(sample), []).append(sample)
        self._insert_raw(groups)
        self._db.execute("DROP TABLE samples")

    # -- raw samples: compressed chunks -------------------------------------------------------
    def _chunk_key(self, s: GpuSample) -> tuple[str, str, str, float]:
        span = self.retention.raw_chunk_s
        return (s.host, s.gpu_uuid, s.mig or "", math.floor(s.ts / span) * span)

    def write_samples(self, samples: list[GpuSample]) -> None:
        """One chunk per GPU and raw interval of these samples (sorted by time)."""
        span = self.retention.raw_chunk_s
        groups: dict[tuple, list[GpuSample]] = {}
        # Group a GPU's run at a time, not sample by sample: a stable sort keeps each GPU's samples in time
        # order (MIG instances of one GPU may come in several runs; they are appended in order).
        for (host, uuid, mig), gpu_run in groupby(sorted(samples, key=_sample_gpu_order), key=_sample_gpu):
            run = list(gpu_run)
            for i, j, bucket in _intervals(np.array(list(map(_sample_time, run)), dtype=np.float64), span):
                groups.setdefault((host, uuid, mig or "", bucket), []).extend(run[i:j])
        self._insert_raw(groups)

    def write_series(self, series: list[Series]) -> None:
        """One chunk per series and raw interval (each series strictly increasing in time)."""
        span = self.retention.raw_chunk_s
        parts, buckets = [], []
        for s in series:
            for i, j, bucket in _intervals(s.ts, span):
                parts.append(s if j - i == s.n else s.slice(i, j))
                buckets.append(bucket)
        if parts:  # a batch's chunks packed together: numpy's per-call cost is shared by its GPUs
            self._db.executemany(_INSERT_CHUNK, [
                (RAW, p.host, p.gpu_uuid, p.mig or "", b, float(p.ts[0]), float(p.ts[-1]), p.n, blob)
                for p, b, blob in zip(parts, buckets, encode_series_many(parts))])

    def write_host_series(self, series: list[Series]) -> None:
        """One batch's series (one host; each with the agent's wire columns, in time order) as one host chunk."""
        if series:
            self._db.execute(
                "INSERT INTO host_chunks (host, t_min, t_max, n, data) VALUES (?,?,?,?,?)",
                (series[0].host, min([s.ts[0] for s in series]).item(),
                 max([s.ts[-1] for s in series]).item(), sum([s.n for s in series]), encode_host_chunk(series)))

    def _insert_raw(self, groups: dict[tuple, list[GpuSample]]) -> None:
        self._db.executemany(
            _INSERT_CHUNK,
            [(RAW, *k, g[0].ts, g[-1].ts, len(g), encode_samples(g)) for k, g in groups.items()],
        )

    def _chunk_rows(self, tier: int, gpu_key: GpuKey, start: float, end: float) -> list[tuple[bytes]]:
        span = self.retention.span(tier)
        lo = math.floor(start / span) * span if math.isfinite(start) else -1e300
        return self._db.execute(
            "SELECT data FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket>=? AND bucket<=? "
            "AND t_max>=? AND t_min<=?" + _CHUNK_ORDER,
            (tier, *gpu_key, lo, end, start, end),
        ).fetchall()

    def _host_parts(self, host: str, start: float = -math.inf, end: float = math.inf) -> dict[GpuKey, list[_Columns]]:
        """The host chunks of ``host`` reaching into [start, end], decoded, by GPU."""
        rows = self._db.execute(
            "SELECT data FROM host_chunks WHERE host=? AND t_max>=? AND t_min<=? ORDER BY t_min, id",
            (host, max(start, -1e300), min(end, 1e300))).fetchall()
        out: dict[GpuKey, list[_Columns]] = {}
        for (data,) in rows:
            for part in decode_host_chunk(data):
                out.setdefault((host, *part.key[1:]), []).append(series_columns(part.series(host)))
        return out

    def _raw_parts(self, gpu_key: GpuKey, start: float, end: float) -> list[_Columns]:
        """A GPU's raw chunks reaching into [start, end], decoded: its own, then its part of its host's host
        chunks."""
        parts = [decode_columns(data) for (data,) in self._chunk_rows(RAW, gpu_key, start, end)]
        return parts + self._host_parts(gpu_key[0], start, end).get(gpu_key, [])

    def _read_raw(self, gpu_key: GpuKey, start: float, end: float) -> list[GpuSample]:
        host, uuid, mig = gpu_key
        out: list[GpuSample] = []
        for n, cols in self._raw_parts(gpu_key, start, end):
            out.extend(smp for smp in samples_of(n, cols, host, uuid, mig or None) if start <= smp.ts <= end)
        out.sort(key=_sample_time)
        return out

    def _raw_arrays(self, gpu_key: GpuKey, start: float, end: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Raw samples with start <= ts < end as arrays (for rollups), unsorted."""
        ts_parts, val_parts = [], []
        for n, cols in self._raw_parts(gpu_key, start, end):
            ts, vals = columns_as_floats(n, cols, NUMERIC_FIELDS)
            keep = (ts >= start) & (ts < end)
            ts_parts.append(ts[keep])
            val_parts.append({f: v[keep] for f, v in vals.items()})
        if not ts_parts:
            return np.zeros(0), {f: np.zeros(0) for f in NUMERIC_FIELDS}
        return np.concatenate(ts_parts), {f: np.concatenate([p[f] for p in val_parts]) for f in NUMERIC_FIELDS}

    def _rollup_rows(self, tier: int, gpu_key: GpuKey, start: float, end: float) -> rollup.Rollup:
        """Stored rollup rows of a tier with start <= ts < end."""
        r = rollup.concat([rollup.decode(d) for (d,) in self._chunk_rows(tier, gpu_key, start, end)])
        return r.select((r.ts >= start) & (r.ts < end))

    def window(self, gpu_key: GpuKey, floor: float) -> list[WindowSegment]:
        """A GPU's stored samples at or after ``floor`` plus the newest one before it (the anchor), as the
        aggregation window keeps them: time-ordered columns of the fields pair contributions read, one
        segment per run of one job set, straight from the chunks (no object per sample: a restart reads
        every GPU's window). Read from the GPU's own chunks and its parts of its host's host chunks (all of
        them: they are recent)."""
        host_parts = self._host_parts(gpu_key[0]).get(gpu_key, [])
        (newest_before,) = self._db.execute(
            "SELECT MAX(t_max) FROM chunks WHERE tier=0 AND host=? AND gpu_uuid=? AND mig=? AND t_max<?",
            (*gpu_key, floor),
        ).fetchone()
        # the anchor is in a chunk ending at newest_before, or in one reaching past floor: such a chunk keeps its
        # samples before floor too (the newest of them may be the anchor); or in a host chunk
        lo = floor if newest_before is None else newest_before
        oldest_kept = -math.inf if newest_before is None else newest_before
        span = self.retention.raw_chunk_s
        chunks = self._db.execute(
            "SELECT data FROM chunks WHERE tier=0 AND host=? AND gpu_uuid=? AND mig=? AND bucket>=? AND t_max>=?"
            + _CHUNK_ORDER,
            (*gpu_key, math.floor(lo / span) * span, lo),
        ).fetchall()
        ts_parts: list[np.ndarray] = []
        cols: dict[str, list[np.ndarray]] = {f: [] for f in PAIR_FLOATS}
        job_set_codes: list[np.ndarray] = []
        job_sets: dict[tuple, int] = {}  # (job_ids, job_shares) -> code
        for n, columns in [*(decode_columns(data) for (data,) in chunks), *host_parts]:
            ts, vals = columns_as_floats(n, columns, PAIR_FLOATS)
            keep = np.flatnonzero(ts >= oldest_kept)
            if not keep.size:
                continue
            ts_parts.append(ts[keep])
            for f in PAIR_FLOATS:
                cols[f].append(vals[f][keep])
            ids = column_list(n, columns["job_ids"]) if "job_ids" in columns else [()] * n
            shares = column_list(n, columns["job_shares"]) if "job_shares" in columns else [()] * n
            if ids.count(ids[0]) == n and shares.count(shares[0]) == n:  # the usual chunk: one job set
                key = (tuple(ids[0] or ()), tuple(shares[0] or ()))
                job_set_codes.append(np.full(keep.size, job_sets.setdefault(key, len(job_sets))))
            else:
                job_set_codes.append(np.array([
                    job_sets.setdefault((tuple(ids[i] or ()), tuple(shares[i] or ())), len(job_sets))
                    for i in keep.tolist()]))
        if not ts_parts:
            return []
        ts = np.concatenate(ts_parts)
        order = np.argsort(ts, kind="stable")
        ts = ts[order]
        first = max(int(np.searchsorted(ts, floor, side="left")) - 1, 0)  # the anchor
        order, ts = order[first:], ts[first:]
        code = np.concatenate(job_set_codes)[order]
        arrays = {f: np.concatenate(cols[f])[order] for f in PAIR_FLOATS}
        job_set_of = {v: k for k, v in job_sets.items()}
        cuts = [0, *(np.flatnonzero(code[1:] != code[:-1]) + 1).tolist(), len(ts)]
        return [WindowSegment(ts[a:b], {f: v[a:b] for f, v in arrays.items()}, *job_set_of[int(code[a])])
                for a, b in zip(cuts, cuts[1:])]

    def newest(self, host: str, gpu_keys: Iterable[GpuKey]) -> dict[GpuKey, list[WindowSegment]]:
        """Each of these GPUs' (one host's) newest stored sample as a window of one row, [] where none is stored:
        what a GPU restored into the aggregation keeps in memory (the start of its next interval; a late sample
        reads the rest of its window back, ``window``). Read from the GPU's newest chunk (the one ending last in its
        newest interval) and its host's host chunks (each decoded once for all the host's GPUs)."""
        parts = self._host_parts(host)
        out: dict[GpuKey, list[WindowSegment]] = {}
        for gpu_key in gpu_keys:
            row = self._db.execute(
                "SELECT data FROM chunks WHERE tier=0 AND host=? AND gpu_uuid=? AND mig=? ORDER BY bucket DESC, "
                "t_max DESC LIMIT 1", gpu_key).fetchone()
            best: tuple[float, int, np.ndarray, dict[str, np.ndarray], _Columns] | None = None
            for n, columns in [*([decode_columns(row[0])] if row else []), *parts.get(gpu_key, [])]:
                ts, vals = columns_as_floats(n, columns, PAIR_FLOATS)
                i = int(ts.argmax())
                if best is None or ts[i] > best[0]:
                    best = (float(ts[i]), i, ts, vals, (n, columns))
            if best is None:
                out[gpu_key] = []
                continue
            _, i, ts, vals, (n, columns) = best
            ids = column_list(n, columns["job_ids"])[i] if "job_ids" in columns else ()
            shares = column_list(n, columns["job_shares"])[i] if "job_shares" in columns else ()
            out[gpu_key] = [WindowSegment(ts[i:i + 1], {f: v[i:i + 1] for f, v in vals.items()}, tuple(ids or ()),
                                          tuple(shares or ()))]
        return out

    # -- compaction: rollups, merging, retention ----------------------------------------------
    # Each step is planned from reads alone (``plan_*``: on any connection, another thread's included, without
    # the store's lock), then applied in a transaction (``apply_*``) that first checks that what the plan read
    # still holds (StaleCompaction otherwise: roll the transaction back and plan again). Only compaction
    # rewrites rollups and state or deletes chunks, and one compacts at a time (the compaction lock); ingest only
    # adds raw chunks of minutes that are not sealed (``seal``: compaction seals before it plans a roll-up), so a plan
    # stays valid while ingest goes on.
    def split_hosts(self, newest: Mapping[str, float] | None = None, span_s: float = 0.0,
                    min_chunks: int = 1) -> list[str]:
        """The hosts whose host chunks are to be split: with ``newest`` (each host's newest sample), those whose
        oldest host chunk starts ``span_s`` or more before it, or that hold ``min_chunks`` host chunks or more
        (each split then makes chunks of many rows a GPU, not one batch's few); without, every host that has any."""
        rows = self._db.execute("SELECT host, MIN(t_min), COUNT(*) FROM host_chunks GROUP BY host").fetchall()
        if newest is None:
            return sorted(h for h, _, _ in rows)
        return sorted(h for h, oldest, count in rows
                      if count >= min_chunks or newest.get(h, math.inf) - oldest >= span_s)

    def plan_host_splits(self, host: str) -> Iterator[SplitPlan]:
        """A host's host chunks as its GPUs' raw chunks, one per GPU and raw interval (reads only), in plans of at
        most ``HOST_SPLIT_MAX_ROWS`` samples (a backlog never takes memory without bound)."""
        sizes = self._db.execute("SELECT id, n FROM host_chunks WHERE host=? ORDER BY t_min, id", (host,)).fetchall()
        ids: list[int] = []
        rows = 0
        for i, (chunk_id, n) in enumerate(sizes):
            ids.append(chunk_id)
            rows += n
            if rows >= HOST_SPLIT_MAX_ROWS or i == len(sizes) - 1:
                yield self._plan_split(host, ids)
                ids, rows = [], 0

    def _plan_split(self, host: str, ids: list[int]) -> SplitPlan:
        by_gpu: dict[GpuKey, list[HostPart]] = {}
        for at in range(0, len(ids), MAX_LIST_VALUES):
            chunk_ids = ids[at:at + MAX_LIST_VALUES]
            for (data,) in self._db.execute(
                    f"SELECT data FROM host_chunks WHERE id IN ({','.join('?' * len(chunk_ids))}) ORDER BY t_min, id",
                    chunk_ids).fetchall():
                for part in decode_host_chunk(data):
                    by_gpu.setdefault((host, *part.key[1:]), []).append(part)
        span = self.retention.raw_chunk_s
        series: list[tuple[Series, float]] = []  # each GPU's rows of an interval, encoded together below
        odd: list[tuple[GpuKey, list[_Columns]]] = []  # GPUs whose batches differ (a job change): merged apart
        for gpu_key, parts in sorted(by_gpu.items()):
            joined = join_parts(parts, host)  # (parts in the order their batches came: a GPU's times in order)
            if joined is None or not bool((joined.ts[1:] > joined.ts[:-1]).all()):
                odd.append((gpu_key, [series_columns(p.series(host)) for p in parts]))
                continue
            for i, j, bucket in _intervals(joined.ts, span):
                series.append((joined if j - i == joined.n else joined.slice(i, j), bucket))
        chunks = [(RAW, *s.key, bucket, float(s.ts[0]), float(s.ts[-1]), s.n, blob)
                  for (s, bucket), blob in zip(series, encode_series_many([s for s, _ in series]))]
        chunks += [(RAW, *gpu_key, bucket, t_min, t_max, n, blob) for gpu_key, parts in odd
                   for blob, n, t_min, t_max, bucket in merge_columns(parts, span)]
        return SplitPlan(tuple(ids), chunks)

    def apply_host_split(self, plan: SplitPlan) -> int:
        """Replace a plan's host chunks by the GPUs' chunks (inside the caller's transaction); returns how many
        host chunks went."""
        gone = 0
        for at in range(0, len(plan.ids), MAX_LIST_VALUES):
            part = plan.ids[at:at + MAX_LIST_VALUES]
            gone += self._db.execute(f"DELETE FROM host_chunks WHERE id IN ({','.join('?' * len(part))})",
                                     part).rowcount
        if gone != len(plan.ids):
            raise StaleCompaction(f"{len(plan.ids)} host chunks planned for splitting, {gone} found")
        self._db.executemany(_INSERT_CHUNK, plan.chunks)
        return gone

    def seal(self, horizons: Iterable[tuple[GpuKey, float]]) -> None:
        """Seal each GPU's samples before its time (inside the caller's transaction; a seal never moves back):
        from its commit on, ingest refuses them as too late (:meth:`sealed`), so a roll-up planned after it reads
        every sample its minutes will ever have."""
        self._db.executemany(_SEAL, [(*gpu_key, until) for gpu_key, until in horizons])

    def sealed(self, host: str) -> dict[GpuKey, float]:
        """Per GPU of ``host`` that has one: the time its samples are final before (a later arrival there is too
        late): its seal, or how far its minutes are rolled up where that is further (a store rolled up before
        seals were kept)."""
        out: dict[GpuKey, float] = {}
        for uuid, mig, until in self._db.execute(
                "SELECT gpu_uuid, mig, until FROM sealed WHERE host=? UNION ALL "
                "SELECT gpu_uuid, mig, until FROM rollup_state WHERE host=? AND tier=?", (host, host, MINUTE)):
            key = (host, uuid, mig)
            out[key] = max(out.get(key, -math.inf), until)
        return out

    def rolled_up_until(self, gpu_key: GpuKey, tier: int) -> float | None:
        """How far ``tier`` is rolled up for this GPU (None: not yet)."""
        row = self._db.execute(
            "SELECT until FROM rollup_state WHERE host=? AND gpu_uuid=? AND mig=? AND tier=?", (*gpu_key, tier)
        ).fetchone()
        return None if row is None else row[0]

    def _rollup_states(self, gpu_key: GpuKey) -> dict[int, float]:
        """How far each rolled-up tier is for this GPU (a tier not there: not yet), in one read: a roll-up's plan
        and its apply read both tiers for every GPU compaction rolls up."""
        return dict(self._db.execute("SELECT tier, until FROM rollup_state WHERE host=? AND gpu_uuid=? AND mig=?",
                                     gpu_key).fetchall())

    def _first_times(self, gpu_key: GpuKey, tiers: list[int]) -> dict[int, float]:
        """The first time stored in each of these tiers for this GPU (a tier not there: nothing stored), in one
        read: a GPU's first roll-up wants both its raw and its minute tier's."""
        if not tiers:
            return {}
        return dict(self._db.execute(
            f"SELECT tier, MIN(t_min) FROM chunks WHERE tier IN ({','.join('?' * len(tiers))}) AND host=? AND "
            "gpu_uuid=? AND mig=? GROUP BY tier", (*tiers, *gpu_key)).fetchall())

    @staticmethod
    def _resume(state: float | None, first: float | None, tier: int, horizon: float) -> float:
        """Where rolling up into ``tier`` goes on: its saved state, else the start of the finer tier's first
        chunk (on the tier's grid), never past ``horizon``."""
        if state is not None:
            return state
        res = RESOLUTION[tier]
        return horizon if first is None else min(horizon, math.floor(first / res) * res)

    def plan_roll_up(self, gpu_key: GpuKey, final_before: float) -> RollUpPlan:
        """What rolling up this GPU's minutes that end by ``final_before`` (no late sample can change them any
        more), then its hours of rolled-up minutes, writes (reads only)."""
        horizon = math.floor(final_before / 60.0) * 60.0
        states = self._rollup_states(gpu_key)
        minute_state, hour_state = states.get(MINUTE), states.get(HOUR)
        # where a tier not rolled up yet starts from: the finer tier's first time (read now: only this compaction
        # writes rollups, so the minute tier's is the same read here as after the raw roll-up below)
        firsts = self._first_times(gpu_key, [t for t, state in ((RAW, minute_state), (MINUTE, hour_state))
                                             if state is None])
        until = self._resume(minute_state, firsts.get(RAW), MINUTE, horizon)
        minutes = rollup.empty()
        if horizon > until:
            ts, vals = self._raw_arrays(gpu_key, until, horizon)
            minutes = rollup.from_raw(ts, vals, 60.0)
            until = horizon
        hour_horizon = math.floor(until / 3600.0) * 3600.0
        first_minute = None
        if hour_state is None:  # the first minute stored, or rolled up just now
            minute_firsts = [t for t in (firsts.get(MINUTE), float(minutes.ts[0]) if len(minutes) else None)
                             if t is not None]
            first_minute = min(minute_firsts) if minute_firsts else None
        hours_until = self._resume(hour_state, first_minute, HOUR, hour_horizon)
        hours = rollup.empty()
        if hour_horizon > hours_until:
            # the stored minutes, then the new ones (all later): the rows in the order one transaction read them
            fresh = minutes.select((minutes.ts >= hours_until) & (minutes.ts < hour_horizon))
            hours = rollup.combine(rollup.concat([self._rollup_rows(MINUTE, gpu_key, hours_until, hour_horizon),
                                                  fresh]), 3600.0)
            hours_until = hour_horizon
        return RollUpPlan(gpu_key, ((MINUTE, minute_state, until), (HOUR, hour_state, hours_until)),
                          self._rollup_chunks(MINUTE, gpu_key, minutes) + self._rollup_chunks(HOUR, gpu_key, hours),
                          len(minutes), len(hours))

    def apply_roll_up(self, plan: RollUpPlan) -> tuple[int, int]:
        """Write a roll-up plan (inside the caller's transaction); returns (minutes, hours) written."""
        states = self._rollup_states(plan.gpu_key)
        for tier, read, _ in plan.states:
            if states.get(tier) != read:
                raise StaleCompaction(f"{plan.gpu_key} tier {TIER_NAMES[tier]}: rolled up since it was planned")
        if plan.chunks:
            self._db.executemany(_INSERT_CHUNK, plan.chunks)
        self._db.executemany(_SET_ROLLUP_STATE, [(*plan.gpu_key, tier, until) for tier, _, until in plan.states])
        return plan.minutes, plan.hours

    def roll_up(self, gpu_key: GpuKey, final_before: float) -> tuple[int, int]:
        """Roll up this GPU's final minutes and hours (:meth:`plan_roll_up`) in one transaction. Returns
        (minutes, hours) written."""
        with self._db.transaction():
            return self.apply_roll_up(self.plan_roll_up(gpu_key, final_before))

    def _rollup_chunks(self, tier: int, gpu_key: GpuKey, r: rollup.Rollup) -> list[tuple]:
        """A rollup's chunk rows, one per interval of the tier's span."""
        if not len(r):
            return []
        span = self.retention.span(tier)
        buckets = np.floor(r.ts / span) * span
        out = []
        for bucket in np.unique(buckets).tolist():
            part = r.select(buckets == bucket)
            out.append((tier, *gpu_key, bucket, float(part.ts[0]), float(part.ts[-1]), len(part), rollup.encode(part)))
        return out

    def mergeable_groups(self, tier: int, now: float,
                         final_before: Mapping[GpuKey, float] | None = None) -> list[MergeGroup]:
        """Each (GPU, interval) whose small chunks are to be merged into one: closed intervals always, an open
        one once it has ``MERGE_OPEN_AT`` chunks as batches wrote them (``OPEN_MERGE_MAX_ROWS`` rows at most;
        only those are merged there: re-packing the interval's merged chunks with every 16 new batches cost
        compaction most of its CPU, so they wait for the interval to close). An interval is closed once it ended
        by ``now`` and, for a GPU in ``final_before`` (its newest sample - the late window), by that time too:
        one whose agent still sends samples of that interval (a backlog, a clock behind) would otherwise be
        merged again at every pass, each time re-packing every sample merged before. Raw chunks of
        ``MERGE_MAX_ROWS`` rows or more are left alone: they compress within a few per cent of a merged one, and
        re-packing every sample of a large-batch cluster would cost compaction as much CPU as ingest."""
        span = self.retention.span(tier)
        max_rows = MERGE_MAX_ROWS if tier == RAW else 2**62
        groups = self._db.execute(
            "SELECT host, gpu_uuid, mig, bucket, COUNT(*), COALESCE(SUM(CASE WHEN n<=? THEN 1 ELSE 0 END), 0) "
            "FROM chunks WHERE tier=? AND n<? GROUP BY host, gpu_uuid, mig, bucket HAVING COUNT(*) > 1",
            (OPEN_MERGE_MAX_ROWS, tier, max_rows)
        ).fetchall()
        final = final_before if final_before is not None and tier == RAW else {}
        out = []
        for host, uuid, mig, bucket, _, small in sorted(groups):  # sorted here: the engines' collations differ
            if bucket + span <= min(now, final.get((host, uuid, mig), now)):
                out.append(MergeGroup(tier, (host, uuid, mig), bucket, max_rows))
            elif small >= MERGE_OPEN_AT:
                out.append(MergeGroup(tier, (host, uuid, mig), bucket, OPEN_MERGE_MAX_ROWS + 1))
        return out

    def plan_merge(self, group: MergeGroup) -> MergePlan | None:
        """The merged chunk of a group's chunks as they are now, and which chunks it replaces (reads only); None
        when there is nothing to merge."""
        key = (group.tier, *group.gpu_key, group.bucket)
        rows = self._db.execute(
            "SELECT t_min, data FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket=? AND n<?"
            + _CHUNK_ORDER, (*key, group.max_rows),
        ).fetchall()
        if len(rows) < 2:
            return None
        blob, n, t_min, t_max = merge_chunks([r[1] for r in rows])
        return MergePlan(key, tuple(r[0] for r in rows), (*key, t_min, t_max, n, blob))

    def apply_merge(self, plan: MergePlan) -> int:
        """Replace a plan's chunks by its merged one (inside the caller's transaction); returns how many chunks
        were merged away."""
        # (key, t_min) is the unique index: one chunk each; chunks ingest added since are not among them
        gone = self._db.execute(
            "DELETE FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket=? AND t_min IN ("
            + ",".join("?" * len(plan.t_mins)) + ")", (*plan.key, *plan.t_mins)).rowcount
        if gone != len(plan.t_mins):
            raise StaleCompaction(f"{plan.key}: {len(plan.t_mins)} chunks planned for merging, {gone} found")
        self._db.execute(_INSERT_CHUNK, plan.chunk)
        return gone - 1

    def merge(self, group: MergeGroup) -> int:
        """Merge one group's chunks in one transaction; returns how many chunks were merged away."""
        with self._db.transaction():
            plan = self.plan_merge(group)
            return 0 if plan is None else self.apply_merge(plan)

    def plan_expiry(self, now: float, window_floors: Mapping[GpuKey, float] | None = None) -> list[ExpiryPlan]:
        """Per tier and GPU, the newest interval whose chunks retention lets go: older than the tier's retention,
        and (raw and minute data) rolled up into the next tier already (reads only).

        ``window_floors``: per GPU, where its aggregation window begins (newest sample - window_s). Retention runs
        on the clock, the window on sample time: samples that arrive late in life (a spool replayed after a week)
        are past retention yet in the window. Raw chunks the window reads (:meth:`window`: from the floor on, and
        the newest sample before it, the start of the interval a late sample splits) are kept whatever their age,
        or that interval would be counted twice."""
        plans = []
        for tier in TIERS:
            keep = self.retention.keep(tier)
            if keep is None:
                continue
            span = self.retention.span(tier)
            where = "FROM chunks WHERE tier=? AND bucket + ? <= ?"
            args: tuple = (tier, span, now - keep)
            if tier != HOUR:
                where += (" AND bucket + ? <= COALESCE((SELECT until FROM rollup_state r WHERE r.host=chunks.host "
                          "AND r.gpu_uuid=chunks.gpu_uuid AND r.mig=chunks.mig AND r.tier=?), -1e300)")
                args += (span, tier + 1)
            rows = self._db.execute(f"SELECT host, gpu_uuid, mig, MAX(bucket) {where} GROUP BY host, gpu_uuid, mig",
                                    args).fetchall()
            for h, u, m, b in sorted(rows):
                if tier == RAW and window_floors and (floor := window_floors.get((h, u, m))) is not None:
                    b = self._before_window(tier, (h, u, m), b, floor, span)
                    if b is None:
                        continue
                plans.append(ExpiryPlan(tier, (h, u, m), b))
        return plans

    def _before_window(self, tier: int, gpu_key: GpuKey, last_bucket: float, floor: float,
                       span: float) -> float | None:
        """``last_bucket``, or the newest bucket before the one holding the GPU's window anchor (the newest raw
        chunk with a sample before ``floor``), None when nothing is left to expire. Both only move forward with
        time, so a plan stays valid."""
        (anchor,) = self._db.execute(
            "SELECT MAX(bucket) FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND t_min<?",
            (tier, *gpu_key, floor)).fetchone()
        if anchor is None or anchor > last_bucket:
            return last_bucket
        (older,) = self._db.execute(
            "SELECT MAX(bucket) FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket<=?",
            (tier, *gpu_key, anchor - span)).fetchone()
        return older

    def apply_expiry(self, plan: ExpiryPlan) -> int:
        """Delete a GPU's chunks of a tier up to the plan's interval (inside the caller's transaction; both
        conditions only grow true with time, so a plan stays valid); returns how many were deleted."""
        deleted = self._db.execute("DELETE FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket<=?",
                                   (plan.tier, *plan.gpu_key, plan.last_bucket)).rowcount
        # remember how far each GPU's tier is gone, so queries pick a tier that is complete
        self._db.execute(_EXPIRED_UNTIL, (*plan.gpu_key, plan.tier,
                                          plan.last_bucket + self.retention.span(plan.tier)))
        return deleted

    def expire(self, now: float) -> int:
        """Delete chunks older than their tier's retention, but never raw or minute data that the
        next tier has not rolled up yet, in one transaction. Returns how many chunks were deleted."""
        with self._db.transaction():
            return sum(self.apply_expiry(p) for p in self.plan_expiry(now))

    # -- reads --------------------------------------------------------------------------------
    def pick_tier(self, gpu_key: GpuKey, start: float, step: float | None = None) -> int:
        """The tier a query from ``start`` reads: among tiers still complete from the query's first bucket on
        (from ``start`` itself for raw samples; none of that GPU's data after it expired), the coarsest whose
        resolution is at most ``step``, else the finest complete one; when none reaches back that far, the hour
        tier. (By the bucket, not ``start``: the first bucket begins before ``start``, and a tier expired in
        between would answer it partial.)"""
        gone = dict(self._db.execute(
            "SELECT tier, until FROM expired WHERE host=? AND gpu_uuid=? AND mig=?", gpu_key).fetchall())

        def first(tier: int) -> float:  # where the query reads this tier from (series: its first bucket's start)
            width = bucket_step(tier, step)
            return math.floor(start / width) * width if width else start

        complete = [t for t in TIERS if first(t) >= gone.get(t, -math.inf)]
        return tier_for_step(complete, step) if complete else HOUR

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        """One GPU's (or MIG instance's) data with start <= ts <= end, in time order.

        Raw samples (``GpuSample``) when the raw tier is picked and no ``step`` is asked; otherwise
        ``RollupPoint`` buckets of ``step`` seconds (at least the tier's resolution, rounded up to a
        multiple of it), aligned to multiples of it: every bucket that holds a time in [start, end], each
        whole (its first and last too, so a bucket says the same whichever tier answers it: a stored rollup is
        whole, and what is summarised on the fly is read to the bucket's end). The newest minutes that are not
        rolled up yet are summarised from the finer tier on the fly, so a rollup query also covers recent data.
        ``tier`` forces a tier.

        A MIG instance's series holds none of its GPU's readings (``agent.mig.as_series``): the aggregation stores
        each of its rows with copies of them (``aggregate.normalize_mig``; its window reads them back) beside the
        GPU's own row, whose series shows them, once. (Rows written here with no whole-GPU series beside them
        read back as written.)

        One read snapshot (``Database.snapshot``): a query reads several tables (what expired, the rollups and
        how far they go, the GPU's raw chunks, its host's host chunks), and a compaction committed between two
        of those reads (another process: its split of host chunks, a roll-up, an expiry) would lose or double
        samples in the answer.
        """
        gpu_key = (host, gpu_uuid, mig or "")
        with self._db.snapshot():
            copies = bool(mig) and self._has_own_series(host, gpu_uuid)
            tier = self.pick_tier(gpu_key, start, step) if tier is None else tier
            if tier == RAW and not step:
                raw = self._read_raw(gpu_key, start, end)
                return [replace(s, **NO_READINGS) for s in raw] if copies else raw
            step = bucket_step(tier, step)
            lo = math.floor(start / step) * step
            hi = math.nextafter((math.floor(end / step) + 1) * step, -math.inf)  # the end of end's bucket
            rows = self._tier_rows(tier, gpu_key, lo, hi)
        if copies:
            rows = rollup.Rollup(rows.ts, rows.samples, {f: v for f, v in rows.stats.items() if f not in GPU_READINGS})
        return rollup.combine(rows, step).points(step, TIER_NAMES[tier])

    def _has_own_series(self, host: str, gpu_uuid: str) -> bool:
        """Whether a MIG GPU's whole-GPU series is stored (the aggregation stores one with every MIG GPU's rows)."""
        return self._db.execute(
            "SELECT 1 FROM chunks WHERE tier IN (0, 1, 2) AND host=? AND gpu_uuid=? AND mig='' LIMIT 1",
            (host, gpu_uuid)).fetchone() is not None

    def _tier_rows(self, tier: int, gpu_key: GpuKey, start: float, end: float) -> rollup.Rollup:
        """Rows of ``tier``'s resolution (raw: one row per sample) for start <= ts <= end, filled in
        past the tier's rolled-up horizon from the tier below."""
        if tier == RAW:
            ts, vals = self._raw_arrays(gpu_key, start, math.nextafter(end, math.inf))
            return rollup.from_raw(ts, vals, 1e-6)  # one row per sample (distinct times)
        until = self.rolled_up_until(gpu_key, tier)
        until = -math.inf if until is None else until
        stored = self._rollup_rows(tier, gpu_key, start, min(math.nextafter(end, math.inf), until))
        if end < until:
            return stored
        tail = rollup.combine(self._tier_rows(tier - 1, gpu_key, max(start, until), end), RESOLUTION[tier])
        return rollup.concat([stored, tail])

    def tiers(self) -> list[dict]:
        """Per tier: chunks, rows and bytes stored, oldest and newest time (for the CLI and metrics); one snapshot,
        so a split of host chunks committed meanwhile is counted once."""
        with self._db.snapshot():
            rows = self._db.execute(
                "SELECT tier, COUNT(*), COALESCE(SUM(n), 0), COALESCE(SUM(LENGTH(data)), 0), MIN(t_min), MAX(t_max) "
                "FROM chunks GROUP BY tier"
            ).fetchall()
            count, n, size, oldest, newest = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n), 0), COALESCE(SUM(LENGTH(data)), 0), MIN(t_min), MAX(t_max) "
                "FROM host_chunks").fetchone()
        have = {r[0]: r for r in rows}
        if count:  # batches not split yet are raw samples too
            _, c0, n0, s0, o0, w0 = have.get(RAW, (RAW, 0, 0, 0, None, None))
            have[RAW] = (RAW, c0 + count, n0 + n, s0 + size, oldest if o0 is None else min(o0, oldest),
                         newest if w0 is None else max(w0, newest))
        return [{"tier": TIER_NAMES[t], "chunks": have[t][1] if t in have else 0,
                 "rows": int(have[t][2]) if t in have else 0, "bytes": int(have[t][3]) if t in have else 0,
                 "oldest": have[t][4] if t in have else None, "newest": have[t][5] if t in have else None,
                 "retention_s": self.retention.keep(t)} for t in TIERS]
