"""A small typed builder for Grafana dashboards: the model and its rendering to Grafana JSON.

Dashboards are declared in :mod:`gpuledger.dashboards.influxdb_defs` and :mod:`gpuledger.dashboards.prometheus_defs`
with the helpers below (:func:`dashboard`, :func:`row`, :func:`timeseries`, :func:`stat`, :func:`table`,
:func:`bar`, :func:`target`, :func:`query_var`, :func:`custom_var`); :func:`render` turns one into Grafana JSON
(schemaVersion 39, panels laid out left to right in the 24-column grid, ids assigned in order, the data source a
template variable ``${ds}``). Writing the files is :mod:`gpuledger.dashboards.build`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Flavour = Literal["influxdb", "prometheus"]
PanelKind = Literal["timeseries", "stat", "table", "bargauge"]
FLAVOURS: tuple[Flavour, ...] = ("influxdb", "prometheus")
SCHEMA_VERSION = 39
GRID_WIDTH = 24
DS_VAR = "ds"
# Grafana's default palette for a stat/bar without thresholds of its own.
_GREEN = [{"color": "green", "value": None}]


@dataclass(frozen=True, slots=True)
class Target:
    """One query of a panel: PromQL or raw InfluxQL, with its legend (Prometheus ``{{label}}`` / Influx alias)."""

    query: str
    legend: str = ""
    fmt: Literal["time_series", "table"] = "time_series"
    instant: bool = False  # Prometheus: evaluate once at the end of the range


@dataclass(frozen=True, slots=True)
class Panel:
    kind: PanelKind
    title: str
    targets: tuple[Target, ...]
    unit: str = "none"
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    stack: bool = False
    calcs: tuple[str, ...] = ("lastNotNull",)  # stat/bar reduction
    thresholds: tuple[tuple[str, float | None], ...] = ()  # (colour, from value); first value None
    time_from: str | None = None  # panel-relative time, e.g. "now/d" (today so far)
    transformations: tuple[dict[str, Any], ...] = ()
    no_value: str | None = None  # shown instead of "No data" (e.g. "0" for a count with nothing to count)
    bars: bool = False  # timeseries drawn as bars (per-interval totals)


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    kind: Literal["query", "custom", "textbox"]
    query: str
    label: str = ""
    multi: bool = False
    include_all: bool = False
    description: str = ""


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    flavour: Flavour
    slug: str  # file name without .json
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = ()
    description: str = ""
    tags: tuple[str, ...] = ()
    time_from: str = "now-6h"
    refresh: str = "1m"

    def panels(self) -> list[Panel]:
        return [p for r in self.rows for p in r.panels]


# -- helpers that read like the dashboards they build ------------------------------------------------------
def target(query: str, legend: str = "", *, fmt: Literal["time_series", "table"] = "time_series",
           instant: bool = False) -> Target:
    return Target(" ".join(query.split()), legend, fmt, instant)


def timeseries(title: str, *targets: Target, unit: str = "none", **kw: Any) -> Panel:
    return Panel("timeseries", title, targets, unit, **kw)


def stat(title: str, *targets: Target, unit: str = "none", width: int = 4, height: int = 4, **kw: Any) -> Panel:
    return Panel("stat", title, targets, unit, width=width, height=height, **kw)


def table(title: str, *targets: Target, unit: str = "none", width: int = 24, **kw: Any) -> Panel:
    return Panel("table", title, targets, unit, width=width, **kw)


def bar(title: str, *targets: Target, unit: str = "none", **kw: Any) -> Panel:
    """A horizontal bar gauge: one bar per series, reduced by ``calcs``."""
    return Panel("bargauge", title, targets, unit, **kw)


def row(title: str, *panels: Panel) -> Row:
    return Row(title, panels)


def query_var(name: str, query: str, label: str = "", *, multi: bool = False, include_all: bool = False,
              description: str = "") -> Variable:
    return Variable(name, "query", query, label or name, multi, include_all, description)


def custom_var(name: str, values: str, label: str = "", description: str = "") -> Variable:
    """A fixed list (comma-separated); the first value is the default."""
    return Variable(name, "custom", values, label or name, description=description)


def textbox_var(name: str, default: str = "", label: str = "", description: str = "") -> Variable:
    return Variable(name, "textbox", default, label or name, description=description)


def dashboard(uid: str, title: str, flavour: Flavour, slug: str, *rows: Row, variables: tuple[Variable, ...] = (),
              description: str = "", tags: tuple[str, ...] = (), time_from: str = "now-6h") -> Dashboard:
    return Dashboard(uid, title, flavour, slug, rows, variables, description, ("gpuledger", flavour, *tags), time_from)


# -- rendering ------------------------------------------------------------------------------------------------
def _ds(flavour: Flavour) -> dict[str, str]:
    return {"type": flavour, "uid": f"${{{DS_VAR}}}"}


def _target_json(t: Target, ref: str, flavour: Flavour) -> dict[str, Any]:
    if flavour == "prometheus":
        return {"datasource": _ds(flavour), "editorMode": "code", "expr": t.query, "format": t.fmt,
                "instant": t.instant, "legendFormat": t.legend or "__auto", "range": not t.instant, "refId": ref}
    out: dict[str, Any] = {"datasource": _ds(flavour), "query": t.query, "rawQuery": True,
                           "refId": ref, "resultFormat": t.fmt}
    if t.legend:
        out["alias"] = t.legend
    return out


def _field_defaults(p: Panel) -> dict[str, Any]:
    d: dict[str, Any] = {"unit": p.unit}
    for key in ("min", "max", "decimals"):
        if getattr(p, key) is not None:
            d[key] = getattr(p, key)
    if p.no_value is not None:
        d["noValue"] = p.no_value
    steps = [{"color": c, "value": v} for c, v in p.thresholds] or _GREEN
    d["thresholds"] = {"mode": "absolute", "steps": steps}
    if p.kind == "timeseries":
        d["color"] = {"mode": "palette-classic"}
        d["custom"] = {
            "drawStyle": "bars" if p.bars else "line", "lineWidth": 1, "showPoints": "never",
            "fillOpacity": 80 if p.bars else 25 if p.stack else 10,
            "spanNulls": False, "axisSoftMin": 0,
            "stacking": {"group": "A", "mode": "normal" if p.stack else "none"},
        }
    elif p.kind == "table":
        d["custom"] = {"align": "auto", "cellOptions": {"type": "auto"}, "filterable": True}
    else:
        d["color"] = {"mode": "thresholds" if p.thresholds else "palette-classic"}
    return d


def _options(p: Panel) -> dict[str, Any]:
    reduce = {"calcs": list(p.calcs), "fields": "", "values": False}
    if p.kind == "timeseries":
        return {"legend": {"calcs": ["mean", "max"], "displayMode": "table", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    if p.kind == "stat":
        return {"colorMode": "value", "graphMode": "area", "justifyMode": "auto", "orientation": "auto",
                "reduceOptions": reduce, "textMode": "auto", "showPercentChange": False, "wideLayout": True}
    if p.kind == "bargauge":
        return {"displayMode": "gradient", "orientation": "horizontal", "reduceOptions": reduce,
                "showUnfilled": True, "valueMode": "color", "namePlacement": "auto", "sizing": "auto",
                "minVizHeight": 16, "minVizWidth": 8, "maxVizHeight": 300}
    return {"cellHeight": "sm", "showHeader": True,
            "footer": {"countRows": False, "fields": "", "reducer": ["sum"], "show": False}}


def _panel_json(p: Panel, pid: int, x: int, y: int, flavour: Flavour) -> dict[str, Any]:
    refs = [chr(ord("A") + i) for i in range(len(p.targets))]
    out: dict[str, Any] = {
        "datasource": _ds(flavour),
        "description": p.description,
        "fieldConfig": {"defaults": _field_defaults(p), "overrides": []},
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "id": pid,
        "options": _options(p),
        "targets": [_target_json(t, r, flavour) for t, r in zip(p.targets, refs)],
        "title": p.title,
        "type": p.kind,
    }
    if p.time_from:
        out["timeFrom"] = p.time_from
    if p.transformations:
        out["transformations"] = [dict(t) for t in p.transformations]
    return out


def _variable_json(v: Variable, flavour: Flavour) -> dict[str, Any]:
    base: dict[str, Any] = {"name": v.name, "label": v.label, "description": v.description, "hide": 0,
                            "skipUrlSync": False, "type": v.kind}
    if v.kind == "query":
        base.update({
            "datasource": _ds(flavour), "definition": v.query, "query": v.query, "refresh": 2, "regex": "",
            "sort": 3 if v.name == "jobid" else 1, "multi": v.multi, "includeAll": v.include_all,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if v.include_all else {},
            "options": [],
        })
    elif v.kind == "custom":
        values = [s.strip() for s in v.query.split(",") if s.strip()]
        base.update({
            "query": v.query, "multi": False, "includeAll": False,
            "current": {"selected": True, "text": values[0], "value": values[0]},
            "options": [{"selected": i == 0, "text": s, "value": s} for i, s in enumerate(values)],
        })
    else:
        base.update({"query": v.query, "current": {"selected": False, "text": v.query, "value": v.query},
                     "options": [{"selected": True, "text": v.query, "value": v.query}]})
    return base


def _datasource_variable(flavour: Flavour) -> dict[str, Any]:
    return {"name": DS_VAR, "label": "Data source", "type": "datasource", "query": flavour, "hide": 0,
            "includeAll": False, "multi": False, "refresh": 1, "regex": "", "skipUrlSync": False,
            "current": {}, "options": []}


def render(d: Dashboard) -> dict[str, Any]:
    """Grafana dashboard JSON for ``d``; rows are expanded, panels packed into the grid row by row."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for r in d.rows:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "id": pid,
                       "panels": [], "title": r.title, "type": "row"})
        pid, y = pid + 1, y + 1
        x, line_h = 0, 0
        for p in r.panels:
            if not 1 <= p.width <= GRID_WIDTH:
                raise ValueError(f"{d.uid}: panel {p.title!r} width {p.width} outside 1..{GRID_WIDTH}")
            if x + p.width > GRID_WIDTH:
                x, y, line_h = 0, y + line_h, 0
            panels.append(_panel_json(p, pid, x, y, d.flavour))
            pid, x, line_h = pid + 1, x + p.width, max(line_h, p.height)
        y += line_h
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": d.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"asDropdown": True, "icon": "external link", "includeVars": False, "keepTime": True,
                   "tags": ["gpuledger", d.flavour], "targetBlank": False, "title": "gpuledger", "type": "dashboards"}],
        "panels": panels,
        "refresh": d.refresh,
        "schemaVersion": SCHEMA_VERSION,
        "tags": list(d.tags),
        "templating": {"list": [_datasource_variable(d.flavour)] + [_variable_json(v, d.flavour) for v in d.variables]},
        "time": {"from": d.time_from, "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
        "weekStart": "",
    }


def render_text(d: Dashboard) -> str:
    return json.dumps(render(d), indent=2, ensure_ascii=False) + "\n"


# Grafana provisioning (written as YAML next to the dashboards): data sources and file providers. URLs and the
# dashboards path are the defaults of a single-host install; docs/dashboards.md says what to change.
