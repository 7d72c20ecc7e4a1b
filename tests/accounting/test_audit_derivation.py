"""A fairshare entry's outputs must follow from its inputs: `audit verify` recomputes each one (decay, each
association's usage as the sum of its jobs', the fairshare rows, every site factor) with accounting's own code,
names the entry and what does not follow (exit 1), and `audit explain` marks such a step "not proven". The
priority feed files name the entry they were made from, and verify compares them with it. An operator who can
write the data dir appends the forgeries here (an append keeps every earlier checkpoint valid)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from audit_cli import CONFIG, run

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.audit import (
    AuditLog,
    job_charges,
    keygen,
    open_log,
    record_fairshare,
    record_job_records,
    record_usage,
    verify_all,
)
from gpuledger.accounting.audit.explain import derive, explain
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.engine import ChargedJob
from gpuledger.accounting.fairshare import classic
from gpuledger.accounting.ledger import join
from gpuledger.accounting.priority import FLAT_MAGIC, parse_flat_feed, priority_feed
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

# two days ago, on the hour: inside the decay horizon (10 half-lives of 7 days) whenever the suite runs
T0 = (time.time() // 3600 - 48) * 3600


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _s(ts, gpu, job):
    return GpuSample(ts=ts, host="n1", gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200", sm_active_ratio=0.5,
                     energy_joules=360.0 * (ts - T0), job_ids=(job,))


def _data_dir(tmp_path: Path, job1_from: float = 0.0, agent_job: bool = False, config: str = CONFIG) -> Path:
    """Jobs 1 (alice, n1's G0) and 2 (bob, G1), an hour each; job 1 measured from ``job1_from`` s into its hour;
    ``agent_job``: and job 3 on G2, which only its agent describes (alice's, it says)."""
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    gpus = (("G0", "1"), ("G1", "2"), *((("G2", "3"),) if agent_job else ()))
    try:
        store.ingest(Batch("a", 0, "n1", tuple(_s(T0 + 10 * k, g, j) for g, j in gpus
                                                 for k in range(361) if j != "1" or 10 * k >= job1_from),
                           jobs=(JobRecord("3", user="alice", account="a", hosts=("n1",)),) if agent_job else (),
                           cluster="c" if agent_job else None))
    finally:
        store.close()
    (d / "gpuledger.toml").write_text(config)
    jobs = tmp_path / "sacct.txt"
    jobs.write_text("JobID|Cluster|User|UID|Account|Partition|AllocTRES|Submit|Start|End|State\n" + "".join(
        f"{j}|c|{u}|100{j}|a|gpu|gres/gpu=1|{_iso(T0)}|{_iso(T0)}|{_iso(T0 + 3600)}|COMPLETED\n"
        for j, u in (("1", "alice"), ("2", "bob"))))
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", jobs).exit_code == 0
    assert run("priority", "feed", "--data-dir", d).exit_code == 0
    return d


@pytest.fixture()
def fed(tmp_path):
    """A data dir after one feed, and the auditor's checkpoint of its log (with the public key to check it)."""
    d = _data_dir(tmp_path)
    key = keygen()
    cp = tmp_path / "cp.txt"
    assert run("audit", "checkpoint", "--data-dir", d, "-o", cp).exit_code == 0
    return d, ("--checkpoint", cp, "--public-key", key.public)


def _forge(d: Path, edit) -> int:
    """Append a copy of the newest fairshare entry as ``edit(data, log)`` changes it; its number."""
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        data = copy.deepcopy(fs.data)
        edit(data, log)
        return log.append("fairshare", data).seq


def _assoc(items, log, user):
    return next(r for r in items if r.get("user") == log.alias(user))


def _verify(d: Path, pinned=()):
    return run("audit", "verify", "--data-dir", d, *pinned)


def test_an_honest_feed_verifies_and_explain_proves_every_derived_step(fed):
    d, pinned = fed
    r = _verify(d, pinned)
    assert r.exit_code == 0, r.output
    r = run("audit", "explain", "1", "--data-dir", d)
    assert r.exit_code == 0, r.output
    assert "(recomputed from its logged pieces: same; the association's is the sum of its 1 job(s)' decayed " \
           "charges)" in r.output, r.output
    assert "(recomputed from the logged tree, shares and usage: same)" in r.output
    assert "6. site factor: round(1000 x" in r.output and "(recomputed, halves up: same)" in r.output
    assert r.output.count("not proven") == 1 and "not proven: applied" in r.output, r.output


def test_a_site_factor_that_does_not_follow_from_its_fairshare_fails_verify(fed):
    d, pinned = fed

    def edit(data, log):
        _assoc(data["outputs"]["feed"], log, "bob")["site_factor"] = 999

    seq = _forge(d, edit)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"TAMPERED: audit entry {seq}: u-" in r.output and "'s site factor 999 does not follow from its " \
           "fairshare" in r.output and "round-half-up(1000 x" in r.output, r.output
    r = run("audit", "explain", "2", "--data-dir", d)
    assert "not proven: site factor: round(1000 x" in r.output and ") = 999; " in r.output, r.output
    assert ". site factor:" not in r.output  # never a numbered (proven) step


def test_an_association_usage_that_is_not_its_jobs_sum_fails_verify(fed):
    d, pinned = fed

    def edit(data, log):
        _assoc(data["inputs"]["associations"], log, "alice")["decayed_usage"] = 1.0

    seq = _forge(d, edit)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"audit entry {seq}: " in r.output and "'s decayed usage 1.0 is not the sum of its 1 job(s)' decayed " \
           "charges" in r.output, r.output
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "not proven: decayed usage:" in r.output and "(does not follow)" in r.output, r.output
    # the fairshare is computed from that usage: no longer proven either, for anyone
    assert "not proven: fairshare:" in r.output and "not proven: site factor:" in r.output, r.output
    assert "not proven: fairshare:" in run("audit", "explain", "2", "--data-dir", d).output


def test_a_fairshare_row_that_does_not_follow_from_shares_and_usage_fails_verify(fed):
    d, pinned = fed

    def edit(data, log):  # alice's fairshare 0.9 with the site factor it rounds to: only the row is forged
        for part in ("rows", "feed"):
            _assoc(data["outputs"][part], log, "alice")["fairshare"] = 0.9
        _assoc(data["outputs"]["feed"], log, "alice")["site_factor"] = 900

    seq = _forge(d, edit)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"audit entry {seq}: " in r.output and "'s fairshare row does not follow from the logged shares and " \
           "usage (classic): fairshare 0.9 (recomputed " in r.output, r.output
    assert "site factor 900 does not follow" not in r.output  # 900 is round(1000 x 0.9): the row is what is wrong
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "not proven: fairshare:" in r.output and "-> fairshare 0.9; " in r.output, r.output
    assert "not proven: site factor: round(1000 x 0.9) = 900 (recomputed, halves up: same); the fairshare it is made " \
           "of is not proven" in r.output, r.output


def test_a_decayed_charge_above_what_the_charge_can_decay_to_fails_verify(fed):
    d, pinned = fed

    def edit(data, log):  # job 1 not decayed at all, its association's usage to match, in an entry of the shape
        for c in data["inputs"]["jobs"].values():  # written before entries logged pieces
            del c["pieces"]
        job = data["inputs"]["jobs"]["1"]
        job["decayed"] = job["charged"]
        _assoc(data["inputs"]["associations"], log, "alice")["decayed_usage"] = job["charged"]

    seq = _forge(d, edit)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"audit entry {seq}: job 1's decayed charge 3600.0 is more than its charge decays to even if all of it " \
           "was used at its last time" in r.output, r.output
    assert "not proven: decayed usage:" in run("audit", "explain", "1", "--data-dir", d).output


def _charging_job_1_only(log: AuditLog, fs) -> int:
    """Append a fairshare entry that charges only job 1, as entry ``fs`` did, at fs's time (job 1's logged pieces
    decay to the same charge) and with its settings; returns its seq."""
    settings = AccountingSettings(**fs.data["settings"])
    job = fs.data["inputs"]["jobs"]["1"]
    charge = ChargedJob(**{**{f.name: job[f.name] for f in dataclasses.fields(ChargedJob)}, "user": "alice"})
    usage = {("a", "alice"): job["decayed"]}
    rows = classic(AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}}), usage)
    sources = {"1": {k: job[k] for k in ("usage_entry", "job_entry", "gpu_entries")}}
    return record_fairshare(log, now=fs.data["now"], settings=settings, charges=[charge], usage=usage, rows=rows,
                            feed=priority_feed(rows, 1000), sources=sources).seq


