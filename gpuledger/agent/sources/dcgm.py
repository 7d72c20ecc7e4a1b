"""The ``dcgm`` GPU source: DCGM field values through DCGM's own Python bindings (``DcgmReader``).

DCGM gives the profiling fields (SM activity, occupancy, tensor, DRAM) on pre-Hopper datacenter GPUs
where NVML GPM does not exist. Fields are requested by numeric id: ids are stable across DCGM versions
(DCGM 4.6 renamed some fields, not their ids). The id -> GpuSample field table (``DCGM_FIELDS``) is data,
shared with the dcgm-exporter parser, and the conversion of ``{gpu_id: {field_id: value}}`` into samples
(``dcgm_values_to_samples``) is a pure function.

The bindings ship with DCGM, not on PyPI; they are looked for in ``bindings_path`` (the setting), then in
``DEFAULT_BINDINGS_PATHS``. MIG instances are not read by this source (whole GPUs only).
"""

from __future__ import annotations

import importlib
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuledger.schema.records import GpuSample
from gpuledger.agent.sources.base import SourceUnavailable

DEFAULT_BINDINGS_PATHS: tuple[str, ...] = (
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
    "/usr/local/dcgm/bindings/python3",
)

# DCGM's "blank" sentinels (dcgm_structs.h): DCGM_INT64_BLANK and up, DCGM_FP64_BLANK and up mean "no value"
# (e.g. DCGM_INT64_NOT_SUPPORTED = BLANK + 2 is what dcgm-exporter prints for an unsupported field).
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0

MIB = 1024 * 1024

# Pseudo-targets that are not GpuSample fields but feed one (see build_sample).
_AUX = ("_fb_free", "_fb_reserved", "_rows_correctable", "_rows_uncorrectable", "_gr_engine_active",
        "_uuid", "_name", "_index")


@dataclass(frozen=True, slots=True)
class DcgmField:
    """How one DCGM field becomes (part of) a GpuSample field."""

    field_id: int
    name: str  # DCGM_FI_* name, as dcgm-exporter names its metric
    target: str  # GpuSample field, or an _AUX pseudo-target
    scale: float = 1.0  # multiply the DCGM value by this to get SI units
    device_level: bool = False  # a whole-GPU value, repeated on every MIG instance by dcgm-exporter
    double: bool = False  # DCGM_FT_DOUBLE (else int64): decides which blank sentinel applies


