"""The flat feed beside the JSON one; the watch daemon's loop: when it runs a cycle, that it survives a failed
one, and what it measures."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from test_apply_interrupted import cluster, slurm_env  # noqa: F401  (cluster: the fixture)
from testdata import capture

from gpuledger.accounting.cli import IMPORT_CURSOR_NAME
from gpuledger.accounting.priority import (
    FLAT_MAGIC,
    FeedFormatError,
    FeedSource,
    PriorityEntry,
    feed_document,
    flat_feed,
    flat_path,
    parse_flat_feed,
    site_factor,
    write_feed,
)
from gpuledger.accounting.priority_watch import CycleResult, PriorityWatch
from gpuledger.accounting.privacy import decay_horizon_start
from gpuledger.accounting.slurm import SlurmCommandError
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def metric(w: PriorityWatch, line: str) -> float:
    text = generate_latest(w.registry).decode()
    for ln in text.splitlines():
        if ln.startswith(line + " "):
            return float(ln.split()[-1])
    raise AssertionError(f"{line} not in\n{text}")


def test_cycles_on_ledger_change_at_most_every_interval_and_survives_failures() -> None:
    clock = Clock()
    state = {"v": 1}
    results: list[object] = []

    def cycle() -> CycleResult:
        r = results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    w = PriorityWatch(lambda: "feed", lambda feed: cycle(), lambda: state["v"], poll_s=1, min_interval_s=10,
                      resync_s=300, clock=clock, monotonic=clock)
    results.append(CycleResult(newest_end=900.0, changed=5, failed=0))
    assert w.poll()  # first poll: catch up (history: no lag measured)
    assert metric(w, "gpuledger_priority_lag_seconds") == 0.0
    clock.t += 5
    assert not w.poll()  # nothing changed
    state["v"] = 2  # a job ended at t=1004
    assert not w.poll()  # changed, but within min_interval of the last cycle
    clock.t += 5
    results.append(RuntimeError("sacct down"))
    assert w.poll()  # the cycle fails ...
    assert metric(w, 'gpuledger_priority_cycles_total{result="failed"}') == 1
    clock.t += 10
    results.append(CycleResult(newest_end=1004.0, changed=7, failed=1))
    assert w.poll()  # ... and the next one after the interval runs again (the state was not taken as seen)
    assert metric(w, "gpuledger_priority_lag_seconds") == pytest.approx(1020.0 - 1004.0)
    assert metric(w, 'gpuledger_priority_cycles_total{result="partial"}') == 1
    assert metric(w, "gpuledger_priority_jobs_changed_total") == 12
    clock.t += 100
    assert not w.poll()  # no change, no resync due
    clock.t += 300
    results.append(CycleResult(newest_end=1004.0, changed=0, failed=0))
    assert w.poll()  # resync
    assert metric(w, "gpuledger_priority_lag_seconds") == pytest.approx(16.0)  # no newer end: unchanged
    assert metric(w, "gpuledger_priority_last_success_timestamp_seconds") == clock.t


def test_a_failing_ledger_state_still_runs_cycles() -> None:
    clock = Clock()

    def broken():
        raise OSError("store unreadable")

    ran = []
    w = PriorityWatch(lambda: ran.append(1) or "feed", lambda feed: CycleResult(None, 0, 0), broken,
                      min_interval_s=10, clock=clock, monotonic=clock)
    assert w.poll() and ran == [1]
    clock.t += 10
    assert w.poll() and ran == [1, 1]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        PriorityWatch(lambda: "feed", lambda feed: CycleResult(None, 0, 0), lambda: 1, poll_s=0)


def test_flat_feed_beside_the_json_one(tmp_path) -> None:
    doc = {"generated_at": 12.5, "associations": [
        {"account": "proj_a", "user": "alice", "fairshare": 0.5, "site_factor": 5000},
        {"account": "proj_b", "user": "carol", "fairshare": 1.0, "site_factor": 10000}]}
    path = write_feed(tmp_path / "priority-feed.json", doc)
    assert json.loads(path.read_text()) == doc
    assert flat_path(path).read_text() == ("# gpuledger-priority-feed v1 generated_at=12.500 entries=2\n"
                                           "proj_a alice 5000\nproj_b carol 10000\n")
    assert oct(flat_path(path).stat().st_mode & 0o777) == "0o644"  # slurmctld may run as another user
    assert sorted(p.name for p in tmp_path.iterdir()) == ["priority-feed.json", "priority-feed.txt"]  # no temp left


def test_both_feed_files_name_the_fairshare_entry_they_were_made_from(tmp_path) -> None:
    entries = [PriorityEntry("proj_a", "alice", 0.5, 5000, 10.0, 0.25, 0.5)]
    doc = feed_document(entries, {"generated_at": 12.5}, FeedSource(118, "6b" * 32))
    assert (doc["audit_entry"], doc["audit_leaf"]) == (118, "6b" * 32)
    path = write_feed(tmp_path / "priority-feed.json", doc)
    assert json.loads(path.read_text()) == doc
    text = flat_path(path).read_text()
    # job_submit.lua reads the magic first and entries=N last, and ignores what lies between
    assert text == (f"{FLAT_MAGIC} generated_at=12.500 audit_entry=118 audit_leaf={'6b' * 32} entries=1\n"
                    "proj_a alice 5000\n")
    flat = parse_flat_feed(text)
    assert flat.header == {"generated_at": "12.500", "audit_entry": "118", "audit_leaf": "6b" * 32, "entries": "1"}
    assert flat.lines == [(2, "proj_a", "alice", 5000)]
    for bad, why in ((text.replace(" entries=1", " entries=2"), "1 entries, the header says 2"),
                     (text.replace(" entries=1", " entries=1 x=2"), "line 1 does not end in entries=N"),
                     (text.replace("alice 5000", "alice\t5000"), "line 2 is not 'account user factor'"),
                     (text.replace("entries=1", "entries=\u00b9"), "line 1 does not end in entries=N"),
                     ("# gpuledger-priority-feed v2 entries=0\n", "line 1 is not")):
        with pytest.raises(FeedFormatError, match=why):
            parse_flat_feed(bad)


def test_a_name_the_flat_format_cannot_carry_leaves_both_files_alone(tmp_path) -> None:
    good = {"generated_at": 1.0, "associations": [{"account": "a", "user": "u", "site_factor": 1}]}
    path = write_feed(tmp_path / "f.json", good)
    before = (path.read_text(), flat_path(path).read_text())
    bad = {"generated_at": 2.0, "associations": [{"account": "a b", "user": "u", "site_factor": 1}]}
    with pytest.raises(ValueError, match="entry 0: account 'a b'"):
        write_feed(path, bad)
    assert (path.read_text(), flat_path(path).read_text()) == before
    assert flat_feed({"associations": []}) == "# gpuledger-priority-feed v1 generated_at=0.000 entries=0\n"
    with pytest.raises(ValueError, match="must not end in .txt"):
        write_feed(tmp_path / "feed.txt", good)


def test_site_factor_rounds_halves_up_whatever_the_neighbour():
    # Fair Tree's ranks are k/n: at weight 10000, 1/32 and 3/32 are both exact halves
    assert (site_factor(1 / 32, 10000), site_factor(3 / 32, 10000)) == (313, 938)
    assert (site_factor(0.5, 1), site_factor(0.25, 2), site_factor(0.0, 10000), site_factor(1.0, 10000)) == (
        1, 1, 0, 10000)


class Outage:
    """The daemon's steps over a sacct and slurmctld that are down until ``up`` is set."""

    def __init__(self) -> None:
        self.up = False
        self.computed = self.applies = 0

    def import_jobs(self) -> None:
        if not self.up:
            raise SlurmCommandError(["sacct", "--json"], 1, "sacct: error: Problem talking to the database\n"
                                    "Connection refused")

    def compute(self) -> str:  # records a fairshare entry in the daemon
        self.computed += 1
        return f"feed {self.computed}"

    def apply(self, feed: str) -> CycleResult:
        self.applies += 1
        if not self.up:
            raise SlurmCommandError(["squeue"], 1, "squeue: error: Unable to contact slurm controller")
        return CycleResult(None, 4, 0)


