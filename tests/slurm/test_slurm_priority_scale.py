"""Priority at scale against a real Slurm 22.05: the flat feed read by job_submit.lua at submit time (and a
corrupt or missing one that never blocks a submission), then a batched `priority apply` over a few hundred
pending jobs of three associations, array jobs included, and a job that ends during the apply failing alone.

Runs after test_slurm_priority.py on the same session cluster; the steps run in file order.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from slurm_cluster import PARTITION, USERS, SlurmCluster, free_ports  # tests/slurm is on sys.path (rootdir imports)

from gpuledger.accounting.apply import apply_changes, plan_changes, run_apply
from gpuledger.accounting.priority import PriorityEntry, feed_document, flat_path, write_atomically, write_feed

pytestmark = pytest.mark.slurm

JOBS_PER_USER = 80
ARRAY_TASKS = 40
state: dict[str, Any] = {}


def feed(factors: dict[str, int]) -> list[PriorityEntry]:
    """A feed with the given site factor per user (their association from USERS)."""
    return [PriorityEntry(USERS[u], u, f / 10_000, f, 0.0, 0.0, 0.5) for u, f in factors.items()]


def publish(cluster: SlurmCluster, entries: list[PriorityEntry]) -> None:
    write_feed(cluster.feed, feed_document(entries, {"generated_at": time.time(), "priority_weight": 10_000}))


def sprio(cluster: SlurmCluster) -> dict[str, int]:
    return cluster.client().site_factors()


@pytest.fixture(scope="module")
def submitted(slurm_cluster: SlurmCluster):
    """JOBS_PER_USER single jobs and one ARRAY_TASKS-task array per user, pending (partition down), submitted
    under the first feed; afterwards everything cancelled and the partition back up."""
    c = slurm_cluster
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=down")
    first = {"alice": 1111, "bob": 2222, "carol": 3333}
    publish(c, feed(first))
    ids: dict[str, list[str]] = {u: [] for u in USERS}
    arrays: dict[str, str] = {}
    for u, account in USERS.items():
        script = c.dir / "jobs" / f"many-{u}.sh"
        script.write_text("#!/bin/sh\nsleep 60\n")
        script.chmod(0o755)
        for _ in range(JOBS_PER_USER):
            ids[u].append(c.sbatch_as(u, "-A", account, str(script)))
        arrays[u] = c.sbatch_as(u, "-A", account, f"--array=1-{ARRAY_TASKS}", str(script))
    state.update(first=first, ids=ids, arrays=arrays)
    yield ids, arrays
    c.cmd("scancel", *[j for js in ids.values() for j in js], *arrays.values(), check=False)
    c.cmd("scontrol", "delete", "partitionname=run", check=False)
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")


def test_lua_sets_the_flat_feed_factor_at_submit(slurm_cluster: SlurmCluster, submitted) -> None:
    c = slurm_cluster
    ids, arrays = submitted
    records = {j: u for u, js in ids.items() for j in js} | {a: u for u, a in arrays.items()}

    def listed() -> dict[str, int] | None:
        f = sprio(c)
        return f if set(records) <= set(f) else None

    got = c.wait("sprio to list the submitted jobs", listed)
    assert {j: got[j] for j in records} == {j: state["first"][u] for j, u in records.items()}
    assert flat_path(c.feed).read_text().splitlines()[1:] == ["proj_a alice 1111", "proj_a bob 2222",
                                                            "proj_b carol 3333"]


@pytest.mark.parametrize("content,reason", [
    ("{\"associations\": []}\n", "first line is not"),  # the JSON feed where the flat one belongs
    ("# gpuledger-priority-feed v1 generated_at=1.000 entries=3\nproj_a alice 5\n", "1 entries, header says 3"),
    ("# gpuledger-priority-feed v1 generated_at=2.000 entries=1\nproj_a alice five\n", "line 2 is not"),
    (None, "No such file"),  # no feed at all
])
def test_a_corrupt_or_missing_feed_never_blocks_a_submission(slurm_cluster: SlurmCluster, submitted,
                                                              content: str | None, reason: str) -> None:
    c = slurm_cluster
    flat = flat_path(c.feed)
    if content is None:
        flat.unlink()
    else:
        write_atomically(flat, content)
    try:
        job = c.sbatch_as("alice", "-A", "proj_a", "--hold", "--wrap", "true")  # accepted: sbatch printed an id
        c.cmd("scontrol", "release", job)
        got = c.wait(f"sprio to list job {job}", lambda: sprio(c).get(job) is not None and sprio(c))
        assert got[job] == 0  # factor left alone
        assert reason in c.log_tail(lines=50)
        c.cmd("scancel", job)
    finally:
        publish(c, feed(state["first"]))


def test_batch_apply_sets_exactly_the_feed_factors(slurm_cluster: SlurmCluster, submitted) -> None:
    c = slurm_cluster
    ids, arrays = submitted
    # one array task with a record of its own (an update splits it off), the rest still sharing the array's
    c.cmd("scontrol", "update", f"jobid={arrays['bob']}_3", "SiteFactor=7")
    second = {"alice": 4000, "bob": 500, "carol": 9000}
    entries = feed(second)
    recorded: list[list[dict]] = []
    t0 = time.monotonic()
    plan, applied = run_apply(c.client(), entries, record=recorded.append)
    took = time.monotonic() - t0
    n_records = 3 * JOBS_PER_USER + 3 + 1
    assert plan.jobs == 3 * (JOBS_PER_USER + ARRAY_TASKS) and plan.skipped == ()
    assert [o.status for o in applied.outcomes] == ["applied"] * n_records
    assert applied.calls == 3  # one scontrol per factor
    targets = {o.change.job_id for o in applied.outcomes}
    assert f"{arrays['bob']}_3" in targets and f"{arrays['bob']}_[1-2,4-{ARRAY_TASKS}]" in targets
    # per command one transaction before it (intended) and one after (applied)
    assert len(recorded) == 2 * applied.calls and sum(map(len, recorded)) == 2 * n_records
    assert sorted(c["status"] for b in recorded for c in b) == ["applied"] * n_records + ["intended"] * n_records
    got = sprio(c)
    want = {j: second[u] for u, js in ids.items() for j in js} | {a: second[u] for u, a in arrays.items()}
    assert {j: got[j] for j in want} == want
    split = [j for j in got if j not in want]  # the split task's own record
    assert len(split) == 1 and got[split[0]] == second["bob"]
    assert sum(1 for j in got if got[j] == second["bob"]) == JOBS_PER_USER + 2
    # same feed again: nothing to do, no scontrol
    plan2, applied2 = run_apply(c.client(), entries, record=recorded.append)
    assert plan2.changes == () and applied2.calls == 0 and len(recorded) == 2 * applied.calls
    print(f"apply of {n_records} records ({plan.jobs} jobs): {took:.2f} s")


def test_a_job_that_ends_during_the_apply_fails_alone(slurm_cluster: SlurmCluster, submitted) -> None:
    c = slurm_cluster
    ids, arrays = submitted
    client = c.client()
    third = {"alice": 6000, "bob": 6000, "carol": 100}
    plan = plan_changes(client.pending_jobs(), feed(third), client.site_factors())
    ended, started = ids["alice"][5], ids["bob"][7]
    # between the plan and the update: one job is cancelled (ended), one starts on a partition that is up
    c.cmd("scancel", ended)
    c.cmd("scontrol", "create", "partitionname=run", f"nodes={socket.gethostname().split('.')[0]}", "state=up")
    c.cmd("scontrol", "update", f"jobid={started}", "partition=run")
    c.wait(f"job {started} to start", lambda: c.cmd("squeue", "-h", "-j", started, "-o", "%T").strip() == "RUNNING")
    applied = apply_changes(client, plan.changes, dry_run=False)
    failed = {o.change.job_id: o.error for o in applied.outcomes if o.status == "failed"}
    assert list(failed) == [ended] and "already finished" in failed[ended]
    # Slurm 22.05 accepts a site factor for a job that has started (it no longer counts): applied, not failed
    assert {o.change.job_id for o in applied.outcomes if o.status == "applied"} == \
           {ch.job_id for ch in plan.changes} - {ended}
    got = sprio(c)
    want = {j: third[u] for u, js in ids.items() for j in js if j not in (ended, started)}
    assert {j: got[j] for j in want} == want
    assert applied.calls > 2  # the batch with the ended job was split until it stood alone


def test_watch_daemon_applies_the_ledger_and_follows_a_job_end(slurm_cluster: SlurmCluster, submitted,
                                                               tmp_path) -> None:
    """`gpuledger priority watch` as a process: its first cycle sets every pending record to the feed it wrote;
    a job end with usage arriving in the ledger (as the collector stores it) moves the factors again, and the
    lag metric says so; SIGTERM ends it cleanly."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample, JobRecord

    c = slurm_cluster
    ids, arrays = submitted
    (tmp_path / "assoc.txt").write_text(c.cmd("sacctmgr", "-P", "show", "associations",
                                              "format=Cluster,Account,User,ParentName,Share"))
    (tmp_path / "gpuledger.toml").write_text('[accounting]\nalgorithm = "fair-tree"\npolicy = "allocated"\n'
                                             "priority_weight = 10000\n")

    def ended_job(job_id: str, account: str, user: str, end: float) -> None:
        store = Store(tmp_path / "gpuledger.sqlite")
        try:
            store.put_jobs([JobRecord(job_id=job_id, cluster="testcluster", account=account, user=user, gpus=1,
                                      start=end - 100, end=end, state="COMPLETED")])
            store.ingest(Batch("t", int(end), "vm", tuple(
                GpuSample(ts=t, host="vm", gpu_uuid="GPU-w", gpu_index=0, job_ids=(job_id,))
                for t in range(int(end) - 100, int(end) + 1, 10))))
        finally:
            store.close()

    ended_job("w1", "proj_a", "alice", time.time() - 600)
    port = free_ports(1)[0]
    gpuledger = str(Path(sys.executable).parent / "gpuledger")
    proc = subprocess.Popen([gpuledger, "priority", "watch", "--data-dir", str(tmp_path), "--associations",
                             str(tmp_path / "assoc.txt"), "--no-import-jobs", "--poll", "0.5", "--min-interval", "1",
                             "--metrics-port", str(port)], env={**c.env, "SLURM_CONF": str(c.conf)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def metrics() -> str:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return ""

    def sample(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", metrics(), re.M)
        return float(m.group(1)) if m else 0.0

    def feed_matches() -> dict[str, int] | None:
        flat = flat_path(tmp_path / "priority-feed.json")
        if not flat.exists():
            return None
        want = {u: int(f) for _, u, f in (ln.split() for ln in flat.read_text().splitlines()[1:])}
        got = sprio(c)
        records = {j: u for u, js in ids.items() for j in js if j in got} | {a: u for u, a in arrays.items()}
        return want if all(got.get(j) == want[u] for j, u in records.items()) else None

    try:
        first = c.wait("the daemon's first cycle to set the feed on every pending record", feed_matches,
                       timeout_s=60, every_s=0.3)
        assert first["alice"] < first["carol"]  # alice has usage, carol none
        ended_job("w2", "proj_b", "carol", time.time())
        second = c.wait("the factors to follow the job end", lambda: (f := feed_matches()) and f != first and f,
                        timeout_s=60, every_s=0.3)
        assert second["carol"] < first["carol"]
        lag = c.wait("the lag metric", lambda: sample("gpuledger_priority_lag_seconds"), timeout_s=10)
        assert 0 < lag < 60
        assert sample('gpuledger_priority_cycles_total{result="ok"}') >= 2
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
