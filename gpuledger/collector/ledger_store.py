"""The ledger: job records, measured usage per (job, host, GPU), per-GPU totals, per-GPU hourly buckets
(cluster totals over a time range; energy charged to jobs and counter anomalies, so unattributed energy per
GPU and hour), gap records (energy across gaps in a GPU's samples, see ``collector.aggregate``) and the ids
of ingested batches (so a resent batch is not counted twice).

Queries read these tables, never the samples. What the rest of the code reads is :class:`LedgerReader`;
what the collector's store writes through is :class:`LedgerStore`. :class:`SqliteLedger` is the embedded
implementation; it shares the collector's SQLite connection with the series store, so ingest writes both
in one transaction. It is not thread-safe by itself: ``collector.store.SqliteStore`` serialises access.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gpuledger.collector.aggregate import GapKey, GpuKey, GpuState, HourAcc, HourKey, UsageAcc, UsageKey, summarize
from gpuledger.collector.sqlite_db import transaction
from gpuledger.schema.records import JobRecord, JobUsage

USAGE_FIELDS = UsageAcc.FIELDS
HOUR_FIELDS = HourAcc.FIELDS
GPU_TOTAL_FIELDS = GpuState.TOTAL_FIELDS
_IN_CLAUSE_LIMIT = 500  # ids per "IN (...)" query, well under SQLite's parameter limit

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
  job_id TEXT NOT NULL, host TEXT NOT NULL, gpu TEXT NOT NULL, {", ".join(USAGE_FIELDS)},
  PRIMARY KEY (job_id, host, gpu)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpus (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, {", ".join(GPU_TOTAL_FIELDS)},
  PRIMARY KEY (host, gpu_uuid, mig)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpu_hours (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, hour REAL NOT NULL, {", ".join(HOUR_FIELDS)},
  PRIMARY KEY (host, gpu_uuid, mig, hour)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS gpu_hours_by_hour ON gpu_hours (hour);
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT NOT NULL, cluster TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (job_id, cluster)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS energy_gaps (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, start REAL NOT NULL, end REAL NOT NULL,
  energy_j REAL NOT NULL, jobs TEXT NOT NULL, PRIMARY KEY (host, gpu_uuid, mig, start, end)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS energy_gaps_by_end ON energy_gaps (end);
CREATE TABLE IF NOT EXISTS batches (
  agent_id TEXT NOT NULL, seq INTEGER NOT NULL, received REAL NOT NULL, samples INTEGER NOT NULL,
  PRIMARY KEY (agent_id, seq)) WITHOUT ROWID;
"""


class LedgerReader(Protocol):
    """The query side: what accounting, the API and the CLI read."""

    def jobs(self) -> list[JobRecord]: ...
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False) -> list[JobUsage]: ...
    def totals(self, start: float | None = None, end: float | None = None) -> dict: ...
    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]: ...
    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]: ...
    def counter_anomalies(self) -> int: ...


class LedgerStore(LedgerReader, Protocol):
    """What the collector's store writes through (called with its lock held; ingest's writes inside
    the store's transaction)."""

    def batch_seen(self, agent_id: str, seq: int) -> bool: ...
    def record_batch(self, agent_id: str, seq: int, received: float, samples: int) -> None: ...
    def add_agent_jobs(self, records: Iterable[JobRecord]) -> None: ...
    def put_jobs(self, records: Iterable[JobRecord]) -> int: ...
    def jobs_by_id(self, job_ids: Sequence[str]) -> list[JobRecord]: ...
    def load_usage(self, key: UsageKey) -> UsageAcc | None: ...
    def load_hour(self, key: HourKey) -> HourAcc | None: ...
    def gpu_totals(self) -> list[tuple[GpuKey, tuple]]: ...
    def write_aggregates(self, usage: Iterable[tuple[UsageKey, tuple]], gpus: Iterable[tuple[GpuKey, tuple]],
                         hours: Iterable[tuple[HourKey, tuple]]) -> None: ...
    def write_gaps(self, gaps: Mapping[GapKey, tuple[float, tuple[str, ...]] | None]) -> None: ...
    def batches_seen(self) -> int: ...


def _job_json(record: JobRecord) -> str:
    return json.dumps(record.to_dict(), sort_keys=True)


