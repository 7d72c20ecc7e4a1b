"""Columnar (series) batches store and aggregate exactly what the same samples as rows do.

The series path folds and packs a GPU's samples a column at a time and falls back to the per-sample path
for anything out of order; either way the ledger must be bit-for-bit what the row layout gives, across
restarts, late samples, job changes, gaps, counter resets and absent values.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.agent.mig import NO_READINGS
from gpuledger.agent.push import encode_batch
from gpuledger.collector.aggregate import normalize_mig
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch, parse_batch
from gpuledger.schema.records import GpuSample

T0 = 1_700_000_000.0
NOW = T0 + 10**6


def stream(rnd: random.Random, gpus: int, n: int, step: float, complete: bool = False) -> list[GpuSample]:
    """Samples of ``gpus`` GPUs (the fourth a MIG instance) with a gap, a counter reset, job changes and Xid errors;
    ``complete``: no value missing (the agent's binary columns: its batches are stored as host chunks), else some
    missing energy, HBM and memory readings (list columns: stored a chunk a GPU)."""
    out = []
    maybe = (lambda v: v) if complete else (lambda v: rnd.choice([None, v]))
    for g in range(gpus):
        e = rnd.uniform(1e5, 1e7)
        for i in range(n):
            ts = T0 + i * step + (700 if i > n * 0.6 else 0)  # a gap longer than max_gap_s
            e = 50.0 if i == n // 2 else e + rnd.uniform(10, 700) * step  # a counter reset; at most 700 W
            job = ("7",) if i < n // 3 else (("8", "9") if g % 2 else ())
            out.append(GpuSample(
                ts=ts, host="n1", gpu_uuid=f"G{g}", gpu_index=g, model="H200", mig="1.0" if g == 3 else None,
                energy_joules=None if rnd.random() < 0.05 and not complete else e,
                power_watts=round(rnd.uniform(60, 700), 1), sm_active_ratio=round(rnd.random(), 3),
                dram_bw_ratio=maybe(round(rnd.random(), 3)), mem_used_bytes=maybe(rnd.randrange(10**11)),
                temp_celsius=float(rnd.randint(-5, 90)),
                job_ids=job, job_shares=(0.25, 0.75) if len(job) == 2 and g == 1 else (),
                xid_errors=(79,) if rnd.random() < 0.02 else ()))
    return out


def body(agent: str, seq: int, samples: list[GpuSample], layout: str, fmt: str) -> bytes:
    return encode_batch(agent, "n1", seq, samples, fmt=fmt, layout=layout)


def ingest_all(store: Store, batches: list[list[GpuSample]], layout: str, fmt: str = "msgpack",
               restart_at: int | None = None, path=None) -> Store:
    for i, ss in enumerate(batches):
        if i == restart_at:
            store.close()
            store = Store(path)
        ct = "application/msgpack" if fmt == "msgpack" else "application/json"
        b = parse_batch(body("a", i, ss, layout, fmt), ct, NOW)
        assert bool(b.series) == (layout == "series")
        store.ingest(b)
    return store


def snapshot(store: Store) -> tuple:
    gpus = [("n1", f"G{g}") for g in range(4)]
    return (
        [u.to_dict() for u in store.job_usage(per_gpu=True)],
        [u.to_dict() for u in store.job_usage()],
        store.totals(),
        store.totals(T0 + 300, T0 + 5000),
        [[p.to_dict() for p in store.series(h, u, 0, 2e9, mig="1.0" if u == "G3" else None)] for h, u in gpus],
    )


def cut(samples: list[GpuSample], rnd: random.Random, sizes: tuple[int, int], late: float) -> list[list[GpuSample]]:
    """Time-ordered batches of random sizes; a fraction ``late`` of samples moved to the next batch."""
    samples = sorted(samples, key=lambda s: (s.ts, s.gpu_uuid))
    out, i = [], 0
    while i < len(samples):
        k = rnd.randint(*sizes)
        out.append(samples[i:i + k])
        i += k
    for j in range(len(out) - 1):
        moved = [s for s in out[j] if rnd.random() < late]
        if moved:
            out[j] = [s for s in out[j] if s not in moved]
            out[j + 1] = moved + out[j + 1]
    return [b for b in out if b]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), late=st.sampled_from([0.0, 0.0, 0.05]), restart=st.integers(0, 12),
       fmt=st.sampled_from(["msgpack", "json"]), complete=st.booleans())
def test_series_layout_equals_row_layout(tmp_path_factory, seed, late, restart, fmt, complete):
    """The agent's series layout stores and aggregates what the row layout does: before compaction (host chunks:
    complete msgpack columns), after a background pass (some split), after an operator's (all split)."""
    rnd = random.Random(seed)
    batches = cut(stream(rnd, gpus=4, n=rnd.randint(20, 160), step=rnd.choice([1.0, 10.0]), complete=complete), rnd,
                  (1, 300), late)
    d = tmp_path_factory.mktemp("s")
    rows = ingest_all(Store(d / "rows.sqlite"), batches, "samples")
    cols = ingest_all(Store(d / "cols.sqlite"), batches, "series", fmt, restart_at=restart,
                      path=d / "cols.sqlite")
    assert snapshot(cols) == snapshot(rows)
    rows.compact(now=NOW)
    cols.compact(now=NOW)
    assert snapshot(cols) == snapshot(rows)
    cols.compact(now=NOW, all_host_chunks=True)
    assert cols.db.execute("SELECT COUNT(*) FROM host_chunks").fetchone()[0] == 0
    assert snapshot(cols) == snapshot(rows)
    rows.close()
    cols.close()


