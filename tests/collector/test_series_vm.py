"""Series in VictoriaMetrics (``series_url``) against the real server (Debian's victoria-metrics, loopback, free
ports): collectors serving real HTTP ingest batches; the samples land in VictoriaMetrics exactly; GET /api/v1/series
answers from there with the points a collector without series_url gives; a collector killed before shipping loses
nothing; VictoriaMetrics down leaves ingest and the ledger untouched and shipping resumes."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from series_cases import (
    NOW,
    Collector,
    H,
    assert_series_api_matches_local,
    assert_shipping_fails,
    assert_shipping_resumed,
    batches,
    fleet,
    killed_collector_ships_after_restart,
    stored,
)
from servers import VictoriaMetricsServer, free_port  # tests/servers.py: the shared harness

from gpuledger.agent.exposition import GPU_SERIES, JOB_INFO, JOB_SHARE, JOBS
from gpuledger.agent.mig import GPU_READINGS, MigEnergySplitter
from gpuledger.collector.aggregate import Aggregator
from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.db import open_database
from gpuledger.collector.series_outbox import (
    SHIP_SLOTS,
    OutboxSeriesStore,
    RemoteSeries,
    SeriesShipper,
    local_retention,
)
from gpuledger.collector.series_store import ChunkSeriesStore, Retention
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.validate import parse_batch
from gpuledger.collector.victoriametrics import VictoriaMetrics, import_body
from gpuledger.schema.records import GpuSample
from gpuledger.schema.wire import to_series

pytestmark = [pytest.mark.influx, pytest.mark.timeout(240)]

DEDUP = ("-dedup.minScrapeInterval=1ms",)  # what docs/deploy.md asks of a site's VictoriaMetrics


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VictoriaMetricsServer]:
    with VictoriaMetricsServer(tmp_path_factory.mktemp("vm"), flags=DEDUP) as server:
        yield server


def vm_points(vm: VictoriaMetricsServer, host: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], dict[int, Any]]:
    """{(metric name, labels): {ms: value}} of every series of ``host``."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], dict[int, Any]] = {}
    for line in vm.export(f'{{host="{host}"}}'):
        metric = dict(line["metric"])
        name = metric.pop("__name__")
        got = out.setdefault((name, tuple(sorted(metric.items()))), {})
        for t, v in zip(line["timestamps"], line["values"]):
            assert t not in got, f"{name} {metric}: two points at {t}"
            got[t] = v
    return out


