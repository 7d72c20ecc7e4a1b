#!/usr/bin/env python3
"""Scale-out ingest: 1, 2 and 3 `gpuledger collector serve` processes on one PostgreSQL ledger (issue 16), and from
what one sample costs, the collectors and the PostgreSQL write load for 10,000 and 100,000 GPUs at 1 Hz.

The script starts its own PostgreSQL (``tests/servers.py``: initdb + pg_ctl on a free loopback port, fsync on) and,
for each collector count, a fresh database and that many collectors (the real command, ``--ledger-url``). The load is
the fleet's shape (``bench/fleet.py``): --hosts hosts x 8 GPUs, each push 80 samples (8 GPUs x 10 s at 1 Hz; --push-s
for other shapes) as msgpack columns from the agent's own encoder; host h goes to collector h mod N, as agents pick
their own collector (jobs span two hosts, so multi-node jobs are split across collectors). Each host's first batch
goes in before the clock starts (new series); then later batches, host by host in rounds, over --conns keep-alive
connections per collector, each batch once, for at most --seconds. Afterwards the ledger must hold every batch
acknowledged, once.

Per collector: requests/s, samples/s, CPU seconds per 1,000 samples (from /proc). For the ledger: PostgreSQL's own
CPU (its processes, from /proc), transactions (pg_stat_database xact_commit), rows written (tup_inserted + updated +
deleted) and WAL bytes (pg_current_wal_lsn difference; ``pg_waldump --stats`` says how much of it is full-page images),
per request and per sample. A checkpoint starts each run, so each run pays the full-page images of every page it
touches once, as each checkpoint cycle does. PostgreSQL reports a backend's counters when it goes idle, at most every
10 s: the script waits 11 s before reading them. Then what 10,000 and 100,000 GPUs at 1 Hz need, printed with the
planning rules it assumes.

    .venv/bin/python bench/scale.py                                  # 1, 2 and 3 collectors, ~3 minutes
    .venv/bin/python bench/scale.py --collectors 1,2 --seconds 10    # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import loadgen  # noqa: E402
from servers import PostgresServer  # noqa: E402

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.collector.store import open_store  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

GPUS_PER_HOST = 8
FLEET_PUSH_S = 10  # the fleet's shape: 10 s of 1 Hz samples a push, 80 samples
STATS_FLUSH_S = 11.0  # PostgreSQL flushes an idle backend's statistics within 10 s (PGSTAT_IDLE_INTERVAL)
# Planning rules for the projection (printed with it)
COLLECTOR_CORE_BUDGET = 0.6  # of the one core a collector process can use (Python): headroom for bursts
PG_CORE_BUDGET = 0.5  # of PostgreSQL's cores
CHECKPOINT_S = 300.0  # PostgreSQL's default checkpoint_timeout: each hot page is logged whole once per checkpoint


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def start_collector(port: int, data_dir: Path, ledger_url: str | None,
                    series_url: str | None) -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "gpuledger.cli", "collector", "serve", "--data-dir", str(data_dir),
            "--port", str(port), *(["--ledger-url", ledger_url] if ledger_url else [])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if series_url:
        env["GPULEDGER_COLLECTOR_SERIES_URL"] = series_url
    proc = subprocess.Popen(argv, cwd=ROOT, env=env,
                            stdout=(data_dir / "collector.log").open("wb"), stderr=subprocess.STDOUT)
    loadgen.wait_ready(port, proc)
    return proc


def start_victoriametrics(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A VictoriaMetrics single node with the flags the collector's shipper relies on (docs/deploy.md); its URL."""
    workdir.mkdir(parents=True)
    port = loadgen.free_port()
    proc = subprocess.Popen(["victoria-metrics", f"-httpListenAddr=127.0.0.1:{port}",
                             f"-storageDataPath={workdir / 'data'}", "-retentionPeriod=100y",
                             "-dedup.minScrapeInterval=1ms", "-search.latencyOffset=0s"],
                            stdout=(workdir / "vm.log").open("wb"), stderr=subprocess.STDOUT)
    loadgen.wait_ready(port, proc, "/health")
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


