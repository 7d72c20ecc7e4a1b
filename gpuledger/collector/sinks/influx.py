"""InfluxDB sink: every accepted sample (and per-job summaries) as line protocol, batched in a thread.

Two write paths: ``api="v2"`` goes through influxdb-client's synchronous write API to
``/api/v2/write`` (InfluxDB 2.x, 3.x, 1.8+ and compatible servers such as VictoriaMetrics);
``api="v1"`` POSTs to ``/write?db=...`` (InfluxDB 1.x, which has no v2 API before 1.8). Lines are
built with plain string formatting (influxdb-client's ``Point`` builder costs about 10x more).

The buffer is bounded (``max_buffer_lines``); what does not fit is dropped and counted, so a slow
or absent InfluxDB never slows ingest. A failed write is retried with exponential backoff; a batch
the server rejects (4xx other than 429) is dropped and counted, as retrying cannot help.
The schema (measurements, tags, fields, units) is documented in docs/schema.md.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from gpuledger.agent.mig import GPU_READINGS
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

log = logging.getLogger(__name__)

# Every numeric GpuSample field, by line-protocol type (one type per field forever: InfluxDB refuses
# a field whose type changes).
FLOAT_FIELDS: tuple[str, ...] = (
    "sm_active_ratio", "sm_occupancy_ratio", "dram_bw_ratio", "tensor_active_ratio", "fp64_active_ratio",
    "fp32_active_ratio", "fp16_active_ratio", "gpu_util_ratio", "mem_copy_util_ratio", "power_watts",
    "power_limit_watts", "energy_joules", "temp_celsius", "sm_clock_hz", "mem_clock_hz", "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
)
INT_FIELDS: tuple[str, ...] = ("mem_used_bytes", "mem_total_bytes", "throttle_reasons", "ecc_errors_total",
                               "remapped_rows_total")
JOB_FIELDS: tuple[str, ...] = ("sm_active_ratio", "dram_bw_ratio", "tensor_active_ratio", "power_watts")
# A MIG instance's gpu point holds no reading of its GPU's: those are on the GPU's own point (agent.mig.as_series).
INSTANCE_FLOAT_FIELDS: tuple[str, ...] = tuple(f for f in FLOAT_FIELDS if f not in GPU_READINGS)
_FLOATS = operator.attrgetter(*FLOAT_FIELDS)
_INSTANCE_FLOATS = operator.attrgetter(*INSTANCE_FLOAT_FIELDS)
_INTS = operator.attrgetter(*INT_FIELDS)
_JOB = operator.attrgetter(*JOB_FIELDS)
_I64 = 2**63
_TAG_ESC = str.maketrans({",": r"\,", "=": r"\=", " ": r"\ ", "\n": " ", "\r": " ", "\\": "\\\\"})
_MEAS_ESC = str.maketrans({",": r"\,", " ": r"\ ", "\n": " ", "\r": " ", "\\": "\\\\"})


def escape_tag(v: str) -> str:
    """Tag keys and values, field keys: backslash-escape comma, equals sign, space (and backslash);
    line breaks cannot be expressed in line protocol and become spaces."""
    return v.translate(_TAG_ESC)


def escape_measurement(v: str) -> str:
    return v.translate(_MEAS_ESC)


def string_field(v: str) -> str:
    """A string field value: double-quoted with quote and backslash escaped (we send none on the hot
    path, since VictoriaMetrics stores string fields as 0, but the encoder is complete)."""
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _f(v: float) -> str | None:
    return repr(float(v)) if math.isfinite(v) else None


def _ms(ts: float) -> int:
    return round(ts * 1000.0)


def tags(pairs: Iterable[tuple[str, Any]]) -> str:
    """``,k=v`` for each pair whose value is not None or empty, keys in the order given (sorted is
    what InfluxDB prefers; callers pass them sorted)."""
    return "".join(f",{k}={escape_tag(str(v))}" for k, v in pairs if v is not None and v != "")


def fields(pairs: Iterable[tuple[str, Any]]) -> str:
    """``k=v`` joined by commas: bool as true/false, int as ``Ni``, float as ``repr``, str quoted;
    None and non-finite values omitted."""
    out = []
    for k, v in pairs:
        if v is None:
            continue
        text: str | None
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int):
            if not -_I64 <= v < _I64:
                continue  # beyond int64: not representable as an InfluxDB integer
            text = f"{v}i"
        elif isinstance(v, float):
            text = _f(v)
            if text is None:
                continue
        else:
            text = string_field(str(v))
        out.append(f"{escape_tag(k)}={text}")
    return ",".join(out)


def line(measurement: str, tag_str: str, field_str: str, ts_ms: int) -> str | None:
    return f"{escape_measurement(measurement)}{tag_str} {field_str} {ts_ms}" if field_str else None


class GpuPrefixes:
    """Tag sets per GPU are built once (the hot path only formats fields)."""

    def __init__(self) -> None:
        self.gpu: dict[tuple, str] = {}
        self.job: dict[tuple, str] = {}

    def gpu_prefix(self, s: GpuSample) -> str:
        key = (s.host, s.gpu_index, s.gpu_uuid, s.model, s.mig)
        p = self.gpu.get(key)
        if p is None:
            p = self.gpu[key] = "gpu" + tags((("gpu", s.gpu_index), ("host", s.host), ("mig", s.mig),
                                               ("model", s.model), ("uuid", s.gpu_uuid)))
            if len(self.gpu) > 100_000:
                self.gpu.clear()
        return p

    def job_prefix(self, s: GpuSample, job: str) -> str:
        key = (s.host, s.gpu_uuid, s.mig, job)
        p = self.job.get(key)
        if p is None:
            if len(self.job) > 100_000:  # job ids churn: keep the cache bounded
                self.job.clear()
            p = self.job[key] = "gpu_job" + tags((("host", s.host), ("jobid", job), ("mig", s.mig),
                                                   ("uuid", s.gpu_uuid)))
        return p


def sample_lines(samples: Iterable[GpuSample], prefixes: GpuPrefixes | None = None) -> list[str]:
    """Measurements ``gpu`` (one point per sample, no job ids) and ``gpu_job`` (one per sample and job; its
    ``share_reported`` says whether ``share`` is the agent's or the equal split of a sample without shares).
    ``series_url`` ships these same lines to InfluxDB (``collector.influxdb``).

    A MIG GPU is counted once (``samples`` as the store keeps them: ``aggregate.normalize_mig``): its power, power
    limit and energy counter only on its whole-GPU point, which has no ``jobs`` either (it is no device a job
    holds: its instances are); its instances' points hold none of its readings (their ``gpu_job`` points keep its
    power, which ``share`` splits). A whole-GPU row is a MIG GPU's when ``samples`` hold one of its instances at the
    same instant, as ``normalize_mig`` groups them (a batch never parts an instant; the outbox queues a batch's rows
    together): rows of other instants never decide, so a backlog rendered in any order, or a batch spanning a GPU's
    switch into MIG mode, gives the same points."""
    px = prefixes or GpuPrefixes()
    rows = samples if isinstance(samples, (list, tuple)) else list(samples)
    mig_instants = {(s.host, s.gpu_uuid, s.ts) for s in rows if s.mig}
    out: list[str] = []
    append = out.append
    for s in rows:
        if s.mig:
            parts = [f"{k}={v!r}" for k, v in zip(INSTANCE_FLOAT_FIELDS, _INSTANCE_FLOATS(s))
                     if v is not None and math.isfinite(v)]
        else:
            parts = [f"{k}={v!r}" for k, v in zip(FLOAT_FIELDS, _FLOATS(s)) if v is not None and math.isfinite(v)]
        parts += [f"{k}={v}i" for k, v in zip(INT_FIELDS, _INTS(s)) if v is not None and v < _I64]
        parts.append(f"xid_errors={len(s.xid_errors)}i")
        if s.mig or not mig_instants or (s.host, s.gpu_uuid, s.ts) not in mig_instants:
            parts.append(f"jobs={len(s.job_ids)}i")
        ts = round(s.ts * 1000.0)
        append(f"{px.gpu_prefix(s)} {','.join(parts)} {ts}")
        if s.job_ids:
            shares = s.job_shares or (1.0 / len(s.job_ids),) * len(s.job_ids)
            common = [f"{k}={v!r}" for k, v in zip(JOB_FIELDS, _JOB(s)) if v is not None and math.isfinite(v)]
            if s.mem_used_bytes is not None and s.mem_used_bytes < _I64:
                common.append(f"mem_used_bytes={s.mem_used_bytes}i")
            common.append(f"share_reported={'true' if s.job_shares else 'false'}")
            tail = "," + ",".join(common)
            for job, share in zip(s.job_ids, shares):
                append(f"{px.job_prefix(s, job)} share={float(share)!r}{tail} {ts}")
    return out


def job_usage_lines(usage: Iterable[JobUsage], jobs: Mapping[str, JobRecord] | None = None,
                    ts: float | None = None) -> list[str]:
    """Measurement ``job_usage``: one point per job summary (``gpu_uuid == "*"`` rows), stamped with
    the job's last sample time unless ``ts`` is given."""
    jobs = jobs or {}
    out = []
    for u in usage:
        r = jobs.get(u.job_id)
        t = tags((("account", r and r.account), ("cluster", r and r.cluster), ("jobid", u.job_id),
                  ("partition", r and r.partition), ("user", r and r.user)))
        f = fields((("allocated_gpu_seconds", float(u.allocated_gpu_seconds)),
                    ("dram_bw_mean", u.dram_bw_mean), ("efficiency", u.efficiency),
                    ("energy_joules", float(u.energy_joules)), ("gpus", int(u.gpus)),
                    ("sm_active_gpu_seconds", float(u.sm_active_gpu_seconds)), ("sm_active_mean", u.sm_active_mean)))
        ln = line("job_usage", t, f, _ms(u.last_ts if ts is None else ts))
        if ln:
            out.append(ln)
    return out


