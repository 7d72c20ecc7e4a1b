"""Downsampling: per-GPU time buckets with count, sum, min and max of every numeric sample field.

A rollup row is ``ts`` (bucket start), ``samples`` (raw samples in the bucket) and, per field ``f``,
``f:n`` (samples that reported it), ``f:sum``, ``f:min``, ``f:max``. Counts and sums add and
extremes combine, so 1-hour rows are built from 1-minute rows exactly as from the raw samples, and
a coarser query step re-buckets any tier the same way. Means are plain sample means (``sum / n``).
For the energy counter (``energy_joules``) ``max`` is the highest reading in the bucket, nothing more: the
counter at the bucket's end only while it grew throughout, not across a counter reset (a driver reload; the
aggregation handles it as a normal event), where it is the reading before the reset. So differences of ``max``
are not a bucket's energy: that comes from the ledger's hour buckets (``Store.gpu_hours``, ``Store.gpu_energy``),
which the aggregation builds from consecutive samples, across resets and gaps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuledger.collector.chunks import FLOAT, INT, NUMERIC_FIELDS, column_floats, decode_columns, encode_columns

STATS = ("n", "sum", "min", "max")


Stats = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # per row: n, sum, min, max of a field


def _stats(columns: Iterable[np.ndarray]) -> Stats:
    n, total, lo, hi = columns
    return n, total, lo, hi


@dataclass
class Rollup:
    """Columnar rollup rows, sorted by ``ts``; ``stats[f]`` is (n, sum, min, max) arrays."""

    ts: np.ndarray
    samples: np.ndarray
    stats: dict[str, Stats] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ts.size)

    def select(self, keep: np.ndarray) -> Rollup:
        return Rollup(self.ts[keep], self.samples[keep],
                      {f: (n[keep], s[keep], lo[keep], hi[keep]) for f, (n, s, lo, hi) in self.stats.items()})

    def points(self, step: float, tier: str) -> list[RollupPoint]:
        out = []
        ts, samples = self.ts.tolist(), self.samples.tolist()
        cols = {f: [a.tolist() for a in s] for f, s in self.stats.items()}
        for i, t in enumerate(ts):
            vals = {}
            for f, (n, s, lo, hi) in cols.items():
                if n[i] > 0:
                    vals[f] = (int(n[i]), s[i], lo[i], hi[i])
            out.append(RollupPoint(t, step, int(samples[i]), vals, tier))
        return out


@dataclass(frozen=True, slots=True)
class RollupPoint:
    """One bucket of one GPU: ``values[field] = (n, sum, min, max)`` for the fields reported in it."""

    ts: float
    step: float
    samples: int
    values: dict[str, tuple[int, float, float, float]]
    tier: str = ""

    def mean(self, f: str) -> float | None:
        v = self.values.get(f)
        return v[1] / v[0] if v else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts, "step": self.step, "samples": self.samples, "tier": self.tier,
            "mean": {f: v[1] / v[0] for f, v in self.values.items()},
            "min": {f: v[2] for f, v in self.values.items()},
            "max": {f: v[3] for f, v in self.values.items()},
        }


_NONE = np.zeros(0)  # every empty rollup's columns: nothing written into a zero-length array changes it


def empty() -> Rollup:
    """No rows. Its columns are one shared zero-length array: compaction plans two empty rollups a GPU at most
    passes (no minute to roll up yet), and a copy per column was 40% of a pass's CPU (bench/compaction.py)."""
    z = _NONE
    return Rollup(z, z, {f: (z, z, z, z) for f in NUMERIC_FIELDS})


def _groups(ts: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ts -> (bucket starts, index where each bucket begins)."""
    b = np.floor(ts / step) * step
    starts = np.flatnonzero(np.concatenate(([True], b[1:] != b[:-1])))
    return b[starts], starts


def from_raw(ts: np.ndarray, values: dict[str, np.ndarray], step: float) -> Rollup:
    """Bucket raw samples (ts sorted; values float64 with NaN for None) into ``step``-second rows."""
    if ts.size == 0:
        return empty()
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    buckets, starts = _groups(ts, step)
    counts = np.diff(np.append(starts, ts.size)).astype(np.float64)
    stats: dict[str, Stats] = {}
    for f in NUMERIC_FIELDS:
        v = values[f][order]
        ok = ~np.isnan(v)
        n = np.add.reduceat(ok.astype(np.float64), starts)
        s = np.add.reduceat(np.where(ok, v, 0.0), starts)
        lo = np.fmin.reduceat(v, starts)  # fmin/fmax skip NaN; an all-NaN bucket stays NaN
        hi = np.fmax.reduceat(v, starts)
        stats[f] = (n, s, lo, hi)
    return Rollup(buckets, counts, stats)


def combine(r: Rollup, step: float) -> Rollup:
    """Re-bucket rollup rows (any order, possibly overlapping buckets) to a coarser ``step``."""
    if len(r) == 0:
        return empty()
    order = np.argsort(r.ts, kind="stable")
    r = r.select(order)
    buckets, starts = _groups(r.ts, step)
    stats: dict[str, Stats] = {}
    for f, (n, s, lo, hi) in r.stats.items():
        stats[f] = (np.add.reduceat(n, starts), np.add.reduceat(s, starts),
                    np.fmin.reduceat(lo, starts), np.fmax.reduceat(hi, starts))
    return Rollup(buckets, np.add.reduceat(r.samples, starts), stats)


def concat(parts: Sequence[Rollup]) -> Rollup:
    parts = [p for p in parts if len(p)]
    if not parts:
        return empty()
    return Rollup(np.concatenate([p.ts for p in parts]), np.concatenate([p.samples for p in parts]),
                  {f: _stats(np.concatenate([p.stats[f][i] for p in parts]) for i in range(4)) for f in NUMERIC_FIELDS})


def _col(a: np.ndarray, present: np.ndarray) -> list:
    return [v if ok else None for v, ok in zip(a.tolist(), present.tolist())]


def encode(r: Rollup) -> bytes:
    cols: list[tuple[str, str, Sequence]] = [("ts", FLOAT, r.ts.tolist()),
                                             ("samples", INT, r.samples.astype(np.int64).tolist())]
    for f in NUMERIC_FIELDS:
        n, s, lo, hi = r.stats[f]
        present = n > 0
        cols.append((f + ":n", INT, n.astype(np.int64).tolist()))
        cols += [(f"{f}:{k}", FLOAT, _col(a, present)) for k, a in (("sum", s), ("min", lo), ("max", hi))]
    return encode_columns(len(r), cols)


def decode(blob: bytes) -> Rollup:
    n, cols = decode_columns(blob)
    ts = column_floats(n, cols["ts"])
    stats: dict[str, Stats] = {}
    for f in NUMERIC_FIELDS:
        if f + ":n" not in cols:  # a field added after this chunk was written
            stats[f] = (np.zeros(n), np.zeros(n), np.full(n, np.nan), np.full(n, np.nan))
            continue
        stats[f] = _stats(column_floats(n, cols[f"{f}:{k}"]) for k in STATS)
    for cnt, s, _lo, _hi in stats.values():
        s[cnt == 0] = 0.0
    return Rollup(ts, column_floats(n, cols["samples"]), stats)
