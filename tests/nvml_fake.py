"""A fake of nvidia-ml-py's ``pynvml`` module, built from a declarative scenario.

This is a machine-boundary fake: it stands where the NVIDIA driver would, so the NVML source (and the
overhead bench) run without a GPU. It keeps the real module's function names, argument order, return
types (``c_nvmlMemory_t``, ``c_nvmlUtilization_t``, ``nvmlFriendlyObject`` processes, the ctypes GPM
structs) and -- most important -- the *same* ``NVMLError`` class hierarchy and codes, re-exported from the
installed ``pynvml``, so ``except pynvml.NVMLError_GpuIsLost`` catches what the fake raises.

Behaviour that the driver has and the fake models:

- a function the driver lacks raises ``NVML_ERROR_FUNCTION_NOT_FOUND`` when called (as pynvml does when
  the symbol is absent from ``libnvidia-ml.so``; ``missing_functions`` names C symbols, so
  ``nvmlDeviceGetMemoryInfo_v2`` is what ``nvmlDeviceGetMemoryInfo(h, version)`` needs), one the GPU does
  not support ``NVML_ERROR_NOT_SUPPORTED``;
- the unversioned wrappers pynvml decorates with ``throwOnVersionMismatch``
  (``nvmlDeviceGetComputeRunningProcesses``, ``nvmlDeviceGetMPSComputeRunningProcesses``) call ``_v3`` and turn
  its FUNCTION_NOT_FOUND into ``NVMLLibraryMismatchError`` -- not an ``NVMLError`` -- as pynvml does;
  ``nvmlEventSetWait`` is only an alias of ``nvmlEventSetWait_v2``, as in pynvml;
- MIG parents answer as ``nvml.h`` says: memory and process lists of the whole GPU need privileges
  (``NO_PERMISSION`` unless ``Scenario.root``), utilisation and remapped rows are ``NOT_SUPPORTED``, and
  ``nvmlDeviceGetMaxMigDeviceCount`` is 0 with MIG off;
- ``nvmlDeviceGetMemoryInfo(h)`` is the v1 struct, whose ``used`` includes the reserved memory;
  ``nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2)`` the v2 struct, ``used`` without it, as on a real driver;
- MPS clients are listed only by ``nvmlDeviceGetMPSComputeRunningProcesses*``;
- GPM values may be NaN (a scenario value ``float("nan")``), as the driver can return;
- ``nvmlEventSetWait_v2`` answers ``GPU_IS_LOST`` while a GPU registered in the set is lost, whatever
  other GPUs have queued (so a lost GPU can starve the others' events);
- a GPU lost after N calls on its handles raises ``NVML_ERROR_GPU_IS_LOST`` from then on (``revive()``
  brings it back, as a reset would);
- the energy counter (mJ) grows as power x time on the injected clock; GPM metrics are the time average of
  the scenario's values between two GPM samples (so changing a value mid-window is averaged, as on a GPU);
- MIG: device handles per compute instance, per-GPU-instance GPM, processes tagged with their instance;
- Xid events queued by ``inject_xid`` and returned by ``nvmlEventSetWait_v2`` (which never blocks);
- per-process utilization (``nvmlDeviceGetProcessUtilization``) as the driver keeps it: one sample per
  process and sample period (``UTIL_PERIOD_S``, the last ``UTIL_PERIODS_KEPT``), stamped in microseconds
  at the period's end, only for processes with a non-zero ``smUtil`` then (``update`` changes a process's from
  then on); ``NOT_FOUND`` when no such sample is newer than the timestamp asked for; ``NOT_SUPPORTED`` in MIG mode;
- ``calls`` counts calls per function name (for "probed once" and overhead tests).

Names not defined here (constants, ``NVMLError*`` classes, ctypes structs) come from the real module;
real *functions* are never reachable through the fake.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml as _real

NOT_IN_MIG = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId NVML reports for a process outside MIG

# The GPM metric ids (percent values) the fake knows by default; a GPU's ``gpm`` dict may hold any id.
GPM_SM_UTIL = _real.NVML_GPM_METRIC_SM_UTIL
GPM_SM_OCCUPANCY = _real.NVML_GPM_METRIC_SM_OCCUPANCY
GPM_DRAM_BW_UTIL = _real.NVML_GPM_METRIC_DRAM_BW_UTIL
GPM_ANY_TENSOR_UTIL = _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL
GPM_FP64_UTIL = _real.NVML_GPM_METRIC_FP64_UTIL
GPM_FP32_UTIL = _real.NVML_GPM_METRIC_FP32_UTIL
GPM_FP16_UTIL = _real.NVML_GPM_METRIC_FP16_UTIL

MIB = 1024 * 1024
UTIL_PERIOD_S = 1 / 6  # per-process utilization: one sample per process and period (the driver's own rate)
UTIL_PERIODS_KEPT = 30


def busy_gpm(sm: float = 90.0, occ: float = 45.0, dram: float = 40.0, tensor: float = 60.0,
             fp64: float = 0.0, fp32: float = 10.0, fp16: float = 5.0) -> dict[int, float]:
    """GPM metric values in percent, keyed by NVML metric id."""
    return {
        GPM_SM_UTIL: sm, GPM_SM_OCCUPANCY: occ, GPM_DRAM_BW_UTIL: dram, GPM_ANY_TENSOR_UTIL: tensor,
        GPM_FP64_UTIL: fp64, GPM_FP32_UTIL: fp32, GPM_FP16_UTIL: fp16,
    }


@dataclass
class FakeProcess:
    pid: int
    used_memory: int | None = None  # bytes; None = the driver cannot say (as under WDDM)
    gpu_instance: int | None = None  # MIG GPU instance id, None outside MIG
    compute_instance: int | None = None
    mps: bool = False  # an MPS client: listed only by nvmlDeviceGetMPSComputeRunningProcesses*
    sm_util: int = 0  # percent of each utilization sample period in which its kernels ran


@dataclass
class FakeMigInstance:
    """One MIG GPU instance (with one compute instance unless ``compute_instances`` says more)."""

    gi: int
    profile: str = "1g.10gb"
    mem_total: int = 9984 * MIB
    mem_used: int = 0
    gpm: dict[int, float] = field(default_factory=dict)  # metric id -> percent
    compute_instances: tuple[int, ...] = (0,)


@dataclass
class FakeGpu:
    """One physical GPU and what its driver would report. Units are NVML's own (MHz, KB/s, %)."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    mem_total: int = 81559 * MIB
    mem_used: int = 0  # bytes used by allocations (v2 ``used``); v1 ``used`` adds ``mem_reserved``
    mem_reserved: int = 0  # driver/firmware reserve (NVML v2 ``reserved``)
    power_w: float = 70.0
    power_limit_w: float = 700.0  # enforced
    energy_mj: float = 1.0e8  # counter value at the scenario's start
    gpu_util: int = 0
    mem_util: int = 0
    temp_c: int = 30
    sm_clock_mhz: int = 345
    mem_clock_mhz: int = 2619
    clock_reasons: int = 0x1
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    pcie_tx_kbps: int = 0
    pcie_rx_kbps: int = 0
    gpm: dict[int, float] | None = field(default_factory=dict)  # None: no GPM (pre-Hopper)
    mig: list[FakeMigInstance] | None = None  # None: MIG off
    processes: list[FakeProcess] = field(default_factory=list)
    unsupported: frozenset[str] = frozenset()  # function names answering NOT_SUPPORTED on this GPU
    lost_after_calls: int | None = None  # lost once this many calls were made on its handles


