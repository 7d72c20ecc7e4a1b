"""The ledger contract: SQLite and PostgreSQL ledgers behave the same through the store (LedgerStore and
LedgerReader), test for test. Measured values are dyadic (whole seconds and joules, halves and quarters), so every
sum is exact in any order: expectations are the in-memory aggregation's (the reference) to the last bit."""

from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import replace

import pytest

from gpuledger.collector.aggregate import HOUR_S, Aggregator, HourAcc, UsageAcc, summarize
from gpuledger.collector.db import open_database
from gpuledger.collector.ledger_store import NO_DIGEST
from gpuledger.collector.migrations import LATEST, LedgerTooNew, migrate, status
from gpuledger.collector.store import BatchConflict, Store
from gpuledger.collector.validate import Batch, content_digest
from gpuledger.schema.records import GpuSample, JobRecord

T0 = 1_699_999_200.0  # an hour boundary
CLUSTER = {"n1": "c1", "n2": "c2"}


def samples() -> list[GpuSample]:
    """n1/G0 (cluster c1) across an hour boundary: job 1, then jobs 1 and 2 (equal shares), a counter reset (an
    anomaly), a 200 s gap the same jobs hold; n2/G0 (cluster c2) runs a job 1 of its own cluster."""
    out = []
    e = 1_000_000.0
    for k, dt in enumerate([*range(-400, -90, 10), *range(100, 400, 10)]):
        e = 500.0 if dt == 200 else e + 700.0
        jobs = ("1",) if dt < -200 else ("1", "2")
        out.append(GpuSample(ts=T0 + dt, host="n1", gpu_uuid="G0", gpu_index=0, model="H200", energy_joules=e,
                             power_watts=100.0 + k % 4, sm_active_ratio=(0.5, 0.25)[k % 2],
                             mem_used_bytes=2**30 + k, job_ids=jobs))
    out += [GpuSample(ts=T0 + dt, host="n2", gpu_uuid="G0", gpu_index=0, model="A100", energy_joules=64.0 * dt,
                      power_watts=6.5, sm_active_ratio=0.75, job_ids=("1",)) for dt in range(100, 700, 20)]
    return out


def ingest_all(store: Store) -> Aggregator:
    """The samples in batches of 7 per host; returns the reference aggregation of the same samples."""
    ref = Aggregator()
    for host in ("n1", "n2"):
        mine = [s for s in samples() if s.host == host]
        for seq, i in enumerate(range(0, len(mine), 7)):
            r = store.ingest(Batch("a-" + host, seq, host, tuple(mine[i:i + 7]), cluster=CLUSTER[host]))
            assert r.accepted == len(mine[i:i + 7])
    for s in samples():
        ref.add(s)
    return ref


@pytest.fixture
def store(ledger):
    s = Store(ledger)
    yield s
    s.close()


def test_usage_per_job_per_gpu_and_per_cluster(store):
    ref = ingest_all(store)
    rows = {c: [(k, a) for k, a in ref.usage.items() if CLUSTER[k[1]] == c] for c in ("c1", "c2")}
    per_gpu = [replace(u, cluster=c) for c in ("c1", "c2") for u in summarize(rows[c], per_gpu=True)]
    per_job = [replace(u, cluster=c) for c in ("c1", "c2") for u in summarize(rows[c], per_gpu=False)]
    assert store.job_usage(per_gpu=True) == per_gpu
    assert store.job_usage() == per_job
    assert [(u.cluster, u.job_id) for u in store.job_usage("1")] == [("c1", "1"), ("c2", "1")]  # one id, two jobs
    assert store.job_usage("1", cluster="c2") == [per_job[-1]] and store.job_usage(cluster="nowhere") == []
    assert store.job_usage("2", per_gpu=True) == [u for u in per_gpu if u.job_id == "2"]
    one = store.job_usage("1", cluster="c1")[0]
    assert one.gap_gpu_seconds == 100.0 and one.gpus == 1 and one.host == "n1"  # half the held 200 s gap


