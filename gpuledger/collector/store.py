"""The embedded store: SQLite in WAL mode, one transaction per batch, aggregation kept in step.

Tables: raw samples in compressed columnar chunks (``collector.chunks``; one row per GPU per batch at
ingest, merged per GPU per ``raw_chunk_s`` interval by compaction), 1-minute and 1-hour rollups in
the same chunk format (``collector.rollup``), per-(job, host, GPU) usage sums, per-GPU totals, per-GPU
hourly buckets (cluster totals over a time range), job records, and ingested batch ids for
idempotency. Queries read the usage tables, never the raw samples. On open the aggregation window is
rebuilt from the stored samples, so a restart loses no exactness.

Tiers (``Retention``): raw chunks for ``raw_s`` (7 days), 1-minute rollups for ``minute_s`` (90
days), 1-hour rollups, per-job usage and hourly totals for good. ``compact(now)`` rolls up every
GPU's closed minutes (older than its newest sample minus the late window, so no late sample can
still change them), merges small chunks, then drops what retention allows; raw data is never dropped
before it is rolled up. Every step is one transaction and idempotent.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample, JobRecord, JobUsage
from gpuledger.collector import rollup
from gpuledger.collector.aggregate import (
    PAIR_FLOATS,
    AddCounts,
    Aggregator,
    GpuKey,
    GpuState,
    HourAcc,
    HourKey,
    UsageAcc,
    UsageKey,
    WindowSegment,
    summarize,
)
from gpuledger.collector.chunks import (
    NUMERIC_FIELDS,
    column_list,
    columns_as_floats,
    decode_arrays,
    decode_columns,
    decode_samples,
    encode_samples,
    encode_series_many,
    merge_chunks,
)
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.collector.validate import Batch, as_sample

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_U = UsageAcc.FIELDS
_H = HourAcc.FIELDS
_G = GpuState.TOTAL_FIELDS
RAW, MINUTE, HOUR = 0, 1, 2
TIER_NAMES = {RAW: "raw", MINUTE: "1m", HOUR: "1h"}
RESOLUTION = {RAW: 0.0, MINUTE: 60.0, HOUR: 3600.0}
_MERGE_AT = 16  # an open interval's chunks are merged once there are this many
_MERGE_ROWS = 512  # raw chunks this large are not merged (see _merge)
_TS, _GPU = operator.attrgetter("ts"), operator.attrgetter("host", "gpu_uuid", "mig")
_GPU_SORT = operator.attrgetter("host", "gpu_uuid")  # not mig: None and str do not compare

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
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
CREATE TABLE IF NOT EXISTS usage (
  job_id TEXT NOT NULL, host TEXT NOT NULL, gpu TEXT NOT NULL, {", ".join(_U)},
  PRIMARY KEY (job_id, host, gpu)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpus (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, {", ".join(_G)},
  PRIMARY KEY (host, gpu_uuid, mig)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpu_hours (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, hour REAL NOT NULL, {", ".join(_H)},
  PRIMARY KEY (host, gpu_uuid, mig, hour)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS gpu_hours_by_hour ON gpu_hours (hour);
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT NOT NULL, cluster TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (job_id, cluster)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batches (
  agent_id TEXT NOT NULL, seq INTEGER NOT NULL, received REAL NOT NULL, samples INTEGER NOT NULL,
  PRIMARY KEY (agent_id, seq)) WITHOUT ROWID;
"""


def _intervals(ts: np.ndarray, span: float) -> list[tuple[int, int, float]]:
    """(start, end, interval start) of each run of time-sorted ``ts`` within one raw interval of ``span``
    (the interval of every sample at once: the same value as math.floor(ts / span) * span)."""
    b = np.floor(ts / span) * span
    cuts = [0, *(np.flatnonzero(b[1:] != b[:-1]) + 1).tolist(), len(ts)]
    return [(i, j, float(b[i])) for i, j in zip(cuts, cuts[1:])]


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicate_samples: int = 0
    too_late: int = 0
    duplicate_batch: bool = False


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
class CompactStats:
    rolled_minutes: int = 0
    rolled_hours: int = 0
    merged_chunks: int = 0
    deleted_chunks: int = 0
    job_summaries: int = 0


