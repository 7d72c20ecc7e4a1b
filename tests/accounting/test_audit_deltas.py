"""Fairshare entries logged as deltas on the entry before (``audit.chain``): an entry's size follows what changed,
not the jobs in the decay horizon; every reader reads a delta as the full entry it stands for; a base altered,
removed or swapped, and a delta that drops a job still weighing, fail `audit verify` naming the entry."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from audit_cli import run

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.audit import (
    AuditLog,
    chain,
    job_charges,
    open_log,
    record_fairshare,
    record_job_records,
    record_usage,
    usage_key,
    verify_all,
)
from gpuledger.accounting.audit.chain import read_entry
from gpuledger.accounting.audit.explain import derive, explain, fairshare_problems
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.fairshare import classic
from gpuledger.accounting.ledger import join
from gpuledger.accounting.priority import priority_feed
from gpuledger.collector.auditlog import Entry, job_key
from gpuledger.schema.records import JobRecord, JobUsage

T0 = (time.time() // 3600 - 48) * 3600  # two days ago: inside the decay horizon whenever the suite runs
SETTINGS = AccountingSettings(algorithm="classic", policy="allocated", priority_weight=1000)
TREE = AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}})


def _job(i: int, now: float) -> tuple[JobRecord, JobUsage]:
    """Job i: an hour from T0 + i x 600 s (running until then), alice's if i is odd."""
    start = T0 + 600.0 * i
    end = start + 3600.0 if start + 3600.0 <= now else None
    last = end if end is not None else now
    rec = JobRecord(str(i), cluster="c", user="alice" if i % 2 else "bob", account="a", gpus=1, start=start, end=end,
                    state="COMPLETED" if end is not None else "RUNNING")
    return rec, JobUsage(str(i), "n1", "*", start, last, 10, last - start, 0.5 * (last - start), 1e5, cluster="c")


def _cycle(log: AuditLog, jobs: list[int], now: float, full: bool | None = None, drop: tuple[str, ...] = ()):
    """A fairshare cycle at ``now`` over ``jobs`` as `priority feed` records it (the jobs in ``drop`` left out of
    the charges, everything computed from the rest consistent); its entry."""
    pairs = [_job(i, now) for i in jobs]
    records, usages = [r for r, _ in pairs], [u for _, u in pairs]
    record_job_records(log, records)
    record_usage(log, usages)
    charges = [c for c in job_charges(join(records, usages, now=now), SETTINGS, now) if c.job_id not in drop]
    usage: dict[tuple[str, str], float] = {}
    for c in charges:
        usage[(c.account, c.user)] = usage.get((c.account, c.user), 0.0) + c.decayed
    rows = classic(TREE, usage)
    sources = {r.job_id: {"job_entry": log.latest(job_key(r)).seq, "usage_entry": log.latest(usage_key(u)).seq}
               for r, u in pairs}
    return record_fairshare(log, now=now, settings=SETTINGS, charges=charges, usage=usage, rows=rows,
                            feed=priority_feed(rows, 1000), sources=sources, full=full)


def _jobs(log: AuditLog, seq: int) -> dict:
    read = read_entry(log, log.get(seq))
    assert read.problem is None and read.entry is not None, read.problem
    return read.entry.data["inputs"]["jobs"]


