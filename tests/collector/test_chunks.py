"""The chunk codec is exact: every sample field, None, -0.0, huge ints, odd floats; merges too; and the batched
encoder writes the very bytes of the one-chunk encoder."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.collector import chunks
from gpuledger.collector.chunks import (
    FLOAT,
    INT,
    OBJ,
    column_floats,
    column_list,
    decode_columns,
    decode_samples,
    encode_columns,
    encode_samples,
    encode_series,
    encode_series_many,
    merge_chunks,
)
from gpuledger.collector.series import Series
from gpuledger.schema.records import GpuProcess, GpuSample

T0 = 1_700_000_000.0
floats = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=64),
                   st.sampled_from([0.0, -0.0, 0.1, 1e-300, 5e-324, 123.4, 2.0**60]))
ints = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(0, 300))


@st.composite
def samples(draw) -> list[GpuSample]:
    n = draw(st.integers(1, 40))
    tss = draw(st.lists(st.floats(1.0, 2e9, allow_nan=False), min_size=n, max_size=n, unique=True))
    out = []
    for ts in tss:
        out.append(GpuSample(
            ts=ts, host="h", gpu_uuid="G", gpu_index=draw(st.integers(0, 7)), model=draw(st.sampled_from(["", "H200"])),
            sm_active_ratio=draw(floats), dram_bw_ratio=draw(floats), power_watts=draw(floats),
            energy_joules=draw(floats), temp_celsius=draw(floats), mem_used_bytes=draw(ints),
            throttle_reasons=draw(ints), ecc_errors_total=draw(ints),
            xid_errors=tuple(draw(st.lists(st.integers(0, 200), max_size=2))),
            processes=tuple(GpuProcess(p, m, u) for p, m, u in draw(st.lists(
                st.tuples(st.integers(1, 2**22), ints, st.none() | st.floats(0.0, 1.0)), max_size=2))),
            job_ids=tuple(draw(st.lists(st.sampled_from(["1", "2_3", "ü"]), max_size=2, unique=True))),
            job_shares=tuple(draw(st.lists(st.floats(0, 1), max_size=2))), source=draw(st.sampled_from(["", "nvml"])),
        ))
    return out


def same(a: list[GpuSample], b: list[GpuSample]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == y
        for f in ("ts", "power_watts", "sm_active_ratio", "energy_joules", "temp_celsius", "dram_bw_ratio"):
            vx, vy = getattr(x, f), getattr(y, f)
            if isinstance(vx, float):  # bit for bit: -0.0 stays -0.0
                assert math.copysign(1, vx) == math.copysign(1, vy) and type(vx) is type(vy)


@settings(max_examples=150, deadline=None)
@given(samples(), st.sampled_from([True, False]))
def test_samples_round_trip_exactly(ss, light):
    # Both on-disk forms: light (what one batch writes) and columnar (what compaction writes).
    same(decode_samples(encode_samples(ss, light=light), "h", "G", None), ss)


@settings(max_examples=60, deadline=None)
@given(samples(), st.randoms(use_true_random=False))
def test_merge_equals_sorted_concatenation(ss, rnd):
    parts = [ss[i::3] for i in range(3)]
    blobs = [encode_samples(p, light=i % 2 == 0) for i, p in enumerate(parts) if p]
    rnd.shuffle(blobs)
    blob, n, t0, t1 = merge_chunks(blobs)
    want = sorted(ss, key=lambda s: s.ts)
    same(decode_samples(blob, "h", "G", None), want)
    assert (n, t0, t1) == (len(ss), want[0].ts, want[-1].ts)


def test_mig_key_and_missing_columns_take_defaults():
    s = GpuSample(ts=T0, host="h", gpu_uuid="G", gpu_index=1, mig="1.0", power_watts=50.0)
    (back,) = decode_samples(encode_samples([s]), "h", "G", "1.0")
    assert back == s
    # a chunk written before a field existed decodes with that field's default
    blob = encode_columns(1, [("ts", FLOAT, [T0]), ("gpu_index", INT, [2])])
    (old,) = decode_samples(blob, "h", "G", None)
    assert old == GpuSample(ts=T0, host="h", gpu_uuid="G", gpu_index=2)


def test_regular_telemetry_compresses_well():
    rnd = random.Random(0)
    ss, e, p = [], 1e6, 300.0
    for i in range(3600):
        e += rnd.randint(100, 700)
        p = round(max(0.0, p + rnd.uniform(-5, 5)), 1)
        ss.append(GpuSample(ts=T0 + i, host="h", gpu_uuid="G", gpu_index=0, model="H200", power_watts=p,
                            energy_joules=e, sm_active_ratio=round(rnd.random(), 3),
                            temp_celsius=float(rnd.randint(40, 45)),
                            mem_used_bytes=80 * 2**30, sm_clock_hz=1.98e9, job_ids=("42",)))
    blob = encode_samples(ss)
    assert len(blob) / len(ss) < 10  # bytes per sample; msgpack rows were ~120
    assert decode_samples(blob, "h", "G", None) == ss


def test_column_errors_and_generic_columns():
    with pytest.raises(ValueError, match="expected 2"):
        encode_columns(2, [("x", FLOAT, [1.0])])
    n, cols = decode_columns(encode_columns(3, [("o", OBJ, [[1], [1], "a"]), ("i", INT, [None, 2**64 - 1, 3])]))
    assert column_list(n, cols["o"]) == [[1], [1], "a"] and column_list(n, cols["i"]) == [None, 2**64 - 1, 3]


# -- encode_series_many: a batch's chunks at once, the same bytes as encode_series one by one ------------
FLOAT_FIELDS = ("power_watts", "energy_joules", "sm_active_ratio", "dram_bw_ratio", "temp_celsius", "sm_clock_hz",
                "pcie_tx_bytes_per_second")
INT_FIELDS = ("mem_used_bytes", "mem_total_bytes", "throttle_reasons", "ecc_errors_total")
I64 = (-(2**63), 2**63 - 1)


def float_column(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """Columns that take each path of the encoder: decimals of every scale, a scale that only later values
    show, whole numbers, constants, values that are not decimal or overflow 2**53, -0.0, infinities."""
    if kind == "ratio":  # three decimals, like the validated ratios
        return rng.random(n).round(3)
    if kind == "ratio_late":  # the first values have fewer decimals than the rest
        col = rng.random(n).round(3)
        col[:2] = [0.5, 0.25][:n]
        return col
    if kind == "watts":  # a random walk, one decimal
        return (300 + np.cumsum(rng.normal(0, 5, n))).round(1)
    if kind == "walk":  # not decimal at all: the XOR path
        return 300 + np.cumsum(rng.normal(0, 5, n))
    if kind == "counter":
        return 1e8 + np.cumsum(rng.integers(0, 700, n)).astype(np.float64)
    if kind == "temp":  # whole numbers, negative too
        return rng.integers(-40, 90, n).astype(np.float64)
    if kind == "const":
        return np.full(n, rng.choice([0.0, -0.0, 0.5, 1.98e9, 2619e6, -7.25]))
    if kind == "dup":
        return rng.choice([0.1, 0.2, 0.25, 3.0, 1e-9], n)
    if kind == "near53":  # whole numbers at the edge of exactness
        return 2.0**53 - rng.integers(0, 3, n).astype(np.float64)
    if kind == "nine":  # the largest scale, and one beyond it
        return rng.random(n).round(int(rng.choice([9, 10])))
    if kind == "odd":
        return rng.choice([1e300, -1e300, 5e-324, 1e-300, 2.0**60, 1.5, -0.0, math.inf, -math.inf], n)
    if kind == "ms":  # timestamps in milliseconds
        return (T0 + np.sort(rng.integers(0, 10**6, n)) / 1000).round(3)
    raise AssertionError(kind)


def int_column(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if kind == "counter":
        return 10**12 + np.cumsum(rng.integers(0, 2**20, n))
    if kind == "top":
        return I64[1] - rng.integers(0, 5, n)
    if kind == "bottom":
        return I64[0] + rng.integers(0, 5, n)
    if kind == "near53":
        return 2**53 + rng.integers(-3, 3, n)
    if kind == "wild":
        return rng.integers(I64[0], I64[1], n, dtype=np.int64, endpoint=True)
    if kind == "const":
        return np.full(n, int(rng.choice([0, 80 * 2**30, -1])), dtype=np.int64)
    return rng.integers(0, 300, n)  # "small"


FLOAT_KINDS = ("ratio", "ratio_late", "watts", "walk", "counter", "temp", "const", "dup", "near53", "nine", "odd", "ms")
INT_KINDS = ("counter", "top", "bottom", "near53", "wild", "const", "small")


@st.composite
def series_groups(draw) -> list[Series]:
    """A batch: series of a few lengths (light and columnar), fields of one kind across the batch or each its
    own, some values absent, some columns or dtypes unusual, constants and per-row lists now and then."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(st.lists(st.sampled_from([1, 5, 64, 65, 100, 625]), min_size=1, max_size=3))
    fkinds = {f: draw(st.sampled_from(FLOAT_KINDS)) for f in draw(st.lists(st.sampled_from(FLOAT_FIELDS), unique=True))}
    ifields = draw(st.lists(st.sampled_from(INT_FIELDS), unique=True, max_size=3))
    ikinds = {f: draw(st.sampled_from(INT_KINDS)) for f in ifields}
    out = []
    for i in range(draw(st.integers(1, 9))):
        n = lengths[i % len(lengths)]
        ts = float_column("ms", rng, n) if draw(st.booleans()) else np.sort(T0 + rng.integers(0, 10**6, n)) * 1.0
        if draw(st.integers(0, 19)) == 0:  # ts is stored as it is, whatever it holds
            ts = float_column(draw(st.sampled_from(FLOAT_KINDS)), rng, n)
            ts[rng.random(n) < 0.1] = np.nan
        floats = {}
        for f, kind in fkinds.items():
            if draw(st.integers(0, 9)) == 0:  # this GPU never reported it
                continue
            col = float_column(draw(st.sampled_from(FLOAT_KINDS)) if draw(st.integers(0, 3)) == 0 else kind, rng, n)
            gaps = draw(st.sampled_from(["none"] * 6 + ["some", "all"]))
            if gaps == "some":
                col[rng.random(n) < 0.3] = np.nan
            elif gaps == "all":
                col[:] = np.nan
            if draw(st.integers(0, 19)) == 0:  # not float64: left to the one-chunk path
                with np.errstate(over="ignore"):
                    col = col.astype(np.float32)
            floats[f] = col
        ints = {}
        for f, kind in ikinds.items():
            vals = int_column(draw(st.sampled_from(INT_KINDS)) if draw(st.integers(0, 3)) == 0 else kind, rng, n)
            mask = draw(st.sampled_from([None, None, None, np.ones(n, dtype=bool), rng.random(n) < 0.7]))
            ints[f] = (vals, mask)
        if draw(st.booleans()):  # another field order
            floats = dict(reversed(floats.items()))
        lists = {}
        if draw(st.integers(0, 9)) == 0:
            lists["xid_errors"] = tuple((79,) if j % 7 == 0 else () for j in range(n))
        if draw(st.integers(0, 9)) == 0:
            lists["processes"] = tuple((GpuProcess(100 + j, 2**30),) for j in range(n))
        out.append(Series(
            "h", f"GPU-{i}", draw(st.sampled_from([i, i, i, 0, -1, 2**62, I64[0], 2**64 - 1, True])), ts,
            model=draw(st.sampled_from(["H200", "", "ü"])), source="nvml", job_ids=("42",) if i % 2 else (),
            job_shares=draw(st.sampled_from([(), (1.0,), (0.5, 0.5)])), floats=floats, ints=ints, lists=lists))
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.astype(np.float64).view(np.uint64), b.view(np.uint64))


