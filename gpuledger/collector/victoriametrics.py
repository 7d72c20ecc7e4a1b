"""Series in VictoriaMetrics (``series_url``): what the collector ships there, and reading it back as the store would.

**What is stored**: the vocabulary the agents export on /metrics (``agent.exposition``, its one definition), a point
per sample: each reported numeric field under its ``GPU_SERIES`` name with the GPU labels ``host``, ``gpu`` (the
index), ``uuid``, ``model``, ``mig`` (empty ones omitted, as Prometheus does); ``gpuledger_gpu_jobs``, the number
of jobs holding the GPU, which every sample has; ``gpuledger_gpu_job_info`` = 1 for each job holding it and, where
the sample gives shares, ``gpuledger_gpu_job_share_ratio``, both labelled ``host``, ``gpu``, ``uuid``, ``mig`` and
``jobid``. A MIG GPU is shipped as ``agent.mig.as_series`` shows it (the agent's /metrics too): its power, power
limit and energy counter once, on its whole-GPU series (which holds no job), none of them on its instances' series,
whose jobs' shares are of the physical GPU (the instance's slice fraction times the job's share of it). The
Prometheus dashboards therefore read VictoriaMetrics as they read Prometheus. A sample's ``xid_errors``,
``processes`` and ``source`` are not stored there (the local store keeps them for its raw retention).

**Precision**: timestamps are milliseconds. VictoriaMetrics (1.79) keeps about 12 significant decimal digits of a
value: values of up to 11 (NVML's readings: integer milliwatts, millijoules, bytes, percentages) come back bit for
bit, longer ones within a relative 1e-11. The ledger never reads them back: it is computed from the exact samples
at ingest.

**Writes**: :func:`import_body` turns stored chunks into /api/v1/import JSON lines, one line per series and
shipment (``collector.series_outbox`` ships them). **Reads**: :class:`VmSeriesReader` answers
``SeriesReader.series`` in the local store's shape: raw samples from /api/v1/export; buckets from one
/api/v1/query_range of count, sum, min and max per field, each over a window of one step that ends at its
bucket's last millisecond (so [bucket, bucket + step), as the store buckets), with the tier and step the store
would pick when every tier is complete. Steps are rounded up to whole milliseconds; the last bucket holds the
samples up to ``end`` (the local store's rolled-up rows reach to their own end: the two agree when ``end`` is a
row's last millisecond).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from typing import Any

import httpx
import numpy as np

from gpuledger.agent.exposition import GPU_SERIES, JOB_INFO, JOB_SHARE, JOBS
from gpuledger.agent.mig import GPU_READINGS
from gpuledger.collector.chunks import OBJ, column_floats, column_list, decode_columns
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series_remote import (
    Chunk,
    RemoteSeriesReader,
    SeriesBackendError,
    SeriesHttpClient,
    ms_step,
    one_line,
)
from gpuledger.collector.series_store import TIER_NAMES
from gpuledger.schema.records import INT_FIELDS, GpuSample

FIELD_OF: dict[str, str] = {name: attr for name, attr in GPU_SERIES}  # stored name -> GpuSample field
_FIELD_NAMES = "|".join(name for name, _ in GPU_SERIES)
_ALL_NAMES = "|".join((*FIELD_OF, JOBS, JOB_INFO, JOB_SHARE))
_STATS = ("n", "sum", "min", "max")
_INTS = frozenset(INT_FIELDS)
_INSTANCE_SERIES = tuple((name, attr) for name, attr in GPU_SERIES if attr not in GPU_READINGS)


class VictoriaMetrics(SeriesHttpClient):
    """A VictoriaMetrics single-node server (or anything serving its HTTP API under ``url``). Thread-safe; a
    ``series_remote.SeriesTarget``."""

    name = "VictoriaMetrics"

    def import_lines(self, body: bytes) -> None:
        """POST JSON lines to /api/v1/import, gzipped (raises SeriesUnavailable, or SeriesBackendError: refused)."""
        self._request("POST", "/api/v1/import", content=gzip.compress(body, 1), headers={"Content-Encoding": "gzip"})

    def export(self, match: str, start_ms: int, end_ms: int) -> list[dict[str, Any]]:
        """Raw points of the series ``match`` selects, with start_ms <= ts <= end_ms (as far as VictoriaMetrics'
        second-based parameters allow: callers filter exactly)."""
        r = self._request("POST", "/api/v1/export", data={"match[]": match, "start": _seconds(start_ms),
                                                          "end": _seconds(end_ms)})
        try:
            return [json.loads(line) for line in r.text.splitlines() if line.strip()]
        except ValueError as e:
            raise SeriesBackendError(f"VictoriaMetrics at {self.url}: unreadable export ({e})") from None

    def query_range(self, expr: str, start_ms: int, end_ms: int, step_ms: int) -> list[dict[str, Any]]:
        """A range query evaluated at start_ms, start_ms + step_ms, ... <= end_ms (uncached: a late shipment
        changes old buckets)."""
        return self._result(self._request("POST", "/api/v1/query_range", data={
            "query": expr, "start": _seconds(start_ms), "end": _seconds(end_ms), "step": f"{step_ms}ms",
            "nocache": "1"}))

    def query(self, expr: str, at_ms: int) -> list[dict[str, Any]]:
        return self._result(self._request("POST", "/api/v1/query", data={
            "query": expr, "time": _seconds(at_ms), "nocache": "1"}))

    def _result(self, r: httpx.Response) -> list[dict[str, Any]]:
        try:
            doc = r.json()
            out = doc["data"]["result"]
            if doc.get("status") != "success" or not isinstance(out, list):
                raise ValueError(doc.get("error", "no result"))
            return out
        except (ValueError, KeyError, TypeError) as e:
            raise SeriesBackendError(f"VictoriaMetrics at {self.url}: unreadable answer ({one_line(str(e))})"
                                     ) from None

    def flags(self) -> dict[str, str]:
        """The flags the server was started with (``/flags`` lists those set on its command line)."""
        out = {}
        for line in self._request("GET", "/flags").text.splitlines():
            name, sep, value = line.strip().lstrip("-").partition("=")
            if sep:
                out[name] = value.strip('"')
        return out

    # -- what the shipper needs (series_remote.SeriesTarget) --------------------------------------------------
    def render(self, chunks: Iterable[Chunk]) -> tuple[bytes, int]:
        return import_body(chunks)

    def post(self, body: bytes) -> None:
        self.import_lines(body)

    def problems(self) -> list[str]:
        return settings_problems(self.flags())


def _seconds(ms: int) -> str:
    """Unix milliseconds as the seconds VictoriaMetrics parses: it multiplies by 1000 and truncates, so the text
    carries half a millisecond more (``1.2345``), which truncates to exactly ``ms`` whatever the float rounding."""
    return f"{ms // 1000}.{ms % 1000:03d}5"


def settings_problems(flags: dict[str, str]) -> list[str]:
    """What a VictoriaMetrics started with ``flags`` gets wrong for the collector (docs/deploy.md)."""
    problems = []
    if flags.get("dedup.minScrapeInterval", "0s") in ("0s", "0", "0ms", ""):
        problems.append("-dedup.minScrapeInterval is not set: a shipment resent after a crash or timeout is stored "
                        "twice (start VictoriaMetrics with -dedup.minScrapeInterval=1ms)")
    if flags.get("search.latencyOffset", "30s") not in ("0s", "0", "0ms"):
        problems.append("-search.latencyOffset is not 0s: /api/v1/series buckets miss the newest "
                        f"{flags.get('search.latencyOffset', '30s')} (start it with -search.latencyOffset=0s)")
    return problems


# -- writes: stored chunks -> import lines --------------------------------------------------------------------
def import_body(chunks: Iterable[Chunk]) -> tuple[bytes, int]:
    """/api/v1/import JSON lines of raw chunks ``(host, gpu_uuid, mig, chunk)`` (``collector.chunks``); returns
    (body, samples). A GPU's points of all the chunks go in one line per series."""
    points: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}  # (name, labels JSON) -> (timestamps, values)
    label_json: dict[tuple[str, ...], str] = {}
    samples = 0

    def add(name: str, labels: tuple[str, ...], ts: list[int], values: list[Any]) -> None:
        if not ts:  # a column no row of the run reported (a row chunk has every field's)
            return
        text = label_json.get(labels)
        if text is None:  # label names alternate with values; empty values are left out, as Prometheus does
            pairs = {labels[i]: labels[i + 1] for i in range(0, len(labels), 2) if labels[i + 1]}
            text = label_json[labels] = json.dumps(pairs, ensure_ascii=False)
        got = points.setdefault((name, text), ([], []))
        got[0].extend(ts)
        got[1].extend(values)

    for host, uuid, mig, blob in chunks:
        n, cols = decode_columns(blob)
        samples += n
        ts_ms = np.rint(column_floats(n, cols["ts"]) * 1000.0).astype(np.int64)
        index = column_list(n, cols["gpu_index"]) if "gpu_index" in cols else [0] * n
        model = column_list(n, cols["model"]) if "model" in cols else [""] * n
        jobs = column_list(n, cols["job_ids"]) if "job_ids" in cols else [None] * n
        shares = column_list(n, cols["job_shares"]) if "job_shares" in cols else [None] * n
        # rows by GPU labels: one run in practice (an index or model that changes splits it)
        runs: dict[tuple[str, str], list[int]] = {}
        for i, (gpu, mdl) in enumerate(zip(index, model)):
            runs.setdefault((str(gpu), mdl or ""), []).append(i)
        # a MIG instance's chunk holds its GPU's readings as the aggregation counted them: they are the GPU's series'
        series = _INSTANCE_SERIES if mig else GPU_SERIES
        for (gpu, mdl), rows in runs.items():
            labels = ("host", host, "gpu", gpu, "uuid", uuid, "model", mdl, "mig", mig)
            in_run = None if len(rows) == n else np.isin(np.arange(n), rows)
            for name, attr in series:
                col = cols.get(attr)
                if col is None:
                    continue
                kind, vals, mask = col
                if kind == OBJ:  # an integer beyond int64, kept as a generic column
                    row_vals = column_list(n, col)
                    keep = [i for i in rows if row_vals[i] is not None]
                    add(name, labels, ts_ms[keep].tolist(), [float(row_vals[i]) for i in keep])
                    continue
                if in_run is None:  # the usual case: the column's present values as they are
                    add(name, labels, (ts_ms if mask is None else ts_ms[mask]).tolist(), vals.tolist())
                    continue
                present = np.ones(n, dtype=bool) if mask is None else mask
                full = np.zeros(n, dtype=vals.dtype)
                full[present] = vals
                add(name, labels, ts_ms[present & in_run].tolist(), full[present & in_run].tolist())
            add(JOBS, labels, ts_ms[rows].tolist(), [len(jobs[i] or ()) for i in rows])
            per_job: dict[str, tuple[list[int], list[float]]] = {}
            shared: dict[str, tuple[list[int], list[float]]] = {}
            for i in rows:
                ids, fractions = jobs[i] or (), shares[i] or ()
                for k, job in enumerate(ids):
                    per_job.setdefault(job, ([], []))[0].append(int(ts_ms[i]))
                    if k < len(fractions):
                        got = shared.setdefault(job, ([], []))
                        got[0].append(int(ts_ms[i]))
                        got[1].append(float(fractions[k]))
            for job, (ts, _) in per_job.items():
                add(JOB_INFO, ("host", host, "gpu", gpu, "uuid", uuid, "mig", mig, "jobid", job), ts, [1] * len(ts))
            for job, (ts, fractions) in shared.items():
                add(JOB_SHARE, ("host", host, "gpu", gpu, "uuid", uuid, "mig", mig, "jobid", job), ts, fractions)
    lines = [f'{{"metric":{{"__name__":{json.dumps(name)}{"," if labels != "{}" else ""}{labels[1:]},'
             f'"values":{json.dumps(vals)},"timestamps":{json.dumps(ts)}}}'
             for (name, labels), (ts, vals) in points.items()]
    return ("\n".join(lines) + "\n").encode() if lines else b"", samples


