"""Push sample batches to the collector over HTTP (a sink for :class:`agent.sampler.Agent`).

Each batch carries ``(agent_id, seq)`` so the collector can drop a batch it has already seen (a retry).
Sequence numbers never come from the wall clock (a clock stepped back would reuse them): with a spool
directory they persist there (``agent.spool.SeqFile``); without one a pusher starts at a random 62-bit
number, so a restarted agent does not meet its old numbers. Numbers may have gaps (a failed batch burns its
number unless it is re-sent with :meth:`HttpPusher.send`).

``--collector`` is the collector's base URL (``http://host:8470``, or ``host:8470``: http is assumed); the
samples path is the agent's business. Several URLs fail over in order.

A batch counts as delivered only on the collector's acknowledgement: a JSON object with its counts
(:class:`Ack`), in a 2xx, or in a 422 ``too_late`` that stored some (the rest were behind their GPU's window). A 2xx
with any other body (a proxy's page) says nothing about the batch: a retryable :class:`PushError`.

Batches fit the collector's limits (:class:`BatchLimits`, ``schema.limits``): the sinks split what they are handed
into batches of whole ticks within them (:func:`split_ticks`), halve a batch whose body is over the size limit, and
halve one the collector refuses as ``too_large`` (413), rather than drop it (:func:`halve`). No cut ever parts the rows
of one GPU's instant (:func:`instants`).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from email.utils import parsedate_to_datetime
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgpack
import zstandard

from gpuledger.schema import limits as collector_limits
from gpuledger.schema.records import GpuSample, JobRecord
from gpuledger.schema.text import ascii_int
from gpuledger.schema.wire import from_series, series_key, to_series

log = logging.getLogger(__name__)

_BODY_EXCERPT = 500  # characters of an error response kept in the exception
CONTENT_TYPES = {"json": "application/json", "msgpack": "application/msgpack"}
SAMPLES_PATH = "/api/v1/samples"
# Answers after which another collector (or a later attempt) may take the batch: no answer, the server's
# trouble, overload, or a configuration problem of that collector or a proxy before it (a redirect, a wrong
# token, path, method or media type). Only the collector's own verdict on the batch (400, 409, 413, 422) is final.
FAILOVER_STATUSES = (frozenset(range(300, 400)) | frozenset({401, 403, 404, 405, 407, 408, 415, 421, 425, 429})
                     | frozenset(range(500, 600)))
CLOCK_SKEW_REASONS = frozenset({"future"})  # a 400 with this reason: this node's clock, not the batch
MAX_NAMED_RECORDS = 8  # job records of one batch left out one at a time, as refused; then all the rest at once
MAX_HUNG_REQUESTS = 2  # requests past their deadline still waiting on a stalled answer; more are not started
_MAX_LOGGED = 1024  # GPUs whose trimmed samples were said (bounded: GPUs come and go)


def samples_url(collector: str) -> str:
    """The samples endpoint of a collector given by its base URL; ValueError (one line) for what is no URL.

    ``host:port`` means ``http://host:port``; a path is a prefix (a collector behind a proxy), and a URL
    that already ends in the samples path is taken as it is."""
    raw = collector.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"collector URL {collector!r}: scheme must be http or https")
    try:
        parts.port  # noqa: B018 - reading it checks it
    except ValueError:
        raise ValueError(f"collector URL {collector!r}: the port is not a number in 0..65535") from None
    if not parts.hostname:
        raise ValueError(f"collector URL {collector!r} has no host name")
    if parts.query or parts.fragment:
        raise ValueError(f"collector URL {collector!r}: no query or fragment (give the base URL)")
    path = parts.path.rstrip("/")
    if not path.endswith(SAMPLES_PATH):
        path += SAMPLES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _floats(s: GpuSample) -> list[Any]:
    return [getattr(s, f) for f in s.__slots__ if isinstance(getattr(s, f), float)] + list(s.job_shares)


def _verify(verify: str | bool) -> ssl.SSLContext | bool:
    # httpx deprecates verify=<path>; a context built from the CA file says the same thing.
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


class PushError(RuntimeError):
    """A batch did not reach the collector: ``status`` is the HTTP status (None when no response came),
    ``reason`` the collector's machine-readable reason (``future``, ``invalid``, ...) when it gave one;
    ``not_ack``: a 2xx whose body is no collector's acknowledgement (something else answered: retryable);
    ``job``: the index of the job record the collector named as the cause (None: it named none)."""

    def __init__(self, message: str, status: int | None = None, body: str = "", cause: str = "",
                 reason: str = "", retry_after_s: float | None = None, not_ack: bool = False,
                 job: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.cause = cause
        self.reason = reason
        self.retry_after_s = retry_after_s  # the answer's Retry-After, in seconds from now (None: not given)
        self.not_ack = not_ack
        self.job = job

    @property
    def failover(self) -> bool:
        """Might another collector, or a later attempt, take the batch?"""
        return self.status is None or self.status in FAILOVER_STATUSES or self.not_ack

    @property
    def too_large(self) -> bool:
        """Refused for its size (413 too_large): the same samples in smaller batches are taken."""
        return self.status == 413 and self.reason == "too_large"

    @property
    def clock_skewed(self) -> bool:
        """Refused for times in the collector's future: this node's clock, not the batch (taken once they are not)."""
        return self.status == 400 and self.reason in CLOCK_SKEW_REASONS

    @property
    def about_content(self) -> bool:
        """Did a collector refuse the batch for what it holds: its verdict on the batch (a 4xx not in
        ``FAILOVER_STATUSES``, but clock skew and 409, which is about the batch's key: stored before with other
        content) or a 403 (under a host-bound token, what the batch says of another host or cluster; else a token's
        configuration)? The job records it carried may be the cause: they come from Slurm
        or, with ``trust_environ``, from the job's own environment, which its user writes (``SLURM_CLUSTER_NAME=x``),
        and one record a collector will not take refuses the whole batch: a 403 (a record of another cluster), 400 (a
        control character), 413 too_large (a field over a length limit: halving the batch would not help, the record
        rides with a half). The sinks then send the samples again without them
        (``HttpPusher.resend_without_jobs``)."""
        return (self.status is not None and 400 <= self.status < 500 and not self.not_ack and not self.clock_skewed
                and (self.status == 403 or self.status not in FAILOVER_STATUSES and self.status != 409))

    def describe(self) -> str:
        """Why the push failed, in a few words (for one log line)."""
        if self.status is None:
            return f"unreachable ({self.cause})"
        if self.not_ack:
            return (f"answered HTTP {self.status} with no collector's acknowledgement ({self.cause}; is the URL a "
                    "collector's?)")
        return f"answered HTTP {self.status}: {self.body.strip()[:200] or '(no body)'}"


@dataclass(frozen=True, slots=True)
class Ack:
    """A collector's acknowledgement of a batch (its IngestResult): stored but for ``too_late`` samples (behind
    their GPU's window: lost) and ``duplicate_samples`` (stored before); ``duplicate``: the batch was seen before."""

    accepted: int
    duplicate: bool
    duplicate_samples: int
    too_late: int


