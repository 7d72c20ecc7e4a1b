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

``encode_series_many`` writes the chunks of a batch's series (one per GPU) byte for byte as ``encode_series``
does, but encodes the numeric columns of equal-length series together, as the rows of 2-D arrays.

So the numeric encodings have two implementations, and production needs both. The 1-D encoders
(``_encode_ints``, ``_encode_floats``, ``_decimal_scale``) are the reference; they encode every column
that stands alone (merged chunks, rollups, samples that arrived late or out of order, columns with
absent values). The 2-D ones (``_encode_ints_rows``, ``_encode_floats_rows``, ``_decimal_scale_rows``)
encode a batch's GPUs at once, paying numpy's per-call cost once per block instead of once per column
(2.5x faster per batch, ``bench/chunk_encode.py``). ``tests/collector/test_chunks.py`` checks that they
give the same bytes.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import zstandard

from gpuledger.collector.series import Series, plain_row_lists, row_list
from gpuledger.schema.records import SAMPLE_FIELDS, GpuProcess, GpuSample
from gpuledger.schema.wire import ROW_LISTS

VERSION = 1
LIGHT = 2  # the light form of small chunks
LIGHT_MAX_ROWS = 64
FLOAT, INT, OBJ = "f", "i", "o"
_U64 = np.uint64
_MAX_EXACT = float(2**53)
# zstandard's (de)compressors are not thread-safe: each call takes one from a pool and gives it back. Not one per
# thread: the collector serves each connection on a thread of its own, and thousands of threads each kept their
# own contexts (hundreds of KB each) as they came to write a group commit.
_COMPRESSORS: list[zstandard.ZstdCompressor] = []
# Host chunks live until the next compaction splits them: zstd's fast level -1 (13 us for an agent's 80-sample
# batch against 23 us at level 3, for 9% more bytes) is what ingest pays.
_FAST_COMPRESSORS: list[zstandard.ZstdCompressor] = []
_HOST_CHUNK_LEVEL = -1
_DECOMPRESSORS: list[zstandard.ZstdDecompressor] = []
_HDR = struct.Struct("<I")
_POW10 = [10.0**k for k in range(10)]  # the scales a decimal column may have
_HEAD = 4  # first values from which _decimal_scale proves where to start
# Values per block of encode_series_many: more rows a block, less overhead a row, but each temporary stays
# in cache and under malloc's mmap threshold (128 KiB; a fresh mapping per temporary costs page faults).
_BLOCK = 16384


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


def _scale_floor(head: Sequence[float]) -> int | None:
    """A start for :func:`_decimal_scale` from a column's first values, in scalar arithmetic (the same IEEE
    operations as numpy's): the smallest k at which all of them fit. Every smaller k fails for one of them,
    so for the column too; None where they prove the column has no scale (one overflows 2**53 before it
    fits, or none fits by k = 9). The column is then checked at that k, usually the answer."""
    k = 0
    for x in head:
        while True:  # k only grows: a k that fails for one value fails for the column
            if k > 9:
                return None
            p = _POW10[k]
            y = x * p
            if not abs(y) < _MAX_EXACT:  # NaN and infinities too; |y| < 2**53 <=> |rint(y)| < 2**53
                return None
            if round(y) / p == x and (x or math.copysign(1.0, x) > 0):  # bit for bit: -0.0 fails
                break
            k += 1
    return k


