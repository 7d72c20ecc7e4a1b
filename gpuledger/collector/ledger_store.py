"""The ledger: job records, measured usage per (job, host, GPU), per-GPU totals, per-GPU hourly buckets
(cluster totals over a time range; energy charged to jobs and counter anomalies, so unattributed energy per
GPU and hour), gap records (energy across gaps in a GPU's samples, see ``collector.aggregate``) and the ids
of ingested batches (so a resent batch is not counted twice).

Queries read these tables, never the samples. What the rest of the code reads is :class:`LedgerReader`;
what the collector's store writes through is :class:`LedgerStore`. :class:`SqlLedger` implements both over
``collector.db``'s portable dialect, so the same code runs on embedded SQLite and on PostgreSQL (a ledger
shared by several collectors). It shares the store's database with the series store, so ingest writes both
in one transaction. It is not thread-safe by itself: ``collector.store.Store`` serialises access.
Its tables are created and migrated by ``collector.migrations`` (on store open), never here.

Job identity is ``(cluster, job_id)``: two clusters feeding one collector may both have a job 1234.

- ``jobs`` holds one row per (cluster, job, source): ``slurm`` (the scheduler's record, the authority) and
  ``agent`` (what a node's agent said of a job it ran, kept apart so that it can never overwrite or outvote
  the scheduler's record; the first agent's description wins).
- ``usage`` rows carry the cluster of the GPU they were measured on. A physical GPU belongs to one cluster:
  ``gpu_clusters`` keeps the cluster the GPU's agent named first ("" = not named; a later name replaces "",
  never another name). So the aggregation's own keys (job, host, GPU) stay unique without naming the cluster.

Several collectors may share one ledger: ``hosts`` holds each host's write generation, bumped (under the row's
lock) by every transaction that writes the host, so a collector learns that another one wrote a host since it
last did (``collector.store`` then restores the host from the ledger; see :meth:`SqlLedger.claim_hosts`).

Schema history: v2 keyed ``jobs`` by (job_id, cluster) with agents' and the scheduler's records mixed, and
``usage`` by (job_id, host, gpu). :func:`migrate_v2` moves such a store to v3: usage rows get cluster "" (their
agents named none), and job records become scheduler records (v2 did not record their source; re-import from
sacct to re-establish authority). Later versions are ``collector.migrations``'.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, Protocol

from gpuledger.collector.aggregate import (
    HOUR_S,
    GapKey,
    GpuKey,
    GpuState,
    HourAcc,
    HourKey,
    UsageAcc,
    UsageKey,
    summarize,
)
from gpuledger.collector.db import MAX_LIST_VALUES, SQLITE, Database, Upserts, upsert
from gpuledger.schema.records import JobRecord, JobUsage, split_gpu_id

log = logging.getLogger(__name__)

USAGE_FIELDS = UsageAcc.FIELDS
HOUR_FIELDS = HourAcc.FIELDS
GPU_TOTAL_FIELDS = GpuState.TOTAL_FIELDS
SLURM, AGENT = "slurm", "agent"  # sources of a job record
BeforeStore = Callable[[list[JobRecord]], object]  # sees the merged records a write will store, before it does

# An accumulator field's column type (REAL unless named): counts and byte peaks are integers, the model is text.
# PostgreSQL needs the types; on SQLite they keep each value's type as written (an integer stays one).
_FIELD_TYPES = {"samples": "INTEGER", "n": "INTEGER", "anomalies": "INTEGER", "mem_peak": "INTEGER", "model": "TEXT"}


def field_type(name: str) -> str:
    return _FIELD_TYPES.get(name, "REAL")


def _typed(names: Sequence[str]) -> str:
    return ", ".join(f"{n} {field_type(n)}" for n in names)


ACCUMULATOR_TABLES = (("usage", USAGE_FIELDS), ("gpus", GPU_TOTAL_FIELDS), ("gpu_hours", HOUR_FIELDS))

_USAGE_TABLE = f"""CREATE TABLE IF NOT EXISTS usage (
  cluster TEXT NOT NULL, job_id TEXT NOT NULL, host TEXT NOT NULL, gpu TEXT NOT NULL, {_typed(USAGE_FIELDS)},
  PRIMARY KEY (cluster, job_id, host, gpu)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_gpu ON usage (job_id, host, gpu);"""
_JOBS_TABLE = """CREATE TABLE IF NOT EXISTS jobs (
  cluster TEXT NOT NULL, job_id TEXT NOT NULL, source TEXT NOT NULL, data TEXT NOT NULL,
  PRIMARY KEY (cluster, job_id, source)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_by_id ON jobs (job_id);"""

SCHEMA = f"""
{_USAGE_TABLE}
CREATE TABLE IF NOT EXISTS gpus (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, {_typed(GPU_TOTAL_FIELDS)},
  PRIMARY KEY (host, gpu_uuid, mig)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpu_hours (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, hour REAL NOT NULL, {_typed(HOUR_FIELDS)},
  PRIMARY KEY (host, gpu_uuid, mig, hour)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS gpu_hours_by_hour ON gpu_hours (hour);
{_JOBS_TABLE}
CREATE TABLE IF NOT EXISTS gpu_clusters (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, cluster TEXT NOT NULL, PRIMARY KEY (host, gpu_uuid)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS energy_gaps (
  host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, start REAL NOT NULL, "end" REAL NOT NULL,
  energy_j REAL NOT NULL, jobs TEXT NOT NULL, PRIMARY KEY (host, gpu_uuid, mig, start, "end")) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS energy_gaps_by_end ON energy_gaps ("end");
CREATE TABLE IF NOT EXISTS batches (
  agent_id TEXT NOT NULL, seq INTEGER NOT NULL, received REAL NOT NULL, samples INTEGER NOT NULL,
  PRIMARY KEY (agent_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batch_keys (
  host TEXT NOT NULL, agent_id TEXT NOT NULL, seq INTEGER NOT NULL, digest BLOB, received REAL NOT NULL,
  samples INTEGER NOT NULL, PRIMARY KEY (host, agent_id, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batch_keys_by_received ON batch_keys (received);
"""
# ``batches`` is the key of stores written before the host and the content digest were part of it: still
# consulted (by agent id and seq, as then) until the dedupe horizon has pruned it empty.
HOSTS_TABLE = "CREATE TABLE IF NOT EXISTS hosts (host TEXT PRIMARY KEY, generation INTEGER NOT NULL)"
NO_DIGEST = b""  # what batches_seen_of gives for a batch stored without a digest (it matches any content)


def needs_migration(db: Database) -> bool:
    """True for a v2 ledger (usage without a cluster column)."""
    cols = db.columns("usage")
    return bool(cols) and "cluster" not in cols


def migrate_v2(db: Database) -> None:
    """Move a v2 ledger to v3 (call inside a transaction): see the module docstring."""
    db.execute("ALTER TABLE usage RENAME TO usage_v2")
    db.execute("DROP INDEX IF EXISTS usage_by_gpu")
    db.script(_USAGE_TABLE)
    # fields added since the v2 store was written (energy accumulators) start at 0, as add_columns does
    have = set(db.columns("usage_v2"))
    values = ", ".join(f if f in have else "0" for f in USAGE_FIELDS)
    db.execute(f"INSERT INTO usage SELECT '', job_id, host, gpu, {values} FROM usage_v2")
    db.execute("DROP TABLE usage_v2")
    if "source" not in db.columns("jobs"):
        db.execute("ALTER TABLE jobs RENAME TO jobs_v2")
        db.execute("DROP INDEX IF EXISTS jobs_by_id")
        db.script(_JOBS_TABLE)
        db.execute(f"INSERT INTO jobs SELECT cluster, job_id, '{SLURM}', data FROM jobs_v2")
        db.execute("DROP TABLE jobs_v2")


def add_columns(db: Database) -> list[str]:
    """Accumulator fields added since the ledger was created become columns (0 for what came before); returns
    them as ``table.column``. Run on every open (``collector.migrations``): a new accumulator field needs no
    migration of its own."""
    added = []
    for table, names in ACCUMULATOR_TABLES:
        have = set(db.columns(table))
        for name in names:
            if name not in have:
                db.script(f"ALTER TABLE {table} ADD COLUMN {name} {field_type(name)} DEFAULT 0")
                added.append(f"{table}.{name}")
    return added


def hour_span(start: float | None, end: float | None) -> tuple[float | None, float | None]:
    """The hour buckets a range [start, end) sums: from the one holding ``start`` up to, not including, the one
    holding ``end`` (bucket starts; None: unbounded). The one rule of every query over hours (totals, per-GPU energy
    and hours), so adjacent ranges partition the hours: [a, b) + [b, c) = [a, c). A range inside one hour sums none."""
    return (None if start is None else math.floor(start / HOUR_S) * HOUR_S,
            None if end is None else math.floor(end / HOUR_S) * HOUR_S)


def _total(column: str) -> str:
    """SQL for the sum of ``column`` as a float, 0.0 over no rows (what SQLite's TOTAL gives, portably)."""
    return f"CAST(COALESCE(SUM({column}), 0) AS DOUBLE PRECISION)"


_EMPTY = (None, "", ())


def merge_record(old: JobRecord, new: JobRecord) -> JobRecord:
    """``new`` with every field it lacks (None, "", empty) taken from ``old``: one sacct format never erases
    what another gave (``sacct -P`` has no GPU UUIDs, a JSON record may lack the uid). A record with no end never
    replaces one with an end of the same run: it is an answer from before the job ended (sacct's running jobs,
    stored after the job's end record), so ``old`` stands, taking only what it lacks from ``new``. One that started
    after that end is a later run (the job was requeued): it replaces the record, the earlier run's end, exit code
    and placement (hosts, GPUs) not taken, its (start, end, hosts) kept in ``earlier_runs`` (with those either
    record lists); a record of a run that ended before the stored one started is such an earlier run, and joins
    the stored record's."""
    if _ended_before(new, old):
        return merge_record(new, old)
    runs = new.earlier_runs + old.earlier_runs
    if _ended_before(old, new):
        assert old.start is not None and old.end is not None  # as _ended_before found them
        runs += ((old.start, old.end, old.hosts),)
        # the earlier run's end, exit code and placement are not the later run's (it may run on other nodes)
        old = replace(old, end=None, exit_code=None, hosts=(), gpu_uuids=(), gpu_indexes=())
    elif new.end is None and old.end is not None:
        return merge_record(new, old)
    kept = {f.name: getattr(old, f.name) for f in fields(JobRecord)
            if getattr(new, f.name) in _EMPTY and getattr(old, f.name) not in _EMPTY}
    return (replace(new, **kept) if kept else new).with_earlier_runs(runs)


def _ended_before(a: JobRecord, b: JobRecord) -> bool:
    """Is ``a`` the record of a run that ran and ended before ``b``'s started (``b``: a later run of a requeued
    job)?"""
    return a.start is not None and a.end is not None and b.start is not None and b.start > a.end


class LedgerReader(Protocol):
    """The query side: what accounting, the API and the CLI read."""

    def jobs(self) -> list[JobRecord]: ...
    def job_records(self) -> list[tuple[JobRecord, str]]: ...
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False,
                  cluster: str | None = None) -> list[JobUsage]: ...
    def jobs_page(self, offset: int, limit: int) -> tuple[list[JobRecord], int]: ...
    def job_usage_page(self, job_id: str | None, per_gpu: bool, offset: int, limit: int
                       ) -> tuple[list[JobUsage], int]: ...
    def totals(self, start: float | None = None, end: float | None = None) -> dict: ...
    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]: ...
    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]: ...
    def counter_anomalies(self) -> int: ...
    def gpu_hours(self, start: float | None = None, end: float | None = None) -> list[dict]: ...
    def busy_hours(self, since: float | None = None) -> dict[GpuKey, list[tuple[float, float]]]: ...


class LedgerStore(LedgerReader, Protocol):
    """What the collector's store writes through (called with its lock held; ingest's writes inside
    the store's transaction)."""

    def claim_hosts(self, hosts: Sequence[str]) -> dict[str, int]: ...
    def lock_hosts(self, hosts: Sequence[str]) -> None: ...
    def forget_host(self, host: str) -> None: ...
    def batches_seen_of(self, keys: Sequence[tuple[str, str, int]]) -> dict[tuple[str, str, int], bytes]: ...
    def record_batches(self, batches: Sequence[tuple[str, str, int, bytes | None, float, int]]) -> int: ...
    def prune_batches(self, before: float) -> int: ...
    def note_gpus(self, cluster: str, gpus: Iterable[tuple[str, str]]) -> None: ...
    def reload_clusters(self) -> None: ...
    def add_agent_jobs(self, records: Iterable[JobRecord], host: str, cluster: str,
                       batch_job_ids: Iterable[str]) -> int: ...
    def put_jobs(self, records: Iterable[JobRecord], before_store: BeforeStore | None = None) -> int: ...
    def merge_jobs(self, records: Iterable[JobRecord], before_store: BeforeStore | None = None) -> list[JobRecord]: ...
    def jobs_by_id(self, job_ids: Sequence[str]) -> list[JobRecord]: ...
    def load_usages(self, keys: Sequence[UsageKey]) -> dict[UsageKey, UsageAcc]: ...
    def load_hours(self, keys: Sequence[HourKey]) -> dict[HourKey, HourAcc]: ...
    def gpu_totals(self) -> list[tuple[GpuKey, tuple]]: ...
    def host_gpu_totals(self, host: str) -> list[tuple[GpuKey, tuple]]: ...
    def write_aggregates(self, usage: Iterable[tuple[UsageKey, tuple]], gpus: Iterable[tuple[GpuKey, tuple]],
                         hours: Iterable[tuple[HourKey, tuple]]) -> None: ...
    def write_gaps(self, gaps: Mapping[GapKey, tuple[float, tuple[str, ...]] | None]) -> None: ...
    def batches_seen(self) -> int: ...


_GPU_CLUSTER_UPSERT = upsert("gpu_clusters", ("host", "gpu_uuid", "cluster"), ("host", "gpu_uuid"))
_JOB_UPSERT = upsert("jobs", ("cluster", "job_id", "source", "data"), ("cluster", "job_id", "source"))
_USAGE_KEY = ("cluster", "job_id", "host", "gpu")
_USAGE_UPSERTS = Upserts("usage", (*_USAGE_KEY, *USAGE_FIELDS), _USAGE_KEY)
_GPU_KEY = ("host", "gpu_uuid", "mig")
_GPU_UPSERTS = Upserts("gpus", (*_GPU_KEY, *GPU_TOTAL_FIELDS), _GPU_KEY)
_HOUR_KEY = ("host", "gpu_uuid", "mig", "hour")
_HOUR_UPSERTS = Upserts("gpu_hours", (*_HOUR_KEY, *HOUR_FIELDS), _HOUR_KEY)
_GAP_KEY = ("host", "gpu_uuid", "mig", "start", "end")
_GAP_UPSERT = upsert("energy_gaps", (*_GAP_KEY, "energy_j", "jobs"), _GAP_KEY)


def _job_json(record: JobRecord) -> str:
    return json.dumps(record.to_dict(), sort_keys=True)


def _record(data: str) -> JobRecord:
    return JobRecord.from_dict(json.loads(data))


def gpu_totals(db: Database) -> list[tuple[GpuKey, tuple]]:
    """Every GPU's running totals (``GPU_TOTAL_FIELDS``) in ``db``'s ledger (``SqlLedger.gpu_totals``; also read
    through another connection, ``Database.reader``)."""
    rows = db.execute(f"SELECT host, gpu_uuid, mig, {', '.join(GPU_TOTAL_FIELDS)} FROM gpus").fetchall()
    return [((r[0], r[1], r[2]), tuple(r[3:])) for r in rows]


class SqlLedger:
    """The ledger in the store's database, SQLite or PostgreSQL (tables ``usage``, ``gpus``, ``gpu_hours``,
    ``jobs``, ``gpu_clusters``, ``energy_gaps``, ``batch_keys``, ``hosts``). ``collector.migrations`` creates
    and migrates them (the store runs it on open) before this opens them."""

    def __init__(self, db: Database) -> None:
        self._db = db
        if not db.has_table("hosts") or needs_migration(db):
            raise RuntimeError(f"ledger {db.url}: tables missing or of an older schema; open it through the store, "
                               "which applies collector.migrations")
        self._gpu_cluster: dict[str, dict[str, str]] = {}  # host -> GPU uuid -> cluster (note_gpus)
        self.reload_clusters()

    def reload_clusters(self) -> None:
        """Re-read the GPUs' clusters (after a rolled-back ingest: :meth:`note_gpus` caches what it writes)."""
        self._gpu_cluster = {}
        for h, g, c in self._db.execute("SELECT host, gpu_uuid, cluster FROM gpu_clusters"):
            self._gpu_cluster.setdefault(h, {})[g] = c

    # -- hosts: which collector wrote a host last -----------------------------------------------
    def claim_hosts(self, hosts: Sequence[str]) -> dict[str, int]:
        """Bump each host's write generation and return them (call inside the transaction that writes the hosts;
        give them sorted: one statement locks its rows in that order).

        The rows stay locked until that transaction ends (PostgreSQL's row locks; SQLite's ``BEGIN IMMEDIATE``
        already holds the whole file), so two collectors never write one host at once. The caller compares each
        result with the generation it wrote last + 1: anything else means another collector wrote the host in
        between, and what it keeps in memory of the host is stale (:meth:`forget_host`)."""
        out: dict[str, int] = {}
        for at in range(0, len(hosts), MAX_LIST_VALUES):
            part = hosts[at:at + MAX_LIST_VALUES]
            rows = self._db.execute(
                f"INSERT INTO hosts (host, generation) VALUES {','.join(['(?, 1)'] * len(part))} ON CONFLICT (host) "
                "DO UPDATE SET generation = hosts.generation + 1 RETURNING host, generation", part).fetchall()
            out.update((h, int(g)) for h, g in rows)
        return out

    def lock_hosts(self, hosts: Sequence[str]) -> None:
        """Take the row locks :meth:`claim_hosts` takes (sorted ``hosts``; until the transaction ends) without moving
        their generations: a compaction's seal, which collectors holding the hosts need not restore them for. SQLite:
        nothing to take (``BEGIN IMMEDIATE`` holds the whole file)."""
        if self._db.dialect == SQLITE:
            return
        for at in range(0, len(hosts), MAX_LIST_VALUES):
            part = hosts[at:at + MAX_LIST_VALUES]
            self._db.execute(f"SELECT host FROM hosts WHERE host IN ({','.join(['?'] * len(part))}) ORDER BY host "
                             "FOR UPDATE", part).fetchall()

    def forget_host(self, host: str) -> None:
        """Re-read ``host``'s GPUs' clusters (another collector may have named them since they were cached)."""
        self._gpu_cluster[host] = dict(self._db.execute("SELECT gpu_uuid, cluster FROM gpu_clusters WHERE host=?",
                                                        (host,)).fetchall())

    # -- batches ------------------------------------------------------------------------------
    # A batch's key is (host, agent_id, seq): the host is the one its token is bound to, so one node cannot
    # claim another's numbers. The digest of its content tells a resend (same content) from a conflict.
    def batches_seen_of(self, keys: Sequence[tuple[str, str, int]]) -> dict[tuple[str, str, int], bytes]:
        """Of these batch keys (host, agent_id, seq), the ones stored, with their content digests (NO_DIGEST where
        none was stored)."""
        out = {(h, a, int(s)): bytes(d) if d else NO_DIGEST
               for h, a, s, d in self._stored("batch_keys", ("host", "agent_id", "seq"), ("digest",), list(keys))}
        legacy = {(a, int(s)) for a, s in self._stored("batches", ("agent_id", "seq"), (), [k[1:] for k in keys])}
        if legacy:
            out.update((k, NO_DIGEST) for k in keys if (k[1], k[2]) in legacy and k not in out)
        return out

    def record_batches(self, batches: Sequence[tuple[str, str, int, bytes | None, float, int]]) -> int:
        """Record batch keys (host, agent_id, seq, digest, received, samples); returns how many were new (a key
        stored meanwhile by another collector is not written again: the caller's transaction must not commit that
        batch a second time)."""
        new = 0
        step = MAX_LIST_VALUES // 6
        for at in range(0, len(batches), step):
            part = batches[at:at + step]
            new += len(self._db.execute(
                "INSERT INTO batch_keys (host, agent_id, seq, digest, received, samples) VALUES "
                + ",".join(["(?,?,?,?,?,?)"] * len(part)) + " ON CONFLICT (host, agent_id, seq) DO NOTHING "
                "RETURNING seq", [x for b in part for x in b]).fetchall())
        return new

    def prune_batches(self, before: float) -> int:
        """Forget batch keys received before ``before`` (the dedupe horizon); returns how many."""
        with self._db.transaction() as db:
            n = db.execute("DELETE FROM batch_keys WHERE received < ?", (before,)).rowcount
            return n + db.execute("DELETE FROM batches WHERE received < ?", (before,)).rowcount

    def batches_seen(self) -> int:
        return sum(self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("batch_keys", "batches"))

    # -- clusters -----------------------------------------------------------------------------
    def note_gpus(self, cluster: str, gpus: Iterable[tuple[str, str]]) -> None:
        """The cluster a batch's agent named for its GPUs (host, uuid); call before the batch's aggregates are
        written. A GPU's first named cluster sticks (a GPU is in one cluster); a name given later for a GPU
        first seen unnamed ("") renames its usage rows."""
        for host, uuid in gpus:
            clusters = self._gpu_cluster.setdefault(host, {})
            known = clusters.get(uuid)
            if known == cluster or (known is not None and known != "" and cluster == ""):
                continue
            if known:
                log.warning("GPU %s/%s is in cluster %r; its agent now names %r (kept %r)", host, uuid, known,
                            cluster, known)
                continue
            clusters[uuid] = cluster
            self._db.execute(_GPU_CLUSTER_UPSERT, (host, uuid, cluster))
            if known == "":
                self._db.execute("UPDATE usage SET cluster=? WHERE cluster='' AND host=? AND (gpu=? OR gpu LIKE ?)",
                                 (cluster, host, uuid, uuid + "/%"))

    def _cluster_of(self, host: str, gpu: str) -> str:
        return self._gpu_cluster.get(host, {}).get(split_gpu_id(gpu)[0], "")

    # -- jobs ---------------------------------------------------------------------------------
    def add_agent_jobs(self, records: Iterable[JobRecord], host: str, cluster: str,
                       batch_job_ids: Iterable[str]) -> int:
        """An agent's job metadata, kept apart from the scheduler's records (which always win when read).

        Accepted only for a job whose samples came from the agent's ``host``: in this batch (``batch_job_ids``)
        or already in the ledger. A record names the batch's cluster (filled in when it names none). The first
        agent description of a job is kept, unless another host's names another owner (user or account): agents that
        disagree about a job describe nobody (a node's token may be stolen, and the first to describe a job id would
        otherwise decide who pays for every host's usage of it), so the kept record loses its user and account
        until the scheduler's record comes. Returns how many records were refused."""
        records = list(records)
        if not records:
            return 0
        in_batch = set(batch_job_ids)
        refused, rows = 0, []
        for r in records:
            r = r if r.cluster else replace(r, cluster=cluster)
            if r.earlier_runs:  # Slurm's word on where and when a requeued job ran: never a node's
                r = replace(r, earlier_runs=())
            if r.job_id not in in_batch and self._db.execute(
                    "SELECT 1 FROM usage WHERE job_id=? AND host=? LIMIT 1", (r.job_id, host)).fetchone() is None:
                refused += 1
                continue
            rows.append((r.cluster, r.job_id, AGENT, _job_json(r)))
        if rows:
            # The first description stands (DO NOTHING). A job's row is the one row that batches of different hosts
            # share: without the lock, two collectors inserting two such jobs in opposite orders would deadlock.
            # Taken after the hosts (the store claims them first), as merge_jobs takes it alone: one order.
            self._db.lock("jobs")
            disputed = self._disputed(rows, host)
            self._db.executemany("INSERT INTO jobs (cluster, job_id, source, data) VALUES (?,?,?,?) "
                                 "ON CONFLICT (cluster, job_id, source) DO NOTHING", rows)
            if disputed:
                self._db.executemany("UPDATE jobs SET data=? WHERE cluster=? AND job_id=? AND source=?", disputed)
        if refused:
            log.warning("host %s: %d job description(s) refused: no sample of those jobs came from the host",
                        host, refused)
        return refused

    def _disputed(self, rows: list[tuple[str, str, str, str]], host: str) -> list[tuple[str, str, str, str]]:
        """(data, cluster, job_id, source) updates for the stored agent descriptions ``rows`` contradict: the same
        job, another user or account (both named): the stored one without either."""
        stored = {(c, j, src): d for c, j, src, d in self._stored("jobs", ("cluster", "job_id", "source"), ("data",),
                                                                   [r[:3] for r in rows])}
        out = []
        for cluster, job_id, source, data in rows:
            if (cluster, job_id, source) not in stored:
                continue
            old, new = _record(stored[cluster, job_id, source]), _record(data)
            # the same host(s) again (a node's own later word): the first description stands. Not "the host is
            # among the stored hosts": a node may list others in its description, and would then outrank them
            if set(old.hosts) == set(new.hosts):
                continue
            if any(a and b and a != b for a, b in ((old.user, new.user), (old.account, new.account))):
                log.warning("job %s%s: host %s describes it as %s/%s, an earlier agent as %s/%s: agents disagree, "
                            "it stays undescribed until the scheduler's record", job_id, f"@{cluster}" if cluster
                            else "", host, new.account, new.user, old.account, old.user)
                out.append((_job_json(replace(old, user=None, account=None, uid=None)), cluster, job_id, source))
        return out

    def _slurm_match(self, cluster: str, job_id: str) -> tuple[str, JobRecord] | None:
        """The stored scheduler record that ``(cluster, job_id)`` names: the same cluster, or one side unnamed
        and the job id unique among the scheduler's records."""
        rows = self._db.execute("SELECT cluster, data FROM jobs WHERE job_id=? AND source=?",
                                (job_id, SLURM)).fetchall()
        exact = [r for r in rows if r[0] == cluster]
        if exact:
            return exact[0][0], _record(exact[0][1])
        loose = [r for r in rows if r[0] == "" or cluster == ""]
        if len(loose) == 1:
            return loose[0][0], _record(loose[0][1])
        return None

    def merge_jobs(self, records: Iterable[JobRecord], before_store: BeforeStore | None = None) -> list[JobRecord]:
        """Insert or merge the scheduler's job records (one transaction); returns the stored records that are
        new or whose data changed. A field a record lacks keeps its stored value (:func:`merge_record`), so
        importing the same jobs in another sacct format changes nothing (a uid that only ``sacct -P`` prints
        is stored without counting as a change: it is personal data, not accounting data).

        ``before_store`` gets those records, as they will be stored, before anything is written (the audit log
        appends them there: nothing is charged that the log has not seen); if it raises, nothing is stored.

        Several processes may merge at once (collectors, ``gpuledger jobs import``): the read-merge-write holds
        the ledger's ``jobs`` lock, so none loses another's update."""
        changed: list[JobRecord] = []
        writes: list[tuple[str, str, str, str]] = []
        # records of one job in one call (a requeued job's runs, posted as sacct -D lists them) merge first, as
        # they would one call each
        folded: dict[tuple[str, str], JobRecord] = {}
        for r in records:
            r = replace(r, tres=tuple(sorted(r.tres)))  # sacct's JSON and -P list TRES in other orders
            key = (r.cluster, r.job_id)
            folded[key] = merge_record(folded[key], r) if key in folded else r
        with self._db.transaction() as db:
            db.lock("jobs")
            for r in folded.values():
                match = self._slurm_match(r.cluster, r.job_id)
                if match is None:
                    writes.append(("put", r.cluster, r.job_id, _job_json(r)))
                    changed.append(r)
                    continue
                stored_cluster, old = match
                merged = merge_record(old, r)
                if merged == old:
                    continue
                if replace(merged, uid=old.uid) != old:  # a uid only -P prints is stored, but is no change
                    changed.append(merged)
                if stored_cluster != merged.cluster:  # an unnamed record gets its cluster
                    writes.append(("delete", stored_cluster, r.job_id, ""))
                writes.append(("put", merged.cluster, merged.job_id, _job_json(merged)))
            if before_store is not None and changed:
                before_store(changed)
            for op, cluster, job_id, data in writes:
                if op == "delete":
                    db.execute("DELETE FROM jobs WHERE cluster=? AND job_id=? AND source=?", (cluster, job_id, SLURM))
                else:
                    db.execute(_JOB_UPSERT, (cluster, job_id, SLURM, data))
        return changed

    def put_jobs(self, records: Iterable[JobRecord], before_store: BeforeStore | None = None) -> int:
        """:meth:`merge_jobs`, counted: how many records are new or changed (a re-import changes none)."""
        return len(self.merge_jobs(records, before_store))

    def job_records(self) -> list[tuple[JobRecord, str]]:
        """Every stored record with its source (``slurm`` or ``agent``), by cluster and job id."""
        rows = self._db.execute("SELECT data, source FROM jobs ORDER BY cluster, job_id, source").fetchall()
        return [(_record(d), src) for d, src in rows]

    def jobs(self) -> list[JobRecord]:
        """One record per job: the scheduler's, else the first agent's description (see :func:`authoritative`)."""
        return authoritative(self.job_records())

    # authoritative() in SQL: every scheduler record, and an agent's where no scheduler record of its job id is
    # in its cluster, or unnamed, or it is unnamed itself
    _SHOWN = ("source = ? OR (source = ? AND NOT EXISTS (SELECT 1 FROM jobs s WHERE s.source = ? AND "
              "s.job_id = jobs.job_id AND (s.cluster = jobs.cluster OR s.cluster = '' OR jobs.cluster = '')))")

    def jobs_page(self, offset: int, limit: int) -> tuple[list[JobRecord], int]:
        """``jobs()[offset:offset + limit]`` and ``len(jobs())``, read in SQL: an answer holds at most ``limit``
        records however many the ledger has."""
        shown = (SLURM, AGENT, SLURM)
        (total,) = self._db.execute(f"SELECT COUNT(*) FROM jobs WHERE {self._SHOWN}", shown).fetchone()
        rows = self._db.execute(
            f"SELECT data FROM jobs WHERE {self._SHOWN} ORDER BY CASE WHEN source = ? THEN 0 ELSE 1 END, cluster, "
            "job_id LIMIT ? OFFSET ?", (*shown, SLURM, limit, offset)).fetchall()
        return [_record(r[0]) for r in rows], int(total)

    def jobs_by_id(self, job_ids: Sequence[str]) -> list[JobRecord]:
        out: list[tuple[JobRecord, str]] = []
        for i in range(0, len(job_ids), MAX_LIST_VALUES):
            part = job_ids[i:i + MAX_LIST_VALUES]
            out += [(_record(r[0]), r[1]) for r in self._db.execute(
                f"SELECT data, source FROM jobs WHERE job_id IN ({','.join('?' * len(part))})", part)]
        return authoritative(out)

    # -- aggregates ---------------------------------------------------------------------------
    def load_usages(self, keys: Sequence[UsageKey]) -> dict[UsageKey, UsageAcc]:
        """The stored accumulators of these (job, host, GPU) keys (those not stored are left out)."""
        rows = self._stored("usage", ("cluster", "job_id", "host", "gpu"), USAGE_FIELDS,
                            [(self._cluster_of(host, gpu), job, host, gpu) for job, host, gpu in keys])
        return {(r[1], r[2], r[3]): UsageAcc.from_values(r[4:]) for r in rows}

    def load_hours(self, keys: Sequence[HourKey]) -> dict[HourKey, HourAcc]:
        """The stored accumulators of these (host, GPU uuid, MIG, hour) keys (those not stored are left out)."""
        rows = self._stored("gpu_hours", ("host", "gpu_uuid", "mig", "hour"), HOUR_FIELDS, list(keys))
        return {(r[0], r[1], r[2], r[3]): HourAcc.from_values(r[4:]) for r in rows}

    def _stored(self, table: str, columns: tuple[str, ...], fields: Sequence[str], keys: list[tuple]) -> list[tuple]:
        """The rows of ``table`` whose ``columns`` equal one of ``keys``: each those columns, then ``fields`` (a
        query for each MAX_LIST_VALUES values, the keys a VALUES table joined to the key's index: a row-value IN list
        is a scan of the whole table in SQLite)."""
        width = len(columns)
        names = ", ".join(f"k{i}" for i in range(width))
        on = " AND ".join(f"t.{c} = k.k{i}" for i, c in enumerate(columns))
        select = ", ".join(f"t.{c}" for c in (*columns, *fields))
        row = f"({','.join('?' * width)})"
        out: list[tuple] = []
        step = MAX_LIST_VALUES // width
        for at in range(0, len(keys), step):
            part = keys[at:at + step]
            out += self._db.execute(f"WITH k ({names}) AS (VALUES {','.join([row] * len(part))}) SELECT {select} "
                                    f"FROM k JOIN {table} t ON {on}", [x for key in part for x in key]).fetchall()
        return out

    def gpu_totals(self) -> list[tuple[GpuKey, tuple]]:
        """Every GPU's running totals (``GPU_TOTAL_FIELDS``), from which the aggregation restarts."""
        return gpu_totals(self._db)

    def host_gpu_totals(self, host: str) -> list[tuple[GpuKey, tuple]]:
        """The running totals of every GPU (and MIG instance) stored for one host."""
        rows = self._db.execute(f"SELECT host, gpu_uuid, mig, {', '.join(GPU_TOTAL_FIELDS)} FROM gpus WHERE host=?",
                                (host,)).fetchall()
        return [((r[0], r[1], r[2]), tuple(r[3:])) for r in rows]

    def write_aggregates(self, usage: Iterable[tuple[UsageKey, tuple]], gpus: Iterable[tuple[GpuKey, tuple]],
                         hours: Iterable[tuple[HourKey, tuple]]) -> None:
        """Store changed accumulators: (key, ``USAGE_FIELDS`` values), (key, ``GPU_TOTAL_FIELDS`` values),
        (key, ``HOUR_FIELDS`` values). A usage row goes under its GPU's cluster (:meth:`note_gpus`)."""
        _USAGE_UPSERTS.write(self._db, [(self._cluster_of(k[1], k[2]), *k, *v) for k, v in usage])
        _GPU_UPSERTS.write(self._db, [k + v for k, v in gpus])
        _HOUR_UPSERTS.write(self._db, [k + v for k, v in hours])

    def write_gaps(self, gaps: Mapping[GapKey, tuple[float, tuple[str, ...]] | None]) -> None:
        """Store gap records (energy J, jobs charged) and delete those a late sample split (None)."""
        self._db.executemany('DELETE FROM energy_gaps WHERE host=? AND gpu_uuid=? AND mig=? AND start=? AND "end"=?',
                             [k for k, v in gaps.items() if v is None])
        self._db.executemany(_GAP_UPSERT,
                             [(*k, v[0], json.dumps(list(v[1]))) for k, v in gaps.items() if v is not None])

    # -- reads --------------------------------------------------------------------------------
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False,
                  cluster: str | None = None) -> list[JobUsage]:
        """Usage per job (summed over its GPUs) or per (job, host, GPU), from the usage table; a job is
        (cluster, job_id), so the same job id in two clusters gives two records."""
        sql = f"SELECT cluster, job_id, host, gpu, {', '.join(USAGE_FIELDS)} FROM usage"
        where, args = [], []
        if job_id is not None:
            where.append("job_id=?")
            args.append(job_id)
        if cluster is not None:
            where.append("cluster=?")
            args.append(cluster)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return self._usage_records(self._db.execute(sql, args).fetchall(), per_gpu)

    def job_usage_page(self, job_id: str | None, per_gpu: bool, offset: int, limit: int
                       ) -> tuple[list[JobUsage], int]:
        """``job_usage(job_id, per_gpu)[offset:offset + limit]`` and its length, read in SQL a page at a time (a
        page of jobs reads the rows of those jobs only): memory bounded by ``limit`` and the jobs' GPU counts."""
        where, args = ("WHERE job_id = ?", [job_id]) if job_id is not None else ("", [])
        columns = f"cluster, job_id, host, gpu, {', '.join(USAGE_FIELDS)}"
        if per_gpu:
            (total,) = self._db.execute(f"SELECT COUNT(*) FROM usage {where}", args).fetchone()
            rows = self._db.execute(f"SELECT {columns} FROM usage {where} ORDER BY cluster, job_id, host, gpu "
                                    "LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()
        else:
            (total,) = self._db.execute(
                f"SELECT COUNT(*) FROM (SELECT DISTINCT cluster, job_id FROM usage {where}) AS j", args).fetchone()
            keys = self._db.execute(f"SELECT DISTINCT cluster, job_id FROM usage {where} ORDER BY cluster, job_id "
                                    "LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()
            rows = self._db.execute(  # the page's jobs are one range in (cluster, job_id) order
                f"SELECT {columns} FROM usage {where}{' AND' if where else ' WHERE'} (cluster, job_id) >= (?, ?) "
                "AND (cluster, job_id) <= (?, ?)", [*args, *keys[0], *keys[-1]]).fetchall() if keys else []
        return self._usage_records(rows, per_gpu), int(total)

    def _usage_records(self, rows: Iterable[Sequence[Any]], per_gpu: bool) -> list[JobUsage]:
        """Usage table rows (cluster, job_id, host, gpu, fields) as records, by cluster (see :meth:`job_usage`)."""
        by_cluster: dict[str, list] = {}
        for r in rows:
            by_cluster.setdefault(r[0], []).append(((r[1], r[2], r[3]), UsageAcc.from_values(r[4:])))
        out = []
        for c in sorted(by_cluster):
            out += [replace(u, cluster=c) for u in summarize(by_cluster[c], per_gpu)]
        return out

    @staticmethod
    def _hour_range(first: float | None, stop: float | None) -> tuple[str, list[float]]:
        """SQL ``WHERE`` over ``hour`` for the buckets ``first <= hour < stop`` (:func:`hour_span`'s)."""
        where, args = "", []
        if first is not None:
            where, args = " WHERE hour >= ?", [first]
        if stop is not None:
            where += (" AND" if where else " WHERE") + " hour < ?"
            args.append(stop)
        return where, args

    def totals(self, start: float | None = None, end: float | None = None) -> dict:
        """Cluster totals over whole hours: the hour buckets from the one holding ``start`` up to, not including,
        the one holding ``end`` (:func:`hour_span`: adjacent ranges partition the hours; a range inside one hour
        sums none). ``hours_start`` and ``hours_end`` say which were summed: the first bucket and the one the sum stops
        before (None: unbounded); ``start`` and ``end`` are the range as asked.

        ``gpus`` counts physical GPUs (a MIG GPU once), observed GPU-seconds and energy are the physical GPUs',
        allocated and SM-active GPU-seconds count a MIG instance's seconds by its slice fraction, ``samples``
        the samples agents sent; ``unattributed_energy_joules`` is the energy charged to no job. ``jobs_measured``
        counts the jobs (cluster, job id) measured on some GPU between its first and last sample whose span
        reaches into those hours (the usage rows keep a job's first and last sample per GPU, not its hours)."""
        first, stop = hour_span(start, end)
        where, args = self._hour_range(first, stop)
        # physical GPUs: a MIG instance's key holds no seconds or energy of its own (aggregate's rules)
        row = self._db.execute(
            f"SELECT {_total('observed_s')}, {_total('energy_j')}, {_total('alloc_s')}, {_total('sm_s')}, "
            f"{_total('samples')}, {_total('job_energy_j')}, {_total('anomalies')} FROM gpu_hours" + where,
            args,
        ).fetchone()
        gpus = self._db.execute(f"SELECT COUNT(*) FROM (SELECT DISTINCT host, gpu_uuid FROM gpu_hours{where}) AS g",
                                args).fetchone()[0]
        # a job's sample at ts counts in the hour holding ts: its span [first_ts, last_ts] meets [first, stop)
        spans = [(c, v) for c, v in (("last_ts >= ?", first), ("first_ts < ?", stop)) if v is not None]
        jobs = self._db.execute(
            "SELECT COUNT(*) FROM (SELECT DISTINCT cluster, job_id FROM usage"
            + (" WHERE " + " AND ".join(c for c, _ in spans) if spans else "") + ") AS j",
            [v for _, v in spans]).fetchone()[0]
        return {
            "start": start,
            "end": end,
            "hours_start": first,
            "hours_end": stop,
            "gpus": gpus,
            "samples": int(row[4]),
            "observed_gpu_seconds": row[0],
            "allocated_gpu_seconds": row[2],
            "sm_active_gpu_seconds": row[3],
            "energy_joules": row[1],
            "unattributed_energy_joules": row[1] - row[5],
            "counter_anomalies": int(row[6]),
            "jobs_measured": jobs,
        }

    def gpu_energy(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per physical GPU (host, gpu_uuid), over the whole hours of [start, end) (:func:`hour_span`): observed and
        allocated GPU-seconds, energy, the part charged to jobs, the unattributed (idle) rest and counter
        anomalies."""
        where, args = self._hour_range(*hour_span(start, end))
        rows = self._db.execute(
            f"SELECT host, gpu_uuid, {_total('observed_s')}, {_total('alloc_s')}, {_total('energy_j')}, "
            f"{_total('job_energy_j')}, {_total('anomalies')} FROM gpu_hours{where} GROUP BY host, gpu_uuid "
            "ORDER BY host, gpu_uuid", args).fetchall()
        return [{"host": h, "gpu_uuid": u, "observed_gpu_seconds": obs, "allocated_gpu_seconds": alloc,
                 "energy_joules": e, "job_energy_joules": je, "unattributed_energy_joules": e - je,
                 "counter_anomalies": int(an)} for h, u, obs, alloc, e, je, an in rows]

    def energy_gaps(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Gaps in each GPU's samples that ended in [start, end): span, the counter delta across it (J) and the
        jobs it was charged to (empty: unattributed). Accounting may reassign these from the scheduler's records.
        A MIG instance's record (``mig`` set) is a gap its jobs held (each charged its slice); its energy is the
        physical GPU's delta, which the physical record (no jobs) also holds."""
        lo = -math.inf if start is None else start
        hi = math.inf if end is None else end
        rows = self._db.execute(
            'SELECT host, gpu_uuid, mig, start, "end", energy_j, jobs FROM energy_gaps WHERE "end" >= ? AND "end" < ? '
            "ORDER BY host, gpu_uuid, mig, start", (lo, hi)).fetchall()
        return [{"host": h, "gpu_uuid": u, "mig": m or None, "start": a, "end": b, "energy_joules": e,
                 "job_ids": json.loads(j)} for h, u, m, a, b, e, j in rows]

    def counter_anomalies(self) -> int:
        """Intervals whose energy counter was not trusted, over all GPUs (for the collector's metric)."""
        return int(self._db.execute(f"SELECT {_total('anomalies')} FROM gpus").fetchone()[0])

    def gpu_hours(self, start: float | None = None, end: float | None = None) -> list[dict]:
        """Per GPU (host, uuid, mig) over the whole hours of [start, end) (:func:`hour_span`): observed GPU-seconds,
        GPU-seconds that carried a job, energy, the GPU's model and cluster (for reconciliation)."""
        where, args = self._hour_range(*hour_span(start, end))
        rows = self._db.execute(
            f"SELECT h.host, h.gpu_uuid, h.mig, {_total('h.observed_s')}, {_total('h.alloc_s')}, "
            f"{_total('h.energy_j')}, "
            "COALESCE(g.model, ''), COALESCE(c.cluster, '') FROM gpu_hours h "
            "LEFT JOIN gpus g ON g.host=h.host AND g.gpu_uuid=h.gpu_uuid AND g.mig=h.mig "
            "LEFT JOIN gpu_clusters c ON c.host=h.host AND c.gpu_uuid=h.gpu_uuid"
            + where.replace("hour", "h.hour")
            # one gpus row and one gpu_clusters row at most per group: grouping by them splits nothing
            + " GROUP BY h.host, h.gpu_uuid, h.mig, g.model, c.cluster ORDER BY h.host, h.gpu_uuid, h.mig",
            args).fetchall()
        return [{"host": r[0], "gpu_uuid": r[1], "mig": r[2], "observed_gpu_seconds": r[3],
                 "job_gpu_seconds": r[4], "energy_joules": r[5], "model": r[6], "cluster": r[7]} for r in rows]

    def busy_hours(self, since: float | None = None) -> dict[GpuKey, list[tuple[float, float]]]:
        """Per GPU: (hour start, GPU-seconds that carried a job) of every hour bucket with any, in time order;
        hours starting before ``since`` left out. Where in time a job's measured use fell (decay placement)."""
        sql = "SELECT host, gpu_uuid, mig, hour, alloc_s FROM gpu_hours WHERE alloc_s > 0"
        args: tuple = ()
        if since is not None and math.isfinite(since):
            sql, args = sql + " AND hour >= ?", (hour_span(since, None)[0],)
        out: dict[GpuKey, list[tuple[float, float]]] = {}
        for host, uuid, mig, hour, alloc in self._db.execute(sql + " ORDER BY host, gpu_uuid, mig, hour", args):
            out.setdefault((host, uuid, mig), []).append((hour, alloc))
        return out


def authoritative(records: Iterable[tuple[JobRecord, str]]) -> list[JobRecord]:
    """One record per job from (record, source) pairs: every scheduler record; an agent's only for a job the
    scheduler has no record of (same cluster, or either cluster unnamed). Scheduler records always win."""
    records = list(records)
    slurm = [r for r, src in records if src == SLURM]
    by_id: dict[str, set[str]] = {}
    for r in slurm:
        by_id.setdefault(r.job_id, set()).add(r.cluster)
    out = list(slurm)
    for r, src in records:
        if src != AGENT:
            continue
        clusters = by_id.get(r.job_id, set())
        if r.cluster in clusters or "" in clusters or (r.cluster == "" and clusters):
            continue
        out.append(r)
    return out

