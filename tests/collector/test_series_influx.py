"""Series in InfluxDB 1.x (``series_url`` with ``series_api = "influxdb"``) against the real server (Debian's
influxd, loopback, free ports): collectors serving real HTTP ingest batches; the samples land in InfluxDB exactly,
as the InfluxDB sink writes them (so the InfluxDB dashboards read them); GET /api/v1/series answers from there with
the points a collector without series_url gives; a resent shipment is stored once; a collector killed before
shipping loses nothing; collectors sharing a PostgreSQL ledger ship each sample once; InfluxDB down, or without
the database, leaves ingest untouched and shipping resumes; a refused shipment is dropped and counted; bad
settings are one line and exit 2."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from collector_proc import ROOT
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
from servers import InfluxServer, free_port  # tests/servers.py: the shared harness

from gpuledger.agent.mig import GPU_READINGS
from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.influxdb import InfluxDB, write_body
from gpuledger.collector.series_outbox import OutboxSeriesStore, RemoteSeries, local_retention
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.sinks.influx import FLOAT_FIELDS, INT_FIELDS, InfluxSink
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample
from gpuledger.schema.wire import to_series

pytestmark = [pytest.mark.influx, pytest.mark.timeout(240)]

API = "influxdb"
Points = dict[tuple[str, tuple[tuple[str, str], ...]], dict[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def influx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfluxServer]:
    with InfluxServer(tmp_path_factory.mktemp("influx")) as server:
        yield server


def influx_points(server: InfluxServer, host: str, db: str | None = None) -> Points:
    """{(measurement, tags): {ms: fields}} of every point of ``host`` (of database ``db``, default the server's)."""
    out: Points = {}
    saved, server.db = server.db, db or server.db
    try:
        for measurement in ("gpu", "gpu_job"):
            (res,) = server.query(f"SELECT * FROM \"{measurement}\" WHERE \"host\" = '{host}' GROUP BY *")
            for s in res.get("series", ()):
                tags = tuple(sorted((k, v) for k, v in s["tags"].items() if v))
                got = out.setdefault((measurement, tags), {})
                for row in s["values"]:
                    point = dict(zip(s["columns"], row))
                    t = point.pop("time")
                    assert t not in got
                    got[t] = {k: v for k, v in point.items() if v is not None}
    finally:
        server.db = saved
    return out


def expected_points(samples: list[GpuSample]) -> Points:
    """What docs/schema.md says InfluxDB must hold for ``samples`` (measurements gpu and gpu_job): a MIG GPU's
    readings and no ``jobs`` on its whole-GPU point (one with instances at its instant), none of its readings on
    its instances' (whose ``gpu_job`` points hold its power: a MIG instance as series show it has none, so the whole
    GPU's at that time)."""
    out: Points = {}
    mig_instants = {(s.host, s.gpu_uuid, s.ts) for s in samples if s.mig}
    gpu_power = {(s.host, s.gpu_uuid, s.ts): s.power_watts for s in samples if not s.mig}
    for s in samples:
        t = round(s.ts * 1000)
        gpu = {"host": s.host, "gpu": str(s.gpu_index), "uuid": s.gpu_uuid, "model": s.model, "mig": s.mig or ""}
        fields: dict[str, Any] = {f: getattr(s, f) for f in (*FLOAT_FIELDS, *INT_FIELDS)
                                  if getattr(s, f) is not None and not (s.mig and f in GPU_READINGS)}
        fields["xid_errors"] = len(s.xid_errors)
        if s.mig or (s.host, s.gpu_uuid, s.ts) not in mig_instants:
            fields["jobs"] = len(s.job_ids)
        out.setdefault(("gpu", tuple(sorted((k, v) for k, v in gpu.items() if v))), {})[t] = fields
        shares = s.job_shares or (1.0 / max(1, len(s.job_ids)),) * len(s.job_ids)
        for job, share in zip(s.job_ids, shares):
            tags = {"host": s.host, "uuid": s.gpu_uuid, "mig": s.mig or "", "jobid": job}
            per_job = {"share": share, "share_reported": bool(s.job_shares)}
            per_job |= {f: getattr(s, f) for f in ("sm_active_ratio", "dram_bw_ratio", "tensor_active_ratio",
                                                   "power_watts", "mem_used_bytes") if getattr(s, f) is not None}
            if s.mig and s.power_watts is None and gpu_power.get((s.host, s.gpu_uuid, s.ts)) is not None:
                per_job["power_watts"] = gpu_power[(s.host, s.gpu_uuid, s.ts)]
            out.setdefault(("gpu_job", tuple(sorted((k, v) for k, v in tags.items() if v))), {})[t] = per_job
    return out


def as_counted(samples: list[GpuSample]) -> list[GpuSample]:
    """Series rows as the store hands them to its sinks (``aggregate.normalize_mig``): a MIG instance's with its
    GPU's readings."""
    gpu = {(s.host, s.gpu_uuid, s.ts): s for s in samples if not s.mig}
    return [replace(s, **{f: getattr(gpu[(s.host, s.gpu_uuid, s.ts)], f) for f in GPU_READINGS}) if s.mig else s
            for s in samples]


def shipped(c: Collector) -> None:
    assert c.remote is not None and c.remote.shipper.flush(30)


# -- shipping ---------------------------------------------------------------------------------------------------
def test_ingested_samples_land_in_influxdb_exactly_as_the_sink_writes_them(influx: InfluxServer,
                                                                           tmp_path: Path) -> None:
    host = "exact01"
    samples = fleet(host, hours=0.5)
    c = Collector(tmp_path / "c.sqlite", influx.url, API)
    try:
        accepted = sum(c.post(b)["accepted"] for b in batches(samples, host))
        assert accepted == len(samples)
        shipped(c)
        everything = stored(c.store)
        assert len(everything) > len(samples)  # the MIG GPU's whole-GPU rows too
        got = influx_points(influx, host)
        assert got == expected_points(everything)  # measurements, tags, millisecond times and values, bit for bit
        assert any(not f["share_reported"] for (m, _), pts in got.items() if m == "gpu_job" for f in pts.values())
        assert c.metric("gpuledger_collector_series_shipped_samples_total") == len(everything)
        assert c.metric("gpuledger_collector_series_backlog_samples") == 0
        assert c.metric("gpuledger_collector_series_lag_seconds") == 0
        # the InfluxDB sink writes the same points: the InfluxDB dashboards read the shipped series as the sink's
        influx.query('CREATE DATABASE "sink"', post=True)
        sink = InfluxSink(influx.url, api="v1", database="sink")
        sink.write(as_counted(everything))
        sink.close()
        assert influx_points(influx, host, db="sink") == got
    finally:
        c.close()


def test_series_api_answers_from_influxdb_as_the_local_store_would(influx: InfluxServer, tmp_path: Path) -> None:
    host = "same01"
    remote = Collector(tmp_path / "influx.sqlite", influx.url, API)
    local = Collector(tmp_path / "local.sqlite")
    try:
        for b in batches(fleet(host), host):
            assert remote.post(b) == local.post(b)
        local.store.compact(NOW)  # the local store answers hours and minutes from its rollup tiers
        shipped(remote)
        assert_series_api_matches_local(remote, local, host)
    finally:
        remote.close()
        local.close()


def test_values_come_back_bit_for_bit(influx: InfluxServer, tmp_path: Path) -> None:
    # DCGM's ratios carry a double's 17 digits, counters may pass 2**53: InfluxDB keeps float64 and int64.
    host = "precise01"
    rng = random.Random(7)
    samples = [GpuSample(ts=H + i + 0.001, host=host, gpu_uuid="GPU-p", gpu_index=0, sm_active_ratio=rng.random(),
                         energy_joules=1e9 + rng.random() * 1e6, mem_used_bytes=2**62 + i) for i in range(50)]
    c = Collector(tmp_path / "c.sqlite", influx.url, API)
    try:
        c.post({"agent_id": "a", "seq": 0, "host": host, "series": to_series(samples, host)})
        shipped(c)
        got = c.series(host=host, uuid="GPU-p", start=H, end=H + 60).json()
        assert [(g["ts"], g["sm_active_ratio"], g["energy_joules"], g["mem_used_bytes"]) for g in got] == \
               [(s.ts, s.sm_active_ratio, s.energy_joules, s.mem_used_bytes) for s in samples]
    finally:
        c.close()


def test_names_with_quotes_and_backslashes_are_read_back(influx: InfluxServer) -> None:
    # Tag values reach InfluxQL as string literals: quotes and backslashes are escaped, not interpreted (and
    # InfluxDB 1.x keeps the sink's escaped backslashes in tags doubled: collector.influxdb.stored_tag). It refuses
    # a tag value that ends in one: docs/deploy.md says so.
    from gpuledger.collector.chunks import encode_samples
    from gpuledger.collector.influxdb import InfluxSeriesReader

    odd = GpuSample(ts=H + 0.5, host="n'1\\x", gpu_uuid='GPU-"q",=', gpu_index=1, mig="1 '0\\a", temp_celsius=1.5,
                    model="\\M\\\\a", job_ids=("j'1", "j\\2"), job_shares=(0.25, 0.75))
    db = InfluxDB(influx.url, influx.db)
    try:
        db.write(write_body([(odd.host, odd.gpu_uuid, odd.mig or "", encode_samples([odd]))])[0])
        reader = InfluxSeriesReader(db)
        (got,) = reader.series(odd.host, odd.gpu_uuid, H, H + 1, mig=odd.mig)
        assert got == odd
        assert reader.series(odd.host, odd.gpu_uuid, H, H + 1, mig=None) == []  # the whole GPU: none
    finally:
        db.close()


def test_a_shipment_that_reached_influxdb_unacknowledged_is_stored_once(influx: InfluxServer, tmp_path: Path) -> None:
    # A collector that died after InfluxDB took a shipment but before it forgot the rows ships them again:
    # InfluxDB overwrites each point with itself.
    host = "twice01"
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW, series_outbox=True, retention=local_retention(600.0))
    try:
        server = CollectorServer(store, clock=lambda: NOW).start()
        for b in batches(fleet(host, hours=0.1), host):
            assert httpx.post(f"{server.url}/api/v1/samples", json=b).status_code == 200
        server.stop()
        outbox = store.series_store
        assert isinstance(outbox, OutboxSeriesStore)
        body, n = write_body(c for q in outbox.take(10_000, 10**9) for c in q.chunks())
        assert n == len(stored(store))
        InfluxDB(influx.url, influx.db).write(body)  # ... and the collector died here, before ack
        remote = RemoteSeries(store.series_store, influx.url, API, influx.db, interval_s=0.05)
        assert remote.shipper.flush(30) and remote.shipper.stats.shipped_samples == n
        remote.close()
        got = influx_points(influx, host)  # one point per measurement, tags and time (influx_points checks)
        assert got == expected_points(stored(store))
        (res,) = influx.query(f"SELECT count(\"xid_errors\") FROM \"gpu\" WHERE \"host\" = '{host}'")
        assert res["series"][0]["values"][0][1] == n
    finally:
        store.close()


