"""`priority apply` stopped part way (SIGTERM while an scontrol hangs, an audit log that no longer takes writes):
every change Slurm may have made is in the audit log, and nothing is sent that the log did not take first.

Slurm's commands are fakes at the machine boundary (shell scripts on PATH, or ``SlurmClient(run=...)``) over a
table of site factors, as slurmctld holds them; the ledger and the audit log are real.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.accounting.apply import AuditNotWritten, Change, apply_changes
from gpuledger.accounting.audit import open_log, record_priority_changes
from gpuledger.accounting.slurm import SlurmClient
from gpuledger.cli import app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

USERS = {"2001": ("proj_a", "alice"), "2002": ("proj_a", "bob"), "2003": ("proj_b", "carol"),
         "2004": ("proj_b", "dave")}
CONFIG = """[accounting]
algorithm = "classic"
policy = "allocated"
priority_weight = 10000
[accounts.proj_a]
shares = 60
[accounts.proj_a.users]
alice = 1
bob = 3
[accounts.proj_b]
shares = 40
[accounts.proj_b.users]
carol = 1
dave = 7
"""
# squeue, sprio and scontrol over $FAKE_SLURM/state (lines "job factor", the newest wins); the scontrol command for
# job $HANG_JOB sets its factor at once and then hangs until $FAKE_SLURM/release exists (slurmctld answering late)
SQUEUE = "#!/bin/sh\n" + "".join(f"echo '{j}|{j}|{u}|{a}|gpu|PENDING'\n" for j, (a, u) in USERS.items())
SPRIO = f"""#!/bin/bash
touch "$FAKE_SLURM/state"
for j in {" ".join(USERS)}; do
  f=$(grep "^$j " "$FAKE_SLURM/state" | tail -1 | cut -d' ' -f2); echo "$j|x|1000|${{f:-0}}"
