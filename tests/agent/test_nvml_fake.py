"""The fake NVML library behaves like nvidia-ml-py where the source depends on it."""

from __future__ import annotations

import ctypes

import pynvml
import pytest
from nvml_fake import (
    GPM_DRAM_BW_UTIL,
    GPM_SM_UTIL,
    FakeGpu,
    FakeMigInstance,
    FakeNvml,
    FakeProcess,
    Scenario,
    fake_node,
)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _metrics(lib: FakeNvml, s1, s2, ids):
    req = lib.c_nvmlGpmMetricsGet_t()
    req.version = lib.NVML_GPM_METRICS_GET_VERSION
    req.numMetrics = len(ids)
    req.sample1, req.sample2 = s1, s2
    for i, mid in enumerate(ids):
        req.metrics[i].metricId = mid
    lib.nvmlGpmMetricsGet(req)
    return [(req.metrics[i].nvmlReturn, req.metrics[i].value) for i in range(len(ids))]


def test_errors_are_the_real_pynvml_classes() -> None:
    lib = fake_node(1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        lib.nvmlDeviceGetCount()
    lib.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlDeviceGetHandleByIndex(5)
    assert lib.NVMLError is pynvml.NVMLError
    assert lib.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    with pytest.raises(AttributeError, match="does not implement"):
        lib.nvmlDeviceGetFanSpeed  # noqa: B018 - a real pynvml function the fake lacks


def test_return_types_match_pynvml() -> None:
    lib = FakeNvml(Scenario([FakeGpu("GPU-a", mem_total=100, mem_used=40, gpu_util=70, mem_util=20,
                                     processes=[FakeProcess(7, 30)])]))
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    mem = lib.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and (mem.total, mem.used, mem.free) == (100, 40, 60)
    util = lib.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t) and (util.gpu, util.memory) == (70, 20)
    (p,) = lib.nvmlDeviceGetComputeRunningProcesses_v3(h)
    assert (p.pid, p.usedGpuMemory, p.gpuInstanceId) == (7, 30, 0xFFFFFFFF)
    assert lib.nvmlDeviceGetUUID(h) == "GPU-a"
    assert lib.nvmlDeviceGetPowerUsage(h) == 70_000  # mW


def test_energy_counter_grows_as_power_times_time() -> None:
    clock = Clock()
    lib = fake_node(1, clock=clock, busy=False)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    e0 = lib.nvmlDeviceGetTotalEnergyConsumption(h)
    clock.t += 10
    lib.update(0, power_w=300.0)  # 10 s at 70 W, then 300 W
    clock.t += 5
    assert lib.nvmlDeviceGetTotalEnergyConsumption(h) - e0 == 10 * 70_000 + 5 * 300_000


def test_gpm_metrics_are_window_averages() -> None:
    clock = Clock()
    lib = fake_node(1, clock=clock)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    s1, s2 = lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()
    assert isinstance(s1, pynvml.c_nvmlGpmSample_t)
    lib.nvmlGpmSampleGet(h, s1)
    clock.t += 1
    lib.update(0, gpm={GPM_SM_UTIL: 10.0})  # 1 s at 90 %, 1 s at 10 %; DRAM no longer reported
    clock.t += 1
    lib.nvmlGpmSampleGet(h, s2)
    (sm_rc, sm), (dram_rc, dram), (other_rc, _) = _metrics(lib, s1, s2, [GPM_SM_UTIL, GPM_DRAM_BW_UTIL, 99])
    assert sm_rc == 0 and sm == pytest.approx(50.0)
    assert dram_rc == 0 and dram == pytest.approx(20.0)  # 40 % for half the window
    assert other_rc == pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _metrics(lib, s2, s1, [GPM_SM_UTIL])  # samples in the wrong order


def test_gpm_unsupported_before_hopper() -> None:
    lib = fake_node(1, gpm=False)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlGpmSampleGet(h, lib.nvmlGpmSampleAlloc())


