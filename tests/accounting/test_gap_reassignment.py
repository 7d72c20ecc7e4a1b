"""Unattributed gap energy reassigned from Slurm's records (accounting.gaps), and reconcile reading the collector's
per-GPU energy, gaps and counter anomalies, with a MIG GPU counted once. Everything through a real Store
fed by ingest."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest
import typer
from typer.testing import CliRunner

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.cli import fairshare_app
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.engine import association_usage
from gpuledger.accounting.gaps import reassign
from gpuledger.accounting.jobreport import load_job_report, to_text
from gpuledger.accounting.ledger import gap_attribution, load
from gpuledger.accounting.report.jobs import job_rows
from gpuledger.accounting.report.period import Period, parse_period
from gpuledger.accounting.report.reconcile import NO_JOB, TOTAL, reconcile
from gpuledger.accounting.report.usage import usage_report
from gpuledger.accounting.report_cli import audit_app, report_app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

T0 = datetime(2026, 10, 5, tzinfo=UTC).timestamp()  # a whole hour
H200, A100 = "NVIDIA H200", "NVIDIA A100-SXM4-80GB"
app = typer.Typer()
app.add_typer(report_app, name="report")
app.add_typer(audit_app, name="audit")
app.add_typer(fairshare_app, name="fairshare")
runner = CliRunner()


def _s(host: str, gpu: str, ts: float, energy: float, jobs: tuple[str, ...] = (), model: str = H200,
       mig: str | None = None, power: float | None = None) -> GpuSample:
    return GpuSample(ts=ts, host=host, gpu_uuid=gpu, gpu_index=0, energy_joules=energy, power_watts=power,
                     model=model, mig=mig, job_ids=jobs)


def _job(job_id: str, account: str, start: float, end: float, hosts: tuple[str, ...] = ("n1",), **kw) -> JobRecord:
    kw.setdefault("tres", (("gres/gpu", 1.0),))
    kw.setdefault("gpus", 1)
    return JobRecord(job_id, cluster="c", user="u" + job_id, account=account, start=start, end=end,
                     state="COMPLETED", hosts=hosts, gpu_model=kw.pop("gpu_model", H200), **kw)


@pytest.fixture()
def store_dir(tmp_path):
    """Host n1 has two H200s (G0, G1); host n3 one A100 in MIG mode.

    G0: samples at T0, T0+10, then silence until T0+3610, T0+3620, no job on any: the gap (T0+10, T0+3610] is
        3600 s with a trusted counter delta of 360 kJ (100 W), unattributed by the collector; G0's jobless
        intervals add 1 kJ + 1 kJ. G0's unattributed energy: 362 kJ.
    G1: T0 and T0+10 carry job 10 (an agent's job: it describes it, Slurm does not), 500 J; T0+20 the counter steps
        back to 100 J (not trusted: 1 anomaly, the power integral 50 W x 10 s = 500 J, unattributed).
    Slurm: job 7 (1 of n1's GPUs, no GPU identity) T0+610..T0+2410; job 8 (G0 by UUID) T0+2410..T0+4000; job 11
    (G1 by UUID) T0..T0+3600; job 9 on n2. The agent's job 10 says it held both n1 GPUs all the time: ignored.
    n3: MIG A100 M0, instances 1.0 (3g, job 21) and 2.0 (2g, job 22), parent row and instance rows repeating the
        parent's counter: 700 J per 10 s, T0+7200..T0+7220.
    """
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        n1 = [_s("n1", "G0", T0, 0.0), _s("n1", "G0", T0 + 10, 1e3), _s("n1", "G0", T0 + 3610, 361e3),
              _s("n1", "G0", T0 + 3620, 362e3),
              _s("n1", "G1", T0, 0.0, ("10",)), _s("n1", "G1", T0 + 10, 500.0, ("10",)),
              _s("n1", "G1", T0 + 20, 100.0, power=50.0)]
        agent_job = JobRecord("10", cluster="c", user="mallory", account="x", hosts=("n1",), gpus=2, start=T0,
                              end=T0 + 4000, state="COMPLETED")
        store.ingest(Batch("a1", 1, "n1", tuple(n1), jobs=(agent_job,), cluster="c"))
        mig = []
        for k, e in enumerate((1000.0, 1700.0, 2400.0)):
            ts = T0 + 7200 + 10 * k
            mig += [_s("n3", "M0", ts, e, model=A100, power=70.0),
                    _s("n3", "M0", ts, e, ("21",), f"{A100} MIG 3g.40gb", "1.0", 70.0),
                    _s("n3", "M0", ts, e, ("22",), f"{A100} MIG 2g.20gb", "2.0", 70.0)]
        store.ingest(Batch("a3", 1, "n3", tuple(mig), cluster="c"))
        store.put_jobs([
            _job("7", "proj", T0 + 610, T0 + 2410),
            _job("8", "ml", T0 + 2410, T0 + 4000, gpu_uuids=("G0",)),
            _job("9", "proj", T0, T0 + 3600, hosts=("n2",)),
            _job("11", "ml", T0, T0 + 3600, gpu_uuids=("G1",)),
            _job("21", "proj", T0 + 7200, T0 + 7220, hosts=("n3",), gpu_model=None,
                 tres=(("gres/gpu", 1.0), ("gres/gpu:3g.40gb", 1.0))),
            _job("22", "ml", T0 + 7200, T0 + 7220, hosts=("n3",), gpu_model=None,
                 tres=(("gres/gpu", 1.0), ("gres/gpu:2g.20gb", 1.0))),
        ])
    finally:
        store.close()
    return tmp_path


def _open(d):
    return Store(d / "gpuledger.sqlite")


def test_gap_energy_goes_to_the_slurm_jobs_that_held_the_host(store_dir):
    store = _open(store_dir)
    try:
        (gap,) = store.energy_gaps()
        att = gap_attribution(store, now=T0 + 86400)
        per_host = {"n1": 2, "n3": 1}
        records = [r for r, src in store.job_records() if src == "slurm"]
    finally:
        store.close()
    assert (gap["start"], gap["end"], gap["job_ids"]) == (T0 + 10, T0 + 3610, [])
    assert gap["energy_joules"] == pytest.approx(360e3)
    by = {k[1]: v for k, v in att.by_job().items()}
    # job 7: overlap 1800 s of the 3600 s gap, 1 of n1's 2 GPUs, no GPU identity: 1800/3600 x 1/2 = 1/4 -> 90 kJ,
    # covering 1800 s x 1/2 = 900 GPU-s; job 8 names G0: overlap T0+2410..T0+3610 = 1200 s -> 1/3 -> 120 kJ.
    # job 11 names G1 (not the gap's GPU), job 9 ran on n2, the agent's job 10 is no scheduler record: nothing.
    assert set(by) == {"7", "8"}
    (s7,), (s8,) = by["7"], by["8"]
    assert (s7.start, s7.end, s8.start, s8.end) == (T0 + 610, T0 + 2410, T0 + 2410, T0 + 3610)
    assert s7.energy_joules == pytest.approx(90e3) and s7.gpu_seconds == pytest.approx(900.0)
    assert s8.energy_joules == pytest.approx(120e3) and s8.gpu_seconds == pytest.approx(1200.0)
    # conservation: reassigned + still unattributed = the gap's energy (360 - 210 = 150 kJ left)
    assert att.unattributed_joules() == pytest.approx(150e3)
    assert att.reassigned_joules() + att.unattributed_joules() == pytest.approx(gap["energy_joules"], rel=1e-12)
    # deterministic: the same result whatever order the records come in
    shuffled = records[:]
    random.Random(3).shuffle(shuffled)
    assert reassign([gap], shuffled, per_host, T0 + 86400) == reassign([gap], records, per_host, T0 + 86400)
    # a job of another cluster on a host of the same name held nothing of this GPU (its agent named cluster c)
    other = JobRecord("41", cluster="d", account="p", hosts=("n1",), gpus=1, gpu_uuids=("G0",), start=T0,
                      end=T0 + 4000, state="COMPLETED")
    named = {("n1", "G0"): "c"}
    assert reassign([gap], records + [other], per_host, T0 + 86400, named) == reassign(
        [gap], records, per_host, T0 + 86400, named)
    assert "41" in {s.job_id for s in reassign([gap], records + [other], per_host, T0 + 86400).shares}
    # conservative: three jobs that each claim G0 for the whole gap share it, never more than the gap holds
    greedy = [_job(j, "p", T0, T0 + 4000, gpu_uuids=("G0",)) for j in ("31", "32", "33")]
    over = reassign([gap], greedy + records, per_host, T0 + 86400)
    assert over.reassigned_joules() == pytest.approx(360e3) and over.unattributed_joules() == pytest.approx(0.0)
    shares = {s.job_id: s.energy_joules for s in over.shares}
    # the raw shares 1, 1, 1 (31-33), 1/4 (7), 1/3 (8) sum to 3 7/12 = 43/12: each is scaled by 12/43
    assert shares["31"] == pytest.approx(360e3 * 12 / 43) and shares["7"] == pytest.approx(360e3 * 3 / 43)


def test_a_requeued_jobs_earlier_run_on_the_gaps_host_gets_its_share(store_dir):
    """Job 50 ran first on n1 over the gap (T0+10..T0+3610 on G0), was requeued and ran again on n2: its earlier run
    held the GPU then, so it gets the share job 7 would (no GPU identity: Slurm keeps only the latest run's UUIDs);
    its latest run, elsewhere, none. In the reports the share counts with the run it came from."""
    store = _open(store_dir)
    try:
        (gap,) = store.energy_gaps()
    finally:
        store.close()
    per_host = {"n1": 2}
    latest = _job("50", "proj", T0 + 5000, T0 + 6000, hosts=("n2",), gpu_uuids=("G9",),
                  earlier_runs=((T0 + 610, T0 + 2410, ("n1",)),))
    (share,) = reassign([gap], [latest], per_host, T0 + 86400).shares
    assert (share.job_id, share.host, share.start, share.end) == ("50", "n1", T0 + 610, T0 + 2410)
    assert share.energy_joules == pytest.approx(90e3) and share.gpu_seconds == pytest.approx(900.0)  # as job 7
    # requeued onto the same host: its earlier run (no UUIDs known) and its latest (G0 by UUID) each get their part
    again = _job("51", "proj", T0 + 2410, T0 + 4000, gpu_uuids=("G0",), earlier_runs=((T0 + 610, T0 + 2410, ("n1",)),))
    parts = sorted((s.start, s.energy_joules) for s in reassign([gap], [again], per_host, T0 + 86400).shares)
    assert parts == [(T0 + 610, pytest.approx(90e3)), (T0 + 2410, pytest.approx(120e3))]
    waiting = replace(_job("52", "proj", T0, T0, earlier_runs=((T0 + 610, T0 + 2410, ("n1",)),)),
                      start=None, end=None, state="PENDING", hosts=())
    (share,) = reassign([gap], [waiting], per_host, T0 + 86400).shares  # requeued, pending: its earlier run counts
    assert share.energy_joules == pytest.approx(90e3)
    # through the ledger: the latest run two days later, the share in the earlier run's day and nowhere else
    days = [Period(T0 + d * 86400, T0 + (d + 1) * 86400, f"day {d}") for d in range(3)]
    store = _open(store_dir)
    try:
        before = load(store, now=T0 + 3 * 86400)
        store.put_jobs([replace(latest, start=T0 + 2 * 86400, end=T0 + 2 * 86400 + 600)])
        after = load(store, now=T0 + 3 * 86400)
    finally:
        store.close()
    energy = [[usage_report(entries, "account", p, now=T0 + 3 * 86400).total.energy_kwh for p in days]
              for entries in (before, after)]
    assert energy[1][0] - energy[0][0] == pytest.approx(90e3 / 3.6e6)  # beside job 7's and 8's shares
    assert energy[1][1:] == energy[0][1:] == [0.0, 0.0]


def test_energy_policy_charges_reassigned_gap_energy_not_the_gap_twice(store_dir):
    store = _open(store_dir)
    try:
        entries = load(store, now=T0 + 86400)
    finally:
        store.close()
    settings = AccountingSettings(policy="energy", half_life_s=0, calc_period_s=1)
    tree = AssocTree.from_toml({"accounts": {"proj": {"shares": 1, "users": {"u7": 1}},
                                             "ml": {"shares": 1, "users": {"u8": 1}}}})
    res = association_usage(entries, settings, tree, T0 + 86400)
    jobs = {j.job_id: j for j in res.jobs}
    # job 7: Slurm 1800 GPU-s, nothing observed; the gap covers 900 GPU-s of it with 90 kJ measured by the counter,
    # the other 900 s are unmeasured, charged at full power 700 W: 90e3 + 900 x 700 = 720 kJ (1 260 kJ before)
    assert jobs["7"].gap_energy_joules == pytest.approx(90e3)
    assert jobs["7"].unmeasured_gpu_seconds == pytest.approx(900.0)
    assert jobs["7"].charged == pytest.approx(90e3 + 900 * 700)
    # job 8: Slurm 1590 GPU-s, the gap covers 1200 with 120 kJ: 120e3 + 390 x 700 = 393 kJ
    assert jobs["8"].charged == pytest.approx(120e3 + 390 * 700)
    assert res.usage[("proj", "u7")] == pytest.approx(720e3)


def test_reports_show_the_reassigned_gap_energy(store_dir):
    store = _open(store_dir)
    try:
        entries = load(store, now=T0 + 86400)
        rep = load_job_report(store, "7", now=T0 + 86400)
    finally:
        store.close()
    rows = {r.job_id: r for r in job_rows(entries, now=T0 + 86400)}
    assert rows["7"].energy_kwh == pytest.approx(90e3 / 3.6e6)  # nothing sampled, the gap's 90 kJ
    assert rows["10"].energy_kwh == pytest.approx(500 / 3.6e6)  # the agent's job: its samples only
    usage = {r.group: r for r in usage_report(entries, "account", parse_period("2026-10")).rows}
    assert usage["proj"].energy_kwh == pytest.approx((90e3 + 1400 * 3 / 7) / 3.6e6)  # job 7 gap, job 21: 3/7 of 1400 J
    assert rep.allocation is not None and rep.allocation.gap_energy_joules == pytest.approx(90e3)
    assert "gap energy 0.025 kWh" in to_text(rep)


def test_reconcile_reads_the_collectors_energy_gaps_and_anomalies(store_dir):
    store = _open(store_dir)
    try:
        gaps = gap_attribution(store, now=T0 + 86400)
        entries = load(store, gaps=gaps)
        rec = reconcile(entries, store.gpu_hours(), parse_period("2026-10"), now=T0 + 86400,
                        gpu_energy=store.gpu_energy(), gaps=gaps)
    finally:
        store.close()
    rows = {(r.account, r.node, r.model): r for r in rec.rows}
    idle = rows[(NO_JOB, "n1", H200)]
    # G0: 362 kJ unattributed by the collector, 210 kJ of it reassigned -> 152 kJ; G1: 500 J (after its step back)
    assert idle.unattributed_energy_kwh == pytest.approx((152e3 + 500) / 3.6e6)
    # G0 observed 20 s with no job, G1 10 s (T0+10..T0+20); the gap is not observed time
    assert idle.unattributed_gpu_hours == pytest.approx(30 / 3600)
    assert idle.counter_anomalies == 1  # G1's counter stepping back
    assert rows[("proj", "n1", H200)].reassigned_energy_kwh == pytest.approx(90e3 / 3.6e6)
    assert rows[("ml", "n1", H200)].reassigned_energy_kwh == pytest.approx(120e3 / 3.6e6)
    t = rec.total
    assert t.reassigned_energy_kwh == pytest.approx(210e3 / 3.6e6) and t.counter_anomalies == 1
    # conservation over n1 and n3: reassigned + still unattributed = the collector's unattributed energy
    # (n1 362.5 kJ, n3's MIG A100: 1400 J of which 3/7 + 2/7 went to jobs 21, 22 -> 400 J)
    assert (t.reassigned_energy_kwh + t.unattributed_energy_kwh) * 3.6e6 == pytest.approx(362.5e3 + 400)


def test_reconcile_counts_a_mig_gpu_once(store_dir):
    store = _open(store_dir)
    try:
        rec = reconcile(load(store, now=T0 + 86400), store.gpu_hours(), parse_period("2026-10"), now=T0 + 86400,
                        gpu_energy=store.gpu_energy())
    finally:
        store.close()
    n3 = [r for r in rec.rows if r.node == "n3"]
    rows = {(r.account, r.model): r for r in n3}
    # job 21: Slurm 1 x 3g.40gb x 20 s = 20 x 3/7 GPU-s, observed the same on the 3g instance: coverage 1
    a = rows[("proj", f"{A100} MIG 3g.40gb")]
    assert a.slurm_gpu_hours == pytest.approx(20 * 3 / 7 / 3600) and a.coverage == pytest.approx(1.0)
    # the physical A100 observed 20 s: 20 x 5/7 carried jobs, 20 x 2/7 (the free slices) with no job, and the
    # instance rows add nothing of their own; its energy 1400 J once, 400 J of it on no job
    idle = rows[(NO_JOB, A100)]
    assert idle.unattributed_gpu_hours == pytest.approx(20 * 2 / 7 / 3600)
    assert idle.unattributed_energy_kwh == pytest.approx(400 / 3.6e6)
    assert math_sum(r.observed_gpu_hours + r.unattributed_gpu_hours for r in n3) == pytest.approx(20 / 3600)
    assert idle.counter_anomalies == 0


def math_sum(values) -> float:
    import math

    return math.fsum(values)


def test_report_reconcile_cli_json(store_dir):
    r = runner.invoke(app, ["report", "reconcile", "--data-dir", str(store_dir), "--period", "2026-10",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    total = json.loads(r.output)["total"]
    assert total["counter_anomalies"] == 1
    assert total["reassigned_energy_kwh"] == pytest.approx(210e3 / 3.6e6)
    assert total["unattributed_energy_kwh"] == pytest.approx((152.5e3 + 400) / 3.6e6)
    r = runner.invoke(app, ["report", "reconcile", "--data-dir", str(store_dir), "--period", "2026-10"])
    assert r.exit_code == 0 and "Gap kWh to jobs" in r.output and TOTAL in r.output


def test_the_audit_trail_records_and_explains_the_reassigned_gap_energy(store_dir):
    (store_dir / "gpuledger.toml").write_text(
        '[accounting]\npolicy = "energy"\nhalf_life_s = 0\ncalc_period_s = 1\n'
        '[accounts.proj]\nshares = 1\n[accounts.proj.users]\nu7 = 1\n[accounts.ml]\nshares = 1\n'
        '[accounts.ml.users]\nu8 = 1\n')
    r = runner.invoke(app, ["fairshare", "--data-dir", str(store_dir), "--format", "json", "--record"])
    assert r.exit_code == 0, r.output
    from gpuledger.accounting.audit import open_log

    with open_log(store_dir) as log:
        (fs,) = list(log.entries(kind="fairshare"))
    job7 = fs.data["inputs"]["jobs"]["7"]
    # as in the energy-policy test: 90 kJ of the gap plus 900 unmeasured GPU-s at 700 W
    assert job7["gap_energy_joules"] == pytest.approx(90e3) and job7["charged"] == pytest.approx(720e3)
    r = runner.invoke(app, ["audit", "explain", "7", "--data-dir", str(store_dir)])
    assert r.exit_code == 0, r.output
    assert "gap energy: 90000.0 J" in r.output


def _mig_gap_store(tmp_path, second_jobs: tuple[str, str]) -> Store:
    """n3's MIG A100 at 70 W (the counter 70 J/s), samples at +0, 10, 20, then +320, 330: a 300 s gap (21 kJ).
    Instance 1.0 (3g) runs job 21 throughout; instance 2.0 (2g) job 22 before the gap, ``second_jobs`` after."""
    store = Store(tmp_path / "gpuledger.sqlite")
    rows = []
    for t in (0, 10, 20, 320, 330):
        e = 70.0 * t
        jobs = ("21", "22") if t < 320 else second_jobs
        rows += [_s("n3", "M0", T0 + t, e, model=A100, power=70.0),
                 _s("n3", "M0", T0 + t, e, (jobs[0],), f"{A100} MIG 3g.40gb", "1.0", 70.0),
                 _s("n3", "M0", T0 + t, e, (jobs[1],), f"{A100} MIG 2g.20gb", "2.0", 70.0)]
    store.ingest(Batch("a3", 1, "n3", tuple(rows), cluster="c"))
    store.put_jobs([_job(j, "proj", T0 - 10, T0 + 400, hosts=("n3",), gpu_model=None,
                         tres=(("gres/gpu", 1.0), (f"gres/gpu:{p}", 1.0)))
                    for j, p in (("21", "3g.40gb"), ("22", "2g.20gb"), ("23", "2g.20gb"))])
    return store


def test_a_gap_the_mig_instances_held_is_charged_once(tmp_path):
    # The instances charge their jobs their slices of the gap (held: the same job on both sides); the physical
    # GPU's gap record names no job (its rows carry none), and must not be reassigned to the same jobs again.
    store = _mig_gap_store(tmp_path, ("21", "22"))
    try:
        entries = {e.job_id: e for e in load(store, now=T0 + 86400)}
        (gpu,) = store.gpu_energy()
    finally:
        store.close()
    assert gpu["energy_joules"] == pytest.approx(70.0 * 330)
    charged = {j: e.usage.energy_joules + e.gap_energy_joules for j, e in entries.items() if j in ("21", "22")}
    assert charged == pytest.approx({"21": 70.0 * 330 * 3 / 7, "22": 70.0 * 330 * 2 / 7})
    assert all(e.gap_energy_joules == 0.0 for e in entries.values())
    assert gpu["unattributed_energy_joules"] == pytest.approx(70.0 * 330 * 2 / 7)  # the free slices


def test_a_mig_gap_only_some_instances_held_is_never_charged_twice(tmp_path):
    # Instance 2.0's job changes across the gap (22 -> 23): its slice of the gap stays unattributed; instance 1.0
    # held it. The physical gap is not reassigned on top of what the instances charged.
    store = _mig_gap_store(tmp_path, ("21", "23"))
    try:
        entries = {e.job_id: e for e in load(store, now=T0 + 86400)}
        (gpu,) = store.gpu_energy()
    finally:
        store.close()
    total = math_sum(e.usage.energy_joules + e.gap_energy_joules for e in entries.values())
    assert total <= gpu["energy_joules"] * 5 / 7 + 1e-6
    assert entries["21"].usage.energy_joules == pytest.approx(70.0 * 330 * 3 / 7)  # held: its slice of the gap
    assert all(e.gap_energy_joules == 0.0 for e in entries.values())


def test_a_mig_gap_no_instance_held_is_reassigned_from_slurm(tmp_path):
    store = _mig_gap_store(tmp_path, ("23", "23"))  # both instances change jobs across the gap: nobody held it
    try:
        gaps = store.energy_gaps()
        entries = {e.job_id: e for e in load(store, now=T0 + 86400)}
    finally:
        store.close()
    assert [(g["mig"], g["job_ids"]) for g in gaps] == [(None, [])]  # only the physical record
    assert math_sum(e.gap_energy_joules for e in entries.values()) == pytest.approx(21000.0)
