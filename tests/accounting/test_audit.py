"""What accounting appends to the audit log (job records, usage, fairshare, priority changes) and `explain`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuledger.accounting.apply import Change
from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.audit import (
    AuditError,
    AuditLog,
    explain,
    job_charges,
    open_log,
    record_fairshare,
    record_job_records,
    record_priority_change,
    record_usage,
)
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.decay import decayed_usage
from gpuledger.accounting.fairshare import classic
from gpuledger.accounting.ledger import join
from gpuledger.accounting.priority import priority_feed
from gpuledger.schema.records import JobRecord, JobUsage


def test_dedupe_key_skips_unchanged_data(tmp_path):
    rec = JobRecord("7", cluster="c", user="alice", account="a", gpus=2, start=10.0, end=None)
    with open_log(tmp_path) as log:
        assert record_job_records(log, [rec]) == 1
        assert record_job_records(log, [rec]) == 0
        changed = JobRecord("7", cluster="c", user="alice", account="a", gpus=2, start=10.0, end=99.0)
        assert record_job_records(log, [changed]) == 1
        entries = list(log.entries(job_id="7"))
        assert [e.data["end"] for e in entries] == [None, 99.0]
        # personal data never enters the log in clear
        assert entries[0].data["user"].startswith("u-") and entries[0].data["uid"] is None
        assert "alice" not in (tmp_path / "audit.sqlite").read_bytes().decode("latin-1")


def _usage(job: str, alloc: float, active: float, energy: float) -> JobUsage:
    return JobUsage(job, "n1", "*", 1000.0, 1000.0 + alloc, 10, alloc, active, energy, model="H200")


def test_explain_walks_from_measurement_to_applied_factor(tmp_path):
    tree = AssocTree.from_toml({"accounts": {"a": {"shares": 1, "users": {"alice": 1, "bob": 1}}}})
    records = [JobRecord("1", cluster="c", user="alice", account="a", gpus=1, start=1000.0, end=4600.0),
               JobRecord("2", cluster="c", user="bob", account="a", gpus=1, start=1000.0, end=4600.0)]
    usages = [_usage("1", 3600.0, 3000.0, 1e6), _usage("2", 3600.0, 360.0, 3e5)]
    # charge = blend with floor 0.25, decayed evenly over each job's hour (every output follows from its inputs)
    settings = AccountingSettings(algorithm="classic", policy="blend", floor=0.25, priority_weight=10000)
    charges = job_charges(join(records, usages), settings, now=5000.0)
    assert [c.charged for c in charges] == [0.25 * 3600 + 0.75 * 3000, 0.25 * 3600 + 0.75 * 360]
    usage = {(c.account, c.user): c.decayed for c in charges}
    rows = classic(tree, usage)
    feed = priority_feed(rows, weight=10000)

    with open_log(tmp_path) as log:
        record_job_records(log, records)
        record_usage(log, usages)
        fs = record_fairshare(log, now=5000.0, settings=settings, charges=charges, usage=usage, rows=rows, feed=feed)
        alice = next(f for f in feed if f.user == "alice")
        rec = record_priority_change(log)
        rec(Change("1", "a", "alice", 2900.0, alice.effective_usage, alice.fairshare, 0, alice.site_factor, 5001.0))
        ex = explain(log, "1")
    assert ex.chain_ok and not ex.missing
    names = [s.name for s in ex.steps]
    assert names == ["job record", "measurements", "charged usage", "decayed usage", "fairshare", "site factor",
                     "applied"]
    steps = {s.name: s for s in ex.steps}
    assert "3600 allocated GPU-s, 3000 SM-active" in steps["measurements"].summary
    assert repr(0.25 * 3600 + 0.75 * 3000) in steps["charged usage"].summary
    assert f"= {alice.site_factor}" in steps["site factor"].summary
    assert steps["fairshare"].entries == ((fs.seq, fs.leaf.hex()),)
    assert f"-> {alice.site_factor}" in steps["applied"].summary
    # Job 2 was never applied: explain says what it cannot prove.
    with open_log(tmp_path) as log:
        ex2 = explain(log, "2")
    assert any(m.startswith("applied: no priority_change") for m in ex2.missing)


def test_priority_change_without_job_is_rejected(tmp_path):
    with open_log(tmp_path) as log:
        with pytest.raises(AuditError, match="names no job_id"):
            record_priority_change(log)({"site_factor": 3})


def test_job_charges_decay_per_job_and_sum_to_the_association_usage(tmp_path):
    """The per-job decayed values explain cites add up to what fairshare used for the association."""
    settings = AccountingSettings(policy="blend", floor=0.25, half_life_s=86400.0, calc_period_s=300.0)
    records = [JobRecord(str(i), user=("alice", "bob")[i % 2], account="a", start=1000.0 * i, end=1000.0 * i + 3600)
               for i in range(1, 7)]
    # each measured while its record says it ran (usage outside it is not charged: accounting.scope)
    usages = [replace(_usage(str(i), 3600.0, 360.0 * i, 1e5), first_ts=1000.0 * i, last_ts=1000.0 * i + 3600)
              for i in range(1, 7)]
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
        log.append_many([("job_record", {"note": 'quote " and \\ and ü'}, j, None if j is None else f"job:{j}")
                         for j in ('12"3', "ü-7", "1234_7", "s0123456789ABC", None)])
        assert log.verify().ok
        assert [e.job_id for e in log.entries()] == ['12"3', "ü-7", "1234_7", "s0123456789ABC", None]
