"""NvmlSource against the fake NVML library (and, under ``-m gpu``, the real driver)."""

from __future__ import annotations

import logging

import pynvml
import pytest
from nvml_fake import (
    MIB,
    FakeGpu,
    FakeMigInstance,
    FakeNvml,
    FakeProcess,
    Scenario,
    busy_gpm,
    fake_node,
)

from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.base import GpuSource, SourceUnavailable
from gpuledger.agent.sources.nvml import GPM_FIELDS, NvmlSource
from gpuledger.schema.records import RATIO_FIELDS, GpuProcess


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _open(lib: FakeNvml, clock: Clock, **kw) -> NvmlSource:
    src = NvmlSource(lib=lib, host="node1", clock=clock, **kw)
    src.open()
    return src


def test_converts_every_field_to_si_units() -> None:
    clock = Clock()
    gpu = FakeGpu("GPU-x", mem_total=81559 * MIB, mem_used=74166 * MIB, power_w=113.611, power_limit_w=72.0,
                  energy_mj=4742776,
                  gpu_util=87, mem_util=35, temp_c=31, sm_clock_mhz=1980, mem_clock_mhz=2619, clock_reasons=0x4,
                  ecc_uncorrected=2, remapped_rows=(3, 1, 0, 0), pcie_tx_kbps=1000, pcie_rx_kbps=2,
                  gpm=busy_gpm(sm=80, occ=30, dram=60, tensor=50, fp64=1, fp32=20, fp16=3),
                  processes=[FakeProcess(42, 1 * MIB), FakeProcess(43, None)])
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    src = _open(lib, clock)
    assert isinstance(src, GpuSource)
    (first,) = src.sample()
    assert first.sm_active_ratio is None  # the first tick has no GPM window yet
    clock.t += 2.0
    (s,) = src.sample()
    assert (s.host, s.gpu_uuid, s.gpu_index, s.model, s.mig, s.source) == (
        "node1", "GPU-x", 0, "NVIDIA H100 80GB HBM3", None, "nvml")
    assert s.ts == 1002.0
    assert s.gpu_util_ratio == pytest.approx(0.87) and s.mem_copy_util_ratio == pytest.approx(0.35)
    assert (s.mem_used_bytes, s.mem_total_bytes) == (74166 * MIB, 81559 * MIB)
    assert s.power_watts == pytest.approx(113.611)
    assert s.power_limit_watts == 72.0  # mW -> W: the collector's bound on each energy-counter step
    assert s.energy_joules == pytest.approx(4742.776 + 2 * 113.611, abs=1e-3)  # mJ -> J, grown over 2 s
    assert s.temp_celsius == 31.0
    assert (s.sm_clock_hz, s.mem_clock_hz) == (1.98e9, 2.619e9)
    assert (s.throttle_reasons, s.ecc_errors_total, s.remapped_rows_total) == (4, 2, 4)
    assert (s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second) == (1024_000.0, 2048.0)
    assert s.processes == (GpuProcess(42, 1 * MIB), GpuProcess(43, None))
    assert s.sm_active_ratio == pytest.approx(0.80)
    assert s.sm_occupancy_ratio == pytest.approx(0.30)
    assert s.dram_bw_ratio == pytest.approx(0.60)
    assert s.tensor_active_ratio == pytest.approx(0.50)
    assert (s.fp64_active_ratio, s.fp32_active_ratio, s.fp16_active_ratio) == pytest.approx((0.01, 0.20, 0.03))
    assert s == type(s).from_dict(s.to_dict())


