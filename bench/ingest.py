#!/usr/bin/env python3
"""Ingest speed: our collector (real HTTP server + SqliteStore, durable commits, per-job aggregation)
against VictoriaMetrics, interleaved, on the same generated data.

Workload (the issue's): 1,000 hosts x 8 GPUs, 10 fields a sample (sm/dram ratios, power, the energy
counter, memory used, temperature, SM and memory clocks, PCIe tx/rx) as random walks, every GPU on a
Slurm job (jobs span 1-4 hosts). Batches of 5,000 samples: a collector batch belongs to one host (the
collector binds a batch to its host), so a batch is 8 GPUs x 625 consecutive seconds; VictoriaMetrics
gets exactly those samples as the same batches of line protocol (`/write`, precision ms). Two client
connections each. Bodies are encoded before the clock starts (for the collector by the agent's own
encoder, ``agent.push.encode_batch``: msgpack, one series of columns per GPU; line protocol for VM), so
both measure the server.

Each round runs each competitor once (order alternating) for up to --points samples or --seconds;
the figures are medians over rounds. Server CPU comes from /proc (VM) and the collector process;
bytes on disk are measured after VM's force_flush + force_merge and after the collector's
``compact()`` + WAL checkpoint (whose CPU time is added to the collector's).

    .venv/bin/python bench/ingest.py                   # ~2-3 minutes
    .venv/bin/python bench/ingest.py --rounds 1 --points 200000   # a quick look
    .venv/bin/python bench/ingest.py --layout samples             # the row layout (simple clients)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.collector.store import SqliteStore  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
GPUS = 8
STEPS = 625  # seconds per batch per GPU: 8 x 625 = 5,000 samples
FIELDS = ("sm_active_ratio", "dram_bw_ratio", "power_watts", "energy_joules", "mem_used_bytes", "temp_celsius",
          "sm_clock_hz", "mem_clock_hz", "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")
INTS = {"mem_used_bytes"}


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def du(path: Path) -> int:
    total = 0
    for root, _d, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_blocks * 512
            except OSError:
                pass
    return total


class Data:
    """Deterministic batches: batch i is host (i % hosts), seconds [t0 + k*625, t0 + (k+1)*625)."""

    def __init__(self, hosts: int, t0: float, seed: int = 1) -> None:
        self.hosts, self.t0 = hosts, t0
        self.rng = np.random.default_rng(seed)
        self.energy = self.rng.uniform(1e6, 1e8, (hosts, GPUS)).round()
        self.jobs = []
        h = 0
        j = 1000
        while h < hosts:
            span = int(self.rng.integers(1, 5))
            self.jobs += [str(j)] * span
            h, j = h + span, j + 1

    def batch(self, i: int) -> tuple[str, list[dict]]:
        h, k = i % self.hosts, i // self.hosts
        r = self.rng
        host = f"node{h:04d}"
        ts = self.t0 + k * STEPS + np.arange(STEPS, dtype=np.float64)
        shape = (GPUS, STEPS)
        sm = np.clip(0.5 + np.cumsum(r.normal(0, 0.02, shape), axis=1), 0, 1).round(3)
        dram = np.clip(0.3 + np.cumsum(r.normal(0, 0.02, shape), axis=1), 0, 1).round(3)
        power = np.clip(300 + np.cumsum(r.normal(0, 5, shape), axis=1), 60, 700).round(1)
        energy = self.energy[h][:, None] + np.cumsum(power, axis=1).round()
        self.energy[h] = energy[:, -1]
        mem = (60e9 + np.cumsum(r.integers(-2**24, 2**24, shape), axis=1)).astype(np.int64)
        temp = np.clip(50 + np.cumsum(r.integers(-1, 2, shape), axis=1), 30, 90).astype(np.float64)
        smclk = np.where(r.random(shape) < 0.9, 1980e6, 1755e6)
        memclk = np.full(shape, 2619e6)
        tx = r.integers(0, 2_000_000_000, shape).astype(np.float64)
        rx = r.integers(0, 2_000_000_000, shape).astype(np.float64)
        cols = [sm, dram, power, energy, mem, temp, smclk, memclk, tx, rx]
        out = []
        job = self.jobs[h]
        for g in range(GPUS):
            per = [c[g].tolist() for c in cols]
            uuid = f"GPU-{h:04d}-{g}"
            for t, *vals in zip(ts.tolist(), *per):
                d = {"ts": t, "host": host, "gpu_uuid": uuid, "gpu_index": g, "model": "NVIDIA H200",
                     "job_ids": [job]}
                d.update(zip(FIELDS, vals))
                out.append(d)
        return host, out


def lp_body(samples: list[dict]) -> bytes:
    lines = []
    for d in samples:
        f = ",".join(f"{k}={d[k]}i" if k in INTS else f"{k}={d[k]!r}" for k in FIELDS)
        lines.append(f"gpu,gpu={d['gpu_index']},host={d['host']},jobid={d['job_ids'][0]},uuid={d['gpu_uuid']} "
                     f"{f} {round(d['ts'] * 1000)}")
    return ("\n".join(lines) + "\n").encode()


def post_all(port: int, path: str, bodies: list[bytes], headers: dict, ok: int, conns: int,
             seconds: float) -> tuple[int, float]:
    """POST bodies over ``conns`` keep-alive connections until done or ``seconds``; -> (bodies, wall)."""
    q: queue.Queue[int] = queue.Queue()
    for i in range(len(bodies)):
        q.put(i)
    done = [0] * conns
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    def worker(w: int) -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.perf_counter() < deadline and not errors:
            try:
                i = q.get_nowait()
            except queue.Empty:
                break
            c.request("POST", path, bodies[i], headers)
            r = c.getresponse()
            text = r.read()
            if r.status != ok:
                errors.append(f"HTTP {r.status}: {text[:300]!r}")
                break
            done[w] += 1
        c.close()

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    return sum(done), time.perf_counter() - t0


def wait_ready(port: int, path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status < 500:
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready")


def settle(pid: int, idle_s: float = 2.0, limit_s: float = 30.0) -> None:
    """Wait until the server has been idle for ``idle_s`` (background merges finish)."""
    end = time.monotonic() + limit_s
    last = cpu_s(pid)
    quiet = 0.0
    while time.monotonic() < end and quiet < idle_s:
        time.sleep(0.5)
        now = cpu_s(pid)
        quiet = quiet + 0.5 if now - last < 0.02 else 0.0
        last = now


COLLECTOR = """
import sys
sys.path.insert(0, sys.argv[3])
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import SqliteStore
store = SqliteStore(sys.argv[1])
server = CollectorServer(store, port=int(sys.argv[2]))
server.serve_forever()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--points", type=int, default=1_000_000, help="samples per competitor per round (cap)")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds per competitor per round (cap)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", type=int, default=2)
    ap.add_argument("--layout", choices=("series", "samples"), default="series",
                    help="the collector's batch layout: series (what agents send) or samples (one map a sample)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    a = ap.parse_args()
    if not shutil.which("victoria-metrics"):
        sys.exit("victoria-metrics not on PATH (Debian package victoria-metrics)")
    work = Path(tempfile.mkdtemp(prefix="gl-ingest-"))
    procs: list[subprocess.Popen] = []
    try:
        vm_port, gl_port = free_port(), free_port()
        vm = subprocess.Popen(["victoria-metrics", f"-httpListenAddr=127.0.0.1:{vm_port}",
                               f"-storageDataPath={work / 'vm'}", "-retentionPeriod=100y",
                               "-search.latencyOffset=0s"], stdout=(work / "vm.log").open("wb"),
                              stderr=subprocess.STDOUT)
        procs.append(vm)
        db = work / "gl" / "gpuledger.sqlite"
        db.parent.mkdir()
        gl = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(db), str(gl_port), str(ROOT)],
                              stdout=(work / "gl.log").open("wb"), stderr=subprocess.STDOUT)
        procs.append(gl)
        wait_ready(vm_port, "/health", vm)
        wait_ready(gl_port, "/metrics", gl)
        data = Data(a.hosts, t0=time.time() - 3 * 86400)
        nb = max(1, a.points // (GPUS * STEPS))
        cursor = {"vm": 0, "gl": 0}
        results: dict[str, list[dict]] = {"vm": [], "gl": []}
        cache: dict[int, tuple[bytes, bytes]] = {}

        def bodies(start: int, n: int) -> tuple[list[bytes], list[bytes]]:
            for i in range(start, start + n):
                if i not in cache:
                    host, ss = data.batch(i)
                    # the agent's own encoder: series layout, complete columns as raw bytes
                    mp = encode_batch(host, host, i, [GpuSample.from_dict(d) for d in ss], fmt="msgpack",
                                      layout=a.layout)
                    cache[i] = (mp, lp_body(ss))
            return [cache[i][0] for i in range(start, start + n)], [cache[i][1] for i in range(start, start + n)]

        for rnd in range(a.rounds):
            order = ["vm", "gl"] if rnd % 2 == 0 else ["gl", "vm"]
            for name in order:
                mp, lp = bodies(cursor[name], nb)
                pid = vm.pid if name == "vm" else gl.pid
                c0 = cpu_s(pid)
                if name == "vm":
                    n, wall = post_all(vm_port, "/write?precision=ms", lp, {}, 204, a.conns, a.seconds)
                else:
                    n, wall = post_all(gl_port, "/api/v1/samples", mp, {"Content-Type": "application/msgpack"},
                                       200, a.conns, a.seconds)
                settle(pid)
                cpu = cpu_s(pid) - c0
                cursor[name] += n
                samples = n * GPUS * STEPS
                results[name].append({"samples": samples, "wall_s": wall, "rate": samples / wall, "cpu_s": cpu})
                log(f"round {rnd + 1} {name}: {samples} samples in {wall:.1f} s = {samples / wall:,.0f}/s, "
                    f"server CPU {cpu:.1f} s")
                for i in [k for k in cache if k < min(cursor.values())]:
                    del cache[i]
        # bytes on disk: VM after flush + merge; the collector after compaction + checkpoint
        for path in ("/internal/force_flush", "/internal/force_merge"):
            c = http.client.HTTPConnection("127.0.0.1", vm_port, timeout=300)
            c.request("GET", path)
            c.getresponse().read()
        settle(vm.pid, idle_s=3.0, limit_s=60)
        vm_bytes = du(work / "vm")
        gl.terminate()
        gl.wait(30)
        t0 = time.process_time()
        store = SqliteStore(db)
        store.compact(now=time.time())
        store.checkpoint()
        tiers = store.tiers()
        store.close()
        compact_cpu = time.process_time() - t0
        gl_bytes = du(db.parent)
        totals = {k: sum(r["samples"] for r in v) for k, v in results.items()}
        cpu_tot = {k: sum(r["cpu_s"] for r in v) for k, v in results.items()}
        cpu_tot["gl"] += compact_cpu
        rate = {k: statistics.median(r["rate"] for r in v) for k, v in results.items()}
        ratios = [g["rate"] / v["rate"] for g, v in zip(results["gl"], results["vm"])]
        per_m = {k: cpu_tot[k] / totals[k] * 1e6 for k in totals}
        bps = {"vm": vm_bytes / totals["vm"], "gl": gl_bytes / totals["gl"]}
        out = {
            "workload": {"hosts": a.hosts, "gpus": a.hosts * GPUS, "fields": len(FIELDS), "batch": GPUS * STEPS,
                     "layout": a.layout,
                         "conns": a.conns, "rounds": a.rounds},
            "victoria_metrics": {"samples_per_s": rate["vm"], "cpu_s_per_million": per_m["vm"],
                                 "bytes_per_sample": bps["vm"], "samples": totals["vm"]},
            "collector": {"samples_per_s": rate["gl"], "cpu_s_per_million": per_m["gl"],
                          "bytes_per_sample": bps["gl"], "samples": totals["gl"], "compact_cpu_s": compact_cpu,
                          "tiers": tiers},
            "ratio_to_vm": {"samples_per_s": statistics.median(ratios), "cpu_per_sample": per_m["gl"] / per_m["vm"],
                            "bytes_per_sample": bps["gl"] / bps["vm"]},
            "rounds": results,
        }
        print(f"{'':28}{'samples/s':>12}{'CPU s / 1M':>12}{'bytes/sample':>14}")
        print(f"{'VictoriaMetrics /write':28}{rate['vm']:>12,.0f}{per_m['vm']:>12.1f}{bps['vm']:>14.1f}")
        print(f"{'gpuledger collector':28}{rate['gl']:>12,.0f}{per_m['gl']:>12.1f}{bps['gl']:>14.1f}")
        r = out["ratio_to_vm"]
        print(f"{'ratio collector / VM':28}{r['samples_per_s']:>12.2f}{r['cpu_per_sample']:>12.2f}"
              f"{r['bytes_per_sample']:>14.2f}")
        print("targets: samples/s ratio >= 1.0, bytes/sample ratio <= 2.0")
        if a.json:
            a.json.write_text(json.dumps(out, indent=2))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")


if __name__ == "__main__":
    main()