def test_missing_unsupported_and_lost() -> None:
    scenario = Scenario.node(2, unsupported=frozenset({"nvmlDeviceGetTotalEnergyConsumption"}))
    scenario.missing_functions = frozenset({"nvmlDeviceGetComputeRunningProcesses_v3"})
    scenario.gpus[1].lost_after_calls = 2
    lib = FakeNvml(scenario)
    lib.nvmlInit()
    h0, h1 = lib.nvmlDeviceGetHandleByIndex(0), lib.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        lib.nvmlDeviceGetComputeRunningProcesses_v3(h0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetTotalEnergyConsumption(h0)
    lib.nvmlDeviceGetPowerUsage(h1)
    lib.nvmlDeviceGetPowerUsage(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlDeviceGetPowerUsage(h1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lib.nvmlDeviceGetHandleByIndex(1)
    assert lib.nvmlDeviceGetPowerUsage(h0) > 0  # the other GPU is fine
    lib.revive(1)
    assert lib.nvmlDeviceGetPowerUsage(lib.nvmlDeviceGetHandleByUUID(scenario.gpus[1].uuid)) > 0
    assert lib.calls["nvmlDeviceGetPowerUsage"] == 5


def test_mig_layout_and_events() -> None:
    gpu = FakeGpu("GPU-m", mig=[FakeMigInstance(1, "3g.40gb"), FakeMigInstance(2, "1g.10gb", compute_instances=(0, 1))],
                  processes=[FakeProcess(5, 10, gpu_instance=2, compute_instance=1)])
    lib = FakeNvml(Scenario([gpu]))
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    assert lib.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    handles = [lib.nvmlDeviceGetMigDeviceHandleByIndex(h, i) for i in range(3)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 3)
    assert [lib.nvmlDeviceGetGpuInstanceId(m) for m in handles] == [1, 2, 2]
    assert lib.nvmlDeviceGetName(handles[0]) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetPowerUsage(handles[0])  # device-level values exist only on the parent
    assert [p.pid for p in lib.nvmlDeviceGetComputeRunningProcesses(handles[1])] == [5]
    assert lib.nvmlDeviceGetComputeRunningProcesses(handles[0]) == []
    es = lib.nvmlEventSetCreate()
    lib.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    lib.inject_xid(0, 48)
    ev = lib.nvmlEventSetWait_v2(es, 0)
    assert (ev.eventData, ev.device) == (48, h)
    with pytest.raises(pynvml.NVMLError_Timeout):
        lib.nvmlEventSetWait_v2(es, 0)


def test_gpm_sample_is_a_real_ctypes_pointer() -> None:
    lib = fake_node(1)
    lib.nvmlInit()
    s = lib.nvmlGpmSampleAlloc()
    assert ctypes.cast(s, ctypes.c_void_p).value is not None
    lib.nvmlGpmSampleFree(s)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        lib.nvmlGpmSampleGet(lib.nvmlDeviceGetHandleByIndex(0), s)


def _fake_functions() -> dict[str, object]:
    return {n: getattr(FakeNvml, n) for n in dir(FakeNvml) if n.startswith("nvml") and callable(getattr(FakeNvml, n))}


def test_contract_fake_functions_match_installed_pynvml() -> None:
    """Every function the fake offers exists in the installed nvidia-ml-py with the same parameters (names,
    order, defaults), so a pynvml release that renames, removes or re-signs one fails here."""
    import inspect

    problems = []
    for name, fn in sorted(_fake_functions().items()):
        real = getattr(pynvml, name, None)
        if real is None or not callable(real):
            problems.append(f"{name}: not in pynvml {pynvml.__name__}")
            continue
        fake_params = list(inspect.signature(fn).parameters.values())[1:]  # without self
        real_params = list(inspect.signature(real).parameters.values())
        shape = [(p.name, p.kind, p.default) for p in fake_params]
        want = [(p.name, p.kind, p.default) for p in real_params]
        if shape != want:
            problems.append(f"{name}: fake {shape} != pynvml {want}")
        # Unversioned wrappers pynvml guards with throwOnVersionMismatch must be guarded in the fake too.
        real_throws = real.__code__.co_qualname.startswith("throwOnVersionMismatch.")
        if real_throws != getattr(fn, "throws_on_version_mismatch", False):
            problems.append(f"{name}: pynvml and the fake disagree on raising NVMLLibraryMismatchError")
    assert not problems, "\n".join(problems)


def test_contract_source_uses_only_what_the_fake_and_pynvml_have() -> None:
    """Every nvml* name the NVML source calls is implemented by the fake and exists in pynvml."""
    import re
    from pathlib import Path

    import gpuledger.agent.sources.nvml as mod

    text = Path(mod.__file__).read_text()
    used = set(re.findall(r'"(nvml[A-Z][A-Za-z0-9_]*)', text)) | set(re.findall(r"lib\.(nvml[A-Z][A-Za-z0-9_]*)", text))
    symbols_only = {"nvmlDeviceGetMemoryInfo_v2"}  # a C symbol pynvml looks up inside nvmlDeviceGetMemoryInfo
    fake = _fake_functions()
    assert used, "no NVML names found in the source"
    assert sorted(n for n in used - symbols_only if n not in fake) == []
    assert sorted(n for n in used - symbols_only if not callable(getattr(pynvml, n, None))) == []


def test_strict_fake_answers_as_pynvml_and_nvml_h() -> None:
    scenario = Scenario([FakeGpu("GPU-a", mig=[FakeMigInstance(1)])], root=False)
    scenario.missing_functions = frozenset({"nvmlDeviceGetMPSComputeRunningProcesses_v3"})
    lib = FakeNvml(scenario)
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        lib.nvmlDeviceGetMPSComputeRunningProcesses(h)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        lib.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetRemappedRows(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        lib.nvmlDeviceGetUtilizationRates(h)
    assert lib.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    mh = lib.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert lib.nvmlDeviceGetMemoryInfo(mh, pynvml.nvmlMemory_v2).version == pynvml.nvmlMemory_v2
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # a missing symbol fails at the call
        lib.nvmlDeviceGetMPSComputeRunningProcesses_v3(mh)
    with pytest.raises(AttributeError):  # real functions the fake lacks are never reachable through it
        _ = lib.nvmlDeviceGetFanSpeed


def test_gpm_can_return_nan() -> None:
    import math

    clock = [100.0]
    lib = fake_node(1, clock=lambda: clock[0])
    lib.update(0, gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: math.nan})
    lib.nvmlInit()
    h = lib.nvmlDeviceGetHandleByIndex(0)
    a, b = lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()
    lib.nvmlGpmSampleGet(h, a)
    clock[0] += 1.0
    lib.nvmlGpmSampleGet(h, b)
    req = pynvml.c_nvmlGpmMetricsGet_t()
    req.version, req.numMetrics, req.sample1, req.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 1, a, b
    req.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    lib.nvmlGpmMetricsGet(req)
    assert req.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS and math.isnan(req.metrics[0].value)
