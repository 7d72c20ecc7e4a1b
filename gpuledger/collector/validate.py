"""Pure parsing and validation of what agents send: a batch is accepted whole or rejected whole.

Every error names the batch (agent_id/seq), the sample index and the field, so an operator can find
the offending agent from the collector's answer alone.

The rules have two implementations, and production needs both. The per-sample path (``_CHECKS``,
``_parse_sample``, ``_parse_series`` untyped) is the reference: it reads every format (JSON and msgpack)
and words every error. The fast path (``_parse_fast``: msgspec structs typed from the same bounds, for
msgpack bodies) checks types and ranges in C, for the ingest rate; it only ever accepts, and hands
anything it doubts to the per-sample path. ``tests/collector/test_validate.py`` and
``test_validate_series.py`` check that both decide every batch alike.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import math
import operator
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from operator import is_not
from typing import Annotated, Any, TypeGuard

import msgpack
import msgspec
import numpy as np
import zstandard

from gpuledger.collector.series import Series, row_list
from gpuledger.schema import limits as wire_limits
from gpuledger.schema.records import (
    INT_FIELDS,
    NONNEG_FIELDS,
    RATIO_FIELDS,
    SAMPLE_FIELDS,
    GpuProcess,
    GpuSample,
    JobRecord,
)
from gpuledger.schema.wire import COLUMNS, INT_COLUMNS, ROW_LISTS, SERIES_CONSTANTS

# The batch limits' defaults are the agent's too (it splits its batches to fit): one set of numbers, in schema.limits
MAX_BODY_BYTES = wire_limits.MAX_BODY_BYTES
FUTURE_SLACK_S = 300.0
# Bounds that keep every accepted value storable and summable: SQLite integers are signed 64-bit (a
# larger one would fail inside the store's transaction, a 500), and a float near 1e308 would turn
# aggregates into inf, which JSON cannot carry. No GPU reading comes near either bound.
MAX_INT = 2**63 - 1
MAX_FLOAT = 1e18
SHARES_SUM_TOLERANCE = 1e-6  # a sample's job shares must sum to 1 within this
BATCH_KEYS = frozenset({"agent_id", "seq", "host", "cluster", "samples", "series", "jobs"})  # one of samples/series;
# jobs and cluster optional (cluster: the Slurm cluster the agent's host is in; absent or "" = not named)
MAX_CLUSTER_CHARS = 256
# Characters no accepted string holds: PostgreSQL text cannot hold NUL (a 500 the agent would retry for good), and an
# unpaired surrogate (a JSON escape) is no UTF-8. Names (hosts, GPUs, job ids, users, ...) hold no control
# character either (C0, DEL: they would forge log lines and labels); free text (model, source, job state) may.
_BAD_NAME = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
_NAME_CHARS = "without control characters or unpaired surrogates"
_TEXT_CHARS = "without NUL characters or unpaired surrogates"
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


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may hold, checked while it is decoded (before the objects exist): a request's memory
    is bounded by these, never by what the sender claims. Counts over a limit are a 413, a string too long
    a 400. The decoded body is at most ``max_body_bytes``, and each list's length is bounded; the lists whose
    elements cost least on the wire and most in memory (processes: 3 bytes, ~100 in memory) by ``max_batch_list``
    over the whole batch as well. With the defaults, validating one body costs at most about 100 MiB for an
    instant, typical agent batches (80 samples: 8 KiB) well under 1 MiB.
    Measured: ru_maxrss growth of one parse_batch in a fresh process, bodies with every list at its limit: 92 MiB."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_samples: int = wire_limits.MAX_SAMPLES  # per batch (all series together); a default agent batch has 80
    max_series: int = wire_limits.MAX_SERIES  # series (or GPUs and MIG instances) per batch
    max_job_ids: int = wire_limits.MAX_SAMPLE_JOB_IDS  # per sample or series (jobs sharing one GPU at once)
    max_batch_job_ids: int = wire_limits.MAX_BATCH_JOB_IDS  # distinct job ids in one batch
    max_jobs: int = wire_limits.MAX_JOBS  # job records riding with one batch
    max_str: int = 256  # host, GPU uuid, job id, model, user, ... (characters)
    max_list: int = wire_limits.MAX_ROW_LIST  # per sample: processes, Xid errors; per job record: GPUs, TRES
    max_job_hosts: int = wire_limits.MAX_JOB_HOSTS  # per job record: hosts
    # per batch, all samples together: processes, and Xid errors (each; 1,000 samples of max_list); all job records
    # together: hosts. A process is 3 bytes of msgpack but ~100 of memory: max_samples x max_list of them would be
    # 500 MiB; a host 3 bytes and ~50.
    max_batch_list: int = wire_limits.MAX_BATCH_LIST

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"limit {f.name} must be positive, got {getattr(self, f.name)!r}")


DEFAULT_LIMITS = Limits()
# A body this small whose typed decode failed is decoded again untyped to word the error (the per-sample
# path's message names batch, index and field); its untyped objects cost at most ~72x this (empty maps).
_WORDING_MAX_BYTES = 64 * 1024


class BatchError(ValueError):
    """A rejected request: ``status`` is the HTTP status to answer with, ``message`` says why.

    ``reason`` is a short label for the collector's rejection metrics (``malformed``, ``too_large``,
    ``unsupported``, ``invalid``, ``future``, ``unauthorized``, ``forbidden``); ``samples`` is how many
    samples the rejected batch held, when that is known (0 otherwise); ``job`` the index of the job record that
    is the cause, when one is (the answer says it: an agent sends the batch again without that record).
    """

    def __init__(self, status: int, message: str, reason: str = "invalid", samples: int = 0,
                 job: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.samples = samples
        self.job = job


class Batch:
    """A validated batch: row-layout samples (``rows``) and/or columnar ``series`` (``collector.series``).

    ``rows`` are what the store aggregates and packs a sample at a time: GpuSamples, or (from the msgspec
    fast path) structs with exactly GpuSample's fields, which cost a fraction of a GpuSample to build.
    ``samples`` turns everything into GpuSamples only when asked (tests, sinks)."""

    __slots__ = ("agent_id", "seq", "host", "_samples", "rows", "series", "jobs", "cluster", "digest")

    def __init__(self, agent_id: str, seq: int, host: str, samples: tuple[GpuSample, ...] = (),
                 rows: tuple[Any, ...] | list[Any] | None = None, jobs: tuple[JobRecord, ...] = (),
                 series: tuple[Series, ...] = (), cluster: str = "") -> None:
        self.agent_id, self.seq, self.host, self.cluster = agent_id, seq, host, cluster
        self.jobs = tuple(jobs)  # job metadata the agent knows (user, account, GPUs) for jobs on this host
        self.series = tuple(series)
        self._samples = None if rows is not None or self.series else tuple(samples)
        self.rows = rows if rows is not None else tuple(samples)
        self.digest: bytes | None = None  # of the decoded body (parse_batch sets it): a resend from a conflict

    @property
    def n_samples(self) -> int:
        return len(self.rows) + sum(s.n for s in self.series)

    @property
    def samples(self) -> tuple[GpuSample, ...]:
        if self._samples is None:
            self._samples = tuple([*(as_sample(r) for r in self.rows), *(r for s in self.series for r in s.rows())])
        return self._samples

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return (self.agent_id, self.seq, self.host, self.samples) == (other.agent_id, other.seq, other.host,
                                                                      other.samples)

    def __repr__(self) -> str:
        return (f"Batch(agent_id={self.agent_id!r}, seq={self.seq!r}, host={self.host!r}, "
                f"samples={self.n_samples}, series={len(self.series)})")


def as_sample(r: Any) -> GpuSample:
    """A GpuSample from a fast-path row (fields in SAMPLE_FIELDS order); a GpuSample is returned as is."""
    return r if type(r) is GpuSample else GpuSample(*msgspec.structs.astuple(r))


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and -MAX_INT - 1 <= v <= MAX_INT


def _is_num(v: Any) -> bool:
    """A finite number within +-MAX_FLOAT (so NaN and inf are never numbers here); ints bounded as floats."""
    f = _float(v)
    return f is not None and -MAX_FLOAT <= f <= MAX_FLOAT


def decode_body(body: bytes, content_type: str, content_encoding: str = "", max_bytes: int = MAX_BODY_BYTES) -> Any:
    """Decompress (gzip, zstd) and decode (JSON, msgpack) a request body; BatchError on failure."""
    return _decode(_decompress(body, content_encoding, max_bytes), content_type)


def _decompress(body: bytes, content_encoding: str, max_bytes: int) -> bytes:
    if len(body) > max_bytes:
        raise BatchError(413, f"body of {len(body)} bytes exceeds the limit of {max_bytes}", "too_large")
    enc = content_encoding.strip().lower()
    try:
        if enc == "gzip":
            body = _gunzip_bounded(body, max_bytes + 1)
            if len(body) > max_bytes:
                raise BatchError(413, f"decompressed body exceeds the limit of {max_bytes} bytes", "too_large")
        elif enc == "zstd":
            body = _unzstd_bounded(body, max_bytes + 1)
            if len(body) > max_bytes:
                raise BatchError(413, f"decompressed body exceeds the limit of {max_bytes} bytes", "too_large")
        elif enc not in ("", "identity"):
            raise BatchError(415, f"unsupported Content-Encoding {content_encoding!r} (use gzip or zstd)",
                             "unsupported")
    except (zlib.error, zstandard.ZstdError, EOFError, gzip.BadGzipFile) as e:
        raise BatchError(400, f"body is not valid {enc}: {e}", "malformed") from None
    return body


_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_JSON_TYPES = ("application/json", "")


def _decode(body: bytes, content_type: str) -> Any:
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime in _JSON_TYPES:
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
            raise BatchError(400, f"malformed msgpack: {str(e) or type(e).__name__}", "malformed") from None
    raise BatchError(
        415, f"unsupported Content-Type {content_type!r} (use application/json or application/msgpack)", "unsupported"
    )


def _gunzip_bounded(body: bytes, limit: int) -> bytes:
    """Every member of a gzip body (RFC 1952 2.2: members one after the other are one stream), inflated to at most
    ``limit`` bytes in all (bounded as it inflates: a small bomb cannot eat memory); BatchError for a stream cut
    short or followed by anything but another member."""
    parts, n, rest, members = [], 0, body, 0
    while n < limit:
        if members and rest[:2] != b"\x1f\x8b":
            raise BatchError(400, f"body is not valid gzip (Content-Encoding: gzip): {len(rest)} bytes after member "
                                  f"{members} are not another member", "malformed")
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        parts.append(d.decompress(rest, limit - n))
        n += len(parts[-1])
        members += 1
        if n < limit and not d.eof:
            raise BatchError(400, f"body is not valid gzip (Content-Encoding: gzip): it ends inside member {members}",
                             "malformed")
        rest = d.unused_data
        if not rest:
            break
    return b"".join(parts)


def _unzstd_bounded(body: bytes, limit: int) -> bytes:
    # every frame (RFC 8878 3.1: frames one after the other are one stream), as for gzip's members
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
    parts, n = [], 0
    while n < limit:
        chunk = reader.read(min(1 << 20, limit - n))
        if not chunk:
            break
        parts.append(chunk)
        n += len(chunk)
    if n < limit:
        # the stream reader ends quietly inside a frame cut short; each frame must be whole (what it inflates to is
        # known by now to be under the limit, so this second pass is bounded too)
        rest, frames = body, 0
        while rest or not frames:  # an empty body is a frame cut short too
            d = zstandard.ZstdDecompressor().decompressobj()
            d.decompress(rest)
            frames += 1
            if not d.eof:
                raise BatchError(400, f"body is not valid zstd (Content-Encoding: zstd): it ends inside frame {frames}",
                                 "malformed")
            rest = d.unused_data
    return b"".join(parts)


def parse_batch(
    body: bytes,
    content_type: str,
    now: float,
    max_bytes: int | None = None,
    content_encoding: str = "",
    allowed_host: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    allowed_cluster: str | None = None,
) -> Batch:
    """Decode and validate a sample batch; raises BatchError naming batch, sample index and field.

    With ``allowed_host`` (the host a node token is bound to), a batch or sample of any other host is a 403.
    With ``allowed_cluster`` (the cluster a node token is bound to), a batch naming another cluster is a 403, and
    one naming none is that cluster's (its GPUs and job records).
    ``limits`` bound what a batch may hold; they are checked while decoding (``max_bytes``, when given,
    replaces ``limits.max_body_bytes``).
    """
    body = _decompress(body, content_encoding, limits.max_body_bytes if max_bytes is None else max_bytes)
    mime = content_type.split(";", 1)[0].strip().lower()
    batch = None
    if _FAST is not None and mime in (*_MSGPACK_TYPES, *_JSON_TYPES):
        # Typed decode first: msgspec checks shape, types, ranges and every length limit as it goes, so a
        # hostile body (a bomb of empty maps, 200,000 job ids) fails before its objects exist.
        batch = _parse_fast(body, now, allowed_host, limits, json_body=mime in _JSON_TYPES,
                            allowed_cluster=allowed_cluster)
    if batch is None:
        # The per-sample path: authoritative for what the fast path doubts (its shape is valid and within the
        # limits by now), and the one that words errors.
        batch = _parse_doc(_decode(body, content_type), now, allowed_host, allowed_cluster)
    batch.digest = content_digest(body)
    return batch


# A batch's content digest: this tag, then SHA-256 of its decoded body, cut to 16 bytes (collisions between one
# agent's batches of one key are what it tells apart). Ledgers written before hold 16-byte BLAKE2b digests of the
# same bodies: a digest of the other form is not compared (as a batch stored without one, it matches any content).
# SHA-256 because CPUs hash it in hardware: 5 us for an agent's 80-sample batch, against 10 for BLAKE2b.
DIGEST_TAG = b"\x02"


def content_digest(body: bytes) -> bytes:
    return DIGEST_TAG + hashlib.sha256(body).digest()[:16]


def _parse_doc(doc: Any, now: float, allowed_host: str | None, allowed_cluster: str | None = None) -> Batch:
    if not isinstance(doc, dict):
        raise BatchError(400, f"batch must be an object with keys {sorted(BATCH_KEYS)}, got {type(doc).__name__}")
    agent_id, seq = doc.get("agent_id"), doc.get("seq")
    where = f"batch agent_id={agent_id!r} seq={seq!r}"
    extra = set(doc) - BATCH_KEYS
    if extra:
        raise BatchError(400, f"{where}: unknown field(s) {sorted(map(str, extra))}")
    if not isinstance(agent_id, str) or not agent_id or _BAD_NAME.search(agent_id):
        raise BatchError(400, f"{where}: field 'agent_id' must be a non-empty string {_NAME_CHARS}")
    if not _is_int(seq) or seq < 0:
        raise BatchError(400, f"{where}: field 'seq' must be an integer in 0..{MAX_INT}")
    host, samples = doc.get("host"), doc.get("samples")
    if not isinstance(host, str) or not host or _BAD_NAME.search(host):
        raise BatchError(400, f"{where}: field 'host' must be a non-empty string {_NAME_CHARS}")
    cluster = doc.get("cluster", "")
    if not is_cluster_name(cluster):
        raise BatchError(400, f"{where}: field 'cluster' must be {CLUSTER_RULE}")
    if ("samples" in doc) == ("series" in doc):
        raise BatchError(400, f"{where}: exactly one of the fields 'samples' (one object a sample) and 'series' "
                              "(columns) is required")
    if "series" in doc:
        return _parse_series_batch(doc, agent_id, seq, host, where, now, allowed_host, cluster, allowed_cluster)
    if not isinstance(samples, list):
        raise BatchError(400, f"{where}: field 'samples' must be a list")
    if allowed_host is not None and host != allowed_host:
        raise BatchError(403, f"{where}: field 'host' is {host!r} but the token is bound to host {allowed_host!r}",
                         "forbidden", len(samples))
    cluster = _bound_cluster(cluster, allowed_cluster, where, len(samples))
    try:
        bound = allowed_host is not None
        out = tuple(_parse_sample(d, i, where, host, now, bound) for i, d in enumerate(samples))
        jobs = _job_records(doc.get("jobs", []), f"{where}: ", host, bound, cluster)
    except BatchError as e:
        e.samples = len(samples)  # the whole batch is refused: every sample in it counts as rejected
        raise
    return Batch(agent_id, seq, host, out, jobs=tuple(jobs), cluster=cluster)


_BAD = object()  # what a field check returns for an invalid value (None can be a valid value)


def _opt(check: Any) -> Any:
    """The check of an optional field: None passes as None."""
    return lambda v: None if v is None else check(v)


def _float(v: Any) -> float | None:
    """A reading as the float a float field stores, or None when it is no number. An int converts first and is
    bounded after, as msgspec's fast path does it (so 10**18 + 1 is 1e18). Exact types: bool is no number."""
    t = type(v)
    if t is float:
        return v
    if t is int:
        try:
            return float(v)
        except OverflowError:
            return None
    return None


