"""The records every layer shares: immutable, slotted, in SI base units.

Ratios are 0..1, memory in bytes, power in watts, energy in joules, clocks in hertz, times in unix
seconds. ``None`` means the device (or source) did not report the value; it is never a silent zero.
This module imports only the standard library (and ``schema.text``) so that every layer may import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from gpuledger.schema.text import ascii_int

# The float fields of GpuSample that are ratios in 0..1 (validated by the collector).
RATIO_FIELDS: tuple[str, ...] = (
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "dram_bw_ratio",
    "tensor_active_ratio",
    "fp64_active_ratio",
    "fp32_active_ratio",
    "fp16_active_ratio",
    "gpu_util_ratio",
    "mem_copy_util_ratio",
)
# Non-negative float fields (validated by the collector).
NONNEG_FIELDS: tuple[str, ...] = (
    "power_watts",
    "energy_joules",
    "sm_clock_hz",
    "mem_clock_hz",
    "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
    "power_limit_watts",
)
# Non-negative integer fields.
INT_FIELDS: tuple[str, ...] = (
    "mem_used_bytes",
    "mem_total_bytes",
    "throttle_reasons",
    "ecc_errors_total",
    "remapped_rows_total",
)


class GpuProcess(NamedTuple):
    """A compute process on a GPU, as the driver lists it.

    ``gpu_util_ratio`` is the share of the agent's last sampling interval in which a kernel of this process ran
    on the GPU (NVML's per-process ``smUtil``, 0..1); None where the driver does not say (MIG, vGPU, an older
    GPU or driver). It is what a shared GPU's interval is split by (``agent.sharing.split_shares``).

    A named tuple, not a dataclass like the other records: a sample of a busy GPU lists its processes in every
    row, and the collector's typed decode builds these straight from the wire's rows (msgspec decodes a named
    tuple from an array, trailing defaults optional), where building a frozen dataclass a row doubled the cost
    of validating a batch.
    """

    pid: int
    used_memory_bytes: int | None  # required (if null): the wire's rows have two elements at least
    gpu_util_ratio: float | None = None

    def to_wire(self) -> list[int | float | None]:
        """The wire's process row: ``[pid, bytes|null]``, with ``gpu_util_ratio`` third when it is known (a
        row without it is what agents before it sent, and still valid)."""
        if self.gpu_util_ratio is None:
            return [self.pid, self.used_memory_bytes]
        return [self.pid, self.used_memory_bytes, self.gpu_util_ratio]

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> GpuProcess:
        """Inverse of :meth:`to_wire` for well-formed rows (the collector validates its own)."""
        util = row[2] if len(row) > 2 else None
        return cls(int(row[0]), None if row[1] is None else int(row[1]), None if util is None else float(util))


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU (or one MIG instance) at one instant.

    ``energy_joules`` is the device's monotonic counter (since driver load), not a delta.
    ``job_ids`` is a tuple because a GPU can be shared; ``job_shares`` (same length, summing to 1)
    says how to split the GPU's interval among them; empty means "split equally".
    """

    ts: float
    host: str
    gpu_uuid: str
    gpu_index: int
    model: str = ""
    mig: str | None = None  # the MIG GPU instance id ("3", as NVML and dcgm-exporter's GPU_I_ID), else None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    dram_bw_ratio: float | None = None  # HBM/DRAM bandwidth utilisation
    tensor_active_ratio: float | None = None
    fp64_active_ratio: float | None = None
    fp32_active_ratio: float | None = None
    fp16_active_ratio: float | None = None
    gpu_util_ratio: float | None = None  # "a kernel was running", what nvidia-smi shows
    mem_copy_util_ratio: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    temp_celsius: float | None = None
    sm_clock_hz: float | None = None
    mem_clock_hz: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    throttle_reasons: int | None = None  # NVML clock-event reason bit mask
    ecc_errors_total: int | None = None
    remapped_rows_total: int | None = None
    xid_errors: tuple[int, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    job_ids: tuple[str, ...] = ()
    job_shares: tuple[float, ...] = ()
    source: str = ""
    # The enforced power limit (NVML's enforced limit); bounds what the energy counter can plausibly advance.
    power_limit_watts: float | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON-ready): field names as keys, tuples as lists."""
        out: dict[str, Any] = {}
        for f in _SAMPLE_FIELDS:
            v = getattr(self, f)
            if f == "processes":
                v = [p.to_wire() for p in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[f] = v
        return out

    def to_wire(self) -> dict[str, Any]:
        """The compact form agents push: :meth:`to_dict` without the fields that are None or empty (their
        defaults), so a batch is smaller and the collector validates only what was reported."""
        return {k: v for k, v in self.to_dict().items() if v is not None and v != []}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSample:
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError/ValueError on bad input."""
        kw = {k: d[k] for k in _SAMPLE_FIELDS if k in d}
        if "processes" in kw:
            kw["processes"] = tuple(map(GpuProcess.from_wire, kw["processes"]))
        for k in ("xid_errors", "job_ids", "job_shares"):
            if k in kw:
                kw[k] = tuple(kw[k])
        return cls(**kw)


_SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GpuSample))
SAMPLE_FIELDS = _SAMPLE_FIELDS


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What the scheduler knows of a job. ``job_id`` is text ("1234", "1234_7" for array tasks).

    A requeued job (node failure, preemption, ``scontrol requeue``) keeps its id and runs again: the fields are
    the latest run's, ``earlier_runs`` the (start, end, hosts) of each run before it, oldest first."""

    job_id: str
    cluster: str = ""
    user: str | None = None
    uid: int | None = None
    account: str | None = None
    partition: str | None = None
    hosts: tuple[str, ...] = ()
    gpus: int | None = None  # allocated GPU count
    gpu_model: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    gpu_indexes: tuple[int, ...] = ()  # node numbering (SLURM_JOB_GPUS / GRES IDX), not CUDA_VISIBLE_DEVICES
    submit: float | None = None
    start: float | None = None
    end: float | None = None
    state: str | None = None
    exit_code: int | None = None
    tres: tuple[tuple[str, float], ...] = ()  # (("cpu", 8), ("gres/gpu", 2), ...)
    earlier_runs: tuple[tuple[float, float, tuple[str, ...]], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The stored form (JSON-ready). ``earlier_runs`` only when there are some: a job never requeued has the
        form it had before the field existed, so stored records and audit log entries read back byte for byte."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "earlier_runs":
                if v:
                    out[f.name] = [[start, end, list(hosts)] for start, end, hosts in v]
                continue
            out[f.name] = [list(x) for x in v] if f.name == "tres" else (list(v) if isinstance(v, tuple) else v)
        return out

    def with_earlier_runs(self, runs: Iterable[tuple[float, float, tuple[str, ...]]]) -> JobRecord:
        """This record with ``runs`` among its earlier runs: each run once, oldest first, and none that starts when
        this run does (that is this run, not an earlier one)."""
        merged = tuple(sorted({r for r in (*self.earlier_runs, *runs) if r[0] != self.start}))
        return self if merged == self.earlier_runs else replace(self, earlier_runs=merged)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRecord:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k in ("hosts", "gpu_uuids", "gpu_indexes"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if "tres" in kw:
            kw["tres"] = tuple((str(a), float(b)) for a, b in kw["tres"])
        if "earlier_runs" in kw:
            kw["earlier_runs"] = tuple((float(a), float(b), tuple(h)) for a, b, h in kw["earlier_runs"])
        return cls(**kw)


def gpu_id(uuid: str, mig: str) -> str:
    """The GPU name in usage records (``JobUsage.gpu_uuid``): the UUID, or ``uuid/mig`` for a MIG instance."""
    return f"{uuid}/{mig}" if mig else uuid


def split_gpu_id(gpu: str) -> tuple[str, str]:
    """(physical GPU UUID, MIG instance or "") of a usage record's GPU name: :func:`gpu_id` undone."""
    uuid, _, mig = gpu.partition("/")
    return uuid, mig


def job_sort_key(job_id: str) -> tuple[tuple[int, int, str], ...]:
    """The order of Slurm job ids everywhere we list them: numeric part by part ("9" before "10", "12_2" before
    "12_10", a job before its array tasks), ids that are not digits after the numbers of their position."""
    return tuple((0, n, "") if (n := ascii_int(p)) is not None else (1, 0, p) for p in job_id.split("_"))


def sorted_job_ids(job_ids: Iterable[str]) -> tuple[str, ...]:
    """``job_ids`` once each, in :func:`job_sort_key` order."""
    return tuple(sorted(set(job_ids), key=job_sort_key))


@dataclass(frozen=True, slots=True)
class JobUsage:
    """Measured usage of one job on one GPU (or summed over GPUs when ``gpu_uuid`` is "*").

    This is what the collector hands accounting; accounting never reads raw samples. A job is identified by
    ``(cluster, job_id)``; ``cluster`` is the one the reporting agent named ("" when it named none).
    """

    job_id: str
    host: str
    gpu_uuid: str
    first_ts: float
    last_ts: float
    samples: int
    allocated_gpu_seconds: float
    sm_active_gpu_seconds: float
    energy_joules: float
    # Means are time-weighted over the seconds where the source reported the value (None if never).
    sm_active_mean: float | None = None
    dram_bw_mean: float | None = None
    tensor_active_mean: float | None = None
    sm_occupancy_mean: float | None = None
    mem_used_peak_bytes: int | None = None
    power_peak_watts: float | None = None
    model: str = ""
    gpus: int = 1
    # Seconds the job held the GPU across a gap in the samples (same jobs on both sides): not observed, so not
    # in ``allocated_gpu_seconds``, but the gap's counter delta is in ``energy_joules``.
    gap_gpu_seconds: float = 0.0
    cluster: str = ""

    @property
    def efficiency(self) -> float | None:
        """SM-active GPU-seconds over allocated GPU-seconds."""
        if self.allocated_gpu_seconds <= 0:
            return None
        return self.sm_active_gpu_seconds / self.allocated_gpu_seconds

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["efficiency"] = self.efficiency
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobUsage:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
