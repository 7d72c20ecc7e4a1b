"""Measured usage is charged to a job only where and when Slurm's record says the job ran (accounting.scope)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuledger.accounting.scope import SLACK_S, in_scope
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

T0 = 1_790_000_000.0  # 2026-09-22: in the past, so that a feed made now (the real clock) sees the job ended
SLURM = JobRecord(job_id="500", cluster="c", user="bob", account="B", hosts=("n2",), gpus=1, start=T0, end=T0 + 600,
                  state="COMPLETED")


def usage(host: str, first: float, last: float, energy: float = 420e3, gap_s: float = 0.0) -> JobUsage:
    return JobUsage(job_id="500", host=host, gpu_uuid=f"GPU-{host}", first_ts=first, last_ts=last, samples=61,
                    allocated_gpu_seconds=last - first, sm_active_gpu_seconds=(last - first) / 2,
                    energy_joules=energy, gap_gpu_seconds=gap_s, cluster="c")


def h100_rows(host: str, start: float, n: int) -> tuple[GpuSample, ...]:
    """Job 500 on one H100 of ``host`` at 700 W, a sample every 10 s from ``start``."""
    return tuple(GpuSample(ts=start + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, sm_active_ratio=1.0,
                           power_watts=700.0, energy_joules=7000.0 * k, job_ids=("500",), model="NVIDIA H100")
                 for k in range(n))


def test_an_honest_record_is_charged_whole_within_the_slack():
    honest = usage("n2", T0 + 5, T0 + 600 + SLACK_S / 2)
    assert in_scope(SLURM, [honest], T0 + 9999) == ((honest,), ())


def test_another_hosts_record_is_not_charged_to_the_job():
    phantom = usage("n1", T0, T0 + 600)
    kept, cut = in_scope(SLURM, [usage("n2", T0, T0 + 600), phantom], T0 + 9999)
    assert [u.host for u in kept] == ["n2"]
    assert [(c.usage, c.charged_fraction, c.reason) for c in cut] == [(phantom, 0.0, "host")]


def test_a_record_outside_the_jobs_time_is_not_charged_and_one_across_it_in_proportion():
    after = usage("n2", T0 + 1200, T0 + 3000)  # samples named after the job, from after it ended
    kept, cut = in_scope(SLURM, [after], T0 + 9999)
    assert kept == () and [(c.charged_fraction, c.reason) for c in cut] == [(0.0, "time")]
    # a first sample dated 1e8 s before the job (a "held gap" of absurd energy): only the part inside counts
    across = usage("n2", T0 + 600 - 1e8, T0 + 600, energy=1.5e11, gap_s=1e8 - 600)
    (kept_one,), (c,) = in_scope(SLURM, [across], T0 + 9999)
    fraction = (600 + SLACK_S) / 1e8
    assert c.charged_fraction == pytest.approx(fraction) and c.reason == "time"
    assert kept_one.energy_joules == pytest.approx(1.5e11 * fraction)
    assert kept_one.gap_gpu_seconds == pytest.approx((1e8 - 600) * fraction)
    assert (kept_one.first_ts, kept_one.last_ts) == (T0 - SLACK_S, T0 + 600)


def test_a_running_job_is_held_to_now_and_a_job_without_a_record_or_start_is_charged_as_measured():
    running = JobRecord(job_id="500", hosts=("n2",), start=T0, end=None, state="RUNNING")
    later = usage("n2", T0 + 100, T0 + 200)
    assert in_scope(running, [later], now=T0 + 150 - SLACK_S)[0][0].last_ts == pytest.approx(T0 + 150)
    rows = [usage("n1", 0.0, 1.0)]
    assert in_scope(None, rows, T0) == (tuple(rows), ())
    assert in_scope(JobRecord(job_id="500", hosts=("n2",)), rows, T0) == (tuple(rows), ())
    # a record without hosts: only its times are checked; a job-level row ("*") has no host to check
    assert in_scope(JobRecord(job_id="500", start=T0, end=T0 + 600), [usage("n1", T0, T0 + 600)], T0)[1] == ()
    assert in_scope(SLURM, [usage("*", T0, T0 + 600)], T0 + 9999)[1] == ()


def test_a_node_naming_another_hosts_job_charges_nothing_and_the_audit_agrees(tmp_path, capsys):
    # n2 runs Slurm's job 500 (bob) for 600 s; n1 names job 500 on a GPU of its own, after the job ended. The
    # ledger keeps n1's record aside, bob is charged n2's measurement only, and the feed's charge is what the
    # audit log's records recompute to (verify passes).
    from gpuledger.accounting.associations import AssocTree
    from gpuledger.accounting.config import AccountingSettings
    from gpuledger.accounting.engine import association_usage
    from gpuledger.accounting.ledger import load
    from gpuledger.cli import run
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch

    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a2", 1, "n2", h100_rows("n2", T0, 61), cluster="c"))
        store.ingest(Batch("a1", 1, "n1", h100_rows("n1", T0 + 1200, 181), cluster="c"))
        store.put_jobs([SLURM])
        (entry,) = [e for e in load(store, now=T0 + 9999) if e.job_id == "500"]
    finally:
        store.close()
    assert [(c.usage.host, c.reason) for c in entry.out_of_scope] == [("n1", "host")]
    assert [u.host for u in entry.gpus] == ["n2"] and entry.usage.allocated_gpu_seconds == pytest.approx(600.0)
    tree = AssocTree.from_csv("account,parent,user,shares\nB,,,1\nB,,bob,1\n")
    used = association_usage([entry], AccountingSettings(policy="active", half_life_s=0), tree, T0 + 9999).usage
    assert used[("B", "bob")] == pytest.approx(600.0)
    (tmp_path / "gpuledger.toml").write_text('[accounting]\npolicy = "active"\nhalf_life_s = 0\n'
                                             '[accounts.B]\nshares = 1\n[accounts.B.users]\nbob = 1\n')
    assert run(["priority", "feed", "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    code = run(["audit", "verify", "--data-dir", str(tmp_path), "--store"])
    assert code == 0, capsys.readouterr()


def test_the_weight_of_a_measured_gpu_is_slurms_typed_gres_not_the_agents_model_name():
    # carol's job was allocated gres/gpu:h100 (weight 1); her node names its GPU an H200 (weight 4): the
    # measured part weighs as Slurm's type. A MIG profile (gres/gpu:3g.40gb) names no model: the agent's stands.
    from gpuledger.accounting.charge import ChargePolicy, allocation

    policy = ChargePolicy(kind="active", model_weights={"H100": 1.0, "H200": 4.0, "A100": 2.0})
    record = JobRecord(job_id="102", hosts=("n1",), gpus=1, start=T0, end=T0 + 600, state="COMPLETED",
                       tres=(("gres/gpu", 1.0), ("gres/gpu:h100", 1.0)))
    alloc = allocation(record, T0 + 9999)

    def gpu(model: str) -> JobUsage:
        return JobUsage("102", "n1", "GPU-1", T0, T0 + 600, 61, 600.0, 300.0, 1e5, model=model)

    assert policy.charge_job(alloc, [gpu("NVIDIA H200")]).measured == 300.0
    assert policy.charge_job(alloc, [gpu("NVIDIA H100 80GB HBM3")]).measured == 300.0
    assert policy.charge_job(None, [gpu("NVIDIA H200")]).measured == 1200.0  # no scheduler record: as named
    mig = JobRecord(job_id="103", hosts=("n1",), gpus=1, start=T0, end=T0 + 600, state="COMPLETED",
                    tres=(("gres/gpu", 1.0), ("gres/gpu:3g.40gb", 1.0)))
    assert policy.measured_weight(gpu("NVIDIA A100-SXM4-40GB MIG 3g.40gb"), allocation(mig, T0 + 9999)) == 2.0
    two = JobRecord(job_id="104", hosts=("n1",), gpus=2, start=T0, end=T0 + 600, state="COMPLETED",
                    tres=(("gres/gpu", 2.0), ("gres/gpu:h100", 1.0), ("gres/gpu:a100", 1.0)))
    assert policy.measured_weight(gpu("NVIDIA A100"), allocation(two, T0 + 9999)) == 2.0  # one of Slurm's types
    assert policy.measured_weight(gpu("NVIDIA H200"), allocation(two, T0 + 9999)) == 1.5  # neither: their mean


def test_agents_that_disagree_about_a_job_describe_nobody_until_slurm_does(tmp_path):
    # n1 (a stolen token) describes job 500 first, as carol's, and names it on a GPU of its own; n2 really runs it
    # for bob. Kept as the first description, carol would pay for n2's usage until Slurm's record came.
    from gpuledger.accounting.ledger import load
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    def rows(host: str, job: str) -> tuple[GpuSample, ...]:
        return tuple(GpuSample(ts=T0 + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, sm_active_ratio=1.0,
                               job_ids=(job,)) for k in range(7))

    def described(job: str, user: str, account: str, host: str) -> tuple[JobRecord]:
        return (JobRecord(job_id=job, cluster="c", user=user, account=account, hosts=(host,)),)

    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        # (listing n2 among the job's hosts does not make n2's own description a repeat of n1's)
        liar = (JobRecord(job_id="500", cluster="c", user="carol", account="C", hosts=("n1", "n2")),)
        store.ingest(Batch("a1", 1, "n1", rows("n1", "500"), jobs=liar, cluster="c"))
        store.ingest(Batch("a2", 1, "n2", rows("n2", "500"), jobs=described("500", "bob", "B", "n2"), cluster="c"))
        (entry,) = load(store, now=T0 + 9999)
        assert (entry.seen_by, entry.account, entry.user) == ("agent", "(unknown)", "(unknown)")
        # agents that agree (a job on two hosts) describe it
        store.ingest(Batch("a1", 2, "n1", rows("n1", "501"), jobs=described("501", "dan", "D", "n1"), cluster="c"))
        store.ingest(Batch("a2", 2, "n2", rows("n2", "501"), jobs=described("501", "dan", "D", "n2"), cluster="c"))
        (other,) = [e for e in load(store, now=T0 + 9999) if e.job_id == "501"]
        assert (other.account, other.user) == ("D", "dan")
        store.put_jobs([SLURM])  # Slurm's record: bob's, on n2
        (entry,) = [e for e in load(store, now=T0 + 9999) if e.job_id == "500"]
        assert (entry.account, entry.user) == ("B", "bob") and [u.host for u in entry.gpus] == ["n2"]
    finally:
        store.close()


def test_mig_rows_that_do_not_fit_one_physical_gpu_count_it_once(tmp_path):
    # a node reports its one A100 whole (job 100) in one batch and as a 7g instance (job 101) in the next, at the
    # same instants; or as two 7g instances 1 ms apart: either would count the GPU twice
    from gpuledger.accounting.ledger import load
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    a100, mig7 = "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB MIG 7g.80gb"

    def rows(job: str, model: str, mig: str | None, t0: float = T0) -> tuple[GpuSample, ...]:
        return tuple(GpuSample(ts=t0 + 10 * k, host="n1", gpu_uuid="GPU-m", gpu_index=0, model=model, mig=mig,
                               power_watts=300.0, energy_joules=3000.0 * k, job_ids=(job,)) for k in range(61))

    def observed(store: Store) -> dict[str, float]:
        return {e.job_id: (e.usage.allocated_gpu_seconds if e.usage else 0.0) for e in load(store, now=T0 + 9999)}

    store = Store(tmp_path / "a.sqlite")
    try:
        store.ingest(Batch("a", 1, "n1", rows("100", a100, None)))
        store.ingest(Batch("a", 2, "n1", rows("101", mig7, "1.0")))
        assert observed(store) == {"100": 0.0, "101": pytest.approx(600.0)}
        (e100,) = [e for e in load(store, now=T0 + 9999) if e.job_id == "100"]
        assert [(c.reason, c.charged_fraction) for c in e100.out_of_scope] == [("mig", 0.0)]
    finally:
        store.close()
    store = Store(tmp_path / "b.sqlite")
    try:
        store.ingest(Batch("a", 1, "n1", rows("100", mig7, "1.0") + rows("101", mig7, "2.0", T0 + 0.001)))
        got = observed(store)
        assert got["100"] + got["101"] == pytest.approx(600.0)  # one GPU's 600 s, halved between them
    finally:
        store.close()
    # instances that fit (3g + 4g) are charged whole
    store = Store(tmp_path / "c.sqlite")
    try:
        store.ingest(Batch("a", 1, "n1", rows("100", f"{a100} MIG 3g.40gb", "1.0")
                           + rows("101", f"{a100} MIG 4g.40gb", "2.0")))
        got = observed(store)
        assert got == {"100": pytest.approx(600 * 3 / 7), "101": pytest.approx(600 * 4 / 7)}
        assert all(not e.out_of_scope for e in load(store, now=T0 + 9999))
    finally:
        store.close()


def test_what_the_scope_cuts_is_shown_and_reconcile_balances_with_the_collectors_totals(tmp_path):
    # n2 runs Slurm's job 500 for 600 s and samples it 300 s past its end (180 s beyond the slack); n1 names job
    # 500 on a GPU of its own for 1800 s. Neither cut was shown anywhere, so `report reconcile` no longer added up
    # to `collector totals`.
    import csv
    import io
    import json

    from typer.testing import CliRunner

    from gpuledger.cli import app
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch

    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a2", 1, "n2", h100_rows("n2", T0, 91), cluster="c"))
        store.ingest(Batch("a1", 1, "n1", h100_rows("n1", T0 + 1200, 181), cluster="c"))
        store.put_jobs([SLURM])
    finally:
        store.close()
    d = str(tmp_path)

    def cli(*args: str) -> str:
        r = CliRunner().invoke(app, [*args, "--data-dir", d])
        assert r.exit_code == 0, r.output
        return r.stdout

    cut_s = 180.0 + 1800.0
    (job,) = [j for j in json.loads(cli("jobs", "list", "--format", "json")) if j["job_id"] == "500"]
    assert job["observed_gpu_seconds"] == pytest.approx(720.0)
    assert job["out_of_scope_gpu_seconds"] == pytest.approx(cut_s)
    assert job["out_of_scope_energy_joules"] == pytest.approx(180 * 700.0 + 1800 * 700.0)
    assert sorted((c["host"], c["reason"], round(c["gpu_seconds"])) for c in job["out_of_scope"]) == [
        ("n1", "host", 1800), ("n2", "time", 180)]
    (row,) = [r for r in csv.DictReader(io.StringIO(cli("jobs", "list", "--format", "csv"))) if r["job_id"] == "500"]
    assert float(row["out_of_scope_gpu_seconds"]) == pytest.approx(cut_s) and row["out_of_scope_reasons"] == "host,time"
    assert "0.55 (host,time)" in cli("jobs", "list")  # the table: GPU-hours and why

    rep = json.loads(cli("report", "job", "500", "--format", "json"))
    assert rep["allocation"]["out_of_scope_gpu_seconds"] == pytest.approx(cut_s)
    assert sorted(c["reason"] for c in rep["out_of_scope"]) == ["host", "time"]
    text = cli("report", "job", "500")
    assert "out of scope, not charged: 0.50 GPU-h" in text and "on n1/GPU-n1 (host: on a host Slurm's" in text

    totals = json.loads(cli("collector", "totals"))
    rec = json.loads(cli("report", "reconcile", "--format", "json"))
    t = rec["total"]
    assert t["out_of_scope_gpu_hours"] == pytest.approx(cut_s / 3600)
    assert (t["observed_gpu_hours"] + t["out_of_scope_gpu_hours"] + t["unattributed_gpu_hours"]) * 3600 == (
        pytest.approx(totals["observed_gpu_seconds"]))
    cells = {(r["node"], r["account"]): r["out_of_scope_gpu_hours"] * 3600 for r in rec["rows"]}
    assert cells == {("n1", "B"): pytest.approx(1800.0), ("n2", "B"): pytest.approx(180.0)}


# job 500 requeued: its first run on n1 for 600 s, its second (SLURM's) on n2 from T0 + 1000
REQUEUED = replace(SLURM, start=T0 + 1000, end=T0 + 1600, earlier_runs=((T0, T0 + 600, ("n1",)),))


def test_usage_in_an_earlier_run_of_a_requeued_job_is_charged_on_that_runs_host():
    first, second = usage("n1", T0, T0 + 600), usage("n2", T0 + 1000, T0 + 1600)
    assert in_scope(REQUEUED, [first, second], T0 + 9999) == ((first, second), ())
    # each run is held to its own hosts: n2 during the first run, n1 during the second, are not the job's
    n2_early, n1_late = usage("n2", T0, T0 + 600), usage("n1", T0 + 1000, T0 + 1600)
    kept, cut = in_scope(REQUEUED, [n2_early, n1_late], T0 + 9999)
    assert kept == () and [(c.usage, c.charged_fraction, c.reason) for c in cut] == [
        (n2_early, 0.0, "time"), (n1_late, 0.0, "time")]
    assert [c.reason for c in in_scope(REQUEUED, [usage("n3", T0, T0 + 600)], T0 + 9999)[1]] == ["host"]


def test_usage_between_the_runs_is_cut_and_a_row_across_both_is_charged_for_their_windows():
    between = usage("n1", T0 + 600 + SLACK_S + 10, T0 + 1000 - SLACK_S - 10)
    kept, (c,) = in_scope(REQUEUED, [between], T0 + 9999)
    assert kept == () and (c.charged_fraction, c.reason) == (0.0, "time")
    # one GPU sampled from the first run's start to the second's end (both runs on n1): the time between the runs'
    # windows is cut, the rest charged in proportion
    same_host = replace(REQUEUED, hosts=("n1",))
    across = usage("n1", T0, T0 + 1600, energy=1.6e6)
    (kept_one,), (c,) = in_scope(same_host, [across], T0 + 9999)
    fraction = (600 + SLACK_S + 600 + SLACK_S) / 1600  # [T0, T0+720] and [T0+880, T0+1600]
    assert (c.charged_fraction, c.reason) == (pytest.approx(fraction), "time")
    assert kept_one.allocated_gpu_seconds == pytest.approx(1600 * fraction)
    assert kept_one.energy_joules == pytest.approx(1.6e6 * fraction)
    assert (kept_one.first_ts, kept_one.last_ts) == (T0, T0 + 1600)
    # runs whose windows overlap (requeued within the slack) count their common time once
    close = replace(same_host, start=T0 + 700, end=T0 + 1300)
    assert in_scope(close, [usage("n1", T0, T0 + 1300)], T0 + 9999)[1] == ()


def test_a_requeued_job_waiting_for_its_next_run_is_held_to_its_earlier_runs():
    pending = replace(REQUEUED, start=None, end=None, hosts=(), state="PENDING")
    kept, cut = in_scope(pending, [usage("n1", T0, T0 + 600), usage("n1", T0 + 2000, T0 + 2600)], T0 + 9999)
    assert [u.first_ts for u in kept] == [T0] and [(c.usage.first_ts, c.reason) for c in cut] == [(T0 + 2000, "time")]
