"""Compressed columnar chunks: how raw samples and rollups sit on disk.

A chunk holds ``n`` rows of named columns. Each numeric column is encoded losslessly the way
time-series databases do it, then the whole chunk goes through zstd once:

* floats that are exactly ``m / 10**k`` for small integers ``m`` (timestamps in ms, one-decimal
  watts, ...) are stored as the integers ``m`` (checked bit for bit, so decoding is exact);
* integer columns are delta- or delta-of-delta-encoded (counters and regular timestamps become
  tiny), zig-zagged, narrowed to the fewest bytes that hold them and byte-shuffled so that zstd sees
  runs of equal high bytes;
* other floats are XORed with their predecessor (Gorilla) and byte-shuffled;
* ``None`` is a bit mask (omitted when a column has none); other values (strings, tuples) are
  run-length encoded and msgpacked, because per GPU they rarely change (model, job ids).

Every transformation is exact, so ``decode(encode(x)) == x``; the tests check it on random data.

Small chunks (an agent's batch holds one or a few samples per GPU) are written in a light form instead: the
columns as plain msgpack lists, zstd-compressed. Per-column numpy work costs far more than it saves on a handful
of rows; compaction merges the small chunks of an interval into one columnar chunk, and readers accept both.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zstandard

from agent.records import SAMPLE_FIELDS, GpuProcess, GpuSample

VERSION = 1
LIGHT = 2  # the light form of small chunks
LIGHT_MAX_ROWS = 64
FLOAT, INT, OBJ = "f", "i", "o"
_U64 = np.uint64
_MAX_EXACT = float(2**53)
_ZC = zstandard.ZstdCompressor(level=3)
_ZD = zstandard.ZstdDecompressor()
_HDR = struct.Struct("<I")


# -- numeric encodings -------------------------------------------------------------------------
def _shuffle(x: np.ndarray) -> tuple[int, bytes]:
    """Zig-zagged uint64 -> (byte width, byte-plane-major bytes of the narrowest unsigned type)."""
    top = int(x.max()) if x.size else 0
    w = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
    narrow = x.astype(f"<u{w}", copy=False)
    return w, narrow.view(np.uint8).reshape(-1, w).T.tobytes()


def _unshuffle(buf: bytes, w: int, n: int) -> np.ndarray:
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(w, n)
    return np.ascontiguousarray(planes.T).view(f"<u{w}").reshape(n).astype(_U64)


def _zigzag(x: np.ndarray) -> np.ndarray:
    return ((x << 1) ^ (x >> 63)).view(_U64)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return ((z >> _U64(1)) ^ (-(z & _U64(1)).view(np.int64)).view(_U64)).view(np.int64)


def _encode_ints(x: np.ndarray) -> tuple[list, bytes]:
    """int64 -> (meta, bytes): the delta order (0, 1 or 2) that leaves the smallest numbers."""
    if not x.size:
        return [0, 1], b""
    best: tuple[int, np.ndarray] | None = None
    cur = x
    for order in range(3):
        if order:
            prev = cur
            cur = prev.copy()
            cur[1:] -= prev[:-1]  # wraps like the decoder's cumsum: exact
        size = int(np.abs(cur).max())
        if best is None or size < best[0]:
            best, chosen = (size, cur), order
    assert best is not None
    w, data = _shuffle(_zigzag(best[1]))
    return [chosen, w], data


def _decode_ints(meta: list, buf: bytes, n: int) -> np.ndarray:
    order, w = meta
    x = _unzigzag(_unshuffle(buf, w, n))
    for _ in range(order):
        x = np.cumsum(x, dtype=np.int64)
    return x


def _decimal_scale(v: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The smallest k in 0..9 with v == rint(v * 10**k) / 10**k bit for bit, and those integers."""
    if not v.size:
        return 0, np.zeros(0, dtype=np.int64)
    bits = v.view(_U64)
    for k in range(10):
        p = 10.0**k
        m = np.rint(v * p)
        if m.size and not np.abs(m).max() < _MAX_EXACT:
            return None
        mi = m.astype(np.int64)
        if np.array_equal((mi / p).view(_U64), bits):  # exactly what the decoder computes (-0.0 fails)
            return k, mi
    return None


