"""`priority apply --slurm`: what it writes and logs, and when. A dry run writes and logs nothing; a real apply
writes the feed files (which job_submit.lua reads) only after Slurm answered, so a failed apply leaves them as
they were.

Slurm's commands are fakes at the machine boundary (shell scripts on PATH over a table of site factors, as
slurmctld holds them); the ledger, the audit log and the CLI are real.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

CONFIG = """[accounting]
algorithm = "classic"
policy = "allocated"
[accounts.proj_a]
shares = 1
[accounts.proj_a.users]
alice = 1
bob = 1
"""
SQUEUE_OK = "#!/bin/sh\necho '2001|2001|alice|proj_a|gpu|PENDING'\necho '2002|2002|bob|proj_a|gpu|PENDING'\n"
SQUEUE_DOWN = "#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n"
SPRIO = '#!/bin/sh\necho "2001|alice|1000|0"\necho "2002|bob|1000|0"\n'
SCONTROL = '#!/bin/sh\necho "$@" >> "$FAKE_SLURM/commands"\n'


@pytest.fixture()
def site(tmp_path: Path, monkeypatch) -> Path:
    """A data dir whose ledger charges alice 300 s and bob 100 s, its feed written once, and fake Slurm commands on
    PATH (bin/); `bin/squeue` is the working one until a test replaces it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "gpuledger.toml").write_text(CONFIG)
    now = time.time()
    store = Store(data / "gpuledger.sqlite")
    try:
        store.put_jobs([JobRecord(j, cluster="c", account="proj_a", user=u, gpus=1, start=now - 1000 - s,
                                  end=now - 1000, state="COMPLETED") for j, u, s in (("11", "alice", 300),
                                                                                      ("12", "bob", 100))])
        store.ingest(Batch("t", 1, "n1", tuple(sorted(
            (GpuSample(ts=now - 1000 - s + t, host="n1", gpu_uuid=f"GPU-{j}", gpu_index=i, job_ids=(j,))
             for i, (j, s) in enumerate((("11", 300), ("12", 100))) for t in range(0, s + 1, 10)),
            key=lambda x: x.ts))))
    finally:
        store.close()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "slurm").mkdir()
    for name, text in (("squeue", SQUEUE_OK), ("sprio", SPRIO), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(tmp_path / "slurm"))
    r = CliRunner().invoke(app, ["priority", "feed", "--data-dir", str(data)])
    assert r.exit_code == 0, r.output
    return tmp_path


def squeue(site: Path, text: str) -> None:
    (site / "bin" / "squeue").write_text(text)


def audit_entries(data: Path) -> int:
    db = sqlite3.connect(data / "audit.sqlite")
    try:
        return db.execute("SELECT count(*) FROM entries").fetchone()[0]
    finally:
        db.close()


def feed_files(data: Path) -> tuple[bytes, bytes, int, int]:
    json_feed, flat = data / "priority-feed.json", data / "priority-feed.txt"
    return json_feed.read_bytes(), flat.read_bytes(), json_feed.stat().st_mtime_ns, flat.stat().st_mtime_ns


def apply(data: Path, *args: str):
    return CliRunner().invoke(app, ["priority", "apply", "--slurm", "--data-dir", str(data), *args])


@pytest.mark.parametrize("slurm_up", [True, False])
def test_a_dry_run_writes_no_feed_and_logs_nothing(site: Path, slurm_up: bool) -> None:
    # it used to rewrite both feed files and append a fairshare computation to the audit log, even when it failed
    data = site / "data"
    if not slurm_up:
        squeue(site, SQUEUE_DOWN)
    before, entries = feed_files(data), audit_entries(data)
    time.sleep(0.01)  # a rewrite would show in the files' times
    r = apply(data, "--dry-run")
    if slurm_up:
        assert r.exit_code == 0, r.output
        assert "2 pending job(s): 2 would change" in r.stdout and "0 scontrol call(s)" in r.stdout
    else:
        assert r.exit_code == 2 and "Unable to contact slurm controller" in r.stderr, r.output
    assert feed_files(data) == before and audit_entries(data) == entries
    assert not (site / "slurm" / "commands").exists()


def test_a_failed_apply_leaves_the_feed_files_as_they_were(site: Path) -> None:
    data = site / "data"
    squeue(site, SQUEUE_DOWN)
    before = feed_files(data)
    time.sleep(0.01)
    r = apply(data)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Unable to contact slurm controller" in r.stderr
    assert feed_files(data) == before  # job_submit.lua keeps the factors Slurm's pending jobs hold


def test_an_apply_writes_the_feed_it_applied_after_slurm_took_it(site: Path) -> None:
    data = site / "data"
    before = feed_files(data)
    r = apply(data)
    assert r.exit_code == 0, r.output
    sent = (site / "slurm" / "commands").read_text().splitlines()
    flat = (data / "priority-feed.txt").read_text().splitlines()
    assert feed_files(data)[:2] != before[:2]  # written anew, from the feed it applied
    factors = {line.split()[1]: int(line.split()[2]) for line in flat[1:]}
    assert sorted(sent) == sorted([f"update jobid=2001 SiteFactor={factors['alice']}",
                                   f"update jobid=2002 SiteFactor={factors['bob']}"])