def read_ack(response: httpx.Response) -> Ack | None:
    """The acknowledgement an answer's body holds; None when it holds none (not JSON, not the collector's object)."""
    try:
        d = response.json()
    except ValueError:  # not JSON, not UTF-8
        return None
    if not isinstance(d, dict) or type(d.get("duplicate")) is not bool:
        return None
    counts = [d.get(k) for k in ("accepted", "duplicate_samples", "too_late")]
    if not all(type(v) is int and v >= 0 for v in counts):
        return None
    return Ack(int(d["accepted"]), d["duplicate"], int(d["duplicate_samples"]), int(d["too_late"]))


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one batch the agent sends may hold: the collector's limits (``schema.limits``) unless told lower ones
    (a collector configured below its defaults). ``body_bytes`` bounds the encoded body before compression."""

    samples: int = collector_limits.MAX_SAMPLES
    series: int = collector_limits.MAX_SERIES
    job_ids: int = collector_limits.MAX_BATCH_JOB_IDS
    row_lists: int = collector_limits.MAX_BATCH_LIST  # processes, Xid errors, job records' hosts: each over the batch
    jobs: int = collector_limits.MAX_JOBS
    body_bytes: int = collector_limits.MAX_BODY_BYTES
    row_list: int = collector_limits.MAX_ROW_LIST  # processes, and Xid errors, of one sample
    job_hosts: int = collector_limits.MAX_JOB_HOSTS  # hosts of one job record
    gpu_jobs: int = collector_limits.MAX_SAMPLE_JOB_IDS  # job ids of one sample (the jobs sharing its GPU)

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"batch limit {f.name} must be positive, got {getattr(self, f.name)!r}")


class _Tally:
    """What the collector counts of a batch against its limits (``collector.validate._check_totals``)."""

    __slots__ = ("job_ids", "processes", "samples", "series", "xids")

    def __init__(self, samples: Sequence[GpuSample] = ()) -> None:
        self.samples = len(samples)
        self.series = {series_key(s) for s in samples}
        self.job_ids = {j for s in samples for j in s.job_ids}
        self.processes = sum(len(s.processes) for s in samples)
        self.xids = sum(len(s.xid_errors) for s in samples)

    def fits_with(self, other: _Tally, lim: BatchLimits) -> bool:
        return (self.samples + other.samples <= lim.samples and len(self.series | other.series) <= lim.series
                and len(self.job_ids | other.job_ids) <= lim.job_ids
                and self.processes + other.processes <= lim.row_lists and self.xids + other.xids <= lim.row_lists)

    def add(self, other: _Tally) -> None:
        self.samples += other.samples
        self.series |= other.series
        self.job_ids |= other.job_ids
        self.processes += other.processes
        self.xids += other.xids


def fit_rows(s: GpuSample, row_list: int) -> GpuSample:
    """``s`` with at most ``row_list`` processes (those using the most memory; the collector stores them as they are,
    attribution is done) and Xid errors (the first): over them, the collector would refuse the whole GPU's instant,
    its power and energy with it, so 257 processes on a GPU would make its job's use go unmeasured."""
    if len(s.processes) <= row_list and len(s.xid_errors) <= row_list:
        return s
    kept = sorted(range(len(s.processes)), key=lambda i: (-(s.processes[i].used_memory_bytes or 0), i))[:row_list]
    return replace(s, processes=tuple(s.processes[i] for i in sorted(kept)), xid_errors=s.xid_errors[:row_list])


def instants(samples: Sequence[GpuSample]) -> list[list[GpuSample]]:
    """The rows of each (host, GPU, instant) together, in time order: what no batch split may part. A MIG GPU's
    whole-GPU row and instance rows are normalized per batch (``collector.aggregate.normalize_mig``): a batch with
    only its instance rows would take the largest instance's counter for the GPU's, and undercount its energy."""
    groups: dict[tuple[str, str, float], list[GpuSample]] = {}
    for s in sorted(samples, key=lambda s: s.ts):  # stable: a tick keeps its order
        groups.setdefault((s.host, s.gpu_uuid, s.ts), []).append(s)
    return list(groups.values())