def test_adjacent_ranges_sum_each_hour_once_and_count_the_jobs_measured_in_them(store):
    """A range sums the hour buckets from the one holding its start up to, not including, the one holding its end:
    [a, b) + [b, c) = [a, c) wherever b falls; jobs_measured counts the jobs measured in those hours."""
    ingest_all(store)
    a, c = T0 - HOUR_S, T0 + HOUR_S
    whole = store.totals(a, c)
    assert whole["samples"] == len(samples()) and (whole["hours_start"], whole["hours_end"]) == (a, c)
    summed = ("samples", "observed_gpu_seconds", "allocated_gpu_seconds", "sm_active_gpu_seconds", "energy_joules",
              "unattributed_energy_joules", "counter_anomalies")
    for b in (T0 - 1800, T0, T0 + 1):  # inside the first hour, on the boundary, just past it
        parts = [store.totals(a, b), store.totals(b, c)]
        assert {f: parts[0][f] + parts[1][f] for f in summed} == {f: whole[f] for f in summed}, b
        energy = [sum(g["energy_joules"] for g in store.gpu_energy(lo, hi)) for lo, hi in ((a, b), (b, c))]
        assert sum(energy) == sum(g["energy_joules"] for g in store.gpu_energy(a, c)), b
        observed = [sum(g["observed_gpu_seconds"] for g in store.gpu_hours(lo, hi)) for lo, hi in ((a, b), (b, c))]
        assert sum(observed) == whole["observed_gpu_seconds"], b
    inside = store.totals(T0 + 10, T0 + 20)  # within one hour: no whole hour, and the answer says which it summed
    assert [inside[k] for k in ("samples", "energy_joules", "hours_start", "hours_end")] == [0, 0.0, T0, T0]
    assert [store.totals(T0 - 1800, T0 + 1800)[k] for k in ("hours_start", "hours_end")] == [T0 - HOUR_S, T0]
    # n1's jobs 1 and 2 ran in both hours; n2's job 1 (another cluster) only from T0 + 100
    assert [store.totals(lo, hi)["jobs_measured"] for lo, hi in ((a, T0), (T0, c), (a, c), (c, c + 86400))] == \
        [2, 3, 3, 0]
    assert store.totals(end=T0)["jobs_measured"] == 2 and store.totals(start=T0)["jobs_measured"] == 3


def test_totals_energy_hours_busy_hours_gaps_and_anomalies(store):
    ref = ingest_all(store)
    hours = ref.hours
    f = HourAcc.FIELDS

    def total(field: str, keys) -> float:
        return sum(getattr(hours[k], field) for k in keys)

    everything = list(hours)
    assert store.totals() == {
        "start": None, "end": None, "gpus": 2, "samples": int(total("samples", everything)),
        "observed_gpu_seconds": total("observed_s", everything), "allocated_gpu_seconds": total("alloc_s", everything),
        "sm_active_gpu_seconds": total("sm_s", everything), "energy_joules": total("energy_j", everything),
        "unattributed_energy_joules": total("energy_j", everything) - total("job_energy_j", everything),
        "counter_anomalies": 1, "jobs_measured": 3, "hours_start": None, "hours_end": None}
    later = [k for k in hours if k[3] >= T0]
    t = store.totals(start=T0 + 1)  # whole hours: the bucket the start falls in counts
    assert (t["observed_gpu_seconds"], t["energy_joules"]) == (total("observed_s", later), total("energy_j", later))
    assert store.totals(end=T0)["energy_joules"] == total("energy_j", [k for k in hours if k[3] < T0])
    assert store.counter_anomalies() == 1 and len(f) == 7
    gpus = {(h, u): [k for k in hours if k[:2] == (h, u)] for h, u in (("n1", "G0"), ("n2", "G0"))}
    assert store.gpu_energy() == [
        {"host": h, "gpu_uuid": u, "observed_gpu_seconds": total("observed_s", ks),
         "allocated_gpu_seconds": total("alloc_s", ks), "energy_joules": total("energy_j", ks),
         "job_energy_joules": total("job_energy_j", ks),
         "unattributed_energy_joules": total("energy_j", ks) - total("job_energy_j", ks),
         "counter_anomalies": int(total("anomalies", ks))} for (h, u), ks in gpus.items()]
    assert store.gpu_hours(T0, T0 + HOUR_S) == [
        {"host": h, "gpu_uuid": u, "mig": "", "observed_gpu_seconds": total("observed_s", [(h, u, "", T0)]),
         "job_gpu_seconds": total("alloc_s", [(h, u, "", T0)]), "energy_joules": total("energy_j", [(h, u, "", T0)]),
         "model": m, "cluster": CLUSTER[h]} for h, u, m in (("n1", "G0", "H200"), ("n2", "G0", "A100"))]
    assert store.busy_hours() == {k: [(kk[3], hours[kk].alloc_s) for kk in sorted(ks)] for k, ks in
                                  ((("n1", "G0", ""), gpus[("n1", "G0")]), (("n2", "G0", ""), gpus[("n2", "G0")]))}
    assert store.busy_hours(since=T0 + 5) == {k: [h for h in v if h[0] >= T0] for k, v in store.busy_hours().items()}
    ((key, (energy, jobs)),) = ref.gaps.items()
    gap = {"host": "n1", "gpu_uuid": "G0", "mig": None, "start": key[3], "end": key[4], "energy_joules": energy,
           "job_ids": list(jobs)}
    assert store.energy_gaps() == [gap] and jobs == ("1", "2")
    assert store.energy_gaps(start=key[4] + 1) == [] and store.energy_gaps(end=key[4] + 1) == [gap]