def test_an_outage_computes_the_feed_once_retries_its_apply_and_counts_the_failed_imports(caplog) -> None:
    clock, mono = Clock(), Clock()
    o, state = Outage(), {"v": 1}
    w = PriorityWatch(o.compute, o.apply, lambda: state["v"], o.import_jobs, poll_s=1, min_interval_s=1,
                      resync_s=300, expected=(SlurmCommandError,), clock=clock, monotonic=mono)
    caplog.set_level("INFO", "gpuledger.priority.watch")
    for _ in range(30):  # 30 s of outage: the import fails every poll and forces nothing
        assert w.poll()
        mono.t += 1
    assert (o.computed, o.applies) == (1, 30)  # one feed (one fairshare entry), its apply retried
    assert metric(w, "gpuledger_priority_import_failures_total") == 30
    assert metric(w, "gpuledger_priority_last_import_timestamp_seconds") == 0
    assert metric(w, 'gpuledger_priority_cycles_total{result="failed"}') == 30
    # each expected failure is one line, without a traceback
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 60 and not any(r.exc_info for r in errors)
    assert errors[0].getMessage() == ("importing ended jobs failed; the ledger's other changes still count: "
                                      "`sacct --json` exited with 1: sacct: error: Problem talking to the database "
                                      "Connection refused")
    assert errors[1].getMessage().startswith(
        "priority cycle failed (the apply, with the feed computed); retrying at the next poll: `squeue` exited")
    state["v"] = 2  # usage from the collector: the feed is recomputed
    assert w.poll() and (o.computed, o.applies) == (2, 31)
    mono.t += 300  # a resync recomputes too
    assert w.poll() and o.computed == 3
    mono.t += 1
    o.import_jobs = lambda: None  # type: ignore[method-assign]  # sacct back, slurmctld still down
    o.up = True
    o.apply = lambda feed: CycleResult(None, 4, 0)  # type: ignore[method-assign]
    assert w.poll() and o.computed == 3  # the feed computed before is what is applied
    assert metric(w, 'gpuledger_priority_cycles_total{result="ok"}') == 1
    assert metric(w, "gpuledger_priority_last_import_timestamp_seconds") == clock.t
    mono.t += 1
    assert not w.poll()  # applied: nothing to retry


