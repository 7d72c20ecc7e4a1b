"""The store keeps only each GPU's newest sample in memory and reads a window back from the series store when a
late sample needs it (``Aggregator(load_window=...)``): the ledger must be bit for bit what the in-memory
aggregation (every window whole) gives, across late, duplicate and too-late samples, MIG instances, gaps,
counter resets, both batch layouts and restarts; and memory holds one row a GPU."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.collector.aggregate import Aggregator
from gpuledger.collector.series import series_from_samples
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

T0 = 1_700_000_000.0


def stream(rnd: random.Random, n: int) -> list[GpuSample]:
    """Three GPUs (one with two MIG instances) at 1-10 s steps: job changes, shared jobs, counter resets and
    jumps, gaps longer than max_gap_s, absent values."""
    out = []
    for g, migs in ((0, (None,)), (1, (None,)), (2, ("1g.10gb", "3g.40gb"))):
        ts, e = T0, rnd.uniform(1e5, 1e7)
        for i in range(n):
            ts += rnd.choice([1.0, 5.0, 10.0, 10.0]) if rnd.random() > 0.03 else rnd.choice([120.0, 700.0])
            e = rnd.choice([50.0, e + 1e9]) if rnd.random() < 0.03 else e + rnd.uniform(10, 600) * 10
            job = ("7",) if i < n // 3 else (("8", "9") if g % 2 else ("8",))
            for mig in migs:
                out.append(GpuSample(
                    ts=ts, host="n1", gpu_uuid=f"G{g}", gpu_index=g, model="H200 MIG " + mig if mig else "H200",
                    mig=mig, energy_joules=None if rnd.random() < 0.05 else e,
                    power_watts=rnd.choice([None, round(rnd.uniform(60, 700), 1)]),
                    sm_active_ratio=round(rnd.random(), 3), dram_bw_ratio=rnd.choice([None, round(rnd.random(), 3)]),
                    mem_used_bytes=rnd.choice([None, rnd.randrange(10**11)]), job_ids=job,
                    job_shares=(0.25, 0.75) if len(job) == 2 and i % 2 else ()))
    return out


def batches(samples: list[GpuSample], rnd: random.Random, jitter: float) -> list[list[GpuSample]]:
    """Batches of 1-60 samples in an order jittered by up to ``jitter`` seconds (late samples), a few repeated
    (duplicates) and a few from long ago (too late)."""
    order = sorted(samples, key=lambda s: s.ts + rnd.uniform(-jitter, jitter))
    out, i = [], 0
    while i < len(order):
        k = rnd.randint(1, 60)
        b = order[i:i + k]
        if rnd.random() < 0.1:
            b = b + [rnd.choice(order[:i + k])]
        out.append(b)
        i += k
    return out


def as_batch(seq: int, samples: list[GpuSample], layout: str) -> Batch:
    if layout == "samples":
        return Batch("a", seq, "n1", tuple(samples))
    runs: dict[tuple, list[GpuSample]] = {}  # one series per GPU and job set, as an agent sends them
    for s in sorted(samples, key=lambda s: s.ts):
        runs.setdefault((s.gpu_uuid, s.mig, s.model, s.job_ids, s.job_shares), []).append(s)
    series = []
    for run in runs.values():
        ts = [s.ts for s in run]
        if len(set(ts)) != len(ts):  # a repeated sample: a series holds distinct times; send it as rows
            return Batch("a", seq, "n1", tuple(samples))
        series.append(series_from_samples(run))
    return Batch("a", seq, "n1", series=tuple(series))


def assert_ledger_is(store: Store, ref: Aggregator) -> None:
    """The store's ledger rows equal the reference's accumulators exactly (floats bit for bit)."""
    led = store.ledger
    usage = led.load_usages(list(ref.usage))
    for key, acc in ref.usage.items():
        assert key in usage and usage[key].values() == acc.values(), key
    assert dict(led.gpu_totals()) == {k: g.totals() for k, g in ref.gpus.items()}
    hours = led.load_hours(list(ref.hours))
    for key, hour in ref.hours.items():
        assert key in hours and hours[key].values() == hour.values(), key


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), jitter=st.sampled_from([0.0, 30.0, 300.0, 900.0]),
       layout=st.sampled_from(["samples", "series"]), restart=st.integers(0, 30))
def test_bounded_window_equals_whole_windows_in_memory(tmp_path_factory, seed, jitter, layout, restart):
    rnd = random.Random(seed)
    samples = stream(rnd, rnd.randint(10, 80))
    path = tmp_path_factory.mktemp("w") / "s.sqlite"
    store = Store(path)
    ref = Aggregator()
    for i, b in enumerate(batches(samples, rnd, jitter)):
        if i == restart:
            store.close()
            store = Store(path)
        r = store.ingest(as_batch(i, b, layout))
        counts, _ = ref.add_many(b)
        assert (r.accepted, r.duplicate_samples, r.too_late) == (counts.accepted, counts.duplicate, counts.too_late)
    assert_ledger_is(store, ref)
    # one more in-order sample per GPU: every window is back to the newest row
    last = max(s.ts for s in samples) + 1.0
    tail = [GpuSample(ts=last, host="n1", gpu_uuid=f"G{g}", gpu_index=g, power_watts=100.0, job_ids=("8",))
            for g in range(2)]
    store.ingest(as_batch(10**6, tail, layout))
    ref.add_many(tail)
    assert_ledger_is(store, ref)
    assert all(len(store.agg.gpus[("n1", f"G{g}", "")].ts) == 1 for g in range(2))
    store.close()


def test_a_late_sample_reads_the_window_back_and_counts_exactly(tmp_path):
    rnd = random.Random(3)
    samples = [s for s in stream(rnd, 60) if s.gpu_uuid == "G0"]
    store = Store(tmp_path / "s.sqlite")
    ref = Aggregator()
    late = samples.pop(40)
    for i in range(0, len(samples), 10):  # the default agent: 10 in-order samples a batch
        store.ingest(as_batch(i, samples[i:i + 10], "series"))
        ref.add_many(samples[i:i + 10])
        g = store.agg.gpus[("n1", "G0", "")]
        assert g.partial and g.ts == [samples[min(i + 9, len(samples) - 1)].ts]  # one row in memory
    r = store.ingest(as_batch(999, [late], "series"))
    ref.add_many([late])
    assert r.accepted == 1
    g = store.agg.gpus[("n1", "G0", "")]
    assert not g.partial and late.ts in g.ts  # the window came back from the store and took it
    assert_ledger_is(store, ref)
    store.close()


def test_gpus_per_host_are_counted_from_each_batch_not_from_every_gpu_in_memory(tmp_path):
    """The per-host GPU count (max_gpus_per_host) is kept up from each batch's keys; it is what a walk over every
    GPU in memory gives, with MIG GPUs whose whole-GPU key the aggregation makes, new GPUs, restarts."""
    path = tmp_path / "s.sqlite"
    store = Store(path)

    def batch(seq: int, host: str, gpus: list[tuple[str, str | None]]) -> Batch:
        return Batch("a" + host, seq, host, tuple(
            GpuSample(ts=T0 + 10 * seq + k, host=host, gpu_uuid=u, gpu_index=0, mig=m, power_watts=100.0,
                      job_ids=("1",)) for u, m in gpus for k in range(3)))

    plan = [("n1", [("G0", None)]), ("n2", [("G0", "1g.10gb"), ("G0", "2g.20gb")]), ("n1", [("G0", None)]),
            ("n2", [("G0", "1g.10gb"), ("G1", "1g.10gb")]), ("n1", [("G0", None), ("G1", None)]), "restart",
            ("n2", [("G0", "1g.10gb")]), ("n1", [("G2", None)]), ("n2", [("G0", "2g.20gb")])]
    seq = 0
    for step in plan:
        if step == "restart":
            store.close()
            store = Store(path)
            continue
        host, gpus = step
        store.ingest(batch(seq, host, gpus))
        seq += 1
        for h in ("n1", "n2"):
            if h in store._host_gpus:
                assert store._host_gpus[h] == len([k for k in store.agg.gpus if k[0] == h]), (step, h)
    assert store._host_gpus == {"n1": 3, "n2": 5}  # n2: G0 and G1 whole-GPU keys (made) and 3 instances
    store.close()


def test_a_host_without_gpu_rows_has_no_usage_or_hour_rows_and_its_first_batch_is_exact(tmp_path):
    """The store looks up no usage or hour accumulators of a host the ledger holds no GPU of (its first batch: a new
    node, or the fleet's first pushes to a new ledger). That holds because a host's usage and hour rows are only
    ever written with its GPUs' rows: checked here over hosts whose first batch is one sample, jobless samples,
    MIG instances only, too many GPUs (refused), duplicate samples; and hosts taken up again after a restart."""
    rnd = random.Random(11)
    path = tmp_path / "s.sqlite"
    store = Store(path, max_gpus_per_host=6)
    ref = Aggregator()

    def host_batch(host: str, seq: int, samples: list[GpuSample]) -> Batch:
        return Batch("a" + host, seq, host, tuple(dataclasses.replace(s, host=host) for s in samples))

    full = stream(rnd, 30)
    plans = {
        "one-sample": [full[:1]],
        "jobless": [[dataclasses.replace(s, job_ids=(), job_shares=()) for s in full[:20]]],
        "mig-only": [[s for s in full if s.mig][:12]],
        "too-many-gpus": [[GpuSample(ts=T0 + 1, host="x", gpu_uuid=f"G{g}", gpu_index=g, power_watts=90.0)
                           for g in range(8)]],
        "then-more": [full[:40], full[40:80], full[40:80]],  # the last one's samples are duplicates
    }
    for restart in (False, True):
        for host, plan in plans.items():
            for seq, samples in enumerate(plan):
                seq += 100 if restart else 0
                moved = [dataclasses.replace(s, ts=s.ts + (10_000 if restart else 0)) for s in samples]
                try:
                    store.ingest(host_batch(host, seq, moved))
                except Exception as exc:  # too many GPUs: refused whole, nothing of it stored
                    assert host == "too-many-gpus", exc
                    continue
                ref.add_many([dataclasses.replace(s, host=host) for s in moved])
        if not restart:
            store.close()
            store = Store(path, max_gpus_per_host=6)
    db = store._db
    with_gpus = {h for (h,) in db.execute("SELECT DISTINCT host FROM gpus")}
    assert {h for (h,) in db.execute("SELECT DISTINCT host FROM usage")} <= with_gpus
    assert {h for (h,) in db.execute("SELECT DISTINCT host FROM gpu_hours")} <= with_gpus
    assert "too-many-gpus" not in with_gpus and with_gpus == set(plans) - {"too-many-gpus"}
    assert_ledger_is(store, ref)
    store.close()
