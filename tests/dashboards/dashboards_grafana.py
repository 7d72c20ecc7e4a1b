"""What Grafana does with a dashboard JSON before a query reaches the data source, for the dashboard tests:
structural validation, query extraction, and template-variable interpolation ($timeFilter, $__interval,
$__range, $__rate_interval, ${var}, multi-value formatting).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repository root, for the test harness modules
    sys.path.insert(0, str(ROOT))

PANEL_TYPES = {"row", "timeseries", "stat", "table", "bargauge"}
_VAR = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\[\[(\w+)\]\]|\$(\w+)")


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict), path
    return doc


def validate(doc: dict[str, Any]) -> list[str]:
    """Structural problems: what Grafana would reject or mis-render (empty list: fine)."""
    bad: list[str] = []
    for key in ("uid", "title", "panels", "templating", "schemaVersion", "time"):
        if key not in doc:
            bad.append(f"missing {key}")
    if doc.get("schemaVersion", 0) < 39:
        bad.append(f"schemaVersion {doc.get('schemaVersion')} < 39")
    variables = {v.get("name"): v for v in doc.get("templating", {}).get("list", [])}
    ds_var = variables.get("ds")
    if not ds_var or ds_var.get("type") != "datasource" or ds_var.get("query") not in ("influxdb", "prometheus"):
        bad.append("no data-source variable ds")
        return bad
    flavour = ds_var["query"]
    ids: list[int] = []
    occupied: set[tuple[int, int]] = set()
    for p in doc.get("panels", []):
        pid, title = p.get("id"), p.get("title", "?")
        ids.append(pid)
        if p.get("type") not in PANEL_TYPES:
            bad.append(f"{title}: unknown type {p.get('type')}")
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in ("h", "w", "x", "y")):
            bad.append(f"{title}: bad gridPos {g}")
            continue
        if g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24 or g["h"] < 1 or g["y"] < 0:
            bad.append(f"{title}: gridPos outside the grid {g}")
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        if cells & occupied:
            bad.append(f"{title}: overlaps another panel")
        occupied |= cells
        if p.get("type") == "row":
            continue
        if p.get("datasource") != {"type": flavour, "uid": "${ds}"}:
            bad.append(f"{title}: data source is not ${{ds}}")
        targets = p.get("targets") or []
        if not targets:
            bad.append(f"{title}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            bad.append(f"{title}: duplicate refIds {refs}")
        for t in targets:
            q = t.get("expr") if flavour == "prometheus" else t.get("query")
            if not isinstance(q, str) or not q.strip():
                bad.append(f"{title}/{t.get('refId')}: empty query")
            if t.get("datasource", {}).get("uid") != "${ds}":
                bad.append(f"{title}/{t.get('refId')}: target data source is not ${{ds}}")
            if flavour == "influxdb" and t.get("rawQuery") is not True:
                bad.append(f"{title}/{t.get('refId')}: not a raw InfluxQL query")
            for name in variables_used(q or ""):
                if name not in variables and not name.startswith("__") and name != "timeFilter":
                    bad.append(f"{title}/{t.get('refId')}: undefined variable ${name}")
    if len(set(ids)) != len(ids) or None in ids:
        bad.append(f"panel ids not unique: {ids}")
    return bad


def variables_used(q: str) -> set[str]:
    return {next(g for g in m.groups()[0:1] + m.groups()[2:] if g) for m in _VAR.finditer(q)}


@dataclass(frozen=True)
class Query:
    where: str
    text: str
    fmt: str
    instant: bool
    time_from: str | None


def targets(doc: dict[str, Any]) -> Iterator[Query]:
    flavour = next(v["query"] for v in doc["templating"]["list"] if v["name"] == "ds")
    for p in doc["panels"]:
        for t in p.get("targets", []):
            text = t["expr"] if flavour == "prometheus" else t["query"]
            fmt = t.get("format", t.get("resultFormat", "time_series"))
            yield Query(f"{doc['uid']} / {p['title']} / {t['refId']}", text, fmt, bool(t.get("instant")),
                        p.get("timeFrom"))


def query_variables(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in doc["templating"]["list"] if v["type"] == "query"]


@dataclass
class Context:
    """The dashboard state Grafana interpolates from: time range, interval and chosen variable values."""

    start: float
    end: float
    interval_s: int
    scrape_s: int = 1  # Prometheus data source's scrape interval (for $__rate_interval)
    values: dict[str, list[str]] = field(default_factory=dict)
    multi: set[str] = field(default_factory=set)

    def for_panel(self, time_from: str | None, midnight: float) -> Context:
        # "now/d": today so far, as Grafana's relative panel time; at least 15 minutes, so that a test run
        # just after midnight still sees the demo's data (which Grafana, then, would legitimately not show).
        if time_from == "now/d":
            start = min(midnight, self.end - 900)
            # Grafana's interval: the range over ~1000 data points, never below the source's own interval.
            interval = max(self.interval_s, math.ceil((self.end - start) / 1000))
            return Context(start, self.end, interval, self.scrape_s, self.values, self.multi)
        if time_from is not None:
            raise ValueError(f"unsupported panel time {time_from!r}")
        return self


def _prom_escape(v: str) -> str:
    return re.sub(r"[$^*{}\[\]'+?.()|\\]", lambda m: "\\\\" + m.group(0), v)


def _influx_escape(v: str) -> str:
    return re.sub(r"[\\^$*+?.()|\[\]{}/]", lambda m: "\\" + m.group(0), v)


def interpolate(q: str, flavour: str, ctx: Context) -> str:
    rng = int(round(ctx.end - ctx.start))
    builtins = {
        "__interval": f"{ctx.interval_s}s",
        "__interval_ms": str(ctx.interval_s * 1000),
        "__range": f"{rng}s",
        "__range_s": str(rng),
        "__range_ms": str(rng * 1000),
        "__rate_interval": f"{max(ctx.interval_s + ctx.scrape_s, 4 * ctx.scrape_s)}s",
        "timeFilter": f"time >= {int(ctx.start * 1000)}ms and time <= {int(ctx.end * 1000)}ms",
    }

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3) or m.group(4)
        if name in builtins:
            return builtins[name]
        if name not in ctx.values:
            raise KeyError(f"no value for ${name} in {q}")
        vals = ctx.values[name]
        fmt = m.group(2)
        if fmt == "raw":
            return ",".join(vals)
        if name in ctx.multi or len(vals) > 1:
            esc = _prom_escape if flavour == "prometheus" else _influx_escape
            return "(" + "|".join(esc(v) for v in vals) + ")"
        return vals[0]

    return _VAR.sub(sub, q)


# -- what Grafana does with a Prometheus-flavour dashboard, against anything serving Prometheus' API ----------
def prom_has_data(data: dict[str, Any]) -> bool:
    for series in data["result"]:
        values = series.get("values") or [series.get("value")]
        if any(v is not None and not math.isnan(float(v[1])) for v in values):
            return True
    return False


def choose(ctx: Context, v: dict[str, Any], values: list[Any]) -> None:
    """Pick a query variable's values as Grafana would: all of them for "include all", else the first."""
    ctx.values[v["name"]] = values if v.get("includeAll") else values[:1]
    if v.get("multi") or v.get("includeAll"):
        ctx.multi.add(v["name"])


