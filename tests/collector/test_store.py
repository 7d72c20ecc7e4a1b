"""The store on either ledger engine (SQLite, PostgreSQL): one transaction per batch, idempotency, restart
exactness, queries."""

from __future__ import annotations

import random

import pytest
from ledger_engines import allow_inserts, fail_inserts

from gpuledger.collector.aggregate import Aggregator
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

T0 = 1_700_000_000.0


def stream(n: int, gpus=("G0", "G1"), seed: int = 0) -> list[GpuSample]:
    """A plausible stream: two GPUs, a job change, a counter reset, a gap, some missing fields."""
    rnd = random.Random(seed)
    out = []
    for g in gpus:
        e = 1e6
        for i in range(n):
            ts = T0 + i * 10.0 + (900 if i > n * 0.7 else 0)  # a 900 s gap at 70 %
            e = 100.0 if i == n // 2 else e + rnd.uniform(1000, 7000)  # a driver reload half-way
            job = ("100",) if i < n // 3 else (("200", "300") if g == "G0" else ("200",))
            out.append(GpuSample(ts=ts, host="n1", gpu_uuid=g, gpu_index=0, model="H200", energy_joules=e,
                                 power_watts=rnd.uniform(75, 700), sm_active_ratio=rnd.random(),
                                 dram_bw_ratio=rnd.choice([None, rnd.random()]), mem_used_bytes=rnd.randrange(10**11),
                                 job_ids=job))
    return out


def batches(samples: list[GpuSample], size: int, agent: str = "a1") -> list[Batch]:
    return [Batch(agent, i, "n1", tuple(samples[j:j + size])) for i, j in enumerate(range(0, len(samples), size))]


def as_dicts(rows) -> dict:
    return {(u.job_id, u.host, u.gpu_uuid): u.to_dict() for u in rows}


def assert_usage_equal(a, b) -> None:
    da, db = as_dicts(a), as_dicts(b)
    assert da.keys() == db.keys()
    for k in da:
        for f, v in da[k].items():
            if isinstance(v, float):
                assert v == pytest.approx(db[k][f], rel=1e-9, abs=1e-6), (k, f)
            else:
                assert v == db[k][f], (k, f)


def test_ingest_matches_in_memory_aggregation(ledger):
    samples = stream(60)
    store = Store(ledger)
    for b in batches(samples, 7):
        r = store.ingest(b)
        assert r.accepted == len(b.samples) and not r.duplicate_batch
    ref = Aggregator()
    for s in sorted(samples, key=lambda s: s.ts):
        ref.add(s)
    assert_usage_equal(store.job_usage(per_gpu=True), ref.job_usage(per_gpu=True))
    assert_usage_equal(store.job_usage(), ref.job_usage())
    (u,) = store.job_usage("200")
    assert u.gpus == 2 and u.gpu_uuid == "*" and u.host == "n1"
    store.close()


def test_duplicate_batch_is_acknowledged_and_not_stored_again(ledger):
    store = Store(ledger)
    (b,) = batches(stream(5, gpus=("G0",)), 100)
    assert store.ingest(b).accepted == 5
    before = as_dicts(store.job_usage(per_gpu=True))
    again = store.ingest(b)
    assert again.duplicate_batch and again.accepted == 0
    assert as_dicts(store.job_usage(per_gpu=True)) == before
    # the same samples under a new seq: the last is a duplicate, the four before the 900 s gap are
    # now older than the window
    r = store.ingest(Batch("a1", 99, "n1", b.samples))
    assert (r.accepted, r.duplicate_samples, r.too_late) == (0, 1, 4)
    assert store.batches_seen() == 2
    assert len(store.series("n1", "G0", 0, 2e9)) == 5
    store.close()


