"""The priority feed against a real Slurm 22.05: job_submit.lua at submit, `priority apply` on pending jobs,
start order, and the finished jobs read back with sacct.

One scenario, in steps that run in file order on one session cluster (each step needs the one before):
the partition is down so that jobs stay pending; three users in two accounts submit GPU jobs; every job needs
both of the node's GPUs, so they start one at a time, in priority order, once the partition comes up.
"""

from __future__ import annotations

import time
from datetime import UTC
from typing import Any

import pytest
from slurm_cluster import PARTITION, SlurmCluster  # tests/slurm is on sys.path (rootdir imports)

from gpuledger.accounting.apply import run_apply
from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.fairshare import fair_tree
from gpuledger.accounting.priority import FeedSource, PriorityEntry, feed_document, priority_feed, write_feed
from gpuledger.accounting.slurm import merge_sacct, parse_sacct_json, parse_sacct_parsable

pytestmark = pytest.mark.slurm

WEIGHT = 10_000
# Measured usage (GPU-seconds, decayed) per association: at submit time, then a later, different picture.
USAGE_AT_SUBMIT = {("proj_a", "alice"): 0.0, ("proj_a", "bob"): 0.0, ("proj_b", "carol"): 500.0}
USAGE_NOW = {("proj_a", "alice"): 100.0, ("proj_a", "bob"): 400.0, ("proj_b", "carol"): 0.0}

state: dict[str, Any] = {}


def feed_for(cluster: SlurmCluster, usage: dict[tuple[str, str], float]) -> list[PriorityEntry]:
    """Fair Tree over the cluster's own association tree (sacctmgr), usage as given; written where the lua reads."""
    text = cluster.cmd("sacctmgr", "-P", "show", "associations", "format=Cluster,Account,User,ParentName,Share")
    entries = priority_feed(fair_tree(AssocTree.from_sacctmgr(text), usage), weight=WEIGHT)
    # the header names the audit entry the feed came from: job_submit.lua reads past it (magic ... entries=N)
    write_feed(cluster.feed, feed_document(entries, {"generated_at": time.time(), "priority_weight": WEIGHT},
                                           FeedSource(118, "6bb074fc" * 8)))
    return entries


def factors(entries: list[PriorityEntry]) -> dict[tuple[str, str], int]:
    return {(e.account, e.user): e.site_factor for e in entries}


def sprio(cluster: SlurmCluster) -> dict[str, int]:
    return cluster.client().site_factors()


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster) -> dict[str, str]:
    c = slurm_cluster
    state["t0"] = time.time()
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=down")
    # No feed yet: the lua must still accept the job. Held, so that sprio leaves it out.
    held = c.sbatch_as("carol", "-A", "proj_b", "--hold", "--wrap", "true")
    state["feed_at_submit"] = feed_for(c, USAGE_AT_SUBMIT)
    ids = {
        "alice": c.sbatch_as("alice", "-A", "proj_a", "--gres=gpu:2", "--wrap", "sleep 2"),
        "bob": c.sbatch_as("bob", "-A", "proj_a", "--gres=gpu:h200:2", "--wrap", "sleep 2"),
        "carol": c.sbatch_as("carol", "-A", "proj_b", "--gres=gpu:2", "--wrap", "sleep 2; exit 3"),
        "alice_default": c.sbatch_as("alice", "--gres=gpu:1", "--wrap", "sleep 2"),  # no -A: lua leaves it
        "held": held,
    }
    return ids


def test_job_submit_lua_sets_the_feed_site_factor(slurm_cluster: SlurmCluster, jobs: dict[str, str]) -> None:
    c = slurm_cluster
    want = factors(state["feed_at_submit"])
    assert want[("proj_a", "alice")] != want[("proj_b", "carol")]  # the check below can tell them apart
    gpu_jobs = [jobs[k] for k in ("alice", "bob", "carol", "alice_default")]

    def listed() -> dict[str, int] | None:
        f = sprio(c)  # a just-submitted job may need a moment to get its priority
        return f if set(gpu_jobs) <= set(f) else None

    got = c.wait("sprio to list the pending jobs", listed)
    assert got[jobs["alice"]] == want[("proj_a", "alice")]
    assert got[jobs["bob"]] == want[("proj_a", "bob")]
    assert got[jobs["carol"]] == want[("proj_b", "carol")]
    assert got[jobs["alice_default"]] == 0  # default account: left to `priority apply`
    assert jobs["held"] not in got
    assert "gpuledger: no site factor for carol@proj_b" in c.log_tail(lines=400)  # the feedless submit