def _ratio(v: Any) -> Any:
    f = _float(v)  # NaN fails every comparison
    return f if f is not None and 0.0 <= f <= 1.0 else _BAD


def _nonneg(v: Any) -> Any:
    f = _float(v)
    return f if f is not None and 0.0 <= f <= MAX_FLOAT else _BAD


def _finite(v: Any) -> Any:
    f = _float(v)
    return f if f is not None and -MAX_FLOAT <= f <= MAX_FLOAT else _BAD


def _count(v: Any) -> Any:
    return v if type(v) is int and 0 <= v <= MAX_INT else _BAD


def is_name(s: str) -> bool:
    """Whether ``s`` may be a name (a host, a GPU, a job id, ...): no control character, no unpaired surrogate."""
    return _BAD_NAME.search(s) is None


CLUSTER_RULE = f"a string of at most {MAX_CLUSTER_CHARS} characters {_NAME_CHARS}"


def is_cluster_name(s: Any) -> bool:
    """Whether ``s`` may be a batch's cluster (``CLUSTER_RULE``; "" = not named); a node token's too (config)."""
    return isinstance(s, str) and len(s) <= MAX_CLUSTER_CHARS and is_name(s)


def _bound_cluster(cluster: str, allowed_cluster: str | None, where: str, samples: int) -> str:
    """The cluster a batch is stored under. A token bound to ``allowed_cluster`` gives it to a batch that names
    none; a batch naming another is a 403 (the stolen token of one cluster's gpu01 writing another's gpu01)."""
    if allowed_cluster is None or cluster == allowed_cluster:
        return cluster
    if not cluster:
        return allowed_cluster
    raise BatchError(403, f"{where}: field 'cluster' is {cluster!r} but the token is bound to cluster "
                          f"{allowed_cluster!r}", "forbidden", samples)


