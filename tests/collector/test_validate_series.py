"""The columnar ("series") batch layout: round trips, every rule, fast path == slow path, fuzzing, HTTP.

The msgspec fast path (msgpack bodies) and the per-sample path (``validate._FAST = None``) must decide every
batch alike: the same samples, or the same status, reason, message and rejected-sample count.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import httpx
import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpuledger.collector import validate
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.validate import BatchError, parse_batch
from gpuledger.schema.records import INT_FIELDS, NONNEG_FIELDS, RATIO_FIELDS, GpuProcess, GpuSample
from gpuledger.schema.wire import COLUMNS, INT_COLUMNS, from_series, to_series

NOW = 1_700_000_000.0
MAX_INT = 2**63 - 1
WHERE = "batch agent_id='a1' seq=3"
MSGPACK, JSON = "application/msgpack", "application/json"
needs_fast = pytest.mark.skipif(validate._FAST is None, reason="msgspec not installed: there is no fast path")


# -- helpers ----------------------------------------------------------------------------------------

@contextmanager
def slow_path() -> Iterator[None]:
    """Force the per-sample (authoritative) path, as if msgspec were missing."""
    saved, validate._FAST = validate._FAST, None
    try:
        yield
    finally:
        validate._FAST = saved


def outcome(body: bytes, ctype: str = MSGPACK, **kw: Any) -> tuple:
    """What parse_batch decided, comparable across paths: the samples as a multiset, or the error."""
    try:
        b = parse_batch(body, ctype, NOW, **kw)
    except BatchError as e:
        return ("rejected", e.status, e.reason, e.message, e.samples)
    assert b.n_samples == len(b.samples)
    return ("accepted", b.agent_id, b.seq, b.host, Counter(b.samples), b.jobs)


def decide(body: bytes, ctype: str = MSGPACK, **kw: Any) -> tuple:
    """The outcome; for msgpack, asserts the fast path and the forced slow path agree on all of it."""
    if ctype != MSGPACK:
        return outcome(body, ctype, **kw)
    fast = outcome(body, ctype, **kw)
    with slow_path():
        slow = outcome(body, ctype, **kw)
    assert fast == slow
    return fast


def pack_d(*xs: float) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


def pack_q(*xs: int) -> bytes:
    return struct.pack(f"<{len(xs)}q", *xs)


def envelope(series: Any, **top: Any) -> dict:
    doc = {"agent_id": "a1", "seq": 3, "host": "n1", "series": series}
    doc.update(top)
    return doc


def encode(doc: dict, fmt: str) -> tuple[bytes, str]:
    return (json.dumps(doc).encode(), JSON) if fmt == "json" else (msgpack.packb(doc), MSGPACK)


# -- 1. round trip: GpuSamples -> agent.wire.to_series -> body -> parse_batch -> the same samples -------

_GPUS = [("GPU-0", 0, "H100"), ("GPU-1", 1, "H100"), ("GPU-7", 7, "A100")]
_JOBS = [((), ()), (("42",), ()), (("42",), (1.0,)), (("1", "2"), ()), (("1", "2"), (0.25, 0.75)),
         (("a", "b", "c"), (0.5, 0.25, 0.25))]


def _value(f: str) -> st.SearchStrategy:
    if f in RATIO_FIELDS:
        return st.floats(0.0, 1.0)
    if f in NONNEG_FIELDS:
        return st.floats(0.0, 1e18)
    if f in INT_FIELDS:
        return st.integers(0, MAX_INT)
    if f == "temp_celsius":
        return st.floats(-1e18, 1e18)
    raise AssertionError(f"no strategy for the new column {f!r}: add one")


_VALUES = {f: _value(f) for f in COLUMNS if f != "ts"}
PROCESS_ROWS = ("must be a list of [pid, used_memory_bytes or null] or [pid, used_memory_bytes or null, "
                "gpu_util_ratio 0..1 or null]")
_XIDS = st.lists(st.integers(-(2**63), MAX_INT), max_size=3).map(tuple)
_PROCS = st.lists(st.builds(GpuProcess, st.integers(0, MAX_INT), st.none() | st.integers(0, MAX_INT),
                            st.none() | st.floats(0.0, 1.0)), max_size=3).map(tuple)


@st.composite
def sample_lists(draw) -> list[GpuSample]:
    """One host's samples: several GPUs, MIG instances, job changes, gaps, xid errors and processes.

    Each column is reported always, sometimes or never (so whole columns exist, which travel as bytes)."""
    modes = {f: draw(st.sampled_from(["all", "some", "none"])) for f in _VALUES}
    lists = {f: draw(st.sampled_from(["some", "none"])) for f in ("xid_errors", "processes")}
    out = []
    for _ in range(draw(st.integers(1, 16))):
        uuid, index, model = draw(st.sampled_from(_GPUS))
        jobs, shares = draw(st.sampled_from(_JOBS))
        kw: dict[str, Any] = {f: draw(v) for f, v in _VALUES.items()
                              if modes[f] == "all" or (modes[f] == "some" and draw(st.booleans()))}
        if lists["xid_errors"] == "some":
            kw["xid_errors"] = draw(_XIDS)
        if lists["processes"] == "some":
            kw["processes"] = draw(_PROCS)
        out.append(GpuSample(ts=draw(st.floats(NOW - 7 * 86400, NOW + 300)), host="n1", gpu_uuid=uuid,
                             gpu_index=index, model=model, mig=draw(st.sampled_from([None, "1.0", "2.1"])),
                             source=draw(st.sampled_from(["", "dcgm"])), job_ids=jobs, job_shares=shares, **kw))
    return out


@needs_fast
@settings(max_examples=80, deadline=None)
@given(sample_lists())
def test_series_round_trip_in_every_encoding_and_both_paths(samples):
    want = Counter(samples)
    for fmt, binary in (("json", False), ("msgpack", False), ("msgpack", True)):
        series = to_series(samples, "n1", binary=binary)
        assert Counter(from_series(series, "n1")) == want
        body, ctype = encode(envelope(series), fmt)
        assert decide(body, ctype) == ("accepted", "a1", 3, "n1", want, ())
        if fmt == "msgpack":
            # the fast path takes a valid series batch itself (it does not just hand everything on)
            fast = validate._parse_fast(body, NOW, None)
            assert fast is not None and Counter(fast.samples) == want
            if binary:  # a complete column travels as bytes (8 per value)
                assert all(type(d["ts"]) is bytes and len(d["ts"]) % 8 == 0 for d in series)
    b = parse_batch(msgpack.packb(envelope(to_series(samples, "n1", binary=True))), MSGPACK, NOW)
    assert len(b.series) == len({(s.gpu_uuid, s.mig, s.source, s.job_ids, s.job_shares) for s in samples})
    assert sorted(b.samples, key=lambda s: (s.gpu_uuid, s.mig or "", s.ts, repr(s))) == sorted(
        samples, key=lambda s: (s.gpu_uuid, s.mig or "", s.ts, repr(s)))


def test_compressed_series_bodies_and_jobs_round_trip():
    samples = _base_samples()
    doc = envelope(to_series(samples, "n1", binary=True),
                   jobs=[{"job_id": "42", "user": "ann", "hosts": ["n1"], "gpus": 1}])
    raw = msgpack.packb(doc)
    for body, enc in ((raw, ""), (gzip.compress(raw), "gzip"), (zstandard.ZstdCompressor().compress(raw), "zstd")):
        out = decide(body, content_encoding=enc)
        assert out[0] == "accepted" and out[4] == Counter(samples)
        assert [j.user for j in out[5]] == ["ann"]
    b = parse_batch(raw, MSGPACK, NOW, allowed_host="n1")
    assert b.n_samples == 8 and len(b.series) == 2 and b.series[1].mig == "1.0"


def test_empty_series_list_is_an_empty_batch():
    for fmt in ("json", "msgpack"):
        assert decide(*encode(envelope([]), fmt)) == ("accepted", "a1", 3, "n1", Counter(), ())


# -- 2. every rule, in every encoding it applies to, on both paths ------------------------------------

def _base_samples() -> list[GpuSample]:
    """series[0]: 3 samples of GPU-0; series[1]: 5 samples of MIG 1.0 on GPU-1, every kind of field."""
    s0 = [GpuSample(ts=NOW - 30 + 10 * j, host="n1", gpu_uuid="GPU-0", gpu_index=0, model="H100",
                    sm_active_ratio=0.5, power_watts=300.0, mem_used_bytes=10**9, job_ids=("42",))
          for j in range(3)]
    s1 = [GpuSample(ts=NOW - 50 + 10 * j, host="n1", gpu_uuid="GPU-1", gpu_index=1, model="H100", mig="1.0",
                    sm_active_ratio=0.25, power_watts=100.0 + j, mem_used_bytes=2**30 + j, temp_celsius=40.0 + j,
                    xid_errors=(79,) if j == 2 else (), processes=(GpuProcess(100 + j, 2**20),),
                    job_ids=("1", "2"), job_shares=(0.25, 0.75), source="dcgm")
          for j in range(5)]
    return s0 + s1


# encodings: "json" (lists), "list" (msgpack, lists), "bytes" (msgpack, complete columns as bytes)
ALL, MSGPACK_ONLY = ("json", "list", "bytes"), ("list", "bytes")
TS1 = [NOW - 50, NOW - 40, NOW - 30, NOW - 20, NOW - 10]


def base_doc(enc: str) -> dict:
    return envelope(to_series(_base_samples(), "n1", binary=enc == "bytes"))


def _set(key: str, value: Any, i: int = 1) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        doc["series"][i][key] = value
    return mutate


def _del(key: str, i: int = 1) -> Callable[[dict], None]:
    return lambda doc: doc["series"][i].pop(key)


def _top(key: str, value: Any = None, delete: bool = False) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        if delete:
            del doc[key]
        else:
            doc[key] = value
    return mutate


def _both(*ms: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        for m in ms:
            m(doc)
    return mutate


def _excerpt(v: Any) -> str:
    """How an error quotes a long value: its repr, cut at 80 characters."""
    r = repr(v)
    return r if len(r) <= 80 else r[:80] + "..."


def _pw(x: Any, j: int = 4) -> list:
    return [100.0 + k if k != j else x for k in range(5)]


RATIO = "ratio must be a finite number in 0..1"
NONNEG = "must be a finite number in 0..1e+18"
INT = f"must be an integer in 0..{MAX_INT}"
TS = "must be a positive finite number (unix seconds)"
FUTURE = "is more than 300 s in the future (collector time 1700000000.000)"
NAME = "must be a non-empty string without control characters or unpaired surrogates"
TEXT = "must be a string without NUL characters or unpaired surrogates"
JOB_IDS = "must be a list of distinct non-empty strings without control characters or unpaired surrogates"
EXACTLY_ONE = "exactly one of the fields 'samples' (one object a sample) and 'series' (columns) is required"

# (id, mutation, message after "batch agent_id='a1' seq=3: ", encodings, samples, reason, status)
REJECTIONS: list[tuple] = [
    # numeric columns as bytes (msgpack only)
    ("bytes-short", _set("power_watts", pack_d(1, 2, 3, 4)),
     "series[1].power_watts: 32 bytes, expected 40 (5 values of 8 bytes, as ts has)", MSGPACK_ONLY),
    ("bytes-long", _set("power_watts", pack_d(1, 2, 3, 4, 5) + b"\0"),
     "series[1].power_watts: 41 bytes, expected 40 (5 values of 8 bytes, as ts has)", MSGPACK_ONLY),
    ("bytes-int-short", _set("mem_used_bytes", pack_q(1, 2)),
     "series[1].mem_used_bytes: 16 bytes, expected 40 (5 values of 8 bytes, as ts has)", MSGPACK_ONLY),
    ("bytes-nan", _set("power_watts", pack_d(1, 2, math.nan, 4, 5)), f"series[1].power_watts[2]: {NONNEG} (got nan)",
     MSGPACK_ONLY),
    ("bytes-inf", _set("power_watts", pack_d(math.inf, 2, 3, 4, 5)), f"series[1].power_watts[0]: {NONNEG} (got inf)",
     MSGPACK_ONLY),
    ("bytes-neg-inf", _set("temp_celsius", pack_d(1, -math.inf, 3, 4, 5)),
     "series[1].temp_celsius[1]: must be a finite number within +-1e+18 (got -inf)", MSGPACK_ONLY),
    ("bytes-negative", _set("power_watts", pack_d(1, 2, 3, 4, -1.0)), f"series[1].power_watts[4]: {NONNEG} (got -1.0)",
     MSGPACK_ONLY),
    ("bytes-too-big", _set("energy_joules", pack_d(1, 2, 3, 1.5e18, 5)),
     f"series[1].energy_joules[3]: {NONNEG} (got 1.5e+18)", MSGPACK_ONLY),
    ("bytes-ratio", _set("sm_active_ratio", pack_d(0, 0, 0, 0, 1.0000001)),
     f"series[1].sm_active_ratio[4]: {RATIO} (got 1.0000001)", MSGPACK_ONLY),
    ("bytes-ratio-nan", _set("gpu_util_ratio", pack_d(0, math.nan, 0, 0, 1)),
     f"series[1].gpu_util_ratio[1]: {RATIO} (got nan)", MSGPACK_ONLY),
    ("bytes-int-negative", _set("mem_used_bytes", pack_q(1, 2, -1, 4, 5)),
     f"series[1].mem_used_bytes[2]: {INT} (got -1)", MSGPACK_ONLY),
    ("bytes-int-min", _set("ecc_errors_total", pack_q(-(2**63), 2, 3, 4, 5)),
     f"series[1].ecc_errors_total[0]: {INT} (got {-(2**63)})", MSGPACK_ONLY),
    ("bytes-ts-zero", _set("ts", pack_d(NOW, 0.0, NOW, NOW, NOW)), f"series[1].ts[1]: {TS} (got 0.0)", MSGPACK_ONLY),
    ("bytes-ts-negative", _set("ts", pack_d(-1.0, NOW, NOW, NOW, NOW)), f"series[1].ts[0]: {TS} (got -1.0)",
     MSGPACK_ONLY, 8),
    ("bytes-ts-nan", _set("ts", pack_d(NOW, NOW, NOW, math.nan, NOW)), f"series[1].ts[3]: {TS} (got nan)",
     MSGPACK_ONLY),
    ("bytes-ts-empty", _set("ts", b""), "series[1].ts: must hold at least one time", MSGPACK_ONLY, 3),
    ("bytes-ts-future", _set("ts", pack_d(*TS1[:3], NOW + 301, NOW)),
     f"series[1].ts[3]: {FUTURE} (got 1700000301.0)", MSGPACK_ONLY, 8, "future"),
    ("bytes-ts-short-sets-n", _set("ts", pack_d(*TS1[:4])),  # ts says 4 rows: the 5-value columns are wrong
     None, MSGPACK_ONLY, 7),
    # numeric columns as lists
    ("list-negative", _set("power_watts", _pw(-1.0)), f"series[1].power_watts[4]: {NONNEG} (got -1.0)", ALL),
    ("list-nan", _set("power_watts", _pw(math.nan, 1)), f"series[1].power_watts[1]: {NONNEG} (got nan)", ALL),
    ("list-inf", _set("power_watts", _pw(math.inf, 2)), f"series[1].power_watts[2]: {NONNEG} (got inf)", ALL),
    ("list-too-big", _set("sm_clock_hz", [None, 1.1e18, None, None, None]),
     f"series[1].sm_clock_hz[1]: {NONNEG} (got 1.1e+18)", ALL),
    ("list-ratio", _set("sm_active_ratio", [0.25, 0.25, 0.25, 0.25, 1.0000001]),
     f"series[1].sm_active_ratio[4]: {RATIO} (got 1.0000001)", ALL),
    ("list-ratio-int", _set("dram_bw_ratio", [0, 1, 2, None, None]), f"series[1].dram_bw_ratio[2]: {RATIO} (got 2)",
     ALL),
    ("list-ratio-negative", _set("dram_bw_ratio", [-0.1, 1, 1, 1, 1]),
     f"series[1].dram_bw_ratio[0]: {RATIO} (got -0.1)", ALL),
    ("list-bool", _set("power_watts", _pw(True, 1)), f"series[1].power_watts[1]: {NONNEG} (got True)", ALL),
    ("list-bool-ratio", _set("sm_active_ratio", [False] * 5), f"series[1].sm_active_ratio[0]: {RATIO} (got False)",
     ALL),
    ("list-bool-int", _set("mem_used_bytes", [1, 2, 3, True, 5]), f"series[1].mem_used_bytes[3]: {INT} (got True)",
     ALL),
    ("list-string", _set("power_watts", _pw("300", 3)), f"series[1].power_watts[3]: {NONNEG} (got '300')", ALL),
    ("list-nested", _set("power_watts", _pw([1.0], 0)), f"series[1].power_watts[0]: {NONNEG} (got [1.0])", ALL),
    ("list-temp-low", _set("temp_celsius", [-1.5e18, 1, 1, 1, 1]),
     "series[1].temp_celsius[0]: must be a finite number within +-1e+18 (got -1.5e+18)", ALL),
    ("list-int-too-big", _set("mem_used_bytes", [1, 2, 2**63, 4, 5]),
     f"series[1].mem_used_bytes[2]: {INT} (got {2**63})", ALL),
    ("list-int-negative", _set("throttle_reasons", [None, None, None, None, -1]),
     f"series[1].throttle_reasons[4]: {INT} (got -1)", ALL),
    ("list-int-float", _set("remapped_rows_total", [1.0, 2, 3, 4, 5]),
     f"series[1].remapped_rows_total[0]: {INT} (got 1.0)", ALL),
    ("list-length-short", _set("power_watts", [1.0, 2.0, 3.0, 4.0]),
     "series[1].power_watts: has 4 values, expected 5 (as ts has)", ALL),
    ("list-length-long", _set("mem_used_bytes", [1] * 6),
     "series[1].mem_used_bytes: has 6 values, expected 5 (as ts has)",
     ALL),
    ("column-not-a-list", _set("power_watts", "300"),
     "series[1].power_watts: must be a list of 5 numbers or null, or bytes of 5 8-byte values (got '300')", ALL),
    ("int-column-not-a-list", _set("mem_used_bytes", 7),
     "series[1].mem_used_bytes: must be a list of 5 integers or null, or bytes of 5 8-byte values (got 7)", ALL),
    ("column-a-map", _set("power_watts", {"0": 1.0}),
     "series[1].power_watts: must be a list of 5 numbers or null, or bytes of 5 8-byte values (got {'0': 1.0})", ALL),
    # ts
    ("ts-null-value", _set("ts", [NOW - 50, None, NOW - 30, NOW - 20, NOW - 10]), f"series[1].ts[1]: {TS} (got None)",
     ALL),
    ("ts-zero", _set("ts", [NOW - 50, NOW - 40, 0, NOW - 20, NOW - 10]), f"series[1].ts[2]: {TS} (got 0)", ALL),
    ("ts-string", _set("ts", ["now"] * 5), f"series[1].ts[0]: {TS} (got 'now')", ALL),
    ("ts-bool", _set("ts", [True] * 5), f"series[1].ts[0]: {TS} (got True)", ALL),
    ("ts-empty", _set("ts", []), "series[1].ts: must hold at least one time", ALL, 3),
    ("ts-null", _set("ts", None), "series[1].ts: must be a list of times or bytes of 8-byte times (got None)", ALL, 3),
    ("ts-missing", _del("ts"), "series[1].ts: missing", ALL, 3),
    ("ts-future", _set("ts", [*TS1[:3], NOW + 301, NOW]), f"series[1].ts[3]: {FUTURE} (got 1700000301.0)", ALL, 8,
     "future"),
    ("ts-future-and-bad-value",  # a column's error is found before the future check
     _both(_set("ts", [*TS1[:3], NOW + 301, NOW]), _set("power_watts", _pw(-1.0))),
     f"series[1].power_watts[4]: {NONNEG} (got -1.0)", ALL),
    ("ts-future-series0", _set("ts", [NOW - 30, NOW - 20, NOW + 1000], 0),
     f"series[0].ts[2]: {FUTURE} (got 1700001000.0)", ALL, 8, "future"),
    # constants
    ("unknown-key", _set("bogus", 1), "series[1]: unknown field 'bogus'", ALL),
    ("host-in-series", _set("host", "n1"), "series[1]: unknown field 'host' (a series takes the batch's host)", ALL),
    ("gpu_uuid-missing", _del("gpu_uuid"), "series[1].gpu_uuid: missing", ALL),
    ("gpu_index-missing", _del("gpu_index"), "series[1].gpu_index: missing", ALL),
    ("gpu_uuid-empty", _set("gpu_uuid", ""), f"series[1].gpu_uuid: {NAME} (got '')", ALL),
    ("gpu_uuid-int", _set("gpu_uuid", 5), f"series[1].gpu_uuid: {NAME} (got 5)", ALL),
    ("gpu_uuid-nul", _set("gpu_uuid", "GPU-1\x00"), f"series[1].gpu_uuid: {NAME} (got 'GPU-1\\x00')", ALL),
    ("gpu_uuid-newline", _set("gpu_uuid", "GPU-1\nforged"), f"series[1].gpu_uuid: {NAME} (got 'GPU-1\\nforged')", ALL),
    ("gpu_index-negative", _set("gpu_index", -1), f"series[1].gpu_index: {INT} (got -1)", ALL),
    ("gpu_index-bool", _set("gpu_index", True), f"series[1].gpu_index: {INT} (got True)", ALL),
    ("gpu_index-float", _set("gpu_index", 1.0), f"series[1].gpu_index: {INT} (got 1.0)", ALL),
    ("mig-empty", _set("mig", ""), f"series[1].mig: {NAME}, or null (got '')", ALL),
    ("mig-nul", _set("mig", "\x00"), f"series[1].mig: {NAME}, or null (got '\\x00')", ALL),
    ("model-int", _set("model", 5), f"series[1].model: {TEXT} (got 5)", ALL),
    ("model-nul", _set("model", "H100\x00"), f"series[1].model: {TEXT} (got 'H100\\x00')", ALL),
    ("source-null", _set("source", None), f"series[1].source: {TEXT} (got None)", ALL),
    ("source-nul", _set("source", "\x00nvml"), f"series[1].source: {TEXT} (got '\\x00nvml')", ALL),
    ("job_ids-duplicate", _set("job_ids", ["1", "1"]),
     f"series[1].job_ids: {JOB_IDS} (got ['1', '1'])", ALL),
    ("job_ids-empty-id", _set("job_ids", ["1", ""]),
     f"series[1].job_ids: {JOB_IDS} (got ['1', ''])", ALL),
    ("job_ids-nul", _set("job_ids", ["1", "7\x00"]), f"series[1].job_ids: {JOB_IDS} (got ['1', '7\\x00'])", ALL),
    ("job_ids-tab", _set("job_ids", ["1\t2"]), f"series[1].job_ids: {JOB_IDS} (got ['1\\t2'])", ALL),
    ("job_ids-string", _set("job_ids", "1"),
     f"series[1].job_ids: {JOB_IDS} (got '1')",
     ALL),
    ("job_shares-sum", _set("job_shares", [0.5, 0.6]), "series[1].job_shares: must sum to 1 (got [0.5, 0.6])", ALL),
    ("job_shares-count", _set("job_shares", [1.0]),
     "series[1].job_shares: must have one share per job id (2) or be empty (got [1.0])", ALL),
    ("job_shares-without-jobs", _both(_del("job_ids"), _set("job_shares", [1.0])),
     "series[1].job_shares: must have one share per job id (0) or be empty (got [1.0])", ALL),
    ("job_shares-negative", _set("job_shares", [-0.25, 1.25]),
     "series[1].job_shares: must be a list of non-negative finite numbers (got [-0.25, 1.25])", ALL),
    ("job_shares-nan", _set("job_shares", [math.nan, 1.0]),
     "series[1].job_shares: must be a list of non-negative finite numbers (got [nan, 1.0])", ALL),
    # per-row lists
    ("xid_errors-short", _set("xid_errors", [[], [], [79], []]),
     "series[1].xid_errors: must be a list of 5 per-sample lists (got [[], [], [79], []])", ALL),
    ("xid_errors-not-a-list", _set("xid_errors", 79),
     "series[1].xid_errors: must be a list of 5 per-sample lists (got 79)",
     ALL),
    ("xid_errors-bytes", _set("xid_errors", bytes(40)),
     f"series[1].xid_errors: must be a list of 5 per-sample lists (got {_excerpt(bytes(40))})", MSGPACK_ONLY),
    ("xid_errors-bad-row", _set("xid_errors", [[], [], ["x"], [], []]),
     "series[1].xid_errors[2]: must be a list of integers (got ['x'])", ALL),
    ("processes-long", _set("processes", [[[1, None]]] * 7),
     f"series[1].processes: must be a list of 5 per-sample lists (got {_excerpt([[[1, None]]] * 7)})", ALL),
    ("processes-bad-row", _set("processes", [[], [[1]], [], [], []]),
     f"series[1].processes[1]: {PROCESS_ROWS} (got [[1]])", ALL),
    ("processes-negative-pid", _set("processes", [[], [], [], [], [[-1, 5]]]),
     f"series[1].processes[4]: {PROCESS_ROWS} (got [[-1, 5]])", ALL),
    ("process-busy-over-1", _set("processes", [[], [], [[1, 5, 1.5]], [], []]),
     f"series[1].processes[2]: {PROCESS_ROWS} (got [[1, 5, 1.5]])", ALL),
    ("process-busy-negative", _set("processes", [[], [], [[1, 5, -0.25]], [], []]),
     f"series[1].processes[2]: {PROCESS_ROWS} (got [[1, 5, -0.25]])", ALL),
    ("process-busy-text", _set("processes", [[], [], [[1, 5, "0.5"]], [], []]),
     f"series[1].processes[2]: {PROCESS_ROWS} (got [[1, 5, '0.5']])", ALL),
    ("process-four-elements", _set("processes", [[[1, 5, 0.5, 0]], [], [], [], []]),
     f"series[1].processes[0]: {PROCESS_ROWS} (got [[1, 5, 0.5, 0]])", ALL),
    # the series list and the envelope
    ("series-element-int", lambda d: d["series"].__setitem__(1, 5), "series[1]: must be an object, got int", ALL, 3),
    ("series-element-list", lambda d: d["series"].__setitem__(1, [1, 2]), "series[1]: must be an object, got list", ALL,
     3),
    ("series-element-null", lambda d: d["series"].__setitem__(0, None), "series[0]: must be an object, got NoneType",
     ALL, 5),
    ("series-not-a-list", _top("series", {"gpu_uuid": "GPU-0"}), "field 'series' must be a list", ALL, 0),
    ("series-null", _top("series", None), "field 'series' must be a list", ALL, 0),
    ("both-samples-and-series", _top("samples", []), EXACTLY_ONE, ALL, 0),
    ("neither-samples-nor-series", _top("series", delete=True), EXACTLY_ONE, ALL, 0),
    ("unknown-top-level", _top("bogus", 1), "unknown field(s) ['bogus']", ALL, 0),
    ("host-nul", _top("host", "n1\x00"), f"field 'host' {NAME}", ALL, 0),
    ("cluster-nul", _top("cluster", "c\x00"),
     "field 'cluster' must be a string of at most 256 characters without control characters or unpaired surrogates",
     ALL, 0),
    ("jobs-user-nul", _top("jobs", [{"job_id": "1", "hosts": ["n1"], "user": "ann\x00"}]),
     "job[0].user: expected str | None without control characters or unpaired surrogates (got 'ann\\x00')", ALL),
    ("jobs-host-newline", _top("jobs", [{"job_id": "1", "hosts": ["n1", "n2\r\n"]}]),
     "job[0].hosts: expected tuple[str, ...] without control characters or unpaired surrogates "
     "(got ['n1', 'n2\\r\\n'])", ALL),
    ("jobs-state-nul", _top("jobs", [{"job_id": "1", "hosts": ["n1"], "state": "DONE\x00"}]),
     "job[0].state: expected str | None without NUL characters or unpaired surrogates (got 'DONE\\x00')", ALL),
    ("jobs-not-a-list", _top("jobs", {}), "field 'jobs' must be a list of job records", ALL),
    ("jobs-other-host", _top("jobs", [{"job_id": "1", "hosts": ["n2"]}]),
     "job[0].hosts: ['n2'] does not include the batch's host 'n1'", ALL),
    ("first-error-wins", _both(_set("bogus", 1), _set("power_watts", [-1.0, 1, 1], 0)),
     f"series[0].power_watts[0]: {NONNEG} (got -1.0)", ALL),
]


def _rejection_cases() -> Iterator[Any]:
    for case in REJECTIONS:
        name, mutate, suffix, encodings, *rest = case
        samples, reason, status = (rest + [8, "invalid", 400][len(rest):])[:3]
        for enc in encodings:
            yield pytest.param(mutate, suffix, enc, samples, reason, status, id=f"{name}-{enc}")


@pytest.mark.parametrize("mutate,suffix,enc,samples,reason,status", list(_rejection_cases()))
def test_each_rule_rejects_the_whole_batch_alike_on_both_paths(mutate, suffix, enc, samples, reason, status):
    doc = base_doc(enc)
    mutate(doc)
    kind, got_status, got_reason, message, got_samples = decide(*encode(doc, "json" if enc == "json" else "msgpack"))
    assert kind == "rejected"
    assert (got_status, got_reason, got_samples) == (status, reason, samples), message
    if suffix is not None:
        assert message == f"{WHERE}: {suffix}"
    else:
        assert message.startswith(f"{WHERE}: series[1].")


def test_short_ts_bytes_make_every_other_column_wrong():
    doc = base_doc("bytes")
    doc["series"][1]["ts"] = pack_d(*TS1[:4])
    _, _, _, message, _ = decide(*encode(doc, "msgpack"))
    assert message == (f"{WHERE}: series[1].sm_active_ratio: 40 bytes, expected 32 (4 values of 8 bytes, as ts has)")


ACCEPTED: list[tuple] = [
    # (id, mutation, field checked on series[1]'s samples, the values expected, encodings)
    ("ratio-bounds", _set("sm_active_ratio", [0, 1, 0.0, 1.0, -0.0]), "sm_active_ratio", [0.0, 1.0, 0.0, 1.0, 0.0],
     ALL),
    ("ratio-bounds-bytes", _set("sm_active_ratio", pack_d(0, 1, 0.5, 1.0, -0.0)), "sm_active_ratio",
     [0.0, 1.0, 0.5, 1.0, 0.0], MSGPACK_ONLY),
    ("nonneg-bounds", _set("energy_joules", [0, 1e18, 10**18, None, 5]), "energy_joules", [0.0, 1e18, 1e18, None, 5.0],
     ALL),
    ("temp-bounds", _set("temp_celsius", [-1e18, 1e18, -(10**18), -273.15, None]), "temp_celsius",
     [-1e18, 1e18, -1e18, -273.15, None], ALL),
    ("int-bounds", _set("ecc_errors_total", [0, MAX_INT, None, 1, None]), "ecc_errors_total",
     [0, MAX_INT, None, 1, None], ALL),
    ("int-bounds-bytes", _set("ecc_errors_total", pack_q(0, MAX_INT, 3, 1, 2)), "ecc_errors_total",
     [0, MAX_INT, 3, 1, 2], MSGPACK_ONLY),
    ("gaps", _set("power_watts", [None, 1.5, None, None, 2]), "power_watts", [None, 1.5, None, None, 2.0], ALL),
    ("all-null-column", _set("power_watts", [None] * 5), "power_watts", [None] * 5, ALL),
    ("null-column", _set("power_watts", None), "power_watts", [None] * 5, ALL),
    ("ts-at-the-future-limit", _set("ts", [*TS1[:4], NOW + 300]), "ts", [*TS1[:4], NOW + 300], ALL),
    ("ts-int", _set("ts", [1, 2, 3, 4, 5]), "ts", [1.0, 2.0, 3.0, 4.0, 5.0], ALL),
    ("null-row-lists", _both(_set("xid_errors", None), _set("processes", None)), "processes", [()] * 5, ALL),
    ("negative-xid", _set("xid_errors", [[-1], [], [2**63 - 1], [-(2**63)], []]), "xid_errors",
     [(-1,), (), (2**63 - 1,), (-(2**63),), ()], ALL),
    ("process-without-memory", _set("processes", [[[1, None]], [], [], [], [[2, 0], [3, 4]]]), "processes",
     [(GpuProcess(1, None),), (), (), (), (GpuProcess(2, 0), GpuProcess(3, 4))], ALL),
    # the time a process's kernels ran, third where the agent knows it (an older agent's rows have two)
    ("process-busy-time", _set("processes", [[[1, 5, 0.0]], [[1, 5, 1]], [[1, None, 0.25], [2, 3]], [[1, 5, None]],
                                             []]), "processes",
     [(GpuProcess(1, 5, 0.0),), (GpuProcess(1, 5, 1.0),), (GpuProcess(1, None, 0.25), GpuProcess(2, 3)),
      (GpuProcess(1, 5),), ()], ALL),
    ("mig-null", _set("mig", None), "mig", [None] * 5, ALL),
    ("no-job-shares", _set("job_shares", []), "job_shares", [()] * 5, ALL),
    ("integer-shares", _both(_set("job_ids", ["1"]), _set("job_shares", [1])), "job_shares", [(1.0,)] * 5, ALL),
    ("shares-within-1e-6", _set("job_shares", [0.25, 0.7500005]), "job_shares", [(0.25, 0.7500005)] * 5, ALL),
    # free text may hold what a name may not (all but NUL); a name may be any printable text
    ("model-with-a-tab", _set("model", "NVIDIA\tH100 \u2028"), "model", ["NVIDIA\tH100 \u2028"] * 5, ALL),
    ("names-non-ascii", _both(_set("mig", "\u00e9\U0001f600"), _set("job_ids", ["t\u00e2che"]),
                             _set("job_shares", [])), "job_ids", [("t\u00e2che",)] * 5, ALL),
]


@pytest.mark.parametrize("mutate,field,values,enc", [
    pytest.param(m, f, v, enc, id=f"{name}-{enc}") for name, m, f, v, encs in ACCEPTED for enc in encs])
def test_boundary_values_are_accepted_alike_on_both_paths(mutate, field, values, enc):
    doc = base_doc(enc)
    mutate(doc)
    kind, *rest = decide(*encode(doc, "json" if enc == "json" else "msgpack"))
    assert kind == "accepted", rest
    got = sorted((s for s in rest[3] if s.gpu_uuid == "GPU-1"), key=lambda s: s.ts)
    if field == "ts":
        values = sorted(values)
    assert [getattr(s, field) for s in got] == values
    assert sum(rest[3].values()) == 8


@pytest.mark.parametrize("enc", ALL)
def test_host_bound_token(enc):
    fmt = "json" if enc == "json" else "msgpack"
    body, ctype = encode(base_doc(enc), fmt)
    assert decide(body, ctype, allowed_host="n1")[0] == "accepted"
    assert decide(body, ctype, allowed_host="n2") == (
        "rejected", 403, "forbidden", f"{WHERE}: field 'host' is 'n1' but the token is bound to host 'n2'", 8)
    # a job record of another host is a 403 under a bound token, a 400 without one
    doc = base_doc(enc)
    doc["jobs"] = [{"job_id": "1", "hosts": ["n2"]}]
    body, ctype = encode(doc, fmt)
    msg = f"{WHERE}: job[0].hosts: ['n2'] does not include the batch's host 'n1'"
    assert decide(body, ctype, allowed_host="n1") == ("rejected", 403, "forbidden", msg, 8)
    assert decide(body, ctype) == ("rejected", 400, "invalid", msg, 8)


def test_envelope_errors_of_a_series_batch():
    for fmt in ("json", "msgpack"):
        for top, needle in ((dict(agent_id=""), "'agent_id'"), (dict(seq=-1), "'seq'"), (dict(host=""), "'host'")):
            out = decide(*encode(envelope([], **top), fmt))
            assert out[:3] == ("rejected", 400, "invalid") and needle in out[3] and out[4] == 0
    assert decide(msgpack.packb([envelope([])]))[:2] == ("rejected", 400)


# -- corners where msgspec and the msgpack module see a body differently: both paths must still agree ----

@needs_fast
@pytest.mark.parametrize("doc", [
    envelope([{"gpu_uuid": "G", "gpu_index": 0, "ts": [NOW]}], samples=None),
    {"agent_id": "a1", "seq": 3, "host": "n1", "series": None,
     "samples": [{"ts": NOW, "host": "n1", "gpu_uuid": "G", "gpu_index": 0}]},
], ids=["samples-null", "series-null"])
def test_a_null_samples_or_series_beside_the_other_is_refused(doc):
    out = decide(msgpack.packb(doc))
    assert out[:2] == ("rejected", 400) and "exactly one of the fields" in out[3]


@needs_fast
@pytest.mark.parametrize("column,value", [("power_watts", 10**18 + 1), ("temp_celsius", -(10**18) - 64),
                                          ("ts", 10**18 + 1)])
def test_an_integer_reading_is_bounded_as_the_float_it_becomes(column, value):
    """msgspec converts an int to float before its bound check (10**18 + 1 is 1e18); the slow path does the same."""
    doc = envelope([{"gpu_uuid": "G", "gpu_index": 0, "ts": [NOW], column: [value]}])
    decide(msgpack.packb(doc))


@needs_fast
@pytest.mark.parametrize("job", [{1: "x"}, {None: "x"}, {"job_id": "1", "user": msgpack.ExtType(5, b"x")}],
                         ids=["int-key", "nil-key", "ext-value"])
def test_jobs_msgspec_would_decode_differently_are_worded_by_the_per_sample_path(job):
    out = decide(msgpack.packb(envelope([{"gpu_uuid": "G", "gpu_index": 0, "ts": [NOW]}], jobs=[job])))
    assert out[0] == "rejected" and "object at 0x" not in out[3]


# -- 3. mutated series batches: a Batch or a 4xx BatchError, never anything else; both paths alike ----

_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=4),
    st.sampled_from([0, 1, -1, 0.0, -0.0, 1.0000001, 1e18, 1.5e18, 2**63 - 1, 2**63, NOW + 300, NOW + 301, "", "x"]),
)
_BYTES = st.one_of(
    st.binary(max_size=48),
    st.lists(st.floats(), max_size=7).map(lambda xs: pack_d(*xs)),
    st.lists(st.integers(-(2**63), MAX_INT), max_size=7).map(lambda xs: pack_q(*xs)),
)
_NESTED = st.recursive(_LEAF | _BYTES, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8), c,
                                                                                           max_size=3), max_leaves=10)
_JUNK = st.one_of(st.none(), _NESTED, _NESTED)  # null a third of the time: "absent" where a field may be
_SERIES_KEYS = [*validate._SERIES_KEYS, "host", "bogus"]


@st.composite
def mutated_series_docs(draw) -> dict:
    samples = draw(sample_lists())
    doc = envelope(to_series(samples, "n1", binary=draw(st.booleans())))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["delete", "replace", "element", "element", "resize", "top", "series"]))
        series = doc.get("series")
        d = draw(st.sampled_from(series)) if isinstance(series, list) and series else None
        if op == "delete" and isinstance(d, dict) and d:
            d.pop(draw(st.sampled_from(sorted(d, key=str))))
        elif op == "replace" and isinstance(d, dict):
            d[draw(st.sampled_from(_SERIES_KEYS))] = draw(_JUNK)
        elif op == "element" and isinstance(d, dict):
            cols = [k for k, v in d.items() if isinstance(v, (list, bytes)) and v]
            if cols:
                k = draw(st.sampled_from(sorted(cols)))
                v = d[k]
                if isinstance(v, bytes):  # a bytes column: one value replaced by any 8 bytes
                    if len(v) < 8:
                        continue
                    j = draw(st.integers(0, len(v) // 8 - 1))
                    d[k] = v[:8 * j] + draw(st.binary(min_size=8, max_size=8)) + v[8 * j + 8:]
                else:
                    v[draw(st.integers(0, len(v) - 1))] = draw(_JUNK)
        elif op == "resize" and isinstance(d, dict):  # a column, ts or row list one value short or long
            seqs = [k for k, v in d.items() if isinstance(v, (list, bytes)) and v]
            if seqs:
                k = draw(st.sampled_from(sorted(seqs)))
                v = d[k]
                if draw(st.booleans()):
                    d[k] = v[:-8] if isinstance(v, bytes) else v[:-1]
                else:
                    d[k] = v + v[-8:] if isinstance(v, bytes) else [*v, v[-1]]
        elif op == "top":
            key = draw(st.sampled_from(["agent_id", "seq", "host", "series", "samples", "jobs", "bogus"]))
            if key in doc and draw(st.booleans()):
                del doc[key]
            else:
                doc[key] = draw(_JUNK)
        elif op == "series" and isinstance(series, list):
            if series and draw(st.booleans()):
                series[draw(st.integers(0, len(series) - 1))] = draw(_JUNK)
            else:
                series.append(draw(_JUNK))
    return doc


def _pack(doc: Any) -> bytes | None:
    try:
        return msgpack.packb(doc)
    except (OverflowError, ValueError, TypeError):
        return None


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_series_docs(), st.sampled_from([None, "n1", "n2"]),
       st.one_of(st.none(), st.none(), st.none(), st.integers(0, 4000)), st.data())  # a quarter truncated
def test_mutated_series_batches_are_decided_cleanly_and_alike(doc, allowed, cut, data):
    raw = _pack(doc)
    if raw is None:
        return
    if cut is not None:  # a truncated (or corrupted) body
        raw = raw[:cut] + data.draw(st.binary(max_size=4))
    results = []
    for fast in (True, False):
        with slow_path() if not fast else nullcontext():
            try:
                b = parse_batch(raw, MSGPACK, NOW, allowed_host=allowed)
            except BatchError as e:
                assert 400 <= e.status < 500 and e.message, e.message
                assert e.status == 400 or (e.status == 403 and allowed is not None)
                assert e.reason in ("malformed", "invalid", "future", "forbidden"), e.reason
                results.append(("rejected", e.status, e.reason, e.message, e.samples))
            else:
                _check_accepted(b, allowed)
                results.append(("accepted", Counter(b.samples), b.jobs))
    event(f"{results[1][0]} {results[1][2] if results[1][0] == 'rejected' else ''}".strip())
    assert results[0] == results[1]


@settings(max_examples=100, deadline=None)
@given(mutated_series_docs())
def test_mutated_series_batches_in_json_are_decided_cleanly(doc):
    try:
        raw = json.dumps(doc).encode()
    except (TypeError, ValueError):  # bytes have no JSON form
        return
    try:
        b = parse_batch(raw, JSON, NOW)
    except BatchError as e:
        assert e.status == 400 and e.message
    else:
        _check_accepted(b, None)


def _check_accepted(b: validate.Batch, allowed: str | None) -> None:
    assert allowed in (None, b.host)
    assert b.n_samples == len(b.samples) == sum(s.n for s in b.series)
    for s in b.samples:
        assert s.host == b.host and s.gpu_uuid and s.gpu_index >= 0 and 0 < s.ts <= NOW + 300
        assert len(set(s.job_ids)) == len(s.job_ids)
        assert not s.job_shares or (len(s.job_shares) == len(s.job_ids) and abs(math.fsum(s.job_shares) - 1) <= 1e-6)
        for f in COLUMNS:
            v = getattr(s, f)
            if v is None:
                continue
            if f in INT_COLUMNS:
                assert type(v) is int and 0 <= v <= MAX_INT, (f, v)
            else:
                assert type(v) is float and math.isfinite(v) and abs(v) <= 1e18, (f, v)
                if f in RATIO_FIELDS or f in NONNEG_FIELDS:
                    assert v >= 0 and (f not in RATIO_FIELDS or v <= 1), (f, v)


# -- 4. real HTTP: malformed series bodies never get a 5xx; the store holds exactly what was accepted -----

@pytest.fixture(scope="module")
def http_srv(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("series-fuzz") / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, max_body_bytes=256 * 1024).start()
    with httpx.Client(base_url=s.url, timeout=20) as client:
        yield s, client
    s.stop()
    store.close()


_SEQ = itertools.count(1000)
_ACCEPTED: list[int] = []  # samples the store said it took, over the whole module


@st.composite
def http_cases(draw) -> tuple[bytes, str, str, dict]:
    if draw(st.integers(0, 3)) == 0:  # a quarter valid, the rest mutated
        doc = envelope(to_series(draw(sample_lists()), "n1", binary=draw(st.booleans())))
    else:
        doc = draw(mutated_series_docs())
    if isinstance(doc.get("seq"), int) and doc["seq"] == 3:
        doc["seq"] = next(_SEQ)  # a fresh batch id (a mutated one may repeat: then the duplicate is acknowledged)
    raw = _pack(doc)
    fmt = draw(st.sampled_from(["msgpack", "json"])) if raw is not None else "json"
    if fmt == "json" or raw is None:
        try:
            raw, fmt = json.dumps(doc).encode(), "json"
        except (TypeError, ValueError):
            raw, fmt = (raw, "msgpack") if raw is not None else (b"{", "json")
    if draw(st.integers(0, 5)) == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
    enc = draw(st.sampled_from(["", "", "gzip", "zstd"]))
    if enc == "gzip":
        raw = gzip.compress(raw)
    elif enc == "zstd":
        raw = zstandard.ZstdCompressor().compress(raw)
    return raw, {"json": JSON, "msgpack": MSGPACK}[fmt], enc, doc


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=http_cases())
def test_http_fuzzed_series_never_5xx_and_store_holds_exactly_the_accepted(http_srv, case):
    s, c = http_srv
    raw, ctype, enc, doc = case
    try:  # what the validator alone decides for this body
        expected: validate.Batch | BatchError = parse_batch(raw, ctype, NOW, max_bytes=256 * 1024,
                                                            content_encoding=enc)
    except BatchError as e:
        expected = e
    before = c.get("/api/v1/totals").json()
    usage_before = c.get("/api/v1/usage").json() if isinstance(expected, BatchError) else None
    r = c.post("/api/v1/samples", content=raw, headers={"Content-Type": ctype, "Content-Encoding": enc})
    assert r.status_code < 500, r.text
    after = c.get("/api/v1/totals").json()
    if r.status_code == 200 or r.json().get("reason") == "too_late":  # 422: stored but for late samples
        assert not isinstance(expected, BatchError), expected.message
        res = r.json()
        assert (r.status_code == 422) == (res["too_late"] > 0)
        if res["duplicate"]:
            assert res["accepted"] == 0 and after == before
        else:
            assert res["accepted"] + res["duplicate_samples"] + res["too_late"] == expected.n_samples
        _ACCEPTED.append(res["accepted"])
        assert after["samples"] - before["samples"] == res["accepted"]
    else:
        assert 400 <= r.status_code < 500 and r.json()["error"]
        assert isinstance(expected, BatchError) and expected.status == r.status_code, r.text
        assert r.json()["error"] == expected.message
        assert after == before  # nothing of a rejected batch stored
        assert c.get("/api/v1/usage").json() == usage_before
    assert after["samples"] == sum(_ACCEPTED)


def test_http_series_batch_is_stored_whole(http_srv):
    s, c = http_srv
    before = c.get("/api/v1/totals").json()["samples"]
    samples = [GpuSample(ts=NOW - 200 + 10 * j, host="n1", gpu_uuid="GPU-http", gpu_index=3, sm_active_ratio=0.5,
                         power_watts=200.0, energy_joules=1000.0 * j, job_ids=("http-job",)) for j in range(6)]
    doc = envelope(to_series(samples, "n1", binary=True), seq=next(_SEQ))
    r = c.post("/api/v1/samples", content=msgpack.packb(doc), headers={"Content-Type": MSGPACK})
    assert r.status_code == 200 and r.json()["accepted"] == 6, r.text
    _ACCEPTED.append(6)
    assert c.get("/api/v1/totals").json()["samples"] == before + 6
    (u,) = c.get("/api/v1/usage", params={"job": "http-job"}).json()
    assert u["samples"] == 6 and u["allocated_gpu_seconds"] == pytest.approx(50.0)
    # the same batch with one bad value anywhere is refused whole
    bad = envelope(to_series(samples, "n1", binary=True), seq=next(_SEQ))
    bad["series"][0]["power_watts"] = pack_d(200, 200, 200, 200, 200, -1)
    r = c.post("/api/v1/samples", content=msgpack.packb(bad), headers={"Content-Type": MSGPACK})
    assert r.status_code == 400 and "series[0].power_watts[5]" in r.json()["error"]
    assert c.get("/api/v1/totals").json()["samples"] == before + 6
    # an empty series list is a valid, empty batch
    r = c.post("/api/v1/samples", content=msgpack.packb(envelope([], seq=next(_SEQ))),
               headers={"Content-Type": MSGPACK})
    assert r.status_code == 200 and r.json()["accepted"] == 0, r.text
    assert c.get("/api/v1/totals").json()["samples"] == before + 6


@needs_fast
def test_the_fast_path_takes_a_series_batch_with_job_records_itself():
    # the typed decode leaves a record's arrays as tuples; they are the record's arrays all the same (before, every
    # batch carrying job records fell to the per-sample path)
    samples = _base_samples()
    doc = envelope(to_series(samples, "n1", binary=True),
                   jobs=[{"job_id": "42", "user": "ann", "hosts": ["n1"], "gpus": 1,
                          "tres": [["gres/gpu", 1.0]]}])
    fast = validate._parse_fast(msgpack.packb(doc), NOW, "n1")
    assert fast is not None and Counter(fast.samples) == Counter(samples)
    assert [(j.job_id, j.hosts, j.tres) for j in fast.jobs] == [("42", ("n1",), (("gres/gpu", 1.0),))]