def _decimal_scale(v: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The smallest k in 0..9 with v == rint(v * 10**k) / 10**k bit for bit, and those integers."""
    if not v.size:
        return 0, np.zeros(0, dtype=np.int64)
    start = _scale_floor(v[:_HEAD].tolist())
    if start is None:
        return None
    hi, lo = float(v.max()), float(v.min())
    if hi != hi:  # NaN
        return None
    top = max(hi, -lo)
    bits = v.view(_U64)
    for k in range(start, 10):
        p = _POW10[k]
        # max|rint(v * p)| < 2**53 <=> max|v| * p < 2**53 (rounding is monotonic), and nothing overflows;
        # it grows with k: had a smaller k overflowed, so would this one
        if not top * p < _MAX_EXACT:
            return None
        mi = np.rint(v * p).astype(np.int64)
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


# -- the same, for the rows of a 2-D array (encode_series_many) -----------------------------------
# A row is one chunk's column; a block holds the same fields of several chunks. Row by row these functions
# give exactly what the 1-D ones above give (the tests compare them), but numpy's per-call overhead, most of
# what the 1-D path costs on a few hundred values, is paid once per block instead of once per column.
def _planes(a: np.ndarray) -> list[bytes]:
    """Each row of ``a`` (r x n, C-contiguous, little-endian) laid out as :func:`_shuffle` does: byte
    plane after byte plane."""
    r, n = a.shape
    w = a.dtype.itemsize
    buf = a.view(np.uint8).reshape(r, n, w).transpose(0, 2, 1).tobytes()
    return [buf[i * n * w:(i + 1) * n * w] for i in range(r)]


def _deltas(x: np.ndarray, op: np.ufunc = np.subtract) -> np.ndarray:
    """Each row's first value, then ``op`` of each value and its predecessor (subtract wraps, as in
    _encode_ints). ``op`` runs over the flat array, one contiguous pass, then the rows' first values go back."""
    flat = x.reshape(-1)
    out = np.empty_like(flat)
    op(flat[1:], flat[:-1], out=out[1:])
    out[::x.shape[1]] = flat[::x.shape[1]]
    return out.reshape(x.shape)


def _encode_ints_rows(x: np.ndarray) -> list[tuple[list, bytes]]:
    """:func:`_encode_ints` of each row of ``x`` (r x n int64, n >= 1)."""
    if not len(x):
        return []
    d1 = _deltas(x)
    cands = (x, d1, _deltas(d1))  # delta orders 0, 1, 2
    hi = np.array([np.maximum.reduce(c, axis=1) for c in cands])  # (the ufuncs skip ndarray.max's wrapper)
    lo = np.array([np.minimum.reduce(c, axis=1) for c in cands])
    his, los = hi.tolist(), lo.tolist()
    if min(map(min, los)) > -(2**63):
        sizes = np.maximum(hi, -lo)  # max |value|
    else:  # np.abs leaves -2**63 negative: take the sizes exactly as _encode_ints does
        sizes = np.array([np.maximum.reduce(np.abs(c), axis=1) for c in cands])
    orders = sizes.argmin(axis=0).tolist()  # the first minimum: ties go to the lowest order, like `<` there
    high = [his[o][i] for i, o in enumerate(orders)]
    low = [los[o][i] for i, o in enumerate(orders)]
    # a row's largest zig-zagged value is that of its largest or of its smallest value
    top = [max(2 * h if h >= 0 else -2 * h - 1, 2 * lw if lw >= 0 else -2 * lw - 1) for h, lw in zip(high, low)]
    widths = [1 if t < 1 << 8 else 2 if t < 1 << 16 else 4 if t < 1 << 32 else 8 for t in top]
    chosen = cands[orders[0]] if len(set(orders)) == 1 else np.array([cands[o][i] for i, o in enumerate(orders)])
    data: list[bytes] = [b""] * len(x)
    for w in set(widths):
        rows = [i for i, wi in enumerate(widths) if wi == w]
        # the values fit in w signed bytes: narrow first, then zig-zag (the same low bytes, less work)
        c = (chosen if len(rows) == len(x) else chosen[rows]).astype(f"<i{w}", copy=False)
        z = c.view(f"<u{w}") << 1
        if min(low[i] for i in rows) < 0:  # (x >> 63 is 0 where x >= 0)
            z ^= (c >> (8 * w - 1)).view(f"<u{w}")
        for i, b in zip(rows, _planes(z)):
            data[i] = b
    return [([o, w], b) for o, w, b in zip(orders, widths, data)]