def custom_variables(doc: dict[str, Any], ctx: Context) -> None:
    for v in doc["templating"]["list"]:
        if v["type"] == "custom":
            ctx.values[v["name"]] = [v["current"]["value"]]


def prom_variable_values(server: Any, doc: dict[str, Any], ctx: Context, jobid: str) -> None:
    """Resolve the query variables through ``server``'s /api/v1/series (Prometheus or VictoriaMetrics); the job
    variable is set to ``jobid``, which must be among its values."""
    for v in query_variables(doc):
        q = interpolate(v["query"], "prometheus", ctx)
        selector, label = q.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
        series = server.api("/api/v1/series", **{"match[]": selector, "start": ctx.start, "end": ctx.end})
        values = sorted({s[label.strip()] for s in series if label.strip() in s})
        assert values, f"variable ${v['name']}: {q} found nothing"
        if v["name"] == "jobid":
            assert jobid in values
            values = [jobid]
        choose(ctx, v, values)
    custom_variables(doc, ctx)


def midnight(now: float) -> float:
    d = dt.datetime.fromtimestamp(now)
    return d.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def empty_prom_targets(server: Any, doc: dict[str, Any], ctx: Context, jobid: str,
                       absent: frozenset[str] = frozenset()) -> list[str]:
    """Every target of a Prometheus-flavour dashboard, interpolated as Grafana would, that ``server`` answers
    with no data ("where: query"), but those over a metric in ``absent`` (what ``server`` is not fed)."""
    from gpuledger.dashboards import lint

    prom_variable_values(server, doc, ctx, jobid)
    empty = []
    for q in targets(doc):
        if lint.prom_metrics(q.text) & absent:
            continue
        c = ctx.for_panel(q.time_from, midnight(ctx.end))
        expr = interpolate(q.text, "prometheus", c)
        data = server.query(expr, at=c.end) if q.instant else server.query_range(expr, c.start, c.end, c.interval_s)
        if not prom_has_data(data):
            empty.append(f"{q.where}: {expr}")
    return empty