def test_a_delta_logs_what_changed_and_reads_as_the_full_entry(tmp_path):
    """Cycle 2 (35 minutes on): jobs 4 to 6 ended, job 7 is charged; the other jobs' decayed charges moved,
    nothing else. The delta logs jobs 4 to 7 only, and reads back as the entry logged in full at that time (the
    decayed charges recomputed from the pieces), which explain shows step for step."""
    now = T0 + 600.0 * 6 + 1800.0  # jobs 4 to 6 run
    # users in clear: two data dirs would pseudonymize them under two keys
    with open_log(tmp_path / "full", pseudonymize=False) as full, \
            open_log(tmp_path / "delta", pseudonymize=False) as delta:
        for log in (full, delta):
            _cycle(log, list(range(7)), now, full=True)
        whole = _cycle(full, list(range(8)), now + 2100.0, full=True)
        e = _cycle(delta, list(range(8)), now + 2100.0, full=False)
        assert e.seq == whole.seq and "jobs" not in e.data["inputs"]
        d = e.data["inputs"]["delta"]
        assert sorted(d["jobs"]) == ["4", "5", "6", "7"] and d["dropped"] == []  # 4..6 ended, 7 is new
        base = list(delta.entries(kind="fairshare"))[-2]
        assert (d["base"], d["base_leaf"]) == (base.seq, base.leaf.hex())
        assert all("decayed" not in c for c in d["jobs"].values())
        assert len(json.dumps(e.data)) < len(json.dumps(whole.data)) * 0.8
        logged = whole.data["inputs"]["jobs"]
        assert _jobs(delta, e.seq) == {j: {k: v for k, v in c.items() if k != "decayed"} for j, c in logged.items()}
        assert verify_all(full, None, feeds=[]).ok and verify_all(delta, None, feeds=[]).ok
        for job in ("1", "6", "7"):
            a, b = explain(full, job), explain(delta, job)
            assert [s.name for s in a.steps] == [s.name for s in b.steps] and a.missing == b.missing, (a, b)
            # a delta that carries the job's charge on cites the entry that logs it too (job 1's: the full one)
            carried = chain.logged_in(delta, e, job)
            assert (carried.seq == e.seq) == (job != "1")
            for x, y in zip(a.steps, b.steps, strict=True):
                cited = [seq for seq, _ in y.entries]
                if carried.seq != e.seq and e.seq in cited:
                    assert cited[0] == carried.seq
                    cited = cited[1:]
                assert [seq for seq, _ in x.entries] == cited  # (leaves: other times)
                if x.name == "decayed usage":  # the same number, recomputed rather than logged
                    assert f"{logged[job]['decayed']!r} of association" in y.summary, y.summary
                    assert "recomputed from its logged pieces (a delta entry logs it only so)" in y.summary
                else:
                    assert x.summary == y.summary


def test_the_recorder_logs_a_delta_where_it_saves_and_in_full_where_it_does_not(tmp_path):
    with open_log(tmp_path) as log:
        _cycle(log, list(range(3)), T0 + 7200.0)
        # nothing changed, but a delta would leave out 3 job records: not worth a read walking back to the full one
        assert "jobs" in _cycle(log, list(range(3)), T0 + 7500.0).data["inputs"]
        many, now = list(range(300)), T0 + 600.0 * 300  # jobs 295..299 still running
        first = _cycle(log, many, now)
        assert "jobs" in first.data["inputs"]  # 297 jobs more than its base: in full
        e = _cycle(log, many, now + 300.0)
        assert e.data["inputs"]["delta"]["base"] == first.seq
        assert sorted(e.data["inputs"]["delta"]["jobs"]) == [str(i) for i in range(295, 300)]  # their charge grew
        assert verify_all(log, None, feeds=[]).ok
        # the changes since the last full entry would reach half its jobs: in full again
        e = _cycle(log, many[:140], now + 600.0)
        assert "jobs" in e.data["inputs"]


def _logs(tmp_path: Path) -> tuple[Path, int, int, int]:
    """A data dir whose log has a full fairshare entry, a delta on it and a delta on that; (dir, their seqs)."""
    d = tmp_path / "data"
    now = T0 + 600.0 * 6 + 1800.0
    with open_log(d) as log:
        seqs = [_cycle(log, list(range(7 + k)), now + 300.0 * k, full=k == 0).seq for k in range(3)]
        assert verify_all(log, None, feeds=[]).ok
    return d, *seqs


def _rewrite(path: Path, edit) -> None:
    """The attacker's full rewrite (as ``test_audit_attacks._rebuild``): every entry re-hashed, the tree and head
    recomputed. ``edit(seq, row) -> row`` (None: the entry left out)."""
    db = sqlite3.connect(path)
    rows = [json.loads(b) for (b,) in db.execute("SELECT body FROM entries ORDER BY seq")]
    db.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    kept = [r2 for r2 in (edit(r["seq"], r) for r in rows) if r2 is not None]
    times = iter([r["ts"] for r in kept])
    with AuditLog(path, clock=lambda: next(times)) as log:
        for r in kept:
            log.append(r["kind"], r["data"], r["job_id"], r["key"])