class Postgres:
    """Readings of the bench's PostgreSQL: its processes' CPU, the database's counters and the WAL written."""

    def __init__(self, server: PostgresServer) -> None:
        import psycopg  # noqa: PLC0415 - the bench's own dependency on the PostgreSQL driver

        self.server = server
        self.conn = psycopg.connect(server.url, autocommit=True)
        self.pgdata = server.workdir / "pg"
        self.postmaster = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        self.version = str(self._one("SHOW server_version"))

    def _one(self, sql: str, *args: object) -> Any:
        row = self.conn.execute(sql, args).fetchone()
        assert row is not None, sql
        return row[0] if len(row) == 1 else row

    def cpu(self) -> dict[int, float]:
        """CPU seconds of the postmaster's children (backends, WAL writer, checkpointer, ...), by pid."""
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(rest[1]) == self.postmaster:
                    out[int(entry.name)] = (int(rest[11]) + int(rest[12])) / loadgen.CLK_TCK
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        return out

    def counters(self, db: str) -> dict[str, float]:
        """The database's transaction and row counters (as far as backends have reported them)."""
        row = self._one("SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted "
                        "FROM pg_stat_database WHERE datname = %s", db)
        return dict(zip(("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted"),
                        map(float, row), strict=True))

    def checkpoint(self) -> str:
        """Write every dirty page now (a checkpoint then starts each run: the first change of each page after it
        is logged whole, a full-page image), and return the WAL position."""
        self.conn.execute("CHECKPOINT")
        return str(self._one("SELECT pg_current_wal_lsn()"))

    def lsn(self) -> str:
        return str(self._one("SELECT pg_current_wal_lsn()"))

    def wal(self, start: str, end: str) -> dict[str, float]:
        """Bytes of WAL between two positions, and how much of it is full-page images (``pg_waldump --stats``)."""
        total = float(self._one("SELECT pg_wal_lsn_diff(%s, %s)", end, start))
        out = subprocess.run([str(self.server.bin / "pg_waldump"), "--path", str(self.pgdata / "pg_wal"),
                              "--start", start, "--end", end, "--stats"], capture_output=True, text=True, check=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("Total"))
        # Total  N  record-bytes [%]  fpi-bytes [%]  combined [%]
        numbers = [int(t) for t in line.split() if t.isdigit()]
        return {"wal_bytes": total, "wal_records": float(numbers[0]), "wal_record_bytes": float(numbers[1]),
                "wal_fpi_bytes": float(numbers[2])}

    def close(self) -> None:
        self.conn.close()


