"""Static checks of dashboard queries against the names the collector and agent produce (:mod:`dashboards.schema`).

Conventions the generated queries follow (and these checks rely on): InfluxQL quotes every identifier with
double quotes and every string with single quotes; PromQL names metrics literally (no ``{__name__=~...}``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpuledger.agent.exposition import GPU_LABELS, JOB_LABELS
from gpuledger.dashboards.grafana import Dashboard
from gpuledger.dashboards.schema import INFLUX_SCHEMA, PROMETHEUS_METRICS

PROM_LABELS: frozenset[str] = frozenset(
    {*GPU_LABELS, *JOB_LABELS, "account", "user", "reason", "kind", "status", "le", "instance", "job"}
)
_PROM_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                            "offset", "bool", "inf", "nan"})
_GRAFANA_VAR = re.compile(r"\$\{\w+(?::\w+)?\}|\$\w+")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SQ_STRING = re.compile(r"'(?:[^'\\]|\\.)*'")  # InfluxQL: strings are single-quoted, identifiers double-quoted
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")


def _strip(expr: str) -> str:
    return _GRAFANA_VAR.sub("0", expr)


def prom_labels(expr: str) -> set[str]:
    """Label names in matchers and in by/without/on/ignoring/group_* lists."""
    e = _STRING.sub('""', _strip(expr))
    out: set[str] = set()
    for block in re.findall(r"\{([^}]*)\}", e):
        out.update(m.group(1) for m in re.finditer(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", block))
    for block in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", e):
        out.update(s.strip() for s in block.split(",") if s.strip())
    return out


def prom_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression selects."""
    e = _STRING.sub('""', _strip(expr))
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group(0)
        if word.lower() in _PROM_KEYWORDS or re.match(r"\s*\(", e[m.end():]):
            continue  # a keyword or a function/aggregation call
        names.add(word)
    return names


def influx_measurements(q: str) -> set[str]:
    return set(re.findall(r'\bFROM\s+"(\w+)"', _SQ_STRING.sub("''", q), flags=re.I))


def influx_identifiers(q: str) -> set[str]:
    """Every double-quoted identifier (fields, tags, aliases, measurements)."""
    return set(re.findall(r'"(\w+)"', _SQ_STRING.sub("''", q)))


def influx_aliases(q: str) -> set[str]:
    return set(re.findall(r'\bAS\s+"(\w+)"', q, flags=re.I))


def influx_function_args(q: str) -> set[str]:
    """Identifiers passed to a function (these must be fields or aliases, never tags)."""
    return set(re.findall(r'\b\w+\(\s*"(\w+)"', _SQ_STRING.sub("''", q)))


def check_influxql(q: str) -> list[str]:
    problems = []
    bare = re.findall(r"\bFROM\s+(?![\"(])(\S+)", q, flags=re.I)
    problems += [f"unquoted measurement {b!r}" for b in bare]
    if re.search(r"(?<![\w.])\d+(?:\.\d+)?[eE][+-]?\d", _SQ_STRING.sub("''", q)):
        problems.append("exponent notation (InfluxQL 1.x cannot parse 3.6e6)")
    measurements = influx_measurements(q)
    if not measurements and not q.upper().startswith("SHOW"):
        problems.append("no measurement")
    unknown = measurements - INFLUX_SCHEMA.keys()
    problems += [f"unknown measurement {m!r}" for m in sorted(unknown)]
    tags = {t for m in measurements & INFLUX_SCHEMA.keys() for t in INFLUX_SCHEMA[m][0]}
    fields = {f for m in measurements & INFLUX_SCHEMA.keys() for f in INFLUX_SCHEMA[m][1]}
    aliases = influx_aliases(q)
    for ident in sorted(influx_identifiers(q) - measurements - aliases):
        if ident not in tags | fields:
            problems.append(f"{ident!r} is no field or tag of {sorted(measurements)}")
    for arg in sorted(influx_function_args(q) - aliases):
        if arg in tags and arg not in fields:
            problems.append(f"tag {arg!r} used as a field")
    return problems


def check_promql(expr: str) -> list[str]:
    problems = [f"unknown metric {m!r}" for m in sorted(prom_metrics(expr) - PROMETHEUS_METRICS)]
    problems += [f"unknown label {lb!r}" for lb in sorted(prom_labels(expr) - PROM_LABELS)]
    if not prom_metrics(expr) and not expr.startswith("label_values"):
        problems.append("selects no metric")
    return problems


def queries(d: Dashboard) -> Iterable[tuple[str, str]]:
    """(where, query) for every panel target and query variable."""
    for p in d.panels():
        for i, t in enumerate(p.targets):
            yield f"{d.uid} / {p.title} / {chr(65 + i)}", t.query
    for v in d.variables:
        if v.kind == "query":
            yield f"{d.uid} / ${v.name}", v.query


def check(d: Dashboard) -> list[str]:
    """Every problem in a dashboard's queries, each prefixed with where it is."""
    out = []
    for where, q in queries(d):
        if d.flavour == "prometheus":
            m = re.fullmatch(r"label_values\((?:(.+),\s*)?(\w+)\)", q)
            found = (check_promql(m.group(1)) if m.group(1) else []) + (
                [] if m.group(2) in PROM_LABELS else [f"unknown label {m.group(2)!r}"]) if m else check_promql(q)
        else:
            found = check_influxql(q)
        out += [f"{where}: {p}" for p in found]
    return out