def _tampered(d: Path) -> str:
    r = run("audit", "verify", "--data-dir", d)
    assert r.exit_code == 1, r.output
    return r.output


def test_a_delta_whose_base_was_altered_fails_verify(tmp_path):
    d, first, middle, last = _logs(tmp_path)

    def edit(seq, row):  # job 1's charge in the full entry, and its association's usage to match
        if seq == first:
            row["data"]["inputs"]["jobs"]["1"]["usage_entry"] = 1
        return row

    _rewrite(d / "audit.sqlite", edit)
    out = _tampered(d)
    assert f"TAMPERED: audit entry {middle}: its base is entry {first}, whose leaf hash is not the " in out \
        and "it names (altered): its inputs cannot be read" in out, out
    assert f"TAMPERED: audit entry {last}: its base, entry {middle}, cannot be read" in out, out


def test_a_delta_whose_base_was_removed_or_swapped_fails_verify(tmp_path):
    d, first, middle, last = _logs(tmp_path)
    _rewrite(d / "audit.sqlite", lambda seq, row: None if seq == middle else row)
    out = _tampered(d)  # the entries after it renumbered: the last delta now sits at middle's place
    assert f"TAMPERED: audit entry {last - 1}: its base is entry {middle}, not the fairshare entry before it (entry " \
           f"{first}): its inputs cannot be read" in out, out

    d, first, middle, last = _logs(tmp_path / "swapped")
    with open_log(d) as log:
        first_leaf = log.get(first).leaf.hex()

    def swap(seq, row):  # the last delta names the full entry, with its real leaf hash, as its base
        if seq == last:
            row["data"]["inputs"]["delta"].update(base=first, base_leaf=first_leaf)
        return row

    _rewrite(d / "audit.sqlite", swap)
    out = _tampered(d)
    assert f"TAMPERED: audit entry {last}: its base is entry {first}, not the fairshare entry before it (entry " \
           f"{middle}): its inputs cannot be read" in out, out


def test_a_delta_that_drops_a_job_still_weighing_fails_verify(tmp_path):
    """Everything the forged delta says follows from what it charges; only its base shows job 3 is gone."""
    d, _, _, last = _logs(tmp_path)
    with open_log(d) as log:
        e = _cycle(log, list(range(9)), log.get(last).data["now"], full=False, drop=("3",))
    assert e.data["inputs"]["delta"]["dropped"] == ["3"]
    out = _tampered(d)
    assert f"TAMPERED: audit entry {e.seq}: job 3, charged by entry {last} and still inside the decay horizon" in out \
        and "is not charged (dropped)" in out, out
    assert out.count("TAMPERED") == 1, out
    r = run("audit", "explain", "3", "--data-dir", d)
    assert f"the newest fairshare entry {e.seq} does not charge this job, though it still weighs in fairshare " \
           f"(dropped); the steps shown are entry {last}'s" in r.output, r.output


def test_a_delta_that_drops_a_job_its_base_does_not_charge_fails_verify(tmp_path):
    d, _, _, last = _logs(tmp_path)
    with open_log(d) as log:
        data = json.loads(json.dumps(log.get(last).data))
        data["inputs"]["delta"].update(base=last, base_leaf=log.get(last).leaf.hex(), jobs={}, dropped=["99"])
        seq = log.append("fairshare", data).seq
    out = _tampered(d)
    assert f"audit entry {seq}: drops job 99, which its base entry {last} does not charge" in out, out


def test_a_log_of_full_entries_then_deltas_verifies_and_explains(tmp_path):
    """A log the previous release wrote (every fairshare entry in full) goes on with deltas: each reads as before."""
    d, _, _, last = _logs(tmp_path)
    r = run("audit", "verify", "--data-dir", d)
    assert r.exit_code == 0, r.output
    r = run("audit", "explain", "1", "--data-dir", d)  # ended before the full entry: no delta logs it
    assert r.exit_code == 0, r.output
    with open_log(d) as log:
        assert "1" not in log.get(last).data["inputs"]["delta"]["jobs"]
        full = chain.logged_in(log, log.get(last), "1")  # the full entry that logs job 1's charge
        assert chain.delta_of(full) is None
        ref = f"proven by #{full.seq} {full.leaf.hex()[:12]}, #{last} {log.get(last).leaf.hex()[:12]}"
    assert "3. charged usage: policy allocated: 3600.0 allocated GPU-s = 3600.0 (recomputed from the logged record: " \
           f"same)\n   {ref}" in r.output, r.output
    assert "recomputed from its logged pieces (a delta entry logs it only so)" in r.output, r.output
    assert "not proven" not in r.output.replace("not proven: applied", ""), r.output