def push_body(node: int, i: int, base: float, push_s: int) -> bytes:
    """Node ``node``'s push ``i``: 8 GPUs at 1 Hz over the ``push_s`` seconds from base + push_s x i (random-walk
    values; two nodes a job), as ``bench/fleet.py`` makes them for 10 s."""
    host = f"node{node:05d}"
    rng = random.Random(node * 100_003 + i)
    t0 = base + push_s * i
    samples = [GpuSample(ts=t0 + k, host=host, gpu_uuid=f"GPU-{node:05d}-{g}", gpu_index=g, model="NVIDIA H200",
                         sm_active_ratio=round(rng.random(), 3), dram_bw_ratio=round(rng.random(), 3),
                         power_watts=round(200 + 400 * rng.random(), 1),
                         energy_joules=1e6 + 300.0 * (push_s * i + k), mem_used_bytes=60 * 2**30 + k,
                         temp_celsius=50.0, sm_clock_hz=1.98e9, mem_clock_hz=2.6e9, job_ids=(str(1000 + node // 2),))
               for g in range(GPUS_PER_HOST) for k in range(push_s)]
    return encode_batch(f"agent-{node}", host, i, samples, fmt="msgpack")


def bodies(hosts: int, batches: int, base: float, push_s: int) -> list[list[bytes]]:
    """Per host, its request bodies in order."""
    headers = {"Content-Type": "application/msgpack"}
    return [[loadgen.request_bytes("/api/v1/samples", push_body(h, i, base, push_s), headers)
             for i in range(batches)] for h in range(hosts)]


def rounds(reqs: list[list[bytes]], hosts: list[int], start: int, per_batch: int) -> Iterator[tuple[bytes, int]]:
    """Batch ``start`` of every host, then the next one of every host, ...: one host's pushes stay in order and far
    apart, as an agent sends them."""
    for i in range(start, len(reqs[0])):
        for h in hosts:
            yield reqs[h][i], per_batch


def run_config(a: argparse.Namespace, n: int, reqs: list[list[bytes]], pg: Postgres | None, work: Path) -> dict:
    per_batch = GPUS_PER_HOST * a.push_s
    db = f"scale{n}"
    url: str | None = None
    if pg is not None:
        pg.server.psql(f'CREATE DATABASE "{db}"')
        url = pg.server.url_for(db)
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for c in range(n):
            ports.append(loadgen.free_port())
            # one SQLite file for all of them without --ledger-url (the same data dir)
            data_dir = work / (f"c{n}-{c}" if url else f"sqlite{n}")
            procs.append(start_collector(ports[-1], data_dir, url, a.series_url))
        share = [[h for h in range(a.hosts) if h % n == c] for c in range(n)]
        # new series: every host's first batch, before the clock
        warm = [loadgen.Stats() for _ in range(n)]

        async def phase(start: int, stats: list[loadgen.Stats], seconds: float) -> None:
            until = time.monotonic() + seconds
            await asyncio.gather(*(loadgen.post_each("127.0.0.1", ports[c], rounds(reqs, share[c], start, per_batch)
                                                     if start else ((reqs[h][0], per_batch) for h in share[c]),
                                                     a.conns, until, stats[c]) for c in range(n)))

        asyncio.run(phase(0, warm, 600.0))
        if any(s.ok != len(share[c]) for c, s in enumerate(warm)):
            raise RuntimeError(f"warm-up: {[s.statuses for s in warm]} {[s.error_kinds for s in warm]}")
        if pg is not None:
            time.sleep(STATS_FLUSH_S)
        before = pg.counters(db) if pg else {}
        lsn0 = pg.checkpoint() if pg else ""
        pg_cpu0 = pg.cpu() if pg else {}
        vm_cpu0 = loadgen.cpu_s(a.vm_pid) if a.vm_pid else 0.0
        cpu0 = [loadgen.cpu_s(p.pid) for p in procs]
        stats = [loadgen.Stats() for _ in range(n)]
        t0 = time.monotonic()
        asyncio.run(phase(1, stats, a.seconds))
        wall = time.monotonic() - t0
        cpu = [loadgen.cpu_s(p.pid) - c0 for p, c0 in zip(procs, cpu0, strict=True)]
        pg_cpu = sum(v - pg_cpu0.get(pid, 0.0) for pid, v in pg.cpu().items()) if pg else None
        vm_cpu = loadgen.cpu_s(a.vm_pid) - vm_cpu0 if a.vm_pid else None
        wal = pg.wal(lsn0, pg.lsn()) if pg else {}
        if pg is not None:
            time.sleep(STATS_FLUSH_S)
        after = pg.counters(db) if pg else {}
        # every batch acknowledged is in the ledger once
        store = open_store(url, work / f"c{n}-0" if url else work / f"sqlite{n}")
        try:
            stored = store.batches_seen()
        finally:
            store.close()
        acked = sum(s.ok for s in warm) + sum(s.ok for s in stats)
        if stored != acked:
            raise RuntimeError(f"{n} collector(s): {acked} batches acknowledged, {stored} in the ledger")
        d = {k: after[k] - before[k] for k in after}
        if min(s.ok // max(len(share[c]), 1) for c, s in enumerate(stats)) < 1:
            raise RuntimeError(f"{n} collector(s): not every host sent a batch in {a.seconds:g} s: raise --seconds")
        ok = sum(s.ok for s in stats)
        samples = ok * per_batch
        per_collector = [{"collector": c, "requests_per_s": s.ok / wall, "samples_per_s": s.samples / wall,
                          "cpu_s_per_1000_samples": 1e3 * cpu[c] / max(s.samples, 1),
                          "cpu_share": cpu[c] / wall,
                          "p50_ms": loadgen.ms(loadgen.percentile(s.latencies, 0.5)),
                          "p99_ms": loadgen.ms(loadgen.percentile(s.latencies, 0.99)),
                          "statuses": s.statuses, "connection_errors": s.conn_errors}
                         for c, s in enumerate(stats)]
        out: dict[str, Any] = {
            "collectors": n, "wall_s": wall, "requests": ok, "samples": samples,
            "requests_per_s": ok / wall, "samples_per_s": samples / wall,
            "collector_cpu_s_per_1000_samples": 1e3 * sum(cpu) / max(samples, 1),
            "per_collector": per_collector,
        }
        if vm_cpu is not None:
            out["victoriametrics_cpu_s_per_1000_samples"] = 1e3 * vm_cpu / max(samples, 1)
        if pg is not None and pg_cpu is not None:
            rows = d["tup_inserted"] + d["tup_updated"] + d["tup_deleted"]
            steady = wal["wal_bytes"] - wal["wal_fpi_bytes"]
            out["postgres"] = {
                "cpu_s_per_1000_samples": 1e3 * pg_cpu / max(samples, 1), "cpu_share": pg_cpu / wall,
                "xact_per_request": d["xact_commit"] / max(ok, 1), "rollbacks": d["xact_rollback"],
                "rows_per_sample": rows / max(samples, 1), "inserted_per_request": d["tup_inserted"] / max(ok, 1),
                "updated_per_request": d["tup_updated"] / max(ok, 1),
                "deleted_per_request": d["tup_deleted"] / max(ok, 1),
                "wal_bytes_per_sample": wal["wal_bytes"] / max(samples, 1),
                "wal_bytes_per_sample_without_fpi": steady / max(samples, 1),
                # every GPU's hot rows were written in the run (each host sent at least once): the full-page images
                # one checkpoint cycle costs, per GPU
                "wal_fpi_bytes_per_gpu": wal["wal_fpi_bytes"] / (a.hosts * GPUS_PER_HOST),
                "xact_per_s": d["xact_commit"] / wall, "rows_per_s": rows / wall,
                "wal_mb_per_s": wal["wal_bytes"] / wall / 1e6,
            }
        return out
    finally:
        for p in procs:
            stop(p)


def projection(results: list[dict], gpus: int, per_batch: int) -> dict[str, Any]:
    """What ``gpus`` GPUs sampled at 1 Hz need, from the costliest per-sample figures measured (any collector count)."""
    samples_s = float(gpus)
    requests_s = samples_s / per_batch
    coll_cpu = max(r["collector_cpu_s_per_1000_samples"] for r in results) / 1e3
    cores = samples_s * coll_cpu
    out: dict[str, Any] = {"gpus": gpus, "samples_per_s": samples_s, "requests_per_s": requests_s,
                           "collector_cores": cores,
                           # N busy ones, each within its budget of one core, plus one whose loss the others absorb
                           "collectors": math.ceil(cores / COLLECTOR_CORE_BUDGET) + 1}
    pgs = [r["postgres"] for r in results if "postgres" in r]
    if pgs:
        worst = {k: max(p[k] for p in pgs) for k in ("cpu_s_per_1000_samples", "xact_per_request", "rows_per_sample",
                                                     "wal_bytes_per_sample_without_fpi", "wal_fpi_bytes_per_gpu")}
        pg_cores = samples_s * worst["cpu_s_per_1000_samples"] / 1e3
        wal_s = (samples_s * worst["wal_bytes_per_sample_without_fpi"]
                 + gpus * worst["wal_fpi_bytes_per_gpu"] / CHECKPOINT_S)
        out["postgres"] = {"cores": pg_cores, "cores_planned": math.ceil(pg_cores / PG_CORE_BUDGET),
                           # group commit joins requests only under load: plan one transaction a request at least
                           "xact_per_s": requests_s * max(1.0, worst["xact_per_request"]),
                           "rows_per_s": samples_s * worst["rows_per_sample"],
                           "wal_mb_per_s": wal_s / 1e6, "wal_gb_per_day": wal_s * 86400 / 1e9}
    return out


def report(a: argparse.Namespace, results: list[dict]) -> None:
    per_batch = GPUS_PER_HOST * a.push_s
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores shared with other jobs (load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the end); collectors, PostgreSQL and the load generator share them: plan with the "
          "figures per sample; the rates are what this machine gave")
    ledger = (f"PostgreSQL {a.pg_version} (fsync on, synchronous_commit on)" if a.ledger == "postgresql"
              else "one SQLite file")
    print(f"load: {a.hosts} hosts x {GPUS_PER_HOST} GPUs, {per_batch}-sample msgpack pushes (agent encoder, "
          f"{a.push_s} s a push), "
          f"{a.conns} connections per collector, each batch once, at most {a.seconds:g} s per run; ledger: {ledger}; "
          f"series: {'VictoriaMetrics (series_url)' if a.series_url else 'in the ledger (chunk store)'}")
    print()
    print(f"{'coll.':>5} {'#':>3} {'req/s':>8} {'samples/s':>10} {'CPU s/1k samples':>17} {'CPU use':>8} "
          f"{'p50 ms':>8} {'p99 ms':>8}  answers")
    for r in results:
        for c in r["per_collector"]:
            print(f"{r['collectors']:>5} {c['collector']:>3} {c['requests_per_s']:>8.1f} "
                  f"{c['samples_per_s']:>10,.0f} {c['cpu_s_per_1000_samples']:>17.3f} {100 * c['cpu_share']:>7.0f}% "
                  f"{c['p50_ms'] or 0:>8.1f} {c['p99_ms'] or 0:>8.1f}  {c['statuses']}, "
                  f"{c['connection_errors']} connection errors")
        vm = r.get("victoriametrics_cpu_s_per_1000_samples")
        print(f"{r['collectors']:>5} {'all':>3} {r['requests_per_s']:>8.1f} {r['samples_per_s']:>10,.0f} "
              f"{r['collector_cpu_s_per_1000_samples']:>17.3f}"
              + (f"  (VictoriaMetrics: {vm:.3f} CPU s/1k samples)" if vm is not None else ""))
    if any("postgres" in r for r in results):
        print()
        print(f"PostgreSQL per run (a checkpoint starts each run): its CPU, its writes per request ({per_batch} "
              "samples) and per sample, WAL with and without full-page images (FPI), the FPIs per GPU")
        print(f"{'coll.':>5} {'CPU s/1k samples':>17} {'CPU use':>8} {'xact/req':>9} {'ins/req':>8} {'upd/req':>8} "
              f"{'del/req':>8} {'rows/sample':>12} {'WAL B/sample':>13} {'w/o FPI':>8} {'FPI KB/GPU':>11} "
              f"{'xact/s':>8} {'WAL MB/s':>9}")
        for r in results:
            p = r["postgres"]
            print(f"{r['collectors']:>5} {p['cpu_s_per_1000_samples']:>17.3f} {100 * p['cpu_share']:>7.0f}% "
                  f"{p['xact_per_request']:>9.2f} {p['inserted_per_request']:>8.2f} {p['updated_per_request']:>8.2f} "
                  f"{p['deleted_per_request']:>8.2f} {p['rows_per_sample']:>12.3f} {p['wal_bytes_per_sample']:>13.1f} "
                  f"{p['wal_bytes_per_sample_without_fpi']:>8.1f} {p['wal_fpi_bytes_per_gpu'] / 1e3:>11.2f} "
                  f"{p['xact_per_s']:>8.1f} {p['wal_mb_per_s']:>9.2f}")
    print()
    print(f"projection at 1 Hz in {per_batch}-sample pushes, from the costliest per-sample figures above. "
          f"Collectors: each within {COLLECTOR_CORE_BUDGET:.0%} of a core, plus one spare. PostgreSQL: cores at "
          f"{PG_CORE_BUDGET:.0%} use; at least one transaction a request (group commit joins them only under load); "
          f"WAL = per sample without FPI + each GPU's FPIs once per checkpoint ({CHECKPOINT_S:g} s, the default "
          "checkpoint_timeout)")
    for gpus in (10_000, 100_000):
        p = projection(results, gpus, per_batch)
        line = (f"{gpus:>7,} GPUs: {p['samples_per_s']:>7,.0f} samples/s, {p['requests_per_s']:>5,.0f} requests/s; "
                f"collectors {p['collector_cores']:.1f} cores -> {p['collectors']} collector processes")
        if "postgres" in p:
            q = p["postgres"]
            line += (f"; PostgreSQL {q['cores']:.1f} cores (plan {q['cores_planned']}), {q['xact_per_s']:,.0f} "
                     f"transactions/s, {q['rows_per_s']:,.0f} rows/s, WAL {q['wal_mb_per_s']:.1f} MB/s "
                     f"({q['wal_gb_per_day']:,.0f} GB/day)")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectors", default="1,2,3", help="collector counts to run, comma-separated")
    ap.add_argument("--hosts", type=int, default=1000, help="simulated hosts (8 GPUs each)")
    ap.add_argument("--batches", type=int, default=12, help="pushes encoded per host (the first one warms up)")
    ap.add_argument("--push-s", type=int, default=FLEET_PUSH_S,
                    help="seconds of 1 Hz samples in a push (10: the fleet's 80-sample shape)")
    ap.add_argument("--seconds", type=float, default=20.0, help="most seconds a run posts for")
    ap.add_argument("--conns", type=int, default=8, help="keep-alive connections per collector")
    ap.add_argument("--ledger", choices=("postgresql", "sqlite"), default="postgresql",
                    help="sqlite: the collectors share one SQLite file (for comparison)")
    ap.add_argument("--series", choices=("ledger", "vm"), default="ledger",
                    help="vm: the collectors ship series to a VictoriaMetrics the script starts (series_url)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    a.series_url, a.vm_pid = None, None
    counts = [int(x) for x in a.collectors.split(",")]
    base = time.time() - a.push_s * (a.batches + 2)  # every sample in the past
    t_enc = time.monotonic()
    reqs = bodies(a.hosts, a.batches, base, a.push_s)
    log(f"encoded {a.hosts * a.batches} bodies in {time.monotonic() - t_enc:.1f} s")
    work = Path(tempfile.mkdtemp(prefix="gl-scale-"))
    results: list[dict] = []
    vm: subprocess.Popen[bytes] | None = None
    try:
        if a.series == "vm":
            vm, a.series_url = start_victoriametrics(work / "vm")
            a.vm_pid = vm.pid
        if a.ledger == "postgresql":
            with PostgresServer(work / "pg") as server:
                pg = Postgres(server)
                a.pg_version = pg.version
                try:
                    for n in counts:
                        results.append(run_config(a, n, reqs, pg, work))
                        log(f"{n} collector(s): {results[-1]['samples_per_s']:,.0f} samples/s")
                finally:
                    pg.close()
        else:
            for n in counts:
                results.append(run_config(a, n, reqs, None, work))
                log(f"{n} collector(s): {results[-1]['samples_per_s']:,.0f} samples/s")
    finally:
        if vm is not None:
            stop(vm)
        shutil.rmtree(work, ignore_errors=True)
    report(a, results)
    if a.json:
        a.json.write_text(json.dumps({"workload": {k: v for k, v in vars(a).items() if k != "json"},
                                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