def expected_points(samples: list[GpuSample]) -> dict[tuple[str, tuple[tuple[str, str], ...]], dict[int, Any]]:
    """What the module's vocabulary says VictoriaMetrics must hold for ``samples`` (a MIG instance's rows: none of
    its GPU's readings)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], dict[int, Any]] = {}
    for s in samples:
        t = round(s.ts * 1000)
        gpu = {"host": s.host, "gpu": str(s.gpu_index), "uuid": s.gpu_uuid, "model": s.model, "mig": s.mig or ""}
        labels = tuple(sorted((k, v) for k, v in gpu.items() if v))
        for name, attr in GPU_SERIES:
            v = getattr(s, attr)
            if v is not None and not (s.mig and attr in GPU_READINGS):
                out.setdefault((name, labels), {})[t] = v
        out.setdefault((JOBS, labels), {})[t] = len(s.job_ids)
        for k, job in enumerate(s.job_ids):
            job_labels = tuple(sorted((k2, v) for k2, v in {**gpu, "model": "", "jobid": job}.items() if v))
            out.setdefault((JOB_INFO, job_labels), {})[t] = 1
            if s.job_shares:
                out.setdefault((JOB_SHARE, job_labels), {})[t] = s.job_shares[k]
    return out


# -- shipping ---------------------------------------------------------------------------------------------------
def test_ingested_samples_land_in_victoriametrics_exactly(vm: VictoriaMetricsServer, tmp_path: Path) -> None:
    host = "exact01"
    samples = fleet(host, hours=0.5)
    c = Collector(tmp_path / "c.sqlite", vm.url)
    try:
        accepted = sum(c.post(b)["accepted"] for b in batches(samples, host))
        assert accepted == len(samples)
        assert c.remote is not None and c.remote.shipper.flush(30)
        vm.flush()
        got = vm_points(vm, host)
        assert got == expected_points(stored(c.store))  # names, labels, millisecond times and values, bit for bit
        assert len(stored(c.store)) > len(samples)  # the MIG GPU's whole-GPU rows too
        assert c.metric("gpuledger_collector_series_shipped_samples_total") == len(stored(c.store))
        assert c.metric("gpuledger_collector_series_backlog_samples") == 0
        assert c.metric("gpuledger_collector_series_lag_seconds") == 0
    finally:
        c.close()


def test_series_api_answers_from_victoriametrics_as_the_local_store_would(vm: VictoriaMetricsServer,
                                                                          tmp_path: Path) -> None:
    host = "same01"
    samples = fleet(host)
    shipped = Collector(tmp_path / "vm.sqlite", vm.url)
    local = Collector(tmp_path / "local.sqlite")
    try:
        for b in batches(samples, host):
            assert shipped.post(b) == local.post(b)
        local.store.compact(NOW)  # the local store answers hours and minutes from its rollup tiers
        assert shipped.remote is not None and shipped.remote.shipper.flush(30)
        vm.flush()
        assert_series_api_matches_local(shipped, local, host)
    finally:
        shipped.close()
        local.close()


def test_values_beyond_victoriametrics_precision_come_back_within_1e_11(vm: VictoriaMetricsServer,
                                                                         tmp_path: Path) -> None:
    # DCGM's ratios carry a double's 17 digits; VictoriaMetrics 1.79 keeps about 12 (the module's docstring).
    host = "precise01"
    rng = random.Random(7)
    samples = [GpuSample(ts=H + i, host=host, gpu_uuid="GPU-p", gpu_index=0, sm_active_ratio=rng.random(),
                         energy_joules=1e9 + rng.random() * 1e6) for i in range(50)]
    c = Collector(tmp_path / "c.sqlite", vm.url)
    try:
        c.post({"agent_id": "a", "seq": 0, "host": host, "series": to_series(samples, host)})
        assert c.remote is not None and c.remote.shipper.flush(30)
        vm.flush()
        got = c.series(host=host, uuid="GPU-p", start=H, end=H + 60).json()
        assert [g["ts"] for g in got] == [s.ts for s in samples]
        for g, s in zip(got, samples):
            assert g["sm_active_ratio"] == pytest.approx(s.sm_active_ratio, rel=1e-11, abs=0)
            assert g["energy_joules"] == pytest.approx(s.energy_joules, rel=1e-11, abs=0)
        assert any(g["sm_active_ratio"] != s.sm_active_ratio for g, s in zip(got, samples))  # the limit is real
    finally:
        c.close()


def test_a_shipment_that_reached_victoriametrics_unacknowledged_is_stored_once(vm: VictoriaMetricsServer,
                                                                              tmp_path: Path) -> None:
    # A collector that died after VictoriaMetrics took a shipment but before it forgot the rows ships them again.
    host = "twice01"
    samples = fleet(host, hours=0.1)
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW, series_outbox=True,
                        retention=local_retention(600.0))
    try:
        server = CollectorServer(store, clock=lambda: NOW).start()
        for b in batches(samples, host):
            assert httpx.post(f"{server.url}/api/v1/samples", json=b).status_code == 200
        server.stop()
        outbox = store.series_store
        assert isinstance(outbox, OutboxSeriesStore)
        queued = outbox.take(10_000, 10**9)
        body, n = import_body(c for q in queued for c in q.chunks())
        assert n == len(stored(store))
        VictoriaMetrics(vm.url).import_lines(body)  # ... and the collector died here, before ack
        remote = RemoteSeries(store.series_store, vm.url, interval_s=0.05)
        assert remote.shipper.flush(30) and remote.shipper.stats.shipped_samples == n
        remote.close()
        vm.flush()
        assert vm_points(vm, host) == expected_points(stored(store))  # one point each (vm_points checks)
    finally:
        store.close()


# -- one outbox shared by several collectors ------------------------------------------------------------------
def test_ack_forgets_only_the_rows_it_shipped(ledger: str) -> None:
    """On a shared ledger another collector's row may commit after the shipper read the queue, older than what it
    read: acknowledging a shipment must leave it queued."""
    db = open_database(ledger)
    written = [100.0]
    outbox = OutboxSeriesStore(ChunkSeriesStore(db), db, threading.RLock(), clock=lambda: written[0])
    try:
        with db.transaction():
            outbox.write_samples(fleet("ack01", hours=0.01)[:4])
        taken = outbox.take(10, 10**6)
        assert [q.samples for q in taken] == [4]
        written[0] = 50.0  # a transaction that began earlier commits now
        with db.transaction():
            outbox.write_samples(fleet("ack02", hours=0.01)[:6])
        outbox.ack(taken)
        left = outbox.take(10, 10**6)
        assert [q.samples for q in left] == [6] and left[0].id != taken[0].id
        assert outbox.backlog() == (6, 50.0) and outbox.queued()
        outbox.ack(left)
        assert outbox.backlog() == (0, None) and not outbox.queued()
    finally:
        db.close()


def test_a_slot_another_shipper_holds_is_left_to_it(vm: VictoriaMetricsServer, ledger: str) -> None:
    """Shippers share the queue by slots: rows of a slot another collector's shipper holds stay for it (never
    sent twice), the rest go, and once that shipper is gone its slot is drained too."""
    host = "slots01"
    db = open_database(ledger)
    outbox = OutboxSeriesStore(ChunkSeriesStore(db), db, threading.RLock())
    samples = fleet(host, hours=0.2)
    for k in range(0, len(samples), 2):
        with db.transaction():
            outbox.write_samples(samples[k:k + 2])
    slot0 = sum(q.samples for q in outbox.take(10**6, 10**9) if q.id % SHIP_SLOTS == 0)
    assert 0 < slot0 < len(samples)  # 72 rows with random ids: some in slot 0, not all (but for 1e-9)
    shipper = SeriesShipper(outbox, VictoriaMetrics(vm.url), interval_s=0.05)
    try:
        with outbox.shipping(0) as held:
            assert held
            shipper.start()
            deadline = time.monotonic() + 30
            while outbox.backlog()[0] != slot0:
                assert time.monotonic() < deadline, outbox.backlog()
                time.sleep(0.05)
            assert all(q.id % SHIP_SLOTS == 0 for q in outbox.take(10**6, 10**9))
        assert shipper.flush(30) and shipper.stats.shipped_samples == len(samples)
        vm.flush()
        assert vm_points(vm, host) == expected_points(samples)
    finally:
        shipper.close()
        db.close()


def test_collectors_sharing_a_postgresql_ledger_ship_every_sample_once(vm: VictoriaMetricsServer, pg_url: str
                                                                       ) -> None:
    """Two collectors on one PostgreSQL ledger, both shipping: one host's batches alternate between them (its
    agent failing over), the other host's go to one. VictoriaMetrics gets every stored sample exactly once, and
    each was shipped once."""
    hosts = ("shared01", "shared02")
    a, b = Collector(pg_url, vm.url), Collector(pg_url, vm.url)
    try:
        samples = {h: fleet(h, hours=0.5, seed=k) for k, h in enumerate(hosts)}
        for k, body in enumerate(batches(samples[hosts[0]], hosts[0])):
            (a, b)[k % 2].post(body)
        for body in batches(samples[hosts[1]], hosts[1]):
            b.post(body)
        assert a.remote is not None and b.remote is not None
        assert a.remote.shipper.flush(30) and b.remote.shipper.flush(30)
        vm.flush()
        everything = stored(a.store)
        assert {s.host for s in everything} == set(hosts) and stored(b.store) == everything
        for h in hosts:
            assert vm_points(vm, h) == expected_points([s for s in everything if s.host == h])  # each point once
        # one shipper at a time per slot of the queue: no queued row went out twice
        assert a.remote.shipper.stats.shipped_samples + b.remote.shipper.stats.shipped_samples == len(everything)
    finally:
        a.close()
        b.close()


# -- crashes and outages ----------------------------------------------------------------------------------------
def test_collector_killed_before_shipping_loses_nothing(tmp_path: Path) -> None:
    vm_port = free_port()

    def check(vm: VictoriaMetricsServer, stored_samples: list[GpuSample]) -> None:
        vm.flush()
        assert vm_points(vm, "crash01") == expected_points(stored_samples)  # one point each (vm_points checks)

    killed_collector_ships_after_restart(
        tmp_path, f'series_url = "http://127.0.0.1:{vm_port}"\n',
        lambda: VictoriaMetricsServer(tmp_path / "vm", port=vm_port, flags=DEDUP), check)


def test_victoriametrics_down_ingest_goes_on_and_shipping_resumes(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    host = "outage01"
    vm_port = free_port()
    samples = fleet(host, hours=0.2)
    c = Collector(tmp_path / "c.sqlite", f"http://127.0.0.1:{vm_port}")
    local = Collector(tmp_path / "local.sqlite")
    caplog.set_level(logging.INFO, logger="gpuledger.collector.series_outbox")
    try:
        failed = assert_shipping_fails(c, local, host, samples, caplog.records)
        assert "unreachable" in failed.getMessage()
        with VictoriaMetricsServer(tmp_path / "vm", port=vm_port, flags=DEDUP) as vm:
            assert c.remote is not None and c.remote.shipper.flush(30)
            vm.flush()
            assert vm_points(vm, host) == expected_points(stored(c.store))
            assert_shipping_resumed(c, host, caplog.records)
        r = c.series(host=host, uuid="GPU-a", start=H, end=H + 600)  # down again: one line of JSON, never a 500
        assert r.status_code == 503 and r.text.count("\n") == 0 and r.json()["reason"] == "series_unavailable"
    finally:
        c.close()
        local.close()


def test_an_error_answer_of_victoriametrics_is_a_502(vm: VictoriaMetricsServer, tmp_path: Path) -> None:
    # VictoriaMetrics returns at most 30,000 points a series (-search.maxPointsPerTimeseries): a collector allowed
    # more asks for more and gets its error, which it passes on as a 502.
    c = Collector(tmp_path / "c.sqlite", vm.url, max_series_points=100_000)
    try:
        r = c.series(host="nobody", uuid="GPU-a", start=H, end=H + 50_000, step=1)
        assert r.status_code == 502, r.text
        assert "VictoriaMetrics" in r.json()["error"] and r.json()["reason"] == "series_unavailable"
    finally:
        c.close()


# -- what stays local ------------------------------------------------------------------------------------------
def test_the_short_local_retention_leaves_the_ledger_as_the_default_one(tmp_path: Path) -> None:
    # A node silent for three days, compacted meanwhile, evicted and restored: the energy across its silence is
    # bridged from its last stored sample, which compaction keeps (it drops only rolled-up samples, and never
    # rolls up a GPU's window) however short the raw retention.
    now = [H]
    kw: dict[str, Any] = {"clock": lambda: now[0], "idle_evict_s": 1200.0}
    short = Store(tmp_path / "short.sqlite", series_outbox=True, retention=local_retention(600.0), **kw)
    default = Store(tmp_path / "default.sqlite", **kw)
    before, after = fleet("quiet01", hours=1.0), fleet("quiet01", hours=1.0, seed=1)
    silence = 3 * 86400.0
    after = [replace(s, ts=s.ts + silence + 3600, energy_joules=s.energy_joules + 1e8) for s in after]
    try:
        for agent, phase in (("before", before), ("after", after)):  # a new agent id: the agent restarted
            for b in batches(phase, "quiet01"):
                batch = parse_batch(json.dumps({**b, "agent_id": agent}).encode(), "application/json", 2e9)
                now[0] = max(s.ts for s in batch.samples)
                assert short.ingest(batch) == default.ingest(batch)
            now[0] += silence / 2
            for store in (short, default):
                store.compact()
                store.compact(now[0] + silence / 2)
            # another node's batch: its commit evicts the silent node, whose next batch then restores it
            other = fleet("other01", hours=0.01)[:1]
            other = [replace(o, ts=now[0] - 1.0) for o in other]
            for store in (short, default):
                store.ingest(parse_batch(json.dumps({"agent_id": "o", "seq": int(now[0]), "host": "other01",
                                                     "samples": [o.to_dict() for o in other]}).encode(),
                                         "application/json", 2e9))
                assert "quiet01" not in {k[0] for k in store.agg.gpus}
        raw_left = {t["tier"]: t["rows"] for t in short.tiers()}["raw"]
        assert 0 < raw_left < {t["tier"]: t["rows"] for t in default.tiers()}["raw"]  # the short one dropped some
        for read in ("job_usage", "gpu_energy", "energy_gaps", "totals"):
            assert getattr(short, read)() == getattr(default, read)(), read
        assert short.energy_gaps() and any(g["energy_joules"] for g in short.energy_gaps())  # bridged
    finally:
        short.close()
        default.close()


def test_a_mig_gpu_is_shipped_with_its_power_and_energy_once(vm: VictoriaMetricsServer, tmp_path: Path) -> None:
    """A MIG GPU (two 3g instances, a job each, 400 W) as the agent sends it, a minute of it, a batch of it late (its
    window is read back from the local chunks): VictoriaMetrics holds its power and energy counter once, on the
    whole GPU, the jobs' shares of the GPU are their slices, and the ledger is the one an aggregation that keeps
    every window in memory computes, bit for bit (what the store keeps folds back to what it counted)."""
    host = "mig01"

    def tick(t: float, e: float) -> list[GpuSample]:
        gpu = GpuSample(ts=t, host=host, gpu_uuid="GPU-m", gpu_index=0, model="NVIDIA H200", power_watts=400.0,
                        energy_joules=e, power_limit_watts=700.0, mem_total_bytes=141 << 30)
        return [gpu] + [GpuSample(ts=t, host=host, gpu_uuid="GPU-m", gpu_index=0, model="NVIDIA H200 MIG 3g.71gb",
                                  mig=m, sm_active_ratio=a, mem_total_bytes=70 << 30, job_ids=(j,))
                        for m, j, a in (("1", "j1", 0.9), ("2", "j2", 0.1))]

    split = MigEnergySplitter()
    rows = [split.map(tick(H + 10.0 * i, 1e6 + 4000.0 * i)) for i in range(7)]
    batches_in = [rows[0] + rows[1] + rows[3], rows[4] + rows[5] + rows[6], rows[2]]  # the last one late
    c = Collector(tmp_path / "c.sqlite", vm.url)
    in_memory = Aggregator()
    try:
        for seq, b in enumerate(batches_in):
            assert c.post({"agent_id": "a", "seq": seq, "host": host, "samples": [s.to_dict() for s in b]}
                          )["accepted"] == len(b)
            in_memory.add_many(b)
        assert [u.to_dict() for u in c.store.job_usage(per_gpu=True)] == [u.to_dict() for u in
                                                                           in_memory.job_usage(per_gpu=True)]
        assert c.remote is not None and c.remote.shipper.flush(30)
        vm.flush()
        at, sel = str(H + 60.0), f'{{host="{host}"}}'
        for expr, want in ((f"sum(gpuledger_gpu_power_watts{sel})", 400.0),
                           (f"sum(gpuledger_gpu_energy_joules_total{sel})", 1e6 + 24000.0),  # the GPU's counter
                           (f"count(gpuledger_gpu_power_limit_watts{sel})", 1.0)):
            (got,) = vm.api("/api/v1/query", query=expr, time=at)["result"]
            assert float(got["value"][1]) == want, expr
        shares = vm.api("/api/v1/query", query=f'gpuledger_gpu_job_share_ratio{{host="{host}"}}', time=at)["result"]
        assert sorted((s["metric"]["jobid"], float(s["value"][1])) for s in shares) == [
            ("j1", pytest.approx(3 / 7, rel=1e-11)), ("j2", pytest.approx(3 / 7, rel=1e-11))]  # VM: 12 digits
    finally:
        c.close()


# -- the vocabulary and the settings ---------------------------------------------------------------------------
def test_import_lines_carry_labels_jobs_and_shares() -> None:
    s = [GpuSample(ts=H + i, host="n1", gpu_uuid="GPU-m", gpu_index=2, mig="3.0", model="", power_watts=100.0 + i,
                   mem_used_bytes=2**40 + i, job_ids=("j1", "j2"), job_shares=(0.5, 0.5)) for i in range(3)]
    from gpuledger.collector.chunks import encode_samples

    gpu = [replace(x, mig=None, job_ids=(), job_shares=()) for x in s]  # the MIG GPU's own rows
    body, n = import_body([("n1", "GPU-m", "3.0", encode_samples(s)), ("n1", "GPU-m", "", encode_samples(gpu))])
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert n == 6
    by_name = {line["metric"]["__name__"]: line for line in lines
               if line["metric"].get("mig") == "3.0" and line["metric"].get("jobid") in (None, "j1")}
    mem = by_name["gpuledger_gpu_memory_used_bytes"]
    assert mem["metric"] == {"__name__": "gpuledger_gpu_memory_used_bytes", "host": "n1", "gpu": "2", "uuid": "GPU-m",
                             "mig": "3.0"}  # an empty model is no label, as in Prometheus
    assert mem["values"] == [2**40, 2**40 + 1, 2**40 + 2]  # integers
    assert mem["timestamps"] == [round(H * 1000) + k * 1000 for k in range(3)]
    assert by_name[JOBS]["values"] == [2, 2, 2]
    assert by_name[JOB_INFO]["metric"]["jobid"] == "j1" and by_name[JOB_INFO]["values"] == [1, 1, 1]
    assert by_name[JOB_SHARE]["values"] == [0.5, 0.5, 0.5]
    assert set(by_name) == {"gpuledger_gpu_memory_used_bytes", JOBS, JOB_INFO, JOB_SHARE}  # its GPU's power: not here
    (power,) = [line for line in lines if line["metric"]["__name__"] == "gpuledger_gpu_power_watts"]
    assert power["metric"] == {"__name__": "gpuledger_gpu_power_watts", "host": "n1", "gpu": "2", "uuid": "GPU-m"}
    assert power["values"] == [100.0, 101.0, 102.0]  # once, on the whole GPU


def test_series_url_setting(tmp_path: Path) -> None:
    s = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://vm.example.org:8428/"})
    assert s.series_url == "http://vm.example.org:8428"
    r = s.retention()  # locally: raw samples for the window and an hour, rollups an hour
    assert (r.raw_s, r.minute_s, r.hour_s) == (600.0 + 3600.0, 3600.0, 3600.0)
    r = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://vm:8428",
                                     "GPULEDGER_COLLECTOR_WINDOW_S": "600"},
                      overrides={"raw_retention_s": 7200}).retention()
    assert r.raw_s == 7200.0
    assert load_settings(tmp_path, env={}).retention() == Retention()  # without it: the local tiers as before
    for bad in ("influx://db:8086", "vm:8428", "http://:8428", "http://vm:8428/?db=x"):
        with pytest.raises(ConfigError, match="series_url"):
            load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": bad})
    with pytest.raises(ConfigError, match="raw retention"):
        load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://vm:8428"},
                      overrides={"raw_retention_s": 60})