def test_a_cycle_after_a_failed_import_is_partial_and_an_unexpected_error_is_a_traceback(caplog) -> None:
    clock = Clock()
    o = Outage()
    w = PriorityWatch(o.compute, lambda feed: CycleResult(None, 0, 0), lambda: 1, o.import_jobs, min_interval_s=0,
                      expected=(SlurmCommandError,), clock=clock, monotonic=clock)
    assert w.poll()  # the first cycle runs, on a ledger the import could not bring up to date
    assert metric(w, 'gpuledger_priority_cycles_total{result="partial"}') == 1
    assert metric(w, 'gpuledger_priority_cycles_total{result="ok"}') == 0

    def bug() -> str:
        raise KeyError("associations")

    w = PriorityWatch(bug, lambda feed: CycleResult(None, 0, 0), lambda: 1, clock=clock, monotonic=clock)
    caplog.clear()
    assert w.poll()
    (r,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert r.exc_info is not None and r.getMessage() == "priority cycle failed (the feed); retrying at the next poll"


def test_running_jobs_are_imported_at_their_cadence_and_their_failures_counted_apart(caplog) -> None:
    clock, mono = Clock(), Clock()
    o, calls = Outage(), []
    o.up = True

    def import_running() -> None:
        calls.append(mono.t)
        if len(calls) == 2:
            raise SlurmCommandError(["sacct", "-P"], 1, "sacct: error: Problem talking to the database")

    state = {"v": 1}
    w = PriorityWatch(o.compute, o.apply, lambda: state["v"], o.import_jobs, import_running, running_every_s=60,
                      poll_s=5,
                      min_interval_s=0, expected=(SlurmCommandError,), clock=clock, monotonic=mono)
    caplog.set_level("INFO", "gpuledger.priority.watch")
    for _ in range(12):  # a minute of polls: sacct of the running jobs once
        w.poll()
        mono.t += 5
    assert calls == [1000.0]
    assert metric(w, "gpuledger_priority_last_running_import_timestamp_seconds") == clock.t
    state["v"] = 2  # a job ended
    w.poll()  # due: it fails, is counted (not as an import of ended jobs), and is tried again a cadence later
    assert metric(w, "gpuledger_priority_running_import_failures_total") == 1
    assert metric(w, "gpuledger_priority_import_failures_total") == 0
    assert metric(w, 'gpuledger_priority_cycles_total{result="partial"}') == 1  # may charge a job as agents say
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "importing running jobs failed; trying again in 60 s: `sacct -P` exited with 1: sacct: error: Problem "
        "talking to the database"]
    for _ in range(12):  # slurmdbd in trouble gets no call of every running job each poll: one a minute
        mono.t += 5
        w.poll()
    assert calls == [1000.0, 1060.0, 1120.0]
    assert metric(w, "gpuledger_priority_running_import_failures_total") == 1
    with pytest.raises(ValueError, match="running_every_s"):
        PriorityWatch(o.compute, o.apply, lambda: 1, o.import_jobs, import_running, running_every_s=0)