@dataclass
class Scenario:
    gpus: list[FakeGpu]
    missing_functions: frozenset[str] = frozenset()  # absent from the "driver": FUNCTION_NOT_FOUND
    init_error: int | None = None  # an NVML_ERROR_* code nvmlInit raises (e.g. DRIVER_NOT_LOADED)
    driver_version: str = "550.54.15"
    root: bool = True  # the caller's privileges: MIG parents refuse memory and processes to non-root

    @classmethod
    def node(cls, gpus: int = 8, *, gpm: bool = True, busy: bool = True, **gpu_fields: Any) -> Scenario:
        """An HGX-like node: ``gpus`` H100s, each busy (or idle) with one process."""
        out = []
        for i in range(gpus):
            g = FakeGpu(
                uuid=f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
                gpm=(busy_gpm() if busy else busy_gpm(0, 0, 0, 0, 0, 0, 0)) if gpm else None,
                power_w=450.0 if busy else 70.0,
                gpu_util=100 if busy else 0,
                mem_util=35 if busy else 0,
                mem_used=(60_000 if busy else 0) * MIB,
                sm_clock_mhz=1980 if busy else 345,
                clock_reasons=0 if busy else 0x1,
                processes=[FakeProcess(10_000 + i, 60_000 * MIB, sm_util=100)] if busy else [],
            )
            out.append(replace(g, **gpu_fields))
        return cls(out)