def test_a_job_dropped_while_it_still_weighs_fails_verify(fed):
    """Every output of the forged entry follows from its inputs; only the entry before it shows job 2 is gone."""
    d, pinned = fed
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        seq = _charging_job_1_only(log, fs)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"TAMPERED: audit entry {seq}: job 2, charged by entry {fs.seq} and still inside the decay horizon (last " \
           f"used {_iso(T0 + 3600)}Z), is not charged (dropped)" in r.output, r.output
    assert r.output.count("TAMPERED") == 1, r.output
    r = run("audit", "explain", "2", "--data-dir", d)
    assert f"not proven: charged usage: the newest fairshare entry {seq} does not charge this job, though it still " \
           f"weighs in fairshare (dropped); the steps shown are entry {fs.seq}'s" in r.output, r.output


def test_a_job_whose_records_were_accepted_as_gone_may_leave_fairshare(fed):
    d, pinned = fed
    db = sqlite3.connect(d / "gpuledger.sqlite")
    for table in ("jobs", "usage"):
        db.execute(f"DELETE FROM {table} WHERE job_id='2'")
    db.commit()
    db.close()
    r = run("priority", "feed", "--data-dir", d, "--accept-store-changes", "job 2 was a test job (ticket 9)")
    assert r.exit_code == 0, r.output
    with open_log(d) as log:
        assert "2" not in next(log.entries(kind="fairshare", newest_first=True)).data["inputs"]["jobs"]
    r = _verify(d, pinned)
    assert r.exit_code == 0, r.output