def _decimal_scale_rows(v: np.ndarray, floors: list[int | None], top: list[float],
                        out: np.ndarray) -> list[int | None]:
    """:func:`_decimal_scale` of each row of ``v`` (r x n float64, n >= 1) -> each row's k (None: no
    scale), the integers into ``out`` (r x n int64; undefined in rows without a scale). ``floors``: each
    row's _scale_floor, where its loop starts; ``top``: each row's max |v|. A row moves on to its next k
    only where it fails, as in the 1-D loop; usually the first pass settles every row."""
    ks = list(floors)
    bits = v.view(_U64)
    todo = [i for i, k in enumerate(ks) if k is not None]
    while todo:
        for i in todo:
            # max|rint(v * p)| < 2**53 <=> max|v| * p < 2**53 (rounding is monotonic; NaN fails both)
            if not top[i] * _POW10[ks[i]] < _MAX_EXACT:  # type: ignore[index]
                ks[i] = None  # overflows at this k: no scale (and what does not fit is never cast)
        todo = [i for i in todo if ks[i] is not None]
        if not todo:
            break
        whole = len(todo) == len(ks)
        mi = out if whole else np.empty((len(todo), v.shape[1]), dtype=np.int64)
        if all(ks[i] == 0 for i in todo):
            # v * 1.0 is v and an exact integer / 1.0 its float; rint can go too: where v is a whole
            # number truncating is rounding, and elsewhere the row fails either way
            np.copyto(mi, v if whole else v[todo], casting="unsafe")
            back = mi.astype(np.float64)
        else:
            p = np.array([_POW10[ks[i]] for i in todo])[:, None]  # type: ignore[index]
            np.copyto(mi, np.rint((v if whole else v[todo]) * p), casting="unsafe")
            back = mi / p
        same = np.logical_and.reduce(back.view(_U64) == (bits if whole else bits[todo]), axis=1).tolist()
        if whole and all(same):
            break
        if not whole:
            out[[i for i, ok in zip(todo, same) if ok]] = mi[same]
        for i, ok in zip(todo, same):
            if not ok:
                ks[i] = None if ks[i] == 9 else ks[i] + 1  # type: ignore[operator]
        todo = [i for i, ok in zip(todo, same) if not ok and ks[i] is not None]
    return ks


def _encode_floats_rows(v: np.ndarray, floors: list[int | None], top: list[float]) -> list[tuple[list, bytes]]:
    """:func:`_encode_floats` of each row of ``v`` (r x n float64), given each row's floor and max |v|."""
    if not len(v):
        return []
    ints = np.empty(v.shape, dtype=np.int64)
    ks = _decimal_scale_rows(v, floors, top, ints)
    out: list[tuple[list, bytes]] = [([], b"")] * len(v)
    dec = [i for i, k in enumerate(ks) if k is not None]
    for i, (meta, data) in zip(dec, _encode_ints_rows(ints if len(dec) == len(v) else ints[dec])):
        out[i] = (["d", ks[i], *meta], data)
    xor = [i for i, k in enumerate(ks) if k is None]
    if xor:  # each value XOR its predecessor
        for i, data in zip(xor, _planes(_deltas(v[xor].view(_U64), np.bitwise_xor))):
            out[i] = (["x"], data)
    return out


# -- columns -----------------------------------------------------------------------------------
# ``values`` of a column encoded beforehand, without absent rows: (name, kind, _ENCODED, meta, data). The
# numeric columns of encode_series_many and constant OBJ columns (meta []) come this way.
_ENCODED = object()
_Encoded = tuple[list, bytes]  # (meta, data)


def _present(values: Sequence) -> tuple[list | Sequence, bytes | None]:
    absent = values.count(None)  # lists and tuples: a C-speed scan
    if not absent:
        return values, None
    if absent == len(values):
        return [], np.packbits(np.zeros(len(values), dtype=bool)).tobytes()
    mask = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    return [v for v in values if v is not None], np.packbits(mask).tobytes()


