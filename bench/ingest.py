#!/usr/bin/env python3
"""Ingest speed: our collector (real HTTP server + Store, durable group commits, per-job aggregation,
background compaction running) against VictoriaMetrics, on the same generated data, every ratio printed here.

Workload: --hosts hosts x 8 GPUs, 10 fields a sample (sm/dram ratios, power, the energy counter, memory used,
temperature, SM and memory clocks, PCIe tx/rx) as random walks, every GPU on a Slurm job (jobs span 1-4
hosts) running one process, which the collector's samples list as the NVML agent does (pid, memory, the share of
the second it ran; VictoriaMetrics gets the fields only). A collector batch belongs to one host; its shape is 8
GPUs x S consecutive seconds, for each --shapes value (80: the default agent, pushing every 10 s; 600; 5,000).
VictoriaMetrics gets exactly those samples as the same batches of line protocol (`/write`, precision ms). Bodies
are encoded before the clock starts (for the collector by the agent's own encoder, ``agent.push.encode_batch``:
msgpack, one series of columns per GPU), so both measure the server.

For each shape, a fresh pair of servers and two phases:
- new series: each host's first batch (series neither store has seen);
- steady state: later batches of hosts already stored, in --rounds rounds, order alternating.
Each phase posts over --conns keep-alive connections (host h's batches over connection h % conns, in order, as one
agent's connection carries them, the connections kept from phase to phase; an asyncio client on raw sockets, light
beside the servers) for at most --seconds or --points samples. The
collector compacts every --compact seconds during ingest (rollups, merges). With --workers N > 1 the collector is the
real `gpuledger collector serve --workers N` (a supervisor, N workers on the port, a compactor). Server CPU comes
from /proc, summed over the server's process tree (of it, the compactor process's: "of it
compactor"); batches/commit (how many batches the collector's group commits held, on average) from its /metrics
(``gpuledger_collector_group_commit_batches``).

    .venv/bin/python bench/ingest.py                                # all shapes, ~3-4 minutes
    .venv/bin/python bench/ingest.py --shapes 80 --seconds 10       # the fleet shape only
    .venv/bin/python bench/ingest.py --shapes 80 --workers 2        # the collector with two ingest processes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import (  # noqa: E402
    cpu_s,
    descendants,
    free_port,
    group_commits,
    read_response,
    request_bytes,
    serve_workers,
    tree_cpu_s,
    wait_ready,
)

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

GPUS = 8
FIELDS = ("sm_active_ratio", "dram_bw_ratio", "power_watts", "energy_joules", "mem_used_bytes", "temp_celsius",
          "sm_clock_hz", "mem_clock_hz", "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")
INTS = {"mem_used_bytes"}


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Data:
    """Deterministic batches: batch (h, k) is host h, seconds [t0 + k*steps, t0 + (k+1)*steps), the same whichever
    server asks and in whatever order (each batch's values come from a generator of its own; the energy counter
    goes on from where batch k - 1 of the host ended, whoever asked for that one)."""

    def __init__(self, hosts: int, t0: float, steps: int, seed: int = 1) -> None:
        self.hosts, self.t0, self.steps, self.seed = hosts, t0, steps, seed
        self.energy0 = np.random.default_rng(seed).uniform(1e6, 1e8, (hosts, GPUS)).round()
        self._energy_end: dict[tuple[int, int], np.ndarray] = {}  # (host, batch) -> its GPUs' last counter
        self.jobs = []
        rng = np.random.default_rng(seed)
        h = 0
        j = 1000
        while h < hosts:
            span = int(rng.integers(1, 5))
            self.jobs += [str(j)] * span
            h, j = h + span, j + 1

    def _power(self, h: int, k: int) -> np.ndarray:
        r = np.random.default_rng((self.seed, h, k))
        return np.clip(300 + np.cumsum(r.normal(0, 5, (GPUS, self.steps)), axis=1), 60, 700).round(1)

    def _energy_before(self, h: int, k: int) -> np.ndarray:
        """Host h's counters at the end of its batch k - 1 (energy0 before its first)."""
        j = k - 1
        while j >= 0 and (h, j) not in self._energy_end:
            j -= 1
        e = self.energy0[h] if j < 0 else self._energy_end[(h, j)]
        for i in range(j + 1, k):  # the batches no server asked for yet
            e = self._energy_end[(h, i)] = e + np.cumsum(self._power(h, i), axis=1).round()[:, -1]
        return e

    def batch(self, h: int, k: int) -> tuple[str, list[dict]]:
        r = np.random.default_rng((self.seed, h, k, 1))
        host = f"node{h:04d}"
        steps = self.steps
        ts = self.t0 + k * steps + np.arange(steps, dtype=np.float64)
        shape = (GPUS, steps)
        sm = np.clip(0.5 + np.cumsum(r.normal(0, 0.02, shape), axis=1), 0, 1).round(3)
        dram = np.clip(0.3 + np.cumsum(r.normal(0, 0.02, shape), axis=1), 0, 1).round(3)
        power = self._power(h, k)
        energy = self._energy_before(h, k)[:, None] + np.cumsum(power, axis=1).round()
        self._energy_end[(h, k)] = energy[:, -1]
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
                # the job's process, as the NVML agent lists it: pid, memory, the share of the second it ran
                d["processes"] = [[100_000 + g, d["mem_used_bytes"], d["sm_active_ratio"]]]
                out.append(d)
        return host, out


