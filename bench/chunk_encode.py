#!/usr/bin/env python3
"""Chunk encoding of one ingest batch: ``encode_series`` per GPU against ``encode_series_many``.

The batch is bench/ingest.py's: one host, 8 GPUs x 625 seconds, 10 numeric fields a sample (random walks,
a counter, clocks) and the job's process, turned into one Series per GPU the way the collector sees it. Both
encoders run in this process on the same series; the script checks that they give the same bytes, then prints the
time per batch of each (the best of three rounds, a round the median of --repeat passes) and their ratio.

    .venv/bin/python bench/chunk_encode.py            # a few seconds
    .venv/bin/python bench/chunk_encode.py --batches 20 --repeat 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ingest import Data  # noqa: E402

from gpuledger.collector.chunks import encode_series, encode_series_many  # noqa: E402
from gpuledger.collector.series import Series, series_from_samples  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402


def batch_series(data: Data, i: int) -> list[Series]:
    """Batch ``i`` as one Series per GPU (rows come GPU by GPU, in time order)."""
    _host, rows = data.batch(i, 0)
    per_gpu: dict[str, list[GpuSample]] = {}
    for d in rows:
        s = GpuSample.from_dict(d)
        per_gpu.setdefault(s.gpu_uuid, []).append(s)
    return [series_from_samples(ss) for ss in per_gpu.values()]


def per_batch(fn, batches: list[list[Series]], repeat: int) -> float:
    """Median over ``repeat`` passes of the mean seconds per batch."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for ss in batches:
            fn(ss)
        times.append((time.perf_counter() - t0) / len(batches))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=10, help="distinct batches (hosts) to encode")
    ap.add_argument("--repeat", type=int, default=30, help="timed passes over them; the median counts")
    a = ap.parse_args()
    data = Data(hosts=max(1, a.batches), t0=1_700_000_000.123456, steps=625)  # t0 not whole, as time.time()
    batches = [batch_series(data, i) for i in range(a.batches)]
    for ss in batches:  # the same bytes, or the comparison means nothing
        if encode_series_many(ss) != [encode_series(s) for s in ss]:
            sys.exit("encode_series_many differs from encode_series")

    def loop(ss: list[Series]) -> list[bytes]:
        return [encode_series(s) for s in ss]

    # alternate, so that neither gets a warmer cache or a quieter machine
    one, many = [], []
    for _ in range(3):
        one.append(per_batch(loop, batches, a.repeat))
        many.append(per_batch(encode_series_many, batches, a.repeat))
    t1, tm = min(one), min(many)
    n = len(batches[0])
    rows = sum(s.n for s in batches[0])
    fields = len(batches[0][0].floats) + len(batches[0][0].ints)
    print(f"batch: {n} series x {rows // n} rows, {fields} numeric fields + ts")
    print(f"{'[encode_series(s) for s in ss]':34}{t1 * 1e3:8.3f} ms/batch")
    print(f"{'encode_series_many(ss)':34}{tm * 1e3:8.3f} ms/batch")
    print(f"{'speed-up':34}{t1 / tm:8.2f} x")


if __name__ == "__main__":
    main()