@dataclass(frozen=True)
class _Handle:
    """A device handle: a physical GPU, or (``mig`` set) a MIG device = (GPU instance, compute instance)."""

    gpu: int
    mig: tuple[int, int] | None = None


@dataclass
class _EventSet:
    devices: set[int] = field(default_factory=set)
    freed: bool = False


@dataclass
class _EventData:
    # Field names of pynvml's c_nvmlEventData_t.
    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class _GpuState:
    def __init__(self, spec: FakeGpu, now: float) -> None:
        self.spec = spec
        self.t = now
        self.energy_mj = float(spec.energy_mj)
        self.calls = 0
        self.lost = False
        # Integrals of GPM percent over time: key None = whole GPU, else the GI id.
        self.gpm_integral: dict[int | None, dict[int, float]] = {}
        self.pending_xids: list[tuple[int, int]] = []  # (xid, gi)
        self.util_log: list[tuple[float, dict[int, int]]] = []  # (since, pid -> smUtil %): per-process history
        self.log_utilization(now)

    def log_utilization(self, now: float) -> None:
        self.util_log = [*self.util_log[-UTIL_PERIODS_KEPT:], (now, {p.pid: p.sm_util for p in self.spec.processes})]

    def utilization_at(self, t: float) -> dict[int, int]:
        return next((u for since, u in reversed(self.util_log) if since <= t), self.util_log[0][1])

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt <= 0:
            return
        self.energy_mj += self.spec.power_w * dt * 1000.0
        areas: list[tuple[int | None, dict[int, float]]] = []
        if self.spec.gpm is not None:
            areas.append((None, self.spec.gpm))
            for m in self.spec.mig or ():
                areas.append((m.gi, m.gpm))
        for key, values in areas:
            acc = self.gpm_integral.setdefault(key, {})
            for mid, pct in values.items():
                acc[mid] = acc.get(mid, 0.0) + pct * dt
        self.t = now


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


def _api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Count the call and apply the driver-level failures every NVML entry point shares."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls[name] += 1
            if self._failing[name]:  # a transient failure the test asked for (fail_next)
                self._failing[name] -= 1
                raise _err(self._failing_code[name])
            if name in self.scenario.missing_functions and name not in _SYMBOL_CHOSEN_INSIDE:
                raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
            if name not in ("nvmlInit", "nvmlInitWithFlags") and self._init_count == 0:
                raise _err(_real.NVML_ERROR_UNINITIALIZED)
            if args and isinstance(args[0], _Handle):
                st = self._state(args[0])
                st.calls += 1
                if st.spec.lost_after_calls is not None and st.calls > st.spec.lost_after_calls:
                    st.lost = True
                if st.lost:
                    raise _err(_real.NVML_ERROR_GPU_IS_LOST)
                if name in st.spec.unsupported:
                    raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
                if args[0].mig is not None and name not in _MIG_HANDLE_OK:
                    # Device-level queries on a MIG device handle: the driver says "not supported".
                    raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
            return fn(self, *args, **kwargs)

    return wrapper


# Wrappers whose C symbol depends on their arguments: they check ``missing_functions`` themselves.
_SYMBOL_CHOSEN_INSIDE = frozenset({"nvmlDeviceGetMemoryInfo"})

