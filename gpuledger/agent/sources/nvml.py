"""The ``nvml`` GPU source: reads every GPU through nvidia-ml-py (``pynvml``).

Per GPU (keyed by UUID): utilisation, memory, power, the energy counter, temperature, clocks, clock-event
reasons, ECC and remapped rows, Xid events, PCIe throughput, compute and MPS processes and, on Hopper and
newer, GPM metrics (SM activity/occupancy, DRAM bandwidth, tensor and FP pipes), also per MIG instance.

Rules the code keeps:

- **Degrade per field, never per GPU.** A function the driver lacks (``FUNCTION_NOT_FOUND``, an unversioned
  wrapper's ``NVMLLibraryMismatchError``, or absent from an old pynvml) is never called again by this source;
  one a GPU does not support (``NOT_SUPPORTED``, ``NO_PERMISSION``) is never called again on that GPU (until
  its MIG mode changes or it is re-opened). Either makes that field None, logs one line and counts the field
  once in ``health.unavailable`` under its reason (a GPU without GPM: its GPM fields, ``not_supported``); the
  rest of the sample goes out. Any other failure of one call (a transient error, a binding bug) costs that field
  for that tick only and is counted per field in ``call_errors_total`` (the GPM calls count under every GPM
  field). Versioned functions
  (``_v3``, ``_v2``; ``nvmlDeviceGetTemperatureV`` before the deprecated ``nvmlDeviceGetTemperature``;
  ``nvmlDeviceGetMemoryInfo`` v2 before v1) are probed once and the first that exists is kept.
- **Memory used** is NVML's v2 ``used``, which leaves out the driver's reserve, as DCGM's ``FB_USED`` does;
  only a driver without ``nvmlDeviceGetMemoryInfo_v2`` gives v1's ``used``, which includes it.
- **One lost GPU never breaks the cycle.** ``GPU_IS_LOST`` / ``RESET_REQUIRED`` (or Xid 79, "fell off the
  bus") mark that GPU lost: a log line, ``gpu_lost_total`` +1, no sample for it, and the handle is re-opened
  later with exponential backoff. A lost GPU also makes ``nvmlEventSetWait`` answer ``GPU_IS_LOST`` for the
  whole event set; the set is then rebuilt without it, so the healthy GPUs' Xids keep coming.
- **GPM needs two samples >= 100 ms apart.** The previous GPM sample per GPU (and per MIG GPU instance) is
  kept between ticks, so each tick reports the average over the time since the previous tick; the first
  tick (and a tick < 100 ms after the last) has no GPM values. A NaN or infinite GPM value is None.
- **Intervals are timed by the monotonic clock** (GPM's 100 ms, the re-open backoff); the wall clock only
  stamps samples, so a step of it (NTP) stops neither GPM nor re-opens.
- **Xid** events come from an NVML event set polled with timeout 0, so the loop never blocks on it. Each Xid
  read (79 too) goes out in its GPU's next sample; those of a GPU lost (or whose sampling failed) before that
  wait for its next sample (after the re-open), and meanwhile :meth:`NvmlSource.held_xids` names them (the agent
  counts them at once). At most 64 wait per GPU; further ones are only counted (``held_xids``), never sent.
- **Processes**: compute processes and MPS clients (``nvmlDeviceGetMPSComputeRunningProcesses``: an MPS
  client is not in the compute list), merged by pid. Each one's ``gpu_util_ratio`` comes from
  ``nvmlDeviceGetProcessUtilization`` since the GPU's last answer: the sum of its ``smUtil`` over the driver's
  sample periods, over the number of periods. NVML lists only processes that ran a kernel in a period, so a
  listed process without a sample ran none (0.0). ``NOT_FOUND`` (no period closed since, or nobody ran) leaves
  every ratio unknown this tick, as do MIG (not supported there) and an older driver.

MIG: the GPU's own sample (``mig=None``) carries the device-level values (power, energy, temperature,
clocks, ECC, PCIe, Xid) and the GPU-wide GPM reading where the driver gives one. Each MIG *GPU instance*
gets one more sample with ``mig=str(gpu_instance_id)`` -- the same key dcgm-exporter's ``GPU_I_ID`` label
and its ``<gpu>.<gi>`` job-mapping files use -- carrying that instance's memory, GPM values and processes
(read through its MIG device handles: on the parent, memory and process lists need privileges), and no
power or energy (those exist only for the whole GPU; ``agent.mig`` shares them out). Compute instances
inside one GPU instance are folded into it (GPM is per GPU instance). The MIG mode is read every tick and
the instances re-enumerated, each known by its MIG UUID: after a reconfiguration a GPU instance id may come
back with another profile, and then it is a new instance (fresh name, GPM window and memory). Remapped rows
are NOT_SUPPORTED while MIG is on and come back when it is turned off.
"""

from __future__ import annotations

import ctypes
import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.health import FieldHealth
from gpuledger.schema.records import GpuProcess, GpuSample

log = logging.getLogger(__name__)

# NVML constants (stable ABI values from nvml.h), so the module does not need pynvml to import.
_SUCCESS = 0
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_TIMEOUT = 10
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_RESET_REQUIRED = 16
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_DRIVER_NOT_LOADED = 9
_PERMANENT = {_ERR_NOT_SUPPORTED: "not_supported", _ERR_NO_PERMISSION: "no_permission"}
_LOST = frozenset({_ERR_GPU_IS_LOST, _ERR_RESET_REQUIRED})
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1
_CLOCK_MEM = 2
_PCIE_TX = 0
_PCIE_RX = 1
_MEMORY_ERROR_UNCORRECTED = 1
_VOLATILE_ECC = 0
_MIG_ENABLE = 1
_MEMORY_V2 = 0x02000028  # nvmlMemory_v2: NVML_STRUCT_VERSION(Memory, 2)
_EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
_XID_FELL_OFF_BUS = 79
_NOT_IN_MIG = 0xFFFFFFFF
_NOT_AVAILABLE_U64 = 2**64 - 1