def test_a_refused_shipment_is_dropped_and_counted(influx: InfluxServer, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    # A field whose type differs from the shard's (an integer power_watts written by something else): InfluxDB
    # answers 400 (partial write), retrying cannot help; the next shipment goes through.
    host = "refused01"
    influx.query('CREATE DATABASE "conflict"', post=True)
    InfluxDB(influx.url, "conflict").write(f"gpu,host=other,uuid=GPU-x power_watts=1i {round(H * 1000)}\n".encode())
    c = Collector(tmp_path / "c.sqlite", influx.url, API, database="conflict")
    try:
        c.post(batches(fleet(host, hours=0.05), host)[0])
        shipped(c)
        assert c.metric("gpuledger_collector_series_dropped_samples_total") == len(stored(c.store)) > 0
        assert c.metric("gpuledger_collector_series_backlog_samples") == 0
        assert any("refused" in r.getMessage() and "HTTP 400" in r.getMessage() for r in caplog.records)
        ok = GpuSample(ts=H, host=host, gpu_uuid="GPU-z", gpu_index=0, temp_celsius=40.0)
        c.post({"agent_id": "b", "seq": 0, "host": host, "samples": [ok.to_dict()]})
        shipped(c)
        assert c.metric("gpuledger_collector_series_shipped_samples_total") == 1
    finally:
        c.close()


def test_collectors_sharing_a_postgresql_ledger_ship_every_sample_once(influx: InfluxServer, pg_url: str) -> None:
    """Two collectors on one PostgreSQL ledger, both shipping to InfluxDB: one host's batches alternate between them
    (its agent failing over). InfluxDB gets every stored sample, and each was shipped once (slots of the queue)."""
    host = "shared01"
    a, b = Collector(pg_url, influx.url, API), Collector(pg_url, influx.url, API)
    try:
        for k, body in enumerate(batches(fleet(host, hours=0.5), host)):
            (a, b)[k % 2].post(body)
        shipped(a)
        shipped(b)
        everything = stored(a.store)
        assert influx_points(influx, host) == expected_points(everything)
        assert a.remote is not None and b.remote is not None
        assert a.remote.shipper.stats.shipped_samples + b.remote.shipper.stats.shipped_samples == len(everything)
    finally:
        a.close()
        b.close()


# -- crashes and outages ----------------------------------------------------------------------------------------
def test_collector_killed_before_shipping_loses_nothing(tmp_path: Path) -> None:
    influx_port = free_port()

    def check(influx: InfluxServer, stored_samples: list[GpuSample]) -> None:
        assert influx_points(influx, "crash01") == expected_points(stored_samples)

    error = killed_collector_ships_after_restart(
        tmp_path, f'series_url = "http://127.0.0.1:{influx_port}"\nseries_api = "influxdb"\nseries_database = "site"\n',
        lambda: InfluxServer(tmp_path / "influx", db="site", port=influx_port), check)
    assert "InfluxDB" in error


def test_influxdb_down_ingest_goes_on_and_shipping_resumes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    host = "outage01"
    port = free_port()
    samples = fleet(host, hours=0.2)
    c = Collector(tmp_path / "c.sqlite", f"http://gl:secret@127.0.0.1:{port}", API)  # basic auth (off there)
    local = Collector(tmp_path / "local.sqlite")
    caplog.set_level(logging.INFO, logger="gpuledger.collector.series_outbox")
    try:
        failed = assert_shipping_fails(c, local, host, samples, caplog.records)
        assert "InfluxDB" in failed.getMessage()
        r = c.series(host=host, uuid="GPU-a", start=H, end=H + 600, step=60)
        assert "gl:***@" in r.text and "secret" not in r.text + failed.getMessage()  # the password stays out
        with InfluxServer(tmp_path / "influx", port=port) as influx:
            shipped(c)
            assert influx_points(influx, host) == expected_points(stored(c.store))
            assert_shipping_resumed(c, host, caplog.records)
        r = c.series(host=host, uuid="GPU-a", start=H, end=H + 600)  # down again: one line of JSON, never a 500
        assert r.status_code == 503 and r.text.count("\n") == 0 and r.json()["reason"] == "series_unavailable"
    finally:
        c.close()
        local.close()


def test_a_missing_database_holds_the_queue_until_it_exists(influx: InfluxServer, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # No database is no malformed shipment: nothing is dropped, and reads are a 502 naming InfluxDB's error.
    host = "nodb01"
    caplog.set_level(logging.INFO, logger="gpuledger.collector.series_outbox")
    c = Collector(tmp_path / "c.sqlite", influx.url, API, database="later")
    try:
        for b in batches(fleet(host, hours=0.05), host):
            c.post(b)
        deadline = time.monotonic() + 10
        while c.metric("gpuledger_collector_series_ship_failures_total") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.metric("gpuledger_collector_series_dropped_samples_total") == 0
        assert any("CREATE DATABASE" in r.getMessage() for r in caplog.records)
        r = c.series(host=host, uuid="GPU-a", start=H, end=H + 600)
        assert r.status_code == 502 and "database not found" in r.json()["error"], r.text
        influx.query('CREATE DATABASE "later"', post=True)
        shipped(c)
        assert influx_points(influx, host, db="later") == expected_points(stored(c.store))
        assert c.series(host=host, uuid="GPU-a", start=H, end=H + 600).status_code == 200
    finally:
        c.close()


# -- settings ---------------------------------------------------------------------------------------------------
def test_series_api_settings(tmp_path: Path) -> None:
    s = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://influx.example.org:8086/",
                                     "GPULEDGER_COLLECTOR_SERIES_API": "influxdb"})
    assert (s.series_url, s.series_api, s.series_database) == ("http://influx.example.org:8086", "influxdb",
                                                               "gpuledger")
    assert load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://vm:8428"}).series_api == \
        "victoriametrics"
    url = "http://db:8086"
    for settings, key in (({"series_url": url, "series_api": "influx"}, "collector.series_api"),
                          ({"series_api": "influxdb"}, "series_url is not"),
                          ({"series_url": url, "series_api": "influxdb", "series_database": ""},
                           "collector.series_database"),
                          ({"series_url": url, "series_database": "x"}, 'needs series_api = "influxdb"')):
        with pytest.raises(ConfigError, match=key):
            load_settings(tmp_path, env={}, overrides=settings)