def _name(v: Any) -> Any:
    return v if type(v) is str and v and not _BAD_NAME.search(v) else _BAD


def _text(v: Any) -> Any:
    return v if type(v) is str and not _BAD_TEXT.search(v) else _BAD


def _xids(v: Any) -> Any:
    return tuple(v) if type(v) is list and all(_is_int(x) for x in v) else _BAD


def _job_ids(v: Any) -> Any:
    ok = type(v) is list and all(_name(x) is not _BAD for x in v) and len(set(v)) == len(v)
    return tuple(v) if ok else _BAD


def _shares(v: Any) -> Any:
    if type(v) is not list or not all(_is_num(x) and x >= 0 for x in v):
        return _BAD
    return tuple(float(x) for x in v)


def _process(p: Any) -> Any:
    """A process row -> GpuProcess, or _BAD: its types here, its bounds by :func:`_process_in_bounds` (the typed
    decode's check too)."""
    if not (type(p) is list and 2 <= len(p) <= 3 and _is_int(p[0]) and (p[1] is None or _is_int(p[1]))):
        return _BAD
    util = None if len(p) == 2 or p[2] is None else _float(p[2])
    if util is None and len(p) == 3 and p[2] is not None:  # not a number
        return _BAD
    proc = GpuProcess(p[0], p[1], util)
    return proc if _process_in_bounds(proc) else _BAD


def _processes(v: Any) -> Any:
    if type(v) is not list:
        return _BAD
    out = tuple(map(_process, v))
    return _BAD if any(p is _BAD for p in out) else out


def _process_in_bounds(p: GpuProcess) -> bool:
    """A process's bounds, for both paths (the typed decode checks a named tuple's types, not their bounds)."""
    mem, util = p.used_memory_bytes, p.gpu_util_ratio
    return 0 <= p.pid <= MAX_INT and (mem is None or 0 <= mem <= MAX_INT) and (util is None or 0.0 <= util <= 1.0)


def _first_out_of_bounds(rows: Sequence[tuple[GpuProcess, ...]]) -> int | None:
    """The first sample whose processes (as the typed decode built them) are not all within bounds, else None."""
    for j, row in enumerate(rows):
        if not all(map(_process_in_bounds, row)):
            return j
    return None


def _by_annotation(field: str) -> Any:
    annotation = _SAMPLE_TYPES[field]
    return lambda v: v if _check_annotation(annotation, v) and not any(map(_BAD_TEXT.search, _strings(v))) else _BAD


def _strings(v: Any) -> Iterator[str]:
    """The strings in a value of a record field (a string, or lists of them or of pairs; tuples from the typed
    decode)."""
    if isinstance(v, str):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _strings(x)


