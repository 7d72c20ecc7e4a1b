"""The columnar batch layout agents push: one *series* per GPU (or MIG instance) and job set.

An agent's batch holds several sampling rounds of the same few GPUs, so the collector gets it as columns,
not as one map per sample: the per-GPU constants once, every numeric field as one column. In msgpack a
complete numeric column travels as raw little-endian bytes (float64 for float fields, int64 for integer
fields), which the collector reads without touching a Python object per value; a column with gaps (a
value the device did not report) is a list with nulls, as is every column in JSON.

A batch in this layout is ``{"agent_id", "seq", "host", "series": [...], "jobs"?}``; one series is::

    {"gpu_uuid": str, "gpu_index": int,                       # required
     "model": str, "mig": str | null, "source": str,          # constants, optional
     "job_ids": [str], "job_shares": [float],                 # constants, optional
     "ts": column,                                            # required, n >= 1 values, unix seconds
     "<numeric field>": column,                               # optional, n values each
     "xid_errors": [[int]] , "processes": [[[pid, bytes|null, util?]]]}   # optional, n per-row lists

where a column is a list of n numbers (null = not reported; ``ts`` has no nulls) or, in msgpack only,
bytes of n 8-byte values (no gaps; NaN and infinities are invalid). Sample ``j`` of a series is the
sample with the batch's host, the series' constants and value ``j`` of every column. The row layout
(``"samples": [...]``, one map per sample) stays accepted for simple clients.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

from gpuledger.schema.records import INT_FIELDS, SAMPLE_FIELDS, GpuSample

# Per-series constants (one series per distinct combination for a GPU); gpu_uuid and gpu_index are required.
SERIES_CONSTANTS: tuple[str, ...] = ("gpu_uuid", "gpu_index", "model", "mig", "source", "job_ids", "job_shares")
# Per-row list fields (rarely non-empty): a list of n lists when any row has one.
ROW_LISTS: tuple[str, ...] = ("xid_errors", "processes")
# Numeric columns: every other field except the batch's host, in record order (ts first).
INT_COLUMNS: tuple[str, ...] = tuple(INT_FIELDS)
COLUMNS: tuple[str, ...] = tuple(f for f in SAMPLE_FIELDS if f not in (*SERIES_CONSTANTS, *ROW_LISTS, "host"))
FLOAT_COLUMNS: tuple[str, ...] = tuple(f for f in COLUMNS if f not in INT_COLUMNS)
_DEFAULTS = {f.name: f.default for f in GpuSample.__dataclass_fields__.values()}
_INT64 = (-(2**63), 2**63 - 1)


def _column(values: list[Any], is_int: bool, binary: bool) -> Any:
    """A column as raw bytes (binary, no gaps, representable) or as a list."""
    if binary and None not in values:
        if is_int:
            if all(type(v) is int and _INT64[0] <= v <= _INT64[1] for v in values):
                return struct.pack(f"<{len(values)}q", *values)
        else:
            return struct.pack(f"<{len(values)}d", *values)
    return values


def series_key(s: GpuSample) -> tuple[Any, ...]:
    """What puts a sample in a series: its values of SERIES_CONSTANTS (one series per GPU and job set)."""
    return (s.gpu_uuid, s.gpu_index, s.model, s.mig, s.source, s.job_ids, s.job_shares)


def to_series(samples: Sequence[GpuSample], host: str, binary: bool = False) -> list[dict[str, Any]]:
    """Samples (one host's) -> series maps, in order of each series' first sample; rows keep their order.

    ``binary`` packs complete numeric columns as bytes (for msgpack). Raises ValueError for a sample of
    another host or a NaN/infinite reading (the collector would reject the whole batch).
    """
    groups: dict[tuple, list[GpuSample]] = {}
    for s in samples:
        if s.host != host:
            raise ValueError(f"sample of host {s.host!r} in a batch of host {host!r}")
        key = series_key(s)
        g = groups.get(key)
        if g is None:
            groups[key] = [s]
        else:
            g.append(s)
    out = []
    for key, rows in groups.items():
        if not all(math.isfinite(x) for x in key[6]):
            raise ValueError(f"NaN or infinite job_shares for GPU {key[0]}")
        d: dict[str, Any] = {}
        for name, v in zip(SERIES_CONSTANTS, key):
            if name in ("gpu_uuid", "gpu_index") or v != _DEFAULTS[name]:
                d[name] = list(v) if isinstance(v, tuple) else v
        for f in COLUMNS:
            values = [getattr(s, f) for s in rows]
            if values.count(None) == len(values):
                continue
            is_int = f in INT_COLUMNS
            if not is_int and not all(v is None or math.isfinite(v) for v in values):
                raise ValueError(f"NaN or infinite {f} for GPU {key[0]}")
            d[f] = _column(values, is_int, binary)
        xids = [list(s.xid_errors) for s in rows]
        if any(xids):
            d["xid_errors"] = xids
        procs = [[p.to_wire() for p in s.processes] for s in rows]
        if any(procs):
            d["processes"] = procs
        out.append(d)
    return out


def from_series(series: Sequence[dict[str, Any]], host: str) -> list[GpuSample]:
    """The inverse of :func:`to_series` for well-formed input (tools and tests; the collector validates its own)."""
    out = []
    for d in series:
        n = len(d["ts"]) // 8 if isinstance(d["ts"], bytes) else len(d["ts"])
        cols: dict[str, list[Any]] = {}
        for f in COLUMNS:
            v = d.get(f)
            if isinstance(v, bytes):
                v = list(struct.unpack(f"<{n}{'q' if f in INT_COLUMNS else 'd'}", v))
            if v is not None:
                cols[f] = v
        const = {k: tuple(d[k]) if isinstance(d.get(k), list) else d[k] for k in SERIES_CONSTANTS if k in d}
        for j in range(n):
            kw: dict[str, Any] = {"host": host, **const, **{f: v[j] for f, v in cols.items()}}
            if "xid_errors" in d:
                kw["xid_errors"] = d["xid_errors"][j]
            if "processes" in d:
                kw["processes"] = d["processes"][j]
            out.append(GpuSample.from_dict(kw))
    return out