@pytest.mark.parametrize("cut", [1, 5, 13])
def test_restart_mid_stream_equals_uninterrupted_run(new_ledger, cut):
    samples = stream(80, seed=cut)
    rnd = random.Random(cut)
    # jitter the order within the window so late inserts straddle the restart
    samples.sort(key=lambda s: s.ts + rnd.uniform(-200, 200))
    bs = batches(samples, 9)
    one_ledger, two_ledger = new_ledger(), new_ledger()
    one = Store(one_ledger)
    for b in bs:
        one.ingest(b)
    two = Store(two_ledger)
    for i, b in enumerate(bs):
        if i == cut:
            two.close()
            two = Store(two_ledger)
        two.ingest(b)
    # restoring a GPU's window and totals from the ledger is exact: the same sums to the last bit
    assert one.job_usage(per_gpu=True) == two.job_usage(per_gpu=True)
    assert one.job_usage() == two.job_usage()
    assert one.gpus() == two.gpus() and one.energy_gaps() == two.energy_gaps()
    assert one.totals() == pytest.approx(two.totals())
    one.close()
    two.close()


def test_a_restored_window_keeps_its_anchor_from_a_chunk_reaching_past_the_window(new_ledger):
    """The sample before the late window (the anchor: the previous sample of a late one landing first in the
    window) sits in a chunk that reaches into the window: restored with it, a late sample splits the same interval
    as in memory."""
    mk = lambda ts, job: GpuSample(ts=T0 + ts, host="n1", gpu_uuid="G0", gpu_index=0,  # noqa: E731
                                   energy_joules=100.0 * ts, power_watts=100.0, job_ids=(job,))
    first = Batch("a", 0, "n1", (mk(0, "1"), mk(10, "1"), mk(20, "1"), mk(30, "1"), mk(45, "2"), mk(100, "2")))
    late = Batch("a", 1, "n1", (mk(42, "3"),))  # window 60 s: 40 to 100; its previous sample is the anchor at 30
    one, two = new_ledger(), new_ledger()
    kept = Store(one, window_s=60)
    restarted = Store(two, window_s=60)
    for store in (kept, restarted):
        store.ingest(first)
    restarted.close()
    restarted = Store(two, window_s=60)
    for store in (kept, restarted):
        assert store.ingest(late).accepted == 1
    assert restarted.job_usage(per_gpu=True) == kept.job_usage(per_gpu=True)
    assert {u.job_id: u.allocated_gpu_seconds for u in restarted.job_usage()} == {"1": 30.0, "2": 58.0, "3": 12.0}
    kept.close()
    restarted.close()


def test_failed_write_stores_nothing_and_keeps_memory_consistent(ledger):
    store = Store(ledger)
    samples = stream(30, gpus=("G0",))
    store.ingest(Batch("a1", 0, "n1", tuple(samples[:10])))
    before = as_dicts(store.job_usage(per_gpu=True))
    # A trigger makes the batch-id insert fail after samples and aggregation were written.
    fail_inserts(store, "batch_keys", "NEW.seq = 1", "disk says no")
    with pytest.raises(Exception, match="disk says no"):
        store.ingest(Batch("a1", 1, "n1", tuple(samples[10:20])))
    assert as_dicts(store.job_usage(per_gpu=True)) == before
    assert len(store.series("n1", "G0", 0, 2e9)) == 10
    allow_inserts(store, "batch_keys")
    store.ingest(Batch("a1", 1, "n1", tuple(samples[10:20])))
    store.ingest(Batch("a1", 2, "n1", tuple(samples[20:])))
    ref = Aggregator()
    for s in samples:
        ref.add(s)
    assert_usage_equal(store.job_usage(per_gpu=True), ref.job_usage(per_gpu=True))
    store.close()