def test_a_wall_clock_step_back_neither_stalls_nor_hurries_the_cycles() -> None:
    wall, mono = Clock(), Clock()
    state, ran = {"v": 0}, []
    w = PriorityWatch(lambda: ran.append(wall.t) or "feed", lambda feed: CycleResult(None, 0, 0), lambda: state["v"],
                      poll_s=5, min_interval_s=10, resync_s=300, clock=wall, monotonic=mono)
    assert w.poll()
    wall.t -= 3600  # NTP steps the clock back an hour
    for _ in range(2):
        wall.t += 5
        mono.t += 5
        state["v"] += 1  # a job ended
        w.poll()
    assert len(ran) == 2  # the next cycle after min_interval, not after the hour
    assert metric(w, "gpuledger_priority_last_success_timestamp_seconds") == wall.t
    wall.t += 7200  # a step forward: no resync for it
    mono.t += 5
    assert not w.poll()


def test_stopped_after_the_import_starts_no_feed_and_no_apply() -> None:
    steps: list[str] = []
    w = PriorityWatch(lambda: steps.append("compute") or "feed",
                      lambda feed: steps.append("apply") or CycleResult(None, 0, 0), lambda: 1,
                      lambda: steps.append("import") or w.stop(), min_interval_s=0)
    assert not w.poll() and steps == ["import"]


def test_a_feed_file_on_a_full_disk_is_named(tmp_path) -> None:
    import os

    from tiny_disk import fill, mount_tmpfs, unmount

    from gpuledger.output import os_error

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not mount_tmpfs(mnt, "64k"):
        pytest.skip("needs root for a tmpfs")
    try:
        fill(mnt)
        with pytest.raises(OSError) as caught:
            write_feed(mnt / "priority-feed.json", {"generated_at": 1.0, "associations": []})
        assert os_error(caught.value) == f"{mnt / 'priority-feed.json'}: No space left on device"
        assert sorted(os.listdir(mnt)) == ["filler"]  # no temp file left
    finally:
        unmount(mnt)


