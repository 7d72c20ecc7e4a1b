"""The columnar batch layout agents push (agent.wire)."""

from __future__ import annotations

import struct

import pytest

from gpuledger.schema.records import GpuProcess, GpuSample
from gpuledger.schema.wire import COLUMNS, FLOAT_COLUMNS, INT_COLUMNS, from_series, to_series


def mk(ts: float, gpu: int, **kw) -> GpuSample:
    return GpuSample(ts=ts, host="n1", gpu_uuid=f"G{gpu}", gpu_index=gpu, model="H200", **kw)


def test_columns_cover_every_numeric_field_once():
    assert COLUMNS[0] == "ts" and set(FLOAT_COLUMNS) | set(INT_COLUMNS) == set(COLUMNS)
    assert not set(FLOAT_COLUMNS) & set(INT_COLUMNS)
    assert "host" not in COLUMNS and "gpu_index" not in COLUMNS


def test_one_series_per_gpu_and_job_set_with_complete_columns_as_bytes():
    samples = [mk(100.0 + i, g, power_watts=300.0 + i, mem_used_bytes=10**9 + i, job_ids=("7",) if i < 3 else ("8",),
                  sm_active_ratio=None if i == 1 else 0.5)
               for i in range(5) for g in range(2)]
    series = to_series(samples, "n1", binary=True)
    assert [(s["gpu_uuid"], s["job_ids"]) for s in series] == [("G0", ["7"]), ("G1", ["7"]), ("G0", ["8"]),
                                                               ("G1", ["8"])]
    first = series[0]
    assert first["ts"] == struct.pack("<3d", 100.0, 101.0, 102.0)
    assert first["mem_used_bytes"] == struct.pack("<3q", 10**9, 10**9 + 1, 10**9 + 2)
    assert first["sm_active_ratio"] == [0.5, None, 0.5]  # a gap: a list with null
    assert "dram_bw_ratio" not in first and "source" not in first  # never reported / default: left out
    assert "host" not in first
    assert sorted(from_series(series, "n1"), key=lambda s: (s.ts, s.gpu_uuid)) == samples


def test_lists_only_without_binary_and_row_lists_round_trip():
    samples = [mk(1.0, 0, xid_errors=(79,), processes=(GpuProcess(12, 2**30),)), mk(2.0, 0), mk(3.0, 0, mig="1.0")]
    series = to_series(samples, "n1")
    assert all(isinstance(v, list) for s in series for k, v in s.items() if k in COLUMNS)
    assert series[0]["xid_errors"] == [[79], []] and series[0]["processes"] == [[[12, 2**30]], []]
    assert series[1]["mig"] == "1.0"
    assert from_series(series, "n1") == samples


def test_unencodable_batches_are_refused():
    with pytest.raises(ValueError, match="host 'n2'"):
        to_series([GpuSample(ts=1.0, host="n2", gpu_uuid="G", gpu_index=0)], "n1")
    with pytest.raises(ValueError, match="NaN or infinite power_watts"):
        to_series([mk(1.0, 0, power_watts=float("inf"))], "n1", binary=True)
    with pytest.raises(ValueError, match="job_shares"):
        to_series([mk(1.0, 0, job_ids=("1", "2"), job_shares=(float("nan"), 0.5))], "n1")


def test_an_integer_beyond_int64_stays_a_list():
    s = to_series([mk(1.0, 0, ecc_errors_total=2**64 - 1)], "n1", binary=True)[0]
    assert s["ecc_errors_total"] == [2**64 - 1] and isinstance(s["ts"], bytes)
