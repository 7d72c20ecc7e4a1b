"""The committed dashboards: current with the code, structurally valid, and naming only what gpuledger produces."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from dashboards_grafana import ROOT, load, targets, validate  # first: puts the repository root on sys.path

from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.dashboards import build, lint
from gpuledger.dashboards.schema import AGENT_GPU_METRICS, COLLECTOR_METRICS, INFLUX_SCHEMA
from gpuledger.schema.records import SAMPLE_FIELDS

DASH_DIR = ROOT / "gpuledger" / "dashboards"
FILES = sorted(p for f in build.FLAVOURS for p in (DASH_DIR / f).glob("*.json"))
EXPECTED = {f"{f}/{n}.json" for f in build.FLAVOURS for n in ("cluster-overview", "node-gpu", "job", "accounting")}


def test_committed_json_is_current() -> None:
    assert build.stale() == [], "run: python -m gpuledger.dashboards.build"


def test_check_command_detects_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "dash"
    shutil.copytree(DASH_DIR, out, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cmd = [sys.executable, str(DASH_DIR / "build.py"), "--check", "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True, cwd=tmp_path).returncode == 0
    doc = load(out / "prometheus" / "job.json")
    doc["panels"][1]["title"] = "hand-edited"
    (out / "prometheus" / "job.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "influxdb" / "left-over.json").write_text("{}")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "prometheus/job.json" in r.stderr and "left-over.json" in r.stderr


def test_every_dashboard_loads_and_validates() -> None:
    assert {f"{p.parent.name}/{p.name}" for p in FILES} == EXPECTED
    uids = set()
    for path in FILES:
        doc = load(path)
        assert validate(doc) == [], path
        assert doc["uid"] not in uids
        uids.add(doc["uid"])
        assert doc["templating"]["list"][0]["query"] == path.parent.name  # ${ds} of the folder's flavour
        assert sum(1 for _ in targets(doc)) >= 4, path


def test_validate_catches_broken_dashboards() -> None:
    good = load(DASH_DIR / "influxdb" / "cluster-overview.json")
    cases = {
        "panel ids not unique": lambda d: d["panels"][2].update(id=d["panels"][1]["id"]),
        "overlaps": lambda d: d["panels"][2].update(gridPos=dict(d["panels"][1]["gridPos"])),
        "outside the grid": lambda d: d["panels"][1]["gridPos"].update(x=22, w=4),
        "data source is not": lambda d: d["panels"][1].update(datasource={"type": "influxdb", "uid": "abc"}),
        "no targets": lambda d: d["panels"][1].update(targets=[]),
        "undefined variable $nosuch": lambda d: d["panels"][1]["targets"][0].update(query="SELECT $nosuch"),
        "no data-source variable": lambda d: d["templating"].update(list=d["templating"]["list"][1:]),
    }
    for needle, mutate in cases.items():
        doc = copy.deepcopy(good)
        mutate(doc)
        assert any(needle in p for p in validate(doc)), needle


def test_queries_name_only_what_the_collector_and_agent_produce() -> None:
    # From the committed JSON, as Grafana would see it.
    problems = []
    for path in FILES:
        doc = load(path)
        check = lint.check_promql if path.parent.name == "prometheus" else lint.check_influxql
        for q in targets(doc):
            problems += [f"{q.where}: {p}" for p in check(q.text)]
    assert problems == []
    assert [p for d in build.all_dashboards() for p in lint.check(d)] == []  # and variables


def test_lint_rejects_unknown_names() -> None:
    assert lint.check_influxql('SELECT mean("sm_util") FROM "gpu" WHERE $timeFilter') == [
        "'sm_util' is no field or tag of ['gpu']"]
    assert "unknown measurement 'gpus'" in lint.check_influxql('SELECT mean("power_watts") FROM "gpus"')
    assert "unquoted measurement 'gpu'" in lint.check_influxql('SELECT mean("power_watts") FROM gpu')
    assert lint.check_influxql('SELECT mean("host") FROM "gpu"') == ["tag 'host' used as a field"]
    assert lint.check_influxql('SELECT sum("energy_joules") / 3.6e6 FROM "gpu"') == [
        "exponent notation (InfluxQL 1.x cannot parse 3.6e6)"]
    assert lint.check_influxql('SELECT last("jobid") FROM "gpu"') == ["'jobid' is no field or tag of ['gpu']"]
    assert lint.check_promql('sum by (hots) (gpuledger_gpu_power_watt)') == [
        "unknown metric 'gpuledger_gpu_power_watt'", "unknown label 'hots'"]
    assert lint.check_promql('rate(gpuledger_gpu_energy_joules[5m])') == [
        "unknown metric 'gpuledger_gpu_energy_joules'"]
    assert lint.check_promql('gpuledger_gpu_job_info{job="1"} and on(host, uuid, mig) vector(1)') == []


def test_prometheus_metric_extraction() -> None:
    expr = ('topk(10, count by (jobid) (gpuledger_gpu_job_info{host=~"$host"} and on(host, uuid, mig) '
            '((gpuledger_gpu_sm_active_ratio or gpuledger_gpu_utilization_ratio) < $idle))) '
            '* $__interval_ms / 3.6e6 + rate(gpuledger_gpu_energy_joules_total[$__rate_interval])')
    assert lint.prom_metrics(expr) == {"gpuledger_gpu_job_info", "gpuledger_gpu_sm_active_ratio",
                                       "gpuledger_gpu_utilization_ratio", "gpuledger_gpu_energy_joules_total"}
    assert lint.prom_labels(expr) == {"host", "jobid", "uuid", "mig"}


def test_schema_constants_match_the_code(tmp_path: Path) -> None:
    # gpu fields are GpuSample's, plus the two derived counts.
    assert INFLUX_SCHEMA["gpu"][1] - {"xid_errors", "jobs"} <= set(SAMPLE_FIELDS)
    # every GpuSample float/int measurement the agent exports is on the gpu measurement too
    from gpuledger.agent.exposition import GPU_METRICS

    assert {attr for _, attr, _, _ in GPU_METRICS} <= INFLUX_SCHEMA["gpu"][1]
    assert "gpuledger_gpu_energy_joules_total" in AGENT_GPU_METRICS
    # The collector's /metrics, with a priority feed present and the ledger compacted once, exports every name the
    # schema lists.
    feed = tmp_path / "priority-feed.json"
    feed.write_text(json.dumps({"generated_at": 1.0, "associations": [
        {"account": "a", "user": "u", "fairshare": 0.5, "site_factor": 5000}]}))
    store = Store(tmp_path / "s.sqlite")
    try:
        store.compact()
        server = CollectorServer(store, priority_feed=feed).start()
        names = set()
        for fam in server.metrics.registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(fam.type, [""])
            names.update(fam.name + s for s in suffixes)
        server.stop()
    finally:
        store.close()
    assert COLLECTOR_METRICS <= names, COLLECTOR_METRICS - names


def test_schema_lists_every_gpu_series_the_agent_exports() -> None:
    """Every gpuledger_gpu_* series on an agent's /metrics (a sample with every field, jobs with shares, Xid errors)
    is in the schema the dashboards are held to; the Xid counter is the agents' alone."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuledger.agent.exposition import make_registry
    from gpuledger.dashboards.schema import AGENT_ONLY_GPU_METRICS, PROMETHEUS_METRICS, SHIPPED_METRICS
    from gpuledger.schema.records import RATIO_FIELDS, GpuSample

    class Agent:
        snapshot = [GpuSample(ts=1.0, host="n1", gpu_uuid="GPU-1", gpu_index=0, model="m", job_ids=("7", "8"),
                              job_shares=(0.5, 0.5), mem_used_bytes=1, mem_total_bytes=2, power_watts=1.0,
                              power_limit_watts=2.0, energy_joules=3.0, temp_celsius=4.0, sm_clock_hz=5.0,
                              mem_clock_hz=6.0, pcie_tx_bytes_per_second=7.0, pcie_rx_bytes_per_second=8.0,
                              throttle_reasons=0, ecc_errors_total=0, remapped_rows_total=0,
                              **dict.fromkeys(RATIO_FIELDS, 0.5))]
        xid_errors_total = {("n1", 0, "GPU-1", ""): 3}

    exported = {s.name for fam in text_string_to_metric_families(generate_latest(make_registry(Agent())).decode())
                for s in fam.samples if s.name.startswith("gpuledger_gpu_")}
    assert exported == SHIPPED_METRICS | AGENT_ONLY_GPU_METRICS
    assert exported <= PROMETHEUS_METRICS and AGENT_ONLY_GPU_METRICS == {"gpuledger_gpu_xid_errors_total"}