def test_a_batch_is_stored_once_a_conflict_is_refused_and_old_keys_are_pruned(store):
    mk = lambda t, e: GpuSample(ts=T0 + t, host="n1", gpu_uuid="G0", gpu_index=0, energy_joules=e,  # noqa: E731
                                job_ids=("1",))
    b = Batch("a", 1, "n1", (mk(0, 0.0), mk(10, 1000.0)))
    b.digest = b"digest-1"
    assert store.ingest(b).accepted == 2 and store.ingest(b).duplicate_batch
    other = Batch("a", 1, "n1", (mk(20, 2000.0),))
    other.digest = b"digest-2"
    with pytest.raises(BatchConflict):
        store.ingest(other)
    assert store.ledger.batches_seen_of([("n1", "a", 1), ("n1", "a", 2)]) == {("n1", "a", 1): b"digest-1"}
    # a digest of an earlier form (16-byte BLAKE2b, before the tagged SHA-256 ones): not compared, a duplicate
    legacy = Batch("a", 3, "n1", (mk(40, 4000.0),))
    legacy.digest = bytes(16)
    assert store.ingest(legacy).accepted == 1
    resend = Batch("a", 3, "n1", (mk(50, 5000.0),))
    resend.digest = content_digest(b"other content")
    assert len(resend.digest) == 17 and store.ingest(resend).duplicate_batch
    store.db.execute("DELETE FROM batch_keys WHERE seq=3")
    # keys of stores written before the host and digest were part of them: any content is a duplicate
    store.db.execute("INSERT INTO batches (agent_id, seq, received, samples) VALUES ('a', 7, ?, 1)", (T0 - 10,))
    assert store.ledger.batches_seen_of([("n1", "a", 7)]) == {("n1", "a", 7): NO_DIGEST}
    assert store.ingest(Batch("a", 7, "n1", (mk(30, 3000.0),))).duplicate_batch
    with store.db.transaction():  # a key that is there already is not written again
        assert store.ledger.record_batches([("n1", "a", 1, b"x", T0, 5), ("n1", "a", 8, b"y", T0, 1)]) == 1
    assert store.ledger.batches_seen_of([("n1", "a", 1), ("n1", "a", 8), ("n1", "a", 9)]) == {
        ("n1", "a", 1): b"digest-1", ("n1", "a", 8): b"y"}
    store.db.execute("DELETE FROM batch_keys WHERE seq=8")
    assert store.batches_seen() == 2 and store.totals()["samples"] == 3
    assert store.ledger.prune_batches(T0) == 1 and store.batches_seen() == 1
    assert store.ledger.prune_batches(math.inf) == 1 and store.batches_seen() == 0


