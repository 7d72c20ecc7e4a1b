"""The ``dcgm`` GPU source: DCGM field values through DCGM's own Python bindings (``DcgmReader``).

DCGM gives the profiling fields (SM activity, occupancy, tensor, DRAM) on pre-Hopper datacenter GPUs
where NVML GPM does not exist. Fields are requested by numeric id: ids are stable across DCGM versions
(DCGM 4.6 renamed some fields, not their ids: ``DcgmField.names`` holds the old and the new name, both of
which a dcgm-exporter may print). The id -> GpuSample field table (``DCGM_FIELDS``) is data, shared with
the dcgm-exporter parser, and the conversion of ``{gpu_id: {field_id: value}}`` into samples
(``dcgm_values_to_samples``) is a pure function.

Degrade per field: the field ids the installed DCGM does not know (its ``dcgm_fields`` module has no
constant with that value) are left out and counted ``unknown_field``; the profiling fields (1001-1010) are
watched by a reader of their own, so a DCGM or GPU that cannot watch them (no DCP support, no privileges)
costs those fields only (``watch_failed``), never power and energy. Each reader has its own field-group
name (DcgmReader's default name is shared by every reader on the host engine, and a second reader deletes
the first one's group).

Xid: ``DCGM_FI_DEV_XID_ERRORS`` (``XID_ERROR`` since 4.6) is the *last* Xid and stays set, so a value is an
Xid event only when it differs from the previous reading of that GPU (``XidLatch``); the first reading is the
baseline. (Two equal Xids in a row read as one: the reader gives values without their timestamps.)

Host engine: when nv-hostengine goes away DcgmReader drops its handle and answers ``{}``. The source then
says so -- an error log line, ``hostengine_disconnects_total`` +1, ``connected`` False, and ``sample()``
raises so the agent counts a source error rather than silently sending nothing -- and every later tick
reconnects (DcgmReader re-connects on its next call); the return is logged too.

The bindings ship with DCGM, not on PyPI; they are looked for in ``bindings_path`` (the setting), then in
``DEFAULT_BINDINGS_PATHS``. MIG instances are not read by this source (whole GPUs only).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.health import FieldHealth
from gpuledger.schema.records import GpuSample

log = logging.getLogger(__name__)

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
        "_uuid", "_name", "_index", "_last_xid")


@dataclass(frozen=True, slots=True)
class DcgmField:
    """How one DCGM field becomes (part of) a GpuSample field."""

    field_id: int
    name: str  # DCGM_FI_* name before DCGM 4.6, as dcgm-exporter's stock counters still name the metric
    target: str  # GpuSample field, or an _AUX pseudo-target
    scale: float = 1.0  # multiply the DCGM value by this to get SI units
    device_level: bool = False  # a whole-GPU value, repeated on every MIG instance by dcgm-exporter
    double: bool = False  # DCGM_FT_DOUBLE (else int64): decides which blank sentinel applies
    new_name: str = ""  # the DCGM 4.6 name of the same id (dcgm_fields.h), where it changed

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, self.new_name) if self.new_name else (self.name,)


DCGM_FIELDS: tuple[DcgmField, ...] = (
    DcgmField(50, "DCGM_FI_DEV_NAME", "_name", new_name="DCGM_FI_DEV_GPU_NAME"),
    DcgmField(52, "DCGM_FI_DEV_NVML_INDEX", "_index"),
    DcgmField(54, "DCGM_FI_DEV_UUID", "_uuid", new_name="DCGM_FI_DEV_GPU_UUID"),
    DcgmField(100, "DCGM_FI_DEV_SM_CLOCK", "sm_clock_hz", 1e6, True),  # MHz
    DcgmField(101, "DCGM_FI_DEV_MEM_CLOCK", "mem_clock_hz", 1e6, True),  # MHz
    DcgmField(112, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "throttle_reasons", 1.0, True),
    DcgmField(150, "DCGM_FI_DEV_GPU_TEMP", "temp_celsius", 1.0, True, new_name="DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
    DcgmField(155, "DCGM_FI_DEV_POWER_USAGE", "power_watts", 1.0, True, double=True,  # W
              new_name="DCGM_FI_DEV_BOARD_POWER_WATTS"),
    DcgmField(156, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_joules", 1e-3, True),  # mJ
    # the limit after every limiter (dcgm_fields.h); the collector bounds energy-counter steps by it
    DcgmField(164, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "power_limit_watts", 1.0, True, double=True),  # W
    DcgmField(200, "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "pcie_tx_bytes_per_second", 1024.0, True),  # KB/s
    DcgmField(201, "DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "pcie_rx_bytes_per_second", 1024.0, True),
    # Field 203 stays an int64 percentage under its 4.6 name (dcgm_fields.h: DCGM_FT_INT64).
    DcgmField(203, "DCGM_FI_DEV_GPU_UTIL", "gpu_util_ratio", 0.01, new_name="DCGM_FI_DEV_GPU_UTIL_RATIO"),  # %
    DcgmField(204, "DCGM_FI_DEV_MEM_COPY_UTIL", "mem_copy_util_ratio", 0.01),  # %
    # The last Xid of the GPU *or MIG instance* (instance level: never moved to the parent), 0 = none.
    DcgmField(230, "DCGM_FI_DEV_XID_ERRORS", "_last_xid", new_name="DCGM_FI_DEV_XID_ERROR"),
    DcgmField(250, "DCGM_FI_DEV_FB_TOTAL", "mem_total_bytes", MIB),  # MiB
    DcgmField(251, "DCGM_FI_DEV_FB_FREE", "_fb_free", MIB),
    DcgmField(252, "DCGM_FI_DEV_FB_USED", "mem_used_bytes", MIB),
    DcgmField(253, "DCGM_FI_DEV_FB_RESERVED", "_fb_reserved", MIB),
    DcgmField(311, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_errors_total", 1.0, True),
    DcgmField(393, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "_rows_uncorrectable", 1.0, True,
              new_name="DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL"),
    DcgmField(394, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "_rows_correctable", 1.0, True,
              new_name="DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL"),
    DcgmField(1001, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "_gr_engine_active", double=True,  # ratio
              new_name="DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    DcgmField(1002, "DCGM_FI_PROF_SM_ACTIVE", "sm_active_ratio", double=True, new_name="DCGM_FI_PROF_SM_UTIL_RATIO"),
    DcgmField(1003, "DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy_ratio", double=True,
              new_name="DCGM_FI_PROF_SM_OCCUPANCY_RATIO"),
    DcgmField(1004, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active_ratio", double=True,
              new_name="DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
    DcgmField(1005, "DCGM_FI_PROF_DRAM_ACTIVE", "dram_bw_ratio", double=True, new_name="DCGM_FI_PROF_DRAM_UTIL_RATIO"),
    DcgmField(1006, "DCGM_FI_PROF_PIPE_FP64_ACTIVE", "fp64_active_ratio", double=True,
              new_name="DCGM_FI_PROF_FP64_UTIL_RATIO"),
    DcgmField(1007, "DCGM_FI_PROF_PIPE_FP32_ACTIVE", "fp32_active_ratio", double=True,
              new_name="DCGM_FI_PROF_FP32_UTIL_RATIO"),
    DcgmField(1008, "DCGM_FI_PROF_PIPE_FP16_ACTIVE", "fp16_active_ratio", double=True,
              new_name="DCGM_FI_PROF_FP16_UTIL_RATIO"),
    DcgmField(1009, "DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_second", 1.0, True),  # B/s
    DcgmField(1010, "DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_per_second", 1.0, True),
)
FIELDS_BY_ID: dict[int, DcgmField] = {f.field_id: f for f in DCGM_FIELDS}
FIELDS_BY_NAME: dict[str, DcgmField] = {n: f for f in DCGM_FIELDS for n in f.names}
# Older name of field 112, still emitted by dcgm-exporter 3.x.
FIELDS_BY_NAME["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] = FIELDS_BY_ID[112]
PROFILING_FIELD_IDS = frozenset(f.field_id for f in DCGM_FIELDS if 1001 <= f.field_id <= 1010)
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


def convert_fields(values: Mapping[int, Any], mig: bool = False) -> dict[str, Any]:
    """``{field_id: raw value}`` -> ``{GpuSample field: SI value}`` (aux targets resolved, unknown ids ignored).

    ``mig``: the values are a MIG instance's, whose ``GPU_UTIL`` may read 0 while it is busy; there
    ``GR_ENGINE_ACTIVE`` (measured per instance) is the utilisation whenever it is present."""
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
        v *= spec.scale
        if t in _RATIO_TARGETS:
            v = min(max(v, 0.0), 1.0)  # counters read a moment apart can overshoot 100 % slightly
        elif t in _INT_TARGETS or t in ("_index", "_last_xid"):
            v = int(round(v))
        if t.startswith("_"):
            aux[t] = v
        else:
            out[t] = v
    if "_gr_engine_active" in aux and (mig or "gpu_util_ratio" not in out):
        # "Graphics engine active" is the profiling counterpart of GPU_UTIL (a kernel was running); DCGM
        # reports it on MIG instances where GPU_UTIL does not exist.
        out["gpu_util_ratio"] = aux["_gr_engine_active"]
    if "mem_total_bytes" not in out and "mem_used_bytes" in out and "_fb_free" in aux:
        # FB_TOTAL is not a default dcgm-exporter field: total = used + free + reserved (what nvidia-smi shows).
        out["mem_total_bytes"] = out["mem_used_bytes"] + aux["_fb_free"] + aux.get("_fb_reserved", 0)
    if "_rows_correctable" in aux or "_rows_uncorrectable" in aux:
        out["remapped_rows_total"] = aux.get("_rows_correctable", 0) + aux.get("_rows_uncorrectable", 0)
    for k in ("_uuid", "_name", "_index", "_last_xid"):
        if k in aux:
            out[k] = aux[k]
    return out


class XidLatch:
    """Turns DCGM's sticky "last Xid" field into Xid events: a reading is an event only when it differs
    from the previous reading of the same GPU or MIG instance; the first reading is the baseline."""

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}

    def events(self, key: Hashable, last_xid: int | None) -> tuple[int, ...]:
        if last_xid is None:
            return ()
        prev = self._last.get(key)
        self._last[key] = last_xid
        return (last_xid,) if prev is not None and last_xid != prev and last_xid > 0 else ()


def dcgm_values_to_samples(
    values: Mapping[int, Mapping[int, Any]],
    *,
    host: str,
    ts: float,
    uuids: Mapping[int, str] | None = None,
    source: str = "dcgm",
    xids: XidLatch | None = None,
) -> list[GpuSample]:
    """Convert DcgmReader's ``{gpu_id: {field_id: value}}`` into one GpuSample per GPU.

    The UUID comes from field 54 (DCGM_FI_DEV_UUID) or else ``uuids[gpu_id]``; a GPU with neither is
    skipped (a sample must name its GPU). The index is field 52 (NVML index) or else the DCGM gpu id.
    Xid events need the previous reading: ``xids`` is the caller's latch (without one, none are reported).
    """
    xids = xids if xids is not None else XidLatch()
    out: list[GpuSample] = []
    for gpu_id in sorted(values):
        conv = convert_fields(values[gpu_id])
        uuid = conv.pop("_uuid", None) or (uuids or {}).get(gpu_id)
        name = conv.pop("_name", "")
        index = conv.pop("_index", gpu_id)
        last_xid = conv.pop("_last_xid", None)
        if not uuid:
            continue
        out.append(GpuSample(ts=ts, host=host, gpu_uuid=uuid, gpu_index=int(index), model=name,
                             source=source, xid_errors=xids.events(uuid, last_xid), **conv))
    return out


def _find_bindings(paths: Iterable[str]) -> str | None:
    for p in paths:
        if os.path.isfile(os.path.join(p, "DcgmReader.py")):
            return p
    return None


def known_field_ids(dcgm_fields: Any) -> frozenset[int]:
    """The field ids an installed DCGM knows: the values of its bindings' ``DCGM_FI_*`` constants."""
    return frozenset(v for k, v in vars(dcgm_fields).items() if k.startswith("DCGM_FI_") and type(v) is int)


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
        self._readers: list[Any] = []
        self._uuids: dict[int, str] = {}
        self._xids = XidLatch()
        self.health = FieldHealth(self.name)
        self.connected = False
        self.hostengine_disconnects_total = 0

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
            known = known_field_ids(importlib.import_module("dcgm_fields"))
        except Exception as exc:  # noqa: BLE001 - the bindings load libdcgm.so: any failure means unavailable
            raise SourceUnavailable(f"dcgm: importing the bindings from {found} failed: {exc}") from exc
        ids = []
        for fid in self.field_ids:
            if fid in known:
                ids.append(fid)
            else:  # one unknown id would make DcgmReader refuse the whole field group
                self.health.note("*", _field_label(fid), "unknown_field", f"this DCGM has no field {fid}")
        base = [f for f in ids if f not in PROFILING_FIELD_IDS]
        prof = [f for f in ids if f in PROFILING_FIELD_IDS]
        group = f"gpuledger_{os.getpid()}_{id(self):x}"  # DcgmReader's default group name is shared
        self._readers = []
        try:
            self._readers.append(self._start(reader_mod, base, f"{group}_device", required=True))
            if prof:
                reader = self._start(reader_mod, prof, f"{group}_profiling", required=False)
                if reader is not None:
                    self._readers.append(reader)
        except BaseException:
            self.close()
            raise
        self._uuids = dict(getattr(self._readers[0], "m_gpuIdToUUId", {}) or {})
        self.connected = True

    def _start(self, reader_mod: Any, field_ids: list[int], group: str, *, required: bool) -> Any:
        reader = reader_mod.DcgmReader(
            hostname=self.hostengine, fieldIds=field_ids, fieldGroupName=group,
            updateFrequency=int(self.update_interval_s * 1_000_000),
        )
        try:
            reader.Init()
        except Exception as exc:  # noqa: BLE001 - libdcgm missing, version mismatch, a field DCGM cannot watch
            if required:
                raise SourceUnavailable(f"dcgm: initialising DCGM failed: {exc}") from exc
            for fid in field_ids:
                self.health.note("*", _field_label(fid), "watch_failed", str(exc))
            log.warning("dcgm: cannot watch the profiling fields (%s); SM activity and the other profiling "
                        "ratios are None, the other fields are read", exc)
            return None
        if getattr(reader, "m_dcgmHandle", None) is None:
            raise SourceUnavailable(f"dcgm: cannot connect to nv-hostengine at {self.hostengine}")
        return reader

    def sample(self) -> list[GpuSample]:
        if not self._readers:
            raise RuntimeError("dcgm: sample() before open()")
        values: dict[int, dict[int, Any]] = {}
        failure = ""
        try:
            for reader in self._readers:
                for gpu_id, fields in reader.GetLatestGpuValuesAsFieldIdDict().items():
                    values.setdefault(gpu_id, {}).update(fields)
        except Exception as exc:  # noqa: BLE001 - a failed re-connect can raise out of DcgmReader
            failure = f" ({type(exc).__name__}: {exc})"
        # DcgmReader drops its handle when the host engine goes away and re-connects on its next call.
        up = not failure and all(getattr(r, "m_dcgmHandle", None) is not None for r in self._readers)
        if not up:
            if self.connected:
                self.hostengine_disconnects_total += 1
                log.error("dcgm: lost the connection to nv-hostengine at %s%s; no samples until it is back "
                          "(reconnecting every tick)", self.hostengine, failure)
            self.connected = False
            raise SourceUnavailable(f"dcgm: not connected to nv-hostengine at {self.hostengine}{failure}")
        if not self.connected:
            log.warning("dcgm: reconnected to nv-hostengine at %s", self.hostengine)
            self.connected = True
        return dcgm_values_to_samples(values, host=self.host, ts=self._clock(), uuids=self._uuids, xids=self._xids)

    def close(self) -> None:
        readers, self._readers = self._readers, []
        self.connected = False
        for reader in readers:
            try:
                reader.Shutdown()
            except Exception as exc:  # noqa: BLE001 - closing: note it and close the others
                log.warning("dcgm: closing a reader failed: %s", exc)


def _field_label(field_id: int) -> str:
    spec = FIELDS_BY_ID.get(field_id)
    return spec.target.lstrip("_") if spec is not None else f"dcgm_field_{field_id}"


__all__ = [
    "DCGM_FIELDS", "DEFAULT_BINDINGS_PATHS", "DcgmField", "DcgmSource", "FIELDS_BY_ID", "FIELDS_BY_NAME",
    "PROFILING_FIELD_IDS", "XidLatch", "convert_fields", "dcgm_number", "dcgm_values_to_samples",
    "known_field_ids",
]