def _encode_floats(v: np.ndarray) -> tuple[list, bytes]:
    dec = _decimal_scale(v)
    if dec is not None:
        meta, data = _encode_ints(dec[1])
        return ["d", dec[0], *meta], data
    bits = v.view(_U64).copy()
    bits[1:] ^= v.view(_U64)[:-1]
    return ["x"], np.ascontiguousarray(bits).view(np.uint8).reshape(-1, 8).T.tobytes()


def _decode_floats(meta: list, buf: bytes, n: int) -> np.ndarray:
    if meta[0] == "d":
        return _decode_ints(meta[2:], buf, n) / 10.0 ** meta[1]
    x = _unshuffle(buf, 8, n)
    return np.bitwise_xor.accumulate(x).view(np.float64)


# -- columns -----------------------------------------------------------------------------------
def _present(values: Sequence) -> tuple[list | Sequence, bytes | None]:
    absent = values.count(None)  # type: ignore[attr-defined]  # lists and tuples: a C-speed scan
    if not absent:
        return values, None
    if absent == len(values):
        return [], np.packbits(np.zeros(len(values), dtype=bool)).tobytes()
    mask = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    return [v for v in values if v is not None], np.packbits(mask).tobytes()


def _rle(values: Sequence) -> list:
    # the usual case, one value throughout (model, job ids of a GPU), checked at C speed
    if values and values.count(values[0]) == len(values) and len(set(map(type, values))) == 1:  # type: ignore[attr-defined]
        return [[values[0], len(values)]]
    runs: list = []
    prev: Any = object()
    for v in values:
        if v == prev and type(v) is type(prev):
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
            prev = v
    return runs


def _encode_light(n: int, columns: Sequence[tuple]) -> bytes | None:
    """The light form, or None where it does not apply (numpy columns, or an int msgpack cannot hold)."""
    meta = []
    for name, kind, values, *_rest in columns:
        if isinstance(values, np.ndarray) or len(values) != n:
            return None
        meta.append([name, kind, values])
    try:
        header = msgpack.packb([LIGHT, n, meta], use_bin_type=True)
    except (OverflowError, TypeError):
        return None
    return _ZC.compress(_HDR.pack(len(header)) + header)


def _decode_light(n: int, meta: list) -> dict[str, tuple[str, Any, np.ndarray | None]]:
    out: dict[str, tuple[str, Any, np.ndarray | None]] = {}
    for name, kind, values in meta:
        if kind != OBJ:
            present = [v for v in values if v is not None]
            try:
                arr = np.array(present, dtype=np.float64 if kind == FLOAT else np.int64)
            except OverflowError:  # an integer beyond int64 stays exact as a generic column
                out[name] = (OBJ, values, None)
                continue
            mask = None if len(present) == n else np.array([v is not None for v in values], dtype=bool)
            out[name] = (kind, arr, mask)
        else:
            out[name] = (OBJ, values, None)
    return out


def encode_columns(n: int, columns: Sequence[tuple], light: bool | None = None) -> bytes:
    """Columns are (name, kind, values) or (name, kind, present_values_array, present_mask) with kind
    FLOAT, INT or OBJ; ``values`` has ``n`` entries (None where absent); the array form holds only the
    present rows and ``present_mask`` (bool, length n) says which, or is None when all are present."""
    if light or (light is None and n <= LIGHT_MAX_ROWS):  # None: light for small chunks
        blob = _encode_light(n, columns)
        if blob is not None:
            return blob
    meta: list = []
    parts: list[bytes] = []
    for name, kind, values, *rest in columns:
        if kind == OBJ:
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values, expected {n}")
            data = msgpack.packb(_rle(values), use_bin_type=True)
            meta.append([name, OBJ, None, [], len(data)])
            parts.append(data)
            continue
        if isinstance(values, np.ndarray):
            arr, mask_arr = values, (rest[0] if rest else None)
            if (n if mask_arr is None else int(mask_arr.sum())) != arr.size or (mask_arr is not None and mask_arr.size != n):
                raise ValueError(f"column {name!r}: {arr.size} present values do not fit its mask of {n} rows")
            mask = None if mask_arr is None or mask_arr.all() else np.packbits(mask_arr).tobytes()
        else:
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values, expected {n}")
            present, mask = _present(values)
            try:
                arr = np.array(present, dtype=np.float64 if kind == FLOAT else np.int64)
            except OverflowError:  # an integer beyond int64: keep it exact as a generic column
                data = msgpack.packb(_rle(values), use_bin_type=True)
                meta.append([name, OBJ, None, [], len(data)])
                parts.append(data)
                continue
        m, data = _encode_floats(arr.astype(np.float64, copy=False)) if kind == FLOAT else _encode_ints(arr)
        if mask is not None:
            parts.append(mask)
        parts.append(data)
        meta.append([name, kind, None if mask is None else len(mask), m, len(data)])
    header = msgpack.packb([VERSION, n, meta], use_bin_type=True)
    return _ZC.compress(_HDR.pack(len(header)) + header + b"".join(parts))