def test_a_job_only_agents_described_leaves_fairshare_once_their_word_is_no_longer_taken(tmp_path):
    """An entry of a site that charged jobs Slurm has no record of (``charge_unrecorded_jobs``, the only rule
    before the setting existed), then one of the default: the agent-only job is no longer charged, which is no
    drop verify fails on; while the agents' word is still taken, dropping it is."""
    taking = CONFIG.replace("[accounting]\n", "[accounting]\ncharge_unrecorded_jobs = true\n")
    d = _data_dir(tmp_path / "forged", agent_job=True, config=taking)
    with open_log(d) as log:
        taken = next(log.entries(kind="fairshare", newest_first=True))
        assert "3" in taken.data["inputs"]["jobs"]
        forged = _charging_job_1_only(log, taken)  # the agents' word still taken, yet job 3 left out (2 as well)
    r = _verify(d)
    assert r.exit_code == 1 and f"audit entry {forged}: job 3, charged by entry {taken.seq}" in r.output, r.output
    # an honest log: the site takes the agents' word, then no longer does
    d = _data_dir(tmp_path / "honest", agent_job=True, config=taking)
    (d / "gpuledger.toml").write_text(CONFIG)
    r = run("priority", "feed", "--data-dir", d)
    assert r.exit_code == 0 and "1 measured job(s) Slurm has no record of are not charged" in r.output, r.output
    with open_log(d) as log:
        newest = next(log.entries(kind="fairshare", newest_first=True))
        assert "3" not in newest.data["inputs"]["jobs"] and newest.data["settings"]["charge_unrecorded_jobs"] is False
    r = _verify(d)
    assert r.exit_code == 0, r.output
    r = run("audit", "explain", "3", "--data-dir", d)
    assert "dropped" not in r.output, r.output
    # Slurm's record of job 3 arrives after that entry: it says nothing of the entry's drop (the next entry charges it)
    sacct = tmp_path / "job3.txt"
    sacct.write_text("JobID|Cluster|User|UID|Account|Partition|AllocTRES|Submit|Start|End|State\n"
                     f"3|c|alice|1003|a|gpu|gres/gpu=1|{_iso(T0)}|{_iso(T0)}|{_iso(T0 + 3600)}|COMPLETED\n")
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", sacct).exit_code == 0
    r = _verify(d)
    assert r.exit_code == 0, r.output
    assert run("priority", "feed", "--data-dir", d).exit_code == 0
    with open_log(d) as log:
        assert "3" in next(log.entries(kind="fairshare", newest_first=True)).data["inputs"]["jobs"]
    r = _verify(d)
    assert r.exit_code == 0, r.output