class SqliteLedger:
    """The ledger in the collector's SQLite file (tables ``usage``, ``gpus``, ``gpu_hours``, ``jobs``,
    ``batches``)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        db.executescript(SCHEMA)
        self._add_columns()

    def _add_columns(self) -> None:
        """Accumulator fields added since a store was created become columns (0 for what came before)."""
        for table, names in (("usage", USAGE_FIELDS), ("gpus", GPU_TOTAL_FIELDS), ("gpu_hours", HOUR_FIELDS)):
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name in names:
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} DEFAULT 0")

    # -- batches ------------------------------------------------------------------------------
    def batch_seen(self, agent_id: str, seq: int) -> bool:
        return self._db.execute("SELECT 1 FROM batches WHERE agent_id=? AND seq=?", (agent_id, seq)).fetchone() \
            is not None

    def record_batch(self, agent_id: str, seq: int, received: float, samples: int) -> None:
        self._db.execute("INSERT INTO batches VALUES (?,?,?,?)", (agent_id, seq, received, samples))

    def batches_seen(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM batches").fetchone()[0]

    # -- jobs ---------------------------------------------------------------------------------
    def add_agent_jobs(self, records: Iterable[JobRecord]) -> None:
        """An agent's job metadata fills a gap; it never replaces a record the scheduler gave."""
        self._db.executemany(
            "INSERT INTO jobs SELECT ?,?,? WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE job_id=?)",
            [(r.job_id, r.cluster, _job_json(r), r.job_id) for r in records])

    def put_jobs(self, records: Iterable[JobRecord]) -> int:
        """Insert or update the scheduler's job records in one transaction; returns how many rows changed
        (a re-import changes none)."""
        rows = [(r.job_id, r.cluster, _job_json(r)) for r in records]
        before = self._db.total_changes
        with transaction(self._db) as db:
            # The scheduler's record replaces what an agent reported without knowing the cluster.
            db.executemany("DELETE FROM jobs WHERE job_id=? AND cluster='' AND ?<>''",
                           [(job_id, cluster) for job_id, cluster, _ in rows])
            db.executemany(
                "INSERT INTO jobs VALUES (?,?,?) ON CONFLICT (job_id, cluster) "
                "DO UPDATE SET data=excluded.data WHERE data != excluded.data",
                rows,
            )
        return self._db.total_changes - before

    def jobs(self) -> list[JobRecord]:
        rows = self._db.execute("SELECT data FROM jobs ORDER BY cluster, job_id").fetchall()
        return [JobRecord.from_dict(json.loads(r[0])) for r in rows]

    def jobs_by_id(self, job_ids: Sequence[str]) -> list[JobRecord]:
        out = []
        for i in range(0, len(job_ids), _IN_CLAUSE_LIMIT):
            part = job_ids[i:i + _IN_CLAUSE_LIMIT]
            out += [JobRecord.from_dict(json.loads(r[0])) for r in self._db.execute(
                f"SELECT data FROM jobs WHERE job_id IN ({','.join('?' * len(part))})", part)]
        return out

    # -- aggregates ---------------------------------------------------------------------------
    def load_usage(self, key: UsageKey) -> UsageAcc | None:
        row = self._db.execute(
            f"SELECT {', '.join(USAGE_FIELDS)} FROM usage WHERE job_id=? AND host=? AND gpu=?", key
        ).fetchone()
        return UsageAcc.from_values(row) if row else None

    def load_hour(self, key: HourKey) -> HourAcc | None:
        row = self._db.execute(
            f"SELECT {', '.join(HOUR_FIELDS)} FROM gpu_hours WHERE host=? AND gpu_uuid=? AND mig=? AND hour=?", key
        ).fetchone()
        return HourAcc.from_values(row) if row else None

    def gpu_totals(self) -> list[tuple[GpuKey, tuple]]:
        """Every GPU's running totals (``GPU_TOTAL_FIELDS``), from which the aggregation restarts."""
        rows = self._db.execute(f"SELECT host, gpu_uuid, mig, {', '.join(GPU_TOTAL_FIELDS)} FROM gpus").fetchall()
        return [((r[0], r[1], r[2]), tuple(r[3:])) for r in rows]

    def write_aggregates(self, usage: Iterable[tuple[UsageKey, tuple]], gpus: Iterable[tuple[GpuKey, tuple]],
                         hours: Iterable[tuple[HourKey, tuple]]) -> None:
        """Store changed accumulators: (key, ``USAGE_FIELDS`` values), (key, ``GPU_TOTAL_FIELDS`` values),
        (key, ``HOUR_FIELDS`` values)."""
        self._db.executemany(f"INSERT OR REPLACE INTO usage VALUES (?,?,?,{','.join('?' * len(USAGE_FIELDS))})",
                             [(*k, *v) for k, v in usage])
        self._db.executemany(f"INSERT OR REPLACE INTO gpus VALUES (?,?,?,{','.join('?' * len(GPU_TOTAL_FIELDS))})",
                             [(*k, *v) for k, v in gpus])
        self._db.executemany(
            f"INSERT OR REPLACE INTO gpu_hours VALUES (?,?,?,?,{','.join('?' * len(HOUR_FIELDS))})",
            [(*k, *v) for k, v in hours])

    def write_gaps(self, gaps: Mapping[GapKey, tuple[float, tuple[str, ...]] | None]) -> None:
        """Store gap records (energy J, jobs charged) and delete those a late sample split (None)."""
        self._db.executemany("DELETE FROM energy_gaps WHERE host=? AND gpu_uuid=? AND mig=? AND start=? AND end=?",
                             [k for k, v in gaps.items() if v is None])
        self._db.executemany("INSERT OR REPLACE INTO energy_gaps VALUES (?,?,?,?,?,?,?)",
                             [(*k, v[0], json.dumps(list(v[1]))) for k, v in gaps.items() if v is not None])

    # -- reads --------------------------------------------------------------------------------
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False) -> list[JobUsage]:
        """Usage per job (summed over its GPUs) or per (job, host, GPU), from the usage table."""
        sql = f"SELECT job_id, host, gpu, {', '.join(USAGE_FIELDS)} FROM usage"
        args: tuple = ()
        if job_id is not None:
            sql, args = sql + " WHERE job_id=?", (job_id,)
        rows = self._db.execute(sql, args).fetchall()
        return summarize((((r[0], r[1], r[2]), UsageAcc.from_values(r[3:])) for r in rows), per_gpu)

    def totals(self, start: float | None = None, end: float | None = None) -> dict:
        """Cluster totals. With a range, whole hours are counted: buckets whose hour starts in [start, end).

        ``gpus`` counts physical GPUs (a MIG GPU once), observed GPU-seconds and energy are the physical GPUs',
        allocated and SM-active GPU-seconds count a MIG instance's seconds by its slice fraction, ``samples``
        the samples agents sent; ``unattributed_energy_joules`` is the energy charged to no job."""
        where, args = "", []
        if start is not None:
            where, args = " WHERE hour >= ?", [math.floor(start / 3600.0) * 3600.0]
        if end is not None:
            where += (" AND" if where else " WHERE") + " hour < ?"
            args.append(end)
        # physical GPUs: a MIG instance's key holds no seconds or energy of its own (aggregate's rules)
        row = self._db.execute(
            "SELECT COUNT(DISTINCT host || char(0) || gpu_uuid), "
            "TOTAL(observed_s), TOTAL(energy_j), TOTAL(alloc_s), TOTAL(sm_s), TOTAL(samples), TOTAL(job_energy_j), "
            "TOTAL(anomalies) FROM gpu_hours" + where,
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
            "unattributed_energy_joules": row[2] - row[6],
            "counter_anomalies": int(row[7]),
            "jobs_measured": jobs,
        }

    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per physical GPU (host, gpu_uuid), over whole hours in [start, end): observed and allocated GPU-seconds,
        energy, the part charged to jobs, the unattributed (idle) rest and counter anomalies."""
        lo = -math.inf if start is None else math.floor(start / 3600.0) * 3600.0
        hi = math.inf if end is None else end
        rows = self._db.execute(
            "SELECT host, gpu_uuid, TOTAL(observed_s), TOTAL(alloc_s), TOTAL(energy_j), TOTAL(job_energy_j), "
            "TOTAL(anomalies) FROM gpu_hours WHERE hour >= ? AND hour < ? GROUP BY host, gpu_uuid "
            "ORDER BY host, gpu_uuid", (lo, hi)).fetchall()
        return [{"host": h, "gpu_uuid": u, "observed_gpu_seconds": obs, "allocated_gpu_seconds": alloc,
                 "energy_joules": e, "job_energy_joules": je, "unattributed_energy_joules": e - je,
                 "counter_anomalies": int(an)} for h, u, obs, alloc, e, je, an in rows]

    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Gaps in each GPU's samples that ended in [start, end): span, the counter delta across it (J) and the
        jobs it was charged to (empty: unattributed). Accounting may reassign these from the scheduler's records."""
        lo = -math.inf if start is None else start
        hi = math.inf if end is None else end
        rows = self._db.execute(
            "SELECT host, gpu_uuid, mig, start, end, energy_j, jobs FROM energy_gaps WHERE end >= ? AND end < ? "
            "ORDER BY host, gpu_uuid, mig, start", (lo, hi)).fetchall()
        return [{"host": h, "gpu_uuid": u, "mig": m or None, "start": a, "end": b, "energy_joules": e,
                 "job_ids": json.loads(j)} for h, u, m, a, b, e, j in rows]

    def counter_anomalies(self) -> int:
        """Intervals whose energy counter was not trusted, over all GPUs (for the collector's metric)."""
        return int(self._db.execute("SELECT TOTAL(anomalies) FROM gpus").fetchone()[0])