def test_job_records_merge_and_the_schedulers_record_outranks_agents(store):
    assert store.put_jobs([JobRecord("1", cluster="c1", user="ann", hosts=("n1",)),
                           JobRecord("5", user="bob", tres=(("gres/gpu", 2.0), ("cpu", 4.0)))]) == 2
    # another sacct format: what it lacks is kept, the TRES order is not a change, the unnamed job gets its cluster
    changed = store.merge_jobs([JobRecord("1", cluster="c1", state="COMPLETED"),
                                JobRecord("5", cluster="c1", tres=(("cpu", 4.0), ("gres/gpu", 2.0)))])
    assert [(r.job_id, r.cluster, r.user, r.state) for r in changed] == [("1", "c1", "ann", "COMPLETED"),
                                                                           ("5", "c1", "bob", None)]
    assert store.put_jobs(changed) == 0
    with pytest.raises(RuntimeError, match="log is down"):
        store.put_jobs([JobRecord("9", cluster="c1")], before_store=lambda recs: (_ for _ in ()).throw(
            RuntimeError("log is down")))
    assert [j.job_id for j in store.jobs()] == ["1", "5"]  # nothing of a refused write
    # agents' descriptions: kept apart, the first one stands, only for jobs that ran on the agent's host
    mk = lambda t, job: GpuSample(ts=T0 + t, host="n1", gpu_uuid="G0", gpu_index=0, job_ids=(job,))  # noqa: E731
    store.ingest(Batch("a", 1, "n1", (mk(0, "1"), mk(10, "7")), cluster="c1",
                       jobs=(JobRecord("1", user="eve", hosts=("n1",)), JobRecord("7", user="eve", hosts=("n1",)),
                             JobRecord("8", user="mallory", hosts=("n1",)))))
    store.ingest(Batch("a", 2, "n1", (mk(20, "7"),), cluster="c1", jobs=(JobRecord("7", user="zed", hosts=("n1",)),)))
    assert [(r.job_id, r.cluster, r.user, src) for r, src in store.job_records()] == [
        ("1", "c1", "eve", "agent"), ("1", "c1", "ann", "slurm"), ("5", "c1", "bob", "slurm"),
        ("7", "c1", "eve", "agent")]
    assert [(j.job_id, j.user) for j in store.jobs()] == [("1", "ann"), ("5", "bob"), ("7", "eve")]
    assert [(j.job_id, j.user) for j in store.ledger.jobs_by_id(["7", "1", "nope"])] == [("1", "ann"), ("7", "eve")]


def test_a_record_with_no_end_never_replaces_an_ended_one(store):
    # sacct's answer for the running jobs, stored after the job's end record (or POSTed late): the end stands, as
    # does everything Slurm said at the end; only what the ended record lacks is taken
    ended = JobRecord("3", cluster="c1", user="ann", hosts=("n1",), start=T0, end=T0 + 60, state="COMPLETED",
                      exit_code=0)
    assert store.put_jobs([ended]) == 1
    running = JobRecord("3", cluster="c1", user="ann", hosts=("n1",), start=T0, state="RUNNING",
                        gpu_uuids=("GPU-1",))
    assert store.merge_jobs([running]) == [replace(ended, gpu_uuids=("GPU-1",))]
    assert store.jobs() == [replace(ended, gpu_uuids=("GPU-1",))]
    assert store.put_jobs([running]) == 0
    # the other way round, the ended record replaces the running one
    assert store.put_jobs([replace(running, job_id="4")]) == 1
    assert store.put_jobs([replace(ended, job_id="4")]) == 1
    assert [(j.job_id, j.state, j.end) for j in store.jobs()] == [("3", "COMPLETED", T0 + 60),
                                                                   ("4", "COMPLETED", T0 + 60)]
    # a later run of job 3 (requeued, on another node): it replaces the ended run, whose end, exit code and GPUs
    # go, its start, end and hosts kept as an earlier run
    rerun = JobRecord("3", cluster="c1", user="ann", hosts=("n2",), start=T0 + 500, state="RUNNING")
    assert store.put_jobs([rerun]) == 1
    assert store.jobs()[0] == replace(rerun, earlier_runs=((T0, T0 + 60, ("n1",)),))
    # a later run whose record names no hosts yet is not placed on the earlier run's
    assert store.put_jobs([replace(rerun, job_id="4", hosts=())]) == 1
    assert store.jobs()[1].hosts == () and store.jobs()[1].earlier_runs == ((T0, T0 + 60, ("n1",)),)


