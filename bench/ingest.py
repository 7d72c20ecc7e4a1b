#!/usr/bin/env python3
"""Ingest speed: our collector (real HTTP server + Store, durable group commits, per-job aggregation,
background compaction running) against VictoriaMetrics, on the same generated data, every ratio printed here.

Workload: --hosts hosts x 8 GPUs, 10 fields a sample (sm/dram ratios, power, the energy counter, memory used,
temperature, SM and memory clocks, PCIe tx/rx) as random walks, every GPU on a Slurm job (jobs span 1-4
hosts). A collector batch belongs to one host; its shape is 8 GPUs x S consecutive seconds, for each
--shapes value (80: the default agent, pushing every 10 s; 600; 5,000). VictoriaMetrics gets exactly those
samples as the same batches of line protocol (`/write`, precision ms). Bodies are encoded before the clock
starts (for the collector by the agent's own encoder, ``agent.push.encode_batch``: msgpack, one series of
columns per GPU), so both measure the server.

For each shape, a fresh pair of servers and two phases:
- new series: each host's first batch (series neither store has seen);
- steady state: later batches of hosts already stored, in --rounds rounds, order alternating.
Each phase posts over --conns keep-alive connections for at most --seconds or --points samples. The
collector compacts every --compact seconds during ingest (rollups, merges). Server CPU comes from /proc.

    .venv/bin/python bench/ingest.py                                # all shapes, ~3-4 minutes
    .venv/bin/python bench/ingest.py --shapes 80 --seconds 10       # the fleet shape only
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import shutil
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
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import free_port, tree_cpu_s, wait_ready  # noqa: E402

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

GPUS = 8
FIELDS = ("sm_active_ratio", "dram_bw_ratio", "power_watts", "energy_joules", "mem_used_bytes", "temp_celsius",
          "sm_clock_hz", "mem_clock_hz", "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")
INTS = {"mem_used_bytes"}


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Data:
    """Deterministic batches: batch (h, k) is host h, seconds [t0 + k*steps, t0 + (k+1)*steps)."""

    def __init__(self, hosts: int, t0: float, steps: int, seed: int = 1) -> None:
        self.hosts, self.t0, self.steps = hosts, t0, steps
        self.rng = np.random.default_rng(seed)
        self.energy = self.rng.uniform(1e6, 1e8, (hosts, GPUS)).round()
        self.jobs = []
        h = 0
        j = 1000
        while h < hosts:
            span = int(self.rng.integers(1, 5))
            self.jobs += [str(j)] * span
            h, j = h + span, j + 1

    def batch(self, h: int, k: int) -> tuple[str, list[dict]]:
        r = self.rng
        host = f"node{h:04d}"
        steps = self.steps
        ts = self.t0 + k * steps + np.arange(steps, dtype=np.float64)
        shape = (GPUS, steps)
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


def settle(pid: int, idle_s: float = 2.0, limit_s: float = 30.0) -> None:
    """Wait until the server has been idle for ``idle_s`` (background merges finish)."""
    end = time.monotonic() + limit_s
    last = tree_cpu_s(pid)
    quiet = 0.0
    while time.monotonic() < end and quiet < idle_s:
        time.sleep(0.5)
        now = tree_cpu_s(pid)
        quiet = quiet + 0.5 if now - last < 0.02 else 0.0
        last = now


COLLECTOR = """
import sys
sys.path.insert(0, sys.argv[3])
from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.gcfreeze import GcFreezer
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
store = Store(sys.argv[1])
# as `collector serve` runs it: compaction during ingest, in a child process (its CPU is counted with the collector's)
CompactorProcess.beside(store, sys.argv[1], float(sys.argv[4])).start()
store.start_background(float(sys.argv[4]), compact=False)
GcFreezer().start()
server = CollectorServer(store, port=int(sys.argv[2]))
server.serve_forever()
"""


def run_shape(a: argparse.Namespace, shape: int, work: Path) -> dict:
    """Fresh servers, the new-series phase, then steady-state rounds; the phases' figures."""
    steps = shape // GPUS
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
        gl = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(db), str(gl_port), str(ROOT), str(a.compact)],
                              stdout=(work / "gl.log").open("wb"), stderr=subprocess.STDOUT)
        procs.append(gl)
        wait_ready(vm_port, vm, "/health")
        wait_ready(gl_port, gl, "/metrics")
        data = Data(a.hosts, time.time() - 3 * 86400, steps)
        per_phase = max(1, a.points // shape)

        def bodies(keys: list[tuple[int, int]]) -> tuple[list[bytes], list[bytes]]:
            mp, lp = [], []
            for h, k in keys:
                host, ss = data.batch(h, k)
                # the agent's own encoder: series layout, complete columns as raw bytes
                mp.append(encode_batch(host, host, k, [GpuSample.from_dict(d) for d in ss], fmt="msgpack"))
                lp.append(lp_body(ss))
            return mp, lp

        def measure(name: str, mp: list[bytes], lp: list[bytes]) -> dict:
            pid = vm.pid if name == "vm" else gl.pid
            c0 = tree_cpu_s(pid)
            if name == "vm":
                n, wall = post_all(vm_port, "/write?precision=ms", lp, {}, 204, a.conns, a.seconds)
            else:
                n, wall = post_all(gl_port, "/api/v1/samples", mp, {"Content-Type": "application/msgpack"}, 200,
                                   a.conns, a.seconds)
            settle(pid)
            samples = n * shape
            return {"samples": samples, "wall_s": wall, "rate": samples / wall, "cpu_s": tree_cpu_s(pid) - c0,
                    "batches": n}

        out: dict[str, dict] = {}
        # new series: each host's first batch (k = 0); both servers get the same hosts
        new_keys = [(h, 0) for h in range(min(a.hosts, per_phase))]
        mp, lp = bodies(new_keys)
        res = {name: measure(name, mp, lp) for name in ("vm", "gl")}
        seen = min(res["vm"]["batches"], res["gl"]["batches"])  # hosts both stores now hold
        out["new"] = res
        log(f"shape {shape} new series: VM {res['vm']['rate']:,.0f}/s, collector {res['gl']['rate']:,.0f}/s")
        # steady state: later batches of hosts both hold (each server continues where it stopped)
        cursor = {"vm": 0, "gl": 0}
        rounds: dict[str, list[dict]] = {"vm": [], "gl": []}
        for rnd in range(a.rounds):
            for name in (["vm", "gl"] if rnd % 2 == 0 else ["gl", "vm"]):
                keys = [(j % seen, 1 + j // seen) for j in range(cursor[name], cursor[name] + per_phase)]
                mp, lp = bodies(keys)
                r = measure(name, mp, lp)
                cursor[name] += r["batches"]
                rounds[name].append(r)
                log(f"shape {shape} steady round {rnd + 1} {name}: {r['rate']:,.0f} samples/s")
        out["steady"] = {k: {"rate": statistics.median(x["rate"] for x in v),
                             "cpu_s": sum(x["cpu_s"] for x in v), "samples": sum(x["samples"] for x in v)}
                         for k, v in rounds.items()}
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--shapes", default="80,600,5000", help="samples per batch (8 GPUs x seconds), comma-separated")
    ap.add_argument("--points", type=int, default=400_000, help="samples per competitor per phase or round (cap)")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds per competitor per phase or round (cap)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", type=int, default=32, help="keep-alive connections per competitor")
    ap.add_argument("--compact", type=float, default=5.0, help="collector compaction interval during ingest")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    if not shutil.which("victoria-metrics"):
        sys.exit("victoria-metrics not on PATH (Debian package victoria-metrics)")
    shapes = [int(x) for x in a.shapes.split(",")]
    if any(x % GPUS for x in shapes):
        sys.exit(f"--shapes: each must be a multiple of {GPUS} (8 GPUs a batch)")
    results = {}
    for shape in shapes:
        work = Path(tempfile.mkdtemp(prefix="gl-ingest-"))
        try:
            results[shape] = run_shape(a, shape, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'batch':>7} {'phase':<8}{'VM samples/s':>14}{'collector':>12}{'ratio':>8}"
          f"{'VM CPU s/1M':>13}{'coll. CPU s/1M':>16}{'CPU ratio':>11}")
    table = []
    for shape, phases in results.items():
        for phase in ("new", "steady"):
            vm, gl = phases[phase]["vm"], phases[phase]["gl"]
            cpu = {k: x["cpu_s"] / max(x["samples"], 1) * 1e6 for k, x in (("vm", vm), ("gl", gl))}
            row = {"batch": shape, "phase": phase, "vm_samples_per_s": vm["rate"],
                   "collector_samples_per_s": gl["rate"], "ratio": gl["rate"] / vm["rate"],
                   "vm_cpu_s_per_million": cpu["vm"],
                   "collector_cpu_s_per_million": cpu["gl"], "cpu_ratio": cpu["gl"] / max(cpu["vm"], 1e-9)}
            table.append(row)
            print(f"{shape:>7} {phase:<8}{vm['rate']:>14,.0f}{gl['rate']:>12,.0f}{row['ratio']:>8.2f}"
                  f"{cpu['vm']:>13.1f}{cpu['gl']:>16.1f}{row['cpu_ratio']:>11.2f}")
    print(f"workload: {a.hosts} hosts x {GPUS} GPUs, {len(FIELDS)} fields, {a.conns} connections each, "
          f"collector compaction every {a.compact:g} s; target: ratio >= 1.5 on the 80-sample steady state")
    if a.json:
        a.json.write_text(json.dumps({"workload": vars(a) | {"json": None}, "table": table}, indent=2))


if __name__ == "__main__":
    main()