# field -> (check returning the stored value or _BAD, what a valid value is). One dict lookup a field: this
# is the collector's hottest loop.
_CHECKS: dict[str, tuple[Any, str]] = {
    "ts": (lambda v: _BAD if (r := _nonneg(v)) is _BAD or r <= 0 else r,
           "must be a positive finite number (unix seconds)"),
    "host": (_name, f"must be a non-empty string {_NAME_CHARS}"),
    "gpu_uuid": (_name, f"must be a non-empty string {_NAME_CHARS}"),
    "model": (_text, f"must be a string {_TEXT_CHARS}"),
    "source": (_text, f"must be a string {_TEXT_CHARS}"),
    "gpu_index": (_count, f"must be an integer in 0..{MAX_INT}"),
    "mig": (_opt(_name), f"must be a non-empty string {_NAME_CHARS}, or null"),
    "xid_errors": (_xids, "must be a list of integers"),
    "job_ids": (_job_ids, f"must be a list of distinct non-empty strings {_NAME_CHARS}"),
    "job_shares": (_shares, "must be a list of non-negative finite numbers"),
    "processes": (_processes, "must be a list of [pid, used_memory_bytes or null] or [pid, used_memory_bytes or "
                              "null, gpu_util_ratio 0..1 or null]"),
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
        if abs(math.fsum(shares) - 1.0) > SHARES_SUM_TOLERANCE:
            raise BatchError(400, f"{where}: sample[{i}].job_shares: must sum to 1 (got {list(shares)!r})")
    return GpuSample(**d)


# -- the columnar layout (agent.wire): a batch of series --------------------------------------------
_SERIES_KEYS = frozenset((*SERIES_CONSTANTS, *COLUMNS, *ROW_LISTS))
_INT_COLS = frozenset(INT_COLUMNS)


def _bounds(f: str) -> tuple[float, float]:
    """The range a numeric column's values must lie in (both ends included; ts must also be > 0)."""
    if f in _RATIOS:
        return 0.0, 1.0
    if f in _NONNEG or f == "ts":
        return 0.0, MAX_FLOAT
    if f in _INTS:
        return 0, MAX_INT
    if f in _FLOATS:
        return -MAX_FLOAT, MAX_FLOAT
    raise TypeError(f"no rule for column {f!r}")  # a new numeric field: give it a rule here and in _CHECKS


_COLUMN_BOUNDS = {f: _bounds(f) for f in COLUMNS}


def _series_rows(d: Any) -> int:
    """How many samples a (possibly invalid) series claims: for the rejection metrics only."""
    ts = d.get("ts") if isinstance(d, dict) else None
    return len(ts) // 8 if isinstance(ts, bytes) else len(ts) if isinstance(ts, list) else 0


def _parse_series_batch(doc: dict, agent_id: str, seq: int, host: str, where: str, now: float,
                        allowed_host: str | None, cluster: str = "", allowed_cluster: str | None = None) -> Batch:
    series = doc["series"]
    if not isinstance(series, list):
        raise BatchError(400, f"{where}: field 'series' must be a list")
    n = sum(map(_series_rows, series))
    if allowed_host is not None and host != allowed_host:
        raise BatchError(403, f"{where}: field 'host' is {host!r} but the token is bound to host {allowed_host!r}",
                         "forbidden", n)
    cluster = _bound_cluster(cluster, allowed_cluster, where, n)
    try:
        out = tuple(_parse_series(d, i, where, host, now, typed=False) for i, d in enumerate(series))
        jobs = _job_records(doc.get("jobs", []), f"{where}: ", host, allowed_host is not None, cluster)
    except BatchError as e:
        e.samples = n
        raise
    return Batch(agent_id, seq, host, jobs=tuple(jobs), series=out, cluster=cluster)


def _parse_series(d: Any, i: int, where: str, host: str, now: float, typed: bool,
                  checked: dict[str, np.ndarray] | None = None) -> Series:
    """One series map -> Series; BatchError names ``series[i].field[row]``. ``typed``: msgspec has already
    checked every constant and every list element (type and range), so only what it cannot is left.
    ``checked``: columns already checked by :func:`_binary_columns` (ts among them: not in the future)."""
    at = f"{where}: series[{i}]"
    if not typed:
        if type(d) is not dict:
            raise BatchError(400, f"{at}: must be an object, got {type(d).__name__}")
        for k in d:
            if k not in _SERIES_KEYS:
                hint = " (a series takes the batch's host)" if k == "host" else ""
                raise BatchError(400, f"{at}: unknown field {str(k)!r}{hint}")
        for k in ("gpu_uuid", "gpu_index", "ts"):
            if k not in d:
                raise BatchError(400, f"{at}.{k}: missing")
        for k in SERIES_CONSTANTS:
            if k in d:
                check, what = _CHECKS[k]
                r = check(d[k])
                if r is _BAD:
                    raise BatchError(400, f"{at}.{k}: {what} (got {d[k]!r})")
                d[k] = r
    ts_in = d["ts"]
    if type(ts_in) not in (list, bytes):
        raise BatchError(400, f"{at}.ts: must be a list of times or bytes of 8-byte times (got {_excerpt(ts_in)})")
    if not ts_in:
        raise BatchError(400, f"{at}.ts: must hold at least one time")
    if type(ts_in) is bytes and len(ts_in) % 8:
        raise BatchError(400, f"{at}.ts: {len(ts_in)} bytes is not a whole number of 8-byte values")
    n = len(ts_in) // 8 if type(ts_in) is bytes else len(ts_in)
    floats: dict[str, np.ndarray] = {}
    ints: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    ts = None
    for f in COLUMNS:
        v = d.get(f)
        if v is None:
            continue
        if checked is not None and f in checked:
            a, mask = checked[f], None
        else:
            a, mask = _column(v, f, n, at, typed)
        if f == "ts":
            ts = a
        elif f in _INT_COLS:
            ints[f] = (a, mask)
        else:
            floats[f] = a
    assert ts is not None
    late = ts > now + FUTURE_SLACK_S
    if (checked is None or "ts" not in checked) and late.any():
        j = int(late.argmax())
        raise BatchError(400, f"{at}.ts[{j}]: is more than {FUTURE_SLACK_S:.0f} s in the future (collector time "
                              f"{now:.3f}) (got {ts[j].item()!r})", "future")
    lists: dict[str, tuple] = {}
    for f, check in (("xid_errors", _xids), ("processes", _processes)):
        v = d.get(f)
        if v is None:
            continue
        if type(v) is not list or len(v) != n:
            raise BatchError(400, f"{at}.{f}: must be a list of {n} per-sample lists (got {_excerpt(v)})")
        if typed:
            rows = tuple(v) if f == "processes" else row_list(f, v)
            if f == "processes" and (bad := _first_out_of_bounds(rows)) is not None:
                raise BatchError(400, f"{at}.{f}[{bad}]: {_CHECKS[f][1]} (got {[p.to_wire() for p in rows[bad]]!r})")
        else:
            rows = tuple(map(check, v))
            if _BAD in rows:
                j = rows.index(_BAD)
                raise BatchError(400, f"{at}.{f}[{j}]: {_CHECKS[f][1]} (got {v[j]!r})")
        lists[f] = rows
    job_ids, shares = tuple(d.get("job_ids") or ()), tuple(d.get("job_shares") or ())
    if len(set(job_ids)) != len(job_ids):
        raise BatchError(400, f"{at}.job_ids: {_CHECKS['job_ids'][1]} (got {list(job_ids)!r})")
    if shares:
        if len(shares) != len(job_ids):
            raise BatchError(400, f"{at}.job_shares: must have one share per job id ({len(job_ids)}) or be empty "
                                  f"(got {list(shares)!r})")
        if abs(math.fsum(shares) - 1.0) > SHARES_SUM_TOLERANCE:
            raise BatchError(400, f"{at}.job_shares: must sum to 1 (got {list(shares)!r})")
    return Series(host, d["gpu_uuid"], d["gpu_index"], ts, model=d.get("model") or "", mig=d.get("mig"),
                  source=d.get("source") or "", job_ids=job_ids, job_shares=tuple(map(float, shares)),
                  floats=floats, ints=ints, lists=lists)


def _excerpt(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _column_ok(a: np.ndarray, f: str) -> np.ndarray:
    """Which values of a binary column of field ``f`` are valid (within its bounds; a time also positive)."""
    lo, hi = _COLUMN_BOUNDS[f]
    ok = (a >= lo) & (a <= hi)  # NaN fails both
    if f == "ts":
        ok &= a > 0
    return ok


def _binary_columns(series: list[Any], now: float) -> list[dict[str, np.ndarray]] | None:
    """The complete binary columns (bytes of n 8-byte values) of a typed batch's series, checked a field at a
    time over the whole batch: one numpy pass a field instead of one a series and field (an agent's batch has
    8 GPUs of 10 rows, where numpy's per-call cost is the work). Per series, {field: array}; None where a value
    fails :func:`_column_ok` or a time is in the future (:func:`_parse_series` then finds and words it)."""
    sizes = [len(x.ts) // 8 if type(x.ts) is bytes else len(x.ts) for x in series]
    out: list[dict[str, np.ndarray]] = [{} for _ in series]
    for f in COLUMNS:
        parts = [(j, v) for j, x in enumerate(series) if type(v := getattr(x, f)) is bytes and len(v) == 8 * sizes[j]]
        if not parts:
            continue
        a = np.frombuffer(b"".join(v for _, v in parts), dtype="<i8" if f in _INT_COLS else "<f8")
        if not _column_ok(a, f).all() or (f == "ts" and a.size and a.max() > now + FUTURE_SLACK_S):
            return None
        at = 0
        for j, v in parts:
            out[j][f] = a[at:at + len(v) // 8]
            at += len(v) // 8
    return out


def _doubtful_job_set(job_ids: Sequence[str], shares: Sequence[float]) -> bool:
    """Whether a fast path leaves a job set to the per-sample path, which words the error: job ids repeated, or
    shares given that are not one a job id or do not sum to 1."""
    if len(job_ids) > 1 and len(set(job_ids)) != len(job_ids):
        return True
    return bool(shares) and (len(shares) != len(job_ids) or abs(math.fsum(shares) - 1.0) > SHARES_SUM_TOLERANCE)


_WIRE_COLUMNS = COLUMNS[1:]  # every numeric column but ts, in wire order
_WIRE_GET = operator.attrgetter(*_WIRE_COLUMNS)


_NONES = (None,) * len(_WIRE_COLUMNS)


@functools.lru_cache(maxsize=256)
def _wire_present(present: tuple[bool, ...]) -> tuple[tuple[str, ...], Callable[[Sequence[Any]], tuple]]:
    """For a series whose columns but ts are present or not as ``present`` says: their names, and what picks
    their values out of all columns (as a tuple, even for one)."""
    idx = [i for i, p in enumerate(present) if p]
    get = operator.itemgetter(*idx) if len(idx) > 1 else (lambda cols: tuple(cols[i] for i in idx))
    return tuple(_WIRE_COLUMNS[i] for i in idx), get


@functools.lru_cache(maxsize=256)
def _wire_bounds(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For series carrying the columns ``names`` (in wire order): the float columns' positions and bounds, and the
    int columns' positions."""
    fl = [i for i, f in enumerate(names) if f not in _INT_COLS]
    it = [i for i, f in enumerate(names) if f in _INT_COLS]
    lo = np.array([_COLUMN_BOUNDS[names[i]][0] for i in fl], dtype=np.float64)
    hi = np.array([_COLUMN_BOUNDS[names[i]][1] for i in fl], dtype=np.float64)
    return np.array(fl, dtype=np.intp), lo, hi, np.array(it, dtype=np.intp)


def _wire_series(series: list[Any], host: str, now: float) -> tuple[Series, ...] | None:
    """A typed batch's series over the body's own bytes, when every column of every series is complete binary
    (what the agent sends in msgpack). The bounds of :func:`_column_ok` are checked a group of series with the
    same columns and rows at a time (an agent's GPUs report the same fields), by each column's least and
    greatest value (a NaN is both, and fails), no array made per column. None where the per-series path must
    decide (a list column, a length that does not match, a value out of bounds, a time in the future, a job set
    or row list it words an error for)."""
    groups: dict[tuple[tuple[str, ...], int], list[bytes]] = {}
    made = []
    times = []
    for d in series:
        cols = _WIRE_GET(d)
        ts = d.ts
        if type(ts) is not bytes or not ts or len(ts) % 8:
            return None
        names, pick = _wire_present(tuple(map(is_not, cols, _NONES)))
        wire = {}
        if names:
            values = pick(cols)
            try:
                # a list column fails the join; a short or long one the set of lengths
                groups.setdefault((names, len(ts)), []).append(b"".join(values))
            except TypeError:
                return None
            if set(map(len, values)) != {len(ts)}:
                return None
            wire = dict(zip(names, values))
        times.append(ts)
        made.append((d, ts, wire))
    if not made:
        return ()
    t = np.frombuffer(b"".join(times), dtype="<f8")
    if not (t.min() > 0 and t.max() <= min(MAX_FLOAT, now + FUTURE_SLACK_S)):  # NaN fails both
        return None
    for (names, size), blobs in groups.items():
        fl, lo, hi, it = _wire_bounds(names)
        raw = b"".join(blobs)
        shape = (len(blobs), len(names), size // 8)
        if fl.size:  # a column a row (one copy: numpy's reductions over two axes at once cost several times that)
            a = np.frombuffer(raw, dtype="<f8").reshape(shape).transpose(1, 0, 2).reshape(len(names), -1)
            if not ((a.min(axis=1)[fl] >= lo).all() and (a.max(axis=1)[fl] <= hi).all()):
                return None
        if it.size and np.frombuffer(raw, dtype="<i8").reshape(shape)[:, it].min() < 0:
            return None
    out = []
    of_wire = Series.of_wire
    for d, ts, wire in made:
        job_ids, shares = d.job_ids, d.job_shares
        if _doubtful_job_set(job_ids, shares):
            return None
        lists: dict[str, tuple] = {}
        if d.xid_errors is not None or d.processes is not None:
            n = len(ts) // 8
            for f in ROW_LISTS:
                v = getattr(d, f)
                if v is None:
                    continue
                if len(v) != n:
                    return None
                if f == "processes":
                    if _first_out_of_bounds(v) is not None:
                        return None  # the per-sample path words it
                    lists[f] = tuple(v)
                else:
                    lists[f] = row_list(f, v)
        out.append(of_wire(host, d.gpu_uuid, d.gpu_index, np.frombuffer(ts, dtype="<f8"), d.model, d.mig, d.source,
                           job_ids, tuple(map(float, shares)) if shares else (), lists, wire))
    return tuple(out)


def _column(v: Any, f: str, n: int, at: str, typed: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A column (bytes or list) -> (array, present mask or None); floats carry NaN where absent."""
    is_int = f in _INT_COLS
    if type(v) is bytes:
        if len(v) != 8 * n:
            raise BatchError(400, f"{at}.{f}: {len(v)} bytes, expected {8 * n} ({n} values of 8 bytes, as ts has)")
        a = np.frombuffer(v, dtype="<i8" if is_int else "<f8")
        ok = _column_ok(a, f)
        if not ok.all():
            j = int(ok.argmin())
            raise BatchError(400, f"{at}.{f}[{j}]: {_CHECKS[f][1]} (got {a[j].item()!r})")
        return a, None
    if type(v) is not list:
        kind = "integers" if is_int else "numbers"
        raise BatchError(400, f"{at}.{f}: must be a list of {n} {kind} or null, or bytes of {n} 8-byte values "
                              f"(got {_excerpt(v)})")
    if len(v) != n:
        raise BatchError(400, f"{at}.{f}: has {len(v)} values, expected {n} (as ts has)")
    if not typed:
        check, what = _CHECKS[f]
        for j, x in enumerate(v):
            r = check(x)
            if r is _BAD:
                raise BatchError(400, f"{at}.{f}[{j}]: {what} (got {x!r})")
            if r is not x:
                v[j] = r
    absent = v.count(None)
    if is_int:
        if absent:
            mask = np.fromiter((x is not None for x in v), dtype=bool, count=n)
            return np.array([0 if x is None else x for x in v], dtype=np.int64), mask
        return np.array(v, dtype=np.int64), None
    return np.array(v, dtype=np.float64), None  # None -> NaN: absent


# -- the fast path (typed decoding with msgspec) ---------------------------------------------------
# msgspec decodes a batch straight into structs and checks types, ranges and lengths in C while it reads
# (bool is no number, NaN fails every bound, unknown fields fail, a list longer than its limit fails at its
# header); what is left (the batch's host, future times, job id sets and shares, totals over the batch) is
# checked a column or a distinct job set at a time. It only ever accepts: a batch it doubts goes to the
# per-sample path, which is authoritative and words the error. A batch the typed decode refuses is refused
# (worded by the per-sample path when small enough to decode untyped cheaply). The rules mirror _CHECKS;
# tests/collector/test_validate.py checks that both paths decide every batch alike.
@dataclass(frozen=True, slots=True)
class _Decoders:
    msgpack: Any
    json: Any
    # the same with each row list (processes, Xid errors) and each job record's hosts left as its raw bytes, decoded
    # once the batch's totals are known to be within max_batch_list (_row_lists); a body too short to exceed them
    # takes the decoders above
    guarded_msgpack: Any
    guarded_json: Any
    row_list_msgpack: dict[str, Any]
    row_list_json: dict[str, Any]
    job_hosts_msgpack: Any
    job_hosts_json: Any
    peek_msgpack: Any
    peek_json: Any


@functools.lru_cache(maxsize=8)
def _decoders(limits: Limits) -> _Decoders | None:
    if not _FIELDS <= _HANDLED:
        return None  # a field this path has no rule for: everything goes the per-sample way

    def num(t: type, **bounds: Any) -> Any:
        return Annotated[t, msgspec.Meta(**bounds)]

    # msgspec's types are built at run time from these bounds; Any-typed names keep a static checker out
    tuple_of: Any = tuple
    list_of: Any = list

    def seq(t: Any, n: int) -> Any:
        return Annotated[tuple_of[t, ...], msgspec.Meta(max_length=n)]

    lim = limits
    name = num(str, min_length=1, max_length=lim.max_str)
    text = num(str, max_length=lim.max_str)
    count = num(int, ge=0, le=MAX_INT)
    types: dict[str, Any] = {
        "ts": num(float, gt=0.0, le=MAX_FLOAT), "host": name, "gpu_uuid": name, "model": text, "source": text,
        "gpu_index": count, "mig": name | None,
        "xid_errors": seq(num(int, ge=-MAX_INT - 1, le=MAX_INT), lim.max_list),
        "job_ids": seq(name, lim.max_job_ids), "job_shares": seq(num(float, ge=0.0, le=MAX_FLOAT), lim.max_job_ids),
        # msgspec builds the records from [pid, bytes|null] or [pid, bytes|null, ratio|null]; their bounds after
        "processes": seq(GpuProcess, lim.max_list),
        # every other numeric field: optional, within the bounds the column checks use too
        **{k: num(int if k in _INTS else float, ge=lo, le=hi) | None
           for k, (lo, hi) in _COLUMN_BOUNDS.items() if k != "ts"},
    }

    def column(t: Any) -> Any:  # a list (typed, null = absent) or bytes of 8-byte values
        return (Annotated[list_of[t], msgspec.Meta(max_length=lim.max_samples)]
                | Annotated[bytes, msgspec.Meta(max_length=8 * lim.max_samples)])

    def rows(t: Any) -> Any:
        return Annotated[list_of[t], msgspec.Meta(max_length=lim.max_samples)]

    # job records: JobRecord's fields, typed and bounded (omit_defaults: to_builtins gives what was sent)
    job_types = {"str": text, "str | None": text | None, "int | None": int | None, "float | None": float | None,
                 "tuple[str, ...]": seq(text, lim.max_list), "tuple[int, ...]": seq(int, lim.max_list),
                 "tuple[tuple[str, float], ...]": seq(tuple_of[text, float], lim.max_list),
                 "tuple[tuple[float, float, tuple[str, ...]], ...]":
                     seq(tuple_of[float, float, seq(name, lim.max_list)], lim.max_list)}
    job_hosts = seq(text, lim.max_job_hosts)

    def job_struct(hosts: Any) -> Any:
        return msgspec.defstruct("WireJob", [(f.name, job_types[str(f.type)]) if f.name == "job_id" else
                                             (f.name, hosts if f.name == "hosts" else job_types[str(f.type)], f.default)
                                             for f in fields(JobRecord)],
                                 forbid_unknown_fields=True, omit_defaults=True)

    def batch(types: dict[str, Any], job: Any) -> Any:
        # SAMPLE_FIELDS order, so astuple() feeds GpuSample(*...); gc=False: rows hold only strings, numbers
        # and tuples of them (no cycles), and skipping GC tracking makes them cheaper
        spec = [(f.name, types[f.name]) if f.name in _REQUIRED else (f.name, types[f.name], f.default)
                for f in fields(GpuSample)]
        row = msgspec.defstruct("WireSample", spec, forbid_unknown_fields=True, gc=False)
        # a series: the constants typed as above; columns (ts has no nulls); per-row lists of the row fields' types
        series_spec: list[tuple] = [("gpu_uuid", name), ("gpu_index", count), ("ts", column(types["ts"]))]
        series_spec += [(k, types[k], GpuSample.__dataclass_fields__[k].default)
                        for k in SERIES_CONSTANTS if k not in ("gpu_uuid", "gpu_index")]
        series_spec += [(k, column(types[k]) | None, None) for k in COLUMNS if k != "ts"]
        series_spec += [(k, rows(types[k]) | None, None) for k in ROW_LISTS]
        series = msgspec.defstruct("WireSeries", series_spec, forbid_unknown_fields=True)
        return msgspec.defstruct("WireBatch", [
            ("agent_id", name), ("seq", count), ("host", name),
            # UNSET, not None: an explicit null is the slow path's error
            ("samples", Annotated[list_of[row], msgspec.Meta(max_length=lim.max_samples)] | msgspec.UnsetType,
             msgspec.UNSET),
            ("series", Annotated[list_of[series], msgspec.Meta(max_length=lim.max_series)] | msgspec.UnsetType,
             msgspec.UNSET),
            ("jobs", Annotated[list_of[job], msgspec.Meta(max_length=lim.max_jobs)], []),
            ("cluster", num(str, max_length=MAX_CLUSTER_CHARS), "")], forbid_unknown_fields=True)

    wire = batch(types, job_struct(job_hosts))
    guarded = batch({**types, **{k: msgspec.Raw for k in ROW_LISTS}}, job_struct(msgspec.Raw))
    # the batch's name for an error message, read without building anything else (other fields are skipped)
    peek = msgspec.defstruct("WirePeek", [("agent_id", text | int | None, None), ("seq", int | text | None, None)])
    return _Decoders(msgspec.msgpack.Decoder(wire), msgspec.json.Decoder(wire), msgspec.msgpack.Decoder(guarded),
                     msgspec.json.Decoder(guarded), {k: msgspec.msgpack.Decoder(types[k]) for k in ROW_LISTS},
                     {k: msgspec.json.Decoder(types[k]) for k in ROW_LISTS}, msgspec.msgpack.Decoder(job_hosts),
                     msgspec.json.Decoder(job_hosts), msgspec.msgpack.Decoder(peek), msgspec.json.Decoder(peek))


_FAST = _decoders(DEFAULT_LIMITS)  # None: every batch takes the per-sample path (tests compare both paths)
_HOST, _TS, _JOBS = (operator.attrgetter(f) for f in ("host", "ts", "job_ids"))
_SHARES, _PROCS = operator.attrgetter("job_shares"), operator.attrgetter("processes")
_UUID, _MIG, _MODEL, _SOURCE = (operator.attrgetter(f) for f in ("gpu_uuid", "mig", "model", "source"))
_MSGSPEC_AT = re.compile(r"^(.*) - at `\$(.*)`$", re.S)
_JOB_AT = re.compile(r"^jobs\[(\d+)\]")  # where a typed decode's refusal lies: in job record N


def _typed_error(body: bytes, exc: Exception, dec: _Decoders, json_body: bool, within: str = "") -> BatchError:
    """A typed decode's refusal as a BatchError: 413 for a length limit, else 400; named like the per-sample
    path names fields (``series[0].job_ids``). ``within``: where the decoded value lies in the batch (a row list
    decoded on its own, ``samples[3].processes``)."""
    msg = str(exc)
    m = _MSGSPEC_AT.match(msg)
    at = within
    if m:
        msg, at = m[1], within + m[2]
    at = re.sub(r"^samples\[", "sample[", at.lstrip("."))
    try:
        p = (dec.peek_json if json_body else dec.peek_msgpack).decode(body)
        where = f"batch agent_id={p.agent_id!r} seq={p.seq!r}"
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        where = "batch"
    too_large = "length <=" in msg
    kind = "malformed JSON" if json_body else "malformed msgpack"
    text = f"{where}: {at}: {msg}" if at else f"{where}: {kind if isinstance(exc, msgspec.DecodeError) else ''} {msg}"
    record = _JOB_AT.match(at)  # a field of one job record (its list of records is bounded by the decode: not it)
    return BatchError(413 if too_large else 400, " ".join(text.split()), "too_large" if too_large else "invalid",
                      job=int(record[1]) if record else None)


def _refuse_typed(body: bytes, exc: Exception, dec: _Decoders, json_body: bool, now: float,
                  allowed_host: str | None, within: str = "", allowed_cluster: str | None = None) -> BatchError:
    """The refusal of a body the typed decode refused, worded by the per-sample path where it is small."""
    err = _typed_error(body, exc, dec, json_body, within)
    if len(body) <= _WORDING_MAX_BYTES and err.status != 413:
        _parse_doc(_decode(body, "application/json" if json_body else "application/msgpack"), now, allowed_host,
                   allowed_cluster)
    return err  # the per-sample path accepted what the typed decode refuses: the refusal stands


def _parse_fast(body: bytes, now: float, allowed_host: str | None, limits: Limits = DEFAULT_LIMITS,
                json_body: bool = False, allowed_cluster: str | None = None) -> Batch | None:
    """The batch, or None where the per-sample path must decide (and word any error); BatchError when the
    typed decode refuses the body (a limit, a type), worded by the per-sample path where it is small."""
    dec = _decoders(limits)
    if dec is None:
        return None
    # each process is at least 3 bytes, each Xid error 1: a shorter body cannot exceed max_batch_list
    guarded = len(body) > limits.max_batch_list
    try:
        if guarded:
            b = (dec.guarded_json if json_body else dec.guarded_msgpack).decode(body)
        else:
            b = (dec.json if json_body else dec.msgpack).decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _refuse_typed(body, exc, dec, json_body, now, allowed_host, allowed_cluster=allowed_cluster) from None
    host, rows = b.host, b.samples
    one = (rows is msgspec.UNSET) != (b.series is msgspec.UNSET)
    where = f"batch agent_id={b.agent_id!r} seq={b.seq!r}"
    names = (b.agent_id, host, b.cluster)
    cluster = b.cluster
    if one and not _BAD_NAME.search("".join(names)):
        # refused here, as the per-sample path would (its checks before these are the typed decode's): the body
        # is not decoded again
        if allowed_host is not None and host != allowed_host:
            raise BatchError(403, f"{where}: field 'host' is {host!r} but the token is bound to host "
                                  f"{allowed_host!r}", "forbidden", _batch_samples(b))
        if allowed_cluster is not None and cluster != allowed_cluster:  # (the samples counted for a refusal only)
            cluster = _bound_cluster(cluster, allowed_cluster, where, _batch_samples(b))
    if guarded:  # before the per-sample path could decode them all
        _row_lists(b, body, dec, json_body, now, allowed_host, where, limits, allowed_cluster)
    if not one or allowed_host is not None and host != allowed_host:
        return None
    _check_totals(b, where, limits)
    if b.series is not msgspec.UNSET:
        if _doubtful_strings(names, b.series):
            return None
        try:
            series = _wire_series(b.series, host, now)
            if series is None:  # list columns (or a doubt): series by series, as the per-sample path reads them
                checked = _binary_columns(b.series, now)
                series = tuple(_parse_series(msgspec.structs.asdict(d), i, where, host, now, typed=True,
                                             checked=None if checked is None else checked[i])
                               for i, d in enumerate(b.series))
            jobs = _job_records(msgspec.to_builtins(b.jobs), f"{where}: ", host, allowed_host is not None, cluster)
        except BatchError:
            return None  # the per-sample path words it (from the body as msgpack decodes it)
        return Batch(b.agent_id, b.seq, host, jobs=tuple(jobs), series=series, cluster=cluster)
    if (not rows
            or list(map(_HOST, rows)).count(host) != len(rows) or max(map(_TS, rows)) > now + FUTURE_SLACK_S
            or _doubtful_strings(names, rows)):
        return None
    # job ids and shares: checked once per distinct combination (a GPU's job rarely changes within a batch)
    for jobs, shares in set(zip(map(_JOBS, rows), map(_SHARES, rows))):
        if _doubtful_job_set(jobs, shares):
            return None
    if any(map(_PROCS, rows)) and _first_out_of_bounds(list(map(_PROCS, rows))) is not None:
        return None  # the per-sample path words it
    try:
        jobs = _job_records(msgspec.to_builtins(b.jobs), f"{where}: ", host, allowed_host is not None, cluster)
    except BatchError:
        return None
    return Batch(b.agent_id, b.seq, host, rows=rows, jobs=tuple(jobs), cluster=cluster)


def _doubtful_strings(names: Sequence[str], items: Sequence[Any]) -> bool:
    """Whether a typed batch holds a character its strings may not (its envelope's ``names``, then the samples' or
    series' names and free text): the per-sample path then finds and words it. Each distinct value once."""
    ids = [*names, *set(map(_UUID, items)), *filter(None, set(map(_MIG, items)))]
    ids += [j for js in set(map(_JOBS, items)) for j in js]
    texts = {*map(_MODEL, items), *map(_SOURCE, items)}
    return bool(_BAD_NAME.search("".join(ids)) or _BAD_TEXT.search("".join(texts)))


def _batch_samples(b: Any) -> int:
    """How many samples a typed batch holds (for the rejection metrics)."""
    if b.series is not msgspec.UNSET:
        return sum(len(s.ts) // 8 if type(s.ts) is bytes else len(s.ts) for s in b.series)
    return len(b.samples) if b.samples is not msgspec.UNSET else 0


def _row_lists(b: Any, body: bytes, dec: _Decoders, json_body: bool, now: float, allowed_host: str | None,
               where: str, limits: Limits, allowed_cluster: str | None = None) -> None:
    """A guarded decode's row lists and job records' hosts (raw bytes): each kind counted over the whole batch from
    their headers, refused (413) past ``max_batch_list``, then decoded in place, as the unguarded decode has them."""
    found: dict[str, list[tuple[Any, int | None, Any, str]]] = {k: [] for k in ROW_LISTS}  # owner, row, raw, where
    for i, r in enumerate(b.samples or ()):
        for k in ROW_LISTS:
            v = getattr(r, k)
            if type(v) is msgspec.Raw:
                found[k].append((r, None, v, f"samples[{i}].{k}"))
    for i, d in enumerate(b.series or ()):
        for k in ROW_LISTS:
            for j, v in enumerate(getattr(d, k) or ()):
                found[k].append((d, j, v, f"series[{i}].{k}[{j}]"))
    hosts = [(r, r.hosts, f"jobs[{i}].hosts") for i, r in enumerate(b.jobs) if type(r.hosts) is msgspec.Raw]
    items = _json_items if json_body else _msgpack_items
    for k, what in (("processes", "processes"), ("xid_errors", "Xid errors"), ("hosts", "job hosts")):
        have = (sum(items(raw, False) for _, raw, _ in hosts) if k == "hosts"
                else sum(items(raw, k == "processes") for _, _, raw, _ in found[k]))
        if have > limits.max_batch_list:
            raise BatchError(413, f"{where}: {have} {what} in one batch, more than the limit of "
                                  f"{limits.max_batch_list}", "too_large", _batch_samples(b))
    for k in ROW_LISTS:
        decode = (dec.row_list_json if json_body else dec.row_list_msgpack)[k].decode
        for owner, row, raw, at in found[k]:
            try:
                v = decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                raise _refuse_typed(body, exc, dec, json_body, now, allowed_host, at, allowed_cluster) from None
            if row is None:
                setattr(owner, k, v)
            else:
                getattr(owner, k)[row] = v
    decode = (dec.job_hosts_json if json_body else dec.job_hosts_msgpack).decode
    for record, raw, at in hosts:
        try:
            record.hosts = decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise _refuse_typed(body, exc, dec, json_body, now, allowed_host, at, allowed_cluster) from None


def _msgpack_items(raw: Any, pairs: bool) -> int:
    """How many elements a msgpack array says it has (0 for anything else: its decode then fails)."""
    head = memoryview(raw)[:5]
    if not head:
        return 0
    t = head[0]
    if 0x90 <= t <= 0x9F:
        return t & 0x0F
    if t in (0xDC, 0xDD):
        return int.from_bytes(head[1:3 if t == 0xDC else 5], "big")
    return 0


def _json_items(raw: Any, pairs: bool) -> int:
    """How many elements a JSON array holds, at most (exact for a valid one): of pairs (processes) by their
    brackets, else by the commas."""
    text = bytes(raw)
    if pairs:
        return max(text.count(b"[") - 1, 0)
    return text.count(b",") + 1 if text.strip(b" \t\r\n[]") else 0


def _check_totals(b: Any, where: str, limits: Limits) -> None:
    """Limits over the whole batch (each list was bounded while decoding): samples, GPUs, distinct job ids."""
    if b.series is not msgspec.UNSET:
        n = sum(len(s.ts) // 8 if type(s.ts) is bytes else len(s.ts) for s in b.series)
        gpus = {(s.gpu_uuid, s.mig) for s in b.series}
        job_ids = {j for s in b.series for j in s.job_ids}
    else:
        n = len(b.samples)
        gpus = {(r.gpu_uuid, r.mig) for r in b.samples}
        job_ids = {j for ids in set(map(_JOBS, b.samples)) for j in ids}
    for what, have, limit in (("samples", n, limits.max_samples), ("GPUs and MIG instances", len(gpus),
                                                                    limits.max_series),
                              ("distinct job ids", len(job_ids), limits.max_batch_job_ids)):
        if have > limit:
            raise BatchError(413, f"{where}: {have} {what} in one batch, more than the limit of {limit}",
                             "too_large", n)


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
    # arrays: lists as JSON and msgpack decode them, tuples as the typed decode's to_builtins leaves them
    if annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        inner = annotation[len("tuple["): -len(", ...]")]
        return isinstance(v, (list, tuple)) and all(_check_annotation(inner, x) for x in v)
    if annotation == "tuple[float, float, tuple[str, ...]]":  # a JobRecord's earlier run: start, end, hosts
        return (isinstance(v, (list, tuple)) and len(v) == 3 and _check_annotation("float", v[0])
                and _check_annotation("float", v[1]) and _check_annotation("tuple[str, ...]", v[2]))
    if annotation == "tuple[str, float]":
        return (isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], str)
                and _check_annotation("float", v[1]))
    raise TypeError(f"validator does not know the annotation {annotation!r}")  # a new record shape: teach it


_JOB_FIELDS = {f.name: str(f.type) for f in fields(JobRecord)}
_JOB_TEXT = frozenset({"state", "gpu_model"})  # free text; the record's other strings are names


def parse_jobs(body: bytes, content_type: str, max_bytes: int = MAX_BODY_BYTES,
               content_encoding: str = "") -> list[JobRecord]:
    """Decode and validate a list of JobRecord dicts; BatchError names the record index and field."""
    doc = decode_body(body, content_type, content_encoding, max_bytes)
    if not isinstance(doc, list):
        raise BatchError(400, f"jobs body must be a list of job records, got {type(doc).__name__}")
    return _job_records(doc, "")


def _job_records(doc: Any, where: str, host: str | None = None, bound: bool = False,
                 cluster: str = "") -> list[JobRecord]:
    """Validate JobRecord dicts; with ``host`` (an agent's batch) each record must be about a job on that host
    (its ``hosts`` list it; a record with no hosts is left out) in the batch's cluster (when both name one).
    Whether samples of the job came from
    the host is the store's check (``ledger_store.SqlLedger.add_agent_jobs``). A refusal of one record names it
    (``BatchError.job``: an agent sends the batch again without it)."""
    if not isinstance(doc, list):
        raise BatchError(400, f"{where}field 'jobs' must be a list of job records")
    out = []
    for i, d in enumerate(doc):
        try:
            rec = _job_record(d, f"{where}job[{i}]", host, bound, cluster)
        except BatchError as e:
            e.job = i
            raise
        if rec is not None:
            out.append(rec)
    return out


def _job_record(d: Any, at: str, host: str | None, bound: bool, cluster: str) -> JobRecord | None:
    """One record of :func:`_job_records` (``at``: where it lies), None when it is left out."""
    if not isinstance(d, dict):
        raise BatchError(400, f"{at}: must be an object")
    for k, v in d.items():
        if k not in _JOB_FIELDS:
            raise BatchError(400, f"{at}: unknown field {str(k)!r}")
        if not _check_annotation(_JOB_FIELDS[k], v) or (k == "job_id" and not v):
            raise BatchError(400, f"{at}.{k}: expected {_JOB_FIELDS[k]} (got {v!r})")
        text = k in _JOB_TEXT
        if any(map((_BAD_TEXT if text else _BAD_NAME).search, _strings(v))):
            raise BatchError(400, f"{at}.{k}: expected {_JOB_FIELDS[k]} {_TEXT_CHARS if text else _NAME_CHARS} "
                                  f"(got {v!r})")
    if "job_id" not in d:
        raise BatchError(400, f"{at}.job_id: missing")
    rec = JobRecord.from_dict(d)
    if host is not None:
        # A node may describe only jobs it runs (under a host-bound token: 403, as for samples).
        status, reason = (403, "forbidden") if bound else (400, "invalid")
        if not rec.hosts:
            # refused, but not the batch with it: agents before 0.x sent no hosts; their samples still count
            return None
        if host not in rec.hosts:
            raise BatchError(status, f"{at}.hosts: {list(rec.hosts)!r} does not include the batch's host "
                                     f"{host!r}", reason)
        if rec.cluster and cluster and rec.cluster != cluster:
            raise BatchError(status, f"{at}.cluster: {rec.cluster!r} is not the batch's cluster {cluster!r}",
                             reason)
    return rec