def test_pages_read_in_sql_are_slices_of_the_whole_answers(store):
    """``jobs_page`` and ``job_usage_page`` (what GET /api/v1/jobs and /usage answer) give exactly the slices of
    ``jobs()`` and ``job_usage()``, whatever the offset and limit, with the scheduler-outranks-agent rule
    applied in SQL: agents' records of jobs the scheduler knows in their cluster, or unnamed, are not shown."""
    ingest_all(store)
    rows = [("c1", "1", "slurm"), ("c1", "1", "agent"), ("c2", "1", "agent"), ("", "2", "slurm"),
            ("c3", "2", "agent"), ("", "3", "agent"), ("c1", "3", "agent"), ("c1", "4", "agent"),
            ("", "4", "slurm"), ("c2", "5", "slurm"), ("", "5", "agent"), ("c9", "6", "agent")]
    with store.db.transaction():
        store.db.executemany("INSERT INTO jobs (cluster, job_id, source, data) VALUES (?, ?, ?, ?)", [
            (c, j, src, json.dumps(JobRecord(j, cluster=c, user=src).to_dict())) for c, j, src in rows])
    everything = store.jobs()
    assert [(j.cluster, j.job_id, j.user) for j in everything] == [
        ("", "2", "slurm"), ("", "4", "slurm"), ("c1", "1", "slurm"), ("c2", "5", "slurm"),
        ("", "3", "agent"), ("c1", "3", "agent"), ("c2", "1", "agent"), ("c9", "6", "agent")]
    usage = {per_gpu: store.job_usage(per_gpu=per_gpu) for per_gpu in (False, True)}
    one = {per_gpu: store.job_usage("1", per_gpu) for per_gpu in (False, True)}
    assert len(usage[False]) == 3 and len(usage[True]) == 3 and len(one[False]) == 2
    for limit in (1, 2, 3, 100):
        for offset in (0, 1, 2, 5, 8, 50):
            assert store.jobs_page(offset, limit) == (everything[offset:offset + limit], len(everything))
            for per_gpu in (False, True):
                assert store.job_usage_page(None, per_gpu, offset, limit) == (
                    usage[per_gpu][offset:offset + limit], len(usage[per_gpu]))
                assert store.job_usage_page("1", per_gpu, offset, limit) == (
                    one[per_gpu][offset:offset + limit], len(one[per_gpu]))


