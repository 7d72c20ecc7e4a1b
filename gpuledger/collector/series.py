"""One validated series: a GPU's samples of one batch as numpy columns (see ``agent.wire`` for the layout).

The collector folds, stores and packs a series a column at a time; ``rows()`` turns it into GpuSamples
only where a sample at a time is needed (late or out-of-order samples, sinks, tests).

A series the validator took from an agent's msgpack body keeps its columns as the body's bytes (``wire``:
field -> n little-endian 8-byte values, all present): the ingest path stacks those bytes straight into the
matrices it folds and into the batch's stored chunk, and the per-field arrays (``floats``, ``ints``) are made
only when something asks for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuledger.schema.records import SAMPLE_FIELDS, GpuProcess, GpuSample
from gpuledger.schema.wire import FLOAT_COLUMNS, INT_COLUMNS, ROW_LISTS

_NONE: dict[str, Any] = {}
_INT_COLUMNS = frozenset(INT_COLUMNS)


class Series:
    """``floats``: field -> float64 array, NaN where not reported (validated values are never NaN);
    ``ints``: field -> (int64 array, present mask or None when all present); ``lists``: field -> one tuple
    per row (``xid_errors``: ints, ``processes``: GpuProcess). Fields never reported are absent.
    ``wire``: field -> the column's bytes as the agent sent them (ts excluded), or None for a series made
    from arrays."""

    __slots__ = ("host", "gpu_uuid", "gpu_index", "model", "mig", "source", "job_ids", "job_shares",
                 "n", "ts", "_floats", "_ints", "lists", "wire")

    def __init__(self, host: str, gpu_uuid: str, gpu_index: int, ts: np.ndarray, *, model: str = "",
                 mig: str | None = None, source: str = "", job_ids: tuple[str, ...] = (),
                 job_shares: tuple[float, ...] = (), floats: Mapping[str, np.ndarray] = _NONE,
                 ints: Mapping[str, tuple[np.ndarray, np.ndarray | None]] = _NONE,
                 lists: Mapping[str, tuple] = _NONE, wire: dict[str, bytes] | None = None) -> None:
        self.host, self.gpu_uuid, self.gpu_index = host, gpu_uuid, gpu_index
        self.model, self.mig, self.source = model, mig, source
        self.job_ids, self.job_shares = job_ids, job_shares
        self.n = len(ts)
        self.ts = ts
        self.wire = wire
        if wire is None:
            self._floats: dict[str, np.ndarray] | None = dict(floats)
            self._ints: dict[str, tuple[np.ndarray, np.ndarray | None]] | None = dict(ints)
        else:  # made from ``wire`` when first asked for
            self._floats = self._ints = None
        self.lists = dict(lists)

    @classmethod
    def of_wire(cls, host: str, gpu_uuid: str, gpu_index: int, ts: np.ndarray, model: str, mig: str | None,
                source: str, job_ids: tuple[str, ...], job_shares: tuple[float, ...], lists: dict[str, tuple],
                wire: dict[str, bytes]) -> Series:
        """A series over an agent body's column bytes (the validator's, once it checked them): ``__init__`` without
        its copies, for the ingest path's few microseconds a series."""
        s = cls.__new__(cls)
        s.host, s.gpu_uuid, s.gpu_index, s.ts, s.n = host, gpu_uuid, gpu_index, ts, len(ts)
        s.model, s.mig, s.source, s.job_ids, s.job_shares = model, mig, source, job_ids, job_shares
        s.lists, s.wire, s._floats, s._ints = lists, wire, None, None
        return s

    @property
    def floats(self) -> dict[str, np.ndarray]:
        if self._floats is None:
            self._decode_wire()
        assert self._floats is not None
        return self._floats

    @property
    def ints(self) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        if self._ints is None:
            self._decode_wire()
        assert self._ints is not None
        return self._ints

    def _decode_wire(self) -> None:
        assert self.wire is not None
        floats: dict[str, np.ndarray] = {}
        ints: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        for f, raw in self.wire.items():
            if f in _INT_COLUMNS:
                ints[f] = (np.frombuffer(raw, dtype="<i8"), None)
            else:
                floats[f] = np.frombuffer(raw, dtype="<f8")
        self._floats, self._ints = floats, ints

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.host, self.gpu_uuid, self.mig or "")

    def float_col(self, f: str) -> np.ndarray:
        """A float field as float64 with NaN where absent (all NaN when never reported)."""
        a = self.floats.get(f)
        return np.full(self.n, np.nan) if a is None else a

    def slice(self, a: int, b: int) -> Series:
        return Series(self.host, self.gpu_uuid, self.gpu_index, self.ts[a:b], model=self.model, mig=self.mig,
                      source=self.source, job_ids=self.job_ids, job_shares=self.job_shares,
                      floats={f: v[a:b] for f, v in self.floats.items()},
                      ints={f: (v[a:b], None if m is None else m[a:b]) for f, (v, m) in self.ints.items()},
                      lists={f: v[a:b] for f, v in self.lists.items()})

    def column(self, f: str) -> list:
        """One field as a list of n Python values (None where absent)."""
        if f in self.floats:
            vals = self.floats[f].tolist()
            total = sum(vals)  # NaN when any value is: a C loop, cheaper than np.isnan(a).any() on a few values
            return [None if v != v else v for v in vals] if total != total else vals
        if f in self.ints:
            v, m = self.ints[f]
            vals = v.tolist()
            if m is None:
                return vals
            return [x if p else None for x, p in zip(vals, m.tolist())]
        if f in self.lists:
            return list(self.lists[f])
        return []

    def rows(self) -> list[GpuSample]:
        n = self.n
        const = {"host": self.host, "gpu_uuid": self.gpu_uuid, "gpu_index": self.gpu_index, "model": self.model,
                 "mig": self.mig, "source": self.source, "job_ids": self.job_ids, "job_shares": self.job_shares}
        cols = []
        for f in SAMPLE_FIELDS:
            if f == "ts":
                cols.append(self.ts.tolist())
            elif f in const:
                cols.append([const[f]] * n)
            elif f in self.floats or f in self.ints or f in self.lists:
                cols.append(self.column(f))
            else:
                cols.append([GpuSample.__dataclass_fields__[f].default] * n)
        return [GpuSample(*r) for r in zip(*cols)]