def test_a_gpus_series_out_of_time_order_store_what_rows_store(tmp_path):
    # One GPU, two series in a batch (its job shares change): [117, 97] and [107]. Sorted by their first times
    # the [107] one would fold first and 97 become late; the rows are folded in time order. Bit for bit equal.
    rnd = random.Random(0)
    for trial in range(20):
        def s(t: float, shares: tuple[float, ...]) -> GpuSample:
            return GpuSample(ts=T0 + t, host="n1", gpu_uuid="G1", gpu_index=1, model="H200",
                             energy_joules=1000.0 * t, power_watts=300.0, sm_active_ratio=round(rnd.random(), 3),
                             job_ids=("8", "9"), job_shares=shares)

        batches = [[s(77, ()), s(87, ())], [s(117, (0.25, 0.75)), s(97, (0.25, 0.75)), s(107, ())]]
        rows = ingest_all(Store(tmp_path / f"rows{trial}.sqlite"), batches, "samples")
        cols = ingest_all(Store(tmp_path / f"cols{trial}.sqlite"), batches, "series")
        assert snapshot(cols) == snapshot(rows)
        rows.close()
        cols.close()


def test_in_order_series_take_the_columnar_path_and_late_ones_fall_back(tmp_path):
    rnd = random.Random(1)
    samples = stream(rnd, gpus=2, n=100, step=1.0)
    store = Store(tmp_path / "s.sqlite")
    first = [s for s in samples if s.ts < T0 + 40]
    b = parse_batch(body("a", 0, first, "series", "msgpack"), "application/msgpack", NOW)
    r = store.ingest(b)
    assert r.accepted == len(first)
    # after an in-order series a GPU keeps only its newest sample in memory; its window is in the store
    assert all(g.partial and g.ts == [g.watermark] and len(g.samples) == 1 for g in store.agg.gpus.values())
    # a late sample for G0 (between two stored ones) and in-order ones for G1
    late = [GpuSample(ts=T0 + 10.5, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0)]
    # (before the counter reset at T0 + 50: an untrusted delta goes one by one)
    more = [s for s in samples if T0 + 40 <= s.ts < T0 + 50 and s.gpu_uuid == "G1"]
    r = store.ingest(parse_batch(body("a", 1, late + more, "series", "msgpack"), "application/msgpack", NOW))
    assert r.accepted == 1 + len(more)
    g0, g1 = store.agg.gpus[("n1", "G0", "")], store.agg.gpus[("n1", "G1", "")]
    # G0's window was read back from the store to take the late one (and stays while late samples come)
    assert not g0.partial and T0 + 10.5 in g0.ts and g0.ts[0] == min(s.ts for s in first)
    assert g1.partial and g1.ts == [max(s.ts for s in more)]  # in order: its newest sample only
    assert len(store.series("n1", "G0", 0, 2e9)) == len(first) // 2 + 1
    store.close()