class SqliteStore:
    """The embedded default store. Thread-safe: one lock serialises all access to the connection.

    ``sinks`` (e.g. ``collector.sinks.influx.InfluxSink``) get every committed batch's accepted
    samples and, at most once per ``summary_interval_s`` per job and at each compaction, the jobs'
    updated usage; they must only enqueue (they run under the store's lock).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        window_s: float = 600.0,
        max_gap_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        cache_limit: int = 200_000,
        retention: Retention = Retention(),
        sinks: Sequence[Any] = (),
        summary_interval_s: float = 60.0,
    ) -> None:
        retention.check(window_s)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention = retention
        self.sinks = list(sinks)
        self.summary_interval_s = summary_interval_s
        self._clock = clock
        self._cache_limit = cache_limit
        self._lock = threading.RLock()
        self._pending_jobs: set[str] = set()
        self._summary_sent: dict[str, float] = {}
        self._bg: threading.Thread | None = None
        self._bg_stop = threading.Event()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so one batch is one transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # WAL + FULL: a commit survives power loss
        self._db.execute("PRAGMA busy_timeout=10000")
        row = None
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name='meta'").fetchone():
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is not None and int(row[0]) not in (1, SCHEMA_VERSION):
            raise RuntimeError(f"{self.path}: store schema {row[0]}, this collector reads {SCHEMA_VERSION}")
        self._db.executescript(_SCHEMA)
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        row = self._db.execute("SELECT value FROM meta WHERE key='sample_fields'").fetchone()
        stored = tuple(json.loads(row[0])) if row else SAMPLE_FIELDS
        if SAMPLE_FIELDS[: len(stored)] != stored:
            raise RuntimeError(f"{self.path}: raw samples were written with fields {stored}, not a prefix of today's")
        if self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "1":
            self._migrate_v1(stored)
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('sample_fields', ?)", (json.dumps(SAMPLE_FIELDS),))
        self.agg = Aggregator(window_s, max_gap_s, load_usage=self._load_usage, load_hour=self._load_hour)
        self._restore()

    def _migrate_v1(self, fields: tuple[str, ...]) -> None:
        """Schema 1 kept one msgpack row per sample; repack them into chunks in one transaction."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            groups: dict[tuple, list[GpuSample]] = {}
            for (data,) in db.execute("SELECT data FROM samples ORDER BY host, gpu_uuid, mig, ts"):
                smp = GpuSample.from_dict(dict(zip(fields, msgpack.unpackb(data, raw=False))))
                groups.setdefault(self._chunk_key(smp), []).append(smp)
            self._insert_raw(groups)
            db.execute("DROP TABLE samples")
            db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    # -- state loading ------------------------------------------------------------------------
    def _load_usage(self, key: UsageKey) -> UsageAcc | None:
        row = self._db.execute(
            f"SELECT {', '.join(_U)} FROM usage WHERE job_id=? AND host=? AND gpu=?", key
        ).fetchone()
        return UsageAcc.from_values(row) if row else None

    def _load_hour(self, key: HourKey) -> HourAcc | None:
        row = self._db.execute(
            f"SELECT {', '.join(_H)} FROM gpu_hours WHERE host=? AND gpu_uuid=? AND mig=? AND hour=?", key
        ).fetchone()
        return HourAcc.from_values(row) if row else None

    def _restore(self) -> None:
        """Rebuild every GPU's window (recent samples plus the one before) from committed state."""
        self.agg.reset()
        for row in self._db.execute(f"SELECT host, gpu_uuid, mig, {', '.join(_G)} FROM gpus").fetchall():
            gk: GpuKey = (row[0], row[1], row[2])
            totals = row[3:]
            floor = totals[_G.index("watermark")] - self.agg.window_s
            self.agg.restore_gpu(gk, totals, segments=self._window(gk, floor))

    def _window(self, gk: GpuKey, floor: float) -> list[WindowSegment]:
        """A GPU's stored samples at or after ``floor`` plus the newest one before it (the anchor), as the
        window keeps them: time-ordered columns of the fields pair contributions read, one segment per run
        of one job set, straight from the chunks (no object per sample: a restart reads every GPU's window)."""
        (m,) = self._db.execute(
            "SELECT MAX(t_max) FROM chunks WHERE tier=0 AND host=? AND gpu_uuid=? AND mig=? AND t_max<?", (*gk, floor)
        ).fetchone()
        lo = floor if m is None else m  # the anchor is in a chunk ending at m, or in one reaching past floor
        span = self.retention.raw_chunk_s
        chunks = self._db.execute(
            "SELECT data FROM chunks WHERE tier=0 AND host=? AND gpu_uuid=? AND mig=? AND bucket>=? AND t_max>=?",
            (*gk, math.floor(lo / span) * span, lo),
        ).fetchall()
        ts_parts: list[np.ndarray] = []
        cols: dict[str, list[np.ndarray]] = {f: [] for f in PAIR_FLOATS}
        codes: list[np.ndarray] = []
        jobs: dict[tuple, int] = {}  # (job_ids, job_shares) -> code
        for (data,) in chunks:
            n, c = decode_columns(data)
            ts, vals = columns_as_floats(n, c, PAIR_FLOATS)
            keep = np.flatnonzero(ts >= lo)
            if not keep.size:
                continue
            ts_parts.append(ts[keep])
            for f in PAIR_FLOATS:
                cols[f].append(vals[f][keep])
            ids = column_list(n, c["job_ids"]) if "job_ids" in c else [()] * n
            shares = column_list(n, c["job_shares"]) if "job_shares" in c else [()] * n
            if ids.count(ids[0]) == n and shares.count(shares[0]) == n:  # the usual chunk: one job set
                key = (tuple(ids[0] or ()), tuple(shares[0] or ()))
                codes.append(np.full(keep.size, jobs.setdefault(key, len(jobs))))
            else:
                codes.append(np.array([jobs.setdefault((tuple(ids[i] or ()), tuple(shares[i] or ())), len(jobs))
                                       for i in keep.tolist()]))
        if not ts_parts:
            return []
        ts = np.concatenate(ts_parts)
        order = np.argsort(ts, kind="stable")
        ts = ts[order]
        first = max(int(np.searchsorted(ts, floor, side="left")) - 1, 0)  # the anchor
        order, ts = order[first:], ts[first:]
        code = np.concatenate(codes)[order]
        arrays = {f: np.concatenate(cols[f])[order] for f in PAIR_FLOATS}
        keys = {v: k for k, v in jobs.items()}
        cuts = [0, *(np.flatnonzero(code[1:] != code[:-1]) + 1).tolist(), len(ts)]
        return [WindowSegment(ts[a:b], {f: v[a:b] for f, v in arrays.items()}, *keys[int(code[a])])
                for a, b in zip(cuts, cuts[1:])]

    # -- raw samples: compressed chunks -------------------------------------------------------
    def _chunk_key(self, s: GpuSample) -> tuple[str, str, str, float]:
        span = self.retention.raw_chunk_s
        return (s.host, s.gpu_uuid, s.mig or "", math.floor(s.ts / span) * span)

    def _write_raw(self, samples: list[GpuSample]) -> None:
        """One chunk per GPU and raw interval of this batch (``samples`` sorted by time)."""
        span = self.retention.raw_chunk_s
        groups: dict[tuple, list[GpuSample]] = {}
        # Group a GPU's run at a time, not sample by sample: a stable sort keeps each GPU's samples in time
        # order (MIG instances of one GPU may come in several runs; they are appended in order).
        for (host, uuid, mig), run in groupby(sorted(samples, key=_GPU_SORT), key=_GPU):
            run = list(run)
            for i, j, bucket in _intervals(np.array(list(map(_TS, run)), dtype=np.float64), span):
                groups.setdefault((host, uuid, mig or "", bucket), []).extend(run[i:j])
        self._insert_raw(groups)

    def _write_series(self, series: list[Series]) -> None:
        """One chunk per series and raw interval (each series strictly increasing in time)."""
        span = self.retention.raw_chunk_s
        parts, buckets = [], []
        for s in series:
            for i, j, bucket in _intervals(s.ts, span):
                parts.append(s if j - i == s.n else s.slice(i, j))
                buckets.append(bucket)
        if parts:  # a batch's chunks packed together: numpy's per-call cost is shared by its GPUs
            self._db.executemany("INSERT INTO chunks VALUES (0,?,?,?,?,?,?,?,?)", [
                (p.host, p.gpu_uuid, p.mig or "", b, float(p.ts[0]), float(p.ts[-1]), p.n, blob)
                for p, b, blob in zip(parts, buckets, encode_series_many(parts))])

    def _insert_raw(self, groups: dict[tuple, list[GpuSample]]) -> None:
        self._db.executemany(
            "INSERT INTO chunks VALUES (0,?,?,?,?,?,?,?,?)",
            [(*k, g[0].ts, g[-1].ts, len(g), encode_samples(g)) for k, g in groups.items()],
        )

    def _chunk_rows(self, tier: int, gk: GpuKey, start: float, end: float) -> list[tuple[bytes]]:
        span = self.retention.span(tier)
        lo = math.floor(start / span) * span if math.isfinite(start) else -1e300
        return self._db.execute(
            "SELECT data FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket>=? AND bucket<=? "
            "AND t_max>=? AND t_min<=?",
            (tier, *gk, lo, end, start, end),
        ).fetchall()

    def _read_raw(self, gk: GpuKey, start: float, end: float) -> list[GpuSample]:
        out: list[GpuSample] = []
        for (data,) in self._chunk_rows(RAW, gk, start, end):
            out.extend(smp for smp in decode_samples(data, gk[0], gk[1], gk[2] or None) if start <= smp.ts <= end)
        out.sort(key=lambda x: x.ts)
        return out

    def _raw_arrays(self, gk: GpuKey, start: float, end: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Raw samples with start <= ts < end as arrays (for rollups), unsorted."""
        ts_parts, val_parts = [], []
        for (data,) in self._chunk_rows(RAW, gk, start, end):
            ts, vals = decode_arrays(data, NUMERIC_FIELDS)
            keep = (ts >= start) & (ts < end)
            ts_parts.append(ts[keep])
            val_parts.append({f: v[keep] for f, v in vals.items()})
        if not ts_parts:
            return np.zeros(0), {f: np.zeros(0) for f in NUMERIC_FIELDS}
        return np.concatenate(ts_parts), {f: np.concatenate([p[f] for p in val_parts]) for f in NUMERIC_FIELDS}

    def _rollup_rows(self, tier: int, gk: GpuKey, start: float, end: float) -> rollup.Rollup:
        """Stored rollup rows of a tier with start <= ts < end."""
        parts = [rollup.decode(d) for (d,) in self._chunk_rows(tier, gk, start, end)]
        r = rollup.concat(parts)
        return r.select((r.ts >= start) & (r.ts < end))

    # -- writes -------------------------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Store and aggregate a validated batch in one durable transaction; idempotent per (agent_id, seq)."""
        with self._lock:
            db = self._db
            if db.execute("SELECT 1 FROM batches WHERE agent_id=? AND seq=?", (batch.agent_id, batch.seq)).fetchone():
                return IngestResult(0, duplicate_batch=True)
            try:
                db.execute("BEGIN IMMEDIATE")
                # rows: GpuSamples or the fast path's structs with the same fields (no GpuSample built per sample);
                # series are folded and packed a column at a time unless a GPU's samples must go one by one
                rows = list(batch.rows)
                if rows:  # both layouts in one batch (only through the Python API): all one by one
                    folded, rest = [], [r for s in batch.series for r in s.rows()]
                else:
                    folded, rest = self.agg.add_series(list(batch.series))
                counts, accepted = self.agg.add_many(rows + rest) if rows or rest else (AddCounts(), [])
                self._write_raw(accepted)
                self._write_series(folded)
                for r in getattr(batch, "jobs", ()):
                    # An agent's job metadata fills a gap; it never replaces a record the scheduler gave.
                    db.execute("INSERT INTO jobs SELECT ?,?,? WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE job_id=?)",
                               (r.job_id, r.cluster, json.dumps(r.to_dict(), sort_keys=True), r.job_id))
                n_accepted = counts.accepted + sum(s.n for s in folded)
                db.execute(
                    "INSERT INTO batches VALUES (?,?,?,?)", (batch.agent_id, batch.seq, self._clock(), n_accepted)
                )
                jobs = self._flush()
                db.execute("COMMIT")
            except BaseException:
                # The in-memory aggregation already moved; put it back to what is committed.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self._restore()
                raise
            if len(self.agg.usage) + len(self.agg.hours) > self._cache_limit:
                self.agg.drop_caches()
            if self.sinks and n_accepted:
                accepted = [as_sample(s) for s in accepted] + [r for s in folded for r in s.rows()]  # sinks get GpuSamples
                for sink in self.sinks:
                    sink.write(accepted)
                self._pending_jobs |= jobs
                self._emit_summaries(force=False)
            return IngestResult(n_accepted, counts.duplicate, counts.too_late)

    def _flush(self) -> set[str]:
        """Write the dirty accumulators; returns the job ids whose usage changed."""
        usage, gpus, hours = self.agg.take_dirty()
        a = self.agg
        if usage:
            self._db.executemany(
                f"INSERT OR REPLACE INTO usage VALUES (?,?,?,{','.join('?' * len(_U))})",
                [(*k, *a.usage[k].values()) for k in usage],
            )
        if gpus:
            self._db.executemany(
                f"INSERT OR REPLACE INTO gpus VALUES (?,?,?,{','.join('?' * len(_G))})",
                [(*k, *a.gpus[k].totals()) for k in gpus],
            )
        if hours:
            self._db.executemany(
                f"INSERT OR REPLACE INTO gpu_hours VALUES (?,?,?,?,{','.join('?' * len(_H))})",
                [(*k, *a.hours[k].values()) for k in hours],
            )
        return {k[0] for k in usage}

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
            rows.extend(self.job_usage(job))
            self._summary_sent[job] = now
        self._pending_jobs.difference_update(due)
        records = {r.job_id: r for r in self._jobs_by_id(due)}
        for sink in self.sinks:
            sink.write_job_usage(rows, records)
        return len(rows)

    def _jobs_by_id(self, ids: Sequence[str]) -> list[JobRecord]:
        out = []
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            out += [JobRecord.from_dict(json.loads(r[0])) for r in self._db.execute(
                f"SELECT data FROM jobs WHERE job_id IN ({','.join('?' * len(part))})", part)]
        return out

    def put_jobs(self, records: Iterable[JobRecord]) -> int:
        """Insert or update job records; returns how many rows changed (a re-import changes none)."""
        rows = [(r.job_id, r.cluster, json.dumps(r.to_dict(), sort_keys=True)) for r in records]
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # The scheduler's record replaces what an agent reported without knowing the cluster.
                self._db.executemany("DELETE FROM jobs WHERE job_id=? AND cluster='' AND ?<>''",
                                     [(job_id, cluster) for job_id, cluster, _ in rows])
                self._db.executemany(
                    "INSERT INTO jobs VALUES (?,?,?) ON CONFLICT (job_id, cluster) "
                    "DO UPDATE SET data=excluded.data WHERE data != excluded.data",
                    rows,
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return self._db.total_changes - before

    # -- compaction: rollups, merging, retention ----------------------------------------------
    def compact(self, now: float | None = None) -> CompactStats:
        """Apply the tiers: roll up closed minutes and hours, merge small chunks, drop expired data.

        Idempotent; each GPU's rollup and each merge is its own transaction, so ingest waits at most
        for one of them, and a crash leaves either the old or the new state.
        """
        now = self._clock() if now is None else now
        with self._lock:
            marks = {gk: g.watermark for gk, g in self.agg.gpus.items()}
        minutes = hours = 0
        for gk, mark in sorted(marks.items()):
            with self._lock:
                m, h = self._rollup_gpu(gk, mark)
            minutes, hours = minutes + m, hours + h
        merged = sum(self._merge(tier, now) for tier in (RAW, MINUTE, HOUR))
        with self._lock:
            deleted = self._expire(now)
            summaries = self._emit_summaries(force=True)
        return CompactStats(minutes, hours, merged, deleted, summaries)

    def _resume_at(self, gk: GpuKey, tier: int, horizon: float) -> float:
        """Where rolling up into ``tier`` goes on: its saved state, else the start of the finer tier's first
        chunk (on the tier's grid), never past ``horizon``."""
        until = self._until(gk, tier)
        if until is not None:
            return until
        (first,) = self._db.execute(
            "SELECT MIN(t_min) FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=?", (tier - 1, *gk)
        ).fetchone()
        res = RESOLUTION[tier]
        return horizon if first is None else min(horizon, math.floor(first / res) * res)

    def _until(self, gk: GpuKey, tier: int) -> float | None:
        row = self._db.execute(
            "SELECT until FROM rollup_state WHERE host=? AND gpu_uuid=? AND mig=? AND tier=?", (*gk, tier)
        ).fetchone()
        return None if row is None else row[0]

    def _rollup_gpu(self, gk: GpuKey, watermark: float) -> tuple[int, int]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            # minutes before (newest sample - window) can no longer receive a late sample: final
            horizon = math.floor((watermark - self.agg.window_s) / 60.0) * 60.0
            until = self._resume_at(gk, MINUTE, horizon)
            n_min = 0
            if horizon > until:
                ts, vals = self._raw_arrays(gk, until, horizon)
                n_min = self._insert_rollup(MINUTE, gk, rollup.from_raw(ts, vals, 60.0))
                until = horizon
            db.execute("INSERT OR REPLACE INTO rollup_state VALUES (?,?,?,?,?)", (*gk, MINUTE, until))
            hour_horizon = math.floor(until / 3600.0) * 3600.0
            h_until = self._resume_at(gk, HOUR, hour_horizon)
            n_hour = 0
            if hour_horizon > h_until:
                rows = self._rollup_rows(MINUTE, gk, h_until, hour_horizon)
                n_hour = self._insert_rollup(HOUR, gk, rollup.combine(rows, 3600.0))
                h_until = hour_horizon
            db.execute("INSERT OR REPLACE INTO rollup_state VALUES (?,?,?,?,?)", (*gk, HOUR, h_until))
            db.execute("COMMIT")
            return n_min, n_hour
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _insert_rollup(self, tier: int, gk: GpuKey, r: rollup.Rollup) -> int:
        if not len(r):
            return 0
        span = self.retention.span(tier)
        buckets = np.floor(r.ts / span) * span
        for b in np.unique(buckets).tolist():
            part = r.select(buckets == b)
            self._db.execute("INSERT INTO chunks VALUES (?,?,?,?,?,?,?,?,?)",
                             (tier, *gk, b, float(part.ts[0]), float(part.ts[-1]), len(part), rollup.encode(part)))
        return len(r)

    def _merge(self, tier: int, now: float) -> int:
        """Merge each (GPU, interval)'s small chunks into one: closed intervals always, the open one once it
        has ``_MERGE_AT`` of them. Raw chunks of ``_MERGE_ROWS`` rows or more are left alone: they compress
        within a few per cent of a merged one, and re-packing every sample of a large-batch cluster would
        cost compaction as much CPU as ingest. Returns how many chunks were merged away."""
        span = self.retention.span(tier)
        small = _MERGE_ROWS if tier == RAW else 2**62
        with self._lock:
            groups = self._db.execute(
                "SELECT host, gpu_uuid, mig, bucket, COUNT(*) FROM chunks WHERE tier=? AND n<? "
                "GROUP BY host, gpu_uuid, mig, bucket HAVING COUNT(*) > 1", (tier, small)
            ).fetchall()
        merged = 0
        for host, uuid, mig, bucket, count in groups:
            if bucket + span > now and count < _MERGE_AT:
                continue
            with self._lock:
                merged += self._merge_group(tier, (host, uuid, mig), bucket, small)
        return merged

    def _merge_group(self, tier: int, gk: GpuKey, bucket: float, small: int) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = db.execute(
                "SELECT rowid, data FROM chunks WHERE tier=? AND host=? AND gpu_uuid=? AND mig=? AND bucket=? AND n<?",
                (tier, *gk, bucket, small),
            ).fetchall()
            if len(rows) > 1:
                blob, n, t0, t1 = merge_chunks([r[1] for r in rows])
                db.executemany("DELETE FROM chunks WHERE rowid=?", [(r[0],) for r in rows])
                db.execute("INSERT INTO chunks VALUES (?,?,?,?,?,?,?,?,?)", (tier, *gk, bucket, t0, t1, n, blob))
            db.execute("COMMIT")
            return max(0, len(rows) - 1)
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _expire(self, now: float) -> int:
        """Delete chunks older than their tier's retention, but never raw or minute data that the
        next tier has not rolled up yet."""
        db = self._db
        deleted = 0
        db.execute("BEGIN IMMEDIATE")
        try:
            for tier in (RAW, MINUTE, HOUR):
                keep = self.retention.keep(tier)
                if keep is None:
                    continue
                span = self.retention.span(tier)
                guard = "" if tier == HOUR else (
                    " AND bucket + :span <= COALESCE((SELECT until FROM rollup_state r WHERE r.host=chunks.host "
                    "AND r.gpu_uuid=chunks.gpu_uuid AND r.mig=chunks.mig AND r.tier=:next), -1e300)")
                where = "FROM chunks WHERE tier=:tier AND bucket + :span <= :cutoff" + guard
                args = {"tier": tier, "span": span, "cutoff": now - keep, "next": tier + 1}
                gone = db.execute(f"SELECT host, gpu_uuid, mig, MAX(bucket) {where} GROUP BY host, gpu_uuid, mig",
                                  args).fetchall()
                deleted += db.execute("DELETE " + where, args).rowcount
                # remember how far each GPU's tier is gone, so queries pick a tier that is complete
                db.executemany(
                    "INSERT INTO expired VALUES (?,?,?,?,?) ON CONFLICT DO UPDATE SET until=MAX(until, excluded.until)",
                    [(h, u, m, tier, b + span) for h, u, m, b in gone],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return deleted

    def start_background(self, interval_s: float = 300.0) -> None:
        """Run :meth:`compact` every ``interval_s`` seconds in a daemon thread until :meth:`close`."""
        if self._bg is not None:
            return
        self._bg_stop.clear()

        def loop() -> None:
            while not self._bg_stop.wait(interval_s):
                try:
                    self.compact()
                except Exception:  # keep compacting later; the store itself is consistent
                    log.exception("compaction failed")

        self._bg = threading.Thread(target=loop, name="store-compact", daemon=True)
        self._bg.start()

    def stop_background(self) -> None:
        if self._bg is not None:
            self._bg_stop.set()
            self._bg.join()
            self._bg = None

    # -- reads --------------------------------------------------------------------------------
    def jobs(self) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM jobs ORDER BY cluster, job_id").fetchall()
        return [JobRecord.from_dict(json.loads(r[0])) for r in rows]

    def job_usage(self, job_id: str | None = None, per_gpu: bool = False) -> list[JobUsage]:
        """Usage per job (summed over its GPUs) or per (job, host, GPU), from the usage table."""
        sql = f"SELECT job_id, host, gpu, {', '.join(_U)} FROM usage"
        args: tuple = ()
        if job_id is not None:
            sql, args = sql + " WHERE job_id=?", (job_id,)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return summarize((((r[0], r[1], r[2]), UsageAcc.from_values(r[3:])) for r in rows), per_gpu)

    def pick_tier(self, gk: GpuKey, start: float, step: float | None = None) -> int:
        """The tier a query from ``start`` reads: among tiers still complete from ``start`` on (none of
        that GPU's data after ``start`` expired), the coarsest whose resolution is at most ``step``,
        else the finest complete one; when none reaches back that far, the hour tier."""
        with self._lock:
            gone = dict(self._db.execute(
                "SELECT tier, until FROM expired WHERE host=? AND gpu_uuid=? AND mig=?", gk).fetchall())
        complete = [t for t in (RAW, MINUTE, HOUR) if start >= gone.get(t, -math.inf)]
        if not complete:
            return HOUR
        if step:
            fit = [t for t in complete if RESOLUTION[t] <= step]
            if fit:
                return fit[-1]
        return complete[0]

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, step: float | None = None, mig: str | None = None,
        tier: int | None = None,
    ) -> list[GpuSample] | list[RollupPoint]:
        """One GPU's (or MIG instance's) data with start <= ts <= end, in time order.

        Raw samples (``GpuSample``) when the raw tier is picked and no ``step`` is asked; otherwise
        ``RollupPoint`` buckets of ``step`` seconds (at least the tier's resolution, rounded up to a
        multiple of it). The newest minutes that are not rolled up yet are summarised from the
        finer tier on the fly, so a rollup query also covers recent data. ``tier`` forces a tier.
        """
        gk = (host, gpu_uuid, mig or "")
        tier = self.pick_tier(gk, start, step) if tier is None else tier
        with self._lock:
            if tier == RAW and not step:
                return self._read_raw(gk, start, end)
            res = RESOLUTION[tier]
            step = float(step) if step else res
            if res:
                step = math.ceil(step / res - 1e-9) * res
            lo = math.floor(start / step) * step
            r = self._tier_rows(tier, gk, lo, end)
        return rollup.combine(r, step).points(step, TIER_NAMES[tier])

    def _tier_rows(self, tier: int, gk: GpuKey, start: float, end: float) -> rollup.Rollup:
        """Rows of ``tier``'s resolution (raw: one row per sample) for start <= ts <= end, filled in
        past the tier's rolled-up horizon from the tier below."""
        if tier == RAW:
            ts, vals = self._raw_arrays(gk, start, math.nextafter(end, math.inf))
            return rollup.from_raw(ts, vals, 1e-6)  # one row per sample (distinct times)
        until = self._until(gk, tier)
        until = -math.inf if until is None else until
        stored = self._rollup_rows(tier, gk, start, min(math.nextafter(end, math.inf), until))
        if end < until:
            return stored
        tail = rollup.combine(self._tier_rows(tier - 1, gk, max(start, until), end), RESOLUTION[tier])
        return rollup.concat([stored, tail])

    def totals(self, start: float | None = None, end: float | None = None) -> dict:
        """Cluster totals. With a range, whole hours are counted: buckets whose hour starts in [start, end)."""
        where, args = "", []
        if start is not None:
            where, args = " WHERE hour >= ?", [math.floor(start / 3600.0) * 3600.0]
        if end is not None:
            where += (" AND" if where else " WHERE") + " hour < ?"
            args.append(end)
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(DISTINCT host || char(0) || gpu_uuid || char(0) || mig), "
                "TOTAL(observed_s), TOTAL(energy_j), TOTAL(alloc_s), TOTAL(sm_s), TOTAL(samples) "
                "FROM gpu_hours" + where,
                args,
            ).fetchone()
            jobs = self._db.execute("SELECT COUNT(DISTINCT job_id) FROM usage").fetchone()[0]
        return {
            "start": start,
            "end": end,
            "gpus": row[0],
            "samples": int(row[5]),
            "observed_gpu_seconds": row[1],
            "allocated_gpu_seconds": row[3],
            "sm_active_gpu_seconds": row[4],
            "energy_joules": row[2],
            "jobs_measured": jobs,
        }

    def tiers(self) -> list[dict]:
        """Per tier: chunks, rows and bytes stored, oldest and newest time (for the CLI and metrics)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT tier, COUNT(*), TOTAL(n), TOTAL(LENGTH(data)), MIN(t_min), MAX(t_max) FROM chunks GROUP BY tier"
            ).fetchall()
        have = {r[0]: r for r in rows}
        return [{"tier": TIER_NAMES[t], "chunks": have[t][1] if t in have else 0,
                 "rows": int(have[t][2]) if t in have else 0, "bytes": int(have[t][3]) if t in have else 0,
                 "oldest": have[t][4] if t in have else None, "newest": have[t][5] if t in have else None,
                 "retention_s": self.retention.keep(t)} for t in (RAW, MINUTE, HOUR)]

    def batches_seen(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM batches").fetchone()[0]

    def size_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += os.path.getsize(str(self.path) + suffix)
            except OSError:
                pass
        return total

    def checkpoint(self) -> None:
        """Fold the WAL into the database file and truncate it (what ``size_bytes`` then measures)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.stop_background()
        with self._lock:
            self._db.close()