# GpuSample field <- NVML GPM metric id (values in percent).
GpmField = Literal["sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_bw_ratio",
                   "fp64_active_ratio", "fp32_active_ratio", "fp16_active_ratio"]


class GpmRatios(TypedDict, total=False):
    """The GpuSample fields one GPM window fills (keyword arguments to GpuSample); one left out was not read."""

    sm_active_ratio: float
    sm_occupancy_ratio: float
    tensor_active_ratio: float
    dram_bw_ratio: float
    fp64_active_ratio: float
    fp32_active_ratio: float
    fp16_active_ratio: float


GPM_METRICS: tuple[tuple[GpmField, int], ...] = (
    ("sm_active_ratio", 2),  # NVML_GPM_METRIC_SM_UTIL
    ("sm_occupancy_ratio", 3),  # NVML_GPM_METRIC_SM_OCCUPANCY
    ("tensor_active_ratio", 5),  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    ("dram_bw_ratio", 10),  # NVML_GPM_METRIC_DRAM_BW_UTIL
    ("fp64_active_ratio", 11),  # NVML_GPM_METRIC_FP64_UTIL
    ("fp32_active_ratio", 12),  # NVML_GPM_METRIC_FP32_UTIL
    ("fp16_active_ratio", 13),  # NVML_GPM_METRIC_FP16_UTIL
)
GPM_FIELDS: tuple[GpmField, ...] = tuple(f for f, _ in GPM_METRICS)
GPM_MIN_INTERVAL_S = 0.1  # NVML: two GPM samples must be at least 100 ms apart
_MAX_EVENTS_PER_TICK = 64
# Xids kept per GPU until its next sample (one whose sampling keeps failing); beyond, they are only counted.
_MAX_PENDING_XIDS = 64
_MAX_LOGGED = 4096


@dataclass(frozen=True)
class _Variant:
    """One version of a function: the pynvml wrapper, trailing arguments, and the C symbol it needs."""

    fn: str
    extra: tuple[Any, ...] = ()
    symbol: str = ""

    @property
    def sym(self) -> str:
        return self.symbol or self.fn


# Newest first. The unversioned process wrappers are left out: in pynvml they only call _v3 and raise
# NVMLLibraryMismatchError (not an NVMLError) when it is missing, so they can never be a fallback.
_PROCESSES = (_Variant("nvmlDeviceGetComputeRunningProcesses_v3"), _Variant("nvmlDeviceGetComputeRunningProcesses_v2"))
_MPS_PROCESSES = (_Variant("nvmlDeviceGetMPSComputeRunningProcesses_v3"),
                  _Variant("nvmlDeviceGetMPSComputeRunningProcesses_v2"))
_REASONS = (_Variant("nvmlDeviceGetCurrentClocksEventReasons"), _Variant("nvmlDeviceGetCurrentClocksThrottleReasons"))
# nvmlDeviceGetTemperature is deprecated in NVML 13 and announced for removal in CUDA 14.
_TEMPERATURE = (_Variant("nvmlDeviceGetTemperatureV"), _Variant("nvmlDeviceGetTemperature"))
_MEMORY = (_Variant("nvmlDeviceGetMemoryInfo", (_MEMORY_V2,), "nvmlDeviceGetMemoryInfo_v2"),
           _Variant("nvmlDeviceGetMemoryInfo"))
# pynvml's nvmlEventSetWait is only an alias of _v2 (same symbol): there is nothing to fall back to.
_EVENT_WAIT = "nvmlEventSetWait_v2"

_MISSING = object()  # _call's answer when the function does not exist in this driver/binding


class _GpuLost(Exception):
    pass


@dataclass
class _Gpm:
    """Two GPM sample buffers used alternately, the reused metrics request, and when the last one was taken."""

    buffers: list[Any]
    request: Any
    cur: int = 0
    prev_at: float | None = None  # monotonic time of the window's start sample


@dataclass
class _Mig:
    gi: int
    handles: list[Any]  # one MIG device handle per compute instance
    name: str
    uuid: str  # MIG UUID of the first compute instance: who this instance is, across reconfigurations
    gpm: _Gpm | None = None


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str | None = None
    name: str = ""
    unsupported: set[str] = field(default_factory=set)
    gpm: _Gpm | None = None
    gpm_supported: bool = False
    mig_enabled: bool | None = None  # None: not read yet
    migs: dict[int, _Mig] = field(default_factory=dict)
    xids: list[int] = field(default_factory=list)  # read, not yet in a sample (kept while the GPU is lost)
    lost: bool = False
    retry_at: float = 0.0  # monotonic
    backoff_s: float = 0.0
    util_seen_us: int = 0  # the newest per-process utilization sample's driver timestamp read (0: none yet)

    @property
    def label(self) -> str:
        return self.uuid or f"index {self.index}"


# The sample fields one NVML call fills: one, several (a GPM sample: every GPM field) or none.
Fields = str | tuple[str, ...] | None


def _fields(field: Fields) -> tuple[str, ...]:
    return () if field is None else (field,) if isinstance(field, str) else field


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _ratio(pct: float) -> float | None:
    # Percent -> 0..1; counters sampled a moment apart can overshoot 100 % slightly. NaN (GPM can answer it,
    # DCGM maps it to blank) is no value.
    if not math.isfinite(pct):
        return None
    return min(max(pct / 100.0, 0.0), 1.0)