def test_decay_the_entry_cannot_recompute_is_not_proven_yet_verifies(tmp_path):
    """Job 1 was measured only from 20 minutes into its hour: its unmeasured part accrues over the whole hour, its
    measured part over the hours it was used, so its charge is not even over first..last, and a fairshare entry
    written before entries logged how charges were placed does not say: explain cannot prove its decay (and does
    not claim to); nothing is forged."""
    d = _data_dir(tmp_path, job1_from=1200.0)

    def edit(data, log):
        for c in data["inputs"]["jobs"].values():
            del c["pieces"]

    _forge(d, edit)
    r = _verify(d)
    assert r.exit_code == 0, r.output
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "not proven: decayed usage: " in r.output and "does not log where in time job 1's charge was placed " \
           "(hour by hour), so its decay cannot be recomputed (spread evenly over first..last it decays to" \
           in r.output, r.output
    assert ". decayed usage:" not in r.output and "4. fairshare:" in r.output, r.output  # the rest follows


def test_rows_that_do_not_state_the_tree_prove_no_fairshare(fed):
    d, pinned = fed

    def edit(data, log):  # as a writer that logged rows without their place in the tree would
        for r in data["outputs"]["rows"]:
            del r["depth"]

    seq = _forge(d, edit)
    assert _verify(d, pinned).exit_code == 0  # nothing in it contradicts its inputs
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "not proven: fairshare: classic: norm shares 0.5, effective usage " in r.output, r.output
    assert f"entry {seq}'s rows do not state the tree (depth and shares), so its fairshare cannot be recomputed" \
        in r.output, r.output
    assert "not proven: site factor: round(1000 x" in r.output and "the fairshare it is made of is not proven" \
        in r.output, r.output


def _logged(tmp_path: Path, decayed_by: float = 1.0, pieces: bool = True) -> AuditLog:
    """A log whose fairshare entry logs how each charge was placed in time (``job_charges``' pieces, or none);
    job 1's decayed charge times ``decayed_by``, everything computed from it consistent."""
    settings = AccountingSettings(algorithm="classic", policy="allocated", priority_weight=1000)
    records = [JobRecord(j, cluster="c", user=u, account="a", gpus=1, start=T0, end=T0 + 3600)
               for j, u in (("1", "alice"), ("2", "bob"))]
    usages = [JobUsage(r.job_id, "n1", "*", T0, T0 + 3600, 361, 3600.0, 1800.0, 1e6) for r in records]
    now = T0 + 7200
    charges = job_charges(join(records, usages), settings, now)
    charges[0] = dataclasses.replace(charges[0], decayed=charges[0].decayed * decayed_by)
    if not pieces:
        charges = [dataclasses.replace(c, pieces=None) for c in charges]
    usage = {(c.account, c.user): c.decayed for c in charges}
    rows = classic(AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}}), usage)
    log = open_log(tmp_path)
    record_job_records(log, records)
    record_usage(log, usages)
    entry = record_fairshare(log, now=now, settings=settings, charges=charges, usage=usage, rows=rows,
                             feed=priority_feed(rows, 1000))
    if not pieces:  # an entry that does not say how charges were placed (as engine.ChargedJob's)
        assert all(j["pieces"] is None for j in entry.data["inputs"]["jobs"].values())
    return log


def test_decay_is_recomputed_from_the_pieces_the_entry_logs(tmp_path):
    with _logged(tmp_path / "honest") as log:
        assert verify_all(log, None, feeds=[]).ok
        (step,) = [s for s in explain(log, "1").steps if s.name == "decayed usage"]
        assert "recomputed from its logged pieces: same" in step.summary
    # job 1's decay lowered a little, its association's usage, fairshare and site factors computed from that
    with _logged(tmp_path / "forged", decayed_by=1 - 1e-4) as log:
        v = verify_all(log, None, feeds=[])
        (p,) = v.problems
        assert p.startswith("audit entry 5: job 1's decayed charge ") and "is not what its logged pieces decay to" in p
        assert any(m.startswith("decayed usage: ") and "(does not follow)" in m for m in explain(log, "1").missing)