def series_from_samples(samples: list[GpuSample]) -> Series:
    """One GPU's samples with the same constants (host, uuid, index, model, mig, source, jobs) as a Series."""
    s0 = samples[0]
    floats = {}
    for f in FLOAT_COLUMNS:
        if f == "ts":
            continue
        vals = [getattr(s, f) for s in samples]
        if vals.count(None) != len(vals):
            floats[f] = np.array([np.nan if v is None else v for v in vals], dtype=np.float64)
    ints = {}
    for f in INT_COLUMNS:
        vals = [getattr(s, f) for s in samples]
        k = vals.count(None)
        if k == len(vals):
            continue
        mask = None if not k else np.array([v is not None for v in vals])
        ints[f] = (np.array([0 if v is None else v for v in vals], dtype=np.int64), mask)
    lists: dict[str, tuple] = {}
    for f in ("xid_errors", "processes"):
        per_row = tuple(getattr(s, f) for s in samples)
        if any(per_row):
            lists[f] = per_row
    return Series(s0.host, s0.gpu_uuid, s0.gpu_index, np.array([s.ts for s in samples], dtype=np.float64),
                  model=s0.model, mig=s0.mig, source=s0.source, job_ids=s0.job_ids, job_shares=s0.job_shares,
                  floats=floats, ints=ints, lists=lists)


def plain_row_lists(lists: Mapping[str, tuple]) -> dict[str, list]:
    """A series' row lists (``Series.lists``) as msgpack packs them, in ``ROW_LISTS`` order: per row, xid_errors a
    list of ints, processes a list of :meth:`GpuProcess.to_wire` rows."""
    out: dict[str, list] = {}
    for name in ROW_LISTS:
        if name in lists:
            out[name] = ([[p.to_wire() for p in r] for r in lists[name]] if name == "processes"
                         else [list(x) for x in lists[name]])
    return out


def row_list(name: str, plain: Iterable[Sequence]) -> tuple:
    """One row list from its plain form (:func:`plain_row_lists`, the wire's): a tuple a row, processes of
    GpuProcess."""
    if name == "processes":
        return tuple(tuple(map(GpuProcess.from_wire, r)) for r in plain)
    return tuple(map(tuple, plain))