def test_gpm_window_spans_ticks_and_needs_100ms() -> None:
    clock = Clock()
    lib = fake_node(1, clock=clock)
    src = _open(lib, clock)
    src.sample()
    clock.t += 0.05
    (too_soon,) = src.sample()
    assert too_soon.sm_active_ratio is None  # < 100 ms: no reading, and the window start is kept
    clock.t += 0.95
    lib.update(0, gpm={2: 30.0})  # SM 90 % for the first 1.0 s, then 30 %; DRAM drops to nothing
    clock.t += 1.0
    (s,) = src.sample()
    assert s.sm_active_ratio == pytest.approx(0.60)  # averaged over the 2 s since the first tick
    assert s.dram_bw_ratio == pytest.approx(0.20)  # 40 % for half the window
    clock.t += 1.0
    (s2,) = src.sample()
    assert s2.sm_active_ratio == pytest.approx(0.30)
    assert s2.dram_bw_ratio == 0.0
    assert lib.calls["nvmlGpmSampleAlloc"] == 2  # buffers are reused, not re-allocated per tick


def test_no_gpm_before_hopper_and_gpm_switch() -> None:
    clock = Clock()
    lib = fake_node(2, clock=clock, gpm=False)
    src = _open(lib, clock)
    for _ in range(3):
        clock.t += 1
        assert all(s.sm_active_ratio is None and s.gpu_util_ratio == 1.0 for s in src.sample())
    assert lib.calls["nvmlGpmSampleGet"] == 0 and lib.calls["nvmlGpmQueryDeviceSupport"] == 2
    lib2 = fake_node(1, clock=clock)
    src2 = _open(lib2, clock, gpm=False)
    src2.sample()
    assert lib2.calls["nvmlGpmQueryDeviceSupport"] == 0


def test_unsupported_function_is_none_called_once_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    scenario = Scenario.node(2, unsupported=frozenset({"nvmlDeviceGetTotalEnergyConsumption",
                                                        "nvmlDeviceGetRemappedRows"}))
    lib = FakeNvml(scenario, clock=clock)
    src = _open(lib, clock)
    caplog.set_level(logging.INFO, logger="gpuledger.agent.sources")
    for _ in range(5):
        clock.t += 1
        samples = src.sample()
        assert len(samples) == 2
        assert all(s.energy_joules is None and s.remapped_rows_total is None for s in samples)
        assert all(s.power_watts == 450.0 for s in samples)
    assert lib.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2  # once per GPU, never again
    assert lib.calls["nvmlDeviceGetRemappedRows"] == 2
    lines = [r.getMessage() for r in caplog.records if "nvmlDeviceGetTotalEnergyConsumption" in r.getMessage()]
    assert len(lines) == 2  # one line per GPU, not per tick
    # Counted once per GPU and field, with the reason.
    assert src.health.unavailable == {("energy_joules", "not_supported"): 2,
                                      ("remapped_rows_total", "not_supported"): 2}


def test_versioned_functions_are_probed_once() -> None:
    clock = Clock()
    scenario = Scenario.node(3)
    scenario.missing_functions = frozenset({"nvmlDeviceGetComputeRunningProcesses_v3",
                                            "nvmlDeviceGetCurrentClocksEventReasons"})
    lib = FakeNvml(scenario, clock=clock)
    src = _open(lib, clock)
    for _ in range(4):
        clock.t += 1
        samples = src.sample()
    assert [s.pids for s in samples] == [(10000,), (10001,), (10002,)]
    assert all(s.throttle_reasons == 0 for s in samples)
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1  # probed once, for the whole source
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 12
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses"] == 0
    assert lib.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 12


def test_function_absent_from_old_bindings_is_missing() -> None:
    clock = Clock()

    class OldBindings:
        """An nvidia-ml-py that predates GPM and _v3: attribute access fails as on an old module."""

        def __init__(self, lib: FakeNvml) -> None:
            self._lib = lib

        def __getattr__(self, name: str):
            if name.startswith("nvmlGpm") or name.endswith("_v3"):
                raise AttributeError(name)
            return getattr(self._lib, name)

    lib = fake_node(1, clock=clock)
    src = _open(OldBindings(lib), clock)  # type: ignore[arg-type]
    src.sample()
    clock.t += 1
    (s,) = src.sample()
    assert s.sm_active_ratio is None and s.pids == (10000,)
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2


