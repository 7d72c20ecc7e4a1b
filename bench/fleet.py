#!/usr/bin/env python3
"""A fleet of agents against the real collector: N nodes, each pushing every --period seconds what the default
agent pushes (8 GPUs sampled at 1 Hz: 80 samples, msgpack columns from the agent's own encoder,
``agent.push.encode_batch``) over its own keep-alive connection, first pushes spread over one period.

The collector runs in its own process as `collector serve` runs it (Store with durable commits and
per-job aggregation, the asyncio HTTP server, compaction every --compact seconds in a child process, or with
--compaction thread in the collector's). With --workers N > 1 it is the real `gpuledger collector serve --workers N`:
a supervisor, N worker processes on the port and a compactor. Every --report seconds the script prints requests/s,
samples/s, p50/p99 latency of that interval, the collector's CPU and RSS (with workers: the supervisor's and the
workers' together) and its compactor's, how many batches its group commits held on average, how long its
/metrics took to answer (null: not within 10 s, a scraper's usual timeout), the load generator's own CPU and how
busy the whole machine was (they share it: near 100%, the interval measured the machine); at the end the
totals, connection errors, answers by status and the peak RSS of each (summed over the processes).

    .venv/bin/python bench/fleet.py --nodes 2000 --seconds 60
    .venv/bin/python bench/fleet.py --nodes 10000 --seconds 60
    .venv/bin/python bench/fleet.py --nodes 2000 --seconds 60 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.schema.records import GpuProcess, GpuSample  # noqa: E402

COLLECTOR = """
import sys
sys.path.insert(0, sys.argv[4])
from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.gcfreeze import GcFreezer
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
store = Store(sys.argv[1])
if sys.argv[5] == "process":  # as `collector serve` runs it by default (compaction = "process")
    CompactorProcess.beside(store, sys.argv[1], float(sys.argv[3])).start()
store.start_background(float(sys.argv[3]), compact=sys.argv[5] == "thread")
if sys.argv[6] == "on":
    GcFreezer().start()
