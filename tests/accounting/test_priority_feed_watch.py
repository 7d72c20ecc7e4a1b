"""The flat feed beside the JSON one; the watch daemon's loop: when it runs a cycle, that it survives a failed
one, and what it measures."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

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

    w = PriorityWatch(cycle, lambda: state["v"], poll_s=1, min_interval_s=10, resync_s=300, clock=clock)
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
    w = PriorityWatch(lambda: ran.append(1) or CycleResult(None, 0, 0), broken, min_interval_s=10, clock=clock)
    assert w.poll() and ran == [1]
    clock.t += 10
    assert w.poll() and ran == [1, 1]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        PriorityWatch(lambda: CycleResult(None, 0, 0), lambda: 1, poll_s=0)


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