def test_duplicate_series_batch_is_acknowledged_once(tmp_path):
    samples = stream(random.Random(2), gpus=2, n=30, step=10.0)
    store = Store(tmp_path / "s.sqlite")
    raw = body("a", 5, samples, "series", "msgpack")
    assert store.ingest(parse_batch(raw, "application/msgpack", NOW)).accepted == len(samples)
    before = snapshot(store)
    again = store.ingest(parse_batch(raw, "application/msgpack", NOW))
    assert again.duplicate_batch and again.accepted == 0
    assert snapshot(store) == before
    # the same samples under another seq: every one a duplicate or too late, nothing stored twice
    r = store.ingest(parse_batch(body("a", 6, samples, "series", "msgpack"), "application/msgpack", NOW))
    assert r.accepted == 0 and r.duplicate_samples + r.too_late == len(samples)
    assert snapshot(store) == before
    store.close()


def test_series_and_rows_in_one_python_batch(tmp_path):
    """Only the Python API can mix layouts; the store then takes every sample one by one."""
    samples = stream(random.Random(3), gpus=2, n=40, step=10.0)
    half = len(samples) // 2
    parsed = parse_batch(body("a", 0, samples[half:], "series", "msgpack"), "application/msgpack", NOW)
    mixed = Batch("a", 0, "n1", rows=tuple(samples[:half]), series=parsed.series)
    store = Store(tmp_path / "mixed.sqlite")
    assert store.ingest(mixed).accepted == len(samples)
    ref = Store(tmp_path / "ref.sqlite")
    ref.ingest(Batch("a", 0, "n1", tuple(samples)))
    assert snapshot(store) == snapshot(ref)
    store.close()
    ref.close()


@pytest.mark.parametrize("binary", [True, False])
def test_raw_chunks_of_a_series_read_back_exactly(tmp_path, binary):
    samples = stream(random.Random(4), gpus=4, n=90, step=1.0)
    fmt = "msgpack" if binary else "json"
    store = Store(tmp_path / "s.sqlite")
    store.ingest(parse_batch(body("a", 0, samples, "series", fmt),
                             "application/msgpack" if binary else "application/json", time.time()))
    # a MIG GPU as counted (aggregate.normalize_mig), its readings on its whole-GPU series only (mig.as_series)
    stored = [replace(s, **NO_READINGS) if s.mig else s for s in normalize_mig(samples)]
    for g in range(4):
        mig = "1.0" if g == 3 else None
        want = sorted((s for s in stored if s.gpu_uuid == f"G{g}" and s.mig == mig), key=lambda s: s.ts)
        assert store.series("n1", f"G{g}", 0, 2e9, mig=mig) == want
    assert store.series("n1", "G3", 0, 2e9)[0].power_watts is not None  # the GPU's, once
    store.close()


def test_msgpack_series_body_is_raw_columns():
    samples = stream(random.Random(5), gpus=1, n=10, step=1.0)
    doc = msgpack.unpackb(body("a", 0, samples, "series", "msgpack"))
    (series,) = [s for s in doc["series"] if s.get("job_ids") == ["7"]]
    assert isinstance(series["ts"], bytes) and isinstance(series["power_watts"], bytes)
    assert len(series["ts"]) == 8 * len([s for s in samples if s.job_ids == ("7",)])


