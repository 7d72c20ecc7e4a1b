#!/usr/bin/env python3
"""Series in VictoriaMetrics or InfluxDB 1.x (``series_url``): what the outbox costs ingest, and how fast the shipper
drains it.

Workload: bench/ingest.py's data, --hosts hosts x 8 GPUs, 10 fields a sample, batches of 8 GPUs x --steps seconds
(10: an agent pushing every 10 s), handed to ``Store.ingest`` in this process as validated batches (columnar
series, as the collector's fast path gives them). Three measurements:

- ingest: seconds per batch into a store without and with ``series_outbox`` (same batches, fresh files), and the
  outbox's share of it;
- render: the backend's rendering of queued chunks (VictoriaMetrics: ``import_body``, /api/v1/import JSON lines;
  InfluxDB: ``write_body``, line protocol), samples per second on one core;
- ship (when ``victoria-metrics``, or ``influxd``, is installed): the queue drained into a real server on loopback
  by ``SeriesShipper`` from start to empty queue: samples per second, and the server's CPU seconds per million.

    .venv/bin/python bench/series_ship.py                 # about a minute
    .venv/bin/python bench/series_ship.py --backend influxdb
    .venv/bin/python bench/series_ship.py --hosts 50 --batches 400
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # servers.py: InfluxDB 1.x on loopback

from ingest import Data  # noqa: E402
from loadgen import cpu_s, free_port, wait_ready  # noqa: E402
from servers import InfluxServer  # noqa: E402

from gpuledger.collector.influxdb import InfluxDB, write_body  # noqa: E402
from gpuledger.collector.series import series_from_samples  # noqa: E402
from gpuledger.collector.series_outbox import OutboxSeriesStore, SeriesShipper, local_retention  # noqa: E402
from gpuledger.collector.series_remote import SeriesTarget  # noqa: E402
from gpuledger.collector.store import Store  # noqa: E402
from gpuledger.collector.validate import Batch  # noqa: E402
from gpuledger.collector.victoriametrics import VictoriaMetrics, import_body  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402


def make_batches(hosts: int, batches: int, steps: int) -> list[Batch]:
    data = Data(hosts=hosts, t0=float(int(time.time()) - 86400), steps=steps)
    out = []
    for i in range(batches):
        h, k = i % hosts, i // hosts
        host, rows = data.batch(h, k)
        per_gpu: dict[str, list[GpuSample]] = {}
        for d in rows:
            s = GpuSample.from_dict(d)
            per_gpu.setdefault(s.gpu_uuid, []).append(s)
        out.append(Batch("bench", k, host, series=tuple(series_from_samples(ss) for ss in per_gpu.values())))
    return out


def ingest_s(path: Path, batches: list[Batch], outbox: bool) -> tuple[float, Store]:
    store = Store(path, series_outbox=outbox, retention=local_retention(600.0), clock=lambda: 2e9)
    t0 = time.perf_counter()
    for b in batches:
        store.ingest(b)
    return (time.perf_counter() - t0) / len(batches), store


def drain(outbox: OutboxSeriesStore, target: SeriesTarget, pid: int, n: int) -> None:
    """Ship the whole queue to ``target`` (served by process ``pid``) and print the rate and the server's CPU."""
    cpu0 = cpu_s(pid)
    shipper = SeriesShipper(outbox, target, interval_s=0.01)
    t0 = time.perf_counter()
    shipper.start()
    assert shipper.flush(600)
    wall = time.perf_counter() - t0
    shipper.close()
    assert shipper.stats.shipped_samples == n and not shipper.stats.dropped_samples
    print(f"ship to {target.name:15s} {n / wall:10,.0f} samples/s  ({target.name} CPU "
          f"{(cpu_s(pid) - cpu0) / n * 1e6:.2f} s per million samples)")


def ship_vm(tmp: Path, outbox: OutboxSeriesStore, n: int) -> None:
    if shutil.which("victoria-metrics") is None:
        print("ship: victoria-metrics not installed, skipped")
        return
    port = free_port()
    with (tmp / "vm.log").open("wb") as log:
        vm = subprocess.Popen(["victoria-metrics", f"-httpListenAddr=127.0.0.1:{port}",
                               f"-storageDataPath={tmp / 'vm'}", "-retentionPeriod=100y",
                               "-dedup.minScrapeInterval=1ms", "-search.latencyOffset=0s"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, vm, "/health")
        drain(outbox, VictoriaMetrics(f"http://127.0.0.1:{port}"), vm.pid, n)
    finally:
        vm.terminate()
        vm.wait(timeout=10)


def ship_influx(tmp: Path, outbox: OutboxSeriesStore, n: int) -> None:
    if shutil.which("influxd") is None:
        print("ship: influxd not installed, skipped")
        return
    with InfluxServer(tmp / "influx") as influx:
        assert influx.proc is not None
        drain(outbox, InfluxDB(influx.url, influx.db), influx.proc.pid, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=20)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10, help="seconds a batch spans (8 GPUs each)")
    ap.add_argument("--backend", choices=("victoriametrics", "influxdb"), default="victoriametrics",
                    help="the series database to render for and ship to")
    a = ap.parse_args()
    batches = make_batches(a.hosts, a.batches, a.steps)
    samples = sum(s.n for b in batches for s in b.series)
    tmp = Path(tempfile.mkdtemp(prefix="series-ship-"))
    try:
        plain, store = ingest_s(tmp / "plain.sqlite", batches, outbox=False)
        store.close()
        shipped, store = ingest_s(tmp / "outbox.sqlite", batches, outbox=True)
        print(f"{len(batches)} batches, {samples} samples ({a.hosts} hosts x 8 GPUs x {a.steps} s)")
        print(f"ingest without outbox   {plain * 1e3:8.3f} ms/batch")
        print(f"ingest with outbox      {shipped * 1e3:8.3f} ms/batch  ({(shipped / plain - 1) * 100:+.0f} %)")
        outbox = store.series_store
        assert isinstance(outbox, OutboxSeriesStore)
        queued = outbox.take(10**9, 10**12)
        chunks = [c for q in queued for c in q.chunks()]
        render = write_body if a.backend == "influxdb" else import_body
        t0 = time.perf_counter()
        body, n = render(chunks)
        took = time.perf_counter() - t0
        print(f"render {a.backend:16s} {n / took:10,.0f} samples/s  ({len(body) / n:.0f} bytes/sample)")
        if a.backend == "influxdb":
            ship_influx(tmp, outbox, n)
        else:
            ship_vm(tmp, outbox, n)
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