DCGM_FIELDS: tuple[DcgmField, ...] = (
    DcgmField(50, "DCGM_FI_DEV_NAME", "_name"),
    DcgmField(52, "DCGM_FI_DEV_NVML_INDEX", "_index"),
    DcgmField(54, "DCGM_FI_DEV_UUID", "_uuid"),
    DcgmField(100, "DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", 1e6, True),  # MHz
    DcgmField(101, "DCGM_FI_DEV_MEM_CLOCK", "mem_clock_hz", 1e6, True),  # MHz
    DcgmField(112, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "throttle_reasons", 1.0, True),
    DcgmField(150, "DCGM_FI_DEV_GPU_TEMP", "temp_celsius", 1.0, True),
    DcgmField(155, "DCGM_FI_DEV_POWER_USAGE", "power_watts", 1.0, True, double=True),  # W
    DcgmField(156, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_joules", 1e-3, True),  # mJ
    DcgmField(200, "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "pcie_tx_bytes_per_second", 1024.0, True),  # KB/s
    DcgmField(201, "DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "pcie_rx_bytes_per_second", 1024.0, True),
    DcgmField(203, "DCGM_FI_DEV_GPU_UTIL", "gpu_util_ratio", 0.01),  # %
    DcgmField(204, "DCGM_FI_DEV_MEM_COPY_UTIL", "mem_copy_util_ratio", 0.01),  # %
    DcgmField(230, "DCGM_FI_DEV_XID_ERRORS", "xid_errors", 1.0, True),  # the last Xid, 0 = none
    DcgmField(250, "DCGM_FI_DEV_FB_TOTAL", "mem_total_bytes", MIB),  # MiB
    DcgmField(251, "DCGM_FI_DEV_FB_FREE", "_fb_free", MIB),
    DcgmField(252, "DCGM_FI_DEV_FB_USED", "mem_used_bytes", MIB),
    DcgmField(253, "DCGM_FI_DEV_FB_RESERVED", "_fb_reserved", MIB),
    DcgmField(311, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_errors_total", 1.0, True),
    DcgmField(393, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "_rows_uncorrectable", 1.0, True),
    DcgmField(394, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "_rows_correctable", 1.0, True),
    DcgmField(1001, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "_gr_engine_active", double=True),  # ratio
    DcgmField(1002, "DCGM_FI_PROF_SM_ACTIVE", "sm_active_ratio", double=True),
    DcgmField(1003, "DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy_ratio", double=True),
    DcgmField(1004, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active_ratio", double=True),
    DcgmField(1005, "DCGM_FI_PROF_DRAM_ACTIVE", "dram_bw_ratio", double=True),
    DcgmField(1006, "DCGM_FI_PROF_PIPE_FP64_ACTIVE", "fp64_active_ratio", double=True),
    DcgmField(1007, "DCGM_FI_PROF_PIPE_FP32_ACTIVE", "fp32_active_ratio", double=True),
    DcgmField(1008, "DCGM_FI_PROF_PIPE_FP16_ACTIVE", "fp16_active_ratio", double=True),
    DcgmField(1009, "DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_second", 1.0, True),  # B/s
    DcgmField(1010, "DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_per_second", 1.0, True),
)
FIELDS_BY_ID: dict[int, DcgmField] = {f.field_id: f for f in DCGM_FIELDS}
FIELDS_BY_NAME: dict[str, DcgmField] = {f.name: f for f in DCGM_FIELDS}
# Older name of field 112, still emitted by dcgm-exporter 3.x.
FIELDS_BY_NAME["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] = FIELDS_BY_ID[112]
# When two fields feed one GpuSample field, the newer/finer one wins (PROF PCIe bytes over the old KB/s field).
_PREFERRED = {200: 1009, 201: 1010}

_RATIO_TARGETS = frozenset({
    "sm_active_ratio", "sm_occupancy_ratio", "dram_bw_ratio", "tensor_active_ratio", "fp64_active_ratio",
    "fp32_active_ratio", "fp16_active_ratio", "gpu_util_ratio", "mem_copy_util_ratio", "_gr_engine_active",
})
_INT_TARGETS = frozenset({"mem_used_bytes", "mem_total_bytes", "throttle_reasons", "ecc_errors_total",
                          "_fb_free", "_fb_reserved", "_rows_correctable", "_rows_uncorrectable"})


def dcgm_number(value: Any, double: bool = False) -> float | None:
    """A DCGM numeric value, or None for blanks, NaN and non-numbers.

    ``double`` says the field is DCGM_FT_DOUBLE (blank at 2**47 and up); int64 fields are blank at
    DCGM_INT64_BLANK and up. A text scrape turns both into floats, so the field's type decides.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        return None
    if double:
        return None if v >= DCGM_FP64_BLANK else v
    return None if v >= float(DCGM_INT64_BLANK) else v


def convert_fields(values: Mapping[int, Any]) -> dict[str, Any]:
    """``{field_id: raw value}`` -> ``{GpuSample field: SI value}`` (aux targets resolved, unknown ids ignored)."""
    out: dict[str, Any] = {}
    aux: dict[str, Any] = {}
    for fid, raw in values.items():
        spec = FIELDS_BY_ID.get(fid)
        if spec is None:
            continue
        if spec.target in ("_uuid", "_name"):
            if isinstance(raw, bytes):
                raw = raw.decode(errors="replace")
            if isinstance(raw, str) and raw:
                aux[spec.target] = raw
            continue
        v = dcgm_number(raw, spec.double)
        if v is None:
            continue
        if fid in _PREFERRED and _PREFERRED[fid] in values and dcgm_number(values[_PREFERRED[fid]]) is not None:
            continue
        t = spec.target
        if t == "xid_errors":
            out[t] = (int(v),) if v > 0 else ()
            continue
        v *= spec.scale
        if t in _RATIO_TARGETS:
            v = min(max(v, 0.0), 1.0)  # counters read a moment apart can overshoot 100 % slightly
        elif t in _INT_TARGETS or t == "_index":
            v = int(round(v))
        if t.startswith("_"):
            aux[t] = v
        else:
            out[t] = v
    if "gpu_util_ratio" not in out and "_gr_engine_active" in aux:
        # "Graphics engine active" is the profiling counterpart of GPU_UTIL (a kernel was running); DCGM
        # reports it on MIG instances where GPU_UTIL does not exist.
        out["gpu_util_ratio"] = aux["_gr_engine_active"]
    if "mem_total_bytes" not in out and "mem_used_bytes" in out and "_fb_free" in aux:
        # FB_TOTAL is not a default dcgm-exporter field: total = used + free + reserved (what nvidia-smi shows).
        out["mem_total_bytes"] = out["mem_used_bytes"] + aux["_fb_free"] + aux.get("_fb_reserved", 0)
    if "_rows_correctable" in aux or "_rows_uncorrectable" in aux:
        out["remapped_rows_total"] = aux.get("_rows_correctable", 0) + aux.get("_rows_uncorrectable", 0)
    for k in ("_uuid", "_name", "_index"):
        if k in aux:
            out[k] = aux[k]
    return out


def dcgm_values_to_samples(
    values: Mapping[int, Mapping[int, Any]],
    *,
    host: str,
    ts: float,
    uuids: Mapping[int, str] | None = None,
    source: str = "dcgm",
) -> list[GpuSample]:
    """Convert DcgmReader's ``{gpu_id: {field_id: value}}`` into one GpuSample per GPU.

    The UUID comes from field 54 (DCGM_FI_DEV_UUID) or else ``uuids[gpu_id]``; a GPU with neither is
    skipped (a sample must name its GPU). The index is field 52 (NVML index) or else the DCGM gpu id.
    """
    out: list[GpuSample] = []
    for gpu_id in sorted(values):
        conv = convert_fields(values[gpu_id])
        uuid = conv.pop("_uuid", None) or (uuids or {}).get(gpu_id)
        name = conv.pop("_name", "")
        index = conv.pop("_index", gpu_id)
        if not uuid:
            continue
        out.append(GpuSample(ts=ts, host=host, gpu_uuid=uuid, gpu_index=int(index), model=name,
                             source=source, **conv))
    return out


def _find_bindings(paths: Iterable[str]) -> str | None:
    for p in paths:
        if os.path.isfile(os.path.join(p, "DcgmReader.py")):
            return p
    return None


class DcgmSource:
    """GPU samples from a DCGM host engine (``nv-hostengine``) via DCGM's Python bindings."""

    name = "dcgm"

    def __init__(
        self,
        bindings_path: str | None = None,
        host: str | None = None,
        hostengine: str = "localhost",
        update_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        field_ids: Iterable[int] | None = None,
    ) -> None:
        self.bindings_path = bindings_path
        self.host = host or socket.gethostname()
        self.hostengine = hostengine
        self.update_interval_s = update_interval_s
        self._clock = clock
        self.field_ids = tuple(field_ids) if field_ids is not None else tuple(f.field_id for f in DCGM_FIELDS)
        self._reader: Any = None
        self._uuids: dict[int, str] = {}

    def search_paths(self) -> tuple[str, ...]:
        return ((self.bindings_path,) if self.bindings_path else ()) + DEFAULT_BINDINGS_PATHS

    def open(self) -> None:
        paths = self.search_paths()
        found = _find_bindings(paths)
        if found is None:
            raise SourceUnavailable(
                "dcgm: DCGM Python bindings (DcgmReader.py) not found; looked in: " + ", ".join(paths)
                + " (install datacenter-gpu-manager or set the dcgm bindings_path)"
            )
        if found not in sys.path:
            sys.path.insert(0, found)
        try:
            reader_mod = importlib.import_module("DcgmReader")
        except Exception as exc:  # noqa: BLE001 - the bindings load libdcgm.so: any failure means unavailable
            raise SourceUnavailable(f"dcgm: importing the bindings from {found} failed: {exc}") from exc
        reader = reader_mod.DcgmReader(
            hostname=self.hostengine, fieldIds=list(self.field_ids),
            updateFrequency=int(self.update_interval_s * 1_000_000),
        )
        try:
            reader.Init()
        except Exception as exc:  # noqa: BLE001 - libdcgm missing, version mismatch, ...
            raise SourceUnavailable(f"dcgm: initialising DCGM failed: {exc}") from exc
        if getattr(reader, "m_dcgmHandle", None) is None:
            raise SourceUnavailable(f"dcgm: cannot connect to nv-hostengine at {self.hostengine}")
        self._reader = reader
        self._uuids = dict(getattr(reader, "m_gpuIdToUUId", {}) or {})

    def sample(self) -> list[GpuSample]:
        if self._reader is None:
            raise RuntimeError("dcgm: sample() before open()")
        values = self._reader.GetLatestGpuValuesAsFieldIdDict()
        return dcgm_values_to_samples(values, host=self.host, ts=self._clock(), uuids=self._uuids)

    def close(self) -> None:
        if self._reader is not None:
            try:
                self._reader.Shutdown()
            finally:
                self._reader = None


__all__ = [
    "DCGM_FIELDS", "DEFAULT_BINDINGS_PATHS", "DcgmField", "DcgmSource", "FIELDS_BY_ID", "FIELDS_BY_NAME",
    "convert_fields", "dcgm_number", "dcgm_values_to_samples",
]
