"""Group commit: concurrent batches share transactions, each is acknowledged only once committed, and one
batch's failure costs the others nothing."""

from __future__ import annotations

import threading

import pytest
from ledger_engines import commit_counter, fail_inserts

from gpuledger.agent.push import encode_batch
from gpuledger.collector.store import BatchConflict, Store
from gpuledger.collector.validate import parse_batch
from gpuledger.schema.records import GpuSample

NOW = 1_700_000_000.0


def body(host: str, seq: int, gpu_index: int = 0) -> bytes:
    s = [GpuSample(ts=NOW - 600 + 10 * seq + k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=gpu_index,
                   sm_active_ratio=0.5, energy_joules=1e6 + 100.0 * (10 * seq + k), job_ids=("7",)) for k in range(10)]
    return encode_batch(f"agent-{host}", host, seq, s, fmt="msgpack")


def batch(host: str, seq: int, gpu_index: int = 0):
    return parse_batch(body(host, seq, gpu_index), "application/msgpack", NOW)


def test_concurrent_batches_share_commits_and_all_are_stored(ledger):
    store = Store(ledger, clock=lambda: NOW)
    commits = commit_counter(store)
    results: dict[tuple[str, int], int] = {}
    start = threading.Barrier(32)

    def node(h: int) -> None:
        start.wait()
        for seq in range(5):
            results[(f"n{h}", seq)] = store.ingest(batch(f"n{h}", seq)).accepted

    threads = [threading.Thread(target=node, args=(h,)) for h in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 160 and set(results.values()) == {10}
    assert store.totals()["samples"] == 1600
    assert commits() < 160  # batches waiting together were committed together
    store.close()


def one_group(store: Store, named: dict) -> dict[str, object]:
    """Ingest ``named`` batches from threads while the writer lock is held, so they queue up and commit as one
    group; each name's outcome: samples accepted, or the exception raised."""
    outcomes: dict[str, object] = {}

    def go(name: str, b) -> None:
        try:
            outcomes[name] = store.ingest(b).accepted
        except Exception as e:  # noqa: BLE001 - a batch's own error is its outcome
            outcomes[name] = e

    with store._lock:
        ts = [threading.Thread(target=go, args=item) for item in named.items()]
        for t in ts:
            t.start()
        while len(store._queue) < len(named):
            threading.Event().wait(0.01)
    for t in ts:
        t.join()
    return outcomes


def test_a_conflict_in_a_group_is_answered_alone(ledger):
    store = Store(ledger, clock=lambda: NOW)
    store.ingest(batch("n1", 0))
    outcomes = one_group(store, {"ok1": batch("n2", 0), "conflict": batch("n1", 0, gpu_index=3),
                                 "ok2": batch("n3", 0)})
    assert outcomes["ok1"] == 10 and outcomes["ok2"] == 10 and isinstance(outcomes["conflict"], BatchConflict)
    assert store.totals()["samples"] == 30
    store.close()


def test_each_group_commit_is_observed_with_its_batches_and_time(ledger):
    store = Store(ledger, clock=lambda: NOW)
    seen: list[tuple[int, float]] = []
    store.commit_observers.append(lambda batches, seconds: seen.append((batches, seconds)))
    store.ingest(batch("n1", 0))
    one_group(store, {"a": batch("n2", 0), "b": batch("n3", 0), "dup": batch("n1", 0)})
    assert [n for n, _ in seen] == [1, 3]  # a duplicate is committed (its answer) with its group
    assert all(0 < t < 10 for _, t in seen)
    fail_inserts(store, "batch_keys", "NEW.host = 'bad'", "one bad batch")
    seen.clear()
    one_group(store, {"c": batch("n4", 0), "bad": batch("bad", 0)})
    assert sorted(n for n, _ in seen) == [1]  # the group failed, then each alone: only c's commit stored anything

    def broken(batches: int, seconds: float) -> None:
        raise RuntimeError("a broken metric")

    store.commit_observers.insert(0, broken)  # costs no batch its answer, nor the next observer its call
    assert store.ingest(batch("n5", 0)).accepted == 10 and seen[-1][0] == 1
    store.close()


def test_a_batch_that_breaks_the_transaction_costs_its_group_nothing(ledger):
    store = Store(ledger, clock=lambda: NOW)
    fail_inserts(store, "batch_keys", "NEW.host = 'bad'", "one bad batch")
    outcomes = one_group(store, {"a": batch("n1", 0), "bad": batch("bad", 0), "b": batch("n2", 0)})
    assert outcomes["a"] == 10 and outcomes["b"] == 10 and "one bad batch" in str(outcomes["bad"])
    assert store.totals()["samples"] == 20
    store.close()


def test_batch_keys_are_pruned_past_the_dedupe_horizon(ledger):
    store = Store(ledger, clock=lambda: NOW, dedupe_horizon_s=3600)
    for seq in range(3):
        store.ingest(batch("n1", seq))
    store.compact(now=NOW + 1800)
    assert store.batches_seen() == 3  # within the horizon: kept, a resend is still a duplicate
    assert store.ingest(batch("n1", 0)).duplicate_batch
    store.compact(now=NOW + 7200)
    assert store.batches_seen() == 0
    assert store.totals()["samples"] == 30  # the data stays; only the keys go
    store.close()


def test_past_hours_leave_memory_and_the_sums_go_on_exactly(ledger):
    from gpuledger.collector.aggregate import Aggregator

    clock = [NOW]
    store = Store(ledger, clock=lambda: clock[0], window_s=60.0, idle_evict_s=60)
    ref = Aggregator(window_s=60.0)
    for seq in range(400):  # 4,000 s: across an hour boundary (NOW - 600 + 3,400 s)
        b = parse_batch(body("n1", seq), "application/msgpack", clock[0])
        store.ingest(b)
        for s in b.samples:
            ref.add(s)
        clock[0] += 10.0
    hour = 3600.0
    boundary = (NOW - 600 + 3400) // hour * hour
    assert [k[3] for k in store.agg.hours] == [boundary]  # the hour before it ended two windows ago: dropped
    assert {k[3] for k in ref.hours} == {boundary - hour, boundary}
    stored = store.db.execute("SELECT hour, observed_s, energy_j, alloc_s, samples FROM gpu_hours ORDER BY hour")
    assert [tuple(r) for r in stored.fetchall()] == [  # bit for bit what the per-sample reference sums
        (k[3], a.observed_s, a.energy_j, a.alloc_s, a.samples) for k, a in sorted(ref.hours.items())]
    assert sum(a.samples for a in ref.hours.values()) == 4000
    store.close()


def test_idle_gpus_leave_memory_and_come_back_exactly(ledger):
    from gpuledger.collector.aggregate import Aggregator

    clock = [NOW]
    store = Store(ledger, clock=lambda: clock[0], idle_evict_s=60)
    ref = Aggregator()
    for seq in range(3):
        for host in ("n1", "n2"):
            b = batch(host, seq)
            store.ingest(b)
            for s in b.samples:
                ref.add(s)
    assert {k[0] for k in store.agg.gpus} == {"n1", "n2"}
    clock[0] += 120  # n1 falls silent; n2 pushes on
    b = batch("n2", 3)
    store.ingest(b)
    for s in b.samples:
        ref.add(s)
    assert {k[0] for k in store.agg.gpus} == {"n2"}  # n1's window left memory, its sums too
    assert {k[1] for k in store.agg.usage} == {"n2"} and {k[0] for k in store.agg.hours} == {"n2"}
    for seq in (3, 4):  # n1 is back: its window is restored from the store, the sums go on exactly
        b = batch("n1", seq)
        store.ingest(b)
        for s in b.samples:
            ref.add(s)
    got = {(u.job_id, u.host, u.gpu_uuid): u for u in store.job_usage(per_gpu=True)}
    want = {(u.job_id, u.host, u.gpu_uuid): u for u in ref.job_usage(per_gpu=True)}
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].allocated_gpu_seconds == pytest.approx(want[k].allocated_gpu_seconds)
        assert got[k].energy_joules == pytest.approx(want[k].energy_joules)
    store.close()
    again = Store(ledger, clock=lambda: clock[0])
    assert again.agg.gpus == {}  # a restart restores windows on demand, not all at once
    assert again.ingest(batch("n2", 4)).accepted == 10 and len(again.agg.gpus) == 1
    again.close()
