"""NvmlSource against behaviours of the real NVML and nvidia-ml-py that a GPU node shows (issue #18).

Each test names the driver behaviour it models; the strict fake (tests/nvml_fake.py) reproduces it.
"""

from __future__ import annotations

import logging
import math

import pynvml
import pytest
from nvml_fake import MIB, FakeGpu, FakeMigInstance, FakeNvml, FakeProcess, Scenario, busy_gpm, fake_node
from test_nvml_source import Clock, _open

from gpuledger.schema.wire import to_series


def _missing(*symbols: str, gpus: int = 2, **kw) -> FakeNvml:
    scenario = Scenario.node(gpus, **kw)
    scenario.missing_functions = frozenset(symbols)
    return FakeNvml(scenario, clock=Clock())


@pytest.mark.parametrize(("symbols", "field"), [
    # nvmlDeviceGetTemperature is deprecated in NVML 13 and announced for removal in CUDA 14.
    (("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), "temp_celsius"),
    (("nvmlDeviceGetRemappedRows",), "remapped_rows_total"),
    (("nvmlDeviceGetTotalEnergyConsumption",), "energy_joules"),
    (("nvmlDeviceGetPowerUsage",), "power_watts"),
    (("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo"), "mem_used_bytes"),
])
def test_a_function_missing_from_the_driver_costs_only_its_field(symbols, field) -> None:
    lib = _missing(*symbols)
    clock = lib._clock
    src = _open(lib, clock)
    for _ in range(3):
        clock.t += 1
        samples = src.sample()
        assert [s.gpu_index for s in samples] == [0, 1]  # the GPUs' samples go out
        assert all(getattr(s, field) is None for s in samples)
        assert all(s.power_watts is not None or field == "power_watts" for s in samples)
        assert all(s.pids for s in samples)
    assert src.errors_total == 0
    assert src.health.unavailable == {(field, "function_not_found"): 2}  # once per GPU, not per tick
    for sym in symbols:
        assert lib.calls[sym] <= 1 or sym == "nvmlDeviceGetMemoryInfo"  # never asked again once missing


def test_temperature_through_the_non_deprecated_function() -> None:
    lib = _missing("nvmlDeviceGetTemperature")
    src = _open(lib, lib._clock)
    assert [s.temp_celsius for s in src.sample()] == [30.0, 30.0]
    assert lib.calls["nvmlDeviceGetTemperature"] == 0 and lib.calls["nvmlDeviceGetTemperatureV"] == 2


def test_unversioned_process_wrapper_raises_library_mismatch_and_is_never_the_fallback() -> None:
    lib = _missing("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
    lib.nvmlInit()
    with pytest.raises(pynvml.NVMLLibraryMismatchError) as info:  # what pynvml's throwOnVersionMismatch does
        lib.nvmlDeviceGetComputeRunningProcesses(lib.nvmlDeviceGetHandleByIndex(0))
    assert not isinstance(info.value, pynvml.NVMLError)
    lib.nvmlShutdown()
    src = _open(lib, lib._clock)
    samples = src.sample()
    assert [(s.gpu_index, s.pids) for s in samples] == [(0, ()), (1, ())]
    assert samples[0].power_watts == 450.0
    assert src.health.unavailable == {("processes", "function_not_found"): 2}


def test_library_mismatch_from_any_call_is_a_missing_function() -> None:
    clock = Clock()

    class Mismatched(FakeNvml):
        def nvmlDeviceGetPcieThroughput(self, device, counter):
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")

    lib = Mismatched(Scenario.node(1), clock=clock)
    src = _open(lib, clock)
    for _ in range(2):
        (s,) = src.sample()
        assert s.pcie_tx_bytes_per_second is None and s.power_watts == 450.0
    assert src.health.unavailable == {("pcie_tx_bytes_per_second", "library_mismatch"): 1,
                                      ("pcie_rx_bytes_per_second", "library_mismatch"): 1}


def test_event_wait_has_no_fallback_and_a_missing_symbol_is_asked_once() -> None:
    lib = _missing("nvmlEventSetWait_v2")
    src = _open(lib, lib._clock)
    for _ in range(3):
        src.sample()
    assert lib.calls["nvmlEventSetWait_v2"] == 1  # pynvml's nvmlEventSetWait is the same symbol


def test_gpm_nan_is_none_and_the_batch_still_encodes() -> None:
    clock = Clock()
    lib = fake_node(1, clock=clock)
    lib.update(0, gpm={**busy_gpm(), 2: math.nan})
    src = _open(lib, clock)
    src.sample()
    clock.t += 1
    (s,) = src.sample()
    assert s.sm_active_ratio is None and s.dram_bw_ratio == pytest.approx(0.4)
    to_series([s], "node1", binary=True)  # a NaN would be refused by the encoder (and the collector)


def _mig_gpu(**kw) -> FakeGpu:
    return FakeGpu(
        "GPU-mig", name="NVIDIA A100-SXM4-80GB", power_w=200.0, remapped_rows=(2, 1, 0, 0),
        mig=[FakeMigInstance(1, "3g.40gb", mem_used=10 * MIB, gpm=busy_gpm(sm=70)),
             FakeMigInstance(2, "1g.10gb", mem_used=5 * MIB, gpm=busy_gpm(sm=20), compute_instances=(0, 1))],
        processes=[FakeProcess(100, 10 * MIB, gpu_instance=1, compute_instance=0),
                   FakeProcess(201, 3 * MIB, gpu_instance=2, compute_instance=1)],
        gpm=busy_gpm(sm=45), **kw)


def test_mig_as_non_root_processes_and_memory_per_instance() -> None:
    clock = Clock()
    scenario = Scenario([_mig_gpu()], root=False)
    lib = FakeNvml(scenario, clock=clock)
    lib.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NoPermission):  # nvml.h: the parent's aggregate needs privileges
        lib.nvmlDeviceGetComputeRunningProcesses_v3(lib.nvmlDeviceGetHandleByIndex(0))
    lib.nvmlShutdown()
    src = _open(lib, clock)
    for _ in range(2):
        clock.t += 1
        parent, gi1, gi2 = src.sample()
        assert (parent.pids, gi1.pids, gi2.pids) == ((), (100,), (201,))
        assert (gi1.mem_used_bytes, gi2.mem_used_bytes) == (10 * MIB, 5 * MIB)
        assert parent.mem_used_bytes is None and parent.power_watts == 200.0
    assert src.health.unavailable == {("mem_used_bytes", "no_permission"): 1,
                                      ("remapped_rows_total", "not_supported"): 1}


def test_remapped_rows_come_back_when_mig_is_turned_off() -> None:
    clock = Clock()
    lib = FakeNvml(Scenario([_mig_gpu()]), clock=clock)
    src = _open(lib, clock)
    assert src.sample()[0].remapped_rows_total is None  # NOT_SUPPORTED while MIG is on
    lib.update(0, mig=None, processes=[FakeProcess(100, MIB)])
    clock.t += 1
    (s,) = src.sample()
    assert (s.mig, s.remapped_rows_total, s.pids) == (None, 3, (100,))
    assert s.gpu_util_ratio is not None


def test_mig_reconfiguration_is_seen_at_the_next_tick() -> None:
    clock = Clock()
    lib = FakeNvml(Scenario([_mig_gpu()]), clock=clock)
    src = _open(lib, clock)
    src.sample()
    clock.t += 1
    assert [s.model for s in src.sample()][1:] == ["NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                                                   "NVIDIA A100-SXM4-80GB MIG 1g.10gb"]
    # GPU instance 1 destroyed and re-created with another profile: the same id, another instance.
    lib.update(0, mig=[FakeMigInstance(1, "2g.20gb", mem_used=7 * MIB, gpm=busy_gpm(sm=10)),
                       FakeMigInstance(2, "1g.10gb", mem_used=5 * MIB, gpm=busy_gpm(sm=20), compute_instances=(0, 1))])
    clock.t += 1
    _, gi1, gi2 = src.sample()
    assert gi1.model == "NVIDIA A100-SXM4-80GB MIG 2g.20gb" and gi1.mem_used_bytes == 7 * MIB
    assert gi1.sm_active_ratio is None  # a new instance starts a new GPM window
    assert gi2.sm_active_ratio == pytest.approx(0.20)  # the unchanged one keeps its window


def test_max_mig_device_count_is_zero_with_mig_off() -> None:
    lib = fake_node(1)
    lib.nvmlInit()
    assert lib.nvmlDeviceGetMaxMigDeviceCount(lib.nvmlDeviceGetHandleByIndex(0)) == 0


def test_memory_used_leaves_out_the_reserve_as_dcgm_fb_used_does() -> None:
    clock = Clock()
    gpu = FakeGpu("GPU-m", mem_total=81559 * MIB, mem_used=1000 * MIB, mem_reserved=500 * MIB)
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    v1, v2 = lib.nvmlDeviceGetMemoryInfo(h), lib.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    assert (v1.used, v2.used, v2.reserved) == (1500 * MIB, 1000 * MIB, 500 * MIB)
    lib.nvmlShutdown()
    (s,) = _open(lib, clock).sample()
    assert s.mem_used_bytes == 1000 * MIB
    # A driver without the v2 symbol: v1's figure, the reserve included (the only one there is).
    old = FakeNvml(Scenario([gpu], missing_functions=frozenset({"nvmlDeviceGetMemoryInfo_v2"})), clock=clock)
    src = _open(old, clock)
    assert [s.mem_used_bytes for s in (src.sample() + src.sample())] == [1500 * MIB, 1500 * MIB]


def test_mps_clients_are_listed() -> None:
    clock = Clock()
    gpu = FakeGpu("GPU-mps", processes=[FakeProcess(500, 100 * MIB), FakeProcess(600, 2000 * MIB, mps=True),
                                        FakeProcess(601, 1000 * MIB, mps=True)])
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    (s,) = _open(lib, clock).sample()
    assert s.pids == (500, 600, 601)
    assert [p.used_memory_bytes for p in s.processes] == [100 * MIB, 2000 * MIB, 1000 * MIB]


def test_a_lost_gpu_does_not_starve_the_others_xids(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    lib = fake_node(3, clock=clock)
    src = _open(lib, clock, reopen_backoff_s=(600.0, 600.0))
    caplog.set_level(logging.WARNING, logger="gpuledger.agent.sources.nvml")
    lib.lose(1)  # no Xid 79 arrives: the driver may never send it
    lib.inject_xid(0, 13)
    seen: list[tuple[int, tuple[int, ...]]] = []
    for _ in range(5):
        clock.t += 1
        seen += [(s.gpu_index, s.xid_errors) for s in src.sample() if s.xid_errors]
        lib.inject_xid(2, 48) if len(seen) == 1 else None
    assert seen == [(0, (13,)), (2, (48,))]
    assert src.lost_gpus == (lib.scenario.gpus[1].uuid,)
    waits = [r for r in caplog.records if "event wait" in r.getMessage()]
    assert len(waits) == 1  # said once, not every tick