done
"""
SCONTROL = """#!/bin/bash
ids=${2#jobid=}; f=${3#SiteFactor=}
for id in ${ids//,/ }; do echo "$id $f" >> "$FAKE_SLURM/state"; done
echo "$ids" >> "$FAKE_SLURM/commands"
if [ "$ids" = "$HANG_JOB" ]; then
  for _ in $(seq 300); do [ -e "$FAKE_SLURM/release" ] && exit 0; sleep 0.1; done
fi
exit 0
"""


@pytest.fixture()
def cluster(tmp_path: Path) -> Path:
    """A data dir whose ledger charges the four associations, and fake Slurm commands (bin/) over slurm/."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "gpuledger.toml").write_text(CONFIG)
    store = Store(data / "gpuledger.sqlite")
    try:  # one ended job per association, measured for 100, 200, 300 and 400 s: four different factors
        now = time.time()
        jobs = {f"1{j}": (a, u, 100 * k) for k, (j, (a, u)) in enumerate(USERS.items(), 1)}
        store.put_jobs([JobRecord(j, cluster="c", account=a, user=u, gpus=1, start=now - 1000 - s, end=now - 1000,
                                  state="COMPLETED") for j, (a, u, s) in jobs.items()])
        store.ingest(Batch("t", 1, "n1", tuple(sorted(
            (GpuSample(ts=now - 1000 - s + t, host="n1", gpu_uuid=f"GPU-{j}", gpu_index=i, job_ids=(j,))
             for i, (j, (_, _, s)) in enumerate(jobs.items()) for t in range(0, s + 1, 10)), key=lambda x: x.ts))))
    finally:
        store.close()
    bin_dir, slurm = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    slurm.mkdir()
    for name, text in (("squeue", SQUEUE), ("sprio", SPRIO), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def slurm_env(root: Path, hang_job: str = "") -> dict[str, str]:
    return {**os.environ, "PATH": f"{root / 'bin'}:{os.environ['PATH']}", "FAKE_SLURM": str(root / "slurm"),
            "HANG_JOB": hang_job}


def factors_in_slurm(root: Path) -> dict[str, int]:
    state = root / "slurm" / "state"
    lines = state.read_text().split("\n") if state.exists() else []
    return {j: int(f) for j, f in (ln.split() for ln in lines if ln)}


def priority_entries(data: Path) -> list[dict]:
    """The priority_change entries as the log holds them (read as an outside observer: committed rows only)."""
    db = sqlite3.connect(data / "audit.sqlite")
    try:
        rows = db.execute("SELECT body FROM entries WHERE kind='priority_change' ORDER BY seq").fetchall()
    finally:
        db.close()
    return [json.loads(b)["data"] for (b,) in rows]


def test_sigterm_while_scontrol_hangs_leaves_every_change_slurm_may_hold_in_the_log(cluster: Path) -> None:
    # A timer's TimeoutStartSec (or a shutdown) stops apply while slurmctld is slow to answer for dave's job:
    # the factors Slurm set, the hanging one included, are each in the log, and the log says which are unconfirmed.
    data = cluster / "data"
    gpuledger = str(Path(sys.executable).parent / "gpuledger")
    proc = subprocess.Popen([gpuledger, "priority", "apply", "--slurm", "--data-dir", str(data)],
                            env=slurm_env(cluster, hang_job="2004"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while len(factors_in_slurm(cluster)) < 4 or len(priority_entries(data)) < 7:  # 4 intents, 3 outcomes
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)  # stops now, not when the hanging command returns
    finally:
        (cluster / "slurm" / "release").touch()  # the orphaned fake scontrol ends
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, (out, err)
    assert err.strip().splitlines() == [
        "priority apply stopped by SIGTERM: 4 of 4 change(s) sent; 1 still running, recorded as unconfirmed "
        "(Slurm may have set them); 0 not sent"], err
    held = factors_in_slurm(cluster)
    entries = priority_entries(data)
    by_job: dict[str, list[dict]] = {}
    for e in entries:
        by_job.setdefault(e["job_id"], []).append(e)
    assert set(by_job) == set(held) == set(USERS)
    for job, es in by_job.items():
        assert [e["status"] for e in es] == ["intended", "unconfirmed" if job == "2004" else "applied"]
        assert {e["new_factor"] for e in es} == {held[job]}  # what Slurm holds is what the log says
    assert by_job["2004"][1]["error"] == "stopped by SIGTERM while scontrol ran: Slurm may have set it"
    with open_log(data) as log:
        assert log.verify().ok


def refuse_priority_changes(data: Path, also: str, message: str) -> None:
    """The data dir's audit log refuses its priority_change entries (those ``also`` picks, an SQL condition on
    NEW) with ``message``, as a full disk would."""
    open_log(data).close()  # the log's file, for the trigger
    db = sqlite3.connect(data / "audit.sqlite")
    db.execute(f"CREATE TRIGGER full BEFORE INSERT ON entries WHEN NEW.kind = 'priority_change' {also} "
               f"BEGIN SELECT RAISE(ABORT, '{message}'); END")
    db.commit()
    db.close()


def test_an_audit_log_that_takes_no_intent_sends_nothing_to_slurm(cluster: Path, monkeypatch) -> None:
    # the log's disk is full: not one scontrol runs, and the command says so in one line
    data = cluster / "data"
    refuse_priority_changes(data, "", "database or disk is full")
    for k, v in slurm_env(cluster).items():
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(app, ["priority", "apply", "--slurm", "--data-dir", str(data)])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "error: priority apply stopped: the audit log did not take the planned changes of "), r.stderr
    assert "database or disk is full" in r.stderr and r.stderr.rstrip().endswith("nothing was sent to Slurm")
    assert not (cluster / "slurm" / "commands").exists() and factors_in_slurm(cluster) == {}
    assert priority_entries(data) == []


class Scontrol:
    """``subprocess.run`` for SlurmClient: scontrol sets factors; each command first checks, as an outside reader
    of the audit log, that the changes it carries are there as intended."""

    def __init__(self, log_path: Path, hang: threading.Event | None = None, hang_value: int | None = None) -> None:
        self.log_path, self.hang, self.hang_value = log_path, hang, hang_value
        self.factors: dict[str, int] = {}
        self.sent: list[list[str]] = []
        self.hanging = threading.Event()

    def __call__(self, argv, *, capture_output, text, env, timeout):
        assert argv[:2] == ["scontrol", "update"], argv
        ids, value = argv[2].removeprefix("jobid=").split(","), int(argv[3].removeprefix("SiteFactor="))
        db = sqlite3.connect(self.log_path)
        try:
            logged = {(d["job_id"], d["new_factor"]) for (b,) in db.execute(
                "SELECT body FROM entries WHERE kind='priority_change'")
                for d in [json.loads(b)["data"]] if d["status"] == "intended"}
        finally:
            db.close()
        assert {(j, value) for j in ids} <= logged, "scontrol ran before its changes were in the audit log"
        self.sent.append(ids)
        self.factors.update((j, value) for j in ids)
        if value == self.hang_value and self.hang is not None:
            self.hanging.set()
            self.hang.wait(30)
        return subprocess.CompletedProcess(argv, 0, "", "")


def changes() -> list[Change]:
    """Three changes to three factors: three batches."""
    return [Change(j, "a", f"u{j}", None, None, fs, 0, round(10_000 * fs), 0.0)
            for j, fs in (("1", 0.5), ("2", 0.25), ("3", 0.1))]


def test_a_log_that_stops_taking_writes_after_a_command_stops_the_run(tmp_path: Path) -> None:
    # the first batch's intent is written, its command runs, its outcome is refused: no later batch is sent
    refuse_priority_changes(tmp_path, "AND json_extract(NEW.body, '$.data.status') <> 'intended'", "disk full")
    scontrol = Scontrol(tmp_path / "audit.sqlite")
    with open_log(tmp_path) as log, pytest.raises(AuditNotWritten) as caught:
        apply_changes(SlurmClient(run=scontrol), changes(), dry_run=False, record=record_priority_changes(log),
                      parallel=1)
    assert scontrol.sent == [["1"]]
    assert str(caught.value).startswith("priority apply stopped: the audit log did not take the outcome of 1 job ")
    assert str(caught.value).endswith("nothing more was sent to Slurm; the 1 change(s) sent before are in the log "
                                      "as intended")
    assert [(e["job_id"], e["status"]) for e in priority_entries(tmp_path)] == [("1", "intended")]


def test_sigterm_in_a_daemon_stops_between_batches_and_reaches_the_daemons_handler(tmp_path: Path) -> None:
    # `priority watch` handles SIGTERM itself: apply stops at once, records what was running as unconfirmed, sends
    # no further batch, and hands the signal on to the watch's handler
    release = threading.Event()
    scontrol = Scontrol(tmp_path / "audit.sqlite", hang=release, hang_value=2500)
    got: list[int] = []

    def watch_stop(signum: int, frame: object) -> None:
        got.append(signum)

    previous = signal.signal(signal.SIGTERM, watch_stop)
    threading.Thread(target=lambda: scontrol.hanging.wait(30) and os.kill(os.getpid(), signal.SIGTERM),
                     daemon=True).start()
    try:
        with open_log(tmp_path) as log:
            t0 = time.monotonic()
            applied = apply_changes(SlurmClient(run=scontrol), changes(), dry_run=False,
                                    record=record_priority_changes(log), parallel=1)
            took = time.monotonic() - t0
            handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        release.set()
        signal.signal(signal.SIGTERM, previous)
    assert took < 10 and got == [signal.SIGTERM]  # the watch's handler got it, once
    assert handler_after is watch_stop  # and is the handler again
    assert scontrol.sent == [["1"], ["2"]]  # the third batch was never sent
    assert [(o.change.job_id, o.status, o.error) for o in applied.outcomes] == [
        ("1", "applied", None), ("2", "failed", "stopped by SIGTERM while scontrol ran: Slurm may have set it"),
        ("3", "failed", "not sent: stopped by SIGTERM")]
    assert [(e["job_id"], e["status"]) for e in priority_entries(tmp_path)] == [
        ("1", "intended"), ("1", "applied"), ("2", "intended"), ("2", "unconfirmed")]


class Slurmctld:
    """``subprocess.run`` for SlurmClient over a table of site factors: scontrol fails for the jobs in ``ended``
    ("Job has already finished", the factor unchanged); sprio lists the factors, or fails when ``sprio_down``."""

    def __init__(self, ended: frozenset[str] = frozenset(), sprio_down: bool = False) -> None:
        self.ended, self.sprio_down = ended, sprio_down
        self.factors: dict[str, int] = {}

    def __call__(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        if argv[0] == "sprio":
            if self.sprio_down:
                return subprocess.CompletedProcess(argv, 1, "", "sprio: error: slurmctld not responding")
            return subprocess.CompletedProcess(argv, 0, "".join(f"{j}|u|1000|{f}\n" for j, f in self.factors.items()),
                                               "")
        ids, value = argv[2].removeprefix("jobid=").split(","), int(argv[3].removeprefix("SiteFactor="))
        self.factors.update((j, value) for j in ids if j not in self.ended)
        if self.ended & set(ids):
            return subprocess.CompletedProcess(argv, 1, "", "slurm_update error: Job has already finished")
        return subprocess.CompletedProcess(argv, 0, "", "")


def _change(job: str, old: int, new: int) -> Change:
    return Change(job, "a", f"u{job}", None, None, new / 10_000, old, new, 0.0)


def _explained(log, job: str) -> tuple[list[str], list[str]]:  # noqa: ANN001
    from gpuledger.accounting.audit.explain import explain

    ex = explain(log, job)
    return ([f"{s.summary} {[seq for seq, _ in s.entries]}" for s in ex.steps if s.name == "applied"],
            [m for m in ex.missing if m.startswith("applied: ")])


def test_explain_and_verify_prove_only_applied_changes(tmp_path: Path) -> None:
    # job 1 applied; job 3 failed (it ended: Slurm kept the old factor); job 4 unconfirmed (its command failed and
    # the factors could not be read back); job 2 applied, then changed again by a run whose log stopped taking
    # outcomes: that change was sent, and what came of it is not in the log
    from gpuledger.accounting.audit import verify_all

    with open_log(tmp_path) as log:
        record = record_priority_changes(log)
        apply_changes(SlurmClient(run=Slurmctld(ended=frozenset({"3"}))),
                      [_change("1", 0, 5000), _change("2", 0, 2500), _change("3", 0, 1000)], dry_run=False,
                      record=record, parallel=1)
        apply_changes(SlurmClient(run=Slurmctld(ended=frozenset({"4"}), sprio_down=True)), [_change("4", 0, 700)],
                      dry_run=False, record=record, parallel=1)
    db = sqlite3.connect(tmp_path / "audit.sqlite")
    db.execute("CREATE TRIGGER full BEFORE INSERT ON entries WHEN NEW.kind = 'priority_change' AND "
               "json_extract(NEW.body, '$.data.status') <> 'intended' BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    db.commit()
    with open_log(tmp_path) as log, pytest.raises(AuditNotWritten):
        apply_changes(SlurmClient(run=Slurmctld()), [_change("2", 2500, 2000)], dry_run=False,
                      record=record_priority_changes(log), parallel=1)
    db.execute("DROP TRIGGER full")
    db.commit()
    db.close()
    seqs = {(e["job_id"], e["new_factor"], e["status"]): n for n, e in enumerate(priority_entries(tmp_path), 1)}
    with open_log(tmp_path) as log:
        assert _explained(log, "1") == ([f"site factor 0 -> 5000 (fairshare 0.5) [{seqs['1', 5000, 'applied']}]"], [])
        applied_2 = seqs["2", 2500, "applied"]
        assert _explained(log, "2") == (
            [f"site factor 0 -> 2500 (fairshare 0.25) [{applied_2}]"],
            [f"applied: a change after entry {applied_2}'s: sent to Slurm, outcome not recorded (the run stopped); "
             f"Slurm may hold 2500 -> 2000 (entry {seqs['2', 2000, 'intended']}, intended)"])
        assert _explained(log, "3") == ([], [  # a failed change never shows as applied
            f"applied: site factor 0 -> 1000 not applied (entry {seqs['3', 1000, 'failed']}, failed: `scontrol update "
            "jobid=3 SiteFactor=1000` exited with 1: slurm_update error: Job has already finished)"])
        (why,) = _explained(log, "4")[1]
        assert _explained(log, "4")[0] == [] and why.startswith(
            f"applied: site factor 0 -> 700 may have been set (entry {seqs['4', 700, 'unconfirmed']}, unconfirmed: ")
        v = verify_all(log, None, feeds=[])
    assert v.ok, v.problems  # a change whose outcome is not logged is not tampering: a note says so
    assert [n for n in v.notes if "priority change" in n] == [
        f"not proven: job 2's priority change: sent to Slurm, outcome not recorded (the run stopped); Slurm may hold "
        f"2500 -> 2000 (entry {seqs['2', 2000, 'intended']}, intended)"]
    r = CliRunner().invoke(app, ["audit", "explain", "2", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0 and "1. applied: site factor 0 -> 2500 (fairshare 0.25)" in r.output, r.output
    assert "not proven: applied: a change after entry " in r.output and "Slurm may hold 2500 -> 2000" in r.output


def test_a_priority_change_status_apply_never_writes_fails_verify(tmp_path: Path) -> None:
    from gpuledger.accounting.audit import verify_all

    with open_log(tmp_path) as log:
        record = record_priority_changes(log)
        record([{**_change("1", 0, 5000).to_dict(), "status": "intended"}])
        old = record([_change("1", 0, 5000)])[0]  # written before changes were logged twice: applied
        (odd,) = record([{**_change("1", 5000, 6000).to_dict(), "status": "done"}])
        v = verify_all(log, None, feeds=[])
        assert v.problems == [f"audit entry {odd.seq}: the priority change of job 1 has status 'done', not one of "
                              "intended, applied, failed, unconfirmed"]
        assert _explained(log, "1") == ([f"site factor 0 -> 5000 (fairshare 0.5) [{old.seq}]"], [
            f"applied: a change after entry {old.seq}'s: entry {odd.seq}'s status 'done' is not one of intended, "
            "applied, failed, unconfirmed"])
    r = CliRunner().invoke(app, ["audit", "verify", "--data-dir", str(tmp_path)])
    assert r.exit_code == 1 and f"TAMPERED: audit entry {odd.seq}: the priority change of job 1 has status " \
        "'done'" in r.output, r.output
