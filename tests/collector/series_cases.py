"""What the series-database tests share (test_series_vm.py: VictoriaMetrics, test_series_influx.py: InfluxDB 1.x):
an in-process collector as `collector serve` wires it, a fleet's samples and its agents' batches, and the check
that GET /api/v1/series answers from the series database with the points the local store gives."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from collector_proc import CollectorProc
from servers import free_port

from gpuledger.collector.series_outbox import RemoteSeries, local_retention
from gpuledger.collector.series_store import RAW, Retention
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample
from gpuledger.schema.wire import to_series

H = 1_699_999_200.0  # an hour's start (the harnesses' servers keep the past)
NOW = H + 3 * 3600.0  # the collectors' clock
R = TypeVar("R")  # a series database's test harness
NOT_REMOTE = ("xid_errors", "processes", "source")  # sample fields the series databases do not hold


class Collector:
    """The collector as `collector serve` wires it, in-process: store, real HTTP server and, with ``series_url``,
    the outbox, the shipper (short backoff) and the series database (``api``) answering /api/v1/series."""

    def __init__(self, path: Path | str, series_url: str | None = None, api: str = "victoriametrics",
                 database: str = "gpuledger", **server: Any) -> None:
        self.store = Store(path, clock=lambda: NOW, series_outbox=series_url is not None,
                           retention=local_retention(600.0) if series_url else Retention())
        self.remote = RemoteSeries(self.store.series_store, series_url, api, database, read_timeout_s=5.0,
                                   interval_s=0.05, backoff_s=0.05, backoff_max_s=0.2) if series_url else None
        self.server = CollectorServer(self.store, clock=lambda: NOW, series=self.remote.reader if self.remote else None,
                                      **server).start()
        if self.remote:
            self.server.metrics.registry.register(self.remote.metrics)
        self.http = httpx.Client(base_url=self.server.url, timeout=30)

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/api/v1/samples", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def series(self, **params: Any) -> httpx.Response:
        return self.http.get("/api/v1/series", params=params)

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        if self.remote:
            self.remote.close()
        self.store.close()


def fleet(host: str, hours: float = 3.0, step_s: float = 10.0, seed: int = 0) -> list[GpuSample]:
    """Two devices of ``host`` with NVML's resolution (milliwatts, millijoules, bytes, percent; times in ms):
    a whole GPU running job 101 then, after a free spell, job 102; a MIG instance shared by two jobs."""
    rng = random.Random(seed)
    out = []
    energy = {0: 12_345_678.125, 1: 2_000_000.5}
    for i in range(int(hours * 3600 / step_s)):
        ts = H + i * step_s + 0.125
        for index, (uuid, mig) in enumerate((("GPU-a", None), ("GPU-b", "1.0"))):
            power = round(rng.uniform(60.0, 700.0), 3)
            energy[index] = round(energy[index] + power * step_s, 3)
            if index == 0:
                jobs: tuple[str, ...] = ("101",) if i < 400 else () if i < 500 else ("102",)
                shares: tuple[float, ...] = ()
            else:
                jobs, shares = ("201", "202"), (0.25, 0.75)
            out.append(GpuSample(
                ts=ts, host=host, gpu_uuid=uuid, gpu_index=index, model="NVIDIA H200", mig=mig,
                sm_active_ratio=round(rng.random(), 2), dram_bw_ratio=round(rng.random(), 2), power_watts=power,
                energy_joules=energy[index], mem_used_bytes=rng.randrange(80 << 30), mem_total_bytes=80 << 30,
                temp_celsius=float(rng.randrange(30, 90)), power_limit_watts=700.0, sm_clock_hz=1.98e9,
                throttle_reasons=rng.choice((0, 4)), ecc_errors_total=0, job_ids=jobs, job_shares=shares,
                source="nvml"))
    return out


def batches(samples: list[GpuSample], host: str, per_batch_s: float = 60.0) -> list[dict[str, Any]]:
    """Agent batches of a minute each in the columnar layout; every tenth batch holds back its last round, which
    the next one sends late in the row layout (late samples take the store's row path)."""
    by_minute: dict[int, list[GpuSample]] = {}
    for s in samples:
        by_minute.setdefault(int((s.ts - H) // per_batch_s), []).append(s)
    out, held = [], []
    for seq, minute in enumerate(sorted(by_minute)):
        group = by_minute[minute]
        if held:
            out.append({"agent_id": "a", "seq": 10_000 + seq, "host": host, "samples": [s.to_dict() for s in held]})
            held = []
        if seq % 10 == 3:
            last = max(s.ts for s in group)
            held = [s for s in group if s.ts == last]
            group = [s for s in group if s.ts != last]
        out.append({"agent_id": "a", "seq": seq, "host": host, "series": to_series(group, host)})
    return out


def stored(store: Store) -> list[GpuSample]:
    """Every raw sample the local store holds (a MIG GPU's power and energy move to a whole-GPU row of its own)."""
    return [smp for host, uuid, mig in store.gpus()
            for smp in store.series(host, uuid, 0, 1e11, mig=mig or None, tier=RAW)]


def without_remote_only(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in NOT_REMOTE}


def assert_series_api_matches_local(shipped: Collector, local: Collector, host: str) -> None:
    """GET /api/v1/series of ``shipped`` (answering from its series database) gives what ``local`` (the local
    store, compacted: it answers hours and minutes from its rollup tiers) gives for raw samples, raw buckets, the
    minute and hour tiers, a last bucket reaching past ``end`` (whole), an automatic step and an empty span: the
    same samples, buckets, counts, minima and maxima, means within 1e-12 (summed in another order).
    ``fleet(host)`` must be in both."""
    end = H + 2.5 * 3600 - 0.001  # an hour's and a minute's last millisecond: rolled-up rows end there too
    queries = [
        {"uuid": "GPU-a", "start": H, "end": H + 1800},  # raw samples
        {"uuid": "GPU-b", "mig": "1.0", "start": H + 600, "end": H + 900},
        {"uuid": "GPU-a", "start": H, "end": end, "step": 30},  # raw buckets
        {"uuid": "GPU-a", "start": H, "end": end, "step": 60},  # the minute tier
        {"uuid": "GPU-b", "mig": "1.0", "start": H + 600, "end": NOW - 0.001, "step": 300},  # and its tail
        {"uuid": "GPU-a", "start": H, "end": H + 7200 - 0.001, "step": 3600},  # the hour tier
        {"uuid": "GPU-a", "start": H + 3600, "end": H + 3600 + 42.5, "step": 10},  # the last bucket whole
        {"uuid": "GPU-a", "start": H, "end": NOW},  # longer than max_series_points seconds: 1.081 s buckets
        {"uuid": "GPU-a", "start": NOW, "end": NOW + 60},  # nothing there
    ]
    for q in queries:
        a, b = shipped.series(host=host, **q), local.series(host=host, **q)
        assert a.status_code == b.status_code == 200, (q, a.text)
        got, want = a.json(), b.json()
        assert len(got) == len(want), q
        if q == queries[-1]:
            assert got == []
        for g, w in zip(got, want):
            if "gpu_uuid" in w:  # a raw sample
                assert without_remote_only(g) == without_remote_only(w), q
                assert (g["xid_errors"], g["processes"], g["source"]) == ([], [], "")
                continue
            assert {k: g[k] for k in ("ts", "step", "samples", "tier", "min", "max")} == \
                   {k: w[k] for k in ("ts", "step", "samples", "tier", "min", "max")}, q
            assert g["mean"] == pytest.approx(w["mean"], rel=1e-12), q
    tiers = {p["tier"] for q in queries[2:6] for p in shipped.series(host=host, **q).json()}
    assert tiers == {"raw", "1m", "1h"}
    assert {p["step"] for p in shipped.series(host=host, **queries[7]).json()} == {1.081}  # 10800 s / 9999
    # a step that is no whole number of milliseconds is rounded up to one (the databases' resolution as written)
    odd = shipped.series(host=host, uuid="GPU-a", start=H, end=H + 600, step=1.0004).json()
    assert {p["step"] for p in odd} == {1.001} and sum(p["samples"] for p in odd) == 60


def assert_shipping_fails(c: Collector, local: Collector, host: str, samples: list[GpuSample],
                          records: list[logging.LogRecord]) -> logging.LogRecord:
    """With the series database down: ``c`` answers every batch as ``local`` (no series_url) does and stores the
    same usage, retries, shows the whole backlog and its lag, logs one line (returned) and answers series reads
    503 with Retry-After."""
    for b in batches(samples, host):
        assert c.post(b) == local.post(b)
    assert c.http.get("/api/v1/usage").json() == local.http.get("/api/v1/usage").json()
    deadline = time.monotonic() + 10
    while c.metric("gpuledger_collector_series_ship_failures_total") < 3:  # several retries ...
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.metric("gpuledger_collector_series_backlog_samples") == len(stored(c.store))
    assert c.metric("gpuledger_collector_series_lag_seconds") > 0
    failed = [r for r in records if "failed" in r.getMessage()]
    assert len(failed) == 1  # ... one log line
    r = c.series(host=host, uuid="GPU-a", start=H, end=H + 600, step=60)
    assert r.status_code == 503 and r.headers["Retry-After"] and set(r.json()) == {"error", "reason"}
    return failed[0]


def assert_shipping_resumed(c: Collector, host: str, records: list[logging.LogRecord]) -> None:
    """After the series database came back and ``c`` shipped: no backlog, no lag, one log line saying so, and
    series reads answered."""
    assert c.metric("gpuledger_collector_series_backlog_samples") == 0
    assert c.metric("gpuledger_collector_series_lag_seconds") == 0
    assert len([r for r in records if "again" in r.getMessage()]) == 1
    assert c.series(host=host, uuid="GPU-a", start=H, end=H + 600, step=60).status_code == 200


def killed_collector_ships_after_restart(tmp_path: Path, settings: str, remote: Callable[[], AbstractContextManager[R]],
                                         check: Callable[[R, list[GpuSample]], None]) -> str:
    """A real collector (`collector serve`, ``settings`` in its [collector] table) ingests while its series
    database is away, and is SIGKILLed before shipping anything. Restarted with the database up (``remote()``):
    the same usage, the backlog shipped, ``check(database, stored samples)``, and /api/v1/series answered from the
    database. Returns the 503's error while the database was away."""
    host = "crash01"
    port = free_port()
    data = tmp_path / "data"
    data.mkdir()
    (data / "gpuledger.toml").write_text("[collector]\n" + settings)
    now = time.time()  # the real collector runs on the real clock: samples of the last few minutes
    samples = [replace(s, ts=s.ts - H + math.floor(now) - 600.0) for s in fleet(host, hours=0.1)]
    gpu_a = {"host": host, "uuid": "GPU-a", "start": now - 900, "end": now}
    proc = CollectorProc(data, port).start()
    try:
        for b in batches(samples, host):
            r = httpx.post(f"{proc.url}/api/v1/samples", json=b, timeout=30)
            assert r.status_code == 200, r.text  # the series database is not there: ingest goes on
        usage = httpx.get(f"{proc.url}/api/v1/usage").json()
        assert "gpuledger_collector_series_backlog_samples 0.0" not in httpx.get(f"{proc.url}/metrics").text
        r = httpx.get(f"{proc.url}/api/v1/series", params=gpu_a)
        assert r.status_code == 503 and "unreachable" in r.json()["error"] and "\n" not in r.text
        error = str(r.json()["error"])
    finally:
        proc.kill()  # SIGKILL: nothing shipped, nothing flushed
    with remote() as database:
        proc = CollectorProc(data, port).start()
        try:
            assert httpx.get(f"{proc.url}/api/v1/usage").json() == usage
            deadline = time.monotonic() + 60
            while "gpuledger_collector_series_backlog_samples 0.0" not in httpx.get(f"{proc.url}/metrics").text:
                assert time.monotonic() < deadline, "the backlog was not shipped after the restart"
                time.sleep(0.2)
            store = Store(data / "gpuledger.sqlite")
            try:
                check(database, stored(store))
            finally:
                store.close()
            raw = httpx.get(f"{proc.url}/api/v1/series", params=gpu_a).json()
            assert len(raw) == sum(1 for s in samples if s.gpu_uuid == "GPU-a")
        finally:
            proc.stop()
    return error