def test_priority_apply_sets_measured_fairshare_once(slurm_cluster: SlurmCluster, jobs: dict[str, str]) -> None:
    c = slurm_cluster
    client = c.client()
    feed = feed_for(c, USAGE_NOW)
    want = factors(feed)
    before = sprio(c)
    # dry run: the plan, but Slurm is not touched
    plan, applied = run_apply(client, feed, dry_run=True)
    assert {o.status for o in applied.outcomes} == {"dry-run"} and sprio(c) == before

    recorded: list[dict] = []
    plan, applied = run_apply(client, feed, record=recorded.extend)
    outcomes = applied.outcomes
    expect = {jobs[k]: want[a] for k, a in (("alice", ("proj_a", "alice")), ("bob", ("proj_a", "bob")),
                                            ("carol", ("proj_b", "carol")),
                                            ("alice_default", ("proj_a", "alice")))}
    assert {o.change.job_id: o.status for o in outcomes} == {j: "applied" for j in expect}
    assert [s.job_id for s in plan.skipped] == [jobs["held"]]
    after = sprio(c)
    assert {j: after[j] for j in expect} == expect  # sprio's SITE column
    # each change twice: intended before its scontrol, applied after it
    assert sorted((r["job_id"], r["status"]) for r in recorded) == sorted(
        (j, s) for j in expect for s in ("applied", "intended"))
    by_job = {r["job_id"]: r for r in recorded if r["status"] == "applied"}
    carol = by_job[jobs["carol"]]
    assert (carol["account"], carol["user"], carol["raw_usage"], carol["old_factor"], carol["new_factor"]) == \
           ("proj_b", "carol", 0.0, factors(state["feed_at_submit"])[("proj_b", "carol")], want[("proj_b", "carol")])
    assert by_job[jobs["alice_default"]]["old_factor"] == 0
    # same inputs again: nothing changes
    plan2, applied2 = run_apply(client, feed, record=recorded.extend)
    assert plan2.changes == () and applied2.outcomes == () and len(recorded) == 2 * len(expect)
    assert sprio(c) == after
    state["feed_now"] = feed