def test_logged_pieces_cannot_be_left_out_for_one_job(tmp_path):
    """An entry whose jobs log pieces leaves them out of none: a job left without is named."""
    with _logged(tmp_path, pieces=False) as log:
        fs = next(log.entries(kind="fairshare"))
        data = copy.deepcopy(fs.data)
        data["inputs"]["jobs"]["2"]["pieces"] = [[T0, T0 + 3600, data["inputs"]["jobs"]["2"]["charged"]]]
        seq = log.append("fairshare", data).seq
        problems = verify_all(log, None, feeds=[]).problems
    assert problems == [f"audit entry {seq}: job 1 logs no pieces, though the entry's other jobs do"], problems


def test_the_feed_files_name_the_fairshare_entry_they_were_made_from(fed):
    d, _ = fed
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
    flat = parse_flat_feed((d / "priority-feed.txt").read_text())
    assert (flat.header["audit_entry"], flat.header["audit_leaf"]) == (str(fs.seq), fs.leaf.hex())
    first = (d / "priority-feed.txt").read_text().splitlines()[0]
    # what contrib/slurm/job_submit.lua needs of the header: its magic first, entries=N last
    assert first.startswith(FLAT_MAGIC + " ") and first.endswith(" entries=2")
    doc = json.loads((d / "priority-feed.json").read_text())
    assert (doc["audit_entry"], doc["audit_leaf"]) == (fs.seq, fs.leaf.hex())


@pytest.mark.parametrize("name", ["priority-feed.txt", "priority-feed.json"])
def test_an_edited_feed_file_fails_verify_naming_the_file_and_association(fed, name):
    d, pinned = fed
    path = d / name
    text = path.read_text()
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        factor = _assoc(fs.data["outputs"]["feed"], log, "bob")["site_factor"]
    if name.endswith(".txt"):
        edited = text.replace(f"a bob {factor}\n", "a bob 999\n")
    else:
        doc = json.loads(text)
        next(a for a in doc["associations"] if a["user"] == "bob")["site_factor"] = 999
        edited = json.dumps(doc, indent=2)
    assert edited != text
    path.write_text(edited)
    r = _verify(d, pinned)
    assert r.exit_code == 1, r.output
    assert f"TAMPERED: {path}: bob@a's site factor 999 is not audit entry {fs.seq}'s {factor}" in r.output, r.output


def test_a_feed_that_names_no_entry_of_the_log_or_is_no_feed_fails_verify(fed):
    d, pinned = fed
    flat = d / "priority-feed.txt"
    text = flat.read_text()
    flat.write_text(text.replace("audit_leaf=", "audit_leaf=00", 1))
    r = _verify(d, pinned)
    assert r.exit_code == 1 and f"{flat}: names audit entry" in r.output and "which is not a fairshare entry of " \
        "this log" in r.output, r.output
    flat.write_text(text + "a carol 5\n")  # one line more than the header says
    r = _verify(d, pinned)
    assert r.exit_code == 1 and f"{flat}: not a priority feed (modified): 3 entries, the header says 2" in r.output
    # a feed written before feeds named their entry is matched by its generation time, and still compared
    header, rest = text.split("\n", 1)
    old = " ".join(f for f in header.split(" ") if not f.startswith("audit_")) + "\n" + rest
    flat.write_text(old)
    r = _verify(d, pinned)
    assert r.exit_code == 0, r.output
    assert "names no fairshare entry (no audit_entry in it); compared with entry" in r.output, r.output
    flat.write_text(old.replace("a alice ", "a alice 1"))
    r = _verify(d, pinned)
    assert r.exit_code == 1 and f"{flat}: alice@a's site factor 1" in r.output, r.output