def prom_state_counts(server: Any, ctx: Context, idle_ratio: str = "0.05") -> dict[str, int]:
    """GPUs per state, as the Prometheus-flavour state panels count them on ``server`` at ``ctx.end`` (the idle
    threshold variable set to ``idle_ratio``)."""
    from gpuledger.dashboards import prometheus_defs

    ctx.values["idle"] = [idle_ratio]
    got = {}
    for state, q in prometheus_defs.STATE_QUERIES.items():
        result = server.query(interpolate(q, "prometheus", ctx), at=ctx.end)["result"]
        got[state] = int(float(result[0]["value"][1]))
    return got


# the Job dashboard's summary stats and the ledger's figure each estimates (JobUsage -> the stat's unit)
JOB_STATS: dict[str, Callable[[Any], float]] = {
    "GPU-hours allocated": lambda u: u.allocated_gpu_seconds / 3600,
    "SM-active GPU-hours": lambda u: u.sm_active_gpu_seconds / 3600,
    "Energy": lambda u: u.energy_joules / 3.6e6,
}


def prom_job_stats(server: Any, job: str, start: float, end: float) -> dict[str, float]:
    """The Prometheus-flavour Job dashboard's summary stats (``JOB_STATS``) of ``job`` over [start, end] on
    ``server``, as Grafana asks for them (instant queries at the end of the range, 1 s interval)."""
    doc = load(ROOT / "gpuledger" / "dashboards" / "prometheus" / "job.json")
    ctx = Context(start=start, end=end, interval_s=1, values={"jobid": [job]})
    got = {}
    for q in targets(doc):
        title = q.where.split(" / ")[1]
        if title in JOB_STATS:
            (series,) = server.query(interpolate(q.text, "prometheus", ctx), at=end)["result"]
            got[title] = float(series["value"][1])
    return got


def job_stats_off_the_ledger(server: Any, store: Any, jobs: dict[str, float], span_s: float,
                             rel: float = 0.2) -> dict[str, dict[str, tuple[float, float]]]:
    """For each of ``jobs`` (job id -> the share of a GPU-second it is charged: its share, or its MIG slice): the Job
    dashboard's stats (:func:`prom_job_stats`) over a span of at least ``span_s`` between two readings of the
    ledger (``store``; ``server`` holds data of it from the first on), against what the ledger counted in it, more
    than ``rel`` off, as {job: {stat: (dashboard, ledger)}} (empty: all within). The ledger's allocated GPU-seconds
    in the span must be the share of it, too."""

    def reading() -> dict[str, Any]:
        return {u.job_id: u for u in store.job_usage() if u.gpu_uuid == "*" and u.job_id in jobs}

    first = reading()
    assert set(first) == set(jobs), sorted(first)
    time.sleep(span_s)
    last = reading()
    off: dict[str, dict[str, tuple[float, float]]] = {}
    for job in jobs:
        u0, u1 = first[job], last[job]
        span = u1.last_ts - u0.last_ts
        assert span >= span_s * 0.5, (job, u0.last_ts, u1.last_ts)
        assert u1.allocated_gpu_seconds - u0.allocated_gpu_seconds == pytest.approx(jobs[job] * span, rel=0.05), job
        got = prom_job_stats(server, job, u0.last_ts, u1.last_ts)
        for title, of in JOB_STATS.items():
            want = of(u1) - of(u0)
            if not abs(got[title] - want) <= rel * abs(want):
                off.setdefault(job, {})[title] = (got[title], want)
    return off