def check_decodes(s: Series, blob: bytes) -> None:
    n, cols = decode_columns(blob)
    assert n == s.n
    assert same_bits(s.ts, column_floats(n, cols["ts"]))
    for f, a in s.floats.items():
        assert same_bits(a, column_floats(n, cols[f]))
    for f, (v, m) in s.ints.items():
        present = [True] * n if m is None else m.tolist()
        assert column_list(n, cols[f]) == [x if p else None for x, p in zip(v.tolist(), present)]
    assert column_list(n, cols["gpu_index"]) == [s.gpu_index] * n


@settings(max_examples=200, deadline=None)
@given(series_groups())
def test_encode_series_many_is_encode_series(ss):
    blobs = encode_series_many(ss)
    assert blobs == [encode_series(s) for s in ss]
    for s, blob in zip(ss, blobs):
        check_decodes(s, blob)


def test_encode_series_many_on_a_batch_of_telemetry():
    # what ingest sees: 8 GPUs of a host, 625 rows each, every field reported; plus a part of another length
    rng = np.random.default_rng(7)
    ss = []
    for g in range(8):
        n = 625
        power = (300 + np.cumsum(rng.normal(0, 5, n))).round(1)
        floats = {
            "power_watts": power, "energy_joules": 1e8 + np.cumsum(power).round(),
            "sm_active_ratio": rng.random(n).round(3), "temp_celsius": 50.0 + rng.integers(-1, 2, n),
            "sm_clock_hz": np.where(rng.random(n) < 0.9, 1980e6, 1755e6), "mem_clock_hz": np.full(n, 2619e6),
            "pcie_tx_bytes_per_second": rng.integers(0, 2 * 10**9, n).astype(np.float64),
        }
        mem = (60e9 + np.cumsum(rng.integers(-2**24, 2**24, n))).astype(np.int64)
        ss.append(Series("h", f"GPU-{g}", g, T0 + np.arange(n, dtype=np.float64), model="H200", job_ids=("42",),
                         floats=floats, ints={"mem_used_bytes": (mem, None)}))
    ss.append(ss[0].slice(100, 300))
    blobs = encode_series_many(ss)
    assert blobs == [encode_series(s) for s in ss]
    for s, blob in zip(ss, blobs):
        check_decodes(s, blob)
        assert decode_samples(blob, "h", s.gpu_uuid, None) == s.rows()
    assert encode_series_many([]) == []


def reference_decimal_scale(v: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The plain loop, k = 0, 1, ... (what _decimal_scale computed before its shortcuts)."""
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(10):
            p = 10.0**k
            m = np.rint(v * p)
            if not np.abs(m).max() < 2.0**53:
                return None
            mi = m.astype(np.int64)
            if np.array_equal((mi / p).view(np.uint64), v.view(np.uint64)):
                return k, mi
    return None


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from(FLOAT_KINDS), min_size=1, max_size=3),
       st.integers(1, 80), st.lists(st.floats(width=64), max_size=3))
def test_decimal_scale_shortcuts_change_nothing(seed, kinds, n, head):
    # _decimal_scale starts at a k proven by the first values and checks magnitudes from max|v|: the same
    # answer as trying every k from 0; on mixed columns too (a scale that only later values show)
    rng = np.random.default_rng(seed)
    v = np.concatenate([np.array(head, dtype=np.float64)] + [float_column(k, rng, n) for k in kinds])
    got, want = chunks._decimal_scale(v), reference_decimal_scale(v)
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == want[0] and np.array_equal(got[1], want[1])
