"""The chunk codec is exact: every sample field, None, -0.0, huge ints, odd floats; merges too."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.records import GpuProcess, GpuSample
from collector.chunks import (
    FLOAT,
    INT,
    OBJ,
    column_list,
    decode_columns,
    decode_samples,
    encode_columns,
    encode_samples,
    merge_chunks,
)

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
            processes=tuple(GpuProcess(p, m) for p, m in draw(st.lists(st.tuples(st.integers(1, 2**22), ints), max_size=2))),
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
                            energy_joules=e, sm_active_ratio=round(rnd.random(), 3), temp_celsius=float(rnd.randint(40, 45)),
                            mem_used_bytes=80 * 2**30, sm_clock_hz=1.98e9, job_ids=("42",)))
    blob = encode_samples(ss)
    assert len(blob) / len(ss) < 10  # bytes per sample; msgpack rows were ~120
    assert decode_samples(blob, "h", "G", None) == ss


def test_column_errors_and_generic_columns():
    with pytest.raises(ValueError, match="expected 2"):
        encode_columns(2, [("x", FLOAT, [1.0])])
    n, cols = decode_columns(encode_columns(3, [("o", OBJ, [[1], [1], "a"]), ("i", INT, [None, 2**64 - 1, 3])]))
    assert column_list(n, cols["o"]) == [[1], [1], "a"] and column_list(n, cols["i"]) == [None, 2**64 - 1, 3]