def decode_columns(blob: bytes) -> tuple[int, dict[str, tuple[str, Any, np.ndarray | None]]]:
    """-> (n, {name: (kind, values, present_mask)}). Numeric values are numpy arrays holding only the
    present rows (``present_mask`` is None when every row is present); OBJ values are lists."""
    raw = _ZD.decompress(blob)
    (hlen,) = _HDR.unpack_from(raw)
    version, n, meta = msgpack.unpackb(raw[4:4 + hlen], raw=False, use_list=True)
    if version == LIGHT:
        return n, _decode_light(n, meta)
    if version != VERSION:
        raise ValueError(f"chunk format {version}, this collector reads {VERSION}")
    pos = 4 + hlen
    out: dict[str, tuple[str, Any, np.ndarray | None]] = {}
    for name, kind, mask_len, m, dlen in meta:
        mask = None
        if mask_len is not None:
            mask = np.unpackbits(np.frombuffer(raw, np.uint8, mask_len, pos), count=n).astype(bool)
            pos += mask_len
        buf = raw[pos:pos + dlen]
        pos += dlen
        if kind == OBJ:
            vals: list = []
            for v, c in msgpack.unpackb(buf, raw=False, use_list=True):
                vals.extend([v] * c)
            out[name] = (OBJ, vals, None)
            continue
        k = n if mask is None else int(mask.sum())
        arr = _decode_floats(m, buf, k) if kind == FLOAT else _decode_ints(m, buf, k)
        out[name] = (kind, arr, mask)
    return n, out


def column_list(n: int, col: tuple[str, Any, np.ndarray | None]) -> list:
    """A decoded column as a Python list with None for absent rows."""
    kind, vals, mask = col
    if kind == OBJ:
        return vals
    lst = vals.tolist()
    if mask is None:
        return lst
    out: list = [None] * n
    for i, v in zip(np.flatnonzero(mask).tolist(), lst):
        out[i] = v
    return out


def column_floats(n: int, col: tuple[str, Any, np.ndarray | None]) -> np.ndarray:
    """A decoded numeric column as float64 with NaN for absent rows (for rollups)."""
    kind, vals, mask = col
    if kind == OBJ:
        return np.array([np.nan if v is None else v for v in vals], dtype=np.float64)
    if mask is None:
        return vals.astype(np.float64, copy=False)
    out = np.full(n, np.nan)
    out[mask] = vals
    return out


# -- raw samples -------------------------------------------------------------------------------
# host, gpu_uuid and mig are the chunk's key, so they are not stored per row.
_KEY = ("host", "gpu_uuid", "mig")
_KIND = {"float": FLOAT, "float | None": FLOAT, "int": INT, "int | None": INT}
_TYPES = {f.name: str(f.type) for f in GpuSample.__dataclass_fields__.values()}
ROW_FIELDS: tuple[str, ...] = tuple(f for f in SAMPLE_FIELDS if f not in _KEY)
ROW_KINDS: dict[str, str] = {f: _KIND.get(_TYPES[f], OBJ) for f in ROW_FIELDS}
# Numeric sample fields other than the time: what rollups summarise.
NUMERIC_FIELDS: tuple[str, ...] = tuple(f for f in ROW_FIELDS if ROW_KINDS[f] != OBJ and f not in ("ts", "gpu_index"))
_GETS = [operator.attrgetter(f) for f in ROW_FIELDS]
_PROC = ROW_FIELDS.index("processes")
_DEFAULTS = {f: GpuSample.__dataclass_fields__[f].default for f in ROW_FIELDS}


