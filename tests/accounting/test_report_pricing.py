"""Prices and models in `report usage` and `report reconcile`: a job on several GPU models, Slurm's typed gres
against the node's name for its GPU, the allocated GPU-time no agent observed."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.accounting.charge import ChargePolicy, allocation, bounded_weight, gres_names
from gpuledger.accounting.ledger import LedgerEntry, join
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.jobs import job_rows
from gpuledger.accounting.report.period import parse_period
from gpuledger.accounting.report.reconcile import reconcile
from gpuledger.accounting.report.settings import ReportSettings
from gpuledger.accounting.report.usage import GROUP_BY, usage_report
from gpuledger.schema.records import JobRecord, JobUsage

H = 3600.0
T1 = datetime(2026, 10, 10, tzinfo=UTC).timestamp()
T0 = T1 - H
OCT = parse_period("2026-10")
H200, A100 = "NVIDIA H200", "NVIDIA A100-SXM4-80GB"
PRICES = ReportSettings(price_per_gpu_hour={"default": 1.0, "H200": 4.0, "A100": 1.0})
COLUMNS = ("allocated_gpu_hours", "sm_active_gpu_hours", "energy_kwh", "cost", "slurm_gpu_hours",
           "unmeasured_gpu_hours", "billed_gpu_hours")


def gpu(job: str, host: str, uuid: str, model: str, seconds: float = H) -> JobUsage:
    """A GPU's usage over the job's hour: ``seconds`` observed (more than the hour: clock skew)."""
    return JobUsage(job, host, uuid, T0, T1, 360, seconds, seconds / 2, 360.0 * seconds,
                    sm_active_mean=0.5, model=model)


def ledger(records: list[JobRecord], gpus: list[JobUsage]) -> list[LedgerEntry]:
    """Entries as the store joins them: a job-level record per job (the collector's: one model) and its GPUs."""
    jobs: dict[str, list[JobUsage]] = {}
    for u in gpus:
        jobs.setdefault(u.job_id, []).append(u)
    usages = [JobUsage(j, gs[0].host if len({g.host for g in gs}) == 1 else "*", "*", T0, T1, 360 * len(gs),
                       math.fsum(g.allocated_gpu_seconds for g in gs), math.fsum(g.sm_active_gpu_seconds for g in gs),
                       math.fsum(g.energy_joules for g in gs), model=gs[-1].model, gpus=len(gs))
              for j, gs in jobs.items()]
    return join(records, usages, gpus, now=T1 + H)


def record(job: str, hosts: tuple[str, ...], gpus: int, gres: str | None = None, account: str = "a") -> JobRecord:
    tres = (("gres/gpu", float(gpus)), (f"gres/gpu:{gres}", float(gpus))) if gres else ()
    return JobRecord(job, user="u", account=account, partition="gpu", gpus=gpus, start=T0, end=T1, hosts=hosts,
                     state="COMPLETED", tres=tres)


def reports(entries: list[LedgerEntry], settings: ReportSettings = PRICES) -> dict[str, object]:
    return {by: usage_report(entries, by, OCT, settings, per_gpu={}) for by in GROUP_BY}


def assert_rows_add_up(rep) -> None:
    for col in COLUMNS:
        assert math.fsum(getattr(r, col) for r in rep.rows) == pytest.approx(getattr(rep.total, col)), (rep.by, col)


def test_a_job_on_two_models_costs_the_same_in_every_grouping():
    # an untyped --gpus=2 job: an H200 on n1, an A100 on n2; the collector's job-level record names one model
    entries = ledger([record("7", ("n1", "n2"), 2)], [gpu("7", "n1", "G0", H200), gpu("7", "n2", "G1", A100)])
    for by, rep in reports(entries).items():
        assert rep.total.cost == 5.0, by  # 1 GPU-h x 4 + 1 GPU-h x 1, whatever the grouping
        assert (rep.total.allocated_gpu_hours, rep.total.slurm_gpu_hours, rep.total.unmeasured_gpu_hours) == (
            2.0, 2.0, 0.0), by
        assert_rows_add_up(rep)
    by_model = {r.group: r for r in reports(entries)["model"].rows}
    assert {m: (r.allocated_gpu_hours, r.slurm_gpu_hours, r.cost, r.jobs) for m, r in by_model.items()} == {
        H200: (1.0, 1.0, 4.0, 1), A100: (1.0, 1.0, 1.0, 1)}


def test_the_price_follows_slurms_typed_gres_as_the_fairshare_weight_does():
    # job 1: Slurm's AutoDetect name for the node's H200; job 2: Slurm says h200, the node calls its GPU an A100
    entries = ledger([record("1", ("n1",), 1, "nvidia_h200"), record("2", ("n2",), 1, "h200", account="b")],
                     [gpu("1", "n1", "G0", H200), gpu("2", "n2", "G1", A100)])
    for by, rep in reports(entries).items():
        assert rep.total.cost == 8.0, by  # both at the H200 price
    assert {r.group: r.cost for r in reports(entries)["account"].rows} == {"a": 4.0, "b": 4.0}
    # one rule: the price is what fairshare's model weight would be with the prices as weights
    weights = ChargePolicy(model_weights={"H200": 4.0, "A100": 1.0})
    for e in entries:
        u, alloc = e.gpus[0], allocation(e.record, T1)
        assert bounded_weight(u.model, alloc, PRICES.gpu_hour_price) == weights.measured_weight(u, alloc) == 4.0


def test_allocated_gpu_time_nobody_measured_costs_the_price_of_slurms_model():
    entries = ledger([record("1", ("n1",), 2, "h200"),  # Slurm only: 2 GPU-h of H200
                      # untyped, only n1's H200 measured: n2's GPU-h unmeasured, of a model Slurm does not name
                      record("2", ("n1", "n2"), 2),
                      record("3", ("n3",), 1)],  # Slurm only, untyped
                     [gpu("2", "n1", "G0", H200)])
    reps = reports(entries)
    for by, rep in reps.items():
        # job 1: 2 GPU-h x 4; job 2: 1 measured GPU-h x 4 and 1 unmeasured x the default 1; job 3: 1 x 1
        assert rep.total.cost == 2 * 4.0 + (4.0 + 1.0) + 1.0, by
        assert (rep.total.slurm_gpu_hours, rep.total.unmeasured_gpu_hours) == (5.0, 4.0), by
        assert_rows_add_up(rep)
    nodes = {r.group: (r.cost, r.unmeasured_gpu_hours) for r in reps["node"].rows}
    assert nodes == {"n1": (12.0, 2.0), "n2": (1.0, 1.0), "n3": (1.0, 1.0)}
    assert {r.group: r.cost for r in reps["model"].rows} == {"h200": 8.0, H200: 4.0, "(unknown)": 2.0}
    # without prices nothing is made up
    assert usage_report(entries, "account", OCT).total.cost is None


def test_gres_type_names_a_measured_model_word_for_word():
    assert gres_names("nvidia_h200", H200) and gres_names("h200", H200) and gres_names("H200", "h200")
    assert gres_names("h100", "NVIDIA H100 80GB HBM3") and gres_names("a100-sxm4-80gb", A100)
    assert not gres_names("a10", "NVIDIA A100") and not gres_names("h200", A100) and not gres_names("", H200)


def test_reconcile_pairs_slurm_types_with_measured_models_and_agrees_with_the_jobs():
    entries = ledger([record("1", ("n1",), 1, "nvidia_h200"),  # Slurm's AutoDetect name
                      record("2", ("n2",), 1, "h200", account="b"),  # a node that misnames its GPU
                      record("7", ("n3", "n4"), 2, account="c")],  # untyped, an H200 and an A100
                     [gpu("1", "n1", "G0", H200), gpu("2", "n2", "G1", A100),
                      gpu("7", "n3", "G2", H200), gpu("7", "n4", "G3", A100)])
    rec = reconcile(entries, [], OCT, now=T1 + H)
    rows = {(r.account, r.node, r.model): (r.slurm_gpu_hours, r.observed_gpu_hours, r.unmeasured_gpu_hours)
            for r in rec.rows}
    assert rows == {("a", "n1", H200): (1.0, 1.0, 0.0), ("b", "n2", A100): (1.0, 1.0, 0.0),
                    ("c", "n3", H200): (1.0, 1.0, 0.0), ("c", "n4", A100): (1.0, 1.0, 0.0)}
    assert (rec.total.slurm_gpu_hours, rec.total.observed_gpu_hours, rec.total.unmeasured_gpu_hours) == (
        4.0, 4.0, 0.0)


def test_reconcile_unmeasured_total_is_the_jobs_own():
    # 4 GPUs of h200 over n1, n2: n1 measured 1.5 GPU-h on one GPU (beyond its share per GPU), n2 nothing; a
    # Slurm-only job; an untyped job on two models with one of them short
    entries = ledger([record("1", ("n1", "n2"), 4, "h200"), record("2", ("n5",), 2),
                      record("3", ("n3", "n4"), 2)],
                     [gpu("1", "n1", "G0", H200, 1.5 * H), gpu("3", "n3", "G1", H200),
                      gpu("3", "n4", "G2", A100, 0.5 * H)])
    rec = reconcile(entries, [], OCT, now=T1 + H)
    jobs = job_rows(entries, T1 + H)
    usage = usage_report(entries, "account", OCT, PRICES)
    assert rec.total.unmeasured_gpu_hours == pytest.approx(math.fsum(j.unmeasured_gpu_hours for j in jobs))
    assert rec.total.unmeasured_gpu_hours == pytest.approx(usage.total.unmeasured_gpu_hours) == 2.5 + 2.0 + 0.5
    cells = {(r.node, r.model): (r.slurm_gpu_hours, r.unmeasured_gpu_hours) for r in rec.rows}
    assert cells[("n2", "h200")] == (2.0, 2.0) and cells[("n1", H200)] == (2.0, 0.5)
    assert cells[("n4", A100)] == (1.0, 0.5) and cells[("n3", H200)] == (1.0, 0.0)
    assert cells[("n5", "(unknown)")] == (2.0, 2.0)


def test_cli_on_a_real_store_prices_and_reconciles_every_model(tmp_path):
    import csv
    import io

    import typer
    from typer.testing import CliRunner

    from gpuledger.accounting.report_cli import report_app
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    def samples(host: str, uuid: str, job: str, model: str) -> tuple[GpuSample, ...]:
        return tuple(GpuSample(ts=T0 + 10 * k, host=host, gpu_uuid=uuid, gpu_index=0, model=model, sm_active_ratio=0.5,
                               energy_joules=360.0 * 10 * k, job_ids=(job,)) for k in range(361))

    (tmp_path / "gpuledger.toml").write_text('[report.price_per_gpu_hour]\ndefault = 1.0\n"H200" = 4.0\n"A100" = 1.0\n')
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T1 + 10_000)
    try:
        for host, uuid, job, model in (("n1", "G0", "7", H200), ("n2", "G1", "7", A100), ("n3", "G2", "8", A100)):
            store.ingest(Batch(f"agent-{host}", 0, host, samples(host, uuid, job, model)))
        store.put_jobs([record("7", ("n1", "n2"), 2),  # untyped, an H200 and an A100
                        record("8", ("n3",), 1, "nvidia_h200", account="b"),  # Slurm says H200, the node A100
                        record("9", ("n4",), 1, "h200", account="b")])  # never measured
    finally:
        store.close()
    app = typer.Typer()
    app.add_typer(report_app, name="report")

    def rows(*args: str) -> list[dict[str, str]]:
        r = CliRunner().invoke(app, ["report", *args, "--data-dir", str(tmp_path), "--format", "csv",
                                     "--period", "2026-10"])
        assert r.exit_code == 0, r.output
        return list(csv.DictReader(io.StringIO(r.stdout)))

    for by in GROUP_BY:
        # 7: 4 + 1; 8: 1 GPU-h at the H200 price; 9: 1 unmeasured GPU-h of h200
        assert float(rows("usage", "--by", by)[-1]["cost"]) == 5.0 + 4.0 + 4.0, by
    assert {r["model"]: float(r["cost"]) for r in rows("usage", "--by", "model")} == {
        H200: 4.0, A100: 5.0, "h200": 4.0, "TOTAL": 13.0}
    assert {(r["account"], r["node"], r["model"]): (float(r["slurm_gpu_hours"]), float(r["unmeasured_gpu_hours"]))
            for r in rows("reconcile")} == {
        ("a", "n1", H200): (1.0, 0.0), ("a", "n2", A100): (1.0, 0.0), ("b", "n3", A100): (1.0, 0.0),
        ("b", "n4", "h200"): (1.0, 1.0), ("TOTAL", "", ""): (4.0, 1.0)}