def test_cli_priority_apply_from_the_ledger_is_audited(slurm_cluster: SlurmCluster, jobs: dict[str, str],
                                                        tmp_path, monkeypatch) -> None:
    """`gpuledger priority apply --slurm` end to end: measured usage in the ledger -> fairshare -> scontrol, each
    change in the audit trail; then the library puts the factors back for the start-order step."""
    import json as _json

    from typer.testing import CliRunner

    from gpuledger.accounting.audit import open_log
    from gpuledger.cli import app
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample, JobRecord

    c = slurm_cluster
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    assoc = tmp_path / "assoc.txt"
    assoc.write_text(c.cmd("sacctmgr", "-P", "show", "associations", "format=Cluster,Account,User,ParentName,Share"))
    (tmp_path / "gpuledger.toml").write_text(
        f'[accounting]\nalgorithm = "fair-tree"\npolicy = "allocated"\npriority_weight = {WEIGHT}\n')
    # Measured GPU-seconds per user, the reverse of USAGE_NOW's picture: carol busy, bob idle.
    measured = {"9001": ("proj_a", "alice", 100), "9002": ("proj_a", "bob", 0), "9003": ("proj_b", "carol", 400)}
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        now = time.time()
        store.put_jobs([JobRecord(job_id=j, cluster="testcluster", account=a, user=u, gpus=1)
                        for j, (a, u, _) in measured.items()])
        samples = [GpuSample(ts=now - 500 + t, host="vm", gpu_uuid=f"GPU-{j}", gpu_index=i, job_ids=(j,))
                   for i, (j, (_, _, secs)) in enumerate(measured.items()) if secs for t in range(0, secs + 1, 50)]
        store.ingest(Batch("test", 1, "vm", tuple(sorted(samples, key=lambda x: x.ts))))
    finally:
        store.close()
    usage = {(a, u): float(secs) for a, u, secs in measured.values()}
    text = assoc.read_text()
    want = factors(priority_feed(fair_tree(AssocTree.from_sacctmgr(text), usage), weight=WEIGHT))
    assert want != factors(state["feed_now"])  # so the apply below changes something
    before = sprio(c)
    runner = CliRunner()
    args = ["priority", "apply", "--slurm", "--data-dir", str(tmp_path), "--associations", str(assoc)]
    r = runner.invoke(app, [*args, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "dry-run" in r.output and sprio(c) == before
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    pending = {jobs[k]: a for k, a in (("alice", ("proj_a", "alice")), ("bob", ("proj_a", "bob")),
                                       ("carol", ("proj_b", "carol")), ("alice_default", ("proj_a", "alice")))}
    after = sprio(c)
    assert {j: after[j] for j in pending} == {j: want[a] for j, a in pending.items()}
    changed = {j for j in pending if before[j] != want[pending[j]]}
    with open_log(tmp_path) as log:
        assert log.verify().ok
        recorded = {e.job_id for e in log.entries(kind="priority_change")}
    assert recorded == changed and changed
    feed = _json.loads((tmp_path / "priority-feed.json").read_text())
    assert {(e["account"], e["user"]): e["site_factor"] for e in feed["associations"]} == want
    flat = (tmp_path / "priority-feed.txt").read_text().splitlines()  # what job_submit.lua reads
    assert flat[0].startswith("# gpuledger-priority-feed v1 ") and flat[0].endswith(f" entries={len(want)}")
    assert {(a, u): int(f) for a, u, f in (ln.split() for ln in flat[1:])} == want
    r = runner.invoke(app, args)  # same ledger again: nothing to change
    assert r.exit_code == 0 and "0 changed, 0 failed" in r.output and "0 scontrol call(s)" in r.output, r.output
    # Put back the factors the start-order step expects.
    run_apply(c.client(), state["feed_now"])
    assert sprio(c) == before


def test_jobs_start_in_site_factor_order(slurm_cluster: SlurmCluster, jobs: dict[str, str]) -> None:
    c = slurm_cluster
    want = factors(state["feed_now"])
    assert want[("proj_b", "carol")] > want[("proj_a", "alice")] > want[("proj_a", "bob")]
    c.cmd("scancel", jobs["held"])
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")
    watched = {jobs[k] for k in ("alice", "bob", "carol", "alice_default")}
    order: list[str] = []

    def all_started() -> bool:
        running = c.cmd("squeue", "-h", "-t", "R,CG", "-o", "%i").split()
        order.extend(j for j in running if j in watched and j not in order)
        return len(order) == len(watched)

    c.wait("the four GPU jobs to start", all_started, timeout_s=45)
    # one job at a time (each needs the node's GPUs): carol (highest factor) first, bob (lowest) last
    assert order[0] == jobs["carol"]
    assert set(order[1:3]) == {jobs["alice"], jobs["alice_default"]}
    assert order[3] == jobs["bob"]
    state["order"] = order


def test_sacct_import_matches_what_was_submitted(slurm_cluster: SlurmCluster, jobs: dict[str, str]) -> None:
    c = slurm_cluster
    array = c.sbatch_as("bob", "-A", "proj_a", "--array=1-2", "--wrap", "true")  # CPU-only array tasks
    mine = [jobs[k] for k in ("alice", "bob", "carol", "alice_default")] + [f"{array}_1", f"{array}_2"]

    def ended() -> bool:
        out = c.cmd("sacct", "-a", "-n", "-X", "-P", "-j", ",".join([*mine[:4], array]), "-o", "JobID,State")
        done = {ln.split("|")[0] for ln in out.split() if ln.split("|")[1] in ("COMPLETED", "FAILED")}
        return set(mine) <= done

    c.wait("the jobs to end in sacct", ended, timeout_s=45, every_s=0.3)
    recs = {r.job_id: r for r in c.client().sacct_jobs(state["t0"] - 60, time.time() + 60)}
    got = {j: (recs[j].user, recs[j].account, recs[j].partition, recs[j].gpus, recs[j].state, recs[j].exit_code)
           for j in mine}
    assert got == {
        jobs["alice"]: ("alice", "proj_a", PARTITION, 2, "COMPLETED", 0),
        jobs["bob"]: ("bob", "proj_a", PARTITION, 2, "COMPLETED", 0),  # typed gres/gpu:h200 counted once
        jobs["carol"]: ("carol", "proj_b", PARTITION, 2, "FAILED", 3),
        jobs["alice_default"]: ("alice", "proj_a", PARTITION, 1, "COMPLETED", 0),
        f"{array}_1": ("bob", "proj_a", PARTITION, 0, "COMPLETED", 0),
        f"{array}_2": ("bob", "proj_a", PARTITION, 0, "COMPLETED", 0),
    }
    for j in mine:
        r = recs[j]
        assert r.cluster == "testcluster" and r.hosts and r.submit <= r.start <= r.end, r
        assert r.gpu_model == ("h200" if r.gpus else None)
    # start times follow the observed order (each job ran >= 2 s, so the seconds differ)
    starts = [recs[j].start for j in state["order"]]
    assert starts == sorted(starts) and len(set(starts)) == 4
    # the two forms on their own: 22.05's JSON gets the failed job's exit code wrong, -P right; merged right
    window = ["-a", "-j", ",".join([*mine[:4], array])]
    env_utc = ("env", "TZ=UTC")
    as_json = {r.job_id: r for r in parse_sacct_json(c.cmd(*env_utc, "sacct", "--json", *window))}
    parsable_text = c.cmd(*env_utc, "sacct", "-P", *window,
                          "--format=JobID,User,Account,Partition,Start,End,AllocTRES,State,ExitCode")
    assert ".batch|" in parsable_text  # steps are there, and skipped
    parsable = {r.job_id: r for r in parse_sacct_parsable(parsable_text, tz=UTC)}
    assert set(as_json) == set(parsable) == set(mine)
    assert as_json[jobs["carol"]].exit_code is None and parsable[jobs["carol"]].exit_code == 3
    assert {r.job_id: r.start for r in merge_sacct(as_json.values(), parsable.values())} == \
           {j: recs[j].start for j in mine}


def test_job_submit_lua_finds_an_account_typed_in_another_case(slurm_cluster: SlurmCluster) -> None:
    # Slurm lowercases the account only after job_submit has run: `-A PROJ_A` is proj_a's job, and its factor
    c = slurm_cluster
    want = factors(feed_for(c, USAGE_NOW))[("proj_a", "bob")]
    assert want != 0
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=down")
    job = c.sbatch_as("bob", "-A", "PROJ_A", "--gres=gpu:1", "--wrap", "true")
    try:
        got = c.wait("sprio to list the job", lambda: sprio(c).get(job))
        assert got == want
    finally:
        c.cmd("scancel", job)
        c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")
