"""The embedded store: SQLite in WAL mode, one transaction per batch, aggregation kept in step.

Tables: raw samples (one row per sample for now, behind ``_write_raw``/``_read_raw`` so that chunked,
compressed storage can replace it), per-(job, host, GPU) usage sums, per-GPU totals, per-GPU hourly
buckets (cluster totals over a time range), job records, and ingested batch ids for idempotency.
Queries read the usage tables, never the raw samples. On open the aggregation window is rebuilt from
the stored samples, so a restart loses no exactness.
"""

from __future__ import annotations

import json
import math
import operator
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from agent.records import SAMPLE_FIELDS, GpuSample, JobRecord, JobUsage
from collector.aggregate import (
    Aggregator,
    GpuKey,
    GpuState,
    HourAcc,
    HourKey,
    UsageAcc,
    UsageKey,
    summarize,
)
from collector.validate import Batch

SCHEMA_VERSION = 1
_U = UsageAcc.FIELDS
_H = HourAcc.FIELDS
_G = GpuState.TOTAL_FIELDS

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, ts REAL NOT NULL, data BLOB NOT NULL,
  PRIMARY KEY (host, gpu_uuid, mig, ts)) WITHOUT ROWID;
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


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicate_samples: int = 0
    too_late: int = 0
    duplicate_batch: bool = False


class SqliteStore:
    """The embedded default store. Thread-safe: one lock serialises all access to the connection."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        window_s: float = 600.0,
        max_gap_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        cache_limit: int = 200_000,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._cache_limit = cache_limit
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so one batch is one transaction.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # WAL + FULL: a commit survives power loss
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: store schema {row[0]}, this collector reads {SCHEMA_VERSION}")
        row = self._db.execute("SELECT value FROM meta WHERE key='sample_fields'").fetchone()
        stored = tuple(json.loads(row[0])) if row else SAMPLE_FIELDS
        if SAMPLE_FIELDS[: len(stored)] != stored:
            raise RuntimeError(f"{self.path}: raw samples were written with fields {stored}, not a prefix of today's")
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('sample_fields', ?)", (json.dumps(SAMPLE_FIELDS),))
        self.agg = Aggregator(window_s, max_gap_s, load_usage=self._load_usage, load_hour=self._load_hour)
        self._restore()

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
            recent = self._read_raw(gk, floor, math.inf)
            anchor = self._db.execute(
                "SELECT data FROM samples WHERE host=? AND gpu_uuid=? AND mig=? AND ts<? ORDER BY ts DESC LIMIT 1",
                (*gk, floor),
            ).fetchone()
            if anchor:
                recent.insert(0, _decode(anchor[0]))
            self.agg.restore_gpu(gk, totals, recent)

    # -- raw samples (the part issue 4 replaces with compressed chunks) ------------------------
    def _write_raw(self, samples: list[GpuSample]) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO samples VALUES (?,?,?,?,?)",
            [(s.host, s.gpu_uuid, s.mig or "", s.ts, _encode(s)) for s in samples],
        )

    def _read_raw(self, gk: GpuKey, start: float, end: float) -> list[GpuSample]:
        rows = self._db.execute(
            "SELECT data FROM samples WHERE host=? AND gpu_uuid=? AND mig=? AND ts>=? AND ts<=? ORDER BY ts",
            (*gk, start, end),
        ).fetchall()
        return [_decode(r[0]) for r in rows]

    # -- writes -------------------------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Store and aggregate a validated batch in one durable transaction; idempotent per (agent_id, seq)."""
        with self._lock:
            db = self._db
            if db.execute("SELECT 1 FROM batches WHERE agent_id=? AND seq=?", (batch.agent_id, batch.seq)).fetchone():
                return IngestResult(0, duplicate_batch=True)
            try:
                db.execute("BEGIN IMMEDIATE")
                counts, accepted = self.agg.add_many(batch.samples)
                self._write_raw(accepted)
                db.execute(
                    "INSERT INTO batches VALUES (?,?,?,?)", (batch.agent_id, batch.seq, self._clock(), counts.accepted)
                )
                self._flush()
                db.execute("COMMIT")
            except BaseException:
                # The in-memory aggregation already moved; put it back to what is committed.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self._restore()
                raise
            if len(self.agg.usage) + len(self.agg.hours) > self._cache_limit:
                self.agg.drop_caches()
            return IngestResult(counts.accepted, counts.duplicate, counts.too_late)

    def _flush(self) -> None:
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

    def put_jobs(self, records: Iterable[JobRecord]) -> int:
        """Insert or update job records; returns how many rows changed (a re-import changes none)."""
        rows = [(r.job_id, r.cluster, json.dumps(r.to_dict(), sort_keys=True)) for r in records]
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN IMMEDIATE")
            try:
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

    def series(
        self, host: str, gpu_uuid: str, start: float, end: float, mig: str | None = None
    ) -> list[GpuSample]:
        """Raw samples of one GPU (or MIG instance) with start <= ts <= end, in time order."""
        with self._lock:
            return self._read_raw((host, gpu_uuid, mig or ""), start, end)

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

    def close(self) -> None:
        with self._lock:
            self._db.close()


# Raw rows are positional msgpack arrays (no key names: smaller and faster). Fields may only be
# appended to GpuSample (checked against ``meta`` on open), so an older, shorter row still decodes.
_ALL = operator.attrgetter(*SAMPLE_FIELDS)
_PROC = SAMPLE_FIELDS.index("processes")


def _encode(s: GpuSample) -> bytes:
    v = list(_ALL(s))
    if s.processes:
        v[_PROC] = [[p.pid, p.used_memory_bytes] for p in s.processes]
    return msgpack.packb(v, use_bin_type=True)


def _decode(b: bytes) -> GpuSample:
    return GpuSample.from_dict(dict(zip(SAMPLE_FIELDS, msgpack.unpackb(b, raw=False))))