def test_provisioning_files() -> None:
    ds = build.PROVISIONING["datasources/gpuledger.yaml"]["datasources"]
    assert {d["type"] for d in ds} == set(build.FLAVOURS)  # Prometheus' flavour: Prometheus or VictoriaMetrics
    assert "http://localhost:8428" in {d["url"] for d in ds if d["type"] == "prometheus"}
    assert len({d["uid"] for d in ds}) == len(ds)
    providers = build.PROVISIONING["dashboards/gpuledger.yaml"]["providers"]
    assert sorted(p["options"]["path"].rsplit("/", 1)[1] for p in providers) == sorted(build.FLAVOURS)
    for name in build.PROVISIONING:
        text = (DASH_DIR / "provisioning" / name).read_text()
        assert text.startswith("# Generated") and "apiVersion: 1\n" in text
    # the emitter writes YAML a YAML reader agrees with (checked on a value of every kind)
    assert build.to_yaml({"a": [{"b": True, "c": 1.5}, "x"],
                          "d": {}}) == 'a:\n  - b: true\n    c: 1.5\n  - "x"\nd: {}\n'


def _parse_line(ln: str) -> tuple[str, set[str], set[str]]:
    """(measurement, tag keys, field keys) of one line-protocol line (no escaped separators in our keys)."""
    head, body, _ts = ln.rsplit(" ", 2)
    measurement, *tag_pairs = head.split(",")
    return measurement, {t.split("=", 1)[0] for t in tag_pairs}, {f.split("=", 1)[0] for f in body.split(",")}