FULL_NAMES = ReportSettings(price_per_gpu_hour={"NVIDIA H200": 3.0, "NVIDIA A100-SXM4-80GB": 1.0})


def test_a_typed_gres_takes_the_weight_and_price_keyed_by_the_model_it_names():
    # weights and prices keyed by the measured model's full name; Slurm says gres/gpu:h200 (gres_names: it names
    # "NVIDIA H200"). Job 1 was measured on its H200; job 2, typed h200, was never measured.
    entries = ledger([record("1", ("n1",), 2, "h200"), record("2", ("n2",), 1, "h200")],
                     [gpu("1", "n1", "G0", H200), gpu("1", "n1", "G1", H200)])
    policy = ChargePolicy(kind="allocated", model_weights={H200: 2.0})
    measured = ChargePolicy(kind="active", model_weights={H200: 2.0})
    one, two = entries
    alloc = allocation(one.record, T1)
    assert policy.charge_job(alloc, one.gpus).total == 2 * H * 2.0  # not 2 GPU-h weighing 1
    assert measured.measured_weight(one.gpus[0], alloc) == 2.0
    assert measured.charge_job(alloc, one.gpus).measured == 2 * H / 2 * 2.0
    assert policy.charge_job(allocation(two.record, T1), two.gpus).total == H * 2.0  # unmeasured: never weight 1
    for by, rep in reports(entries, FULL_NAMES).items():
        assert rep.total.cost == 3 * 3.0, by  # 3 GPU-h of H200, measured or not: none free
        assert_rows_add_up(rep)


