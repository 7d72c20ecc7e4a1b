"""Priority at scheduler scale on a real Slurm 22.05: batched `priority apply`, and job end to new site factor.

Plain script, as root (it brings up the test suite's single-node cluster, tests/slurm/slurm_cluster.py with
slurm-localhost.sh, on free loopback ports, MaxJobCount raised through SLH_MAX_JOBS, no job_submit.lua)::

    python bench/priority.py [--jobs 1000 10000] [--users 12] [--array-share 0.1] [--array-size 100]

For each N: submits N pending jobs (the partition is down, so nothing starts; sprio lists them) as --users users
in 4 accounts, a share of them as job arrays, then times, through the library the CLI uses (run_apply):

- ``apply``: every record changes (two feeds alternate): squeue + sprio + plan + scontrol, with the number of
  scontrol calls;
- ``no-change``: the same feed again (squeue + sprio + plan, no scontrol);
- ``serial``: every record changes again, one command at a time (``parallel=1``: one scontrol per factor and
  command line), to show what the concurrent commands bring;
- ``reference``: the old way, one ``scontrol update jobid=N`` per job, over the first 300 records, projected
  to 1,000 jobs;
- ``lag``: `gpuledger priority watch` runs as a daemon (policy "allocated", so a job record alone moves
  fairshare); a 1-GPU job runs on a second partition and ends; the lag is from its end (sacct End, whole
  seconds) to the moment sprio shows the new factor on a pending job of the same user, and the daemon's own
  gpuledger_priority_lag_seconds metric.

Prints seconds per 1,000 jobs, and the projection to 100,000 jobs (linear in records from the largest N).
Targets: 10,000 pending jobs applied in at most 5 s, a no-change apply in at most 1 s, job end to new factor in
at most 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "slurm"))

from slurm_cluster import PARTITION, SlurmCluster, free_ports, running_cluster  # noqa: E402

from gpuledger.accounting.apply import PARALLEL, run_apply  # noqa: E402
from gpuledger.accounting.priority import PriorityEntry  # noqa: E402

TARGET_APPLY_10K_S = 5.0
TARGET_NOCHANGE_S = 1.0
TARGET_LAG_S = 60.0
GPULEDGER = str(Path(sys.executable).parent / "gpuledger")  # the venv's entry point
ACCOUNTS = ("bench_a", "bench_b", "bench_c", "bench_d")


def users(n: int) -> dict[str, str]:
    return {f"gpb{i:02d}": ACCOUNTS[i % len(ACCOUNTS)] for i in range(n)}


def feed(assoc: dict[str, str], salt: int) -> list[PriorityEntry]:
    """A distinct factor per user, different for each salt (so a second feed changes every record)."""
    return [PriorityEntry(a, u, 0.5, 1000 + 37 * i + 500 * salt, 0.0, 0.0, 0.5)
            for i, (u, a) in enumerate(sorted(assoc.items()))]


def submit(c: SlurmCluster, assoc: dict[str, str], n: int, array_share: float, array_size: int) -> tuple[int, int]:
    """n pending jobs round-robin over the users: arrays of array_size tasks for array_share of them."""
    n_arrays = int(n * array_share) // array_size
    singles = n - n_arrays * array_size
    names = sorted(assoc)
    base = ["sbatch", "--parsable", "-p", PARTITION, "-o", "/dev/null", f"--chdir={c.dir / 'jobs'}"]

    def one(i: int, array: bool) -> None:
        u = names[i % len(names)]
        extra = [f"--array=1-{array_size}"] if array else []
        c.cmd(*base, f"--uid={u}", "-A", assoc[u], *extra, "--wrap", "sleep 60")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: one(i, False), range(singles)))
        list(pool.map(lambda i: one(i, True), range(n_arrays)))
    return singles, n_arrays


def drained(c: SlurmCluster) -> None:
    """Wait until slurmctld has handed every queued accounting message to slurmdbd (sdiag)."""
    def empty() -> bool:
        m = re.search(r"DBD Agent queue size:\s*(\d+)", c.cmd("sdiag"))
        return m is not None and m.group(1) == "0"

    c.wait("slurmctld's DBD agent queue to drain", empty, timeout_s=300, every_s=0.5)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def clear(c: SlurmCluster, assoc: dict[str, str]) -> None:
    for u in assoc:
        c.cmd("scancel", "-u", u, check=False)
    c.wait("the queue to empty", lambda: not c.cmd("squeue", "-h", "-t", "PD,R,CG", "-o", "%i").strip(),
           timeout_s=300, every_s=0.5)


def measure_apply(c: SlurmCluster, assoc: dict[str, str], n: int, args) -> dict:
    client = c.client()
    t_sub, (singles, arrays) = timed(lambda: submit(c, assoc, n, args.array_share, args.array_size))
    c.wait("sprio to list every record", lambda: len(client.site_factors()) >= singles + arrays,
           timeout_s=120, every_s=0.5)
    out = {"jobs": n, "singles": singles, "arrays": arrays, "submit_s": t_sub}
    # each figure: 3 runs; apply and serial interleaved, alternating between two feeds so that every record
    # changes; each run starts once slurmctld's queue to slurmdbd (one message per update) has drained
    plan_runs = [("apply", 1, PARALLEL), ("serial", 2, 1), ("apply", 1, PARALLEL), ("serial", 2, 1),
                 ("apply", 1, PARALLEL), ("serial", 2, 1), ("no-change", 2, PARALLEL), ("no-change", 2, PARALLEL),
                 ("no-change", 2, PARALLEL)]
    runs: dict[str, list[dict]] = {}
    for label, salt, parallel in plan_runs:
        drained(c)
        t, (plan, applied) = timed(
            lambda salt=salt, parallel=parallel: run_apply(client, feed(assoc, salt), parallel=parallel))
        assert plan.jobs == n, (plan.jobs, n)
        assert applied.count("failed") == 0 and not plan.skipped
        runs.setdefault(label, []).append({"s": t, "calls": applied.calls, "changed": len(applied.outcomes)})
    for label, rs in runs.items():
        out[label] = {"runs": rs, "best_s": min(r["s"] for r in rs), "median_s": sorted(r["s"] for r in rs)[1]}
    # the old way on a sample: one scontrol per record
    sample = [ch for ch in run_apply(client, feed(assoc, 3), dry_run=True)[1].outcomes][:300]
    drained(c)
    t0 = time.perf_counter()
    for o in sample:
        client.set_site_factors([o.change.job_id], o.change.new_factor)
    out["reference"] = {"s": time.perf_counter() - t0, "records": len(sample),
                        "jobs": sum(o.change.tasks for o in sample)}
    return out


def agent_report(data: Path, job: str, start: float, end: float, host: str) -> None:
    """What the node agent of ``host`` (the node Slurm ran the job on: usage from a host its record does not list is
    not charged to the job) sends for the job's GPU (there is no GPU here): one sample a second, into the ledger
    through the collector's store, as the collector does with an agent's batch."""
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    samples = tuple(GpuSample(ts=t, host=host, gpu_uuid="GPU-bench-0", gpu_index=0, job_ids=(job,))
                    for t in range(int(start), int(end) + 1))
    store = Store(data / "gpuledger.sqlite")
    try:
        store.ingest(Batch("bench", int(end), host, samples))
    finally:
        store.close()


def measure_lag(c: SlurmCluster, assoc: dict[str, str], data: Path, port: int, user: str) -> dict:
    """Job end -> new factor on a pending job of the same user, with `gpuledger priority watch` running."""
    env = {**os.environ, "SLURM_CONF": str(c.conf)}
    node = socket.gethostname().split(".")[0]
    c.cmd("scontrol", "create", "partitionname=run", f"nodes={node}", "state=up", check=False)
    client = c.client()
    pending = c.cmd("squeue", "-h", "-t", "PD", "-u", user, "-o", "%A").split()[0]
    watch = subprocess.Popen(
        [GPULEDGER, "priority", "watch", "--data-dir", str(data),
         "--associations", str(data / "assoc.txt"), "--poll", "2", "--min-interval", "5",
         "--metrics-port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=open(data / "watch.log", "w"))
    try:
        c.wait("the watch daemon's first cycle", lambda: (metric(port, 'gpuledger_priority_cycles_total{result="ok"}')
                                                          or 0) >= 1, timeout_s=180, every_s=0.5)
        first = client.site_factors()[pending]
        job = c.cmd("sbatch", "--parsable", f"--uid={user}", "-A", assoc[user], "-p", "run", "--gres=gpu:1",
                    "-o", "/dev/null", f"--chdir={c.dir / 'jobs'}", "--wrap", "sleep 3").strip()

        def ended() -> float | None:
            out = c.cmd("sacct", "-n", "-X", "-P", "-j", job, "-o", "State,End").strip()
            state, _, end = out.partition("|")
            if state in ("COMPLETED", "FAILED") and end not in ("", "Unknown"):
                return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))
            return None

        end = c.wait(f"job {job} to end", ended, timeout_s=60, every_s=0.2)
        agent_report(data, job, end - 3, end, node)
        new = c.wait("the new factor", lambda: (client.site_factors().get(pending) or first) != first
                     and client.site_factors()[pending], timeout_s=120, every_s=0.2)
        seen = time.time()
        # the metric is set when the cycle's apply returns, a moment after sprio shows the factor
        lag_metric = c.wait("the lag metric", lambda: metric(port, "gpuledger_priority_lag_seconds"),
                            timeout_s=30, every_s=0.2)
        return {"job": job, "factor_before": first, "factor_after": new, "lag_s": seen - end, "metric_s": lag_metric}
    except AssertionError:
        print("watch daemon log (tail):\n" + "\n".join((data / "watch.log").read_text().splitlines()[-30:]))
        raise
    finally:
        watch.terminate()
        watch.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, nargs="+", default=[1000, 10_000])
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--array-share", type=float, default=0.1, help="share of the jobs submitted as array tasks")
    ap.add_argument("--array-size", type=int, default=100)
    ap.add_argument("--no-lag", action="store_true")
    args = ap.parse_args()
    assoc = users(args.users)
    extra = {"SLH_USERS": " ".join(f"{u}:{a}" for u, a in assoc.items()), "SLH_GPUS": "2",
             "SLH_MAX_JOBS": str(2 * max(args.jobs) + 10_000), "SLH_DELETE_USERS": "1"}
    print(f"# bench/priority.py: Slurm 22.05 single node, {args.users} users in {len(ACCOUNTS)} accounts, "
          f"{args.array_share:.0%} of the jobs in arrays of {args.array_size}; python {sys.version.split()[0]}")
    results = []
    with running_cluster(extra_env=extra, with_lua=False) as c, tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=down")
        (data / "assoc.txt").write_text(c.cmd("sacctmgr", "-P", "show", "associations",
                                              "format=Cluster,Account,User,ParentName,Share"))
        (data / "gpuledger.toml").write_text('[accounting]\nalgorithm = "fair-tree"\npolicy = "allocated"\n'
                                             'priority_weight = 10000\n')
        subprocess.run([GPULEDGER, "jobs", "import", "--slurm", "--data-dir", str(data)],
                       env={**os.environ, "SLURM_CONF": str(c.conf)}, check=True, capture_output=True)
        port = free_ports(1)[0]
        for i, n in enumerate(args.jobs):
            r = measure_apply(c, assoc, n, args)
            if not args.no_lag:  # a user without usage yet, so that its job's end moves its fairshare
                r["lag"] = measure_lag(c, assoc, data, port, sorted(assoc)[i % len(assoc)])
                c.cmd("scontrol", "delete", "partitionname=run", check=False)
            results.append(r)
            report(r)
            clear(c, assoc)
    largest = results[-1]
    scale = 100_000 / largest["jobs"]
    print(f"projection to 100,000 pending jobs (linear in jobs from N={largest['jobs']:,}, medians): apply "
          f"{largest['apply']['median_s'] * scale:.1f} s, no-change {largest['no-change']['median_s'] * scale:.1f} s")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("json: " + json.dumps(results))


def report(r: dict) -> None:
    n = r["jobs"]
    print(f"N={n:,} pending jobs ({r['singles']:,} single, {r['arrays']} array(s)): submitted in {r['submit_s']:.1f} s")
    for label in ("apply", "serial", "no-change"):
        x = r[label]
        target = TARGET_NOCHANGE_S if label == "no-change" else TARGET_APPLY_10K_S * n / 10_000
        calls = "/".join(str(run["calls"]) for run in x["runs"])
        changed = "/".join(f"{run['changed']:,}" for run in x["runs"])
        print(f"  {label:9} best {x['best_s']:7.3f} s, median {x['median_s']:7.3f} s = "
              f"{x['median_s'] / n * 1000:6.3f} s per 1,000 jobs; scontrol calls {calls}; records changed {changed} "
              f"(target {target:.2f} s)")
    ref = r["reference"]
    per_1k_ref = ref["s"] / ref["jobs"] * 1000
    speedup = per_1k_ref / (r["apply"]["median_s"] / n * 1000)
    print(f"  reference one scontrol per job: {ref['s']:.3f} s for {ref['jobs']} jobs = {per_1k_ref:.3f} s per "
          f"1,000 jobs; batched apply (median) is {speedup:.1f}x faster per job")
    if "lag" in r:
        lag = r["lag"]
        metric = f"{lag['metric_s']:.1f} s" if lag["metric_s"] is not None else "not set"
        print(f"  lag: job {lag['job']} end -> SiteFactor {lag['factor_before']} -> {lag['factor_after']} on a "
              f"pending job of its user: {lag['lag_s']:.1f} s (target {TARGET_LAG_S:.0f} s); daemon's "
              f"gpuledger_priority_lag_seconds {metric}")


def metric(port: int, name: str) -> float | None:
    """A sample's value from the daemon's /metrics (None: not there, not up yet, or 0)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) or None if m else None


if __name__ == "__main__":
    main()