# `priority watch` as a process: sacct is a fake at the machine boundary that answers with the jobs of
# $FAKE_SLURM/jobs.json whose end lies in its -S..-E window (as slurmdbd holds them now), and the running ones
# (--state=R,S) with $FAKE_SLURM/running.txt (sacct -P lines), logs each window and each call for running jobs,
# sleeps (for ended jobs) while $FAKE_SLURM/sacct_sleep exists and fails while $FAKE_SLURM/sacct_fail does
SACCT = f"""#!{sys.executable}
import json, os, sys, time
from datetime import datetime, timezone
d, a = os.environ["FAKE_SLURM"], sys.argv[1:]
S, E = (datetime.strptime(a[a.index(k) + 1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
        for k in ("-S", "-E"))
if os.path.exists(d + "/sacct_sleep") and "--state=R,S" not in a:
    open(d + "/sacct_sleeping", "w").close()
    time.sleep(float(open(d + "/sacct_sleep").read()))
if os.path.exists(d + "/sacct_fail"):
    sys.exit("sacct: error: Problem talking to the database: Connection refused")
if "--state=R,S" in a:
    open(d + "/sacct_running_calls", "a").write(f"{{S}} {{E}}\\n")
    print(open(d + "/running.txt").read() if os.path.exists(d + "/running.txt") else "JobID|State", end="")
elif "--json" in a:
    open(d + "/sacct_windows", "a").write(f"{{S}} {{E}}\\n")
    jobs = json.load(open(d + "/jobs.json")) if os.path.exists(d + "/jobs.json") else []
    print(json.dumps({{"jobs": [j for j in jobs if S <= j["time"]["end"] <= E]}}))
else:
    print("JobID|Cluster|Partition|Account|User|UID|Submit|Start|End|State|ExitCode|AllocTRES|NodeList")
"""


def ended_job(job_id: int, end: int) -> dict:
    return {"job_id": job_id, "user": "alice", "account": "proj_a", "cluster": "c", "partition": "gpu",
            "nodes": "n1", "state": {"current": ["COMPLETED"]},
            "time": {"submission": end - 110, "start": end - 100, "end": end},
            "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 1}]},
            "exit_code": {"status": ["SUCCESS"], "return_code": 0}}