def test_unmeasured_gpu_time_is_priced_at_the_nodes_measured_model():
    # job 9 ran on n2 (measured there: an A100); job 8 (untyped, n1 and n2) was measured only on n1; job 7 (untyped)
    # never. Their unmeasured GPU-hours on n2 cost the A100's price, not `default`'s.
    prices = ReportSettings(price_per_gpu_hour={"default": 10.0, "H200": 4.0, "A100": 1.0})
    entries = ledger([record("9", ("n2",), 1), record("8", ("n1", "n2"), 2), record("7", ("n2",), 1)],
                     [gpu("9", "n2", "G9", A100), gpu("8", "n1", "G0", H200)])
    for by, rep in reports(entries, prices).items():
        assert rep.total.cost == 1.0 + (4.0 + 1.0) + 1.0, by
        assert_rows_add_up(rep)
    # a node nothing measured stays at Slurm's model: untyped, `default`
    alone = ledger([record("7", ("n5",), 1)], [])
    assert usage_report(alone, "account", OCT, prices).total.cost == 10.0


def test_a_price_table_without_default_refuses_to_bill_a_model_it_does_not_price():
    # an A100 GPU-hour used to cost 0 without a word; the report now names the model and a job
    entries = ledger([record("1", ("n1",), 1), record("2", ("n2",), 1, "a100", account="b")],
                     [gpu("1", "n1", "G0", H200), gpu("2", "n2", "G1", A100)])
    for by in GROUP_BY:
        with pytest.raises(ReportError, match=rf"no price for GPU model '{A100}' \(job 2\).* no `default`"):
            usage_report(entries, by, OCT, ReportSettings(price_per_gpu_hour={"H200": 3.0}), per_gpu={})
    fine = ReportSettings(price_per_gpu_hour={"H200": 3.0, "default": 0.0})  # free, on purpose
    assert usage_report(entries, "account", OCT, fine).total.cost == 3.0
    # no GPU-hour prices at all: the cost is the energy's, as configured
    energy_only = ReportSettings(price_per_kwh=0.5)
    assert usage_report(entries, "account", OCT, energy_only).total.cost == pytest.approx(2 * 0.36 * 0.5)


