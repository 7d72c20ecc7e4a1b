#!/usr/bin/env python3
"""CPU of compaction's merges on the fleet shape: one GPU's hour of 10-row chunks (what the default agent's
80-sample batch leaves per GPU, 360 an hour) merged into larger ones, by how many are merged at once, and per
GPU-hour under the merge rules (``series_store.mergeable_groups``): the one before (an open interval's chunks
merged once 16 are small, the merged chunk re-packed with every 15 new ones until it reaches 512 rows) and the
one now (64 batch chunks at a time, a merged chunk never re-packed).

    .venv/bin/python bench/merge_cost.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuledger.collector.chunks import encode_series_many, merge_chunks  # noqa: E402
from gpuledger.collector.series import series_from_samples  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

ROUNDS = 3


def batch_chunk(rng: np.random.Generator, k: int) -> bytes:
    """Batch ``k``'s chunk of one GPU: 10 s at 1 Hz, the fleet bench's fields."""
    samples = [GpuSample(ts=1.7e9 + 10 * k + i, host="node0001", gpu_uuid="GPU-1", gpu_index=0, model="NVIDIA H200",
                         sm_active_ratio=round(float(rng.random()), 3), dram_bw_ratio=round(float(rng.random()), 3),
                         power_watts=round(200 + 400 * float(rng.random()), 1),
                         energy_joules=1e6 + 300.0 * (10 * k + i), mem_used_bytes=60 * 2**30 + i, temp_celsius=50.0,
                         sm_clock_hz=1.98e9, mem_clock_hz=2.6e9, job_ids=("1000",)) for i in range(10)]
    return encode_series_many([series_from_samples(samples)])[0]


def cpu_per_hour(merge_hour: Callable[[], None]) -> float:
    """ms of CPU per GPU-hour of ``merge_hour()``, best of ROUNDS."""
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.process_time()
        merge_hour()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def main() -> None:
    rng = np.random.default_rng(1)
    blobs = [batch_chunk(rng, k) for k in range(360)]

    def groups_of(size: int) -> None:
        for i in range(0, 360 - size + 1, size):
            merge_chunks(blobs[i:i + size])

    def now() -> None:
        groups_of(64)
        merge_chunks(blobs[320:])  # at the interval's close: the 40 left

    def before() -> None:
        merged: bytes | None = None
        for i in range(0, 345, 15):
            part = blobs[i:i + 15] if merged is None else [merged, *blobs[i:i + 15]]
            blob, rows, _, _ = merge_chunks(part)
            merged = None if rows >= 512 else blob

    for size in (16, 32, 64):
        ms = cpu_per_hour(partial(groups_of, size))
        print(f"merging {size:2d} batch chunks at a time: {1e3 * ms / (360 // size * size * 10):5.1f} us CPU a row")
    print(f"per GPU-hour, the rule before: {cpu_per_hour(before):5.1f} ms CPU")
    print(f"per GPU-hour, the rule now:    {cpu_per_hour(now):5.1f} ms CPU")


if __name__ == "__main__":
    main()