def start_watch(root: Path, *args: str) -> subprocess.Popen:
    (root / "bin" / "sacct").write_text(SACCT)
    (root / "bin" / "sacct").chmod(0o755)
    return subprocess.Popen([str(Path(sys.executable).parent / "gpuledger"), "priority", "watch", "--data-dir",
                             str(root / "data"), "--metrics-port", "0", "--poll", "0.2", *args],
                            env=slurm_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, what: str, done: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def ledger_jobs(data: Path) -> set[str]:
    db = sqlite3.connect(data / "gpuledger.sqlite")
    try:
        return {j for (j,) in db.execute("SELECT job_id FROM jobs")}
    finally:
        db.close()


def audit_kinds(data: Path) -> dict[str, int]:
    db = sqlite3.connect(data / "audit.sqlite")
    try:
        return dict(db.execute("SELECT kind, count(*) FROM entries GROUP BY kind").fetchall())
    finally:
        db.close()


def first_window(slurm: Path) -> tuple[float, float]:
    s, e = (slurm / "sacct_windows").read_text().split("\n")[0].split()
    return float(s), float(e)


def test_job_ends_a_stopped_daemon_missed_or_slurmdbd_got_late_are_imported(cluster: Path) -> None:  # noqa: F811
    data, slurm = cluster / "data", cluster / "slurm"
    now = int(time.time())
    (slurm / "jobs.json").write_text(json.dumps([ended_job(777, now - 7200)]))
    # never ran before: from the decay horizon (10 half-lives of 7 days), not the last hour
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0")
    try:
        wait_for(proc, "job 777 imported", lambda: "777" in ledger_jobs(data))
    finally:
        stop(proc)
    assert first_window(slurm)[0] == pytest.approx(now - 70 * 86400, abs=30)
    # stopped for 3 h (its cursor as it left it then), and job 778 ended meanwhile
    cursor = json.loads((data / IMPORT_CURSOR_NAME).read_text())
    (data / IMPORT_CURSOR_NAME).write_text(json.dumps({**cursor, "imported_through": now - 10800}))
    (slurm / "jobs.json").write_text(json.dumps([ended_job(777, now - 7200), ended_job(778, now - 9000)]))
    (slurm / "sacct_windows").unlink()
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0")
    try:
        wait_for(proc, "job 778 imported", lambda: "778" in ledger_jobs(data))
        assert first_window(slurm)[0] == pytest.approx(now - 10800 - 900, abs=2)  # the cursor less the overlap
        # job 779 ended 10 min ago, and its record reaches slurmdbd only now: within the overlap
        (slurm / "jobs.json").write_text(json.dumps([ended_job(j, now - s) for j, s in (
            (777, 7200), (778, 9000), (779, 600))]))
        wait_for(proc, "job 779 imported", lambda: "779" in ledger_jobs(data), 20)
    finally:
        stop(proc)
    assert json.loads((data / IMPORT_CURSOR_NAME).read_text())["imported_through"] > now
    # 777, imported by both runs, is in the log once: a record imported twice changes nothing
    assert audit_kinds(data)["job_record"] == 4 + 3


def test_the_window_after_a_usage_reset_reaches_back_from_the_cursor_not_the_reset(cluster: Path) -> None:  # noqa: F811
    # a daily reset moves the decay horizon to midnight; the poll before it may have left ends just before it (and
    # slurmdbd's late ones) still to come: the window starts at the cursor, less the overlap, not at midnight
    data, slurm = cluster / "data", cluster / "slurm"
    config = (data / "gpuledger.toml").read_text()
    (data / "gpuledger.toml").write_text(config.replace("[accounting]\n", "[accounting]\nusage_reset = \"DAILY\"\n", 1))
    midnight = decay_horizon_start(time.time(), 7 * 86400.0, "DAILY", None)
    (data / IMPORT_CURSOR_NAME).write_text(json.dumps(
        {"ledger": str(data / "gpuledger.sqlite"), "imported_through": midnight - 60}))
    (slurm / "jobs.json").write_text(json.dumps([ended_job(780, int(midnight) - 30)]))
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0")
    try:
        wait_for(proc, "job 780 imported", lambda: "780" in ledger_jobs(data))
    finally:
        stop(proc)
    assert first_window(slurm)[0] == pytest.approx(midnight - 900, abs=1)


def test_sigterm_while_sacct_runs_starts_no_cycle(cluster: Path) -> None:  # noqa: F811
    data, slurm = cluster / "data", cluster / "slurm"
    (data / IMPORT_CURSOR_NAME).write_text(json.dumps(  # ran a minute ago: no horizon to import first
        {"ledger": str(data / "gpuledger.sqlite"), "imported_through": time.time() - 60}))
    proc = start_watch(cluster, "--min-interval", "0")
    try:
        wait_for(proc, "first cycle", lambda: (slurm / "commands").exists()
                 and len((slurm / "commands").read_text().split()) == 4)
        fairshare = audit_kinds(data)["fairshare"]
        # a job ends: the poll whose sacct is stopped imports it, and would run a cycle for it
        (slurm / "jobs.json").write_text(json.dumps([ended_job(777, int(time.time()) - 60)]))
        (slurm / "sacct_sleep").write_text("1")
        wait_for(proc, "sacct call", lambda: (slurm / "sacct_sleeping").exists())
        (slurm / "state").unlink()  # slurmctld: the factors are 0 again, so that a cycle would send commands
        (slurm / "commands").unlink()
    finally:
        stop(proc)
    assert "777" in ledger_jobs(data)
    assert not (slurm / "commands").exists()
    assert audit_kinds(data)["fairshare"] == fairshare


def test_an_outage_of_sacct_and_slurmctld_logs_one_line_per_failure_and_one_fairshare_entry(
        cluster: Path) -> None:  # noqa: F811
    data, slurm = cluster / "data", cluster / "slurm"
    (slurm / "sacct_fail").touch()
    (cluster / "bin" / "squeue").write_text("#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller "
                                            "(connect failure)' >&2\nexit 1\n")
    proc = start_watch(cluster, "--min-interval", "0.2")
    try:
        time.sleep(4)
    finally:
        err = stop(proc)
    lines = err.strip().split("\n")
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|ERROR) ", ln) for ln in lines), err
    failed = [ln for ln in lines if "priority cycle failed" in ln]
    assert len(failed) >= 5 and all("squeue: error: Unable to contact slurm controller" in ln for ln in failed)
    assert len([ln for ln in lines if "importing ended jobs failed" in ln]) >= 5
    assert audit_kinds(data)["fairshare"] == 1  # the feed of the first cycle, its apply retried


