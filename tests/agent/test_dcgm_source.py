"""DcgmSource: the pure field conversion, the 'bindings not found' error, and open/sample through bindings."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.dcgm import (
    DCGM_FIELDS,
    DCGM_INT64_BLANK,
    DEFAULT_BINDINGS_PATHS,
    FIELDS_BY_ID,
    DcgmSource,
    dcgm_values_to_samples,
)
from gpuledger.schema.records import GpuSample

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
            155: 312.5, 164: 400.0, 156: 179_000_000, 203: 97, 204: 40, 250: 81920, 252: 40960, 150: 61, 100: 1410,
            101: 1593, 112: 4, 230: 0, 311: 1, 393: 2, 394: 5, 1009: 5_000_000, 200: 999},
        1: {54: b"GPU-bbbb", 52: 1, 155: 61.2, 150: DCGM_INT64_BLANK + 2, 1002: 1.0000003, 230: 48},
        2: {155: 70.0},  # no UUID field: the reader's gpuId -> UUID map names it
        3: {155: 70.0},  # nothing names it: skipped
    }
    a, b, c = dcgm_values_to_samples(values, host="n1", ts=10.0, uuids={2: "GPU-cccc"})
    assert (a.gpu_uuid, a.gpu_index, a.model, a.host, a.ts, a.source) == (
        "GPU-aaaa", 0, "NVIDIA A100-SXM4-80GB", "n1", 10.0, "dcgm")
    assert (a.sm_active_ratio, a.sm_occupancy_ratio, a.tensor_active_ratio, a.dram_bw_ratio) == (0.91, 0.42, 0.33, 0.61)
    assert a.power_watts == 312.5 and a.energy_joules == 179_000.0 and a.power_limit_watts == 400.0
    assert b.power_limit_watts is None
    assert a.gpu_util_ratio == 0.97 and a.mem_copy_util_ratio == 0.40
    assert (a.mem_total_bytes, a.mem_used_bytes) == (81920 * MIB, 40960 * MIB)
    assert (a.temp_celsius, a.sm_clock_hz, a.mem_clock_hz) == (61.0, 1410e6, 1593e6)
    assert (a.throttle_reasons, a.xid_errors, a.ecc_errors_total, a.remapped_rows_total) == (4, (), 1, 7)
    assert a.pcie_tx_bytes_per_second == 5_000_000.0  # PROF bytes/s wins over the old KB/s field
    assert b.gpu_uuid == "GPU-bbbb" and b.temp_celsius is None  # DCGM_INT64_NOT_SUPPORTED
    assert b.sm_active_ratio == 1.0 and b.xid_errors == ()  # a last-Xid reading alone is no event
    assert (c.gpu_uuid, c.gpu_index, c.power_watts) == ("GPU-cccc", 2, 70.0)


def test_open_without_bindings_names_every_path(tmp_path: Path) -> None:
    setting = str(tmp_path / "nowhere")
    with pytest.raises(SourceUnavailable) as info:
        DcgmSource(bindings_path=setting).open()
    msg = str(info.value)
    for p in (setting, *DEFAULT_BINDINGS_PATHS):
        assert p in msg


FAKE_READER = '''
"""Stands in for DCGM's DcgmReader (machine boundary: there is no nv-hostengine here).