def lp_body(samples: list[dict]) -> bytes:
    lines = []
    for d in samples:
        f = ",".join(f"{k}={d[k]}i" if k in INTS else f"{k}={d[k]!r}" for k in FIELDS)
        lines.append(f"gpu,gpu={d['gpu_index']},host={d['host']},jobid={d['job_ids'][0]},uuid={d['gpu_uuid']} "
                     f"{f} {round(d['ts'] * 1000)}")
    return ("\n".join(lines) + "\n").encode()


class Poster:
    """``conns`` keep-alive connections to one server, kept from phase to phase (as agents keep theirs: with several
    collector workers a host stays with one), on an asyncio client over raw sockets (``loadgen``): about 15 us a
    request on the servers' machine, where http.client's threads cost 150."""

    def __init__(self, port: int, conns: int) -> None:
        self.port = port
        self.loop = uvloop.new_event_loop()
        self.lanes: list[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = [None] * conns

    def post(self, path: str, bodies: list[tuple[int, bytes]], headers: dict, ok: int,
             seconds: float) -> tuple[Counter[int], float]:
        """POST (host, body) pairs until done or ``seconds``: host h's over connection h % conns, in order. ->
        (bodies posted per host, wall seconds)."""
        queues: list[list[tuple[int, bytes]]] = [[] for _ in self.lanes]
        for h, body in bodies:
            queues[h % len(queues)].append((h, request_bytes(path, body, headers)))
        posted: Counter[int] = Counter()
        errors: list[str] = []

        async def lane(c: int, requests: list[tuple[int, bytes]], deadline: float) -> None:
            for h, req in requests:
                if time.monotonic() >= deadline or errors:
                    break
                conn = self.lanes[c]
                if conn is None:
                    conn = self.lanes[c] = await asyncio.open_connection("127.0.0.1", self.port)
                reader, writer = conn
                writer.write(req)
                status, text, close = await read_response(reader)
                if status != ok:
                    errors.append(f"HTTP {status}: {text[:300]!r}")
                    break
                posted[h] += 1
                if close:
                    writer.close()
                    self.lanes[c] = None

        async def run() -> None:
            deadline = time.monotonic() + seconds
            await asyncio.gather(*(lane(c, requests, deadline) for c, requests in enumerate(queues) if requests))

        t0 = time.perf_counter()
        self.loop.run_until_complete(run())
        if errors:
            raise RuntimeError(errors[0])
        return posted, time.perf_counter() - t0

    def close(self) -> None:
        for conn in self.lanes:
            if conn is not None:
                conn[1].close()
        self.loop.close()


def compactor_cpu_s(pid: int) -> float:
    """CPU seconds of the compactor processes below ``pid`` (``python -m gpuledger.collector.compactor``), the part of
    the collector's CPU that compaction takes."""
    total = 0.0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"gpuledger.collector.compactor" in f.read():
                    total += cpu_s(p)
        except OSError:  # ended meanwhile
            pass
    return total


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


def start_collector(a: argparse.Namespace, data: Path, port: int, log_path: Path) -> subprocess.Popen:
    """The collector on ``data``'s embedded store: the inline script (one process), or `gpuledger collector serve
    --workers N` once all its workers listen."""
    if a.workers > 1:
        return serve_workers(data, port, a.workers, f"compact_interval_s = {a.compact}\n", log_path)
    data.mkdir()
    with log_path.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", COLLECTOR, str(data / "gpuledger.sqlite"), str(port),
                                 str(ROOT), str(a.compact)], stdout=out, stderr=subprocess.STDOUT)


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
        gl = start_collector(a, work / "gl", gl_port, work / "gl.log")
        procs.append(gl)
        wait_ready(vm_port, vm, "/health")
        wait_ready(gl_port, gl, "/metrics")
        data = Data(a.hosts, time.time() - 3 * 86400, steps)
        per_phase = max(1, a.points // shape)
        posters = {"vm": Poster(vm_port, a.conns), "gl": Poster(gl_port, a.conns)}

        def bodies(name: str, keys: list[tuple[int, int]]) -> list[tuple[int, bytes]]:
            out = []
            for h, k in keys:
                host, ss = data.batch(h, k)
                if name == "gl":  # the agent's own encoder: series layout, complete columns as raw bytes
                    out.append((h, encode_batch(host, host, k, [GpuSample.from_dict(d) for d in ss], fmt="msgpack")))
                else:
                    out.append((h, lp_body(ss)))
            return out

        def measure(name: str, keys: list[tuple[int, int]]) -> dict:
            pid = vm.pid if name == "vm" else gl.pid
            batch_bodies = bodies(name, keys)
            c0 = tree_cpu_s(pid)
            k0 = compactor_cpu_s(pid) if name == "gl" else 0.0
            g0 = group_commits(gl_port) if name == "gl" else (0.0, 0.0)
            if name == "vm":
                posted, wall = posters["vm"].post("/write?precision=ms", batch_bodies, {}, 204, a.seconds)
            else:
                posted, wall = posters["gl"].post("/api/v1/samples", batch_bodies,
                                                  {"Content-Type": "application/msgpack"}, 200, a.seconds)
            settle(pid)
            n = sum(posted.values())
            g1 = group_commits(gl_port) if name == "gl" else (0.0, 0.0)
            return {"samples": n * shape, "wall_s": wall, "rate": n * shape / wall, "cpu_s": tree_cpu_s(pid) - c0,
                    "compactor_cpu_s": compactor_cpu_s(pid) - k0 if name == "gl" else 0.0, "batches": n,
                    "posted": posted, "commits": g1[1] - g0[1]}

        out: dict[str, dict] = {}
        # new series: each host's first batch (k = 0); both servers get the same hosts
        new_keys = [(h, 0) for h in range(min(a.hosts, per_phase))]
        res = {name: measure(name, new_keys) for name in ("vm", "gl")}
        seen = sorted(set(res["vm"]["posted"]) & set(res["gl"]["posted"]))  # hosts both stores now hold
        out["new"] = res
        log(f"shape {shape} new series: VM {res['vm']['rate']:,.0f}/s, collector {res['gl']['rate']:,.0f}/s")
        # steady state: each host's next batches (each server goes on from the batch it stopped at), the hosts in turn
        cursor = {name: dict.fromkeys(seen, 1) for name in ("vm", "gl")}
        rounds: dict[str, list[dict]] = {"vm": [], "gl": []}
        for rnd in range(a.rounds):
            for name in (["vm", "gl"] if rnd % 2 == 0 else ["gl", "vm"]):
                keys = [(h, cursor[name][h] + j // len(seen)) for j in range(per_phase) for h in [seen[j % len(seen)]]]
                r = measure(name, keys)
                for h, count in r["posted"].items():
                    cursor[name][h] += count
                rounds[name].append(r)
                log(f"shape {shape} steady round {rnd + 1} {name}: {r['rate']:,.0f} samples/s")
        out["steady"] = {k: {"rate": statistics.median(x["rate"] for x in v), "cpu_s": sum(x["cpu_s"] for x in v),
                             "compactor_cpu_s": sum(x["compactor_cpu_s"] for x in v),
                             "samples": sum(x["samples"] for x in v), "batches": sum(x["batches"] for x in v),
                             "commits": sum(x["commits"] for x in v)}
                         for k, v in rounds.items()}
        for poster in posters.values():
            poster.close()
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
    ap.add_argument("--workers", type=int, default=1,
                    help="N > 1: the collector is `gpuledger collector serve --workers N`")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    if a.workers < 1:
        ap.error("--workers must be at least 1")
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
          f"{'VM CPU s/1M':>13}{'coll. CPU s/1M':>16}{'of it compactor':>17}{'CPU ratio':>11}"
          f"{'batches/commit':>16}")
    table = []
    for shape, phases in results.items():
        for phase in ("new", "steady"):
            vm, gl = phases[phase]["vm"], phases[phase]["gl"]
            cpu = {k: x["cpu_s"] / max(x["samples"], 1) * 1e6 for k, x in (("vm", vm), ("gl", gl))}
            row = {"batch": shape, "phase": phase, "vm_samples_per_s": vm["rate"],
                   "collector_samples_per_s": gl["rate"], "ratio": gl["rate"] / vm["rate"],
                   "vm_cpu_s_per_million": cpu["vm"],
                   "collector_cpu_s_per_million": cpu["gl"],
                   "compactor_cpu_s_per_million": gl["compactor_cpu_s"] / max(gl["samples"], 1) * 1e6,
                   "cpu_ratio": cpu["gl"] / max(cpu["vm"], 1e-9),
                   "collector_batches_per_commit": gl["batches"] / max(gl["commits"], 1)}
            table.append(row)
            print(f"{shape:>7} {phase:<8}{vm['rate']:>14,.0f}{gl['rate']:>12,.0f}{row['ratio']:>8.2f}"
                  f"{cpu['vm']:>13.1f}{cpu['gl']:>16.1f}{row['compactor_cpu_s_per_million']:>17.1f}"
                  f"{row['cpu_ratio']:>11.2f}"
                  f"{row['collector_batches_per_commit']:>16.1f}")
    print(f"workload: {a.hosts} hosts x {GPUS} GPUs, {len(FIELDS)} fields and a process a sample (VictoriaMetrics: the "
          f"fields), {a.conns} connections each, "
          f"collector workers {a.workers}, compaction every {a.compact:g} s; "
          f"target: ratio >= 1.5 on the 80-sample steady state")
    if a.json:
        a.json.write_text(json.dumps({"workload": vars(a) | {"json": None}, "table": table}, indent=2))


if __name__ == "__main__":
    main()
