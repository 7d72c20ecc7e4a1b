"""Pure parsing and validation of what agents send: a batch is accepted whole or rejected whole.

Every error names the batch (agent_id/seq), the sample index and the field, so an operator can find
the offending agent from the collector's answer alone.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import operator
import zlib
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zstandard

try:  # optional: decodes and type-checks msgpack batches in C; without it every batch takes the per-sample path
    import msgspec
except ImportError:  # pragma: no cover - depends on the environment
    msgspec = None

from agent.records import INT_FIELDS, NONNEG_FIELDS, RATIO_FIELDS, SAMPLE_FIELDS, GpuProcess, GpuSample, JobRecord

MAX_BODY_BYTES = 64 * 1024 * 1024  # decoded size; a 5,000-sample JSON batch is about 5 MB
FUTURE_SLACK_S = 300.0
# Bounds that keep every accepted value storable and summable: SQLite integers are signed 64-bit (a
# larger one would fail inside the store's transaction, a 500), and a float near 1e308 would turn
# aggregates into inf, which JSON cannot carry. No GPU reading comes near either bound.
MAX_INT = 2**63 - 1
MAX_FLOAT = 1e18
BATCH_KEYS = frozenset({"agent_id", "seq", "host", "samples", "jobs"})  # jobs: optional
_REQUIRED = ("ts", "host", "gpu_uuid", "gpu_index")
_RATIOS = frozenset(RATIO_FIELDS)
_NONNEG = frozenset(NONNEG_FIELDS)
_INTS = frozenset(INT_FIELDS)
_FIELDS = frozenset(SAMPLE_FIELDS)
_FLOATS = frozenset({"temp_celsius"})
_STRS = frozenset({"host", "gpu_uuid", "model", "source"})
_SAMPLE_TYPES = {f.name: str(f.type) for f in fields(GpuSample)}
# Fields with a dedicated rule below; any other (newly added) field is checked by its annotation.
_HANDLED = _RATIOS | _NONNEG | _INTS | _FLOATS | _STRS | {
    "ts", "gpu_index", "mig", "xid_errors", "job_ids", "job_shares", "processes"}


class BatchError(ValueError):
    """A rejected request: ``status`` is the HTTP status to answer with, ``message`` says why.

    ``reason`` is a short label for the collector's rejection metrics (``malformed``, ``too_large``,
    ``unsupported``, ``invalid``, ``future``, ``unauthorized``, ``forbidden``); ``samples`` is how many
    samples the rejected batch held, when that is known (0 otherwise).
    """

    def __init__(self, status: int, message: str, reason: str = "invalid", samples: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.samples = samples


class Batch:
    """A validated batch. ``rows`` are what the store aggregates and packs: the GpuSamples, or (from the
    columnar fast path) msgspec structs with exactly GpuSample's fields, which cost a fraction of a GpuSample
    to build; ``samples`` turns them into GpuSamples only when asked (tests, sinks)."""

    __slots__ = ("agent_id", "seq", "host", "_samples", "rows", "jobs")

    def __init__(self, agent_id: str, seq: int, host: str, samples: tuple[GpuSample, ...] = (),
                 rows: tuple[Any, ...] | list[Any] | None = None, jobs: tuple[JobRecord, ...] = ()) -> None:
        self.agent_id, self.seq, self.host = agent_id, seq, host
        self.jobs = tuple(jobs)  # job metadata the agent knows (user, account, GPUs) for jobs on this host
        self._samples = None if rows is not None else tuple(samples)
        self.rows = rows if rows is not None else self._samples

    @property
    def samples(self) -> tuple[GpuSample, ...]:
        if self._samples is None:
            self._samples = tuple(as_sample(r) for r in self.rows)
        return self._samples

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return (self.agent_id, self.seq, self.host, self.samples) == (other.agent_id, other.seq, other.host,
                                                                      other.samples)

    def __repr__(self) -> str:
        return f"Batch(agent_id={self.agent_id!r}, seq={self.seq!r}, host={self.host!r}, samples={len(self.rows)})"


def as_sample(r: Any) -> GpuSample:
    """A GpuSample from a fast-path row (fields in SAMPLE_FIELDS order); a GpuSample is returned as is."""
    return r if type(r) is GpuSample else GpuSample(*msgspec.structs.astuple(r))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT - 1 <= v <= MAX_INT


def _is_num(v: Any) -> bool:
    """A finite number within +-MAX_FLOAT (so NaN and inf are never numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= MAX_FLOAT


def decode_body(body: bytes, content_type: str, content_encoding: str = "", max_bytes: int = MAX_BODY_BYTES) -> Any:
    """Decompress (gzip, zstd) and decode (JSON, msgpack) a request body; BatchError on failure."""
    return _decode(_decompress(body, content_encoding, max_bytes), content_type)


def _decompress(body: bytes, content_encoding: str, max_bytes: int) -> bytes:
    if len(body) > max_bytes:
        raise BatchError(413, f"body of {len(body)} bytes exceeds the limit of {max_bytes}", "too_large")
    enc = content_encoding.strip().lower()
    try:
        if enc == "gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            body = d.decompress(body, max_bytes + 1)  # bounded: a small bomb cannot eat memory
            if len(body) > max_bytes or d.unconsumed_tail:
                raise BatchError(413, f"decompressed body exceeds the limit of {max_bytes} bytes", "too_large")
        elif enc == "zstd":
            body = _unzstd_bounded(body, max_bytes + 1)
            if len(body) > max_bytes:
                raise BatchError(413, f"decompressed body exceeds the limit of {max_bytes} bytes", "too_large")
        elif enc not in ("", "identity"):
            raise BatchError(415, f"unsupported Content-Encoding {content_encoding!r} (use gzip or zstd)", "unsupported")
    except (zlib.error, zstandard.ZstdError, EOFError, gzip.BadGzipFile) as e:
        raise BatchError(400, f"body is not valid {enc}: {e}", "malformed") from None
    return body


_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


def _decode(body: bytes, content_type: str) -> Any:
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime in ("application/json", ""):
        try:
            # NaN/Infinity (not JSON, but Python emits them) parse as floats, so the field checks
            # below reject them with the field's name.
            return json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise BatchError(400, f"malformed JSON: {e}", "malformed") from None
    if mime in _MSGPACK_TYPES:
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise BatchError(400, f"malformed msgpack: {e}", "malformed") from None
    raise BatchError(
        415, f"unsupported Content-Type {content_type!r} (use application/json or application/msgpack)", "unsupported"
    )


def _unzstd_bounded(body: bytes, limit: int) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
    parts, n = [], 0
    while n < limit:
        chunk = reader.read(min(1 << 20, limit - n))
        if not chunk:
            break
        parts.append(chunk)
        n += len(chunk)
    return b"".join(parts)


def parse_batch(
    body: bytes,
    content_type: str,
    now: float,
    max_bytes: int = MAX_BODY_BYTES,
    content_encoding: str = "",
    allowed_host: str | None = None,
) -> Batch:
    """Decode and validate a sample batch; raises BatchError naming batch, sample index and field.

    With ``allowed_host`` (the host a node token is bound to), a batch or sample of any other host is a 403.
    """
    body = _decompress(body, content_encoding, max_bytes)
    if _FAST is not None and content_type.split(";", 1)[0].strip().lower() in _MSGPACK_TYPES:
        fast = _parse_fast(body, now, allowed_host)
        if fast is not None:
            return fast
    # The per-sample path: authoritative for anything the fast path declines, and the one that words errors.
    doc = _decode(body, content_type)
    if not isinstance(doc, dict):
        raise BatchError(400, f"batch must be an object with keys {sorted(BATCH_KEYS)}, got {type(doc).__name__}")
    agent_id, seq = doc.get("agent_id"), doc.get("seq")
    where = f"batch agent_id={agent_id!r} seq={seq!r}"
    extra = set(doc) - BATCH_KEYS
    if extra:
        raise BatchError(400, f"{where}: unknown field(s) {sorted(map(str, extra))}")
    if not isinstance(agent_id, str) or not agent_id:
        raise BatchError(400, f"{where}: field 'agent_id' must be a non-empty string")
    if not _is_int(seq) or seq < 0:
        raise BatchError(400, f"{where}: field 'seq' must be an integer in 0..{MAX_INT}")
    host, samples = doc.get("host"), doc.get("samples")
    if not isinstance(host, str) or not host:
        raise BatchError(400, f"{where}: field 'host' must be a non-empty string")
    if not isinstance(samples, list):
        raise BatchError(400, f"{where}: field 'samples' must be a list")
    if allowed_host is not None and host != allowed_host:
        raise BatchError(403, f"{where}: field 'host' is {host!r} but the token is bound to host {allowed_host!r}",
                         "forbidden", len(samples))
    try:
        bound = allowed_host is not None
        out = tuple(_parse_sample(d, i, where, host, now, bound) for i, d in enumerate(samples))
        jobs = _job_records(doc.get("jobs", []), f"{where}: ", host, bound)
    except BatchError as e:
        e.samples = len(samples)  # the whole batch is refused: every sample in it counts as rejected
        raise
    return Batch(agent_id, seq, host, out, jobs=tuple(jobs))


_BAD = object()  # what a field check returns for an invalid value (None can be a valid value)


def _opt(check: Any) -> Any:
    """The check of an optional field: None passes as None."""
    return lambda v: None if v is None else check(v)


def _ratio(v: Any) -> Any:
    t = type(v)  # exact types: bool is not a number here; NaN fails every comparison
    if t is float:
        return v if 0.0 <= v <= 1.0 else _BAD
    return float(v) if t is int and 0 <= v <= 1 else _BAD


def _nonneg(v: Any) -> Any:
    t = type(v)
    if t is float:
        return v if 0.0 <= v <= MAX_FLOAT else _BAD
    return float(v) if t is int and 0 <= v <= MAX_FLOAT else _BAD


def _finite(v: Any) -> Any:
    t = type(v)
    if t is float:
        return v if -MAX_FLOAT <= v <= MAX_FLOAT else _BAD
    return float(v) if t is int and -MAX_FLOAT <= v <= MAX_FLOAT else _BAD


def _count(v: Any) -> Any:
    return v if type(v) is int and 0 <= v <= MAX_INT else _BAD


def _name(v: Any) -> Any:
    return v if type(v) is str and v else _BAD


def _text(v: Any) -> Any:
    return v if type(v) is str else _BAD


def _xids(v: Any) -> Any:
    return tuple(v) if type(v) is list and all(_is_int(x) for x in v) else _BAD


def _job_ids(v: Any) -> Any:
    ok = type(v) is list and all(type(x) is str and x for x in v) and len(set(v)) == len(v)
    return tuple(v) if ok else _BAD


def _shares(v: Any) -> Any:
    if type(v) is not list or not all(_is_num(x) and x >= 0 for x in v):
        return _BAD
    return tuple(float(x) for x in v)


def _processes(v: Any) -> Any:
    if type(v) is not list or not all(
        type(p) is list and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and (p[1] is None or (_is_int(p[1]) and p[1] >= 0))
        for p in v
    ):
        return _BAD
    return tuple(GpuProcess(p[0], p[1]) for p in v)


def _by_annotation(field: str) -> Any:
    annotation = _SAMPLE_TYPES[field]
    return lambda v: v if _check_annotation(annotation, v) else _BAD


# field -> (check returning the stored value or _BAD, what a valid value is). One dict lookup a field: this
# is the collector's hottest loop.
_CHECKS: dict[str, tuple[Any, str]] = {
    "ts": (lambda v: _BAD if (r := _nonneg(v)) is _BAD or r <= 0 else r,
           "must be a positive finite number (unix seconds)"),
    "host": (_name, "must be a non-empty string"),
    "gpu_uuid": (_name, "must be a non-empty string"),
    "model": (_text, "must be a string"),
    "source": (_text, "must be a string"),
    "gpu_index": (_count, f"must be an integer in 0..{MAX_INT}"),
    "mig": (_opt(_name), "must be a non-empty string or null"),
    "xid_errors": (_xids, "must be a list of integers"),
    "job_ids": (_job_ids, "must be a list of distinct non-empty strings"),
    "job_shares": (_shares, "must be a list of non-negative finite numbers"),
    "processes": (_processes, "must be a list of [pid, used_memory_bytes or null]"),
    **{k: (_opt(_ratio), "ratio must be a finite number in 0..1") for k in _RATIOS},
    **{k: (_opt(_nonneg), f"must be a finite number in 0..{MAX_FLOAT:g}") for k in _NONNEG},
    **{k: (_opt(_count), f"must be an integer in 0..{MAX_INT}") for k in _INTS},
    **{k: (_opt(_finite), f"must be a finite number within +-{MAX_FLOAT:g}") for k in _FLOATS},
}
for _f in _FIELDS - _CHECKS.keys():  # a newly added record field: checked by its annotation
    _CHECKS[_f] = (_by_annotation(_f), f"expected {_SAMPLE_TYPES[_f]}")


def _parse_sample(d: Any, i: int, where: str, host: str, now: float, bound: bool = False) -> GpuSample:
    if type(d) is not dict:
        raise BatchError(400, f"{where}: sample[{i}]: must be an object, got {type(d).__name__}")
    for k in _REQUIRED:
        if k not in d:
            if any(f not in _FIELDS for f in d):
                break  # name the unknown field first
            raise BatchError(400, f"{where}: sample[{i}].{k}: missing")
    else:
        if d["host"] != host:
            # Checked before the values. Under a host-bound token another host's sample is a 403, else a 400.
            status, reason = (403, "forbidden") if bound else (400, "invalid")
            raise BatchError(status, f"{where}: sample[{i}].host: {d['host']!r} differs from the batch's host {host!r}",
                             reason)
    checks = _CHECKS
    for k, v in d.items():
        entry = checks.get(k)
        if entry is None:
            raise BatchError(400, f"{where}: sample[{i}]: unknown field {str(k)!r}")
        r = entry[0](v)
        if r is _BAD:
            raise BatchError(400, f"{where}: sample[{i}].{k}: {entry[1]} (got {v!r})")
        if r is not v:
            d[k] = r  # the converted value (a float for an int reading, tuples for lists): same keys, safe
    if d["ts"] > now + FUTURE_SLACK_S:
        raise BatchError(400, f"{where}: sample[{i}].ts: is more than {FUTURE_SLACK_S:.0f} s in the future "
                              f"(collector time {now:.3f}) (got {d['ts']!r})", "future")
    shares = d.get("job_shares")
    if shares:
        jobs = d.get("job_ids") or ()
        if len(shares) != len(jobs):
            raise BatchError(400, f"{where}: sample[{i}].job_shares: must have one share per job id ({len(jobs)}) "
                                  f"or be empty (got {list(shares)!r})")
        if abs(math.fsum(shares) - 1.0) > 1e-6:
            raise BatchError(400, f"{where}: sample[{i}].job_shares: must sum to 1 (got {list(shares)!r})")
    return GpuSample(**d)


# -- the fast path (msgpack batches, msgspec installed) -------------------------------------------
# msgspec decodes a batch straight into structs and checks types and ranges in C (bool is no number, NaN
# fails every bound, unknown fields fail); what is left (the batch's host, future times, job id sets and
# shares) is checked a column or a distinct job set at a time. It only ever accepts: a batch it doubts goes
# to the per-sample path, which is authoritative and words the error. The rules mirror _CHECKS;
# tests/collector/test_validate.py checks that both paths decide every batch alike.
def _fast_decoder() -> Any:
    if msgspec is None or not _FIELDS <= _HANDLED:
        return None  # a field this path has no rule for: everything goes the per-sample way
    from typing import Annotated

    def num(t: type, **bounds: Any) -> Any:
        return Annotated[t, msgspec.Meta(**bounds)]

    name = num(str, min_length=1)
    count = num(int, ge=0, le=MAX_INT)
    types: dict[str, Any] = {
        "ts": num(float, gt=0.0, le=MAX_FLOAT), "host": name, "gpu_uuid": name, "model": str, "source": str,
        "gpu_index": count, "mig": name | None, "xid_errors": tuple[num(int, ge=-MAX_INT - 1, le=MAX_INT), ...],
        "job_ids": tuple[name, ...], "job_shares": tuple[num(float, ge=0.0, le=MAX_FLOAT), ...],
        "processes": tuple[tuple[count, count | None], ...],
        **{k: num(float, ge=0.0, le=1.0) | None for k in _RATIOS},
        **{k: num(float, ge=0.0, le=MAX_FLOAT) | None for k in _NONNEG},
        **{k: count | None for k in _INTS},
        **{k: num(float, ge=-MAX_FLOAT, le=MAX_FLOAT) | None for k in _FLOATS},
    }
    # SAMPLE_FIELDS order, so astuple() feeds GpuSample(*...); gc=False: rows hold only strings, numbers
    # and tuples of them (no cycles), and skipping GC tracking makes them cheaper
    spec = [(f.name, types[f.name]) if f.name in _REQUIRED else (f.name, types[f.name], f.default)
            for f in fields(GpuSample)]
    row = msgspec.defstruct("WireSample", spec, forbid_unknown_fields=True, gc=False)
    wire = msgspec.defstruct("WireBatch", [("agent_id", name), ("seq", count), ("host", name),
                                           ("samples", list[row])], forbid_unknown_fields=True)
    return msgspec.msgpack.Decoder(wire)


_FAST = _fast_decoder()
_HOST, _TS, _JOBS = (operator.attrgetter(f) for f in ("host", "ts", "job_ids"))
_SHARES, _PROCS = operator.attrgetter("job_shares"), operator.attrgetter("processes")


def _parse_fast(body: bytes, now: float, allowed_host: str | None) -> Batch | None:
    """The batch, or None where the per-sample path must decide (and word any error)."""
    try:
        b = _FAST.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    host, rows = b.host, b.samples
    if (not rows or (allowed_host is not None and host != allowed_host)
            or list(map(_HOST, rows)).count(host) != len(rows) or max(map(_TS, rows)) > now + FUTURE_SLACK_S):
        return None
    # job ids and shares: checked once per distinct combination (a GPU's job rarely changes within a batch)
    for jobs, shares in set(zip(map(_JOBS, rows), map(_SHARES, rows))):
        if len(set(jobs)) != len(jobs):
            return None
        if shares and (len(shares) != len(jobs) or abs(math.fsum(shares) - 1.0) > 1e-6):
            return None
    if any(map(_PROCS, rows)):
        for r in rows:
            if r.processes:
                r.processes = tuple(GpuProcess(p, m) for p, m in r.processes)
    return Batch(b.agent_id, b.seq, host, rows=rows)


def _check_annotation(annotation: str, v: Any) -> bool:
    """Does a JSON value fit a record field's annotation? Covers the shapes the records use."""
    if annotation.endswith(" | None"):
        return v is None or _check_annotation(annotation[: -len(" | None")], v)
    if annotation == "str":
        return isinstance(v, str)
    if annotation == "int":
        return _is_int(v)
    if annotation == "float":
        return _is_num(v) and math.isfinite(v)
    if annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        inner = annotation[len("tuple["): -len(", ...]")]
        return isinstance(v, list) and all(_check_annotation(inner, x) for x in v)
    if annotation == "tuple[str, float]":
        return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and _check_annotation("float", v[1])
    raise TypeError(f"validator does not know the annotation {annotation!r}")  # a new record shape: teach it


_JOB_FIELDS = {f.name: str(f.type) for f in fields(JobRecord)}


def parse_jobs(body: bytes, content_type: str, max_bytes: int = MAX_BODY_BYTES, content_encoding: str = "") -> list[JobRecord]:
    """Decode and validate a list of JobRecord dicts; BatchError names the record index and field."""
    doc = decode_body(body, content_type, content_encoding, max_bytes)
    if not isinstance(doc, list):
        raise BatchError(400, f"jobs body must be a list of job records, got {type(doc).__name__}")
    return _job_records(doc, "")


def _job_records(doc: Any, where: str, host: str | None = None, bound: bool = False) -> list[JobRecord]:
    """Validate JobRecord dicts; with ``host`` (an agent's batch) each record must be about a job on that host."""
    if not isinstance(doc, list):
        raise BatchError(400, f"{where}field 'jobs' must be a list of job records")
    out = []
    for i, d in enumerate(doc):
        at = f"{where}job[{i}]"
        if not isinstance(d, dict):
            raise BatchError(400, f"{at}: must be an object")
        for k, v in d.items():
            if k not in _JOB_FIELDS:
                raise BatchError(400, f"{at}: unknown field {str(k)!r}")
            if not _check_annotation(_JOB_FIELDS[k], v) or (k == "job_id" and not v):
                raise BatchError(400, f"{at}.{k}: expected {_JOB_FIELDS[k]} (got {v!r})")
        if "job_id" not in d:
            raise BatchError(400, f"{at}.job_id: missing")
        rec = JobRecord.from_dict(d)
        if host is not None and rec.hosts and host not in rec.hosts:
            # A node may describe only jobs it runs (under a host-bound token: 403, as for samples).
            status, reason = (403, "forbidden") if bound else (400, "invalid")
            raise BatchError(status, f"{at}.hosts: {list(rec.hosts)!r} does not include the batch's host {host!r}",
                             reason)
        out.append(rec)
    return out