def test_compaction_merges_small_raw_chunks_and_leaves_large_ones(tmp_path):
    h = 3600.0 * 472_223  # an hour boundary
    mk = [GpuSample(ts=h + i, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0 + i % 7,
                    energy_joules=1e6 + 100.0 * i, job_ids=("1",)) for i in range(1200)]
    store = Store(tmp_path / "s.sqlite")
    parts = [mk[:600], mk[600:610], mk[610:620], mk[620:630], mk[630:]]
    for i, p in enumerate(parts):  # JSON: a chunk a GPU and batch (msgpack batches are host chunks, below)
        store.ingest(parse_batch(body("a", i, p, "series", "json"), "application/json", h + 10**5))
    rows = lambda: sorted(n for (n,) in store._db.execute("SELECT n FROM chunks WHERE tier=0"))  # noqa: E731
    assert rows() == [10, 10, 10, 570, 600]
    stats = store.compact(now=h + 10**5)
    assert stats.merged_chunks >= 2 and rows() == [30, 570, 600]  # (rollup tiers merge too)
    assert store.series("n1", "G0", 0, 2e9) == mk
    store.close()


def test_host_chunks_hold_batches_until_compaction_splits_them(tmp_path):
    """An agent's msgpack batch is stored as one host chunk (every GPU of it): reads see it, a late sample reads
    its window from it, a restarted store restores from it, and compaction splits it into the GPUs' chunks, one a
    GPU and raw interval."""
    h = 3600.0 * 472_223  # an hour boundary: the batches cross it
    mk = [GpuSample(ts=h - 30 + i, host="n1", gpu_uuid=f"G{g}", gpu_index=g, power_watts=100.0 + i % 7,
                    energy_joules=1e6 + 100.0 * i, sm_active_ratio=0.5, job_ids=("1",)) for i in range(60)
          for g in range(2)]
    path = tmp_path / "s.sqlite"
    store = Store(path)
    for k in range(3):
        part = [s for s in mk if h - 30 + 20 * k <= s.ts < h - 10 + 20 * k]
        store.ingest(parse_batch(body("a", k, part, "series", "msgpack"), "application/msgpack", h + 10**5))
    count = lambda table: store._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: E731
    assert (count("host_chunks"), count("chunks")) == (3, 0)
    for g in range(2):
        assert store.series("n1", f"G{g}", 0, 2e9) == [s for s in mk if s.gpu_uuid == f"G{g}"]
    assert store.tiers()[0]["rows"] == 120
    store.close()
    store = Store(path)  # restored from the host chunks when the host's next batch comes
    late = GpuSample(ts=h - 30 + 5.5, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0, job_ids=("1",))
    assert store.ingest(parse_batch(body("a", 3, [late], "series", "msgpack"), "application/msgpack",
                                    h + 10**5)).accepted == 1
    ref = Store(tmp_path / "ref.sqlite")
    ref.ingest(Batch("a", 0, "n1", tuple(sorted([*mk, late], key=lambda s: s.ts))))
    usage = [u.to_dict() for u in ref.job_usage(per_gpu=True)]
    assert [u.to_dict() for u in store.job_usage(per_gpu=True)] == usage
    before = [store.series("n1", f"G{g}", 0, 2e9) for g in range(2)]
    store.compact(now=h + 10**5)  # a minute of the host's batches: half a window (300 s) has not passed yet
    assert count("host_chunks") == 3
    store.compact(now=h + 10**5, all_host_chunks=True)
    assert count("host_chunks") == 0
    buckets = sorted(store._db.execute("SELECT gpu_uuid, bucket, n FROM chunks WHERE tier=0").fetchall())
    assert buckets == [("G0", h - 3600, 31), ("G0", h, 30), ("G1", h - 3600, 30), ("G1", h, 30)]
    assert [store.series("n1", f"G{g}", 0, 2e9) for g in range(2)] == before
    assert [u.to_dict() for u in store.job_usage(per_gpu=True)] == usage
    store.close()
    ref.close()