_MIG_HANDLE_OK = frozenset({
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId", "nvmlDeviceIsMigDeviceHandle", "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
})


def _version_mismatch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """pynvml's ``throwOnVersionMismatch``: an unversioned wrapper whose versioned symbol is absent raises
    ``NVMLLibraryMismatchError`` (an ``Exception``, not an ``NVMLError``)."""

    @functools.wraps(fn)
    def wrapper(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        self.calls[fn.__name__] += 1
        try:
            return fn(self, *args, **kwargs)
        except _real.NVMLError_FunctionNotFound:
            raise _real.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib version. "
                "Either use matching pyNVML and NVML lib versions or use a versioned function such as "
                + fn.__name__ + "_v2") from None

    wrapper.throws_on_version_mismatch = True  # type: ignore[attr-defined]
    return wrapper


class FakeNvml:
    """Stands in for the ``pynvml`` module: pass an instance as ``NvmlSource(lib=...)``."""

    def __init__(self, scenario: Scenario, clock: Callable[[], float] = time.monotonic) -> None:
        self.scenario = scenario
        self._clock = clock
        self._lock = threading.RLock()
        now = clock()
        self._gpus = [_GpuState(g, now) for g in scenario.gpus]
        self._init_count = 0
        self.calls: Counter[str] = Counter()
        self._failing: Counter[str] = Counter()  # function -> calls left that fail (fail_next)
        self._failing_code: dict[str, int] = {}
        self.event_wait_timeouts: list[int] = []  # timeoutms of every nvmlEventSetWait call
        # GPM sample buffers: address -> (gpu, gi or None, time, integrals) once filled.
        self._gpm_buffers: dict[int, Any] = {}
        self._gpm_samples: dict[int, tuple[int, int | None, float, dict[int, float]] | None] = {}

    # -- scenario control (not part of pynvml) ----------------------------------------------------
    def update(self, index: int, gi: int | None = None, **changes: Any) -> None:
        """Change a GPU's (or, with ``gi``, a MIG instance's) values from now on; energy/GPM integrate up to now."""
        with self._lock:
            st = self._gpus[index]
            st.advance(self._clock())
            target: Any = st.spec if gi is None else next(m for m in st.spec.mig or () if m.gi == gi)
            for k, v in changes.items():
                if not hasattr(target, k):
                    raise AttributeError(f"fake GPU has no field {k!r}")
                setattr(target, k, v)
            st.log_utilization(self._clock())

    def fail_next(self, name: str, times: int = 1, code: int = _real.NVML_ERROR_UNKNOWN) -> None:
        """The next ``times`` calls of ``name`` (on any handle) raise ``code``: a transient driver error."""
        with self._lock:
            self._failing[name] = times
            self._failing_code[name] = code

    def lose(self, index: int) -> None:
        with self._lock:
            self._gpus[index].lost = True

    def revive(self, index: int) -> None:
        """Bring a lost GPU back (as after a reset); it will not be lost again by its call budget."""
        with self._lock:
            st = self._gpus[index]
            st.lost = False
            st.spec.lost_after_calls = None

    def inject_xid(self, index: int, xid: int, gi: int = NOT_IN_MIG) -> None:
        with self._lock:
            self._gpus[index].pending_xids.append((xid, gi))

    def calls_matching(self, prefix: str) -> int:
        return sum(n for k, n in self.calls.items() if k.startswith(prefix))

    # -- module-like fallthrough ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only called for names not defined on the fake: constants, error classes, structs.
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(_real, name)
        if inspect.isfunction(value):
            raise AttributeError(f"the fake NVML does not implement {name}")
        return value

    # -- helpers -------------------------------------------------------------------------------------
    def _state(self, h: _Handle) -> _GpuState:
        return self._gpus[h.gpu]

    def _now(self, st: _GpuState) -> float:
        now = self._clock()
        st.advance(now)
        return now

    def _mig(self, h: _Handle) -> FakeMigInstance:
        assert h.mig is not None
        st = self._state(h)
        for m in st.spec.mig or ():
            if m.gi == h.mig[0]:
                return m
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def _require(self, symbol: str) -> None:
        if symbol in self.scenario.missing_functions:
            raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _mig_parent_needs_root(self, handle: _Handle) -> None:
        # nvml.h: in MIG mode, a whole-GPU handle gives aggregate memory/processes only to privileged callers.
        if self._state(handle).spec.mig is not None and not self.scenario.root:
            raise _err(_real.NVML_ERROR_NO_PERMISSION)

    def _mig_devices(self, spec: FakeGpu) -> list[tuple[int, int]]:
        return [(m.gi, ci) for m in spec.mig or () for ci in m.compute_instances]

    # -- init -----------------------------------------------------------------------------------------
    @_api
    def nvmlInit(self) -> None:
        if self.scenario.init_error is not None:
            raise _err(self.scenario.init_error)
        self._init_count += 1

    @_api
    def nvmlInitWithFlags(self, flags: int) -> None:
        if self.scenario.init_error is not None:
            raise _err(self.scenario.init_error)
        self._init_count += 1

    @_api
    def nvmlShutdown(self) -> None:
        self._init_count -= 1

    @_api
    def nvmlSystemGetDriverVersion(self) -> str:
        return self.scenario.driver_version

    # -- devices ----------------------------------------------------------------------------------------
    @_api
    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    @_api
    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self._gpus):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if self._gpus[index].lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        return _Handle(index)

    @_api
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, st in enumerate(self._gpus):
            if st.spec.uuid == text:
                if st.lost:
                    raise _err(_real.NVML_ERROR_GPU_IS_LOST)
                return _Handle(i)
        raise _err(_real.NVML_ERROR_NOT_FOUND)

    @_api
    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        return handle.gpu

    @_api
    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        spec = self._state(handle).spec
        if handle.mig is not None:
            m = self._mig(handle)
            return f"{spec.name} MIG {m.profile}"
        return spec.name

    @_api
    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        spec = self._state(handle).spec
        if handle.mig is not None:
            gi, ci = handle.mig
            # Real MIG UUIDs are new for every created instance: one id re-created with another profile differs.
            profile = zlib.crc32(self._mig(handle).profile.encode()) & 0xFFFF
            return f"MIG-{spec.uuid[4:12]}-{gi:04x}-{ci:04x}-{profile:04x}-000000000000"
        return spec.uuid

    @_api
    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        self._require("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo")
        if version and version != _real.nvmlMemory_v2:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if handle.mig is not None:
            m = self._mig(handle)
            total, used, reserved = m.mem_total, m.mem_used, 0
        else:
            spec = self._state(handle).spec
            self._mig_parent_needs_root(handle)
            total, used, reserved = spec.mem_total, spec.mem_used, spec.mem_reserved
        free = total - used - reserved
        if version:
            return _real.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=free, used=used)
        return _real.c_nvmlMemory_t(total=total, free=free, used=used + reserved)

    @_api
    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        spec = self._state(handle).spec
        if spec.mig is not None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)  # as on a GPU in MIG mode
        return _real.c_nvmlUtilization_t(gpu=spec.gpu_util, memory=spec.mem_util)

    @_api
    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(round(self._state(handle).spec.power_w * 1000))  # mW

    @_api
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return int(round(self._state(handle).spec.power_limit_w * 1000))  # mW

    @_api
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: _Handle) -> int:
        st = self._state(handle)
        self._now(st)
        return int(st.energy_mj)  # mJ, uint64 in the driver

    @_api
    def nvmlDeviceGetTemperatureV(self, handle: _Handle, sensor: int, version: int = _real.nvmlTemperature_v1) -> int:
        if version != _real.nvmlTemperature_v1:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._state(handle).spec.temp_c

    @_api
    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._state(handle).spec.temp_c

    @_api
    def nvmlDeviceGetClockInfo(self, handle: _Handle, type: int) -> int:  # noqa: A002 - pynvml's name
        spec = self._state(handle).spec
        if type == _real.NVML_CLOCK_SM:
            return spec.sm_clock_mhz
        if type == _real.NVML_CLOCK_MEM:
            return spec.mem_clock_mhz
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    @_api
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._state(handle).spec.clock_reasons

    @_api
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        return self._state(handle).spec.clock_reasons

    @_api
    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, errorType: int, counterType: int) -> int:
        spec = self._state(handle).spec
        if errorType == _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return spec.ecc_uncorrected
        return spec.ecc_corrected

    @_api
    def nvmlDeviceGetRemappedRows(self, device: _Handle) -> tuple[int, int, int, int]:
        if self._state(device).spec.mig is not None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)  # row remapping is not reported in MIG mode
        return tuple(self._state(device).spec.remapped_rows)  # type: ignore[return-value]

    @_api
    def nvmlDeviceGetPcieThroughput(self, device: _Handle, counter: int) -> int:
        spec = self._state(device).spec
        if counter == _real.NVML_PCIE_UTIL_TX_BYTES:
            return spec.pcie_tx_kbps
        if counter == _real.NVML_PCIE_UTIL_RX_BYTES:
            return spec.pcie_rx_kbps
        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)

    def _processes(self, handle: _Handle, mps: bool = False) -> list[Any]:
        spec = self._state(handle).spec
        if handle.mig is None:
            self._mig_parent_needs_root(handle)
        out = []
        for p in spec.processes:
            if p.mps != mps or (handle.mig is not None and p.gpu_instance != handle.mig[0]):
                continue
            out.append(_real.nvmlFriendlyObject({
                "pid": p.pid,
                "usedGpuMemory": p.used_memory,
                "gpuInstanceId": NOT_IN_MIG if p.gpu_instance is None else p.gpu_instance,
                "computeInstanceId": NOT_IN_MIG if p.compute_instance is None else p.compute_instance,
            }))
        return out

    @_api
    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, timeStamp: int) -> list[Any]:  # noqa: N803
        st = self._state(handle)
        if st.spec.mig is not None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        last = int(self._now(st) / UTIL_PERIOD_S)
        first = max(last - UTIL_PERIODS_KEPT + 1, 1, int(timeStamp / 1e6 / UTIL_PERIOD_S) - 1)
        ends = [round(k * UTIL_PERIOD_S * 1e6) for k in range(first, last + 1)]
        out = [_real.c_nvmlProcessUtilizationSample_t(pid, end, sm, 0, 0, 0)
               for end in ends if end > timeStamp for pid, sm in st.utilization_at(end / 1e6).items() if sm > 0]
        if not out:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return out

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @_api
    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._processes(handle)

    @_version_mismatch
    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self.nvmlDeviceGetComputeRunningProcesses_v3(handle)

    @_api
    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._processes(handle, mps=True)

    @_api
    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._processes(handle, mps=True)

    @_version_mismatch
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self.nvmlDeviceGetMPSComputeRunningProcesses_v3(handle)

    # -- MIG ---------------------------------------------------------------------------------------------
    @_api
    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        on = self._state(device).spec.mig is not None
        mode = _real.NVML_DEVICE_MIG_ENABLE if on else _real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_api
    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        return 0 if self._state(device).spec.mig is None else 7

    @_api
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        devices = self._mig_devices(self._state(device).spec)
        if not 0 <= index < len(devices):
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        return _Handle(device.gpu, devices[index])

    @_api
    def nvmlDeviceIsMigDeviceHandle(self, device: _Handle) -> int:
        return int(device.mig is not None)

    @_api
    def nvmlDeviceGetGpuInstanceId(self, device: _Handle) -> int:
        if device.mig is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return device.mig[0]

    @_api
    def nvmlDeviceGetComputeInstanceId(self, device: _Handle) -> int:
        if device.mig is None:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return device.mig[1]

    @_api
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: _Handle) -> _Handle:
        return _Handle(migDevice.gpu)

    # -- events ----------------------------------------------------------------------------------------
    @_api
    def nvmlEventSetCreate(self) -> _EventSet:
        return _EventSet()

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        return _real.nvmlEventTypeXidCriticalError

    @_api
    def nvmlDeviceRegisterEvents(self, handle: _Handle, eventTypes: int, eventSet: _EventSet) -> None:
        if eventTypes & _real.nvmlEventTypeXidCriticalError:
            eventSet.devices.add(handle.gpu)

    @_api
    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> _EventData:
        self.event_wait_timeouts.append(timeoutms)
        if eventSet.freed:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        if any(self._gpus[i].lost for i in eventSet.devices):
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        for i in sorted(eventSet.devices):
            st = self._gpus[i]
            if st.pending_xids:
                xid, gi = st.pending_xids.pop(0)
                return _EventData(_Handle(i), _real.nvmlEventTypeXidCriticalError, xid, gi, NOT_IN_MIG)
        # The fake never blocks: an empty queue is a timeout whatever timeoutms says.
        raise _err(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> _EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)  # pynvml: an alias, no symbol of its own

    @_api
    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        eventSet.freed = True

    # -- GPM -------------------------------------------------------------------------------------------
    @_api
    def nvmlGpmQueryDeviceSupport(self, device: _Handle) -> Any:
        support = _real.c_nvmlGpmSupport_t()
        support.version = _real.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(self._state(device).spec.gpm is not None)
        return support

    @_api
    def nvmlGpmSampleAlloc(self) -> Any:
        # A real ctypes pointer (the type the metrics struct holds), to an 8-byte buffer we own.
        buf = (ctypes.c_char * 8)()
        addr = ctypes.addressof(buf)
        self._gpm_buffers[addr] = buf
        self._gpm_samples[addr] = None
        return ctypes.cast(buf, _real.c_nvmlGpmSample_t)

    @_api
    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        addr = self._addr(gpmSample)
        self._gpm_buffers.pop(addr, None)
        self._gpm_samples.pop(addr, None)

    def _addr(self, sample: Any) -> int:
        addr = ctypes.cast(sample, ctypes.c_void_p).value
        if addr is None or addr not in self._gpm_samples:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return addr

    def _record_gpm(self, device: _Handle, gi: int | None, sample: Any) -> Any:
        st = self._state(device)
        if st.spec.gpm is None:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        if gi is not None and all(m.gi != gi for m in st.spec.mig or ()):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        now = self._now(st)
        self._gpm_samples[self._addr(sample)] = (device.gpu, gi, now, dict(st.gpm_integral.get(gi, {})))
        return sample

    @_api
    def nvmlGpmSampleGet(self, device: _Handle, gpmSample: Any) -> Any:
        return self._record_gpm(device, None, gpmSample)

    @_api
    def nvmlGpmMigSampleGet(self, device: _Handle, gpuInstanceId: int, gpmSample: Any) -> Any:
        return self._record_gpm(device, gpuInstanceId, gpmSample)

    @_api
    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if metricsGet.version != _real.NVML_GPM_METRICS_GET_VERSION:
            raise _err(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        s1 = self._gpm_samples.get(self._addr(metricsGet.sample1))
        s2 = self._gpm_samples.get(self._addr(metricsGet.sample2))
        if s1 is None or s2 is None or s1[:2] != s2[:2] or s2[2] <= s1[2]:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        st = self._gpus[s1[0]]
        if st.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        dt = s2[2] - s1[2]
        for i in range(metricsGet.numMetrics):
            m = metricsGet.metrics[i]
            if m.metricId in s2[3] or m.metricId in s1[3]:
                m.value = (s2[3].get(m.metricId, 0.0) - s1[3].get(m.metricId, 0.0)) / dt
                m.nvmlReturn = _real.NVML_SUCCESS
            else:
                m.value = 0.0
                m.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
        return metricsGet


def fake_node(gpus: int = 8, clock: Callable[[], float] = time.monotonic, **kw: Any) -> FakeNvml:
    """Shorthand: a FakeNvml over ``Scenario.node(gpus, **kw)``."""
    return FakeNvml(Scenario.node(gpus, **kw), clock=clock)


__all__: Iterable[str] = [
    "FakeGpu", "FakeMigInstance", "FakeNvml", "FakeProcess", "Scenario", "busy_gpm", "fake_node", "NOT_IN_MIG",
]