CollectorServer(store, port=int(sys.argv[2]), max_inflight=4096).serve_forever()
"""


def push_body(node: int, i: int, base: float, period: float) -> bytes:
    """Node ``node``'s push ``i``: the 10 s before it, 8 GPUs at 1 Hz (random-walk values), each GPU running one
    process of the node's job (as the NVML agent lists it)."""
    host = f"node{node:05d}"
    rng = random.Random(node * 100_003 + i)
    t0 = base + period * i - 10
    samples = [GpuSample(ts=t0 + k, host=host, gpu_uuid=f"GPU-{node:05d}-{g}", gpu_index=g, model="NVIDIA H200",
                         sm_active_ratio=round(rng.random(), 3), dram_bw_ratio=round(rng.random(), 3),
                         power_watts=round(200 + 400 * rng.random(), 1),
                         energy_joules=1e6 + 300.0 * (period * i + k), mem_used_bytes=60 * 2**30 + k,
                         temp_celsius=50.0, sm_clock_hz=1.98e9, mem_clock_hz=2.6e9,
                         job_ids=(str(1000 + node // 2),), processes=(GpuProcess(100_000 + g, 60 * 2**30, 0.5),))
               for g in range(8) for k in range(10)]
    return encode_batch(f"agent-{node}", host, i, samples, fmt="msgpack")


def _is_compactor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gpuledger.collector.compactor" in f.read()
    except OSError:
        return False


def figures(pid: int) -> dict[str, dict[str, float]]:
    """CPU seconds, RSS and peak RSS, each summed, of the collector's serving processes (the collector, or the
    supervisor and its workers) and of its compactor (none with --compaction thread)."""
    below = loadgen.descendants(pid)
    groups = {"collector": [pid] + [p for p in below if not _is_compactor(p)],
              "compactor": [p for p in below if _is_compactor(p)]}
    out = {}
    for name, pids in groups.items():
        out[name] = fig = {"cpu_s": 0.0, "rss": 0, "hwm": 0}
        for p in pids:
            try:
                fig["cpu_s"] += loadgen.cpu_s(p)
                fig["rss"] += loadgen.rss_bytes(p)
                fig["hwm"] += loadgen.hwm_bytes(p)
            except OSError:  # gone between the listing and the read
                pass
    return out


def start_collector(a: argparse.Namespace, tmp: Path, port: int) -> subprocess.Popen[Any]:
    """The collector: the inline script (one process), or `gpuledger collector serve --workers N`, once all its
    workers listen."""
    if a.workers == 1:
        return subprocess.Popen([sys.executable, "-c", COLLECTOR, str(tmp / "c.sqlite"), str(port), str(a.compact),
                                 str(ROOT), a.compaction, a.gc_freeze])
    # the inline script's settings: compaction every --compact seconds, 4,096 ingest requests at once (per worker)
    return loadgen.serve_workers(tmp / "data", port, a.workers,
                                 f"compact_interval_s = {a.compact}\nmax_inflight = 4096\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between one node's pushes")
    ap.add_argument("--report", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--compact", type=float, default=30.0, help="collector compaction interval")
    ap.add_argument("--compaction", choices=("process", "thread"), default="process",
                    help="compaction in a child process (the default of `collector serve`) or in the collector's")
    ap.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                    help="freeze long-lived objects out of full GC passes (collector.gcfreeze; `collector serve`: on)")
    ap.add_argument("--workers", type=int, default=1,
                    help="N > 1: `gpuledger collector serve --workers N` (compaction in a process, GC freezing on)")
    a = ap.parse_args()
    if a.workers < 1:
        ap.error("--workers must be at least 1")
    if a.workers > 1 and (a.compaction, a.gc_freeze) != ("process", "on"):
        ap.error("--workers N > 1 runs `collector serve` as it is: --compaction process and --gc-freeze on")
    loadgen.raise_nofile()
    pushes = int(a.seconds / a.period) + 2
    base = time.time()  # samples' time anchor: pushes start after the bodies are encoded, so all lie in the past
    t_enc = time.monotonic()
    headers = {"Content-Type": "application/msgpack"}
    reqs = [[loadgen.request_bytes("/api/v1/samples", push_body(n, i, base, a.period), headers)
             for i in range(pushes)] for n in range(a.nodes)]
    print(f"encoded {a.nodes * pushes} bodies in {time.monotonic() - t_enc:.1f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        port = loadgen.free_port()
        proc = start_collector(a, Path(tmp), port)
        try:
            loadgen.wait_ready(port, proc)
            stats = loadgen.Stats()
            timeline: list[dict] = []

            async def reporter(until: float) -> None:
                f0 = figures(proc.pid)
                seen, cpu0, t0 = 0, f0["collector"]["cpu_s"], time.monotonic()
                own0, machine0 = time.process_time(), loadgen.machine_busy_s()
                samples0, ccpu0 = 0, f0["compactor"]["cpu_s"]
                groups0 = await asyncio.to_thread(loadgen.group_commits, port)
                while time.monotonic() < until + a.period:
                    await asyncio.sleep(a.report)
                    lat = stats.latencies[seen:]
                    now, f = time.monotonic(), figures(proc.pid)
                    own, machine = time.process_time(), loadgen.machine_busy_s()
                    cpu, comp = f["collector"]["cpu_s"], f["compactor"]
                    # a scrape the saturated collector does not answer within its timeout is reported, not fatal:
                    # batches per commit are then counted over the next interval
                    scraped = time.monotonic()
                    try:
                        groups = await asyncio.to_thread(loadgen.group_commits, port)
                        scrape_ms: float | None = round((time.monotonic() - scraped) * 1e3, 1)
                    except OSError:
                        groups, scrape_ms = groups0, None
                    commits = groups[1] - groups0[1]
                    row = {"t_s": round(now - start, 1), "requests_per_s": round(len(lat) / (now - t0), 1),
                           "samples_per_s": round((stats.samples - samples0) / (now - t0)),
                           "p50_ms": loadgen.ms(loadgen.percentile(lat, 0.5)),
                           "p99_ms": loadgen.ms(loadgen.percentile(lat, 0.99)),
                           "cpu_pct": round(100 * (cpu - cpu0) / (now - t0)),
                           "rss_mb": round(f["collector"]["rss"] / 2**20, 1),
                           "compactor_cpu_pct": round(100 * (comp["cpu_s"] - ccpu0) / (now - t0)),
                           "compactor_rss_mb": round(comp["rss"] / 2**20, 1),
                           "batches_per_commit": round((groups[0] - groups0[0]) / commits, 2) if commits else None,
                           "metrics_scrape_ms": scrape_ms, "connection_errors": stats.conn_errors,
                           # the load generator's CPU, and the machine's busy share over all cores: near 100%,
                           # the interval measured the machine, not the collector alone
                           "loadgen_cpu_pct": round(100 * (own - own0) / (now - t0)),
                           "machine_busy_pct": round(100 * (machine[0] - machine0[0])
                                                     / max(machine[1] - machine0[1], 1e-9))}
                    timeline.append(row)
                    print(json.dumps(row), flush=True)
                    seen, cpu0, t0, samples0 = len(stats.latencies), cpu, now, stats.samples
                    own0, machine0 = own, machine
                    ccpu0, groups0 = comp["cpu_s"], groups

            async def run() -> None:
                until = start + a.seconds
                rng = random.Random(1)
                await asyncio.gather(reporter(until), *(
                    loadgen.node("127.0.0.1", port, lambda i, n=n: (reqs[n][min(i, pushes - 1)], 80), a.period,
                                 until, stats, rng) for n in range(a.nodes)))

            start = time.monotonic()
            f0 = figures(proc.pid)
            cpu_start, ccpu_start = f0["collector"]["cpu_s"], f0["compactor"]["cpu_s"]
            groups_start = loadgen.group_commits(port)
            asyncio.run(run())
            wall = a.seconds  # the load window (the last period only lets the last pushes finish)
            f, n = figures(proc.pid), max(len(stats.latencies), 1)
            groups = loadgen.group_commits(port)
            coll, comp = f["collector"], f["compactor"]
            total = {"nodes": a.nodes, "seconds": round(wall, 1), "period_s": a.period,
                     "requests": len(stats.latencies), "requests_per_s": round(len(stats.latencies) / wall, 1),
                     "samples_per_s": round(stats.samples / wall),
                     "p50_ms": loadgen.ms(loadgen.percentile(stats.latencies, 0.5)),
                     "p99_ms": loadgen.ms(loadgen.percentile(stats.latencies, 0.99)),
                     "statuses": stats.statuses, "connection_errors": stats.conn_errors,
                     "error_kinds": stats.error_kinds,
                     "compaction": a.compaction, "gc_freeze": a.gc_freeze, "workers": a.workers,
                     "collector_cpu_ms_per_request": round(1e3 * (coll["cpu_s"] - cpu_start) / n, 2),
                     "compactor_cpu_ms_per_request": round(1e3 * (comp["cpu_s"] - ccpu_start) / n, 2),
                     "collector_peak_rss_mb": round(coll["hwm"] / 2**20, 1),
                     "compactor_peak_rss_mb": round(comp["hwm"] / 2**20, 1),
                     "batches_per_commit": round((groups[0] - groups_start[0]) / max(groups[1] - groups_start[1], 1),
                                                 2),
                     "collector_rss_mb_first_last": [timeline[0]["rss_mb"], timeline[-1]["rss_mb"]] if timeline
                     else None}
            print(json.dumps({"total": total}, indent=1))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
