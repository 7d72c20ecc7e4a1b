"""DcgmSource: the pure field conversion, the 'bindings not found' error, and open/sample through bindings."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from gpuledger.schema.records import GpuSample
from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.dcgm import (
    DCGM_FIELDS,
    DCGM_INT64_BLANK,
    DEFAULT_BINDINGS_PATHS,
    FIELDS_BY_ID,
    DcgmSource,
    dcgm_values_to_samples,
)

MIB = 1024 * 1024


def test_field_table_is_consistent() -> None:
    ids = [f.field_id for f in DCGM_FIELDS]
    assert len(ids) == len(set(ids))
    # The ids the design names, with the sample field each feeds.
    expect = {1002: "sm_active_ratio", 1003: "sm_occupancy_ratio", 1004: "tensor_active_ratio",
              1005: "dram_bw_ratio", 155: "power_watts", 156: "energy_joules", 203: "gpu_util_ratio",
              252: "mem_used_bytes", 250: "mem_total_bytes", 150: "temp_celsius", 100: "sm_clock_hz"}
    assert {i: FIELDS_BY_ID[i].target for i in expect} == expect
    for f in DCGM_FIELDS:
        assert f.target.startswith("_") or f.target in GpuSample.__dataclass_fields__


def test_values_to_samples_converts_units() -> None:
    values = {
        0: {54: "GPU-aaaa", 50: "NVIDIA A100-SXM4-80GB", 52: 0, 1002: 0.91, 1003: 0.42, 1004: 0.33, 1005: 0.61,
            155: 312.5, 156: 179_000_000, 203: 97, 204: 40, 250: 81920, 252: 40960, 150: 61, 100: 1410,
            101: 1593, 112: 4, 230: 0, 311: 1, 393: 2, 394: 5, 1009: 5_000_000, 200: 999},
        1: {54: b"GPU-bbbb", 52: 1, 155: 61.2, 150: DCGM_INT64_BLANK + 2, 1002: 1.0000003, 230: 48},
        2: {155: 70.0},  # no UUID field: the reader's gpuId -> UUID map names it
        3: {155: 70.0},  # nothing names it: skipped
    }
    a, b, c = dcgm_values_to_samples(values, host="n1", ts=10.0, uuids={2: "GPU-cccc"})
    assert (a.gpu_uuid, a.gpu_index, a.model, a.host, a.ts, a.source) == (
        "GPU-aaaa", 0, "NVIDIA A100-SXM4-80GB", "n1", 10.0, "dcgm")
    assert (a.sm_active_ratio, a.sm_occupancy_ratio, a.tensor_active_ratio, a.dram_bw_ratio) == (0.91, 0.42, 0.33, 0.61)
    assert a.power_watts == 312.5 and a.energy_joules == 179_000.0
    assert a.gpu_util_ratio == 0.97 and a.mem_copy_util_ratio == 0.40
    assert (a.mem_total_bytes, a.mem_used_bytes) == (81920 * MIB, 40960 * MIB)
    assert (a.temp_celsius, a.sm_clock_hz, a.mem_clock_hz) == (61.0, 1410e6, 1593e6)
    assert (a.throttle_reasons, a.xid_errors, a.ecc_errors_total, a.remapped_rows_total) == (4, (), 1, 7)
    assert a.pcie_tx_bytes_per_second == 5_000_000.0  # PROF bytes/s wins over the old KB/s field
    assert b.gpu_uuid == "GPU-bbbb" and b.temp_celsius is None  # DCGM_INT64_NOT_SUPPORTED
    assert b.sm_active_ratio == 1.0 and b.xid_errors == (48,)
    assert (c.gpu_uuid, c.gpu_index, c.power_watts) == ("GPU-cccc", 2, 70.0)


def test_open_without_bindings_names_every_path(tmp_path: Path) -> None:
    setting = str(tmp_path / "nowhere")
    with pytest.raises(SourceUnavailable) as info:
        DcgmSource(bindings_path=setting).open()
    msg = str(info.value)
    for p in (setting, *DEFAULT_BINDINGS_PATHS):
        assert p in msg


FAKE_READER = '''
"""Stands in for DCGM's DcgmReader (machine boundary: there is no nv-hostengine here)."""
CONNECT = True


class DcgmReader:
    def __init__(self, hostname="localhost", fieldIds=None, updateFrequency=10000000, **kw):
        self.hostname, self.fieldIds, self.updateFrequency = hostname, fieldIds, updateFrequency
        self.m_dcgmHandle = None
        self.m_gpuIdToUUId = {}
        self.shut = False

    def Init(self, libpath=None):
        if CONNECT:  # DcgmReader logs and stays disconnected when the host engine is down
            self.m_dcgmHandle = object()
            self.m_gpuIdToUUId = {0: "GPU-zero"}

    def GetLatestGpuValuesAsFieldIdDict(self):
        return {0: {155: 250.0, 156: 5_000_000, 1002: 0.5}}

    def Shutdown(self):
        self.shut = True
'''


@pytest.fixture
def bindings(tmp_path: Path):
    (tmp_path / "DcgmReader.py").write_text(textwrap.dedent(FAKE_READER))
    yield tmp_path
    sys.modules.pop("DcgmReader", None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_open_and_sample_through_bindings(bindings: Path) -> None:
    src = DcgmSource(bindings_path=str(bindings), host="n9", clock=lambda: 3.0, update_interval_s=0.5)
    src.open()
    (s,) = src.sample()
    assert (s.gpu_uuid, s.host, s.ts, s.power_watts, s.energy_joules, s.sm_active_ratio) == (
        "GPU-zero", "n9", 3.0, 250.0, 5000.0, 0.5)
    reader = src._reader
    assert reader.updateFrequency == 500_000 and 1002 in reader.fieldIds
    src.close()
    assert reader.shut


def test_open_reports_hostengine_down(bindings: Path) -> None:
    src = DcgmSource(bindings_path=str(bindings), hostengine="10.0.0.9")
    sys.path.insert(0, str(bindings))
    import DcgmReader  # the fixture's module

    DcgmReader.CONNECT = False
    with pytest.raises(SourceUnavailable, match="nv-hostengine at 10.0.0.9"):
        src.open()