def divisible(samples: Sequence[GpuSample]) -> bool:
    """Can the batch be halved (:func:`halve`): does it hold more than one GPU's instant?"""
    return len({(s.host, s.gpu_uuid, s.ts) for s in samples}) > 1


def split_ticks(ticks: Sequence[Sequence[GpuSample]], lim: BatchLimits) -> list[list[GpuSample]]:
    """Consecutive ticks' samples grouped into as few batches as ``lim``'s counts allow, each of whole ticks; a tick
    over them alone is split between its GPUs' instants (:func:`instants`). (The body's size is known only once
    encoded: see :func:`halve`.)"""
    out: list[list[GpuSample]] = []
    batch: list[GpuSample] = []
    tally = _Tally()
    for tick in ticks:
        t = _Tally(tick)
        if not tally.fits_with(t, lim):
            if batch:
                out.append(batch)
            batch, tally = [], _Tally()
        if tally.fits_with(t, lim):
            batch.extend(tick)
            tally.add(t)
            continue
        # over the limits alone: its GPUs' instants one by one (one over them alone goes alone, whole: the collector
        # refuses it, rather than a batch of part of a MIG GPU's rows undercounting its energy)
        for rows in instants(tick):
            one = _Tally(rows)
            if batch and not tally.fits_with(one, lim):
                out.append(batch)
                batch, tally = [], _Tally()
            batch.extend(rows)
            tally.add(one)
    if batch:
        out.append(batch)
    return out


