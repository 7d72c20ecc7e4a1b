"""The audit trail: canonical entries, the hash chain, tamper detection naming the first bad entry, signatures."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat

import pytest

from gpuledger.accounting.audit import (
    GENESIS,
    AuditError,
    AuditLog,
    JobCharge,
    canonical_json,
    entry_hash,
    explain,
    job_charges,
    keygen,
    open_log,
    record_fairshare,
    record_job_records,
    record_priority_change,
    record_usage,
    sign_report,
    verify_report,
)
from gpuledger.accounting.apply import Change
from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.decay import decayed_usage
from gpuledger.accounting.fairshare import classic
from gpuledger.accounting.ledger import join
from gpuledger.accounting.priority import priority_feed
from gpuledger.schema.records import JobRecord, JobUsage


def test_canonical_json_is_sorted_compact_and_float_exact():
    assert canonical_json({"b": 0.1 + 0.2, "a": [1, (2, 3)], "c": None}) == '{"a":[1,[2,3]],"b":0.30000000000000004,"c":null}'
    assert json.loads(canonical_json({"x": 1e-300 / 3}))["x"] == 1e-300 / 3
    with pytest.raises(AuditError, match=r"\$\.usage\.power: nan"):
        canonical_json({"usage": {"power": float("nan")}})
    with pytest.raises(AuditError, match=r"\$\.k\[1\]: <object object.*cannot be written"):
        canonical_json({"k": [1, object()]})


def _fill(log: AuditLog, n: int) -> None:
    log.append_many(("usage_record", {"i": i, "gpu_s": i * 0.5}, str(1000 + i), None) for i in range(1, n + 1))


def _rows(path):
    db = sqlite3.connect(path)
    rows = db.execute("SELECT seq, kind, job_id, body, prev, hash FROM entries ORDER BY seq").fetchall()
    return db, rows


def test_append_chains_hashes_and_verifies(tmp_path):
    with AuditLog(tmp_path / "audit.sqlite", clock=lambda: 1234.5) as log:
        _fill(log, 5)
        res = log.verify()
        assert res.ok and res.entries == 5 and res.head_seq == 5
        prev = GENESIS
        for e in log.entries():
            body = canonical_json({"seq": e.seq, "ts": 1234.5, "kind": e.kind, "job_id": e.job_id, "data": e.data})
            assert e.prev == prev and e.hash == hashlib.sha256(f"{prev}\n{body}".encode()).hexdigest()
            prev = e.hash
        assert log.head() == (5, prev)
        with pytest.raises(AuditError, match="kind 'bogus'"):
            log.append("bogus", {})
        assert log.head() == (5, prev)  # a rejected item writes nothing


def test_dedupe_key_skips_unchanged_data(tmp_path):
    rec = JobRecord("7", cluster="c", user="alice", account="a", gpus=2, start=10.0, end=None)
    with open_log(tmp_path) as log:
        assert record_job_records(log, [rec]) == 1
        assert record_job_records(log, [rec]) == 0
        assert record_job_records(log, [JobRecord("7", cluster="c", user="alice", account="a", gpus=2, start=10.0, end=99.0)]) == 1
        entries = list(log.entries(job_id="7"))
        assert [e.data["end"] for e in entries] == [None, 99.0]
        # personal data never enters the log in clear
        assert entries[0].data["user"].startswith("u-") and entries[0].data["uid"] is None
        assert "alice" not in (tmp_path / "audit.sqlite").read_bytes().decode("latin-1")


# Each tampering is done the way an attacker with write access to the SQLite file would do it.
def _modify(db, rows):
    seq, kind, job, body, prev, h = rows[4]
    db.execute("UPDATE entries SET body=? WHERE seq=?", (body.replace('"gpu_s":2.5', '"gpu_s":0.5'), seq))


def _modify_and_rehash(db, rows):
    seq, kind, job, body, prev, h = rows[4]
    body = body.replace('"gpu_s":2.5', '"gpu_s":0.5')
    db.execute("UPDATE entries SET body=?, hash=? WHERE seq=?", (body, entry_hash(prev, body), seq))


def _delete(db, rows):
    db.execute("DELETE FROM entries WHERE seq=5")


def _delete_and_renumber(db, rows):
    db.execute("DELETE FROM entries WHERE seq=5")
    db.execute("UPDATE entries SET seq=seq-1 WHERE seq>5")


def _truncate_tail(db, rows):
    db.execute("DELETE FROM entries WHERE seq>=9")


def _insert_and_renumber(db, rows):
    # A self-consistent forged entry at 5: right prev, right hash; later rows shifted up by one.
    db.execute("UPDATE entries SET seq=seq+100 WHERE seq>=5")
    db.execute("UPDATE entries SET seq=seq-99 WHERE seq>=105")
    prev = rows[3][5]
    body = canonical_json({"seq": 5, "ts": 1.0, "kind": "usage_record", "job_id": "666", "data": {"i": 666}})
    db.execute("INSERT INTO entries VALUES (5,'usage_record','666',?,?,?)", (body, prev, entry_hash(prev, body)))


def _reorder(db, rows):
    db.execute("UPDATE entries SET seq=-1 WHERE seq=5")
    db.execute("UPDATE entries SET seq=5 WHERE seq=6")
    db.execute("UPDATE entries SET seq=6 WHERE seq=-1")


def _retarget_job(db, rows):
    db.execute("UPDATE entries SET job_id='9999' WHERE seq=5")  # hides the entry from explain


@pytest.mark.parametrize(
    "tamper, first_bad, words",
    [
        (_modify, 5, "modified"),
        (_modify_and_rehash, 5, "replaced"),
        (_delete, 5, "missing"),
        (_delete_and_renumber, 5, "missing"),
        (_truncate_tail, 9, "missing"),
        (_insert_and_renumber, 5, "inserted"),
        (_reorder, 5, "out of order"),
        (_retarget_job, 5, "job_id"),
    ],
)
def test_tampering_is_detected_and_the_first_bad_entry_named(tmp_path, tamper, first_bad, words):
    path = tmp_path / "audit.sqlite"
    with AuditLog(path) as log:
        _fill(log, 10)
        assert log.verify().ok
    db, rows = _rows(path)
    tamper(db, rows)
    db.commit()
    db.close()
    with AuditLog(path) as log:
        res = log.verify()
    assert not res.ok
    assert res.problem.seq == first_bad, str(res.problem)
    assert words in res.problem.reason
    assert res.head_seq == first_bad - 1  # everything before the first bad entry is proven


def test_a_rewritten_head_entry_is_caught_by_the_signed_report(tmp_path):
    keygen(tmp_path)
    report = tmp_path / "r.json"
    report.write_text('{"total": 1}\n')
    with open_log(tmp_path) as log:
        _fill(log, 3)
        manifest = sign_report(report, tmp_path, inputs={"store": "x"}, period={"from": 0, "to": 1}, log=log)
        assert verify_report(report, tmp_path, log) == []
    doc = json.loads(manifest.read_text())
    assert doc["manifest"]["audit_head"]["seq"] == 3
    # The attacker rewrites the whole log consistently, meta included: the chain verifies, the report does not.
    path = tmp_path / "audit.sqlite"
    db = sqlite3.connect(path)
    prev = GENESIS
    for seq, body in db.execute("SELECT seq, body FROM entries ORDER BY seq").fetchall():
        body = body.replace('"gpu_s":0.5', '"gpu_s":9.5')
        h = entry_hash(prev, body)
        db.execute("UPDATE entries SET body=?, prev=?, hash=? WHERE seq=?", (body, prev, h, seq))
        prev = h
    db.execute("UPDATE meta SET value=? WHERE key='head_hash'", (prev,))
    db.commit()
    db.close()
    with open_log(tmp_path) as log:
        assert log.verify().ok
        problems = verify_report(report, tmp_path, log)
    assert any("audit entry 3" in p and "rewritten" in p for p in problems)


def test_report_signature_detects_altered_report_and_manifest(tmp_path):
    priv, pub = keygen(tmp_path)
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        keygen(tmp_path)
    report = tmp_path / "usage.csv"
    report.write_text("account,gpu_hours\na,1.5\n")
    with open_log(tmp_path) as log:
        manifest = sign_report(report, tmp_path, inputs={"jobs": 1}, period={"period": "2026-10"}, log=log)
        assert verify_report(report, tmp_path, log) == []
        report.write_text("account,gpu_hours\na,0.5\n")
        assert any("report altered" in p for p in verify_report(report, tmp_path, log))
        report.write_text("account,gpu_hours\na,1.5\n")
        doc = json.loads(manifest.read_text())
        doc["manifest"]["period"]["period"] = "2026-11"
        manifest.write_text(json.dumps(doc))
        assert any("signature does not match" in p for p in verify_report(report, tmp_path, log))
        manifest.unlink()
        assert any("no manifest" in p for p in verify_report(report, tmp_path, log))


def _usage(job: str, alloc: float, active: float, energy: float) -> JobUsage:
    return JobUsage(job, "n1", "*", 1000.0, 1000.0 + alloc, 10, alloc, active, energy, model="H200")


def test_explain_walks_from_measurement_to_applied_factor(tmp_path):
    tree = AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}})
    records = [JobRecord("1", cluster="c", user="alice", account="a", gpus=1, start=1000.0, end=4600.0),
               JobRecord("2", cluster="c", user="bob", account="a", gpus=1, start=1000.0, end=4600.0)]
    usages = [_usage("1", 3600.0, 3000.0, 1e6), _usage("2", 3600.0, 360.0, 3e5)]
    # Hand-made inputs: charge = blend with floor 0.25; decayed values as given (decay has its own tests).
    charges = [JobCharge("1", "a", "alice", "blend", 0.25 * 3600 + 0.75 * 3000, 2900.0, 1000.0, 4600.0),
               JobCharge("2", "a", "bob", "blend", 0.25 * 3600 + 0.75 * 360, 1100.0, 1000.0, 4600.0)]
    usage = {("a", "alice"): 2900.0, ("a", "bob"): 1100.0}
    rows = classic(tree, usage)
    feed = priority_feed(rows, weight=10000)

    class Settings:  # the fields record_fairshare reads from AccountingSettings
        def model_dump(self):
            return {"algorithm": "classic", "policy": "blend", "floor": 0.25, "half_life_s": 604800.0,
                    "priority_weight": 10000}

    with open_log(tmp_path) as log:
        record_job_records(log, records)
        record_usage(log, usages)
        fs = record_fairshare(log, now=5000.0, settings=Settings(), charges=charges, usage=usage, rows=rows, feed=feed)
        alice = next(f for f in feed if f.user == "alice")
        rec = record_priority_change(log)
        rec(Change("1", "a", "alice", 2900.0, alice.effective_usage, alice.fairshare, 0, alice.site_factor, 5001.0))
        ex = explain(log, "1")
    assert ex.chain.ok and not ex.missing
    names = [s.name for s in ex.steps]
    assert names == ["job record", "measurements", "charged usage", "decayed usage", "fairshare", "site factor", "applied"]
    steps = {s.name: s for s in ex.steps}
    assert "3600 allocated GPU-s, 3000 SM-active" in steps["measurements"].summary
    assert repr(0.25 * 3600 + 0.75 * 3000) in steps["charged usage"].summary
    assert f"= {alice.site_factor}" in steps["site factor"].summary
    assert steps["fairshare"].entries == ((fs.seq, fs.hash),)
    assert f"-> {alice.site_factor}" in steps["applied"].summary
    # Job 2 was never applied: explain says what it cannot prove.
    with open_log(tmp_path) as log:
        ex2 = explain(log, "2")
    assert any("priority_change" in m for m in ex2.missing)


def test_priority_change_without_job_is_rejected(tmp_path):
    with open_log(tmp_path) as log:
        with pytest.raises(AuditError, match="names no job_id"):
            record_priority_change(log)({"site_factor": 3})


def test_job_charges_decay_per_job_and_sum_to_the_association_usage(tmp_path):
    """The per-job decayed values explain cites add up to what fairshare used for the association."""
    settings = AccountingSettings(policy="blend", floor=0.25, half_life_s=86400.0, calc_period_s=300.0)
    records = [JobRecord(str(i), user=("alice", "bob")[i % 2], account="a", start=1000.0 * i, end=1000.0 * i + 3600)
               for i in range(1, 7)]
    usages = [_usage(str(i), 3600.0, 360.0 * i, 1e5) for i in range(1, 7)]
    entries = join(records, usages)
    now = 200_000.0
    charges = job_charges(entries, settings, now)
    assert [c.charged for c in charges] == [0.25 * 3600 + 0.75 * 360 * i for i in range(1, 7)]
    assert all(0 < c.decayed < c.charged for c in charges)
    per_assoc = decayed_usage([((e.record.account, e.record.user), e.usage.first_ts, e.usage.last_ts,
                                settings.charge_policy().charge(e.usage)) for e in entries],
                              now=now, half_life_s=86400.0, calc_period_s=300)
    for user in ("alice", "bob"):
        mine = sum(c.decayed for c in charges if c.user == user)
        assert mine == pytest.approx(per_assoc[("a", user)], rel=1e-12)


def test_unusual_job_ids_and_text_verify(tmp_path):
    with AuditLog(tmp_path / "audit.sqlite") as log:
        log.append_many([("job_record", {"note": 'quote " and \\ and ü'}, j, None)
                         for j in ('12"3', "ü-7", "1234_7", "s0123456789ABC", None)])
        assert log.verify().ok
        assert [e.job_id for e in log.entries()] == ['12"3', "ü-7", "1234_7", "s0123456789ABC", None]