# The real 22.05 cluster's jobs 10 and 11 as sacct -P printed them while they ran (tests/data/slurm/real-22.05), as
# sacct answers `--state=R,S`: their lines (steps too) of the capture; and job 10's record once it has ended.
def running_capture(*job_ids: str) -> str:
    header, *lines = capture("slurm/real-22.05/sacct-a-P-S-today.txt").read_text().splitlines()
    return "\n".join([header, *(ln for ln in lines if ln.split("|")[0].split(".")[0] in job_ids)]) + "\n"


def job_10_ended(end: int) -> dict:
    start = int(datetime(2026, 11, 29, 16, 23, 28, tzinfo=UTC).timestamp())
    return {**ended_job(10, end), "cluster": "testcluster", "time": {"submission": start, "start": start, "end": end}}


def slurm_records(data: Path) -> dict[str, dict]:
    db = sqlite3.connect(data / "gpuledger.sqlite")
    try:
        return {j: json.loads(d) for j, d in db.execute("SELECT job_id, data FROM jobs WHERE source='slurm'")}
    finally:
        db.close()


def logged_records(data: Path, job_id: str) -> list[dict]:
    db = sqlite3.connect(data / "audit.sqlite")
    try:
        rows = db.execute("SELECT body FROM entries WHERE kind='job_record' ORDER BY seq").fetchall()
    finally:
        db.close()
    return [d for (b,) in rows if (d := json.loads(b)["data"])["job_id"] == job_id]


def measure_job_10(data: Path, t0: float, t1: float) -> None:
    """Its node's agent measured job 10 from t0 to t1 (as the collector stores it)."""
    store = Store(data / "gpuledger.sqlite")
    try:
        store.ingest(Batch("agent-n2", 1, "n2", tuple(
            GpuSample(ts=t, host="n2", gpu_uuid="GPU-n2", gpu_index=0, job_ids=("10",))
            for t in range(int(t0), int(t1) + 1, 10)), cluster="testcluster"))
    finally:
        store.close()


def recent_cursor(data: Path) -> None:
    """The watch ran a minute ago: no decay horizon to import first."""
    (data / IMPORT_CURSOR_NAME).write_text(json.dumps(
        {"ledger": str(data / "gpuledger.sqlite"), "imported_through": time.time() - 60}))


