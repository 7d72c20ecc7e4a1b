"""Every panel's query, interpolated as Grafana would, against a real InfluxDB 1.x and a real Prometheus
(Debian packages on free loopback ports) filled by a short demo run and a small live fleet: each returns data,
the GPU-state panels count correctly (a MIG GPU as its instances), every measurement, field, tag and metric named
exists in the server, a MIG GPU's power is one series, the Job dashboard's estimates follow the ledger for a job
with a share of a GPU and for one on a MIG slice, and the usage bars add up to the usage table.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dashboards_fleet import (
    DEVICES,
    EXPECTED_STATES,
    FLEET_JOBS,
    LOST_HOST,
    MIG_HOST,
    MIG_INDEX,
    MIG_JOB,
    SHARED_JOB,
    SHARES,
    EnrichingSink,
    LiveFleet,
)
from dashboards_grafana import (  # first: sys.path
    ROOT,
    Context,
    choose,
    custom_variables,
    empty_prom_targets,
    interpolate,
    job_stats_off_the_ledger,
    load,
    midnight,
    prom_state_counts,
    query_variables,
    targets,
)
from servers import InfluxServer, PrometheusServer
from typer.testing import CliRunner

from gpuledger.agent.push import HttpPusher
from gpuledger.agent.sources.simulated import gpu_uuid_for
from gpuledger.cli import app
from gpuledger.collector.server import FEED_NAME, CollectorServer
from gpuledger.collector.sinks.influx import InfluxSink
from gpuledger.collector.store import Store
from gpuledger.dashboards import influxdb_defs, lint
from gpuledger.dashboards.schema import INFLUX_SCHEMA
from gpuledger.demo import CONFIG_NAME, STORE_NAME, run_demo
from gpuledger.schema.records import JobRecord

pytestmark = [pytest.mark.influx, pytest.mark.timeout(180)]

INFLUX_FILES = sorted((ROOT / "gpuledger" / "dashboards" / "influxdb").glob("*.json"))
PROM_FILES = sorted((ROOT / "gpuledger" / "dashboards" / "prometheus").glob("*.json"))


@dataclass
class Stack:
    influx: InfluxServer
    prom: PrometheusServer
    fleet_started: float
    jobs: set[str]  # the demo's and the fleet's
    store: Store


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboards")
    with ExitStack() as es:
        influx = es.enter_context(InfluxServer(tmp / "influx"))
        sink = InfluxSink(influx.url, api="v1", database=influx.db, flush_interval_s=0.2)
        es.callback(sink.close)
        data = tmp / "data"
        demo = run_demo(data, nodes=2, gpus_per_node=4, hours=0.2, step_s=10, seed=0, extra_sinks=[EnrichingSink(sink)],
                        end=time.time())  # in the panels' last-15-minutes window
        # The accounting measurements come from the product's own commands, configured like a site would.
        with (data / CONFIG_NAME).open("a") as f:
            f.write(f'\n[collector]\ninflux_url = "{influx.url}"\ninflux_api = "v1"\ninflux_database = "{influx.db}"\n')
        for argv in (["report", "usage", "--influx"], ["priority", "feed"]):
            r = CliRunner().invoke(app, [*argv, "--data-dir", str(data)])
            assert r.exit_code == 0 and "written to InfluxDB" in r.stderr, r.output
        # the fleet's samples reach InfluxDB as a site's do: the collector hands its sink what it accepted, and its
        # jobs' running totals every second (so a job has several in the Accounting panels' range)
        store = Store(data / STORE_NAME, sinks=[sink], summary_interval_s=1.0)
        store.put_jobs([JobRecord(j, cluster="live", user="carol", account="chemistry") for j in sorted(FLEET_JOBS)])
        es.callback(store.close)
        store.compact()  # as the collector's compactor does (the "Since the last compaction" panel)

        # the accounting dashboard's per-user panels: a site that publishes user names on /metrics
        collector = CollectorServer(store, priority_feed=data / FEED_NAME, metrics_user_labels=True).start()
        es.callback(collector.stop)
        fleet = LiveFleet(collector.url).start()
        es.callback(fleet.close)
        started = time.time()
        prom = es.enter_context(PrometheusServer(tmp / "prom", {
            "agents": fleet.addresses, "collector": [collector.url.removeprefix("http://")]}))
        prom.wait_for("count(up == 1) == 4")
        prom.wait_for("count(count_over_time(gpuledger_gpu_power_watts[1m]) >= 4) == 10")  # rates need points
        # A replayed snapshot: the collector rejects its samples as duplicates (the "rejected" series).
        replay = HttpPusher(f"{collector.url}/api/v1/samples", agent_id="dash-replay", host="live01")
        replay.write(fleet.agents["live01"].snapshot)
        replay.close()
        fleet.stop_host(LOST_HOST)
        prom.wait_for("count(up == 0) == 1")
        prom.wait_for("count_over_time(gpuledger_collector_samples_rejected_total[1m]) >= 3")
        assert fleet.errors() == {}
        assert sink.flush() and sink.stats.rejected_lines == sink.stats.dropped_lines == 0, sink.stats
        yield Stack(influx, prom, started, set(demo.usage) | FLEET_JOBS, store)


# -- Prometheus ---------------------------------------------------------------------------------------------
def _prom_context(stack: Stack) -> Context:
    end = time.time()
    return Context(start=stack.fleet_started - 5, end=end, interval_s=1, scrape_s=1)


@pytest.mark.parametrize("path", PROM_FILES, ids=lambda p: p.stem)
def test_prometheus_panels_return_data(stack: Stack, path: Path) -> None:
    assert empty_prom_targets(stack.prom, load(path), _prom_context(stack), SHARED_JOB) == []


def test_prometheus_state_panels_count_each_state(stack: Stack) -> None:
    assert prom_state_counts(stack.prom, _prom_context(stack)) == EXPECTED_STATES


def test_prometheus_a_mig_gpu_has_one_power_series(stack: Stack) -> None:
    uuid = gpu_uuid_for(MIG_HOST, MIG_INDEX)
    for metric in ("gpuledger_gpu_power_watts", "gpuledger_gpu_energy_joules_total"):
        series = stack.prom.query(f'{metric}{{uuid="{uuid}"}}')["result"]
        assert [s["metric"].get("mig", "") for s in series] == [""], metric  # the whole GPU's (agent /metrics)
    shares = stack.prom.query(f'gpuledger_gpu_job_share_ratio{{jobid="{MIG_JOB}"}}')["result"]
    assert [(s["metric"]["mig"], float(s["value"][1])) for s in shares] == [("1", pytest.approx(3 / 7))]


def test_prometheus_job_estimates_follow_the_ledger_for_shares_and_mig_slices(stack: Stack) -> None:
    charged = {SHARED_JOB: 1.0 + SHARES[SHARED_JOB], "3004": SHARES["3004"], MIG_JOB: 3 / 7}
    assert job_stats_off_the_ledger(stack.prom, stack.store, charged, span_s=10.0) == {}


def test_prometheus_metrics_named_exist(stack: Stack) -> None:
    stored = stack.prom.metric_names()
    named = {m for path in PROM_FILES for q in targets(load(path)) for m in lint.prom_metrics(q.text)}
    assert named - stored == set()
    assert "gpuledger_gpu_sm_active_ratio" in named and "gpuledger_fairshare_ratio" in named
    assert "gpuledger_gpu_sm_util" not in stored  # a misnamed metric would be caught


# -- InfluxDB -----------------------------------------------------------------------------------------------
def _influx_context() -> Context:
    end = time.time()
    return Context(start=end - 15 * 60, end=end, interval_s=10)


def _influx_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    return [row for r in results for s in r.get("series", []) for row in s.get("values", [])]


def _influx_variable_values(stack: Stack, doc: dict[str, Any], ctx: Context) -> None:
    for v in query_variables(doc):
        q = interpolate(v["query"], "influxdb", ctx)
        values = sorted({row[1] for row in _influx_rows(stack.influx.query(q))})
        assert values, f"variable ${v['name']}: {q} found nothing"
        if v["name"] == "jobid":
            assert set(values) <= stack.jobs
        choose(ctx, v, values)
    custom_variables(doc, ctx)


@pytest.mark.parametrize("path", INFLUX_FILES, ids=lambda p: p.stem)
def test_influx_panels_return_data(stack: Stack, path: Path) -> None:
    doc = load(path)
    ctx = _influx_context()
    _influx_variable_values(stack, doc, ctx)
    empty = []
    for q in targets(doc):
        text = interpolate(q.text, "influxdb", ctx.for_panel(q.time_from, midnight(ctx.end)))
        rows = _influx_rows(stack.influx.query(text))
        if not any(v is not None for row in rows for v in row[1:]):
            empty.append(f"{q.where}: {text}")
    assert empty == []


def test_influx_state_panels_count_each_state(stack: Stack) -> None:
    # The demo's GPUs are in the "now" window too, so the live fleet's states are lower bounds, except "lost".
    ctx = _influx_context()
    ctx.values["idle"] = ["0.05"]
    got = {}
    for state, q in influxdb_defs.STATE_QUERIES.items():
        rows = _influx_rows(stack.influx.query(interpolate(q, "influxdb", ctx)))
        got[state] = int(rows[0][1]) if rows else 0
    assert got["lost"] == EXPECTED_STATES["lost"]
    for state in ("busy", "allocated-idle", "free"):
        assert got[state] >= EXPECTED_STATES[state], got
    assert sum(got.values()) == 2 * 4 + DEVICES  # the demo's 8 GPUs and the fleet's devices: each in one state


def test_influx_a_mig_gpu_has_its_readings_once_and_is_no_device(stack: Stack) -> None:
    uuid = gpu_uuid_for(MIG_HOST, MIG_INDEX)
    (res,) = stack.influx.query(f'SELECT count("power_watts") AS "power", count("energy_joules") AS "energy", '
                                f'count("jobs") AS "jobs" FROM "gpu" WHERE "uuid" = \'{uuid}\' GROUP BY "mig"')
    got = {s["tags"]["mig"]: dict(zip(s["columns"][1:], s["values"][0][1:])) for s in res["series"]}
    assert set(got) == {"", "1", "2"}
    # (a count of no point is null)
    assert got[""]["power"] > 0 and got[""]["energy"] > 0 and not got[""]["jobs"]  # no device: its instances are
    assert all(not got[m]["power"] and not got[m]["energy"] and got[m]["jobs"] > 0 for m in ("1", "2"))


def test_influx_usage_bars_add_up_to_the_usage_table(stack: Stack) -> None:
    doc = load(ROOT / "gpuledger" / "dashboards" / "influxdb" / "accounting.json")
    ctx = _influx_context()
    _influx_variable_values(stack, doc, ctx)
    queries = {q.where.split(" / ")[1]: interpolate(q.text, "influxdb", ctx) for q in targets(doc)}

    def totals() -> dict[str, float]:
        table = stack.influx.query(queries["Usage by account and user"])[0]["series"]
        return {c: sum(dict(zip(s["columns"], s["values"][0]))[c] for s in table) for c in ("gpu_hours", "energy_kwh")}

    # the live fleet's usage summaries keep arriving (every second): compare bars with a table read on both sides
    # of them and unchanged, so that both saw the same data
    for _ in range(20):
        total = totals()
        bars = {title: sum(row[1] or 0.0 for row in _influx_rows(stack.influx.query(queries[title])))
                for title in ("GPU-hours by account", "GPU-hours by user", "Energy by account")}
        if totals() == total:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the usage table changed during every one of 20 reads")
    assert total["gpu_hours"] > 0
    for title, column in (("GPU-hours by account", "gpu_hours"), ("GPU-hours by user", "gpu_hours"),
                          ("Energy by account", "energy_kwh")):
        assert bars[title] == pytest.approx(total[column], rel=1e-9), title


def _missing_influx_names(stack: Stack, queries: list[str]) -> list[str]:
    """Measurements, fields and tags the queries name that the server does not hold."""
    measurements = {row[0] for row in _influx_rows(stack.influx.query("SHOW MEASUREMENTS"))}
    missing = []
    for text in queries:
        named = lint.influx_measurements(text)
        missing += [f"measurement {m!r}" for m in sorted(named - measurements)]
        known: set[str] = set()
        for m in named & measurements:
            known |= {row[0] for row in _influx_rows(stack.influx.query(f'SHOW FIELD KEYS FROM "{m}"'))}
            known |= {row[0] for row in _influx_rows(stack.influx.query(f'SHOW TAG KEYS FROM "{m}"'))}
        idents = lint.influx_identifiers(text) - named - lint.influx_aliases(text)
        missing += [f"{i!r} in {text}" for i in sorted(idents - known)]
    return missing


def test_influx_names_exist(stack: Stack) -> None:
    measurements = {row[0] for row in _influx_rows(stack.influx.query("SHOW MEASUREMENTS"))}
    assert measurements == set(INFLUX_SCHEMA)
    queries = [q for path in INFLUX_FILES for doc in [load(path)]
               for q in [t.text for t in targets(doc)] + [v["query"] for v in query_variables(doc)]]
    assert _missing_influx_names(stack, queries) == []
    # ... and the check does see a name the collector does not write
    bogus = ['SELECT mean("sm_util") FROM "gpu"', 'SELECT last("x") FROM "gpus"']
    assert _missing_influx_names(stack, bogus) == [f"'sm_util' in {bogus[0]}", "measurement 'gpus'",
                                                   f"'x' in {bogus[1]}"]