def _forged_delta(log: AuditLog, base: Entry, assoc: Entry) -> Entry:
    """A delta on ``base`` that changes nothing (``assoc``'s associations, rows and feed)."""
    e = log.append("fairshare", {**assoc.data, "inputs": {
        chain.DELTA: {"base": base.seq, "base_leaf": base.leaf.hex(), "jobs": {}, "dropped": []},
        "associations": assoc.data["inputs"]["associations"]}})
    assert e is not None
    return e


def test_a_delta_on_an_older_entry_or_past_the_chain_bound_is_refused_by_verify_and_every_reader(
        tmp_path, monkeypatch):
    """Verify (``Chain``) and the readers (``read_entry``: explain, the recorder) hold a delta to the same rules: its
    base is the fairshare entry right before it, and no more than ``FULL_EVERY`` deltas follow a full entry."""
    now = T0 + 600.0 * 6 + 1800.0
    with open_log(tmp_path / "skip", pseudonymize=False) as log:
        first = _cycle(log, [1, 2, 3, 4, 5], now, full=True)
        second = _cycle(log, [1, 2, 3, 4, 5], now + 60, full=False)
        forged = _forged_delta(log, first, second)  # on entry `first`, though `second` came between
        problems = [p for _, p in fairshare_problems(log)]
        assert f"audit entry {forged.seq}: its base is entry {first.seq}, not the fairshare entry before it " \
               f"(entry {second.seq}): its inputs cannot be read" in problems, problems
        read = read_entry(log, forged)
        assert read.entry is None and read.problem == (
            f"audit entry {forged.seq}: its base, entry {first.seq}, is not the fairshare entry before it: its inputs "
            "cannot be read")
    monkeypatch.setattr(chain, "FULL_EVERY", 3)
    with open_log(tmp_path / "long", pseudonymize=False) as log:
        at = first = _cycle(log, [1, 2, 3, 4, 5], now, full=True)
        for _ in range(4):  # four deltas in a row, one more than readers walk
            at = _forged_delta(log, at, first)
        problems = [p for _, p in fairshare_problems(log)]
        assert problems == [f"audit entry {at.seq}: more than 3 delta entries since a full one"], problems
        assert read_entry(log, at).problem == f"audit entry {at.seq}: more than 3 delta entries since a full one"
        assert any("more than 3 delta entries" in m for m in explain(log, "1").missing)


def test_verify_reads_a_job_a_delta_logs_again_from_that_delta(tmp_path):
    """Verify keeps each job's record as read between entries (a delta carries its base's on): a forged delta that
    logs job 1 again with its pieces moved an hour earlier (its charge, times and sources the same) decays to less
    than its association's logged usage, and verify says so, as a fresh read of the entry does."""
    d, _, _, last = _logs(tmp_path)
    with open_log(d) as log:
        base = log.get(last)
        record = json.loads(json.dumps(_jobs(log, last)["1"]))
        assert "decayed" not in record and record["pieces"]  # recomputed from its pieces
        record["pieces"] = [[a - 3600.0, b - 3600.0, x] for a, b, x in record["pieces"]]
        data = json.loads(json.dumps(base.data))
        data["inputs"]["delta"].update(base=last, base_leaf=base.leaf.hex(), jobs={"1": record}, dropped=[])
        forged = log.append("fairshare", data)
        fresh = derive(read_entry(log, forged).entry).problems  # no record kept from an entry before
        assert any("decayed usage" in p and "is not the sum of its" in p for p in fresh), fresh
        problems = [p for seq, p in fairshare_problems(log) if seq == forged.seq]
        assert problems == fresh, problems
        assert not [p for seq, p in fairshare_problems(log) if seq != forged.seq]