def halve(samples: Sequence[GpuSample]) -> tuple[list[GpuSample], list[GpuSample]]:
    """A batch too large for the collector as two, the first before the second in time, so that each GPU's samples
    stay in order; the cut is at the change of time nearest the middle (between ticks), or between GPUs when every
    sample has one time, and never inside one GPU's instant (:func:`instants`). ValueError for a batch that is not
    :func:`divisible`."""
    groups = instants(samples)
    if len(groups) < 2:
        raise ValueError("one GPU's instant cannot be halved")
    rows = [s for g in groups for s in g]
    cuts: list[int] = []  # between groups, as row indices
    for g in groups[:-1]:
        cuts.append((cuts[-1] if cuts else 0) + len(g))
    between_times = [c for c in cuts if rows[c - 1].ts != rows[c].ts]
    mid = len(rows) // 2
    cut = min(between_times or cuts, key=lambda c: (abs(c - mid), c))  # the nearest the middle; a tie: the earlier
    return rows[:cut], rows[cut:]


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header (RFC 9110 10.2.3: delay-seconds or an HTTP-date) as seconds from now; None when
    absent or unreadable (then the agent's own backoff decides)."""
    if not value:
        return None
    value = value.strip()
    if (seconds := ascii_int(value)) is not None:
        return float(seconds)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT; a date without a zone is not one
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class EncodeError(ValueError):
    """A batch that cannot be encoded (NaN, a sample of another host): the collector would reject it."""


class BodyTooLarge(Exception):
    """A batch whose body (before compression) is over the size it must fit: to be sent as smaller batches."""


def encode_batch(agent_id: str, host: str, seq: int, samples: Sequence[GpuSample], jobs: Sequence[JobRecord] = (),
                 fmt: str = "json", compress: str | None = None, layout: str = "series", cluster: str = "",
                 max_bytes: int | None = None) -> bytes:
    """A batch's request body: ``fmt`` json or msgpack, ``compress`` None, gzip or zstd; ``layout`` series
    (columns per GPU, ``agent.wire``: what agents send; complete columns as raw bytes in msgpack) or samples
    (one object a sample). Raises EncodeError for what the collector would refuse, ValueError for bad options,
    BodyTooLarge when the body before compression (what the collector bounds) is over ``max_bytes``."""
    if layout not in ("series", "samples"):
        raise ValueError(f"unknown layout {layout!r} (series or samples)")
    if fmt not in CONTENT_TYPES:
        raise ValueError(f"unknown format {fmt!r} (json or msgpack)")
    if compress not in (None, "gzip", "zstd"):
        raise ValueError(f"unknown compression {compress!r} (gzip or zstd)")
    payload: dict[str, Any] = {"agent_id": agent_id, "seq": seq, "host": host}
    if cluster:  # optional on the wire: collectors before it was added refuse unknown fields, so only when set
        payload["cluster"] = cluster
    try:
        if layout == "series":
            payload["series"] = to_series(samples, host, binary=fmt == "msgpack")
        else:
            if any(isinstance(v, float) and not math.isfinite(v) for s in samples for v in _floats(s)):
                raise ValueError("NaN or infinite value")
            payload["samples"] = [s.to_wire() for s in samples]
        if jobs:  # job metadata rides along with the next batch (spooled with it, so never ahead of it)
            # a record describes the job this host runs: it lists the host (the collector refuses one without)
            payload["jobs"] = [(r if host in r.hosts else replace(r, hosts=(*r.hosts, host))).to_dict() for r in jobs]
        if fmt == "json":
            # NaN/inf are not JSON: fail here, naming the batch, rather than send what the collector rejects.
            body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode()
        else:
            body = msgpack.packb(payload, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise EncodeError(str(exc)) from exc
    if max_bytes is not None and len(body) > max_bytes:
        raise BodyTooLarge(f"batch {seq}: {len(body)} bytes, over {max_bytes}")
    if compress == "gzip":
        body = gzip.compress(body, compresslevel=5)
    elif compress == "zstd":
        body = zstandard.ZstdCompressor(level=3).compress(body)
    return body


def decode_batch(body: bytes, fmt: str, compress: str | None) -> tuple[dict[str, Any], list[GpuSample],
                                                                       list[JobRecord]]:
    """A body :func:`encode_batch` made (series layout): its header fields (agent_id, seq, host, cluster), samples
    and job records. ValueError for anything else."""
    try:
        if compress == "gzip":
            body = gzip.decompress(body)
        elif compress == "zstd":
            body = zstandard.ZstdDecompressor().decompress(body)
        payload = json.loads(body) if fmt == "json" else msgpack.unpackb(body, raw=False)
        samples = from_series(payload["series"], payload["host"])
        jobs = [JobRecord.from_dict(d) for d in payload.get("jobs", ())]
        return {k: payload[k] for k in ("agent_id", "seq", "host", "cluster") if k in payload}, samples, jobs
    except Exception as exc:  # noqa: BLE001 - whatever the decoders raise for what is not such a body
        raise ValueError(f"not a {fmt} batch body of the series layout: {type(exc).__name__}: {exc}") from exc


class HttpPusher:
    """POSTs batches ``{"agent_id", "seq", "host", "series": [...]}`` (``agent.wire``) to the collector's samples
    endpoint: JSON by default, msgpack (with raw binary columns) where :meth:`post` is told so."""

    def __init__(
        self,
        url: str | Sequence[str],
        agent_id: str,
        host: str,
        timeout: float = 10.0,
        deadline_s: float | None = None,
        seq_start: int | None = None,
        client: httpx.Client | None = None,
        token: str | None = None,
        headers: Mapping[str, str] | None = None,
        verify: str | bool = True,
        fmt: str = "json",
        cluster: str = "",
        limits: BatchLimits | None = None,
    ) -> None:
        if fmt not in CONTENT_TYPES:
            raise ValueError(f"pusher: fmt must be json or msgpack, got {fmt!r}")
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("pusher: at least one collector url is needed")
        if not agent_id:
            raise ValueError("pusher: agent_id must not be empty")
        self.urls = [samples_url(u) for u in urls]  # tried in order for each batch
        self.url = self.urls[0]
        self.fmt = fmt  # what write() sends: json, or msgpack with complete columns as raw bytes (the agent's)
        self.agent_id = agent_id
        self.host = host
        self.cluster = cluster  # the Slurm cluster this host is in, sent with every batch ("" = not named)
        self.limits = limits or BatchLimits()  # what one batch may hold (the sinks split to fit)
        self._jobs: dict[str, JobRecord] = {}  # job metadata waiting for the next batch
        self._jobs_lock = threading.Lock()
        self._headers: dict[str, str] = dict(headers or {})
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._own_client = client is None
        # One client for the agent's life: keep-alive spares a TCP (and TLS) handshake per batch.
        # verify: True (system CAs), a CA bundle path (a self-signed collector), or False (tests only).
        self._timeout = timeout
        self._verify = _verify(verify)
        self._client = client if client is not None else self._new_client()
        # httpx's timeout bounds each socket operation, not the request: an answer that trickles in a byte at a
        # time would hold the sender (and the agent's shutdown) for ever. Each attempt gets a whole deadline.
        self.deadline_s = 3.0 * timeout if deadline_s is None else deadline_s
        if not self.deadline_s > 0:
            raise ValueError(f"pusher: deadline_s must be positive, got {deadline_s!r}")
        self._hung: list[threading.Thread] = []  # attempts past their deadline, still waiting on an answer
        self._client_lock = threading.Lock()
        self._lock = threading.Lock()
        # not the clock: a random start (62 bits) that a restarted agent without state will not meet again
        self._next_seq = secrets.randbits(62) if seq_start is None else int(seq_start)
        self.batches_sent = 0
        self.samples_sent = 0  # samples in batches the collector acknowledged
        self.samples_refused = 0  # of those, samples it said it did not store (too late, duplicate)
        self.rows_trimmed = 0  # processes and Xid errors left out of samples over the per-sample limit (fit)
        self.job_records_refused = 0  # records a batch was taken without, once refused with them
        self.samples_unattributed = 0  # samples sent without their job ids: more jobs on the GPU than one may carry
        self._trim_logged: set[tuple[str, str, str]] = set()  # (what, GPU, MIG) said once

    def next_seq(self) -> int:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def write(self, samples: Sequence[GpuSample]) -> int:
        """Send one batch under a new sequence number; returns that number. Raises PushError."""
        seq = self.next_seq()
        self.send(seq, samples)
        return seq

    def fit(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        """The samples within the collector's per-sample limits, what was changed counted and said once per GPU:
        processes and Xid errors (:func:`fit_rows`, :attr:`rows_trimmed`); job ids: a GPU shared by more jobs than a
        sample may carry (``limits.gpu_jobs``) goes without them (:attr:`samples_unattributed`), its use measured
        and charged to no job. Over the limit the collector would refuse the GPU's instant, its power and energy with
        it, and every job on it would go unmeasured; keeping only some of the jobs would charge them the others'
        use."""
        out = []
        for s in samples:
            if len(s.job_ids) > self.limits.gpu_jobs:
                self.samples_unattributed += 1
                key = ("jobs", s.gpu_uuid, s.mig or "")
                if key not in self._trim_logged and len(self._trim_logged) < _MAX_LOGGED:
                    self._trim_logged.add(key)
                    log.warning("GPU %s%s: shared by %d jobs, more than the collector takes in one sample (%d): sent "
                                "without job ids, its use measured and charged to no job (said once per GPU; "
                                "gpuledger_agent_push_unattributed_samples_total counts such samples)", s.gpu_uuid,
                                f" MIG {s.mig}" if s.mig else "", len(s.job_ids), self.limits.gpu_jobs)
                s = replace(s, job_ids=(), job_shares=())
            fitted = fit_rows(s, self.limits.row_list)
            if fitted is not s:
                left = len(s.processes) - len(fitted.processes) + len(s.xid_errors) - len(fitted.xid_errors)
                self.rows_trimmed += left
                key = ("rows", s.gpu_uuid, s.mig or "")
                if key not in self._trim_logged and len(self._trim_logged) < _MAX_LOGGED:
                    self._trim_logged.add(key)
                    log.warning("GPU %s%s: a sample with %d processes and %d Xid errors, over the collector's limit "
                                "of %d each: sent with the %d processes using the most memory and the first %d Xid "
                                "errors (said once per GPU; gpuledger_agent_push_trimmed_list_items_total counts "
                                "what was left out)", s.gpu_uuid, f" MIG {s.mig}" if s.mig else "", len(s.processes),
                                len(s.xid_errors), self.limits.row_list, len(fitted.processes),
                                len(fitted.xid_errors))
            out.append(fitted)
        return out

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        """Job metadata (new or changed) to send with the next batch, fitted to what a collector takes of it. A
        record listing more hosts than one may (``limits.job_hosts``) goes with this host alone: what this node knows
        for sure, until the scheduler's record (imported by the collector) lists them all. A record naming another
        cluster than this host's (when the pusher names one) is this host's cluster's: the job runs here, and a
        collector refuses a batch whose records name another cluster (``SLURM_CLUSTER_NAME`` is the job user's to
        set, with ``trust_environ``)."""
        fitted = []
        for r in records:
            if len({*r.hosts, self.host}) > self.limits.job_hosts:
                log.warning("job %s lists %d hosts, more than the collector takes in one record (%d): described "
                            "with this host alone", r.job_id, len(r.hosts), self.limits.job_hosts)
                r = replace(r, hosts=(self.host,))
            if self.cluster and r.cluster and r.cluster != self.cluster:
                log.warning("job %s names cluster %r, but this host is in cluster %r: described as %r's",
                            r.job_id, r.cluster[:64], self.cluster, self.cluster)
                r = replace(r, cluster=self.cluster)
            fitted.append(r)
        with self._jobs_lock:
            self._jobs.update((r.job_id, r) for r in fitted)

    def take_jobs(self) -> list[JobRecord]:
        """The job metadata waiting for a batch (as many records, and hosts in them, as one batch may carry; the
        rest wait for the next), now that one will carry it."""
        with self._jobs_lock:
            taken: list[str] = []
            hosts = 0
            for job_id, r in self._jobs.items():
                n = len(r.hosts) + 1  # encode_batch adds this host where a record lacks it
                if taken and (len(taken) == self.limits.jobs or hosts + n > self.limits.row_lists):
                    break
                taken.append(job_id)
                hosts += n
            return [self._jobs.pop(j) for j in taken]

    def return_jobs(self, records: Sequence[JobRecord]) -> None:
        """Records a batch took but did not deliver (not spooled, not acknowledged): the next batch carries them,
        unless a newer record of the same job is already waiting. The agent sends a record only when it changes,
        so one dropped with its batch would be lost for good."""
        with self._jobs_lock:
            for r in records:
                self._jobs.setdefault(r.job_id, r)

    def bump_seq(self, at_least: int) -> None:
        """Never hand out a number below ``at_least`` (a spool's batches already hold the ones before)."""
        with self._lock:
            self._next_seq = max(self._next_seq, at_least)

    def encode(self, seq: int, samples: Sequence[GpuSample], fmt: str = "json", compress: str | None = None,
               layout: str = "series", jobs: Sequence[JobRecord] | None = None, fit: bool = False) -> bytes:
        """The request body of a batch (see :func:`encode_batch`) with ``jobs``, or else the job metadata waiting
        for it (given back if the batch cannot be encoded). ``fit``: BodyTooLarge for a body over
        ``limits.body_bytes`` that can be split (:func:`divisible`: one GPU's instant over it goes whole, refused)."""
        taken = self.take_jobs() if jobs is None else []
        max_bytes = self.limits.body_bytes if fit and divisible(samples) else None
        try:
            return encode_batch(self.agent_id, self.host, seq, samples, taken if jobs is None else jobs, fmt,
                                compress, layout, self.cluster, max_bytes)
        except EncodeError as exc:
            if taken:
                self.return_jobs(taken)
            raise PushError(f"batch {seq} for {self.url} cannot be encoded as {fmt.upper()}: {exc}") from exc
        except BodyTooLarge:
            if taken:
                self.return_jobs(taken)
            raise

    def send(self, seq: int, samples: Sequence[GpuSample]) -> Ack:
        """Send a batch under a given sequence number (in ``fmt``). A batch refused for what it holds while it
        carried job metadata is sent again without it (:meth:`resend_without_jobs`). The metadata goes back in the
        queue when no collector answered or the batch could not be encoded (a refusal of the batch itself drops
        it: it may be the cause)."""
        jobs = self.take_jobs()
        try:
            try:
                return self.post(seq, self.encode(seq, samples, self.fmt, jobs=jobs), self.fmt, samples=len(samples))
            except PushError as exc:
                return self.resend_without_jobs(exc, seq, samples, jobs, self.fmt)
        except PushError as exc:
            if exc.failover:
                self.return_jobs(jobs)
            raise

    def resend_without_jobs(self, refused: PushError, seq: int, samples: Sequence[GpuSample],
                            jobs: Sequence[JobRecord], fmt: str = "json", compress: str | None = None,
                            reserve: Callable[[int], object] | None = None,
                            head: Mapping[str, Any] | None = None) -> Ack:
        """Send batch ``seq``'s samples again without the job record a collector refused it for (``refused``, when
        :attr:`PushError.about_content` and the batch carried ``jobs``; else ``refused`` is raised): the one its answer
        names (:attr:`PushError.job`), with the others, and so on
        while an answer names another; all of them when one names none (a collector before it did), or once
        ``MAX_NAMED_RECORDS`` were left out one by one (each costs a request). Each attempt goes
        under a new seq (persisted first by ``reserve``; one it cannot persist is not used, and ``refused`` stands): a
        collector that stored one while its answer was lost takes the next as samples stored before, where under
        the same seq it would refuse them as other content. ``head``: the refused body's agent_id, host and cluster
        (a spooled batch's; else this pusher's).

        Taken: the records left out were the cause, dropped, counted in :attr:`job_records_refused` and said in one
        line. A record is sent only when it changes, so this costs the collector that job's metadata (the
        scheduler's records, imported, describe the job), never the samples. Raises the PushError of the last
        attempt when it is not about a record: then the records were not the cause, or not alone, and that answer
        decides the batch."""
        if not (jobs and refused.about_content):
            raise refused
        kept, first = list(jobs), refused
        dropped: list[JobRecord] = []
        while True:
            if refused.job is not None and refused.job < len(kept) and len(dropped) < MAX_NAMED_RECORDS:
                dropped.append(kept.pop(refused.job))
            else:
                dropped += kept
                kept = []
            new_seq = self.next_seq()
            if reserve is not None:
                try:
                    reserve(new_seq)
                except OSError as exc:
                    log.warning("batch %d cannot be sent again without its refused job records: sequence number not "
                                "persisted (%s)", seq, exc.strerror or exc)
                    raise first from None
            body = (self.encode(new_seq, samples, fmt, compress, jobs=kept) if head is None else
                    encode_batch(head["agent_id"], head["host"], new_seq, samples, kept, fmt, compress,
                                 cluster=head.get("cluster", "")))
            try:
                ack = self.post(new_seq, body, fmt, compress, samples=len(samples))
            except PushError as again:
                if not (kept and again.about_content):
                    raise
                refused = again
                continue
            break
        self.job_records_refused += len(dropped)
        log.warning("collector %s for batch %d (%d samples): taken as batch %d without %d of its %d job records, "
                    "dropped (gpuledger_agent_push_refused_job_records_total counts them): job(s) %s",
                    first.describe(), seq, len(samples), new_seq, len(dropped), len(jobs),
                    ", ".join(repr(r.job_id) for r in dropped[:10]) + (" ..." if len(dropped) > 10 else ""))
        return ack

    def post(self, seq: int, body: bytes, fmt: str = "json", compress: str | None = None, samples: int = 0) -> Ack:
        """POST an encoded batch to the collectors in order until one acknowledges it (see :meth:`_post_one`) and
        return the acknowledgement; raises the last PushError (``status`` None: no response) when none does. An
        answer that refuses the batch itself (a 4xx other than ``FAILOVER_STATUSES``) is final: another collector
        would say the same."""
        headers = {"Content-Type": CONTENT_TYPES[fmt], **self._headers}
        if compress:
            headers["Content-Encoding"] = compress
        for i, url in enumerate(self.urls[:-1]):
            try:
                return self._post_one(url, seq, body, headers, samples)
            except PushError as exc:
                if not exc.failover:
                    raise
                log.warning("collector %s %s for batch %d: trying %s", url, exc.describe(), seq, self.urls[i + 1])
        return self._post_one(self.urls[-1], seq, body, headers, samples)

    def _post_one(self, url: str, seq: int, body: bytes, headers: dict[str, str], samples: int) -> Ack:
        """One attempt. Acknowledged: a 2xx with the collector's acknowledgement, or a 422 too_late with it when some
        samples were stored (the rest, behind their GPU's window, are counted and said; the batch is not sent again:
        a 422 of which none was stored refuses the batch). A 2xx without one came from something else (a proxy's
        page): a PushError to try again, never delivered."""
        try:
            response = self._request(url, body, headers)
        except httpx.HTTPError as exc:
            cause = f"{type(exc).__name__}: {exc}"
            raise PushError(f"push of batch {seq} to {url} failed: {cause}", cause=cause) from exc
        except TimeoutError as exc:
            raise PushError(f"push of batch {seq} to {url} failed: {exc}", cause=str(exc)) from exc
        status = response.status_code
        text = response.text[:_BODY_EXCERPT]
        try:
            answer = response.json()
        except ValueError:
            answer = None
        answer = answer if isinstance(answer, dict) else {}
        reason = answer.get("reason", "")
        reason = reason if isinstance(reason, str) else ""
        job = answer.get("job")
        job = job if type(job) is int and job >= 0 else None
        ack = read_ack(response) if 200 <= status < 300 or (status == 422 and reason == "too_late") else None
        if 200 <= status < 300 and ack is None:
            cause = f"{response.headers.get('Content-Type') or 'no Content-Type'}: {text.strip()[:100]!r}"
            raise PushError(f"push of batch {seq} to {url}: HTTP {status} is no collector's acknowledgement ({cause})",
                            status=status, body=text, cause=cause, not_ack=True)
        if ack is None or (status == 422 and not ack.accepted):  # none of it stored: refused
            raise PushError(f"push of batch {seq} to {url} rejected: HTTP {status}: {text}", status=status, body=text,
                            reason=reason, retry_after_s=retry_after_seconds(response.headers.get("Retry-After")),
                            job=job)
        with self._lock:  # the spool's sender and a batch it could not store may be posted at once
            self.batches_sent += 1
            self.samples_sent += samples
            self.samples_refused += ack.too_late + ack.duplicate_samples
        if ack.too_late:
            log.warning("collector %s stored batch %d without %d of its %d samples, too late for their GPU's window "
                        "(is this node's clock behind?): those are lost", url, seq, ack.too_late, samples)
        elif ack.duplicate_samples:  # an overlapping resend: stored before, benign
            log.info("collector %s stored batch %d without %d of its samples, stored before", url, seq,
                     ack.duplicate_samples)
        return ack

    def _new_client(self) -> httpx.Client:
        return httpx.Client(timeout=self._timeout, verify=self._verify)

    def _request(self, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """POST within ``deadline_s``, or TimeoutError. The request runs in a thread of its own that is left
        behind when the deadline passes (a blocked socket read cannot be interrupted); the pusher then moves to a
        fresh client, the old one is closed when that thread ends, and at most MAX_HUNG_REQUESTS are left so."""
        with self._client_lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            if len(self._hung) >= MAX_HUNG_REQUESTS:
                raise TimeoutError(f"{len(self._hung)} earlier requests are still waiting on their answers")
            client = self._client
        outcome: list[Any] = []
        done = threading.Event()
        abandoned = threading.Event()

        def attempt() -> None:
            try:
                outcome.append(client.post(url, content=body, headers=headers))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                outcome.append(exc)
            finally:
                done.set()
                if abandoned.is_set() and self._own_client:
                    client.close()

        worker = threading.Thread(target=attempt, name="push-request", daemon=True)
        worker.start()
        if not done.wait(self.deadline_s):
            abandoned.set()
            with self._client_lock:
                self._hung.append(worker)
                if self._own_client and self._client is client:
                    self._client = self._new_client()
            if done.is_set() and self._own_client:  # it ended just now: its thread may not have seen the flag
                client.close()
            raise TimeoutError(f"no complete answer within {self.deadline_s:g} s")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return cast(httpx.Response, result)

    def close(self) -> None:
        if self._own_client:
            with self._client_lock:
                self._client.close()


# A batch's delivery (seq, body, samples, the job records it carries): returns batches to deliver in its place (the
# halves of one the collector refused as too large), else [].
Deliver = Callable[[int, bytes, list[GpuSample], list[JobRecord]], list[list[GpuSample]]]


def write_batches(pusher: HttpPusher, ticks: Sequence[Sequence[GpuSample]], fmt: str, compress: str | None,
                  deliver: Deliver, reserve: Callable[[int, list[GpuSample]], bool] | None = None) -> int | None:
    """Ticks' samples as one batch or, over ``pusher.limits``, several of whole ticks (:func:`split_ticks`), each
    under a new seq, encoded in ``fmt``/``compress`` and handed to ``deliver`` (both sinks: a post, or a spool).
    The last batch carries the job records waiting: the collector keeps a record only for a job it has samples of,
    from this batch or before. A body over the byte limit is halved before it goes (its seq is burnt: numbers may
    have gaps). ``reserve`` (a spool persisting its numbers) may refuse a seq, False: that batch is skipped (it
    says why). Returns the first seq used (None: none). Raises PushError for an unencodable batch (a NaN), after the
    others went; its job records ride with the next batch."""
    pending = split_ticks([pusher.fit(tick) for tick in ticks], pusher.limits)
    first: int | None = None
    unencodable: PushError | None = None
    while pending:
        part = pending.pop(0)
        seq = pusher.next_seq()
        if reserve is not None and not reserve(seq, part):
            continue
        first = seq if first is None else first
        jobs = [] if pending else pusher.take_jobs()
        try:
            body = pusher.encode(seq, part, fmt, compress, jobs=jobs, fit=True)
        except BodyTooLarge:
            pusher.return_jobs(jobs)
            pending[:0] = halve(part)
            continue
        except PushError as exc:
            pusher.return_jobs(jobs)
            unencodable = unencodable or exc
            continue
        pending[:0] = deliver(seq, body, part, jobs)
    if unencodable is not None:
        raise unencodable
    return first


class DirectSink:
    """An Agent sink without a spool: each batch is posted at once (split to fit the pusher's limits, and halved
    when the collector refuses it as too large); one no collector takes is dropped, with one warning line saying
    why (``unkept``: why nothing keeps it). ``stats()`` and ``summary()`` say what was delivered and what was lost.
    A spool posts what it cannot store through one (``agent.spool``): ``reserve`` then persists each seq the sink
    takes for itself (a batch sent again without its job records) before it is used.
    """

    def __init__(self, pusher: HttpPusher, unkept: str = "no --spool-dir to keep it",
                 reserve: Callable[[int], object] | None = None) -> None:
        self.pusher = pusher
        self.unkept = unkept
        self.reserve = reserve
        self.sent_batches = 0
        self.unsent_batches = 0  # no collector took them: dropped, nothing keeps them
        self.unsent_samples = 0
        self.rejected_batches = 0  # refused for good by the collector (a 4xx about the batch): dropped
        self.rejected_samples = 0
        self.late_samples = 0  # of batches stored, the samples refused as too late for their GPU's window

    def write(self, samples: Sequence[GpuSample]) -> None:
        """Post one tick's samples (see :meth:`write_ticks`)."""
        self.write_ticks([samples])

    def write_ticks(self, ticks: Sequence[Sequence[GpuSample]]) -> None:
        """Post ticks' samples as batches of whole ticks (:func:`write_batches`). Raises PushError for an
        unencodable batch (after the others went)."""
        write_batches(self.pusher, ticks, self.pusher.fmt, None,
                      lambda seq, body, part, jobs: self.post(seq, body, part, jobs, self.pusher.fmt))

    def post(self, seq: int, body: bytes, part: Sequence[GpuSample], jobs: Sequence[JobRecord], fmt: str,
             compress: str | None = None) -> list[list[GpuSample]]:
        """Post one encoded batch (``part``'s samples, carrying ``jobs``) and count what came of it; returns its
        halves, to be posted instead, when the collector refused it as too large. Refused for what it holds while it
        carried records, it is sent again without them (``HttpPusher.resend_without_jobs``). The records go back to
        the queue when no collector took the batch; a refusal of the batch itself drops them (they may be the
        cause)."""
        try:
            try:
                ack = self.pusher.post(seq, body, fmt, compress, samples=len(part))
            except PushError as refused:
                ack = self.pusher.resend_without_jobs(refused, seq, part, jobs, fmt, compress, self.reserve)
        except PushError as exc:
            if exc.too_large and divisible(part):
                self.pusher.return_jobs(jobs)
                log.warning("collector %s for batch %d (%d samples): sent again as two", exc.describe(), seq,
                            len(part))
                return list(halve(part))
            if exc.failover:
                self.pusher.return_jobs(jobs)
                self.drop(seq, len(part), f"collector {exc.describe()}")
            else:
                self.rejected_batches += 1
                self.rejected_samples += len(part)
                log.warning("collector refused batch %d (%d samples) for good, %s: dropped", seq, len(part),
                            exc.describe())
            return []
        self.sent_batches += 1
        self.late_samples += ack.too_late
        return []

    def drop(self, seq: int, samples: int, why: str) -> None:
        """A batch no collector took (``why``): dropped, counted, one line."""
        self.unsent_batches += 1
        self.unsent_samples += samples
        log.warning("%s for batch %d (%d samples): dropped (%s)", why, seq, samples, self.unkept)

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        self.pusher.write_jobs(records)

    def stats(self) -> dict[str, float]:
        """For the agent's /metrics (``agent.exposition``: the keys both sinks share, and no spool's)."""
        return {"sent_batches": self.sent_batches, "trimmed_list_items": self.pusher.rows_trimmed,
                "refused_job_records": self.pusher.job_records_refused,
                "unattributed_samples": self.pusher.samples_unattributed,
                "unsent_batches": self.unsent_batches, "unsent_samples": self.unsent_samples,
                "rejected_batches": self.rejected_batches,
                "rejected_samples": self.rejected_samples + self.late_samples}

    def delivered(self) -> int:
        return self.sent_batches

    def summary(self) -> str:
        p = self.pusher
        return (f"delivered {self.sent_batches} batch(es) ({p.samples_sent} samples, {p.samples_refused} of them not "
                f"stored by the collector); dropped {self.unsent_batches + self.rejected_batches} batch(es) "
                f"({self.unsent_samples + self.rejected_samples} samples)")

    def close(self) -> None:
        self.pusher.close()


class Batcher:
    """A sink that hands ``every`` ticks' samples to ``sink`` at once: sample every 10 s, push every minute.

    Fewer, larger batches cost the collector one durable commit each instead of one per tick. What is held goes as
    batches of whole ticks: the inner sink's ``write_ticks`` splits them within its pusher's limits; for a sink
    without it, ``limits`` (:func:`split_ticks`). ``flush()`` (and ``close()``) push what is held; a failed push
    leaves the samples with the inner sink's own error handling.
    """

    def __init__(self, sink: Any, every: int, limits: BatchLimits | None = None) -> None:
        if every < 1:
            raise ValueError(f"push every {every!r} ticks: must be >= 1")
        self.sink = sink
        self.every = every
        self.limits = limits or BatchLimits()
        self._held: list[list[GpuSample]] = []  # one list a tick
        self._ticks = 0

    def write(self, samples: Sequence[GpuSample]) -> None:
        self._held.append(list(samples))
        self._ticks += 1
        if self._ticks >= self.every:
            self.flush()

    def flush(self) -> None:
        held, self._held, self._ticks = self._held, [], 0
        if not held:
            return
        write_ticks = getattr(self.sink, "write_ticks", None)
        if write_ticks is not None:
            write_ticks(held)
            return
        failed: Exception | None = None
        for batch in split_ticks(held, self.limits):
            try:
                self.sink.write(batch)
            except Exception as exc:  # noqa: BLE001 - one batch's failure must not cost the others; raised after
                failed = failed or exc
        if failed is not None:
            raise failed

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        write_jobs = getattr(self.sink, "write_jobs", None)
        if write_jobs is not None:
            write_jobs(records)

    def stats(self) -> dict[str, int] | None:  # the spool's figures, when the inner sink spools
        inner = getattr(self.sink, "stats", None)
        return inner() if callable(inner) else None

    def summary(self) -> str:
        inner = getattr(self.sink, "summary", None)
        return inner() if callable(inner) else ""

    def delivered(self) -> int:
        inner = getattr(self.sink, "delivered", None)
        return inner() if callable(inner) else 0

    def close(self) -> None:
        try:
            self.flush()
        finally:
            close = getattr(self.sink, "close", None)
            if close is not None:
                close()