def _recomputed(d: Path, decayed_by: dict[str, float]) -> int:
    """Append a fairshare entry as a forger with write access would: the newest entry's jobs, their decayed
    charges times ``decayed_by``, and everything computed from them (association usage, rows, feed) consistent."""
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        settings = AccountingSettings(**fs.data["settings"])
        users = {log.alias(u): u for u in ("alice", "bob")}
        charges, sources, usage = [], {}, {}
        for job_id, job in fs.data["inputs"]["jobs"].items():
            fields = {f.name: job[f.name] for f in dataclasses.fields(ChargedJob)}
            charge = ChargedJob(**{**fields, "user": users[job["user"]],
                                   "decayed": job["decayed"] * decayed_by.get(job_id, 1.0)})
            charges.append(charge)
            sources[job_id] = {k: job[k] for k in ("usage_entry", "job_entry", "gpu_entries")}
            usage[(charge.account, charge.user)] = usage.get((charge.account, charge.user), 0.0) + charge.decayed
        rows = classic(AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}}),
                       usage)
        return record_fairshare(log, now=fs.data["now"], settings=settings, charges=charges, usage=usage, rows=rows,
                                feed=priority_feed(rows, 1000), sources=sources).seq


def test_a_real_entry_logs_where_each_charge_was_placed_and_verify_recomputes_its_decay(tmp_path):
    """Job 1's charge is not even over first..last (measured from 20 minutes into its hour): the fairshare entry
    logs how `priority feed` placed it in time, so explain proves its decay, and a forged decayed charge a little
    lower than that (everything computed from it consistent), which no bound could tell, fails verify."""
    d = _data_dir(tmp_path, job1_from=1200.0)
    with open_log(d) as log:
        jobs = next(log.entries(kind="fairshare", newest_first=True)).data["inputs"]["jobs"]
    assert len(jobs["1"]["pieces"]) > 1 and all(type(x) is float for p in jobs["1"]["pieces"] for x in p)
    assert math.isclose(math.fsum(x for _, _, x in jobs["1"]["pieces"]), jobs["1"]["charged"])
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "4. decayed usage: " in r.output and "(recomputed from its logged pieces: same; " in r.output, r.output
    _recomputed(d, {})
    assert _verify(d).exit_code == 0  # the forger's arithmetic, unforged, verifies
    seq = _recomputed(d, {"1": 1 - 1e-6})
    r = _verify(d)
    assert r.exit_code == 1, r.output
    (line,) = [ln for ln in r.output.splitlines() if "TAMPERED" in ln]
    assert line.startswith(f"TAMPERED: audit entry {seq}: job 1's decayed charge ") and line.endswith(
        f"is not what its logged pieces decay to ({jobs['1']['decayed']!r})"), r.output
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "not proven: decayed usage: " in r.output and "is not what its logged pieces decay to" in r.output \
        and "(does not follow)" in r.output and ". decayed usage:" not in r.output, r.output


def test_an_old_entry_naming_the_configured_algorithm_not_the_one_run_is_not_proven_not_tampered(tmp_path):
    """Releases before entries logged each job's pieces named the configured algorithm (classic here) where
    `fairshare --algorithm fair-tree --record` ran the other: such an honest entry is not called forged. An entry
    that logs pieces (this release's) names the algorithm it ran: there a mismatch is a forgery."""
    d = _data_dir(tmp_path)
    assert run("fairshare", "--data-dir", d, "--algorithm", "fair-tree", "--record").exit_code == 0

    def as_before(data, log):
        data["settings"]["algorithm"] = "classic"
        for c in data["inputs"]["jobs"].values():
            del c["pieces"]

    seq = _forge(d, as_before)
    r = _verify(d)
    assert r.exit_code == 0, r.output
    with open_log(d) as log:
        dv = derive(log.get(seq))
    assert dv.problems == [] and f"entry {seq}'s rows follow from fair-tree, not from the classic it names" in \
        dv.unproven[("fairshare", None)], dv.unproven

    def renamed(data, log):
        data["settings"]["algorithm"] = "classic"

    d = _data_dir(tmp_path / "new")
    assert run("fairshare", "--data-dir", d, "--algorithm", "fair-tree", "--record").exit_code == 0
    seq = _forge(d, renamed)
    r = _verify(d)
    assert r.exit_code == 1 and f"audit entry {seq}: " in r.output and "does not follow from the logged shares " \
           "and usage (classic)" in r.output, r.output