def test_series_settings_survive_a_tokens_file(tmp_path: Path) -> None:
    # The tokens file is merged by validating the settings again: what was left at its default stays so.
    (tmp_path / "tokens.toml").write_text(f'admin_tokens = ["{"a" * 16}"]\n')
    (tmp_path / "gpuledger.toml").write_text('[collector]\ntokens_file = "tokens.toml"\n')
    assert load_settings(tmp_path, env={}).series_api == "victoriametrics"
    s = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_SERIES_URL": "http://db:8086",
                                     "GPULEDGER_COLLECTOR_SERIES_API": "influxdb"})
    assert s.series_api == "influxdb" and s.admin_tokens == ["a" * 16]
    assert s.retention().raw_s == local_retention(600.0).raw_s  # not the 7 days of a store without series_url


@pytest.mark.parametrize("table, key", [
    ('series_url = "http://127.0.0.1:8086"\nseries_api = "influx"', "collector.series_api"),
    ('series_url = "influxdb://127.0.0.1:8086/gpuledger"\nseries_api = "influxdb"', "collector.series_url"),
    ('series_api = "influxdb"', "series_url is not"),
])
def test_bad_series_settings_are_one_line_and_exit_2(tmp_path: Path, table: str, key: str) -> None:
    (tmp_path / "gpuledger.toml").write_text(f"[collector]\n{table}\n")
    r = subprocess.run([sys.executable, "-m", "gpuledger.cli", "collector", "serve", "--data-dir", str(tmp_path),
                        "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert str(tmp_path / "gpuledger.toml") in line and key in line
    assert not (tmp_path / "gpuledger.sqlite").exists()  # nothing created
