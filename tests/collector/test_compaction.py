"""The store's compaction while ingest goes on, on both ledger engines: it plans through a connection of its own
(outside the store's lock) and writes in short steps of many GPUs each; what it leaves is what compacting after
ingest leaves (raw samples exact, rollups and the ledger bit for bit)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from ledger_engines import commit_counter

from gpuledger.agent.push import encode_batch
from gpuledger.collector import rollup
from gpuledger.collector import store as store_module
from gpuledger.collector.chunks import NUMERIC_FIELDS
from gpuledger.collector.db import open_database
from gpuledger.collector.series_store import HOUR, MINUTE, RAW, ChunkSeriesStore, Retention
from gpuledger.collector.store import CompactStats, Store
from gpuledger.collector.validate import parse_batch
from gpuledger.schema.records import GpuSample

NOW = 1_700_000_000.0
START = NOW - 3 * 3600.0
RET = Retention(raw_chunk_s=600.0)  # 10-minute raw intervals: several close while the test ingests
HOSTS = [f"n{h}" for h in range(6)]
GPUS = 3


def body(host: str, seq: int, start: float = START) -> bytes:
    """``host``'s batch ``seq``: 10 s of its GPUs at 1 Hz from ``start``, as the default agent pushes them (job
    changes)."""
    samples = [GpuSample(ts=start + 10 * seq + k + 0.25 * g, host=host, gpu_uuid=f"{host}-G{g}", gpu_index=g,
                         model="H200", power_watts=100.0 + ((seq * 7 + k * 3 + g) % 500) / 10,
                         energy_joules=1e6 + 250.0 * (10 * seq + k), sm_active_ratio=((seq + k) % 10) / 10,
                         job_ids=(f"{host}-{seq // 40}",))
               for g in range(GPUS) for k in range(10)]
    return encode_batch(f"agent-{host}", host, seq, samples, fmt="msgpack")


def make_store(url) -> Store:
    return Store(url, window_s=60.0, retention=RET, clock=lambda: NOW)


def ingest_all(store: Store, batches: int) -> None:
    for seq in range(batches):
        for host in HOSTS:
            assert store.ingest(parse_batch(body(host, seq), "application/msgpack", NOW)).accepted == 10 * GPUS


def snapshot(store: Store) -> str:
    """Every GPU's raw samples, minute and hour rollups, the usage per job and GPU, the totals: as JSON (floats
    by repr, so equal means bit for bit, but for the totals)."""
    out: list = []
    for host in HOSTS:
        for g in range(GPUS):
            uuid = f"{host}-G{g}"
            out.append([s.to_dict() for s in store.series(host, uuid, 0, 2e9)])
            for tier in (MINUTE, HOUR):
                out.append([p.to_dict() for p in store.series(host, uuid, 0, 2e9, tier=tier)])
    out.append([u.to_dict() for u in store.job_usage(per_gpu=True)])
    # cluster totals are SQL SUMs over the ledger's hour rows in storage order, which on PostgreSQL follows the
    # rows' update history (an UPDATE writes a new row version elsewhere): equal to 12 significant digits
    out.append({k: float(f"{v:.12g}") if isinstance(v, float) else v for k, v in store.totals().items()})
    return json.dumps(out, sort_keys=True, default=repr)


def test_compaction_during_ingest_leaves_what_compaction_after_it_leaves(new_ledger):
    batches = 150  # 25 minutes of each host: minutes become final and raw intervals close as it goes
    store, reference = make_store(new_ledger()), make_store(new_ledger())
    passes: list[CompactStats] = []
    errors: list[BaseException] = []
    ingesting = threading.Event()
    ingesting.set()

    def compactor() -> None:
        try:
            while ingesting.is_set():
                passes.append(store.compact(now=NOW))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def agents(hosts: list[str]) -> None:
        try:
            for seq in range(batches):
                for host in hosts:
                    assert store.ingest(parse_batch(body(host, seq), "application/msgpack", NOW)).accepted == 30
                time.sleep(0.005)  # agents push every so often: compaction passes come between their batches
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=agents, args=(HOSTS[i::3],)) for i in range(3)]
    compacting = threading.Thread(target=compactor)
    compacting.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ingesting.clear()
    compacting.join()
    assert not errors
    during = [sum(getattr(p, f) for p in passes) for f in ("split_chunks", "merged_chunks", "rolled_minutes")]
    assert all(during), f"compaction found nothing to do while ingest ran: {passes}"
    store.compact(now=NOW)
    ingest_all(reference, batches)
    reference.compact(now=NOW)
    assert snapshot(store) == snapshot(reference)
    assert store.tiers()[RAW]["rows"] == len(HOSTS) * GPUS * 10 * batches
    store.close()
    reference.close()


@pytest.mark.parametrize("step_s", [0.0, 60.0])
def test_compaction_writes_many_gpus_a_transaction_in_bounded_steps(ledger, new_ledger, monkeypatch, step_s):
    """A step takes planned writes until ``COMPACTION_STEP_S`` of work is done: with none, one GPU's roll-up or
    one merge a transaction; with a long one, hundreds of them in one (a commit each, not each GPU's). Either way
    the same result."""
    store, reference = make_store(ledger), make_store(new_ledger())
    ingest_all(store, 80)
    ingest_all(reference, 80)
    writes = 0
    ref_chunks = reference.series_store
    for host in ref_chunks.split_hosts():  # the reference: one transaction per host's split, GPU's roll-up, merge
        for plan in ref_chunks.plan_host_splits(host):
            with reference.db.transaction():
                ref_chunks.apply_host_split(plan)
            writes += 1
    for gpu_key in reference.gpus():
        reference.series_store.roll_up(gpu_key, START + 799.5 - reference.agg.window_s)
        writes += 1
    for tier in (RAW, MINUTE, HOUR):
        for group in reference.series_store.mergeable_groups(tier, NOW):
            reference.series_store.merge(group)
            writes += 1
    monkeypatch.setattr(store_module, "COMPACTION_STEP_S", step_s)
    commits = commit_counter(store)
    stats = store.compact(now=NOW)
    assert stats.rolled_minutes == len(HOSTS) * GPUS * 12 and stats.split_chunks == len(HOSTS) * 80
    if step_s:
        assert commits() <= 4  # host splits, roll-ups, merges (none), (expiry: none) and the batch keys' pruning
    else:
        assert commits() >= writes
    assert snapshot(store) == snapshot(reference)
    store.close()
    reference.close()


def test_an_active_gpus_minutes_are_rolled_up_ten_at_a_time_and_a_quiet_gpus_at_once(ledger):
    store = make_store(ledger)
    gk = ("n0", "n0-G0", "")

    def ingest(seqs: range) -> None:
        for seq in seqs:
            for host in HOSTS:
                store.ingest(parse_batch(body(host, seq), "application/msgpack", NOW))

    def rolled() -> float:
        until = store.series_store.rolled_up_until(gk, MINUTE)
        assert until is not None
        return until

    ingest(range(30))
    store.compact(now=NOW)  # the first pass rolls up every GPU
    first = rolled()
    assert first == (START + 299 - 60) // 60 * 60
    ingest(range(30, 36))  # a minute more: the GPU is sending, fewer than ten final minutes wait
    store.compact(now=NOW)
    assert rolled() == first
    minutes = store.series("n0", "n0-G0", 0, 2e9, step=60)  # the rest summarised from raw samples
    assert sum(p.samples for p in minutes) == 360
    store.compact(now=NOW)  # nothing arrived since the last pass: the quiet GPU is rolled up at once
    assert rolled() == (START + 359 - 60) // 60 * 60
    ingest(range(36, 100))  # more than ten minutes
    store.compact(now=NOW)
    assert rolled() == (START + 999 - 60) // 60 * 60
    assert sum(p.samples for p in store.series("n0", "n0-G0", 0, 2e9, step=60)) == 1000
    store.close()


def test_expiry_keeps_the_samples_a_late_sample_needs_however_old(ledger):
    # Samples a week and a day old when they arrive (an agent's spool replayed after an outage): past raw
    # retention by the clock, yet in the GPU's late window. Expiry must keep the window's raw samples and the
    # newest one before it, or a late sample's interval (anchor, next] is never taken out and is counted twice.
    from gpuledger.collector.aggregate import Aggregator
    from gpuledger.collector.validate import Batch

    t0 = 1_700_002_800.0  # an hour boundary
    now = t0 + 8 * 86400

    def sample(t: float) -> GpuSample:
        return GpuSample(ts=t0 + t, host="n1", gpu_uuid="G0", gpu_index=0, model="H200",
                         energy_joules=100.0 * (t + 3600), power_watts=100.0, job_ids=("7",))

    on_time = [sample(t) for t in [*range(-3600, 3600, 10), *range(3610, 4200, 10), 4203]]  # none at 3600
    late = sample(3605)  # after the window's floor (4203 - 600): its interval splits (3590, 3610]
    reference = Aggregator()
    for s in [*on_time, late]:
        reference.add(s)
    (expected,) = reference.job_usage("7")
    store = Store(ledger, clock=lambda: now)
    try:
        for i in range(0, len(on_time), 10):
            store.ingest(Batch("a", i, "n1", tuple(on_time[i:i + 10])))
        stats = store.compact(now=now)
        assert stats.deleted_chunks > 0  # the hour before the anchor's is gone
        assert store.ingest(Batch("a", 10**6, "n1", (late,))).accepted == 1
        (u,) = store.job_usage("7")
        assert (u.allocated_gpu_seconds, u.energy_joules) == (expected.allocated_gpu_seconds, expected.energy_joules)
        assert u.allocated_gpu_seconds == 3600 + 4203.0
        store.close()
        store = Store(ledger, clock=lambda: now)  # a restart reads the window from what expiry left
        assert store.ingest(Batch("a", 10**6 + 1, "n1", (sample(3615),))).accepted == 1
        (u,) = store.job_usage("7")
        assert (u.allocated_gpu_seconds, u.energy_joules) == (expected.allocated_gpu_seconds, expected.energy_joules)
    finally:
        store.close()


def test_a_roll_up_reads_a_gpus_state_and_first_times_in_one_statement_each(tmp_path):
    # Every pass plans a roll-up of every GPU whose minutes became final (the first pass: every GPU), and the
    # statements per GPU were most of that pass's CPU: its state (both tiers) and where its tiers start are one
    # read each in the plan, its state one read in the apply.
    db = open_database(tmp_path / "series.sqlite")
    chunks = ChunkSeriesStore(db, RET)
    gk = ("n0", "n0-G0", "")
    chunks.write_samples([GpuSample(ts=START + k, host="n0", gpu_uuid="n0-G0", gpu_index=0, model="H200",
                                    power_watts=100.0 + k % 7) for k in range(1200)])
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)  # type: ignore[attr-defined]  # SQLite's own connection

    def reads(table: str) -> int:
        return sum(s.lstrip().upper().startswith("SELECT") and f"FROM {table}" in s for s in statements)

    for final_before, minutes, first_reads in ((START + 600, 10, 1), (START + 1200, 10, 0)):
        statements.clear()
        plan = chunks.plan_roll_up(gk, final_before)
        assert plan.minutes == minutes
        assert reads("rollup_state") == 1
        assert sum("MIN(t_min)" in s for s in statements) == first_reads  # none once both tiers have a state
        statements.clear()
        with db.transaction():
            assert chunks.apply_roll_up(plan) == (minutes, 0)
        assert reads("rollup_state") == 1
    db.conn.set_trace_callback(None)  # type: ignore[attr-defined]
    assert sum(p.samples for p in chunks.series("n0", "n0-G0", 0, 2e9, tier=MINUTE)) == 1200
    db.close()


def test_an_empty_rollup_allocates_no_column():
    # Compaction plans two empty rollups for each GPU with no minute to roll up (every GPU at its first pass): a
    # fresh array per field and statistic was 40% of that pass's CPU. A zero-length array cannot be changed by
    # what is written into it, so one serves every column.
    a, b = rollup.empty(), rollup.empty()
    columns = [a.ts, a.samples, b.ts, *(c for r in (a, b) for stats in r.stats.values() for c in stats)]
    assert len(a) == 0 and set(a.stats) == set(NUMERIC_FIELDS)
    assert all(c is a.ts for c in columns)
    a.stats["power_watts"][1][:] = 1.0
    assert b.stats["power_watts"][1].size == 0 and a.stats is not b.stats