def test_lost_gpu_others_keep_sampling_then_reopened(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    scenario = Scenario.node(3)
    lib = FakeNvml(scenario, clock=clock)
    src = _open(lib, clock, reopen_backoff_s=(30.0, 120.0))
    assert len(src.sample()) == 3
    caplog.set_level(logging.INFO, logger="gpuledger.agent.sources.nvml")
    lib.lose(1)
    clock.t += 1
    samples = src.sample()
    assert [s.gpu_index for s in samples] == [0, 2]
    assert src.lost_gpus == (scenario.gpus[1].uuid,) and src.gpu_lost_total == 1
    assert any("is lost" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    calls = lib.calls["nvmlDeviceGetHandleByUUID"]
    clock.t += 10
    assert len(src.sample()) == 2
    assert lib.calls["nvmlDeviceGetHandleByUUID"] == calls  # backoff: no re-open attempt yet
    clock.t += 25
    assert len(src.sample()) == 2  # tried once, still lost; backoff doubles to 60 s
    assert lib.calls["nvmlDeviceGetHandleByUUID"] == calls + 1
    lib.revive(1)
    clock.t += 30
    assert len(src.sample()) == 2  # 30 s < 60 s backoff
    clock.t += 31
    samples = src.sample()
    assert [s.gpu_index for s in samples] == [0, 1, 2]
    assert src.lost_gpus == () and src.gpu_lost_total == 1
    assert samples[1].sm_active_ratio is None  # GPM starts a fresh window after the re-open
    clock.t += 1
    assert src.sample()[1].sm_active_ratio == pytest.approx(0.9)


def test_gpu_lost_after_n_calls_mid_cycle() -> None:
    clock = Clock()
    scenario = Scenario.node(2)
    scenario.gpus[0].lost_after_calls = 12  # dies in the middle of its first cycle's reads
    lib = FakeNvml(scenario, clock=clock)
    src = _open(lib, clock)
    samples = src.sample()
    assert [s.gpu_index for s in samples] == [1]
    assert src.lost_gpus == (scenario.gpus[0].uuid,)


def test_lost_at_open_is_retried_by_index() -> None:
    clock = Clock()
    lib = fake_node(2, clock=clock)
    lib.lose(0)
    src = _open(lib, clock, reopen_backoff_s=(5.0, 5.0))
    assert src.lost_gpus == ("index 0",)
    assert [s.gpu_index for s in src.sample()] == [1]
    lib.revive(0)
    clock.t += 6
    assert [s.gpu_index for s in src.sample()] == [0, 1]


def test_xid_events_polled_without_blocking() -> None:
    clock = Clock()
    lib = fake_node(2, clock=clock)
    src = _open(lib, clock, reopen_backoff_s=(60.0, 60.0))
    lib.inject_xid(1, 13)
    lib.inject_xid(1, 31)
    samples = src.sample()
    assert [s.xid_errors for s in samples] == [(), (13, 31)]
    clock.t += 1
    assert [s.xid_errors for s in src.sample()] == [(), ()]  # reported once
    assert lib.event_wait_timeouts and set(lib.event_wait_timeouts) == {0}
    lib.inject_xid(0, 79)  # fell off the bus
    clock.t += 1
    assert [s.gpu_index for s in src.sample()] == [1]
    assert src.lost_gpus == (lib.scenario.gpus[0].uuid,)


class LostMidTick(FakeNvml):
    """A GPU that falls off the bus after this tick's events were read: its first call of the tick answers
    GPU_IS_LOST (``lose_next_tick``: its index)."""

    lose_next_tick: int | None = None

    def nvmlDeviceGetMigMode(self, device):  # the first call sample() makes on each GPU
        if device.gpu == self.lose_next_tick:
            self.lose(device.gpu)
        return super().nvmlDeviceGetMigMode(device)


def test_xids_of_a_lost_gpu_are_held_for_its_sample_after_the_reopen_and_79_is_one() -> None:
    clock = Clock()
    lib = LostMidTick(Scenario.node(2), clock=clock)
    src = _open(lib, clock, reopen_backoff_s=(30.0, 30.0))
    src.sample()
    uuids = [g.uuid for g in lib.scenario.gpus]
    lib.inject_xid(1, 48)  # read by this tick's poll; the GPU is lost before its sample
    lib.lose_next_tick = 1
    clock.t += 1
    assert [s.gpu_index for s in src.sample()] == [0]
    lib.inject_xid(0, 48)  # a DBE, then the GPU falls off the bus: both in one poll
    lib.inject_xid(0, 79)
    clock.t += 1
    assert src.sample() == [] and src.gpu_lost_total == 2
    # Held, not dropped: what the agent counts at once (agent.sampler) while the GPUs are lost.
    assert sorted(src.held_xids()) == [(("node1", 0, uuids[0], ""), "NVIDIA H100 80GB HBM3", 2),
                                       (("node1", 1, uuids[1], ""), "NVIDIA H100 80GB HBM3", 1)]
    lib.lose_next_tick = None
    lib.revive(0)
    lib.revive(1)
    clock.t += 30
    assert [(s.gpu_index, s.xid_errors) for s in src.sample()] == [(0, (48, 79)), (1, (48,))]  # after the re-open
    assert src.held_xids() == []
    clock.t += 1
    assert [s.xid_errors for s in src.sample()] == [(), ()]  # once


def test_a_wall_clock_step_back_stops_neither_gpm_nor_a_reopen() -> None:
    """NTP steps the wall clock back an hour: GPM's 100 ms spacing and the re-open backoff are timed by the
    monotonic clock, so GPM values keep coming and a lost GPU is retried on time; samples keep the wall clock."""
    wall, mono = Clock(1_700_000_000.0), Clock(50.0)
    lib = FakeNvml(Scenario.node(2), clock=mono)  # the GPU's counters follow real (monotonic) time
    src = _open(lib, wall, monotonic=mono, reopen_backoff_s=(30.0, 30.0))

    def tick(dt: float = 10.0) -> list:
        wall.t += dt
        mono.t += dt
        return src.sample()

    tick()
    lib.lose(1)
    assert [s.gpu_index for s in tick()] == [0]
    wall.t -= 3600.0
    lib.revive(1)
    (s,) = tick()  # 10 s of monotonic time since the loss: not yet retried
    assert s.sm_active_ratio == pytest.approx(0.9) and s.ts == wall.t
    samples = tick(20.0)  # 30 s since the loss: re-opened
    assert [s.gpu_index for s in samples] == [0, 1] and samples[0].sm_active_ratio == pytest.approx(0.9)


def test_failed_reads_are_counted_by_field_and_a_gpu_without_gpm_is_unavailable() -> None:
    """A transient NVML error and a binding bug each cost their field that tick and are counted per field, every
    time (a permanent cause is counted once, in ``health``); a GPU without GPM lacks every GPM field."""
    clock = Clock()

    class PowerBug(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):  # a binding bug on GPU 1 only (e.g. a ctypes TypeError)
            if handle.gpu == 1:
                raise TypeError("bad ctypes argument")
            return super().nvmlDeviceGetPowerUsage(handle)

    scenario = Scenario.node(3)
    scenario.gpus[2].gpm = None  # GPM unsupported (isSupportedDevice 0), as before Hopper
    lib = PowerBug(scenario, clock=clock)
    src = _open(lib, clock)
    for _ in range(4):
        lib.fail_next("nvmlDeviceGetTotalEnergyConsumption")  # GPU 0's read, each tick
        lib.fail_next("nvmlGpmSampleGet")  # GPU 0's GPM sample, each tick
        clock.t += 1
        a, b, _ = samples = src.sample()
        assert (a.energy_joules, a.power_watts, a.sm_active_ratio) == (None, 450.0, None)
        assert b.power_watts is None and b.energy_joules is not None
    assert src.call_errors_total == {"energy_joules": 4, "power_watts": 4,
                                     **{f: 4 for f in GPM_FIELDS}}  # a GPM sample fills every GPM field
    assert src.errors_total == 4  # the binding bug's
    assert src.health.unavailable == {(f, "not_supported"): 1 for f in GPM_FIELDS}  # GPU 2, once
    assert samples[2].sm_active_ratio is None and samples[1].sm_active_ratio == pytest.approx(0.9)


def test_mig_one_sample_per_gpu_instance_power_once() -> None:
    clock = Clock()
    mig_gpu = FakeGpu(
        "GPU-mig", name="NVIDIA A100-SXM4-80GB", power_w=200.0,
        mig=[FakeMigInstance(1, "3g.40gb", mem_total=40 * 1024 * MIB, mem_used=10 * MIB, gpm=busy_gpm(sm=70)),
             FakeMigInstance(2, "1g.10gb", mem_used=5 * MIB, gpm=busy_gpm(sm=20), compute_instances=(0, 1))],
        processes=[FakeProcess(100, 10 * MIB, gpu_instance=1, compute_instance=0),
                   FakeProcess(200, 2 * MIB, gpu_instance=2, compute_instance=0),
                   FakeProcess(201, 3 * MIB, gpu_instance=2, compute_instance=1)],
        gpm=busy_gpm(sm=45),
    )
    plain = FakeGpu("GPU-plain", processes=[FakeProcess(300, MIB)])
    lib = FakeNvml(Scenario([mig_gpu, plain]), clock=clock)
    src = _open(lib, clock)
    src.sample()
    clock.t += 1
    samples = src.sample()
    assert [(s.gpu_uuid, s.mig) for s in samples] == [("GPU-mig", None), ("GPU-mig", "1"), ("GPU-mig", "2"),
                                                      ("GPU-plain", None)]
    parent, gi1, gi2, other = samples
    assert parent.power_watts == 200.0 and parent.energy_joules is not None
    assert gi1.power_watts is None and gi2.energy_joules is None  # never counted twice
    assert parent.gpu_util_ratio is None  # utilisation rates do not exist in MIG mode
    assert parent.pids == () and gi1.pids == (100,) and gi2.pids == (200, 201)
    assert gi1.model == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert (gi1.mem_used_bytes, gi1.mem_total_bytes) == (10 * MIB, 40 * 1024 * MIB)
    assert (parent.sm_active_ratio, gi1.sm_active_ratio, gi2.sm_active_ratio) == pytest.approx((0.45, 0.70, 0.20))
    assert other.pids == (300,) and other.mig is None
    assert lib.calls["nvmlDeviceGetUtilizationRates"] == 2  # only the non-MIG GPU is asked


@pytest.mark.parametrize("call", ["nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
                                  "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetUUID"])
def test_a_transient_error_reading_the_mig_layout_keeps_the_last_one(call, caplog) -> None:
    # One NVML_ERROR_UNKNOWN while reading the MIG mode or layout is not "MIG turned off" nor "instance gone":
    # the instances stay, with their processes and GPM windows; the whole GPU never takes their processes.
    clock = Clock()
    gpu = FakeGpu("GPU-a", gpm=busy_gpm(), mig=[FakeMigInstance(1, "3g.40gb", gpm=busy_gpm(sm=50)),
                                                FakeMigInstance(2, "4g.40gb", gpm=busy_gpm(sm=20))],
                  processes=[FakeProcess(11, MIB, gpu_instance=1), FakeProcess(12, MIB, gpu_instance=2)])
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    src = _open(lib, clock)
    src.sample()
    clock.t += 1

    def layout(samples):
        return [(s.mig, s.pids, s.sm_active_ratio) for s in samples]

    steady = layout(src.sample())
    assert steady == [(None, (), pytest.approx(0.9)), ("1", (11,), pytest.approx(0.5)),
                      ("2", (12,), pytest.approx(0.2))]
    lib.fail_next(call)
    clock.t += 1
    assert layout(src.sample()) == steady
    clock.t += 1
    assert layout(src.sample()) == steady  # and after it: GPM windows kept, nothing re-learnt
    assert not any("MIG mode turned" in r.getMessage() for r in caplog.records)
    assert src.call_errors_total == {"": 1}  # counted once, as a call that fills no field
    lib.update(0, mig=None)  # MIG really turned off: seen at once
    clock.t += 1
    assert [s.mig for s in src.sample()] == [None]
    assert any("MIG mode turned off" in r.getMessage() for r in caplog.records)


def test_open_fails_cleanly_without_driver() -> None:
    lib = FakeNvml(Scenario([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(SourceUnavailable, match="libnvidia-ml.so.1 not found"):
        NvmlSource(lib=lib).open()


def test_real_pynvml_without_gpu_is_unavailable() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    with pytest.raises(SourceUnavailable, match="nvml: nvmlInit failed"):
        NvmlSource().open()


def test_one_broken_gpu_does_not_break_the_cycle() -> None:
    clock = Clock()

    class Broken(FakeNvml):
        def nvmlDeviceGetRemappedRows(self, device):  # a binding bug: not an NVMLError
            if device.gpu == 0:
                raise ValueError("garbled struct")
            return super().nvmlDeviceGetRemappedRows(device)

    lib = Broken(Scenario.node(2), clock=clock)
    src = _open(lib, clock)
    a, b = src.sample()  # degrade per field: GPU 0 loses only the field whose call broke
    assert (a.gpu_index, a.remapped_rows_total, a.power_watts) == (0, None, 450.0)
    assert b.remapped_rows_total == 0
    assert src.errors_total == 1 and src.lost_gpus == ()


@pytest.mark.gpu
def test_contract_on_real_driver() -> None:
    src = NvmlSource()
    try:
        src.open()
    except SourceUnavailable as exc:
        pytest.skip(str(exc))
    try:
        src.sample()
        import time

        time.sleep(0.3)
        samples = src.sample()
        opened = len(src._gpus) - len(src.lost_gpus)
    finally:
        src.close()
    assert samples and all(s.gpu_uuid.startswith("GPU-") for s in samples)
    # Degrade per field on the real driver: every GPU has its sample, no call failed outside NVML's codes,
    # and every unavailable field names a known reason.
    assert len({s.gpu_uuid for s in samples if s.mig is None}) == opened
    assert src.errors_total == 0
    reasons = {"function_not_found", "library_mismatch", "not_supported", "no_permission"}
    assert {r for _, r in src.health.unavailable} <= reasons
    for s in samples:
        for f in RATIO_FIELDS:
            v = getattr(s, f)
            assert v is None or 0.0 <= v <= 1.0
        assert s.power_watts is None or s.power_watts > 0
        assert s.mem_total_bytes is None or s.mem_total_bytes > 0


def test_gpu_check_script_fails_clearly_without_gpu() -> None:
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed; the script would run its 60 s check")
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "PyTorch is not installed" in r.stderr


class GarbledAfterReopen(FakeNvml):
    """Binding bugs at the boundary: with ``garble`` set to an index, that GPU's remapped rows come back garbled
    (its sampling raises outside any one call); with ``bad_uuid``, its UUID call raises a non-NVML error."""

    garble: int | None = None
    bad_uuid: int | None = None

    def nvmlDeviceGetRemappedRows(self, device):
        if device.gpu == self.garble:
            return ("garbled", "struct", 0, 0)
        return super().nvmlDeviceGetRemappedRows(device)

    def nvmlDeviceGetUUID(self, handle):
        if getattr(handle, "gpu", None) == self.bad_uuid:
            raise TypeError("binding bug")
        return super().nvmlDeviceGetUUID(handle)


def test_xids_of_a_gpu_whose_sampling_failed_stay_counted_and_are_sent_once() -> None:
    """GPU 1 falls off the bus (Xid 79, held while lost); after its re-open its sampling raises for a tick, then
    works. The agent's Xid count never steps back and counts 79 once; the Xid goes out in the sample after."""
    clock = Clock()
    lib = GarbledAfterReopen(Scenario.node(2), clock=clock)
    agent = Agent(NvmlSource(lib=lib, host="node1", clock=clock, reopen_backoff_s=(30.0, 30.0)))
    agent.open()
    agent.tick()
    key = ("node1", 1, lib.scenario.gpus[1].uuid, "")
    lib.inject_xid(1, 79)
    clock.t += 1
    agent.tick()
    assert agent.xid_errors_total == {key: 1}  # held while lost
    lib.revive(1)
    lib.garble = 1
    clock.t += 30
    assert [s.gpu_index for s in agent.tick()] == [0]  # re-opened, its sampling raised
    assert agent.xid_errors_total == {key: 1}
    lib.garble = None
    clock.t += 1
    assert [s.xid_errors for s in agent.tick()] == [(), (79,)]
    assert agent.xid_errors_total == {key: 1}


def test_pending_xids_are_capped_and_the_rest_still_counted() -> None:
    """GPU 0's sampling raises tick after tick while Xids keep coming: at most 64 wait for its sample, the rest
    are counted (held_xids), so the agent's count is every Xid read, and it never steps back."""
    clock = Clock()
    lib = GarbledAfterReopen(Scenario.node(1), clock=clock)
    src = NvmlSource(lib=lib, host="node1", clock=clock)
    agent = Agent(src)
    agent.open()
    lib.garble = 0
    key = ("node1", 0, lib.scenario.gpus[0].uuid, "")
    counts = []
    for _ in range(5):  # 5 x 40 Xids, read 64 a tick at most
        for _ in range(40):
            lib.inject_xid(0, 13)
        clock.t += 1
        assert agent.tick() == []
        counts.append(agent.xid_errors_total[key])
    lib.garble = None
    sent = []
    for _ in range(3):
        clock.t += 1
        (s,) = agent.tick()
        sent.append(len(s.xid_errors))
        counts.append(agent.xid_errors_total[key])
    assert counts == [40, 80, 120, 160, 200, 200, 200, 200]
    assert sent == [64, 0, 0]
    assert src.held_xids() == [(key, "NVIDIA H100 80GB HBM3", 136)]  # the rest: counted, never sent


def test_a_non_nvml_error_attaching_a_gpu_costs_only_that_gpu() -> None:
    """A binding bug (TypeError) identifying GPU 1, at open and at every re-open: the other GPU is sampled every
    tick, the error is counted, and GPU 1 is lost and retried with backoff."""
    clock = Clock()
    lib = GarbledAfterReopen(Scenario.node(2), clock=clock)
    lib.bad_uuid = 1
    src = _open(lib, clock, reopen_backoff_s=(30.0, 30.0))
    assert src.lost_gpus == ("index 1",) and src.errors_total == 1
    for _ in range(3):
        clock.t += 31
        assert [s.gpu_index for s in src.sample()] == [0]
    assert src.errors_total == 4
    lib.bad_uuid = None
    clock.t += 31
    assert [s.gpu_index for s in src.sample()] == [0, 1]
    # and a GPU opened well, lost, then failing its re-open the same way
    lib.lose(0)
    clock.t += 1
    assert [s.gpu_index for s in src.sample()] == [1]
    lib.revive(0)
    lib.bad_uuid = 0
    clock.t += 31
    assert [s.gpu_index for s in src.sample()] == [1] and src.errors_total == 5


def test_each_process_carries_the_share_of_the_interval_its_kernels_ran() -> None:
    """nvmlDeviceGetProcessUtilization since the GPU's last answer: a process's smUtil summed over the driver's
    sample periods, over the periods; listed without a sample: it ran none; no new period: unknown."""
    clock = Clock()
    gpu = FakeGpu("GPU-shared", processes=[FakeProcess(42, 1 * MIB, sm_util=60), FakeProcess(43, 30_000 * MIB,
                                                                                            sm_util=20),
                                           FakeProcess(44, 5 * MIB, mps=True, sm_util=15), FakeProcess(45, 7 * MIB)])
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    src = _open(lib, clock)
    src.sample()  # the driver's whole buffer: the ratios of the periods before it
    clock.t += 1.0
    (s,) = src.sample()
    by_pid = {p.pid: p for p in s.processes}
    assert {pid: p.gpu_util_ratio for pid, p in by_pid.items()} == pytest.approx({42: 0.6, 43: 0.2, 44: 0.15,
                                                                                  45: 0.0})
    assert by_pid[43].used_memory_bytes == 30_000 * MIB
    # one process busier for half of the next second: the ratio is the interval's average
    clock.t += 0.5
    lib.update(0, processes=[FakeProcess(42, 1 * MIB, sm_util=100), *gpu.processes[1:]])
    clock.t += 0.5
    (s,) = src.sample()
    assert s.processes[0].gpu_util_ratio == pytest.approx(0.8, abs=0.07)  # 3 periods at 60, 3 at 100
    # no period closed since (the agent ticked faster than the driver samples): unknown, and no failure counted
    (s,) = src.sample()
    assert [p.gpu_util_ratio for p in s.processes] == [None] * 4
    assert src.errors_total == 0 and not src.call_errors_total
    # nobody ran a kernel: the driver answers NOT_FOUND, and so it is unknown, not a reason to stop asking
    lib.update(0, processes=[FakeProcess(42, 1 * MIB)])
    clock.t += 1.0
    (s,) = src.sample()
    assert s.processes == (GpuProcess(42, 1 * MIB, None),)
    lib.update(0, processes=[FakeProcess(42, 1 * MIB, sm_util=50)])
    clock.t += 1.0
    (s,) = src.sample()
    assert s.processes == (GpuProcess(42, 1 * MIB, pytest.approx(0.5)),)
    assert s == type(s).from_dict(s.to_dict())


def test_per_process_utilization_unknown_under_mig_or_an_older_driver() -> None:
    clock = Clock()
    # an older driver: the function is missing; asked once for the whole source, the processes still listed
    lib = fake_node(2, clock=clock)
    lib.scenario.missing_functions = frozenset({"nvmlDeviceGetProcessUtilization"})
    src = _open(lib, clock)
    for _ in range(3):
        clock.t += 1.0
        samples = src.sample()
        assert [p.gpu_util_ratio for s in samples for p in s.processes] == [None, None]
    assert lib.calls["nvmlDeviceGetProcessUtilization"] == 1
    assert src.errors_total == 0
    # MIG: not supported there, asked once per GPU; the instance's processes carry their memory, no time
    gpu = FakeGpu("GPU-mig", mig=[FakeMigInstance(1, "3g.40gb")],
                  processes=[FakeProcess(7, 2 * MIB, gpu_instance=1, compute_instance=0, sm_util=90)])
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    src = _open(lib, clock)
    for _ in range(2):
        clock.t += 1.0
        whole, inst = src.sample()
        assert inst.processes == (GpuProcess(7, 2 * MIB, None),)
    assert lib.calls["nvmlDeviceGetProcessUtilization"] == 0  # a MIG GPU's own sample lists no processes


def test_an_odd_per_process_utilization_answer_costs_the_ratios_not_the_gpu(caplog) -> None:
    clock = Clock()
    lib = fake_node(2, clock=clock)
    src = _open(lib, clock)
    lib.nvmlDeviceGetProcessUtilization = lambda handle, since: [object()]  # a binding answering garbage
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            clock.t += 1.0
            samples = src.sample()
            assert len(samples) == 2 and [p.gpu_util_ratio for s in samples for p in s.processes] == [None, None]
            assert all(s.power_watts for s in samples)
    assert src.errors_total == 4
    assert sum("nvmlDeviceGetProcessUtilization answered AttributeError" in r.getMessage()
               for r in caplog.records) == 2  # once a GPU
