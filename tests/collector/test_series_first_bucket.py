"""A series query's first bucket starts before ``start`` (buckets are aligned to the step): it is answered by a
tier that still holds the whole bucket, never summarised from what a tier's retention left of it."""

from __future__ import annotations

import pytest

from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series_store import RAW, Retention
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000  # an hour (and day) boundary


@pytest.mark.parametrize("step", [45.0, 55.0])  # raw buckets would start before H + 2400
def test_the_first_bucket_is_whole_after_raw_retention(tmp_path, step) -> None:
    ret = Retention(raw_s=700.0, minute_s=None, raw_chunk_s=600.0, minute_chunk_s=3600.0, hour_chunk_s=86400.0)
    clock = [H]
    store = Store(tmp_path / "s.sqlite", window_s=60, clock=lambda: clock[0], retention=ret)
    samples = [GpuSample(ts=H + i, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0, job_ids=("7",))
               for i in range(3600)]  # one a second
    for seq, j in enumerate(range(0, 3600, 300)):
        store.ingest(Batch("a", seq, "n1", tuple(samples[j:j + 300])))
    clock[0] = H + 3600 + 10
    store.compact()
    store.compact()
    try:
        (gone,) = store.db.execute("SELECT until FROM expired WHERE tier=?", (RAW,)).fetchone()
        assert gone == H + 2400  # raw samples before it are gone (rolled up into minutes first)
        start = gone + 1  # raw is complete from start on, but not from the first bucket's start
        assert len(store.series("n1", "G0", start, start + 200)) == 201  # raw samples: no bucket to fill
        points = store.series("n1", "G0", start, start + 200, step=step)
        assert points and all(isinstance(p, RollupPoint) for p in points)
        for p in points:  # every bucket whole: all its seconds' samples
            assert p.ts <= start and p.samples == p.step, (p.ts - H, p.step, p.samples, p.tier)
            start = p.ts + p.step
    finally:
        store.close()