def _rle(values: Sequence) -> list:
    # the usual case, one value throughout (model, job ids of a GPU), checked at C speed
    if values and values.count(values[0]) == len(values) and len(set(map(type, values))) == 1:
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
        if values is _ENCODED or isinstance(values, np.ndarray) or len(values) != n:
            return None
        meta.append([name, kind, values])
    try:
        header = msgpack.packb([LIGHT, n, meta], use_bin_type=True)
    except (OverflowError, TypeError):
        return None
    return _compress(_HDR.pack(len(header)) + header)


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
    present rows and ``present_mask`` (bool, length n) says which, or is None when all are present.
    (Internally a column may also come encoded: see _ENCODED.)"""
    if light or (light is None and n <= LIGHT_MAX_ROWS):  # None: light for small chunks
        blob = _encode_light(n, columns)
        if blob is not None:
            return blob
    meta: list = []
    parts: list[bytes] = []
    for name, kind, values, *rest in columns:
        if values is _ENCODED:
            m, data = rest
            meta.append([name, kind, None, m, len(data)])
            parts.append(data)
            continue
        if kind == OBJ:
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values, expected {n}")
            data = msgpack.packb(_rle(values), use_bin_type=True)
            meta.append([name, OBJ, None, [], len(data)])
            parts.append(data)
            continue
        if isinstance(values, np.ndarray):
            arr, mask_arr = values, (rest[0] if rest else None)
            n_present = n if mask_arr is None else int(mask_arr.sum())
            if n_present != arr.size or (mask_arr is not None and mask_arr.size != n):
                raise ValueError(f"column {name!r}: {arr.size} present values do not fit its mask of {n} rows")
            mask = None if mask_arr is None or mask_arr.all() else np.packbits(mask_arr).tobytes()
        else:
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values, expected {n}")
            present_values, mask = _present(values)
            try:
                arr = np.array(present_values, dtype=np.float64 if kind == FLOAT else np.int64)
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
    return _compress(b"".join([_HDR.pack(len(header)), header, *parts]))  # one copy of the parts


def _compress(data: bytes, pool: list[zstandard.ZstdCompressor] = _COMPRESSORS, level: int = 3) -> bytes:
    try:
        zc = pool.pop()  # list.pop and append are atomic: no two threads get one compressor
    except IndexError:
        zc = zstandard.ZstdCompressor(level=level)
    try:
        return zc.compress(data)
    finally:
        pool.append(zc)


def _decompress(blob: bytes) -> bytes:
    try:
        zd = _DECOMPRESSORS.pop()
    except IndexError:
        zd = zstandard.ZstdDecompressor()
    try:
        return zd.decompress(blob)
    finally:
        _DECOMPRESSORS.append(zd)


def decode_columns(blob: bytes) -> tuple[int, dict[str, tuple[str, Any, np.ndarray | None]]]:
    """-> (n, {name: (kind, values, present_mask)}). Numeric values are numpy arrays holding only the
    present rows (``present_mask`` is None when every row is present); OBJ values are lists."""
    raw = _decompress(blob)
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
    cols: list[Sequence[Any]] = [list(map(g, samples)) for g in _GETS]  # cheaper than transposing row tuples
    procs = cols[_PROC]
    if any(procs):
        cols[_PROC] = tuple([p.to_wire() for p in ps] for ps in procs)
    return encode_columns(len(samples), [(f, ROW_KINDS[f], c) for f, c in zip(ROW_FIELDS, cols)], light)


_CONSTANTS = ("model", "source", "job_ids", "job_shares")
_NOTHING_DONE: dict[tuple[str, str], _Encoded] = {}


def _series_columns(s: Series, light: bool | None,
                    done: dict[tuple[str, str], _Encoded] = _NOTHING_DONE) -> list[tuple]:
    """The columns :func:`encode_columns` gets for a series; ``done``: numeric columns already encoded,
    by (where, field) with where ``"ts"``, ``"floats"``, ``"ints"`` or ``"gpu_index"``."""
    n = s.n
    if light or (light is None and n <= LIGHT_MAX_ROWS):  # small: the light form wants lists
        cols: list[tuple] = [("ts", FLOAT, s.ts.tolist())]
        cols += [(f, ROW_KINDS[f], s.column(f)) for f in (*s.floats, *s.ints)]
        cols.append(("gpu_index", INT, [s.gpu_index] * n))
        cols += [(f, OBJ, [getattr(s, f)] * n) for f in _CONSTANTS]
    else:
        e = done.get(("ts", "ts"))
        cols = [("ts", FLOAT, s.ts, None) if e is None else ("ts", FLOAT, _ENCODED, *e)]
        for f, a in s.floats.items():
            e = done.get(("floats", f))
            if e is None:
                mask = ~np.isnan(a)
                cols.append((f, FLOAT, a, None) if mask.all() else (f, FLOAT, a[mask], mask))
            else:
                cols.append((f, FLOAT, _ENCODED, *e))
        for f, (v, m) in s.ints.items():
            e = done.get(("ints", f))
            if e is None:
                cols.append((f, INT, v, None) if m is None else (f, INT, v[m], m))
            else:
                cols.append((f, INT, _ENCODED, *e))
        g, e = s.gpu_index, done.get(("gpu_index", "gpu_index"))
        if e is not None:
            cols.append(("gpu_index", INT, _ENCODED, *e))
        elif type(g) is int and -(2**63) <= g < 2**63:  # an array is cheaper to make than a list of n ints
            cols.append(("gpu_index", INT, np.full(n, g, dtype=np.int64), None))
        else:  # anything else the generic way (it may become an OBJ column)
            cols.append(("gpu_index", INT, [g] * n))
        # a constant column is one run: what _rle makes of [x] * n, without looking at n values
        cols += [(f, OBJ, _ENCODED, [], msgpack.packb([[getattr(s, f), n]] if n else [], use_bin_type=True))
                 for f in _CONSTANTS]
    cols += [(name, OBJ, rows) for name, rows in plain_row_lists(s.lists).items()]
    return cols


def encode_series(s: Series, light: bool | None = None) -> bytes:
    """A series (one GPU, sorted or not) -> a chunk, straight from its columns: the same chunk that
    :func:`encode_samples` makes of ``s.rows()`` (fields never reported are simply left out)."""
    return encode_columns(s.n, _series_columns(s, light), light)


_F64, _I64, _BOOL = np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_)


def _plain(a: Any, n: int, dtype: np.dtype) -> bool:
    """An array the 2-D path takes as it is (anything else goes the 1-D way, which copes or complains)."""
    return type(a) is np.ndarray and a.dtype == dtype and a.shape == (n,)


def _batchable(group: Sequence[Series], n: int) -> tuple[list[tuple], list[tuple]]:
    """The numeric columns of series of ``n`` rows that the 2-D path takes (complete, plain float64 or
    int64 arrays) as rows (key, series, array), float rows and int rows, a field's rows side by side: they
    tend to share their scale, delta order and width. Keys: (where, field), where ``"ts"``, ``"floats"``,
    ``"ints"`` or ``"gpu_index"`` (whose array is the index itself, filled in later)."""
    cols: dict[tuple[str, str], list[tuple]] = {}
    for j, s in enumerate(group):
        if _plain(s.ts, n, _F64):
            cols.setdefault(("ts", "ts"), []).append((j, s.ts))
        for f, a in s.floats.items():
            if _plain(a, n, _F64):  # absent values (NaN) show only later, in the block
                cols.setdefault(("floats", f), []).append((j, a))
        for f, (a, m) in s.ints.items():
            if _plain(a, n, _I64) and (m is None or (_plain(m, n, _BOOL) and m.all())):
                cols.setdefault(("ints", f), []).append((j, a))
        g = s.gpu_index
        if type(g) is int and -(2**63) <= g < 2**63:
            cols.setdefault(("gpu_index", "gpu_index"), []).append((j, g))
    frows = [(key, j, a) for key, col in cols.items() if key[0] in ("ts", "floats") for j, a in col]
    irows = [(key, j, a) for key, col in cols.items() if key[0] in ("ints", "gpu_index") for j, a in col]
    return frows, irows


def _blocks(rows: list, n: int) -> list[list]:
    """``rows`` in blocks of about equal size, each of at most _BLOCK values (or one row)."""
    if not rows:
        return []
    count = -(-len(rows) // max(1, _BLOCK // n))
    step = -(-len(rows) // count)
    return [rows[b:b + step] for b in range(0, len(rows), step)]


def _encode_group(group: Sequence[Series], n: int) -> list[dict[tuple[str, str], _Encoded]]:
    """The numeric columns of series of ``n`` rows each that can be encoded together, encoded a block of
    rows at a time: per series, {(where, field): (meta, data)}. The rest (columns with absent values, odd
    dtypes) is left to the 1-D path of encode_columns."""
    frows, irows = _batchable(group, n)
    done: list[dict[tuple[str, str], _Encoded]] = [{} for _ in group]
    for block in _blocks(frows, n):
        v = np.array([a for _key, _j, a in block])
        his, los = np.maximum.reduce(v, axis=1).tolist(), np.minimum.reduce(v, axis=1).tolist()  # NaN passes on
        if any(h != h for h in his):  # an absent value: that field needs a mask, the 1-D path (ts is kept whole)
            keep = [i for i, (h, (key, _j, _a)) in enumerate(zip(his, block)) if h == h or key[0] == "ts"]
            block, v = [block[i] for i in keep], v[keep]
            his, los = [his[i] for i in keep], [los[i] for i in keep]
        top = [h if h != h else max(h, -lw) for h, lw in zip(his, los)]  # max |v|, NaN where there is one
        floors = [_scale_floor([a.item(0)]) for _key, _j, a in block]  # one value: now and then a second pass
        for (key, j, _a), e in zip(block, _encode_floats_rows(v, floors, top)):
            done[j][key] = e
    for block in _blocks(irows, n):
        x = np.empty((len(block), n), dtype=np.int64)
        for i, (_key, _j, a) in enumerate(block):
            x[i] = a
        for (key, j, _a), e in zip(block, _encode_ints_rows(x)):
            done[j][key] = e
    return done


def encode_series_many(series: Sequence[Series]) -> list[bytes]:
    """``[encode_series(s) for s in series]``, byte for byte, faster: the complete numeric columns of the
    series with the same number of rows (the GPUs of one batch) are encoded together, as the rows of 2-D
    arrays; each chunk is then assembled and compressed on its own, exactly as encode_series does it."""
    out: list[bytes] = [b""] * len(series)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(series):
        if s.n > LIGHT_MAX_ROWS:
            groups.setdefault(s.n, []).append(i)
        else:  # the light form: no numpy work to share
            out[i] = encode_series(s)
    for n, idx in groups.items():
        group = [series[i] for i in idx]
        for i, s, done in zip(idx, group, _encode_group(group, n)):
            out[i] = encode_columns(n, _series_columns(s, False, done), False)
    return out


def decode_samples(blob: bytes, host: str, gpu_uuid: str, mig: str | None) -> list[GpuSample]:
    return samples_of(*decode_columns(blob), host, gpu_uuid, mig)


def samples_of(n: int, cols: dict[str, tuple[str, Any, np.ndarray | None]], host: str, gpu_uuid: str,
               mig: str | None) -> list[GpuSample]:
    """Decoded raw columns (:func:`decode_columns`, :func:`decode_host_chunk`) as one GPU's samples."""
    values: list[Any] = []
    for f in SAMPLE_FIELDS:
        if f == "host":
            values.append([host] * n)
        elif f == "gpu_uuid":
            values.append([gpu_uuid] * n)
        elif f == "mig":
            values.append([mig] * n)
        elif f not in cols:  # a field added after this chunk was written, or one a series never reported
            values.append([_DEFAULTS[f]] * n)
        else:
            vals = column_list(n, cols[f])
            if f == "processes":
                vals = [tuple(map(GpuProcess.from_wire, ps)) if ps else () for ps in vals]
            elif ROW_KINDS[f] == OBJ and isinstance(_DEFAULTS[f], tuple):
                # None: the row came from a chunk without the column (merged with one that has it)
                vals = [() if v is None else tuple(v) for v in vals]
            values.append(vals)
    return [GpuSample(*row) for row in zip(*values)]