# -- reads ----------------------------------------------------------------------------------------------------
def _quote(v: str) -> str:
    return json.dumps(v, ensure_ascii=False)  # a PromQL string literal (Go escapes, which JSON's are)


class VmSeriesReader(RemoteSeriesReader):
    """``SeriesReader`` over VictoriaMetrics with MetricsQL and its export API (``RemoteSeriesReader``). Raises
    SeriesUnavailable (unreachable, timed out, overloaded) or SeriesBackendError (an error answer); never blocks
    ingest."""

    name = "VictoriaMetrics"

    def __init__(self, vm: VictoriaMetrics) -> None:
        self.vm, self.url = vm, vm.url

    def _selector(self, host: str, gpu_uuid: str, mig: str) -> str:
        return f"host={_quote(host)}, uuid={_quote(gpu_uuid)}, mig={_quote(mig)}"

    def close(self) -> None:
        self.vm.close()

    def _raw(self, host: str, uuid: str, mig: str | None, labels: str, start: float, end: float) -> list[GpuSample]:
        got = self.vm.export(f'{{__name__=~"{_ALL_NAMES}", {labels}}}', math.floor(start * 1000) - 1,
                             math.ceil(end * 1000) + 1)
        rows: dict[int, dict[str, Any]] = {}
        for line in got:
            metric, values, stamps = line.get("metric", {}), line.get("values", []), line.get("timestamps", [])
            name = metric.get("__name__", "")
            for t, v in zip(stamps, values):
                row = rows.setdefault(t, {"jobs": {}, "shares": {}})
                if "gpu" in metric:
                    row["gpu_index"] = int(metric["gpu"])
                if name in FIELD_OF:
                    attr = FIELD_OF[name]
                    row[attr] = int(v) if attr in _INTS else float(v)
                    row["model"] = metric.get("model", "")
                elif name == JOB_INFO:
                    row["jobs"][metric.get("jobid", "")] = True
                elif name == JOB_SHARE:
                    row["shares"][metric.get("jobid", "")] = float(v)
        out = []
        for t in sorted(rows):
            ts = t / 1000.0
            if not start <= ts <= end:
                continue
            row = rows[t]
            job_ids = tuple(sorted(row.pop("jobs")))
            shares = row.pop("shares")
            job_shares = tuple(shares[j] for j in job_ids) if shares and all(j in shares for j in job_ids) else ()
            out.append(GpuSample(ts=ts, host=host, gpu_uuid=uuid, mig=mig, gpu_index=row.pop("gpu_index", 0),
                                 job_ids=job_ids, job_shares=job_shares, **row))
        return out

    def _buckets(self, labels: str, tier: int, start: float, end: float, step: float | None) -> list[RollupPoint]:
        step = ms_step(tier, step)  # whole milliseconds, VictoriaMetrics' grid
        step_ms = round(step * 1000)
        first = math.floor(start / step)
        lo_ms = first * step_ms
        stop_ms = math.floor(end * 1000) + 1  # the samples up to end (a rolled-up row of the local store may
        # reach past end to its own end: with an end at a row's last millisecond, the two agree)
        if stop_ms <= lo_ms:
            return []
        last = (stop_ms - 1 - lo_ms) // step_ms  # the bucket holding the last millisecond
        numeric = f'{{__name__=~"{_FIELD_NAMES}", {labels}}}'
        jobs = f"{JOBS}{{{labels}}}"

        def expr(window_ms: int) -> str:
            w = f"[{window_ms}ms]"
            parts = [f'label_set({fn}_over_time({numeric}{w}) keep_metric_names, "stat", "{stat}")'
                     for stat, fn in zip(_STATS, ("count", "sum", "min", "max"))]
            parts.append(f'label_set(count_over_time({jobs}{w}) keep_metric_names, "stat", "n")')
            return f"union({', '.join(parts)})"

        acc: dict[int, dict[str, Any]] = {}

        def collect(result: list[dict[str, Any]], bucket_of: Any) -> None:
            for s in result:
                metric = s.get("metric", {})
                name, stat = metric.get("__name__", ""), metric.get("stat", "")
                for t, v in s.get("values") or [s.get("value")]:
                    b = acc.setdefault(bucket_of(t), {"samples": 0, "values": {}})
                    x = float(v)
                    if name == JOBS:
                        b["samples"] += int(x)
                        continue
                    if name not in FIELD_OF or stat not in _STATS:
                        continue
                    cur = b["values"].setdefault(FIELD_OF[name], [0, 0.0, math.inf, -math.inf])
                    i = _STATS.index(stat)
                    cur[i] = cur[i] + x if i < 2 else (min if i == 2 else max)(cur[i], x)

        # whole buckets: evaluated at each one's last millisecond over one step
        if stop_ms - lo_ms >= step_ms:
            full = (stop_ms - lo_ms) // step_ms  # buckets 0 .. full-1 end by stop
            result = self.vm.query_range(expr(step_ms), lo_ms + step_ms - 1, lo_ms + full * step_ms - 1, step_ms)
            collect(result, lambda t: (round(float(t) * 1000) + 1 - lo_ms) // step_ms - 1)
        else:
            full = 0
        if full <= last:  # the last bucket, cut at stop
            collect(self.vm.query(expr(stop_ms - (lo_ms + last * step_ms)), stop_ms - 1), lambda t: last)
        out = []
        for k in sorted(acc):
            b = acc[k]
            values = {f: (int(v[0]), v[1], v[2], v[3]) for f, v in b["values"].items() if v[0] > 0}
            if b["samples"] or values:
                out.append(RollupPoint((first + k) * step, step, b["samples"], values, TIER_NAMES[tier]))
        return out