def test_two_collectors_merging_job_records_at_once_lose_no_update(new_ledger):
    ledger = new_ledger()
    a, b = Store(ledger), Store(ledger)
    start = threading.Barrier(2)

    def merge(store: Store, field: str) -> None:
        start.wait()
        for i in range(40):
            store.merge_jobs([JobRecord(str(i), cluster="c", **{field: f"{field}-{i}"})])

    threads = [threading.Thread(target=merge, args=(s, f)) for s, f in ((a, "user"), (b, "account"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert [(j.user, j.account) for j in a.jobs()] == [(f"user-{i}", f"account-{i}")
                                                           for i in sorted(range(40), key=str)]
    finally:
        a.close()
        b.close()


def test_floats_round_trip_to_the_last_bit(store):
    tricky = [0.1 + 0.2, 1 / 3, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e-300, math.pi * 1e10,
              T0 + 0.1, 123456789.12345679, math.inf, -math.inf, 2.0**53 + 2]
    bits = lambda v: struct.pack("<d", v)  # noqa: E731
    usage, hours = UsageAcc(), HourAcc()
    for i, name in enumerate(f for f in UsageAcc.FIELDS if f not in ("samples", "mem_peak", "model")):
        setattr(usage, name, tricky[i % len(tricky)])
    usage.samples, usage.mem_peak, usage.model = 2**62, 2**40 + 1, "H200"
    for i, name in enumerate(f for f in HourAcc.FIELDS if f not in ("samples", "anomalies")):
        setattr(hours, name, tricky[-1 - i])
    hours.samples, hours.anomalies = 3, 1
    totals = (tricky[7], tricky[8], 2**53, tricky[0], tricky[1], "H200", 0)
    hour = T0 + 3600.0
    with store.db.transaction():
        store.ledger.note_gpus("c1", [("n1", "G0")])
        store.ledger.write_aggregates([(("1", "n1", "G0"), usage.values())], [(("n1", "G0", ""), totals)],
                                      [(("n1", "G0", "", hour), hours.values())])
        store.ledger.write_gaps({("n1", "G0", "", tricky[7], tricky[8]): (tricky[1], ("1",))})
    back = store.ledger.load_usages([("1", "n1", "G0")]).get(("1", "n1", "G0"))
    assert back is not None and [type(v) for v in back.values()] == [type(v) for v in usage.values()]
    assert [bits(v) if isinstance(v, float) else v for v in back.values()] == \
           [bits(v) if isinstance(v, float) else v for v in usage.values()]
    got_hour = store.ledger.load_hours([("n1", "G0", "", hour)]).get(("n1", "G0", "", hour))
    assert got_hour is not None and list(map(bits, got_hour.values()[:4])) == list(map(bits, hours.values()[:4]))
    assert got_hour.values()[4:] == hours.values()[4:]
    assert store.ledger.host_gpu_totals("n1") == store.ledger.gpu_totals() == [(("n1", "G0", ""), totals)]
    (gap,) = store.energy_gaps()
    assert [bits(gap[k]) for k in ("start", "end", "energy_joules")] == [bits(tricky[7]), bits(tricky[8]),
                                                                         bits(tricky[1])]
    assert store.job_usage(per_gpu=True)[0].cluster == "c1"


def test_accumulators_load_many_keys_at_once_under_their_gpus_clusters(store):
    """``load_usages`` / ``load_hours`` (what a batch's new keys are loaded with): more keys than one query takes,
    some never stored (left out), usage rows found under their GPU's cluster; each as loaded alone."""
    gpus = [(f"n{h}", f"G{g}") for h in (1, 2) for g in range(100)]
    usage_keys = [(str(j), host, uuid) for host, uuid in gpus for j in range(2)]  # 400: over one query's 125
    hour_keys = [(host, uuid, "", T0 + 3600.0 * k) for host, uuid in gpus for k in range(2)]
    with store.db.transaction():
        for host in ("n1", "n2"):
            store.ledger.note_gpus(CLUSTER[host], [g for g in gpus if g[0] == host])
        usage_rows = []
        for i, key in enumerate(usage_keys):
            acc = UsageAcc()
            acc.samples, acc.energy_j, acc.model = i + 1, i * 0.25, "H200"
            usage_rows.append((key, acc.values()))
        hour_rows = []
        for i, key in enumerate(hour_keys):
            acc = HourAcc()
            acc.samples, acc.energy_j = i + 1, i * 0.5
            hour_rows.append((key, acc.values()))
        store.ledger.write_aggregates(usage_rows, [], hour_rows)
    missing_usage = [("9", "n1", "G0"), ("0", "n3", "G0"), ("0", "n1", "G100")]
    missing_hours = [("n1", "G0", "", T0 - 3600.0), ("n1", "G0", "1g.10gb", T0), ("n3", "G0", "", T0)]
    loaded = store.ledger.load_usages(usage_keys[::-1] + missing_usage)
    assert set(loaded) == set(usage_keys)
    assert {k: a.values() for k, a in loaded.items()} == dict(usage_rows)
    assert all(loaded[k].values() == store.ledger.load_usages([k])[k].values() for k in usage_keys[:3])
    hours = store.ledger.load_hours(missing_hours + hour_keys)
    assert {k: a.values() for k, a in hours.items()} == dict(hour_rows)
    assert store.ledger.load_usages([]) == {} and store.ledger.load_hours(missing_hours) == {}
    assert {u.cluster for u in store.job_usage(per_gpu=True) if u.host == "n2"} == {"c2"}


def test_hosts_generations_and_cluster_cache(store, ledger):
    with store.db.transaction():
        assert [store.ledger.claim_hosts(["n1"]) for _ in range(3)] == [{"n1": 1}, {"n1": 2}, {"n1": 3}]
        assert store.ledger.claim_hosts(["n1", "n2"]) == {"n1": 4, "n2": 1}
    other = Store(ledger)  # another collector names a GPU's cluster
    try:
        with other.db.transaction():
            assert other.ledger.claim_hosts(["n1"]) == {"n1": 5}
            other.ledger.note_gpus("c9", [("n1", "G0")])
    finally:
        other.close()
    with store.db.transaction():
        store.ledger.forget_host("n1")  # re-read: the GPU is in c9 now, a later name does not move it
        store.ledger.note_gpus("c1", [("n1", "G0")])
    assert store.db.execute("SELECT cluster FROM gpu_clusters").fetchall() == [("c9",)]


def test_migrations_are_recorded_idempotent_concurrent_and_refuse_a_newer_ledger(new_ledger):
    ledger = new_ledger()
    opened: list[Store] = []
    start = threading.Barrier(3)

    def open_one() -> None:
        start.wait()
        opened.append(Store(ledger))  # three collectors starting at once

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in opened:
        s.close()
    assert len(opened) == 3
    db = open_database(ledger)
    try:
        st = status(db)
        assert [a.version for a in st.applied] == list(range(1, LATEST + 1)) and st.pending == [] and not st.unknown
        assert migrate(db) == [] and [a.version for a in status(db).applied] == list(range(1, LATEST + 1))
        db.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, 'from the future', 0)",
                   (LATEST + 1,))
        assert [a.version for a in status(db).unknown] == [LATEST + 1]
    finally:
        db.close()
    with pytest.raises(LedgerTooNew, match=f"has migration {LATEST + 1} .*upgrade gpuledger"):
        Store(ledger)