def calls(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_running_jobs_record_is_stored_without_an_end_and_its_end_record_replaces_it(cluster: Path) -> None:  # noqa: F811
    # sacct's running jobs reach the ledger while they run (the period rule counts them at `now`, never in a closed
    # month, and the scope holds their agents to Slurm's record); a cycle binds that record, and a later cycle the
    # ended record that replaced it: neither is a store change refused
    data, slurm = cluster / "data", cluster / "slurm"
    recent_cursor(data)
    now = int(time.time())
    measure_job_10(data, now - 300, now - 100)
    (slurm / "running.txt").write_text(running_capture("10", "11"))
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0", "--import-running", "0.2")
    try:
        wait_for(proc, "the running jobs' records", lambda: {"10", "11"} <= set(slurm_records(data)))
        assert [(r["state"], r["end"]) for j, r in sorted(slurm_records(data).items()) if j in ("10", "11")] == [
            ("RUNNING", None), ("RUNNING", None)]
        wait_for(proc, "a cycle over them", lambda: audit_kinds(data).get("store_bound", 0) >= 1)
        runs = calls(slurm / "sacct_running_calls")
        wait_for(proc, "more imports of running jobs", lambda: calls(slurm / "sacct_running_calls") >= runs + 3)
        assert len(logged_records(data, "11")) == 1  # an unchanged record, imported again, changes nothing
        # job 10 ends: its record comes with the ended jobs, and sacct no longer lists it running; the ledger
        # changes only by that record, so the next bind is of it
        bound = audit_kinds(data)["store_bound"]
        (slurm / "jobs.json").write_text(json.dumps([job_10_ended(now)]))
        (slurm / "running.txt").write_text(running_capture("11"))
        wait_for(proc, "job 10's end", lambda: slurm_records(data)["10"]["end"] == now)
        wait_for(proc, "a cycle after it", lambda: audit_kinds(data)["store_bound"] > bound)
    finally:
        err = stop(proc)
    assert all(" INFO " in ln for ln in err.strip().split("\n")), err  # no cycle failed, no record refused
    assert [(d["state"], d["end"]) for d in logged_records(data, "10")] == [("RUNNING", None), ("COMPLETED", now)]
    # a restarted watch puts every running record again (it has not seen them): the ledger merges, nothing changes
    entries = audit_kinds(data)["job_record"]
    (slurm / "sacct_running_calls").unlink()
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0", "--import-running", "0.2")
    try:
        wait_for(proc, "imports of running jobs", lambda: calls(slurm / "sacct_running_calls") >= 2)
    finally:
        stop(proc)
    assert audit_kinds(data)["job_record"] == entries
    verified = subprocess.run([str(Path(sys.executable).parent / "gpuledger"), "audit", "verify", "--data-dir",
                               str(data), "--store"], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_running_record_never_replaces_the_ended_one(cluster: Path) -> None:  # noqa: F811
    # sacct's answer for the running jobs still lists job 10 (slurmdbd behind, or the answer older than the end
    # import of the same poll): the ended record stays, as Slurm gave it at the end
    data, slurm = cluster / "data", cluster / "slurm"
    recent_cursor(data)
    now = int(time.time())
    (slurm / "jobs.json").write_text(json.dumps([job_10_ended(now - 30)]))
    (slurm / "running.txt").write_text(running_capture("10", "11"))
    proc = start_watch(cluster, "--feed-only", "--min-interval", "0", "--import-running", "0.2")
    try:
        wait_for(proc, "job 11's running record", lambda: "11" in slurm_records(data))
    finally:
        stop(proc)
    ten = slurm_records(data)["10"]
    assert (ten["state"], ten["end"], ten["exit_code"]) == ("COMPLETED", now - 30, 0)
    # (what the running answer has and the ended record lacked, its partition and TRES, is merged in: Slurm's too)
    assert {(d["state"], d["end"]) for d in logged_records(data, "10")} == {("COMPLETED", now - 30)}
    # the same through `jobs import` of a file: the end stays, and nothing changed
    (cluster / "running.txt").write_text(running_capture("10"))
    r = subprocess.run([str(Path(sys.executable).parent / "gpuledger"), "jobs", "import", "--data-dir", str(data),
                        "--sacct-parsable", str(cluster / "running.txt")], capture_output=True, text=True,
                       env={**os.environ, "TZ": "UTC"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "imported 1 job record(s); 0 new or changed"
    assert slurm_records(data)["10"] == ten


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_an_import_cadence_that_is_no_time_is_refused_naming_it(cluster: Path, value: str) -> None:  # noqa: F811
    r = subprocess.run([str(Path(sys.executable).parent / "gpuledger"), "priority", "watch", "--data-dir",
                        str(cluster / "data"), "--metrics-port", "0", "--import-running", value],
                       env=slurm_env(cluster), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("error: --import-overlap, --import-catch-up and --import-running must be seconds >= 0"
                                if value == "-1" else "error: gpuledger priority watch: Invalid value for "
                                f"'--import-running': must be a finite number, got {float(value)} (see `gpuledger "
                                "priority watch --help`)")
