"""The Prometheus-flavour dashboards read VictoriaMetrics directly: a live fleet pushes to a collector whose
``series_url`` ships every sample to a real VictoriaMetrics, which scrapes the collector's and the agents' own
metrics with contrib/victoriametrics/scrape.yml. Every panel's query, interpolated as Grafana would, returns data
there (but the agents' Xid counter, which the collector does not ship), the GPU-state panels count the fleet
exactly (no GPU series twice, a MIG GPU as its instances), a MIG GPU's power and energy are one series each, and
the Job dashboard's estimates follow the ledger for a job with a share of a GPU and for one on a MIG slice."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from dashboards_fleet import (
    EXPECTED_STATES,
    LOST_HOST,
    LOST_LAG_S,
    MIG_HOST,
    MIG_INDEX,
    MIG_JOB,
    SHARED_JOB,
    SHARES,
    LiveFleet,
)
from dashboards_grafana import (  # first: sys.path
    ROOT,
    Context,
    empty_prom_targets,
    job_stats_off_the_ledger,
    load,
    prom_state_counts,
)
from servers import VictoriaMetricsServer, free_port

from gpuledger.agent.push import HttpPusher
from gpuledger.agent.sources.simulated import gpu_uuid_for
from gpuledger.collector.series_outbox import RemoteSeries, local_retention
from gpuledger.collector.server import FEED_NAME, CollectorServer
from gpuledger.collector.store import Store
from gpuledger.dashboards.schema import AGENT_ONLY_GPU_METRICS

pytestmark = [pytest.mark.influx, pytest.mark.timeout(180)]

PROM_FILES = sorted((ROOT / "gpuledger" / "dashboards" / "prometheus").glob("*.json"))
SCRAPE = ROOT / "contrib" / "victoriametrics" / "scrape.yml"


@dataclass
class Stack:
    vm: VictoriaMetricsServer
    fleet_started: float
    store: Store


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboards-vm")
    with ExitStack() as es:
        vm_port = free_port()
        (tmp / FEED_NAME).write_text(json.dumps({"generated_at": time.time(), "associations": [
            {"account": "physics", "user": "ada", "fairshare": 0.5, "site_factor": 5000},
            {"account": "physics", "user": "bob", "fairshare": 0.25, "site_factor": 2500}]}))
        store = Store(tmp / "gpuledger.sqlite", series_outbox=True, retention=local_retention(600.0))
        es.callback(store.close)
        store.compact()  # as the collector's compactor does (the "Since the last compaction" panel)
        remote = RemoteSeries(store.series_store, f"http://127.0.0.1:{vm_port}", interval_s=0.2,
                                       backoff_s=0.1, backoff_max_s=0.5)
        es.callback(remote.close)
        collector = CollectorServer(store, priority_feed=tmp / FEED_NAME, metrics_user_labels=True,
                                    series=remote.reader).start()
        collector.metrics.registry.register(remote.metrics)
        es.callback(collector.stop)
        fleet = LiveFleet(collector.url).start()
        es.callback(fleet.close)
        started = time.time()
        # the site's scrape configuration, with this test's targets, a 1 s interval and the port kept in
        # "instance" (the agents here share one address)
        agents = tmp / "agents.yml"
        agents.write_text("- targets: " + json.dumps(fleet.addresses) + "\n")
        config = SCRAPE.read_text()
        for site, here in (("/etc/victoria-metrics/gpuledger-agents.yml", str(agents)),
                           ("gpuledger.example.org:8470", collector.url.removeprefix("http://")),
                           ("scrape_interval: 15s", "scrape_interval: 1s"),
                           ("scrape_interval: 10s", "scrape_interval: 1s"),
                           ("scrape_timeout: 5s", "scrape_timeout: 1s"),
                           ('regex: "([^:]+)(?::\\\\d+)?"', 'regex: "(.+)"')):
            assert site in config, site
            config = config.replace(site, here)
        (tmp / "scrape.yml").write_text(config)
        vm = es.enter_context(VictoriaMetricsServer(tmp / "vm", port=vm_port, flags=(
            "-dedup.minScrapeInterval=1ms", f"-promscrape.config={tmp / 'scrape.yml'}")))
        vm.wait_for("count(up == 1) == 4", timeout=30)
        vm.wait_for("count(count_over_time(gpuledger_gpu_power_watts[1m]) >= 4) == 8", timeout=30)
        # A replayed snapshot: the collector rejects its samples as duplicates (the "rejected" series).
        replay = HttpPusher(f"{collector.url}/api/v1/samples", agent_id="dash-replay", host="live01")
        replay.write(fleet.agents["live01"].snapshot)
        replay.close()
        fleet.stop_host(LOST_HOST)
        vm.wait_for("count(up == 0) == 1", timeout=30)
        vm.wait_for("count_over_time(gpuledger_collector_samples_rejected_total[1m]) >= 3", timeout=30)
        assert fleet.errors() == {}
        assert remote.shipper.stats.failures == 0 or remote.shipper.stats.failing_since is None
        yield Stack(vm, started, store)


def _context(stack: Stack) -> Context:
    # The lost host's clock runs LOST_LAG_S behind: its samples are that old in VictoriaMetrics (pushed, not
    # scraped), so the range reaches back to them.
    return Context(start=stack.fleet_started - LOST_LAG_S - 30, end=time.time(), interval_s=1, scrape_s=1)


@pytest.mark.parametrize("path", PROM_FILES, ids=lambda p: p.stem)
def test_prometheus_panels_return_data_from_victoriametrics(stack: Stack, path: Path) -> None:
    # the Xid panel reads the agents' counter, which the collector does not ship: scrape.yml keeps it
    assert empty_prom_targets(stack.vm, load(path), _context(stack), SHARED_JOB) == []


def test_a_mig_gpu_has_one_power_and_one_energy_series(stack: Stack) -> None:
    uuid = gpu_uuid_for(MIG_HOST, MIG_INDEX)
    for metric in ("gpuledger_gpu_power_watts", "gpuledger_gpu_energy_joules_total", "gpuledger_gpu_power_limit_watts"):
        series = stack.vm.api("/api/v1/series", **{"match[]": f'{metric}{{uuid="{uuid}"}}'})
        assert [s.get("mig", "") for s in series] == [""], metric  # the whole GPU's, none on its instances
    shares = stack.vm.query(f'gpuledger_gpu_job_share_ratio{{jobid="{MIG_JOB}"}}')["result"]
    assert [(s["metric"]["mig"], float(s["value"][1])) for s in shares] == [("1", pytest.approx(3 / 7))]


def test_job_estimates_follow_the_ledger_for_shares_and_mig_slices(stack: Stack) -> None:
    charged = {SHARED_JOB: 1.0 + SHARES[SHARED_JOB], "3004": SHARES["3004"], MIG_JOB: 3 / 7}
    assert job_stats_off_the_ledger(stack.vm, stack.store, charged, span_s=10.0) == {}


def test_state_panels_count_each_state_once(stack: Stack) -> None:
    assert prom_state_counts(stack.vm, _context(stack)) == EXPECTED_STATES
    # the agents' GPU series were dropped at scrape: the collector's are the only ones
    assert {s["job"] for s in stack.vm.api("/api/v1/series", **{"match[]": "up"})} == {
        "gpuledger-agent", "gpuledger-collector"}
    assert not stack.vm.api("/api/v1/series", **{"match[]": 'gpuledger_gpu_power_watts{job!=""}'})
    # but for the agents' own Xid counters (the collector ships none), without the mark that kept them
    xid = stack.vm.api("/api/v1/series", **{"match[]": "gpuledger_gpu_xid_errors_total"})
    assert xid and {s["job"] for s in xid} == {"gpuledger-agent"} and not any("__tmp_keep" in s for s in xid)
    assert {tuple(sorted(AGENT_ONLY_GPU_METRICS))} == {("gpuledger_gpu_xid_errors_total",)}