def encode_samples(samples: Sequence[GpuSample], light: bool | None = None) -> bytes:
    """One GPU's samples (any order) -> a chunk (``light``: None = by size). Tuples are stored as lists."""
    cols = [list(map(g, samples)) for g in _GETS]  # per-field map: cheaper than transposing row tuples
    procs = cols[_PROC]
    if any(procs):
        cols[_PROC] = tuple([[p.pid, p.used_memory_bytes] for p in ps] for ps in procs)
    return encode_columns(len(samples), [(f, ROW_KINDS[f], c) for f, c in zip(ROW_FIELDS, cols)], light)


def decode_samples(blob: bytes, host: str, gpu_uuid: str, mig: str | None) -> list[GpuSample]:
    n, cols = decode_columns(blob)
    values: list[Any] = []
    for f in SAMPLE_FIELDS:
        if f == "host":
            values.append([host] * n)
        elif f == "gpu_uuid":
            values.append([gpu_uuid] * n)
        elif f == "mig":
            values.append([mig] * n)
        elif f not in cols:  # a field added after this chunk was written
            values.append([_DEFAULTS[f]] * n)
        else:
            vals = column_list(n, cols[f])
            if f == "processes":
                vals = [tuple(GpuProcess(p[0], p[1]) for p in ps) if ps else () for ps in vals]
            elif ROW_KINDS[f] == OBJ and isinstance(_DEFAULTS[f], tuple):
                vals = [tuple(v) for v in vals]
            values.append(vals)
    return [GpuSample(*row) for row in zip(*values)]


def decode_arrays(blob: bytes, fields: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(ts, {field: float64 with NaN for None}) straight from a raw chunk, without sample objects."""
    n, cols = decode_columns(blob)
    ts = column_floats(n, cols["ts"])
    return ts, {f: column_floats(n, cols[f]) if f in cols else np.full(n, np.nan) for f in fields}


def merge_chunks(blobs: Sequence[bytes]) -> tuple[bytes, int, float, float]:
    """Several chunks of one series -> one chunk sorted by ``ts`` (columns missing from older chunks
    become absent). Works on columns, never on sample objects. -> (chunk, rows, first ts, last ts)."""
    decoded = [decode_columns(b) for b in blobs]
    total = sum(n for n, _ in decoded)
    names: dict[str, str] = {}
    for _, cols in decoded:
        for name, (kind, _v, _m) in cols.items():
            names.setdefault(name, kind)
    full: dict[str, tuple[Any, np.ndarray]] = {}
    for name, kind in names.items():
        if kind == OBJ or any(name in cols and cols[name][0] == OBJ for _, cols in decoded):
            vals: list = []
            for n, cols in decoded:
                vals.extend(column_list(n, cols[name]) if name in cols else [None] * n)
            full[name] = (OBJ, vals)
            continue
        dtype = np.float64 if kind == FLOAT else np.int64
        arrs, masks = [], []
        for n, cols in decoded:
            a = np.zeros(n, dtype=dtype)
            m = np.zeros(n, dtype=bool)
            if name in cols:
                _k, v, mk = cols[name]
                m[:] = True if mk is None else mk
                a[m] = v
            arrs.append(a)
            masks.append(m)
        full[name] = (np.concatenate(arrs), np.concatenate(masks))
    ts_arr, ts_mask = full["ts"]
    order = np.argsort(ts_arr, kind="stable")
    out = []
    for name, kind in names.items():
        if isinstance(full[name][0], str):  # (OBJ, values)
            vals = full[name][1]  # also a numeric column that fell back to OBJ in some chunk
            out.append((name, OBJ, [vals[i] for i in order.tolist()]))
            continue
        a, m = full[name]
        a, m = a[order], m[order]
        out.append((name, kind, a[m], m))
    ts_sorted = ts_arr[order]
    return encode_columns(total, out), total, float(ts_sorted[0]), float(ts_sorted[-1])
