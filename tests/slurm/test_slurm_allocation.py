"""Jobs that ran with no agent are charged at their allocation, on a real Slurm 22.05 (the session cluster of
``slurm_cluster.py``): ``jobs import --slurm``, then ``priority feed`` and ``priority apply --slurm`` through the
CLI, and sprio's SITE column follows. Before issue 12 every user read fairshare 1.0 here.

alice runs one job on both GPUs of the node; no agent measures anything. Under ``policy = "allocated"`` her
usage is Slurm's elapsed x 2 GPUs (read back from ``sacct -P``, the independent check); bob and carol used
nothing, so alice's Fair Tree fairshare is the lowest, and pending jobs get site factors in that order.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from slurm_cluster import GPUS, PARTITION, SlurmCluster  # tests/slurm is on sys.path (rootdir imports)
from typer.testing import CliRunner

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.fairshare import fair_tree
from gpuledger.accounting.priority import priority_feed
from gpuledger.cli import app

pytestmark = pytest.mark.slurm
WEIGHT = 10_000


def _sacct_elapsed(c: SlurmCluster, job_id: str) -> float | None:
    """End - start of a finished job, from ``sacct -P`` in UTC (None while it has not ended)."""
    out = c.cmd("env", "TZ=UTC", "sacct", "-P", "-n", "-X", "-j", job_id, "--format=State,Start,End").strip()
    if not out:
        return None
    state, start, end = out.splitlines()[0].split("|")
    if not state.startswith("COMPLETED"):
        return None
    t = lambda s: datetime.strptime(s, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()  # noqa: E731
    return t(end) - t(start)


def test_unmeasured_jobs_are_charged_at_allocation_and_sprio_follows(slurm_cluster: SlurmCluster, tmp_path,
                                                                      monkeypatch) -> None:
    c = slurm_cluster
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")
    ran = c.sbatch_as("alice", "-A", "proj_a", f"--gres=gpu:{GPUS}", "--wrap", "sleep 2")
    elapsed = c.wait(f"job {ran} to complete", lambda: _sacct_elapsed(c, ran), timeout_s=60, every_s=0.5)
    assert elapsed >= 1

    # pending jobs whose site factors `priority apply` sets
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=down")
    pending = {u: c.sbatch_as(u, "-A", a, "--gres=gpu:1", "--wrap", "true")
               for u, a in (("alice", "proj_a"), ("bob", "proj_a"), ("carol", "proj_b"))}
    try:
        assoc = tmp_path / "assoc.txt"
        assoc.write_text(c.cmd("sacctmgr", "-P", "show", "associations",
                               "format=Cluster,Account,User,ParentName,Share"))
        (tmp_path / "gpuledger.toml").write_text(
            '[accounting]\nalgorithm = "fair-tree"\npolicy = "allocated"\nhalf_life_s = 0\ncalc_period_s = 1\n'
            f"priority_weight = {WEIGHT}\n")
        runner = CliRunner()
        d = str(tmp_path)
        r = runner.invoke(app, ["jobs", "import", "--slurm", "--since", "1", "--data-dir", d])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["jobs", "list", "--data-dir", d, "--format", "json"])
        assert r.exit_code == 0, r.output
        listed = {j["job_id"]: j for j in json.loads(r.output)}
        job = listed[ran]
        # nobody measured it: seen by Slurm only, allocation = elapsed x 2 GPUs, coverage 0, all of it unmeasured
        assert (job["seen_by"], job["gpus"], job["coverage"]) == ("slurm", GPUS, 0.0)
        assert job["slurm_gpu_seconds"] == job["unmeasured_gpu_seconds"] == elapsed * GPUS

        r = runner.invoke(app, ["priority", "feed", "--data-dir", d, "--associations", str(assoc)])
        assert r.exit_code == 0, r.output
        feed = json.loads((tmp_path / "priority-feed.json").read_text())
        fs = {(e["account"], e["user"]): e["fairshare"] for e in feed["associations"]}
        # every finished job of the window is charged its allocation; alice's includes the one above
        finished = {j["job_id"]: j for j in listed.values() if j["seen_by"] == "slurm" and j["slurm_gpu_seconds"]}
        usage: dict[tuple[str, str], float] = {}
        for j in finished.values():
            usage[(j["account"], j["user"])] = usage.get((j["account"], j["user"]), 0.0) + j["slurm_gpu_seconds"]
        assert usage[("proj_a", "alice")] >= elapsed * GPUS > 0
        want = {(e.account, e.user): e.site_factor
                for e in priority_feed(fair_tree(AssocTree.from_sacctmgr(assoc.read_text()), usage), weight=WEIGHT)}
        assert {(e["account"], e["user"]): e["site_factor"] for e in feed["associations"]} == want
        assert fs[("proj_a", "alice")] < 1.0 and fs[("proj_a", "alice")] < fs[("proj_b", "carol")]

        r = runner.invoke(app, ["priority", "apply", "--slurm", "--data-dir", d, "--associations", str(assoc)])
        assert r.exit_code == 0, r.output
        site = c.client().site_factors()
        assert {u: site[j] for u, j in pending.items()} == {
            "alice": want[("proj_a", "alice")], "bob": want[("proj_a", "bob")], "carol": want[("proj_b", "carol")]}
        assert site[pending["alice"]] < site[pending["carol"]]
    finally:
        # the cluster is shared by the whole session: leave it as found (jobs gone, partition up)
        c.cmd("scancel", *pending.values(), check=False)
        c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")
        time.sleep(0.2)