def decode_arrays(blob: bytes, fields: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(ts, {field: float64 with NaN for None}) straight from a raw chunk, without sample objects."""
    return columns_as_floats(*decode_columns(blob), fields)


def columns_as_floats(n: int, cols: dict[str, tuple[str, Any, np.ndarray | None]],
                      fields: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(ts, {field: float64 with NaN for None}) of decoded columns; a field the chunk lacks is all NaN."""
    ts = column_floats(n, cols["ts"])
    return ts, {f: column_floats(n, cols[f]) if f in cols else np.full(n, np.nan) for f in fields}


def merge_chunks(blobs: Sequence[bytes]) -> tuple[bytes, int, float, float]:
    """Several chunks of one series -> one chunk sorted by ``ts`` (columns missing from older chunks
    become absent). Works on columns, never on sample objects. -> (chunk, rows, first ts, last ts)."""
    ((blob, n, t_min, t_max, _),) = merge_columns([decode_columns(b) for b in blobs])
    return blob, n, t_min, t_max


def merge_columns(decoded: Sequence[tuple[int, dict[str, tuple[str, Any, np.ndarray | None]]]],
                  span: float | None = None) -> list[tuple[bytes, int, float, float, float]]:
    """Decoded chunks of one series (:func:`decode_columns`) -> chunks sorted by ``ts``, one per interval of
    ``span`` seconds (all in one when None), columns missing from some chunks absent there. -> (chunk, rows,
    first ts, last ts, interval start or 0.0) per chunk, in time order."""
    total = sum(n for n, _ in decoded)
    names: dict[str, str] = {}
    for _, cols in decoded:
        for name, (kind, _v, _m) in cols.items():
            names.setdefault(name, kind)
    full: dict[str, tuple[Any, Any]] = {}  # (OBJ, values) or (values array, present mask)
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
    ts_sorted = ts_arr[order]
    cuts: list[int]
    if span is None:
        cuts, starts = [0, total], [0.0]
    else:
        bucket = np.floor(ts_sorted / span) * span
        edges = (np.flatnonzero(bucket[1:] != bucket[:-1]) + 1).tolist()
        cuts = [0, *edges, total]
        starts = [float(bucket[i]) for i in cuts[:-1]]
    out = []
    for (lo, hi), start in zip(zip(cuts, cuts[1:]), starts):
        rows = order[lo:hi]
        cols_out: list[tuple] = []
        for name, kind in names.items():
            if isinstance(full[name][0], str):  # (OBJ, values)
                obj_vals = full[name][1]  # also a numeric column that fell back to OBJ in some chunk
                cols_out.append((name, OBJ, [obj_vals[i] for i in rows.tolist()]))
                continue
            v, m = full[name]
            v, m = v[rows], m[rows]
            cols_out.append((name, kind, v[m], m))
        out.append((encode_columns(hi - lo, cols_out), hi - lo, float(ts_sorted[lo]), float(ts_sorted[hi - 1]), start))
    return out


# -- host chunks: one batch's GPUs in one chunk ------------------------------------------------------
HOST_CHUNK = 3  # the format of a host chunk


def encode_host_chunk(series: Sequence[Series]) -> bytes:
    """One batch's series (one host, several GPUs, each with the columns the agent sent: ``Series.wire``) as one
    chunk: a msgpack header with each series' key, constants and column names, then each series' columns as
    the agent sent them (ts first), zstd-compressed once. Ingest writes one row a batch this way instead of one
    a GPU; compaction splits them into the GPUs' chunks (:func:`decode_host_chunk`)."""
    meta: list[list[Any]] = []
    parts: list[bytes] = []
    for s in series:
        wire = s.wire
        if wire is None:
            raise ValueError(f"series of {s.gpu_uuid!r}: a host chunk takes series with wire columns only")
        meta.append([s.gpu_uuid, s.mig, s.gpu_index, s.model, s.source, s.job_ids, s.job_shares, s.n, list(wire),
                     plain_row_lists(s.lists) if s.lists else {}])
        parts.append(s.ts.tobytes())
        parts.extend(wire.values())
    header = msgpack.packb([HOST_CHUNK, meta], use_bin_type=True)
    return _compress(b"".join([_HDR.pack(len(header)), header, *parts]), _FAST_COMPRESSORS, _HOST_CHUNK_LEVEL)


class HostPart(NamedTuple):
    """One series of a host chunk: its key and constants, and its columns as one buffer (ts, then ``names`` in
    order, ``n`` 8-byte values each)."""

    gpu_uuid: str
    mig: str | None
    gpu_index: int
    model: str
    source: str
    job_ids: tuple[str, ...]
    job_shares: tuple[float, ...]
    n: int
    names: tuple[str, ...]
    block: memoryview
    lists: dict[str, list]

    @property
    def key(self) -> tuple[str, str, str]:
        return ("", self.gpu_uuid, self.mig or "")  # the host is the chunk's

    def series(self, host: str) -> Series:
        """The part as a Series (its columns views of the buffer)."""
        size = 8 * self.n
        block = self.block
        wire = {name: block[size * (k + 1):size * (k + 2)] for k, name in enumerate(self.names)}
        rows = {name: row_list(name, self.lists[name]) for name in ROW_LISTS if name in self.lists}
        return Series.of_wire(host, self.gpu_uuid, self.gpu_index, np.frombuffer(block, "<f8", self.n), self.model,
                              self.mig, self.source, self.job_ids, self.job_shares, rows, wire)  # type: ignore[arg-type]


def decode_host_chunk(blob: bytes) -> list[HostPart]:
    """A host chunk's series, their columns over the decompressed buffer."""
    raw = memoryview(_decompress(blob))
    (hlen,) = _HDR.unpack_from(raw)
    version, meta = msgpack.unpackb(raw[4:4 + hlen], raw=False, use_list=False)
    if version != HOST_CHUNK:
        raise ValueError(f"host chunk format {version}, this collector reads {HOST_CHUNK}")
    pos = 4 + hlen
    out = []
    for uuid, mig, index, model, source, job_ids, shares, n, names, lists in meta:
        end = pos + 8 * n * (len(names) + 1)
        out.append(HostPart(uuid, mig, index, model, source, job_ids, shares, n, names, raw[pos:end], lists))
        pos = end
    return out


def join_parts(parts: Sequence[HostPart], host: str) -> Series | None:
    """A GPU's consecutive host chunk parts with the same constants, columns and rows a part (no row lists), as one
    series, its columns the parts' concatenated (one chunk a GPU and interval, from one buffer of them all); None
    where they differ."""
    first = parts[0]
    const = first[:9]  # key, constants, rows, column names
    if any(p.lists or p[:9] != const for p in parts):
        return None
    n, names = first.n, first.names
    joined = b"".join([p.block for p in parts])
    shape = (len(parts), len(names) + 1, n)
    floats = np.frombuffer(joined, dtype="<f8").reshape(shape).transpose(1, 0, 2).reshape(len(names) + 1, -1)
    ints = np.frombuffer(joined, dtype="<i8").reshape(shape).transpose(1, 0, 2).reshape(len(names) + 1, -1)
    float_cols = {name: floats[k + 1] for k, name in enumerate(names) if ROW_KINDS[name] != INT}
    int_cols = {name: (ints[k + 1], None) for k, name in enumerate(names) if ROW_KINDS[name] == INT}
    return Series(host, first.gpu_uuid, first.gpu_index, floats[0], model=first.model, mig=first.mig,
                  source=first.source, job_ids=first.job_ids, job_shares=first.job_shares, floats=float_cols,
                  ints=int_cols)


def series_columns(s: Series) -> tuple[int, dict[str, tuple[str, Any, np.ndarray | None]]]:
    """A series as :func:`decode_columns` gives a chunk's columns (what the raw readers take)."""
    n = s.n
    cols: dict[str, tuple[str, Any, np.ndarray | None]] = {"ts": (FLOAT, s.ts, None)}
    for name, a in s.floats.items():
        mask = ~np.isnan(a)
        cols[name] = (FLOAT, a, None) if mask.all() else (FLOAT, a[mask], mask)
    for name, (a, m) in s.ints.items():
        cols[name] = (INT, a, None) if m is None else (INT, a[m], m)
    cols["gpu_index"] = (INT, np.full(n, s.gpu_index, dtype=np.int64), None)
    for name in _CONSTANTS:
        value = getattr(s, name)
        cols[name] = (OBJ, [list(value) if isinstance(value, tuple) else value] * n, None)
    for name, rows in plain_row_lists(s.lists).items():
        cols[name] = (OBJ, rows, None)
    return n, cols