Modelled on DCGM's testing/python3/DcgmReader.py: Init() logs and stays disconnected when the host engine is
down; a field id the library does not know raises from Init (GetFieldMetadata); a field group is found by
name and deleted when another reader creates one with the same name; on a lost connection the reader drops
its handle and answers {}, and re-connects on its next call.
"""
import dcgm_fields

HOSTENGINE_UP = True
PROFILING_OK = True
VALUES = {0: {155: 250.0, 156: 5_000_000, 1002: 0.5}}
GROUPS = {}  # field-group name -> the reader that owns it on the host engine
RAISE = None  # an exception the next read raises (a failed re-connect with another status than CONNECTION)


class DCGMError(Exception):
    pass


class DcgmReader:
    def __init__(self, hostname="localhost", fieldIds=None, updateFrequency=10000000, maxKeepAge=3600.0,
                 ignoreList=None, fieldGroupName="dcgm_fieldgroupData", gpuIds=None, entities=None,
                 fieldIntervalMap=None):
        self.hostname, self.fieldIds, self.updateFrequency = hostname, fieldIds, updateFrequency
        self.m_fieldGroupName = fieldGroupName
        self.m_dcgmHandle = None
        self.m_gpuIdToUUId = {}
        self.shut = False

    def _connect(self):
        known = {v for k, v in vars(dcgm_fields).items() if k.startswith("DCGM_FI_")}
        for f in self.fieldIds:
            if f not in known:
                raise DCGMError("Unknown field id %d" % f)
        if any(1001 <= f <= 1010 for f in self.fieldIds) and not PROFILING_OK:
            raise DCGMError("Profiling is not supported for this group of GPUs or GPU")
        self.m_dcgmHandle = object()
        self.m_gpuIdToUUId = {0: "GPU-zero"}
        GROUPS[self.m_fieldGroupName] = self  # deletes another reader's group of that name

    def Init(self, libpath=None):
        if HOSTENGINE_UP:
            self._connect()

    def GetLatestGpuValuesAsFieldIdDict(self):
        if RAISE is not None:
            raise RAISE
        if self.m_dcgmHandle is None and HOSTENGINE_UP:
            self._connect()
        if not HOSTENGINE_UP:
            self.m_dcgmHandle = None
            return {}
        if GROUPS.get(self.m_fieldGroupName) is not self:
            return {}
        return {g: {f: v for f, v in vals.items() if f in self.fieldIds} for g, vals in VALUES.items()}

    def Shutdown(self):
        self.shut = True
'''

# A DCGM whose bindings know every field of the table but PROF_PCIE_TX_BYTES (1009).
FAKE_FIELDS = "".join(f"DCGM_FI_{i} = {i}\n" for i in sorted(FIELDS_BY_ID) if i != 1009)


@pytest.fixture
def bindings(tmp_path: Path):
    (tmp_path / "DcgmReader.py").write_text(textwrap.dedent(FAKE_READER))
    (tmp_path / "dcgm_fields.py").write_text(FAKE_FIELDS)
    sys.path.insert(0, str(tmp_path))
    import DcgmReader  # the fixture's module

    yield DcgmReader
    for mod in ("DcgmReader", "dcgm_fields"):
        sys.modules.pop(mod, None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_open_and_sample_through_bindings(bindings) -> None:
    src = DcgmSource(bindings_path=str(bindings.__file__).rsplit("/", 1)[0], host="n9", clock=lambda: 3.0,
                     update_interval_s=0.5)
    src.open()
    (s,) = src.sample()
    assert (s.gpu_uuid, s.host, s.ts, s.power_watts, s.energy_joules, s.sm_active_ratio) == (
        "GPU-zero", "n9", 3.0, 250.0, 5000.0, 0.5)
    readers = list(src._readers)
    assert [r.updateFrequency for r in readers] == [500_000, 500_000]
    assert 1002 in readers[1].fieldIds and 155 in readers[0].fieldIds  # profiling fields in a reader of their own
    src.close()
    assert all(r.shut for r in readers)


def _src(bindings, **kw) -> DcgmSource:
    return DcgmSource(bindings_path=str(Path(bindings.__file__).parent), host="n9", clock=lambda: 3.0, **kw)


def test_open_reports_hostengine_down(bindings) -> None:
    bindings.HOSTENGINE_UP = False
    with pytest.raises(SourceUnavailable, match="nv-hostengine at 10.0.0.9"):
        _src(bindings, hostengine="10.0.0.9").open()


def test_a_field_unknown_to_the_installed_dcgm_costs_only_that_field(bindings) -> None:
    bindings.VALUES = {0: {155: 250.0, 156: 5_000_000, 1002: 0.5, 1010: 1000.0}}
    src = _src(bindings)
    src.open()  # DcgmReader would refuse the whole field group for field 1009
    (s,) = src.sample()
    assert (s.power_watts, s.energy_joules, s.sm_active_ratio, s.pcie_rx_bytes_per_second) == (
        250.0, 5000.0, 0.5, 1000.0)
    assert src.health.unavailable == {("pcie_tx_bytes_per_second", "unknown_field"): 1}
    assert all(1009 not in r.fieldIds for r in src._readers)


def test_profiling_fields_that_cannot_be_watched_cost_only_themselves(bindings) -> None:
    bindings.PROFILING_OK = False
    src = _src(bindings)
    src.open()
    (s,) = src.sample()
    assert (s.power_watts, s.energy_joules, s.sm_active_ratio) == (250.0, 5000.0, None)
    assert src.health.unavailable[("sm_active_ratio", "watch_failed")] == 1


def test_readers_have_their_own_field_groups(bindings) -> None:
    first, second = _src(bindings), _src(bindings)
    first.open()
    second.open()  # with DcgmReader's default group name this deletes the first reader's group
    assert first.sample()[0].power_watts == 250.0 and second.sample()[0].power_watts == 250.0


def test_lost_host_engine_is_reported_and_reconnected(bindings, caplog: pytest.LogCaptureFixture) -> None:
    src = _src(bindings)
    src.open()
    assert src.sample() and src.connected
    caplog.set_level(logging.INFO, logger="gpuledger.agent.sources.dcgm")
    bindings.HOSTENGINE_UP = False
    for _ in range(3):
        with pytest.raises(RuntimeError, match="not connected to nv-hostengine"):
            src.sample()  # never an empty batch that looks like "no GPUs"
    assert (src.connected, src.hostengine_disconnects_total) == (False, 1)
    assert len([r for r in caplog.records if "lost the connection" in r.getMessage()]) == 1
    bindings.HOSTENGINE_UP = True
    assert src.sample()[0].power_watts == 250.0
    assert src.connected and any("reconnected" in r.getMessage() for r in caplog.records)


def test_sticky_last_xid_counts_once_per_change(bindings) -> None:
    src = _src(bindings)
    src.open()
    seen = []
    for xid in (0, 48, 48, 48, 13, 13):
        bindings.VALUES = {0: {155: 250.0, 230: xid}}
        seen.append(src.sample()[0].xid_errors)
    assert seen == [(), (48,), (), (), (13,), ()]


def test_an_exception_from_the_reader_is_a_lost_host_engine(bindings) -> None:
    src = _src(bindings)
    src.open()
    bindings.RAISE = bindings.DCGMError("Host engine connection invalid/disconnected")
    with pytest.raises(RuntimeError, match="not connected to nv-hostengine.*DCGMError"):
        src.sample()
    assert (src.connected, src.hostengine_disconnects_total) == (False, 1)
    bindings.RAISE = None
    assert src.sample()[0].power_watts == 250.0 and src.connected
