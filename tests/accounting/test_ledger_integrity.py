"""Charging rules, allocation frame, decay inputs, reconciliation, retention and the v2 -> v3 ledger migration
(issue 12, accounting side). Numbers are derived by hand in the comments."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime

import pytest
import typer
from typer.testing import CliRunner

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.charge import ChargePolicy, allocated_gpu_seconds, allocation
from gpuledger.accounting.cli import fairshare_app
from gpuledger.accounting.config import AccountingSettings, ConfigError, accounting_settings
from gpuledger.accounting.decay import decayed_usage, last_reset_boundary
from gpuledger.accounting.engine import association_usage, hourly_pieces
from gpuledger.accounting.ledger import join, load
from gpuledger.accounting.privacy import InsideDecayHorizon, Pseudonymizer, apply_retention, decay_horizon_start
from gpuledger.accounting.report.period import parse_period
from gpuledger.accounting.report.reconcile import NO_JOB, reconcile, reconcile_csv
from gpuledger.accounting.report_cli import audit_app, report_app
from gpuledger.agent.push import encode_batch
from gpuledger.agent.slurm import cluster_name_from_conf, local_cluster_name
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

T0 = datetime(2026, 10, 5, tzinfo=UTC).timestamp()  # a whole hour
app = typer.Typer()
app.add_typer(report_app, name="report")
app.add_typer(audit_app, name="audit")
app.add_typer(fairshare_app, name="fairshare")
runner = CliRunner()


def U(job: str, seconds: float, sm: float = 0.0, energy: float = 0.0, model: str = "NVIDIA H200", host: str = "n1",
      gpu: str = "G0", first: float = T0) -> JobUsage:
    return JobUsage(job, host, gpu, first, first + seconds, 2, seconds, sm * seconds, energy, model=model)


# -- model weights ---------------------------------------------------------------------------------------------
def test_model_weight_exact_then_longest_pattern():
    p = ChargePolicy(model_weights={"A10": 0.5, "A100": 2.0, "NVIDIA H200": 3.0, "H200": 1.5})
    assert p.weight("NVIDIA A100-SXM4-80GB") == 2.0  # "A100" (4 chars) beats "A10" (3), whatever the dict order
    assert p.weight("NVIDIA A10") == 0.5
    assert p.weight("NVIDIA H200") == 3.0  # exact name
    assert p.weight("NVIDIA H200 NVL") == 3.0  # longest contained pattern: "NVIDIA H200"
    assert p.weight("Tesla V100") == 1.0
    # a MIG 3g slice of an A100 weighs as an A100: its GPU-seconds are already 3/7 of the GPU's (never twice)
    assert p.weight("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == 2.0


def test_mig_slice_counted_once_on_both_sides_of_the_frame():
    # Slurm allocates one 3g.40gb slice for 700 s: 300 physical-GPU-seconds, the unit the aggregation uses for
    # a MIG instance's samples; a fully measured slice then has coverage 1, and weight 2.0 applies once.
    r = JobRecord("9", start=T0, end=T0 + 700, state="COMPLETED", gpus=1,
                  tres=(("gres/gpu", 1.0), ("gres/gpu:3g.40gb", 1.0)))
    assert allocation(r, T0 + 10_000) == {"3g.40gb": pytest.approx(300.0)}
    assert allocated_gpu_seconds(r, T0 + 10_000) == pytest.approx(300.0)


# -- allocation frame ------------------------------------------------------------------------------------------
def test_allocation_from_slurm_elapsed_times_gpus_per_model():
    r = JobRecord("1", start=T0, end=T0 + 600, state="COMPLETED", gpus=2,
                  tres=(("gres/gpu", 2.0), ("gres/gpu:h200", 2.0)))
    assert allocation(r, T0 + 10_000) == {"h200": 1200.0}  # 600 s x 2
    untyped = JobRecord("2", start=T0, end=T0 + 100, state="COMPLETED", gpus=3, gpu_model="a100",
                        tres=(("gres/gpu", 3.0),))
    assert allocation(untyped, T0 + 10_000) == {"a100": 300.0}
    running = JobRecord("3", start=T0, state="RUNNING", gpus=1, tres=(("gres/gpu", 1.0),))
    assert allocation(running, T0 + 50) == {"": 50.0}  # up to now
    assert allocation(JobRecord("4", state="PENDING", gpus=1), T0) is None
    assert allocation(None, T0) is None


def test_unmeasured_rules_never_charge_zero():
    # Slurm: 1 GPU for 100 s. Agents saw 50 s at SM 0.5 (25 SM-active GPU-s), 10 kJ.
    rec = JobRecord("1", start=T0, end=T0 + 100, state="COMPLETED", gpus=1, tres=(("gres/gpu", 1.0),))
    u = U("1", 50.0, sm=0.5, energy=10_000.0)
    alloc = allocation(rec, T0 + 1000)

    def total(**kw):
        return ChargePolicy(**kw).charge_job(alloc, [u])

    c = total(kind="active")  # unmeasured 50 s "as fully used": 25 + 50 x 1 = 75
    assert (c.measured, c.unmeasured, c.total, c.coverage, c.unmeasured_gpu_seconds) == (25.0, 50.0, 75.0, 0.5, 50.0)
    assert total(kind="active", unmeasured="floor", floor=0.25).total == 25.0 + 50 * 0.25  # 37.5
    assert total(kind="active", unmeasured="mean").total == 25.0 + 50 * 0.5  # the job's own rate: 50
    # blend (floor 0.25): measured 0.25 x 50 + 0.75 x 25 = 31.25; unmeasured 50 x 1 = 50
    assert total(kind="blend").total == 81.25
    # energy: 10 kJ measured + 50 s x 700 W = 45 kJ
    assert total(kind="energy").total == 45_000.0
    # allocated: Slurm's 100 GPU-s, half observed
    c = total(kind="allocated")
    assert (c.total, c.measured, c.unmeasured) == (100.0, 50.0, 50.0)
    # no scheduler record: measurements only, nothing unmeasured
    assert ChargePolicy(kind="active").charge_job(None, [u]).total == 25.0


# -- decay inputs ----------------------------------------------------------------------------------------------
def test_half_life_zero_means_no_decay_and_zone_is_checked():
    s = accounting_settings({"accounting": {"half_life_s": 0}})
    assert s.half_life_s == 0
    assert decayed_usage([("a", T0, T0 + 100, 50.0)], now=T0 + 10 * 86400, half_life_s=0) == {"a": 50.0}
    with pytest.raises(ConfigError, match="time zone"):
        accounting_settings({"accounting": {"timezone": "Mars/Olympus"}})


def test_reset_periods_are_cut_in_the_configured_zone_default_local(monkeypatch):
    t = datetime(2026, 10, 5, 3, 0, tzinfo=UTC).timestamp()  # 23:00 on Oct 4 in New York
    assert last_reset_boundary("DAILY", t, "UTC") == datetime(2026, 10, 5, tzinfo=UTC).timestamp()
    ny = last_reset_boundary("DAILY", t, "America/New_York")
    assert ny == datetime(2026, 10, 4, 4, 0, tzinfo=UTC).timestamp()  # midnight EDT = 04:00 UTC
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert last_reset_boundary("DAILY", t) == ny  # no zone: this machine's, as slurmctld
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_measured_charge_lands_in_the_hours_the_gpu_was_used(tmp_path):
    # Job 5 on G0: samples every 60 s through hour 0, nothing in hour 1 (agent down), then hour 2 again.
    store = Store(tmp_path / "s.sqlite", max_gap_s=120.0)
    try:
        ts = [T0 + 60 * k for k in range(61)] + [T0 + 7200 + 60 * k for k in range(61)]
        store.ingest(Batch("a", 1, "n1", tuple(GpuSample(ts=t, host="n1", gpu_uuid="G0", gpu_index=0,
                                                         sm_active_ratio=1.0, job_ids=("5",)) for t in ts)))
        (u,) = store.job_usage(per_gpu=True)
        busy = store.busy_hours()
    finally:
        store.close()
    # Each interval sits in the bucket of the hour its end falls in: [3540 s, 3600 s] in hour 1, and so on.
    assert [(h - T0, s) for h, s in busy[("n1", "G0", "")]] == [(0, 3540), (3600, 60), (7200, 3540), (10800, 60)]
    pieces = hourly_pieces(u, 100.0, busy[("n1", "G0", "")])
    # weights 3540, 60, 3540, 60 of 7200 busy GPU-s (the job's own): 100 x 3540/7200 = 49.1667, 100 x 60/7200
    assert [w for _, _, w in pieces] == pytest.approx([100 * 3540 / 7200, 100 * 60 / 7200] * 2)
    # the silent stretch T0 + 3600 .. T0 + 7200 holds only hour 1's bucket (its one 60 s interval, spread over
    # the hour: placement is at hour resolution): 0.83 of 100, where spreading over first..last put 33.3
    silent = sum(w for a, b, w in pieces if a - T0 < 7100 and b - T0 > 3700)
    assert silent == pytest.approx(100 * 60 / 7200, rel=1e-3)


# -- identity: unnamed clusters join, v2 stores migrate -----------------------------------------------------------
def test_an_unnamed_side_joins_a_unique_job_id_only():
    recs = [JobRecord("7", cluster="alpha", account="a", user="u"), JobRecord("8", cluster="alpha"),
            JobRecord("8", cluster="beta")]
    uses = [U("7", 10.0), U("8", 20.0)]  # cluster "" (the agent named none)
    entries = {e.key: e for e in join(recs, uses)}
    assert entries[("alpha", "7")].usage is not None  # 7 is unique: joined
    # 8 exists in two clusters: the unnamed measurement stays apart, flagged
    assert entries[("", "8")].seen_by == "agent" and entries[("alpha", "8")].seen_by == "slurm"


def test_a_gpu_first_seen_unnamed_takes_its_cluster_later(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    try:
        mk = lambda t: GpuSample(ts=t, host="n1", gpu_uuid="G0", gpu_index=0, job_ids=("1",))  # noqa: E731
        store.ingest(Batch("a", 1, "n1", (mk(T0), mk(T0 + 10))))
        store.ingest(Batch("a", 2, "n1", (mk(T0 + 20),), cluster="alpha"))
        store.ingest(Batch("a", 3, "n1", (mk(T0 + 30),), cluster="beta"))  # a GPU stays in its first cluster
        assert [(u.cluster, u.allocated_gpu_seconds) for u in store.job_usage()] == [("alpha", 30.0)]
    finally:
        store.close()


def test_a_v2_store_is_migrated(tmp_path):
    path = tmp_path / "s.sqlite"
    store = Store(path)
    mk = lambda t: GpuSample(ts=t, host="n1", gpu_uuid="G0", gpu_index=0, job_ids=("1",))  # noqa: E731
    store.ingest(Batch("a", 1, "n1", (mk(T0), mk(T0 + 10))))
    store.put_jobs([JobRecord("1", cluster="c", account="a", user="u")])
    store.close()
    # turn it into what schema 2 wrote: usage keyed (job_id, host, gpu) and without the energy rules' gap_s
    # (v2 stores predate it), jobs (job_id, cluster, data)
    db = sqlite3.connect(path)
    cols = [c for c in [r[1] for r in db.execute("PRAGMA table_info(usage)")][1:] if c != "gap_s"]
    db.executescript(f"""
        CREATE TABLE u2 ({', '.join(cols)}, PRIMARY KEY (job_id, host, gpu)) WITHOUT ROWID;
        INSERT INTO u2 SELECT {', '.join(cols)} FROM usage; DROP TABLE usage; ALTER TABLE u2 RENAME TO usage;
        CREATE TABLE j2 (job_id TEXT NOT NULL, cluster TEXT NOT NULL, data TEXT NOT NULL,
                         PRIMARY KEY (job_id, cluster)) WITHOUT ROWID;
        INSERT INTO j2 SELECT job_id, cluster, data FROM jobs; DROP TABLE jobs; ALTER TABLE j2 RENAME TO jobs;
        DROP TABLE gpu_clusters; UPDATE meta SET value='2' WHERE key='schema';""")
    db.commit()
    db.close()
    store = Store(path)
    try:
        assert store._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "4"  # META_FORMAT
        (e,) = load(store)
        assert (e.key, e.seen_by, e.account, e.usage.allocated_gpu_seconds) == (("c", "1"), "both", "a", 10.0)
        assert e.usage.gap_gpu_seconds == 0.0  # a field the v2 store had no column for starts at 0
    finally:
        store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='9' WHERE key='schema'")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="store schema 9"):
        Store(path)


# -- retention and pseudonymized history ---------------------------------------------------------------------------
@pytest.fixture()
def ledger_dir(tmp_path):
    """alice ran job 1 (1 GPU, 1 h) that agents measured at SM 1.0; bob ran job 2, 1 h, no agent."""
    (tmp_path / "gpuledger.toml").write_text(
        '[accounting]\npolicy = "active"\nhalf_life_s = 0\ncalc_period_s = 1\n'
        '[accounts.proj]\nshares = 1\n[accounts.proj.users]\nalice = 1\nbob = 1\ncarol = 1\n')
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a", 1, "n1", tuple(
            GpuSample(ts=T0 + 60 * k, host="n1", gpu_uuid="G0", gpu_index=0, sm_active_ratio=1.0, energy_joules=1e4 * k,
                      model="NVIDIA H200", job_ids=("1",) if k < 61 else ()) for k in range(121)), cluster="c"))
        store.put_jobs([
            JobRecord("1", cluster="c", user="alice", account="proj", gpus=1, start=T0, end=T0 + 3600,
                      state="COMPLETED", hosts=("n1",), tres=(("gres/gpu", 1.0),)),
            JobRecord("2", cluster="c", user="bob", account="proj", gpus=1, start=T0, end=T0 + 3600,
                      state="COMPLETED", hosts=("n2",), tres=(("gres/gpu", 1.0),))])
    finally:
        store.close()
    return tmp_path


def _fairshare_usage(d):
    r = runner.invoke(app, ["fairshare", "--data-dir", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output
    return r


def test_retention_refuses_inside_the_decay_horizon_and_fairshare_survives_it(ledger_dir):
    before = _fairshare_usage(ledger_dir).output
    # half_life_s = 0: nothing decays, everything is inside the horizon
    assert decay_horizon_start(time.time(), 0.0) == -float("inf")
    r = runner.invoke(app, ["audit", "retention", "--data-dir", str(ledger_dir), "--days", "0"])
    assert r.exit_code == 2 and "decay horizon" in r.output and "--force" in r.output
    with pytest.raises(InsideDecayHorizon):
        apply_retention(None, ledger_dir, Pseudonymizer.for_data_dir(ledger_dir), 0,
                        horizon_start=T0)
    r = runner.invoke(app, ["audit", "retention", "--data-dir", str(ledger_dir), "--days", "0", "--force"])
    assert r.exit_code == 0 and "pseudonymized 2" in r.output, r.output
    after = _fairshare_usage(ledger_dir)
    assert "no association" not in after.output
    # the same fairshare as before: the pseudonymized users still charge alice's and bob's associations
    strip = lambda text: text[text.index("["):]  # noqa: E731
    assert json.loads(strip(after.output)) == json.loads(strip(before))


def test_fairshare_charges_the_job_no_agent_saw(ledger_dir):
    settings = AccountingSettings(policy="active", half_life_s=0, calc_period_s=1)
    store = Store(ledger_dir / "gpuledger.sqlite")
    try:
        entries = load(store)
    finally:
        store.close()
    tree = AssocTree.from_toml({"accounts": {"proj": {"shares": 1, "users": {"alice": 1, "bob": 1}}}})
    res = association_usage(entries, settings, tree, T0 + 86400)
    # alice: 3600 SM-active GPU-s measured; bob: no agent, 3600 s "as fully used"
    assert res.usage == pytest.approx({("proj", "alice"): 3600.0, ("proj", "bob"): 3600.0})


# -- reconciliation ----------------------------------------------------------------------------------------------
def test_reconcile_per_account_node_model(ledger_dir):
    store = Store(ledger_dir / "gpuledger.sqlite")
    try:
        entries, hours, energy = load(store), store.gpu_hours(), store.gpu_energy()
    finally:
        store.close()
    rec = reconcile(entries, hours, parse_period("2026-10"), gpu_energy=energy)
    rows = {(r.account, r.node, r.model): r for r in rec.rows}
    # job 1: Slurm 1 GPU x 3600 s on n1 (h200 measured): observed 3600 -> coverage 1
    a = rows[("proj", "n1", "NVIDIA H200")]
    assert (a.slurm_gpu_hours, a.observed_gpu_hours, a.coverage, a.unmeasured_gpu_hours) == (1.0, 1.0, 1.0, 0.0)
    # job 2: 1 GPU-hour on n2 that nobody observed
    b = rows[("proj", "n2", "(unknown)")]
    assert (b.slurm_gpu_hours, b.observed_gpu_hours, b.coverage, b.unmeasured_gpu_hours) == (1.0, 0.0, 0.0, 1.0)
    # G0 after job 1: samples T0+3600 .. T0+7200 carried no job: 1 GPU-hour unattributed, 1e4 J per 60 s = 600 kJ
    # (the collector's energy on no job, not an estimate), no gap, no counter anomaly
    idle = rows[(NO_JOB, "n1", "NVIDIA H200")]
    assert idle.unattributed_gpu_hours == 1.0 and idle.unattributed_energy_kwh == pytest.approx(6e5 / 3.6e6)
    assert (rec.total.slurm_gpu_hours, rec.total.unmeasured_gpu_hours, rec.total.jobs) == (2.0, 1.0, 2)
    assert rec.total.counter_anomalies == 0 and rec.total.reassigned_energy_kwh == 0.0
    assert reconcile_csv(rec).splitlines()[-1].startswith("TOTAL,")
    r = runner.invoke(app, ["report", "reconcile", "--data-dir", str(ledger_dir), "--period", "2026-10",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["total"]["unattributed_gpu_hours"] == 1.0 and doc["total"]["coverage"] == 0.5


# -- the agent names its cluster -----------------------------------------------------------------------------------
def test_agent_sends_its_cluster_and_its_host_in_job_metadata(tmp_path):
    assert cluster_name_from_conf("# x\nSlurmctldHost=a\nclustername=alpha  # the lab\n") == "alpha"
    assert cluster_name_from_conf("SlurmctldHost=a\n") == ""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=beta\n")
    assert local_cluster_name([str(tmp_path / "missing"), str(conf)]) == "beta"
    body = json.loads(encode_batch("a", "n1", 1, [GpuSample(ts=T0, host="n1", gpu_uuid="G", gpu_index=0)],
                                   [JobRecord("5", account="p")], cluster="beta"))
    assert body["cluster"] == "beta" and body["jobs"][0]["hosts"] == ["n1"]
    assert "cluster" not in json.loads(encode_batch("a", "n1", 1, [], []))  # unnamed: the old wire exactly


def test_usage_report_shows_unmeasured_gpu_hours_per_account(ledger_dir):
    from gpuledger.accounting.report.usage import usage_report

    store = Store(ledger_dir / "gpuledger.sqlite")
    try:
        entries = load(store)
        per_gpu: dict[str, list[JobUsage]] = {}
        for u in store.job_usage(per_gpu=True):
            per_gpu.setdefault(u.job_id, []).append(u)
    finally:
        store.close()
    # proj: job 1 (1 GPU-h, all observed) and job 2 (1 GPU-h, nobody observed): 2 Slurm GPU-h, 1 unmeasured
    rep = usage_report(entries, "account", parse_period("2026-10"))
    (row,) = rep.rows
    assert (row.group, row.slurm_gpu_hours, row.unmeasured_gpu_hours) == ("proj", 2.0, 1.0)
    assert (rep.total.slurm_gpu_hours, rep.total.unmeasured_gpu_hours) == (2.0, 1.0)
    # by node the allocation is not split among nodes: only the totals row holds it
    rep = usage_report(entries, "node", parse_period("2026-10"), per_gpu=per_gpu)
    assert (rep.total.slurm_gpu_hours, rep.total.unmeasured_gpu_hours) == (2.0, 1.0)


def test_recorded_fairshare_keeps_two_clusters_with_one_job_id_apart(tmp_path):
    """`fairshare --record` binds the store's records to the audit log; job 7 of alpha and job 7 of beta are
    two jobs there too (one log key each), so recording again appends no usage and refuses nothing."""
    (tmp_path / "gpuledger.toml").write_text(
        '[accounting]\npolicy = "allocated"\nhalf_life_s = 0\ncalc_period_s = 1\n'
        '[accounts.proj]\nshares = 1\n[accounts.proj.users]\nalice = 1\nbob = 1\n')
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        for n, (cluster, host, user, k) in enumerate((("alpha", "a1", "alice", 3), ("beta", "b1", "bob", 5))):
            store.ingest(Batch(host, n, host, tuple(GpuSample(ts=T0 + 10 * i, host=host, gpu_uuid=f"G-{host}",
                                                              gpu_index=0, job_ids=("7",)) for i in range(k)),
                               cluster=cluster))
            store.put_jobs([JobRecord("7", cluster=cluster, user=user, account="proj", gpus=1, start=T0,
                                      end=T0 + 10 * (k - 1), state="COMPLETED", hosts=(host,))])
    finally:
        store.close()
    for _ in range(2):
        r = runner.invoke(app, ["fairshare", "--data-dir", str(tmp_path), "--format", "json", "--record"])
        assert r.exit_code == 0, r.output
    from gpuledger.accounting.audit import open_log

    with open_log(tmp_path) as log:
        usage = list(log.entries(kind="usage_record"))
        fs = list(log.entries(kind="fairshare"))
    # one usage entry per job total and one per GPU (final: they ended long ago), none appended by the second run
    assert sorted((e.data["cluster"], e.data["gpu_uuid"], e.data["allocated_gpu_seconds"]) for e in usage) == [
        ("alpha", "*", 20.0), ("alpha", "G-a1", 20.0), ("beta", "*", 40.0), ("beta", "G-b1", 40.0)]
    jobs = fs[-1].data["inputs"]["jobs"]
    assert {j: (c["account"], c["allocated_gpu_seconds"]) for j, c in jobs.items()} == {
        "7@alpha": ("proj", 20.0), "7@beta": ("proj", 40.0)}


def test_fairshare_of_one_cluster_charges_that_clusters_jobs_only(tmp_path):
    """One ledger for two clusters; `cluster = "alpha"` picks alpha's rows of a two-cluster sacctmgr file and charges
    alpha's jobs only (Slurm keeps usage per cluster): alice's 8 GPU-hours on beta would have put her behind bob."""
    (tmp_path / "gpuledger.toml").write_text(
        'cluster = "alpha"\n[accounting]\npolicy = "allocated"\nhalf_life_s = 0\ncalc_period_s = 1\n')
    rows = "".join(f"{c}|root|||1\n{c}|a||root|1\n{c}|a|alice||1\n{c}|b||root|1\n{c}|b|bob||1\n"
                   for c in ("alpha", "beta"))
    (tmp_path / "assoc.txt").write_text("Cluster|Account|User|ParentName|Share\n" + rows)
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.put_jobs([JobRecord(j, cluster=c, user=u, account=a, gpus=g, start=T0, end=T0 + 3600, hosts=(h,),
                                  state="COMPLETED")
                        for j, c, u, a, g, h in (("1", "alpha", "alice", "a", 1, "n1"),
                                                 ("1", "beta", "alice", "a", 8, "m1"),
                                                 ("2", "alpha", "bob", "b", 2, "n2"), ("3", "", "bob", "b", 1, "n3"))])
    finally:
        store.close()
    r = runner.invoke(fairshare_app, ["--data-dir", str(tmp_path), "--associations", str(tmp_path / "assoc.txt"),
                                      "--format", "json"])
    assert r.exit_code == 0, r.output
    got = {(x["account"], x["user"]): (x["raw_usage"], x["fairshare"]) for x in json.loads(r.output) if x["user"]}
    # bob: job 2 (2 GPU-h) and job 3, named for no cluster (1 GPU-h): this cluster's
    assert got == {("a", "alice"): (3600.0, 1.0), ("b", "bob"): (3 * 3600.0, 0.5)}