def test_too_late_samples_are_counted_not_stored(ledger):
    store = Store(ledger, window_s=60)
    mk = lambda ts: GpuSample(ts=ts, host="n1", gpu_uuid="G0", gpu_index=0, job_ids=("1",))  # noqa: E731
    store.ingest(Batch("a", 0, "n1", (mk(T0), mk(T0 + 100))))
    r = store.ingest(Batch("a", 1, "n1", (mk(T0 + 30), mk(T0 + 50), mk(T0 + 110))))
    assert (r.accepted, r.too_late) == (2, 1)
    assert [s.ts for s in store.series("n1", "G0", 0, 2e9)] == [T0, T0 + 50, T0 + 100, T0 + 110]
    store.close()


def test_jobs_upsert_is_idempotent(ledger):
    store = Store(ledger)
    recs = [JobRecord("1", cluster="c", user="ann", hosts=("n1",), tres=(("gres/gpu", 2.0),)),
            JobRecord("2", cluster="c", user="bob")]
    assert store.put_jobs(recs) == 2
    assert store.put_jobs(recs) == 0
    assert store.put_jobs([JobRecord("2", cluster="c", user="bob", state="COMPLETED")]) == 1
    assert [j.job_id for j in store.jobs()] == ["1", "2"]
    assert store.jobs()[0] == recs[0] and store.jobs()[1].state == "COMPLETED"
    store.close()


def test_series_and_totals(ledger):
    store = Store(ledger)
    mk = lambda ts, e, j=("1",): GpuSample(ts=ts, host="n1", gpu_uuid="G0", gpu_index=0,  # noqa: E731
                                          energy_joules=e, sm_active_ratio=0.5, job_ids=j)
    h = 3600.0 * 500_000  # an hour boundary
    store.ingest(Batch("a", 0, "n1", (mk(h - 20, 0.0), mk(h - 10, 100.0), mk(h + 10, 300.0, ()), mk(h + 20, 400.0))))
    assert [s.ts for s in store.series("n1", "G0", h - 10, h + 10)] == [h - 10, h + 10]
    assert store.series("n1", "G0", h - 10, h + 10)[0] == mk(h - 10, 100.0)
    t = store.totals()
    assert t["gpus"] == 1 and t["samples"] == 4 and t["jobs_measured"] == 1
    assert t["observed_gpu_seconds"] == pytest.approx(40.0)
    assert t["allocated_gpu_seconds"] == pytest.approx(20.0)  # the jobless interval charges nobody
    assert t["sm_active_gpu_seconds"] == pytest.approx(10.0)
    assert t["energy_joules"] == pytest.approx(400.0)
    later = store.totals(start=h)
    # an interval belongs to the hour of its end: (h-10, h+10] and (h+10, h+20]
    assert later["observed_gpu_seconds"] == pytest.approx(30.0) and later["energy_joules"] == pytest.approx(300.0)
    assert store.totals(end=h)["energy_joules"] == pytest.approx(100.0)
    assert store.size_bytes() > 0
    store.close()


def test_schema_version_mismatch_is_refused(ledger):
    store = Store(ledger)
    store.db.execute("UPDATE meta SET value='999' WHERE key='schema'")
    store.close()
    with pytest.raises(RuntimeError, match="schema 999"):
        Store(ledger)


def test_raw_rows_survive_reopen_and_refuse_reordered_fields(ledger):
    from gpuledger.schema.records import GpuProcess

    procs = (GpuProcess(5, 7), GpuProcess(6, None), GpuProcess(8, 9, 0.375))  # the last with its kernels' time
    s = GpuSample(ts=T0, host="n1", gpu_uuid="G0", gpu_index=3, mig="1.0", processes=procs,
                  xid_errors=(79,), job_ids=("1", "2"), job_shares=(0.5, 0.5), temp_celsius=40.0)
    store = Store(ledger)
    store.ingest(Batch("a", 0, "n1", (s,)))
    store.close()
    store = Store(ledger)
    assert store.series("n1", "G0", T0, T0, mig="1.0") == [s]
    store.db.execute("""UPDATE meta SET value='["host", "ts"]' WHERE key='sample_fields'""")
    store.close()
    with pytest.raises(RuntimeError, match="not a prefix"):
        Store(ledger)