def test_the_cost_never_bills_more_gpu_hours_than_slurm_allocated():
    # job 1: its samples run 6 minutes past Slurm's hour (within the scope's slack, or a skewed clock): billed its
    # Slurm hour. Job 2 (2 GPUs over n1, n2): n1 observed 1.5 h, n2 0.5 h: billed its 2 Slurm hours, at the
    # models where they were measured. Job 3: short of its hour, the rest unmeasured: its Slurm hour.
    entries = ledger([record("1", ("n1",), 1, "h200"), record("2", ("n2", "n3"), 2), record("3", ("n4",), 1)],
                     [gpu("1", "n1", "G0", H200, 1.1 * H), gpu("2", "n2", "G1", H200, 1.5 * H),
                      gpu("2", "n3", "G2", A100, 0.5 * H), gpu("3", "n4", "G3", A100, 0.25 * H)])
    for by, rep in reports(entries).items():
        t = rep.total
        assert t.cost == pytest.approx(4.0 + (1.5 * 4.0 + 0.5 * 1.0) + 1.0), by
        assert t.slurm_gpu_hours == 4.0 and t.billed_gpu_hours == pytest.approx(4.0), by
        assert t.allocated_gpu_hours == pytest.approx(1.1 + 2.0 + 0.25), by  # what was measured, as measured
        assert_rows_add_up(rep)
    by_node = {r.group: (r.billed_gpu_hours, r.cost) for r in reports(entries)["node"].rows}
    assert by_node["n1"] == (pytest.approx(1.0), pytest.approx(4.0))
    # a job without a scheduler record is billed as measured
    agent_only = ledger([], [gpu("5", "n1", "G0", H200, 1.1 * H)])
    assert usage_report(agent_only, "account", OCT, PRICES).total.cost == pytest.approx(1.1 * 4.0)


