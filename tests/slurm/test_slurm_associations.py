"""`--associations slurm` against a real Slurm 22.05: the CLI asks sacctmgr for the columns a tree needs; the plain
`sacctmgr -P show associations` output, saved to a file, is refused with the command to run instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_cluster import USERS, SlurmCluster  # tests/slurm is on sys.path (rootdir imports)
from typer.testing import CliRunner

from gpuledger.cli import app

pytestmark = pytest.mark.slurm
runner = CliRunner()


def test_fairshare_reads_the_tree_from_sacctmgr(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    usage = tmp_path / "usage.csv"
    usage.write_text("account,user,usage\nproj_a,alice,100\nproj_a,bob,300\nproj_b,carol,0\n")
    r = runner.invoke(app, ["fairshare", "--associations", "slurm", "--usage", str(usage), "--algorithm",
                            "fair-tree", "--format", "json", "--data-dir", str(tmp_path / "d")],
                      env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert r.exit_code == 0, r.output
    users = {(x["account"], x["user"]): x["fairshare"] for x in json.loads(r.stdout) if x["user"]}
    assert {k for k in users if k[1] != "root"} == {(a, u) for u, a in USERS.items()}
    # Fair Tree ranks: carol (no usage) first, then alice, then bob (most usage)
    assert users[("proj_b", "carol")] > users[("proj_a", "alice")] > users[("proj_a", "bob")]


def test_the_config_can_name_slurm_as_the_tree(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "gpuledger.toml").write_text('[accounting]\nassociations = "slurm"\n')
    usage = tmp_path / "usage.csv"
    usage.write_text("account,user,usage\nproj_a,alice,1\n")
    r = runner.invoke(app, ["fairshare", "--usage", str(usage), "--format", "csv", "--data-dir", str(tmp_path)],
                      env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert r.exit_code == 0, r.output
    assert {tuple(ln.split(",")[:2]) for ln in r.stdout.splitlines()[1:]} >= {("proj_a", "alice"), ("proj_b", "carol")}


def test_plain_sacctmgr_file_is_refused_naming_the_command(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    plain = tmp_path / "assoc.txt"
    plain.write_text(slurm_cluster.cmd("sacctmgr", "-P", "show", "associations"))
    r = runner.invoke(app, ["fairshare", "--associations", str(plain), "--data-dir", str(tmp_path / "d")])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "format=cluster,account,parentname,user,share" in lines[0], r.output


def test_associations_slurm_without_slurm_fails_in_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["fairshare", "--associations", "slurm", "--data-dir", str(tmp_path)],
                      env={"PATH": str(tmp_path)})  # no sacctmgr on this PATH
    assert r.exit_code == 2 and "sacctmgr: command not found" in r.output and len(r.output.strip().splitlines()) == 1


def test_the_jobs_import_unit_imports_from_a_real_slurm(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """contrib/systemd/gpuledger-jobs-import.service's ExecStart, paths substituted, against the test cluster."""
    import subprocess

    from systemd_units import EXE, environment, exec_start, unit

    job = slurm_cluster.sbatch_as("alice", "-A", "proj_a", "--wrap", "true")
    # ended before the next test file's scenario starts on the same cluster
    # ... and visible to a time-window query such as the unit's (slurmdbd shows a just-ended job to `sacct -j`
    # seconds before it shows it to `sacct -S`)
    slurm_cluster.wait(f"job {job} to complete", lambda: f"{job}|COMPLETED" in slurm_cluster.cmd(
        "sacct", "-a", "-n", "-X", "-P", "-S", "now-2hours", "-o", "JobID,State"), timeout_s=60, every_s=0.3)
    u = unit("gpuledger-jobs-import.service")
    (tmp_path / "gpuledger.toml").write_text("")  # the site's file (the unit passes --config): nothing set in it
    sub = {"/usr/local/bin/gpuledger": EXE, "${STATE_DIRECTORY}": str(tmp_path), "/var/lib/gpuledger": str(tmp_path),
           "/etc/gpuledger/gpuledger.toml": str(tmp_path / "gpuledger.toml")}
    env = {**environment(u, sub), "SLURM_CONF": str(slurm_cluster.conf)}
    p = subprocess.run(exec_start(u, sub), capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith("imported ") and "job record(s)" in p.stdout
    listed = subprocess.run([EXE, "jobs", "list", "--format", "json"], capture_output=True, text=True, timeout=60,
                            env=env)
    assert job in {j["job_id"] for j in json.loads(listed.stdout)}, (p.stdout, listed.stdout[:3000])