def fairshare_lines(entries: Iterable[Mapping[str, Any]], ts: float) -> list[str]:
    """Measurement ``fairshare``: dicts with ``account``, ``user`` (None/absent for an account row),
    ``fairshare``, ``site_factor`` (integer), ``effective_usage``, ``raw_usage``."""
    out = []
    for e in entries:
        sf = e.get("site_factor")
        f = fields((("effective_usage", _num(e.get("effective_usage"))), ("fairshare", _num(e.get("fairshare"))),
                    ("raw_usage", _num(e.get("raw_usage"))), ("site_factor", None if sf is None else int(sf))))
        ln = line("fairshare", tags((("account", e.get("account")), ("user", e.get("user")))), f, _ms(ts))
        if ln:
            out.append(ln)
    return out


def _num(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass
class SinkStats:
    queued_lines: int = 0
    written_lines: int = 0
    dropped_lines: int = 0  # buffer overflow
    rejected_lines: int = 0  # the server refused the batch (4xx)
    failed_writes: int = 0  # attempts that failed and were retried
    last_error: str = ""


class InfluxSink:
    """Batches lines in a background thread and writes them with retries.

    ``api="v2"``: ``url``, ``bucket``, ``org``, ``token`` (influxdb-client). ``api="v1"``: ``url``,
    ``database`` (and optional ``username``/``password``). ``sleep`` and ``client`` are seams for tests.
    """

    def __init__(
        self,
        url: str,
        api: str = "v2",
        *,
        bucket: str = "gpuledger",
        org: str = "gpuledger",
        token: str = "",
        database: str = "gpuledger",
        username: str | None = None,
        password: str | None = None,
        batch_lines: int = 5000,
        flush_interval_s: float = 1.0,
        max_buffer_lines: int = 500_000,
        max_retries: int = 8,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 30.0,
        gzip: bool = False,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if api not in ("v1", "v2"):
            raise ValueError(f"api must be 'v1' or 'v2', got {api!r}")
        self.url, self.api = url.rstrip("/"), api
        self.bucket, self.org, self.database = bucket, org, database
        self.batch_lines, self.flush_interval_s = batch_lines, flush_interval_s
        self.max_buffer_lines, self.max_retries = max_buffer_lines, max_retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.stats = SinkStats()
        self._prefixes = GpuPrefixes()
        self._buf: deque[tuple[str, Any, int]] = deque()  # (kind, payload, line count)
        self._buffered = 0
        self._inflight = 0
        self._cv = threading.Condition()
        self._stop = False
        self._wake = threading.Event()
        self._sleep = sleep or self._wake.wait
        self._client: Any = None  # influxdb_client.InfluxDBClient (imported only for the v2 API)
        self._write_api: Any = None
        self._http: httpx.Client | None = None
        if api == "v2":
            from influxdb_client import InfluxDBClient
            from influxdb_client.client.write_api import SYNCHRONOUS

            self._client = InfluxDBClient(url=self.url, token=token, org=org, timeout=int(timeout_s * 1000),
                                          enable_gzip=gzip)
            self._write_api = self._client.write_api(write_options=SYNCHRONOUS)
        else:
            auth = (username, password or "") if username else None
            self._http = httpx.Client(timeout=timeout_s, auth=auth)
        self._thread = threading.Thread(target=self._run, name="influx-sink", daemon=True)
        self._thread.start()

    # -- producers (called under the store's lock: enqueue only) -------------------------------
    def _put(self, kind: str, payload: Any, n: int) -> None:
        with self._cv:
            if self._stop:
                return
            if self._buffered + n > self.max_buffer_lines:
                self.stats.dropped_lines += n
                return
            self._buf.append((kind, payload, n))
            self._buffered += n
            self.stats.queued_lines += n
            if self._buffered >= self.batch_lines:
                self._cv.notify()

    def write(self, samples: Sequence[GpuSample]) -> None:
        """Queue accepted samples; their lines are formatted in the sink's thread."""
        if samples:
            self._put("samples", samples, sum(1 + len(s.job_ids) for s in samples))

    def write_job_usage(self, usage: Sequence[JobUsage], jobs: Mapping[str, JobRecord]) -> None:
        lines = job_usage_lines([u for u in usage if u.gpu_uuid == "*"], jobs)
        self.write_lines(lines)

    def write_lines(self, lines: Sequence[str]) -> None:
        """Queue ready line-protocol lines (e.g. from :func:`fairshare_lines`)."""
        if lines:
            self._put("lines", list(lines), len(lines))

    # -- the writer thread ---------------------------------------------------------------------
    def _take(self) -> list[str]:
        with self._cv:
            if not self._buf and not self._stop:
                self._cv.wait(self.flush_interval_s)
            lines: list[str] = []
            while self._buf and len(lines) < self.batch_lines:
                kind, payload, n = self._buf.popleft()
                self._buffered -= n
                self._inflight += n
                lines.extend(sample_lines(payload, self._prefixes) if kind == "samples" else payload)
            return lines

    def _run(self) -> None:
        while True:
            lines = self._take()
            if lines:
                self._send(lines)
                with self._cv:
                    self._inflight = 0
                    self._cv.notify_all()
            with self._cv:
                if self._stop and not self._buf:
                    return

    def _send(self, lines: list[str]) -> None:
        body = ("\n".join(lines) + "\n").encode()
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                status, text = self._post(body)
            except Exception as e:  # connection refused, timeout, ...: retry
                status, text = 0, f"{type(e).__name__}: {e}"
            if 200 <= status < 300:
                self.stats.written_lines += len(lines)
                return
            self.stats.last_error = f"HTTP {status}: {text[:300]}" if status else text[:300]
            if 400 <= status < 500 and status not in (408, 429):
                log.warning("InfluxDB refused %d lines: %s", len(lines), self.stats.last_error)
                self.stats.rejected_lines += len(lines)
                return
            self.stats.failed_writes += 1
            if attempt == self.max_retries or (self._stop and attempt >= 1):
                break
            self._sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)
        log.warning("dropping %d lines after %d attempts: %s", len(lines), attempt + 1, self.stats.last_error)
        self.stats.dropped_lines += len(lines)

    def _post(self, body: bytes) -> tuple[int, str]:
        if self.api == "v1":
            assert self._http is not None
            r = self._http.post(f"{self.url}/write", params={"db": self.database, "precision": "ms"}, content=body)
            return r.status_code, r.text
        from influxdb_client.rest import ApiException

        try:
            self._write_api.write(bucket=self.bucket, org=self.org, record=body, write_precision="ms")
            return 204, ""
        except ApiException as e:
            return int(e.status or 0), str(e.body or e.reason)

    # -- control -------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far was written or given up; True if the buffer emptied."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._cv.notify_all()
            while self._buf or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.notify_all()
                self._cv.wait(min(left, 0.05))
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (bounded by ``timeout_s``), then stop the thread and the client."""
        self.flush(timeout_s)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._client is not None:
            self._client.close()
        if self._http is not None:
            self._http.close()