def test_schema_constants_match_what_the_influx_sink_writes() -> None:
    from gpuledger.collector.sinks.influx import fairshare_lines, job_usage_lines, sample_lines
    from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

    full = {f: 0.5 for f in INFLUX_SCHEMA["gpu"][1] - {"xid_errors", "jobs", "mem_used_bytes", "mem_total_bytes",
                                                        "throttle_reasons", "ecc_errors_total", "remapped_rows_total"}}
    ints = dict(mem_used_bytes=1, mem_total_bytes=2, throttle_reasons=0, ecc_errors_total=0, remapped_rows_total=0)
    mig = GpuSample(ts=1.0, host="h", gpu_uuid="GPU-1", gpu_index=0, model="m", mig="1", job_ids=("7",),
                    xid_errors=(13,), **full, **ints)
    lines = sample_lines([replace(mig, mig=None, job_ids=()), mig])  # a MIG GPU's own row holds its readings
    lines += job_usage_lines([JobUsage("7", "h", "*", 0.0, 1.0, 2, 10.0, 5.0, 100.0, 0.5, 0.4)],
                             {"7": JobRecord("7", cluster="c", user="u", account="a", partition="p")})
    lines += fairshare_lines([{"account": "a", "user": "u", "fairshare": 0.5, "site_factor": 5000,
                               "effective_usage": 0.1, "raw_usage": 3.0}], 1.0)
    written: dict[str, tuple[set[str], set[str]]] = {}
    for ln in lines:
        m, t, f = _parse_line(ln)
        tags, fields = written.setdefault(m, (set(), set()))
        tags |= t
        fields |= f
    assert {m: (frozenset(t), frozenset(f)) for m, (t, f) in written.items()} == INFLUX_SCHEMA