def _handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle (ctypes pointers compare by object, not address)."""
    if isinstance(handle, ctypes._Pointer):  # real pynvml handle
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


class NvmlSource:
    """GPU samples from NVML. ``lib`` is the pynvml module (default: ``import pynvml``) or a fake of it."""

    name = "nvml"

    def __init__(
        self,
        lib: Any = None,
        host: str | None = None,
        clock: Callable[[], float] = time.time,
        gpm: bool = True,
        pcie: bool = True,
        reopen_backoff_s: tuple[float, float] = (30.0, 600.0),
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self._lib_arg = lib
        self.lib: Any = lib
        self.host = host or socket.gethostname()
        self._clock = clock  # stamps samples only
        # times intervals; where a clock is given but no monotonic one (a test's or a replay's time), that clock
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._gpm_enabled = gpm
        # nvmlDeviceGetPcieThroughput samples a byte counter over 20 ms per call (wall time, not CPU).
        self._pcie = pcie
        self._backoff_min, self._backoff_max = reopen_backoff_s
        self._gpus: list[_Gpu] = []
        self._fns: dict[str, Any] = {}
        self._missing: dict[str, str] = {}  # C symbol -> reason it is unavailable
        self._chosen: dict[str, _Variant | None] = {}
        self._logged: set[tuple[Any, ...]] = set()
        self._events: Any = None
        self._events_stale = False
        self._by_handle: dict[Any, _Gpu] = {}
        self._opened = False
        self.health = FieldHealth(self.name)
        self.gpu_lost_total = 0  # times a GPU was marked lost
        self.errors_total = 0  # unexpected exceptions (a binding bug): of one call, or of one GPU's sampling
        # failed calls by the field they fill ("" for a call that fills none: a name, the MIG layout, the event
        # wait), not for a permanent cause: that field was None for that GPU that tick
        self.call_errors_total: dict[str, int] = {}
        # Xids read beyond a GPU's pending cap, per (host, index, UUID, ""): (model, how many); never reset, so
        # the agent's Xid counter stays monotonic though they never go out in a sample
        self._xids_dropped: dict[tuple[str, int, str, str], tuple[str, int]] = {}

    # -- lifecycle -------------------------------------------------------------------------------------
    def open(self) -> None:
        if self._opened:
            self.close()
        if self._lib_arg is None:
            try:
                import pynvml  # noqa: PLC0415 - the real library only when asked for
            except ImportError as exc:
                raise SourceUnavailable(f"nvml: nvidia-ml-py is not installed ({exc})") from exc
            self.lib = pynvml
        lib = self.lib
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            code = getattr(exc, "value", None)  # pynvml's NVML_ERROR_* number
            hint = {
                _ERR_LIBRARY_NOT_FOUND: " (libnvidia-ml.so.1 not found: no NVIDIA driver on this host)",
                _ERR_DRIVER_NOT_LOADED: " (the NVIDIA kernel driver is not loaded)",
            }.get(code, "") if isinstance(code, int) else ""
            raise SourceUnavailable(f"nvml: nvmlInit failed: {exc}{hint}") from exc
        try:
            count = lib.nvmlDeviceGetCount()
        except lib.NVMLError as exc:
            lib.nvmlShutdown()
            raise SourceUnavailable(f"nvml: nvmlDeviceGetCount failed: {exc}") from exc
        self._opened = True
        self._events = self._create_event_set()
        at = self._monotonic()
        self._gpus = []
        for index in range(count):
            gpu = _Gpu(index)
            self._gpus.append(gpu)
            try:
                self._attach(gpu, lib.nvmlDeviceGetHandleByIndex(index))
            except _GpuLost:
                self._mark_lost(gpu, at, "lost while opening")
            except lib.NVMLError as exc:
                if exc.value in _LOST:
                    self._mark_lost(gpu, at, f"lost while opening: {exc}")
                else:
                    self._mark_lost(gpu, at, f"cannot open: {exc}")
            except Exception as exc:  # noqa: BLE001 - a binding bug: one GPU must not cost the others
                self._attach_failed(gpu, at, "opening", exc)

    def close(self) -> None:
        if not self._opened:
            return
        self._opened = False
        lib = self.lib
        for gpu in self._gpus:
            self._free_gpm(gpu)
        self._free_event_set()
        try:
            lib.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvml: nvmlShutdown failed: %s", exc)
        self._gpus = []
        self._by_handle = {}

    @property
    def lost_gpus(self) -> tuple[str, ...]:
        """UUIDs (or "index N" when never identified) of the GPUs currently marked lost."""
        return tuple(g.label for g in self._gpus if g.lost)

    # -- one cycle ---------------------------------------------------------------------------------------
    def sample(self) -> list[GpuSample]:
        if not self._opened:
            raise RuntimeError("nvml: sample() before open()")
        now, at = self._clock(), self._monotonic()
        self._poll_events(at)
        out: list[GpuSample] = []
        for gpu in self._gpus:
            if gpu.lost and not (at >= gpu.retry_at and self._reopen(gpu, at)):
                continue
            try:
                out.extend(self._sample_gpu(gpu, now, at))
            except _GpuLost as exc:
                self._mark_lost(gpu, at, str(exc) or "GPU is lost")
            except Exception as exc:  # noqa: BLE001 - a bug outside one call: one GPU must not cost the others
                self.errors_total += 1
                self._log_once(("error", gpu.label, type(exc).__name__, str(exc)), logging.ERROR,
                               "nvml: sampling GPU %s failed: %s: %s", gpu.label, type(exc).__name__, exc)
        if self._events_stale:
            self._rebuild_event_set()
        return out

    def _sample_gpu(self, gpu: _Gpu, now: float, at: float) -> list[GpuSample]:
        """The GPU's samples stamped ``now`` (wall clock); ``at`` (monotonic) times the GPM windows."""
        h = gpu.handle
        call = self._call
        self._refresh_mig(gpu)
        mig = gpu.mig_enabled
        mem = self._versioned(gpu, "memory", _MEMORY, h, field="mem_used_bytes")
        util = None if mig else call(gpu, "nvmlDeviceGetUtilizationRates", h, field="gpu_util_ratio")
        power = call(gpu, "nvmlDeviceGetPowerUsage", h, field="power_watts")
        # the collector bounds each energy-counter step by it (a step above limit x elapsed is not trusted); read
        # every cycle: `nvidia-smi -pl` changes it while jobs run
        limit = call(gpu, "nvmlDeviceGetEnforcedPowerLimit", h, field="power_limit_watts")
        energy = call(gpu, "nvmlDeviceGetTotalEnergyConsumption", h, field="energy_joules")
        temp = self._versioned(gpu, "temperature", _TEMPERATURE, h, _TEMPERATURE_GPU, field="temp_celsius")
        sm_clock = call(gpu, "nvmlDeviceGetClockInfo", h, _CLOCK_SM, key="nvmlDeviceGetClockInfo(SM)",
                        field="sm_clock_hz")
        mem_clock = call(gpu, "nvmlDeviceGetClockInfo", h, _CLOCK_MEM, key="nvmlDeviceGetClockInfo(MEM)",
                         field="mem_clock_hz")
        reasons = self._versioned(gpu, "clock-event reasons", _REASONS, h, field="throttle_reasons")
        ecc = call(gpu, "nvmlDeviceGetTotalEccErrors", h, _MEMORY_ERROR_UNCORRECTED, _VOLATILE_ECC,
                   field="ecc_errors_total")
        rows = call(gpu, "nvmlDeviceGetRemappedRows", h, field="remapped_rows_total")
        tx = rx = None
        if self._pcie:
            tx = call(gpu, "nvmlDeviceGetPcieThroughput", h, _PCIE_TX, key="nvmlDeviceGetPcieThroughput(TX)",
                      field="pcie_tx_bytes_per_second")
            rx = call(gpu, "nvmlDeviceGetPcieThroughput", h, _PCIE_RX, key="nvmlDeviceGetPcieThroughput(RX)",
                      field="pcie_rx_bytes_per_second")
        # In MIG mode the parent's process list needs privileges and each instance has its own: read there.
        procs = () if mig else self._with_utilization(gpu, h, self._processes(gpu, h, ""))
        gpm = self._gpm_read(gpu, gpu.gpm, "nvmlGpmSampleGet", (h,), at)

        samples = [GpuSample(
            ts=now,
            host=self.host,
            gpu_uuid=gpu.uuid or "",
            gpu_index=gpu.index,
            model=gpu.name,
            gpu_util_ratio=None if util is None else _ratio(util.gpu),
            mem_copy_util_ratio=None if util is None else _ratio(util.memory),
            mem_used_bytes=None if mem is None else int(mem.used),
            mem_total_bytes=None if mem is None else int(mem.total),
            power_watts=None if power is None else power / 1000.0,  # mW -> W
            power_limit_watts=None if limit is None else limit / 1000.0,  # mW -> W
            energy_joules=None if energy is None else energy / 1000.0,  # mJ -> J
            temp_celsius=None if temp is None else float(temp),
            sm_clock_hz=None if sm_clock is None else sm_clock * 1e6,  # MHz -> Hz
            mem_clock_hz=None if mem_clock is None else mem_clock * 1e6,
            # NVML reports KB/s; taken as KiB/s, as nvitop does.
            pcie_tx_bytes_per_second=None if tx is None else tx * 1024.0,
            pcie_rx_bytes_per_second=None if rx is None else rx * 1024.0,
            throttle_reasons=None if reasons is None else int(reasons),
            ecc_errors_total=None if ecc is None else int(ecc),
            remapped_rows_total=None if rows is None else int(rows[0]) + int(rows[1]),
            xid_errors=tuple(gpu.xids),
            processes=tuple(procs),
            source=self.name,
            **(gpm or {}),
        )]
        for gi, m in gpu.migs.items():
            where = f"MIG {gi} "
            mmem = self._versioned(gpu, "memory", _MEMORY, m.handles[0], key=where + "memory",
                                   field="mem_used_bytes")
            mprocs: dict[int, GpuProcess] = {}
            for ci, mh in enumerate(m.handles):  # every compute instance of the GPU instance
                for p in self._processes(gpu, mh, f"{where}CI {ci} "):
                    mprocs.setdefault(p.pid, p)
            mgpm = self._gpm_read(gpu, m.gpm, "nvmlGpmMigSampleGet", (h, gi), at)
            samples.append(GpuSample(
                ts=now,
                host=self.host,
                gpu_uuid=gpu.uuid or "",
                gpu_index=gpu.index,
                model=m.name,
                mig=str(gi),
                mem_used_bytes=None if mmem is None else int(mmem.used),
                mem_total_bytes=None if mmem is None else int(mmem.total),
                processes=tuple(mprocs.values()),
                source=self.name,
                **(mgpm or {}),
            ))
        gpu.xids = []  # only now: a GPU lost while its instances were read keeps them for its next sample
        return samples

    def held_xids(self) -> list[tuple[tuple[str, int, str, str], str, int]]:
        """Xids read and in no sample: ((host, index, UUID, mig ""), model, how many), so the agent counts them at
        once. Those pending (a GPU lost, or whose sampling failed, since they were read) go out in the GPU's next
        sample; those read beyond the pending cap never do, and are counted here for good."""
        held = dict(self._xids_dropped)
        for g in self._gpus:
            if g.xids:
                key = (self.host, g.index, g.uuid or "", "")
                model, n = held.get(key, (g.name, 0))
                held[key] = (model, n + len(g.xids))
        return [(key, model, n) for key, (model, n) in held.items()]

    def mig_uuids(self) -> dict[tuple[str, str], str]:
        """(GPU UUID, ``mig`` as samples carry it) -> the MIG instance's own UUID, for the current layout: what
        a mapping file or a static table may name a MIG instance by (``MIG-...``, as ``nvidia-smi -L`` shows)."""
        return {(gpu.uuid, str(gi)): m.uuid for gpu in self._gpus if gpu.uuid for gi, m in gpu.migs.items()}

    def _processes(self, gpu: _Gpu, handle: Any, where: str) -> list[GpuProcess]:
        """Compute processes and MPS clients on ``handle``, by pid (an MPS client is not a compute process)."""
        out: dict[int, GpuProcess] = {}
        for family, variants in (("compute processes", _PROCESSES), ("MPS processes", _MPS_PROCESSES)):
            for p in self._versioned(gpu, family, variants, handle, key=where + family, field="processes") or ():
                used = getattr(p, "usedGpuMemory", None)
                if used is not None and (used >= _NOT_AVAILABLE_U64 or used < 0):
                    used = None
                out.setdefault(int(p.pid), GpuProcess(int(p.pid), None if used is None else int(used)))
        return list(out.values())

    def _with_utilization(self, gpu: _Gpu, handle: Any, procs: list[GpuProcess]) -> list[GpuProcess]:
        """``procs`` with each one's share of the time, since the GPU's last answer, in which its kernels ran
        (see the module's rules); as they are where NVML cannot say."""
        if not procs:
            return procs
        samples = self._call(gpu, "nvmlDeviceGetProcessUtilization", handle, gpu.util_seen_us, absent=_ERR_NOT_FOUND)
        if not samples:
            return procs
        busy: dict[int, float] = {}
        periods = set()
        try:
            for u in samples:
                sm, stamp, pid = int(u.smUtil), int(u.timeStamp), int(u.pid)
                periods.add(stamp)
                if 0 <= sm <= 100:  # a value out of range (a driver's "not available") says nothing
                    busy[pid] = busy.get(pid, 0.0) + sm
        except (AttributeError, TypeError, ValueError) as exc:  # a binding's odd answer costs the ratios, not the GPU
            self.errors_total += 1
            self._log_once(("error", gpu.label, "nvmlDeviceGetProcessUtilization"), logging.ERROR,
                           "nvml: GPU %s: nvmlDeviceGetProcessUtilization answered %s: %s (ratios unknown this tick)",
                           gpu.label, type(exc).__name__, exc)
            return procs
        gpu.util_seen_us = max(gpu.util_seen_us, *periods)
        n = len(periods)
        return [GpuProcess(p.pid, p.used_memory_bytes, min(busy.get(p.pid, 0.0) / (100.0 * n), 1.0)) for p in procs]

    # -- NVML calls ----------------------------------------------------------------------------------------
    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            try:
                fn = getattr(self.lib, name)
            except AttributeError:
                return None  # an older pynvml without this binding: same as a driver without the symbol
            self._fns[name] = fn
        return fn

    def _call(self, gpu: _Gpu, name: str, *args: Any, key: str | None = None, field: Fields = None,
              symbol: str | None = None, absent: int | None = None) -> Any:
        """Call ``name``; None when the value is unavailable (see the module's rules), or when it answers the
        error code ``absent`` (one that means "nothing to report now", not a failure)."""
        r = self._call_raw(gpu, name, *args, key=key, field=field, symbol=symbol, absent=absent)
        return None if r is _MISSING else r

    def _call_raw(self, gpu: _Gpu, name: str, *args: Any, key: str | None = None, field: Fields = None,
                  symbol: str | None = None, note_missing: bool = True, absent: int | None = None) -> Any:
        """As _call, but _MISSING (not None) when the function does not exist in this driver/binding
        (counted against ``field`` unless ``note_missing`` is False: an older version may still exist)."""
        key = key or name
        symbol = symbol or name
        if key in gpu.unsupported:
            return None
        reason = self._missing.get(symbol)
        if reason is None:
            fn = self._fn(name)
            if fn is None:
                reason = self._note_missing(symbol, "function_not_found", "not in this nvidia-ml-py")
            else:
                try:
                    return fn(*args)
                except self.lib.NVMLError as exc:
                    code = getattr(exc, "value", None)
                    if code is not None and code == absent:
                        return None
                    if code in _LOST:
                        raise _GpuLost(f"{name}: {exc}") from exc
                    if code == _ERR_FUNCTION_NOT_FOUND:
                        reason = self._note_missing(symbol, "function_not_found", "not in this driver")
                    elif code in _PERMANENT:
                        gpu.unsupported.add(key)
                        if field is not None:
                            self._note(gpu, field, _PERMANENT[code], f"{key}: {exc}")
                        else:
                            self._log_once(("unsupported", gpu.label, key), logging.INFO,
                                           "nvml: GPU %s: %s: %s; not asked again", gpu.label, key, exc)
                        return None
                    else:
                        self._count_failure(field)
                        self._log_once(("failed", gpu.label, key, code), logging.WARNING,
                                       "nvml: GPU %s: %s failed: %s (field None this tick; later repeats not logged)",
                                       gpu.label, key, exc)
                        return None
                except Exception as exc:  # noqa: BLE001 - e.g. NVMLLibraryMismatchError, a binding bug
                    if type(exc).__name__ == "NVMLLibraryMismatchError":
                        reason = self._note_missing(symbol, "library_mismatch", str(exc))
                    else:
                        self.errors_total += 1
                        self._count_failure(field)
                        self._log_once(("error", gpu.label, key, type(exc).__name__), logging.ERROR,
                                       "nvml: GPU %s: %s raised %s: %s (field None this tick)",
                                       gpu.label, key, type(exc).__name__, exc)
                        return None
        if note_missing:
            self._note(gpu, field, reason, f"{symbol} is missing")
        return _MISSING

    def _note(self, gpu: _Gpu, field: Fields, reason: str, detail: str = "") -> None:
        """``health.note`` for each field a call fills."""
        for f in _fields(field):
            self.health.note(gpu.label, f, reason, detail)

    def _count_failure(self, field: Fields) -> None:
        for f in _fields(field) or ("",):
            self.call_errors_total[f] = self.call_errors_total.get(f, 0) + 1

    def _note_missing(self, symbol: str, reason: str, why: str) -> str:
        self._missing[symbol] = reason
        self._log_once(("missing", symbol), logging.INFO, "nvml: %s: %s (%s); not called again", symbol, why, reason)
        return reason

    def _versioned(self, gpu: _Gpu, family: str, variants: Sequence[_Variant], *args: Any,
                   key: str | None = None, field: str | None = None) -> Any:
        """Call the newest existing version of a function; probing happens once per source."""
        chosen = self._chosen.get(family, _MISSING)
        if chosen is None:  # no version exists
            self._note(gpu, field, self._missing.get(variants[-1].sym, "function_not_found"))
            return None
        key = key or family
        for v in (chosen,) if chosen is not _MISSING else variants:
            assert isinstance(v, _Variant)
            r = self._call_raw(gpu, v.fn, *args, *v.extra, key=key, field=field, symbol=v.sym, note_missing=False)
            if r is _MISSING:
                continue
            if chosen is _MISSING:
                self._chosen[family] = v
                log.debug("nvml: %s via %s", family, v.sym)
            return r
        self._chosen[family] = None
        log.info("nvml: no version of %s (%s) exists; that field is None", family, ", ".join(v.sym for v in variants))
        self._note(gpu, field, self._missing.get(variants[-1].sym, "function_not_found"))
        return None

    def _log_once(self, key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        if key in self._logged:
            return
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
        log.log(level, msg, *args)

    # -- per-GPU setup, loss and re-open ---------------------------------------------------------------
    def _attach(self, gpu: _Gpu, handle: Any) -> None:
        """Identify a GPU from a fresh handle and (re)build its GPM state, MIG layout and event registration."""
        lib = self.lib
        uuid = _text(lib.nvmlDeviceGetUUID(handle))
        if gpu.uuid is not None and uuid != gpu.uuid:
            raise _GpuLost(f"index {gpu.index} now holds {uuid}, expected {gpu.uuid}")
        gpu.handle, gpu.uuid = handle, uuid
        name = self._call(gpu, "nvmlDeviceGetName", handle)
        gpu.name = "" if name is None else _text(name)
        self._by_handle[_handle_key(handle)] = gpu
        self._free_gpm(gpu)
        gpu.gpm_supported = False
        if self._gpm_enabled:
            support = self._call(gpu, "nvmlGpmQueryDeviceSupport", handle, field=GPM_FIELDS)
            gpu.gpm_supported = support is not None and bool(support.isSupportedDevice)
            if gpu.gpm_supported:
                gpu.gpm = self._new_gpm(gpu)
            elif support is not None:  # the driver answered: this GPU has no GPM (before Hopper)
                self._note(gpu, GPM_FIELDS, "not_supported", "nvmlGpmQueryDeviceSupport: not a GPM device")
        gpu.migs = {}
        gpu.mig_enabled = None
        self._refresh_mig(gpu)
        self._register_events(gpu)

    def _refresh_mig(self, gpu: _Gpu) -> None:
        """Read the MIG mode and (when on) the instances; called every tick: MIG can be reconfigured any time.
        A read that fails this tick (not lost, not unsupported) keeps the last tick's layout: taken for "MIG
        off", it would hand every instance's processes to the whole GPU and drop the instances' GPM windows."""
        mode = self._call(gpu, "nvmlDeviceGetMigMode", gpu.handle)
        if mode is None and gpu.mig_enabled is not None and not self._never(gpu, "nvmlDeviceGetMigMode"):
            return
        enabled = mode is not None and mode[0] == _MIG_ENABLE
        if gpu.mig_enabled is not None and enabled != gpu.mig_enabled:
            # Fields NOT_SUPPORTED in one mode (remapped rows, utilisation) may exist in the other.
            log.warning("nvml: GPU %s: MIG mode turned %s", gpu.label, "on" if enabled else "off")
            gpu.unsupported.clear()
            self.health.forget(gpu.label)
        gpu.mig_enabled = enabled
        if not enabled:
            for m in gpu.migs.values():
                self._free_one(m.gpm)
            gpu.migs = {}
            return
        count = self._call(gpu, "nvmlDeviceGetMaxMigDeviceCount", gpu.handle)
        if count is None and not self._never(gpu, "nvmlDeviceGetMaxMigDeviceCount"):
            return
        found: dict[int, _Mig] = {}
        lib = self.lib
        for i in range(int(count or 0)):
            try:
                mh = lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, i)
                gi = int(lib.nvmlDeviceGetGpuInstanceId(mh))
            except lib.NVMLError as exc:
                if exc.value in _LOST:
                    raise _GpuLost(str(exc)) from exc
                if exc.value == _ERR_NOT_FOUND:
                    continue  # an empty slot
                self._keep_layout(gpu, found, f"MIG slot {i}: {exc}")
                return
            if gi in found:
                found[gi].handles.append(mh)  # another compute instance of the same GPU instance
                continue
            try:
                muuid = _text(lib.nvmlDeviceGetUUID(mh))
            except lib.NVMLError as exc:
                if exc.value in _LOST:
                    raise _GpuLost(str(exc)) from exc
                self._keep_layout(gpu, found, f"MIG instance {gi} UUID: {exc}")
                return
            old = gpu.migs.get(gi)
            if old is not None and old.uuid == muuid:
                old.handles = [mh]
                found[gi] = old
                continue
            name = self._call(gpu, "nvmlDeviceGetName", mh, key="MIG nvmlDeviceGetName")
            found[gi] = _Mig(gi, [mh], gpu.name if name is None else _text(name), muuid,
                             self._new_gpm(gpu) if gpu.gpm_supported else None)
        for gi, m in gpu.migs.items():
            if found.get(gi) is not m:
                self._free_one(m.gpm)  # gone, or the same id now names another instance
        gpu.migs = found

    def _never(self, gpu: _Gpu, name: str) -> bool:
        """Will ``name`` never answer on this GPU (not supported, or not in this driver or binding)?"""
        return name in gpu.unsupported or name in self._missing

    def _keep_layout(self, gpu: _Gpu, found: dict[int, _Mig], why: str) -> None:
        """A MIG layout read cut short by a transient error: the last tick's instances stand; GPM state made for
        instances read so far is freed."""
        self._count_failure(None)
        for gi, m in found.items():
            if gpu.migs.get(gi) is not m:
                self._free_one(m.gpm)
        self._log_once(("mig layout", gpu.label), logging.WARNING,
                       "nvml: GPU %s: %s; the MIG layout of the last tick kept (later repeats not logged)",
                       gpu.label, why)

    def _mark_lost(self, gpu: _Gpu, at: float, reason: str) -> None:
        """``at``: monotonic time. The GPU's Xids read but not yet sent are kept for its next sample."""
        if not gpu.lost:
            self.gpu_lost_total += 1
            gpu.backoff_s = self._backoff_min
            log.error("nvml: GPU %s (index %d) is lost: %s; other GPUs keep being sampled, re-open in %.0f s",
                      gpu.label, gpu.index, reason, gpu.backoff_s)
            self._events_stale = self._events is not None  # a lost GPU in the set makes every wait fail
        else:
            gpu.backoff_s = min(gpu.backoff_s * 2, self._backoff_max)
        gpu.lost = True
        gpu.retry_at = at + gpu.backoff_s
        if gpu.handle is not None:
            self._by_handle.pop(_handle_key(gpu.handle), None)

    def _attach_failed(self, gpu: _Gpu, at: float, doing: str, exc: Exception) -> None:
        """An unexpected exception (not NVML's) while ``doing`` (opening, re-opening) a GPU: counted, logged once,
        and the GPU marked lost, to be tried again with backoff (one log line: marking it lost logs it)."""
        self.errors_total += 1
        reason = f"{doing} failed: {type(exc).__name__}: {exc}"
        if gpu.lost:  # already lost: _mark_lost logs nothing
            self._log_once(("attach", gpu.label, type(exc).__name__, str(exc)), logging.ERROR,
                           "nvml: GPU %s (index %d): %s", gpu.label, gpu.index, reason)
        self._mark_lost(gpu, at, reason)

    def _reopen(self, gpu: _Gpu, at: float) -> bool:
        lib = self.lib
        try:
            if gpu.uuid is not None:
                handle = lib.nvmlDeviceGetHandleByUUID(gpu.uuid)
            else:
                handle = lib.nvmlDeviceGetHandleByIndex(gpu.index)
            gpu.unsupported.clear()
            self.health.forget(gpu.label)
            self._attach(gpu, handle)
        except (_GpuLost, lib.NVMLError) as exc:
            self._mark_lost(gpu, at, str(exc))
            log.info("nvml: GPU %s still unavailable (%s); next try in %.0f s", gpu.label, exc, gpu.backoff_s)
            return False
        except Exception as exc:  # noqa: BLE001 - a binding bug: one GPU must not cost the others
            self._attach_failed(gpu, at, "re-opening", exc)
            return False
        gpu.lost = False
        log.warning("nvml: GPU %s (index %d) is back", gpu.label, gpu.index)
        return True

    # -- GPM -----------------------------------------------------------------------------------------------
    def _new_gpm(self, gpu: _Gpu) -> _Gpm | None:
        lib = self.lib
        try:
            bufs = [lib.nvmlGpmSampleAlloc(), lib.nvmlGpmSampleAlloc()]
            request = lib.c_nvmlGpmMetricsGet_t()
        except (lib.NVMLError, AttributeError) as exc:
            self._log_once(("gpm-alloc", gpu.label), logging.WARNING,
                           "nvml: GPU %s: GPM sample allocation failed: %s; no GPM values", gpu.label, exc)
            return None
        request.version = lib.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        return _Gpm(bufs, request)

    def _free_one(self, st: _Gpm | None) -> None:
        if st is None:
            return
        for b in st.buffers:
            try:
                self.lib.nvmlGpmSampleFree(b)
            except Exception as exc:  # noqa: BLE001 - freeing is best effort
                log.debug("nvml: nvmlGpmSampleFree failed: %s", exc)
        st.buffers = []

    def _free_gpm(self, gpu: _Gpu) -> None:
        self._free_one(gpu.gpm)
        gpu.gpm = None
        for m in gpu.migs.values():
            self._free_one(m.gpm)
            m.gpm = None

    def _gpm_read(self, gpu: _Gpu, st: _Gpm | None, fn: str, args: tuple[Any, ...],
                  at: float) -> GpmRatios | None:
        """Take a GPM sample at ``at`` (monotonic); with a previous one >= 100 ms older, return the metrics over
        that window."""
        if st is None or not st.buffers:
            return None
        if st.prev_at is not None and at - st.prev_at < GPM_MIN_INTERVAL_S:
            return None  # keep the older sample as the window's start
        cur = st.buffers[st.cur]
        key = fn if len(args) == 1 else f"MIG {args[1]} {fn}"
        if self._call(gpu, fn, *args, cur, key=key, field=GPM_FIELDS) is None:
            st.prev_at = None
            return None
        values: GpmRatios | None = None
        if st.prev_at is not None:
            req = st.request
            req.sample1 = st.buffers[1 - st.cur]
            req.sample2 = cur
            for i, (_, mid) in enumerate(GPM_METRICS):
                req.metrics[i].metricId = mid
            if self._call(gpu, "nvmlGpmMetricsGet", req, key=key + " metrics", field=GPM_FIELDS) is not None:
                values = {}
                for i, (fname, _) in enumerate(GPM_METRICS):
                    m = req.metrics[i]
                    if m.nvmlReturn == _SUCCESS and (v := _ratio(m.value)) is not None:
                        values[fname] = v
        st.prev_at = at
        st.cur = 1 - st.cur
        return values

    # -- Xid events -------------------------------------------------------------------------------------------
    def _create_event_set(self) -> Any:
        lib = self.lib
        try:
            return lib.nvmlEventSetCreate()
        except (lib.NVMLError, AttributeError) as exc:
            log.info("nvml: no event set (%s); Xid errors are not reported", exc)
            return None

    def _free_event_set(self) -> None:
        if self._events is not None:
            try:
                self.lib.nvmlEventSetFree(self._events)
            except Exception as exc:  # noqa: BLE001 - closing: nothing to do but note it
                log.debug("nvml: nvmlEventSetFree failed: %s", exc)
            self._events = None

    def _register_events(self, gpu: _Gpu) -> None:
        if self._events is None:
            return
        r = self._call_raw(gpu, "nvmlDeviceRegisterEvents", gpu.handle, _EVENT_XID, self._events, key="Xid events")
        if r is _MISSING:
            self._log_once(("xid",), logging.INFO, "nvml: no event support; Xid errors are not reported")

    def _rebuild_event_set(self) -> None:
        """A new event set holding only the GPUs not lost (NVML cannot take one device out of a set)."""
        self._events_stale = False
        self._free_event_set()
        self._events = self._create_event_set()
        at = self._monotonic()
        for gpu in self._gpus:
            if gpu.lost or gpu.handle is None:
                continue
            try:
                self._register_events(gpu)
            except _GpuLost as exc:
                self._mark_lost(gpu, at, str(exc))  # marks the set stale: rebuilt next tick without it

    def _poll_events(self, at: float) -> None:
        if self._events is None or not self._gpus or _EVENT_WAIT in self._missing:
            return
        lib = self.lib
        wait = self._fn(_EVENT_WAIT)
        if wait is None:
            self._note_missing(_EVENT_WAIT, "function_not_found", "not in this nvidia-ml-py; no Xid events")
            return
        for _ in range(_MAX_EVENTS_PER_TICK):
            try:
                data = wait(self._events, 0)  # timeout 0: never blocks the sampling loop
            except lib.NVMLError as exc:
                if exc.value == _ERR_FUNCTION_NOT_FOUND:
                    self._note_missing(_EVENT_WAIT, "function_not_found", "not in this driver; no Xid events")
                elif exc.value in _LOST:
                    # Some GPU in the set is lost; its own calls will say which. Rebuild the set without it.
                    self._events_stale = True
                    self._log_once(("event-wait-lost",), logging.WARNING,
                                   "nvml: event wait: %s; the event set is rebuilt without the lost GPU", exc)
                elif exc.value != _ERR_TIMEOUT:
                    self._count_failure(None)  # the events stay queued for the next poll
                    self._log_once(("event-wait", exc.value), logging.WARNING, "nvml: event wait failed: %s", exc)
                return
            gpu = self._by_handle.get(_handle_key(data.device))
            if gpu is None or gpu.lost:
                continue
            xid = int(data.eventData)
            log.warning("nvml: GPU %s: Xid %d", gpu.label, xid)
            if len(gpu.xids) < _MAX_PENDING_XIDS:
                gpu.xids.append(xid)
            else:
                key = (self.host, gpu.index, gpu.uuid or "", "")
                model, n = self._xids_dropped.get(key, (gpu.name, 0))
                self._xids_dropped[key] = (model, n + 1)
                self._log_once(("xids-dropped", gpu.label), logging.WARNING,
                               "nvml: GPU %s: more than %d Xids without a sample; further ones are only counted",
                               gpu.label, _MAX_PENDING_XIDS)
            if xid == _XID_FELL_OFF_BUS:
                self._mark_lost(gpu, at, "Xid 79: fell off the bus")


__all__ = ["GPM_METRICS", "NvmlSource"]
