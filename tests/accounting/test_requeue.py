"""A requeued Slurm job (one job id, several runs) is charged for every run's measured usage: its record keeps
the earlier runs (``JobRecord.earlier_runs``) through the sacct import, the store's merge and the audit log."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from datetime import UTC, datetime

import pytest
from testdata import DATA_ROOT, capture
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.collector.ledger_store import merge_record
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

T0 = 1_790_000_000.0  # 2026-09-22: in the past, so that a feed made now (the real clock) sees the job ended
# job 500 ran on n1 for 600 s, was requeued (node failure), and ran again on n2 from T0 + 1000
RUN1 = JobRecord(job_id="500", cluster="c", user="bob", account="B", hosts=("n1",), gpus=1, start=T0,
                 end=T0 + 600, state="REQUEUED", exit_code=0)
RUN2 = replace(RUN1, hosts=("n2",), start=T0 + 1000, end=T0 + 1600, state="COMPLETED", exit_code=3)
EARLIER = ((T0, T0 + 600, ("n1",)),)
REQUEUE = DATA_ROOT / "slurm" / "requeue-22.05"


def utc(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()


def test_a_later_run_keeps_the_ended_earlier_one_and_a_reimport_changes_nothing(tmp_path):
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        assert store.put_jobs([RUN1]) == 1
        assert store.put_jobs([RUN2]) == 1
        assert store.jobs() == [replace(RUN2, earlier_runs=EARLIER)]  # the latest run's end and exit code
        assert store.put_jobs([RUN2]) == 0
        assert store.put_jobs([RUN1]) == 0  # the earlier run's record again (an old window): already there
        assert store.put_jobs([replace(RUN2, earlier_runs=EARLIER)]) == 0  # as sacct -D's import folds it
    finally:
        store.close()
    # the earlier run's record arriving after the later one joins it, and either side's earlier runs are kept,
    # each once, oldest first
    assert merge_record(RUN2, RUN1) == replace(RUN2, earlier_runs=EARLIER)
    run0 = (T0 - 900, T0 - 700, ("n3",))
    run3 = replace(RUN2, start=T0 + 2000, end=T0 + 2100, earlier_runs=(run0,))
    assert merge_record(replace(RUN2, earlier_runs=EARLIER), run3).earlier_runs == (
        run0, *EARLIER, (T0 + 1000, T0 + 1600, ("n2",)))
    # a running answer of the same run still never replaces the ended record
    running = replace(RUN2, end=None, state="RUNNING", exit_code=None)
    assert merge_record(replace(RUN2, earlier_runs=EARLIER), running) == replace(RUN2, earlier_runs=EARLIER)


def test_a_record_of_a_job_never_requeued_is_stored_as_before():
    # stored records and audit log entries hold JobRecord.to_dict(): without earlier runs it is the form it had
    # before the field, so they read back and verify byte for byte
    d = RUN2.to_dict()
    assert set(d) == {f.name for f in fields(JobRecord)} - {"earlier_runs"}
    assert JobRecord.from_dict(d) == RUN2
    requeued = replace(RUN2, earlier_runs=EARLIER)
    assert requeued.to_dict()["earlier_runs"] == [[T0, T0 + 600, ["n1"]]]
    assert JobRecord.from_dict(json.loads(json.dumps(requeued.to_dict()))) == requeued


def test_jobs_import_of_a_real_requeued_job_keeps_its_first_run_and_is_idempotent(tmp_path):
    d = str(tmp_path)
    both = ["jobs", "import", "--data-dir", d, "--sacct-json", str(capture(REQUEUE / "sacct-json-D-requeued.json")),
            "--sacct-parsable", str(capture(REQUEUE / "sacct-P-X-D-requeued.txt"))]
    r = CliRunner().invoke(app, both)
    assert r.exit_code == 0 and "; 1 new or changed" in r.output, r.output
    for args in (both, ["jobs", "import", "--data-dir", d, "--sacct-parsable",
                        str(capture(REQUEUE / "sacct-P-X-requeued.txt"))]):  # again; the latest run alone (no -D)
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0 and "; 0 new or changed" in r.output, r.output
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        (job,) = store.jobs()
    finally:
        store.close()
    assert (job.job_id, job.state, job.start, job.end) == ("1", "COMPLETED", utc("2026-12-02T06:17:33"),
                                                           utc("2026-12-02T06:17:36"))
    assert job.earlier_runs == ((utc("2026-12-02T06:17:30"), utc("2026-12-02T06:17:31"), ("vm",)),)


def h100_rows(host: str, start: float, n: int) -> tuple[GpuSample, ...]:
    """Job 500 on one H100 of ``host`` at 700 W, a sample every 10 s from ``start``."""
    return tuple(GpuSample(ts=start + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, sm_active_ratio=1.0,
                           power_watts=700.0, energy_joules=7000.0 * k, job_ids=("500",), model="NVIDIA H100")
                 for k in range(n))


def test_a_requeued_job_is_charged_for_both_runs_and_the_audit_verifies(tmp_path, capsys):
    # n1 measured the first run (600 s), n2 the second (600 s). Before earlier runs were kept, the record was the
    # second run's alone and n1's 600 s were cut as "host": bob was charged half of what he used.
    from gpuledger.accounting.associations import AssocTree
    from gpuledger.accounting.config import AccountingSettings
    from gpuledger.accounting.engine import association_usage
    from gpuledger.accounting.ledger import load
    from gpuledger.cli import run

    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a1", 1, "n1", h100_rows("n1", T0, 61), cluster="c"))
        store.ingest(Batch("a2", 1, "n2", h100_rows("n2", T0 + 1000, 61), cluster="c"))
        store.put_jobs([RUN1])
        store.put_jobs([RUN2])  # the requeued run, imported when it ended
        (entry,) = load(store, now=T0 + 9999)
    finally:
        store.close()
    assert entry.out_of_scope == () and sorted(u.host for u in entry.gpus) == ["n1", "n2"]
    assert entry.usage.allocated_gpu_seconds == pytest.approx(1200.0)
    tree = AssocTree.from_csv("account,parent,user,shares\nB,,,1\nB,,bob,1\n")
    used = association_usage([entry], AccountingSettings(policy="active", half_life_s=0), tree, T0 + 9999).usage
    assert used[("B", "bob")] == pytest.approx(1200.0)
    (tmp_path / "gpuledger.toml").write_text('[accounting]\npolicy = "active"\nhalf_life_s = 0\n'
                                             '[accounts.B]\nshares = 1\n[accounts.B.users]\nbob = 1\n')
    assert run(["report", "job", "500", "--data-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "requeued: 1 earlier run(s), 2026-09-21T14:13:20+00:00..2026-09-21T14:23:20+00:00 on n1" in text, text
    assert "out of scope" not in text
    assert run(["priority", "feed", "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    code = run(["audit", "verify", "--data-dir", str(tmp_path), "--store"])
    assert code == 0, capsys.readouterr()
    capsys.readouterr()
    assert run(["audit", "explain", "500", "--data-dir", str(tmp_path)]) == 0
    explained = capsys.readouterr().out
    assert "requeued, earlier runs 2026-09-21T14:13:20Z..2026-09-21T14:23:20Z on n1" in explained, explained


def test_an_agents_description_of_a_job_never_declares_its_runs(tmp_path):
    # where and when a requeued job ran is Slurm's word: a node (whose token may be stolen) describing job 500 with
    # an earlier run on its own host must not widen what the job may be charged for
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        forged = replace(RUN2, hosts=("n2",), earlier_runs=((T0 - 5000, T0 - 100, ("n2",)),))
        store.ingest(Batch("a2", 1, "n2", h100_rows("n2", T0 + 1000, 11), cluster="c", jobs=(forged,)))
        ((stored, source),) = store.job_records()
        assert source == "agent" and stored.earlier_runs == () and stored.user == "bob"
    finally:
        store.close()


def test_a_requeued_jobs_allocation_is_every_runs_and_accrues_over_them(tmp_path):
    # Slurm's fairshare keeps what a run accrued when the job is requeued: the allocation charged (policy
    # "allocated", and the unmeasured part of the measured policies) is both runs', placed in time over each run
    from gpuledger.accounting.associations import AssocTree
    from gpuledger.accounting.charge import allocation
    from gpuledger.accounting.config import AccountingSettings
    from gpuledger.accounting.engine import association_usage
    from gpuledger.accounting.ledger import load

    requeued = replace(RUN2, earlier_runs=EARLIER)
    assert allocation(requeued, T0 + 9999) == {"": 1200.0}
    assert allocation(replace(requeued, end=None, state="RUNNING"), T0 + 1100) == {"": 700.0}
    waiting = replace(requeued, start=None, end=None, state="PENDING")  # requeued, not running again yet
    assert allocation(waiting, T0 + 9999) == {"": 600.0}
    assert allocation(RUN2, T0 + 9999) == {"": 600.0}  # (never requeued: its one run)
    assert allocation(requeued, T0 + 300) == {"": 300.0}  # as of a time inside the first run: up to it only
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.put_jobs([RUN1, RUN2])
        (entry,) = load(store, now=T0 + 9999)
    finally:
        store.close()
    tree = AssocTree.from_csv("account,parent,user,shares\nB,,,1\nB,,bob,1\n")
    for policy in ("allocated", "active"):  # "active": nothing measured, all of it unmeasured
        result = association_usage([entry], AccountingSettings(policy=policy, half_life_s=0), tree, T0 + 9999)
        assert result.usage[("B", "bob")] == pytest.approx(1200.0), policy
    # with decay, each run's part accrues over its own time: as much as two jobs that ran as the two runs did
    store = Store(tmp_path / "apart.sqlite")
    try:
        store.put_jobs([replace(RUN1, job_id="501"), RUN2])
        apart = load(store, now=T0 + 9999)
    finally:
        store.close()
    settings = AccountingSettings(policy="allocated", half_life_s=900.0)
    decayed = association_usage([entry], settings, tree, T0 + 2000).usage[("B", "bob")]
    assert decayed == pytest.approx(association_usage(apart, settings, tree, T0 + 2000).usage[("B", "bob")])
    assert decayed < 1200.0 * 0.9  # (decayed at all)