TYPED = (("gres/gpu", 2.0), ("gres/gpu:h200", 1.0), ("gres/gpu:a100", 1.0))


def test_a_typed_job_on_two_models_with_a_node_unmeasured_is_billed_what_slurm_allocated_per_model():
    # Slurm: one h200 and one a100 over n1, n2; n1's H200 was measured all its hour, n2's agent was down. The
    # unmeasured hour is the a100's: 1 H200-h x 4 + 1 A100-h x 1, not 1.5 H200-h.
    rec = JobRecord("4", user="u", account="a", partition="gpu", gpus=2, start=T0, end=T1, hosts=("n1", "n2"),
                    state="COMPLETED", tres=TYPED)
    entries = ledger([rec], [gpu("4", "n1", "G0", H200)])
    for by, rep in reports(entries).items():
        t = rep.total
        assert t.cost == pytest.approx(4.0 + 1.0), by
        assert (t.slurm_gpu_hours, t.unmeasured_gpu_hours, t.billed_gpu_hours) == pytest.approx((2.0, 1.0, 2.0)), by
        assert_rows_add_up(rep)
    by_model = {r.group: (r.slurm_gpu_hours, r.unmeasured_gpu_hours, r.cost) for r in reports(entries)["model"].rows}
    assert by_model == {H200: (1.0, 0.0, 4.0), "a100": (1.0, 1.0, 1.0)}
    # reconcile puts no a100 on n1 (measured as an H200) and no h200 on n2
    rows = {(r.node, r.model): (r.slurm_gpu_hours, r.observed_gpu_hours, r.unmeasured_gpu_hours)
            for r in reconcile(entries, [], OCT, now=T1 + H).rows}
    assert rows == {("n1", H200): (1.0, 1.0, 0.0), ("n2", "a100"): (1.0, 0.0, 1.0)}
    # both measured: the models as measured, no empty rows under Slurm's names beside them
    both = ledger([rec], [gpu("4", "n1", "G0", H200), gpu("4", "n2", "G1", A100)])
    assert {r.group: r.slurm_gpu_hours for r in reports(both)["model"].rows} == {H200: 1.0, A100: 1.0}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=0, max_size=3),
                          st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=0, max_size=3)),
                min_size=1, max_size=4))
def test_typed_jobs_are_billed_exactly_their_allocation_per_model_whatever_was_measured(jobs):
    # each job: some h200 GPUs on n1 and some a100 GPUs on n2 for an hour, each measured for a fraction of it
    # (None: not at all). Whatever was measured, each model's allocation is billed at its price, once.
    records, gpus, expected = [], [], 0.0
    for i, (h200, a100) in enumerate(jobs):
        n = len(h200) + len(a100)
        tres = (("gres/gpu", float(n)), *((("gres/gpu:h200", float(len(h200))),) if h200 else ()),
                *((("gres/gpu:a100", float(len(a100))),) if a100 else ()))
        hosts = (("n1",) if h200 else ()) + (("n2",) if a100 else ())
        records.append(JobRecord(str(i), user="u", account="a", partition="gpu", gpus=n, start=T0, end=T1,
                                 hosts=hosts, state="COMPLETED", tres=tres))
        for host, model, part in (("n1", H200, h200), ("n2", A100, a100)):
            gpus += [gpu(str(i), host, f"G{i}{host}{k}", model, f * H) for k, f in enumerate(part) if f]
        expected += 4.0 * len(h200) + 1.0 * len(a100)
    entries = ledger(records, gpus)
    for by, rep in reports(entries).items():
        assert rep.total.cost == pytest.approx(expected, abs=1e-9), by
        assert_rows_add_up(rep)
    # per model, Slurm's allocation and its unmeasured part as Slurm gave them (reconcile names a type by the
    # model measured, else by Slurm's name)
    slurm: dict[str, float] = {}
    unmeasured: dict[str, float] = {}
    for r in reconcile(entries, [], OCT, now=T1 + H).rows:
        kind = "h200" if r.model in (H200, "h200") else "a100"
        slurm[kind] = slurm.get(kind, 0.0) + r.slurm_gpu_hours
        unmeasured[kind] = unmeasured.get(kind, 0.0) + r.unmeasured_gpu_hours
    for kind, part in (("h200", 0), ("a100", 1)):
        allocated = sum(len(j[part]) for j in jobs)
        seen = math.fsum(f for j in jobs for f in j[part] if f)
        assert slurm.get(kind, 0.0) == pytest.approx(allocated, abs=1e-9), kind
        assert unmeasured.get(kind, 0.0) == pytest.approx(allocated - seen, abs=1e-9), kind
