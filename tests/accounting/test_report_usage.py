"""Usage reports over a period: hand-computed totals, exact reconciliation, the period rule, settings."""

from __future__ import annotations

import math
import re
import tomllib
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.accounting.ledger import LedgerEntry, join
from gpuledger.accounting.ledger import load as load_ledger
from gpuledger.accounting.privacy import pseudonymize_entries
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.grid import GridIntensity
from gpuledger.accounting.report.idle import idle_jobs
from gpuledger.accounting.report.period import SETTLE_S, in_period, not_ended_note, parse_period
from gpuledger.accounting.report.reconcile import reconcile
from gpuledger.accounting.report.settings import ReportSettings, report_settings
from gpuledger.accounting.report.usage import TOTAL, usage_report, usage_report_csv, usage_report_text
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage


def T(y: int, m: int, d: int, hh: int = 0, mm: int = 0, ss: int = 0) -> float:
    return datetime(y, m, d, hh, mm, ss, tzinfo=UTC).timestamp()


def U(job, alloc, active, energy, dram=None, model="NVIDIA H200", first=None, last=None, host="n1", gpu="*", gpus=1):
    last = T(2026, 10, 10) if last is None else last
    first = last - alloc / gpus if first is None else first
    sm = active / alloc if alloc > 0 else None
    return JobUsage(job, host, gpu, first, last, 10, alloc, active, energy, sm_active_mean=sm, dram_bw_mean=dram,
                    model=model, gpus=gpus)


OCT = parse_period("2026-10")
PRICES = ReportSettings(currency="EUR", price_per_kwh=0.2, price_per_gpu_hour={"H200": 3.0, "default": 1.0},
                        co2e_kg_per_kwh=0.4)


def fixture() -> list[LedgerEntry]:
    records = [
        JobRecord("1", user="alice", account="a", partition="gpu", gpus=1, submit=T(2026, 10, 9, 21, 50),
                  start=T(2026, 10, 9, 22), end=T(2026, 10, 10)),
        JobRecord("2", user="bob", account="a", partition="gpu", gpus=1, submit=T(2026, 10, 20, 0, 30),
                  start=T(2026, 10, 20, 1), end=T(2026, 10, 20, 2)),
        JobRecord("3", user="carol", account="b", partition="big", gpus=2, start=T(2026, 10, 31, 22),
                  end=T(2026, 11, 1, 0, 10)),
        JobRecord("4", user="carol", account="b", partition="big", gpus=1, submit=T(2026, 10, 5), start=T(2026, 10, 5),
                  end=T(2026, 10, 5, 1)),
    ]
    usages = [
        U("1", 7200.0, 3600.0, 3.6e6, dram=0.5, last=T(2026, 10, 10)),
        U("2", 3600.0, 0.0, 1.8e6, model="NVIDIA A100", last=T(2026, 10, 20, 2)),
        U("3", 8400.0, 8000.0, 9e6, last=T(2026, 11, 1, 0, 10), gpus=2),
        U("5", 1800.0, 900.0, 0.9e6, dram=0.25, last=T(2026, 10, 15)),  # measured, unknown to Slurm
    ]
    return join(records, usages)


def test_report_by_account_matches_hand_computed_values():
    rep = usage_report(fixture(), "account", OCT, PRICES)
    rows = {r.group: r for r in rep.rows}
    assert set(rows) == {"a", "b", "(unknown)"}  # job 3 ended in November: not here
    a = rows["a"]
    assert a.jobs == 2
    assert a.allocated_gpu_hours == 3.0 and a.sm_active_gpu_hours == 1.0 and a.idle_gpu_hours == 2.0
    assert a.efficiency == pytest.approx(1 / 3)
    assert a.hbm_mean == 0.5  # only job 1 reports HBM: weighted by its GPU-time alone
    assert a.energy_kwh == 1.5 and a.co2e_kg == pytest.approx(0.6)
    # job 1: 2 GPU-h x 3.0 (H200) + 1 kWh x 0.2; job 2: 1 GPU-h x 1.0 (default) + 0.5 kWh x 0.2
    assert a.cost == pytest.approx(6.2 + 1.1)
    assert a.queue_wait_mean_h == pytest.approx((600 + 1800) / 2 / 3600) and a.queue_wait_jobs == 2
    b = rows["b"]  # job 4: known to Slurm, never measured
    assert (b.jobs, b.unmeasured_jobs, b.allocated_gpu_hours, b.queue_wait_mean_h) == (1, 1, 0.0, 0.0)
    assert b.efficiency is None and b.hbm_mean is None
    t = rep.total
    assert t.group == TOTAL and t.jobs == 4 and t.allocated_gpu_hours == 3.5 and t.energy_kwh == 1.75
    assert t.hbm_mean == pytest.approx((0.5 * 7200 + 0.25 * 1800) / 9000)


def test_report_by_user_partition_model():
    by_user = {r.group: r.jobs for r in usage_report(fixture(), "user", OCT).rows}
    assert by_user == {"alice": 1, "bob": 1, "carol": 1, "(unknown)": 1}
    by_part = {r.group: r.allocated_gpu_hours for r in usage_report(fixture(), "partition", OCT).rows}
    assert by_part == {"gpu": 3.0, "big": 0.0, "(unknown)": 0.5}
    by_model = {r.group: r.allocated_gpu_hours for r in usage_report(fixture(), "model", OCT).rows}
    assert by_model == {"NVIDIA H200": 2.5, "NVIDIA A100": 1.0, "(unknown)": 0.0}
    rep = usage_report(fixture(), "account", OCT)
    assert rep.total.cost is None and rep.total.co2e_kg is None  # nothing configured: no made-up zeros


def test_period_counts_a_job_whole_in_the_period_it_ended():
    nov = usage_report(fixture(), "account", parse_period("2026-11"), PRICES)
    assert nov.total.jobs == 1 and nov.total.allocated_gpu_hours == 8400 / 3600  # job 3, not prorated
    e_end = [LedgerEntry("9", JobRecord("9", account="x", end=T(2026, 11, 1)), U("9", 3600.0, 0.0, 0.0))]
    assert usage_report(e_end, "account", OCT).total.jobs == 0  # the period's end is exclusive
    assert usage_report(e_end, "account", parse_period(start="2026-10-01", end="2026-11-01T00:00:01")).total.jobs == 1
    # consecutive periods partition the jobs: October + November = everything
    everything = usage_report(fixture(), "account")
    assert everything.total.jobs == usage_report(fixture(), "account", OCT).total.jobs + nov.total.jobs


def test_a_running_job_counts_in_no_closed_period_and_once_in_the_period_it_ends():
    # job 500 started 2026-11-20 and runs into December; its node's agent died after the first hour, so its last
    # measurement lies in November. A November report must not bill it, nor December's again once it ended.
    start, dec2 = T(2026, 11, 20), T(2026, 12, 2)
    nov, dec = parse_period("2026-11"), parse_period("2026-12")
    usage = U("500", 3600.0, 1800.0, 0.0, first=start, last=start + 3600)
    running = join([JobRecord("500", account="a", gpus=1, start=start, state="RUNNING")], [usage], now=dec2)
    assert usage_report(running, "account", nov, PRICES, now=dec2).total.jobs == 0  # November is over
    assert reconcile(running, [], nov, now=dec2).total.jobs == 0 and in_period(running, nov, dec2) == []
    assert "1 job(s) that started before the period's end have no end" in (not_ended_note(running, nov, dec2) or "")
    # December is not over: the job counts there with its allocation so far, and says so
    so_far = usage_report(running, "account", dec, PRICES, now=dec2).total
    assert so_far.jobs == 1 and so_far.slurm_gpu_hours == pytest.approx((dec2 - start) / 3600)
    assert "counted with their allocation up to now" in (not_ended_note(running, dec, dec2) or "")
    # once it has ended: in December alone, whenever the closed months' reports are made
    ended = join([JobRecord("500", account="a", gpus=1, start=start, end=T(2026, 12, 1, 12), state="COMPLETED")],
                 [usage])
    for now in (T(2026, 12, 1, 13), T(2027, 3, 1)):
        assert [usage_report(ended, "account", p, PRICES, now=now).total.jobs for p in (nov, dec)] == [0, 1]
    # a job Slurm does not know still counts at its last measurement
    assert usage_report(join([], [usage]), "account", nov, PRICES, now=dec2).total.jobs == 1
    # recorded while pending (no start), measured since: running, so only in the open period, never in none
    pending = join([JobRecord("500", account="a", gpus=1, state="PENDING")], [usage], now=dec2)
    assert [usage_report(pending, "account", p, PRICES, now=dec2).total.jobs for p in (nov, dec)] == [0, 1]
    never_ran = join([JobRecord("500", account="a", gpus=1, state="PENDING")], [], now=dec2)
    assert [usage_report(never_ran, "account", p, PRICES, now=dec2).total.jobs for p in (nov, dec)] == [0, 0]


def test_a_report_just_after_its_period_notes_the_jobs_only_agents_measured_near_its_end():
    # jobs Slurm has no record of count at their last measurement: job 601's lies 5 min before November's end, so
    # it may still run (its agent's later samples not in yet) while the report is made within SETTLE_S of the end
    nov, end = parse_period("2026-11"), T(2026, 12, 1)
    entries = join([JobRecord("500", account="a", gpus=1, start=end - 7200, end=end - 60, state="COMPLETED")],
                   [U("500", 3600.0, 0.0, 0.0, last=end - 60), U("601", 600.0, 0.0, 0.0, last=end - 300),
                    U("602", 600.0, 0.0, 0.0, last=end - SETTLE_S - 1), U("603", 600.0, 0.0, 0.0, last=end - SETTLE_S)])
    assert SETTLE_S == 900.0  # the collector's late window (600 s) and an agent's push cadence (5 min)
    for now in (end, end + 60, end + SETTLE_S - 1):
        note = not_ended_note(entries, nov, now) or ""
        assert note.startswith("2 job(s) Slurm has no record of were last measured within 15 min of the period's "
                               "end"), note  # 601 and 603, not 602 (earlier) nor 500 (Slurm's end)
        assert "(their ends are not final until 2026-12-01T00:15:00+00:00)" in note
        assert usage_report(entries, "account", nov, PRICES, now=now).total.jobs == 4  # the rule stays
    for now in (end - 1, end + SETTLE_S):  # not over yet, or settled
        assert not_ended_note(entries, nov, now) is None
    running = join([JobRecord("700", account="a", gpus=1, start=end - 60, state="RUNNING")], [], now=end + 60)
    assert (not_ended_note(running + entries, nov, end + 60) or "").startswith(
        "1 job(s) that started before the period's end have no end in Slurm's records (running, or not imported "
        "since they ended) and are not counted: each counts whole in the period it ends; 2 job(s) Slurm has no "
        "record of")


def test_parse_period_errors_name_the_input():
    assert parse_period("2026-12").end == T(2027, 1, 1)
    assert parse_period("2026-02-28").end == T(2026, 3, 1)
    with pytest.raises(ReportError, match="period '2026-13'"):
        parse_period("2026-13")
    with pytest.raises(ReportError, match="--from 'yesterday'"):
        parse_period(start="yesterday")
    with pytest.raises(ReportError, match="not both"):
        parse_period("2026-10", start="2026-10-01")



@pytest.mark.parametrize("text, start, end", [
    ("2026-11", T(2026, 11, 1), T(2026, 12, 1)),
    ("2026-11-03..2026-11-05", T(2026, 11, 3), T(2026, 11, 6)),  # both days included
    ("2026-11-05..2026-11-05", T(2026, 11, 5), T(2026, 11, 6)),
    ("last-30d", T(2026, 11, 30) - 30 * 86400, T(2026, 11, 30)),
    ("2026", T(2026, 1, 1), T(2027, 1, 1)),
])
def test_period_forms(text, start, end):
    p = parse_period(text, now=T(2026, 11, 30))
    assert (p.start, p.end, p.label) == (start, end, text)


@pytest.mark.parametrize("text", ["26-11", "2026-1", "2026-11-5", "202611", "2026-11-31", "1969-12",
                                  "2026-11-05..2026-11-03", "2026-11..2026-12", "last-0d", "last-30", "last-d",
                                  "", "2026-11-01..", "nov"])
def test_bad_periods_are_refused_naming_them(text):
    with pytest.raises(ReportError, match="period ") as e:
        parse_period(text, now=T(2026, 11, 30))
    assert repr(text) in str(e.value) and "\n" not in str(e.value)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 1e7), st.floats(0, 1), st.floats(0, 1e9)),
                min_size=1, max_size=40))
def test_totals_reconcile_exactly_with_the_job_records(jobs):
    entries = []
    for i, (acct, alloc, eff, energy) in enumerate(jobs):
        u = U(str(i), alloc, alloc * eff, energy)
        entries.append(LedgerEntry(str(i), JobRecord(str(i), account=acct, end=u.last_ts), u))
    for by in ("account", "user", "model"):
        t = usage_report(entries, by).total
        assert t.allocated_gpu_hours == math.fsum(e.usage.allocated_gpu_seconds for e in entries) / 3600
        assert t.sm_active_gpu_hours == math.fsum(e.usage.sm_active_gpu_seconds for e in entries) / 3600
        assert t.energy_kwh == math.fsum(e.usage.energy_joules for e in entries) / 3.6e6
        assert t.jobs == len(entries)


def _sample(ts, gpu, job, sm, energy, host="n1", dram=None):
    return GpuSample(ts=ts, host=host, gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200",
                     sm_active_ratio=sm, dram_bw_ratio=dram, energy_joules=energy, job_ids=(job,) if job else ())


def test_report_from_a_real_store_reconciles_by_node(tmp_path):
    t0 = T(2026, 10, 3)
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: t0 + 10_000)
    try:
        # job 11 on n1 (2 GPUs, 100 s each) and n2 (1 GPU); job 12 on n2; 10 s steps, 300 J per step.
        seq = 0
        for host, gpus in (("n1", [("G0", "11", 0.5), ("G1", "11", 1.0)]),
                           ("n2", [("G2", "11", 0.0), ("G3", "12", 0.25)])):
            samples = [_sample(t0 + 10 * k, g, job, sm, 300.0 * k, host=host, dram=0.4)
                       for g, job, sm in gpus for k in range(11)]
            store.ingest(Batch(f"agent-{host}", seq, host, tuple(samples)))
            seq += 1
        store.put_jobs([JobRecord("11", cluster="c", user="alice", account="a", end=t0 + 100),
                        JobRecord("12", cluster="c", user="bob", account="b", end=t0 + 100)])
        entries = load_ledger(store)
        per_gpu: dict[str, list[JobUsage]] = {}
        for u in store.job_usage(per_gpu=True):
            per_gpu.setdefault(u.job_id, []).append(u)
        job_level = store.job_usage()
    finally:
        store.close()
    rep = usage_report(entries, "node", OCT, per_gpu=per_gpu)
    nodes = {r.group: r for r in rep.rows}
    assert set(nodes) == {"n1", "n2"}
    assert nodes["n1"].allocated_gpu_hours == 200 / 3600 and nodes["n1"].sm_active_gpu_hours == 150 / 3600
    assert nodes["n2"].jobs == 2 and nodes["n1"].jobs == 1 and rep.total.jobs == 2  # job 11 in both nodes
    assert nodes["n2"].energy_kwh == 6000 / 3.6e6
    assert rep.total.allocated_gpu_hours == math.fsum(u.allocated_gpu_seconds for u in job_level) / 3600 == 400 / 3600
    assert rep.total.energy_kwh == math.fsum(u.energy_joules for u in job_level) / 3.6e6
    by_acct = usage_report(entries, "account", OCT)
    assert by_acct.total.allocated_gpu_hours == rep.total.allocated_gpu_hours
    with pytest.raises(ReportError, match="per-GPU"):
        usage_report(entries, "node", OCT)


def test_grid_intensity_series_weights_emissions_by_time(tmp_path):
    t0 = T(2026, 10, 10)
    csv_text = f"time,g_co2e_per_kwh\n{t0},100\n2026-10-10T01:00:00Z,300\n"
    grid = GridIntensity.from_csv(csv_text)
    assert grid.mean(t0, t0 + 7200) == 200.0 and grid.mean(t0 - 3600, t0) == 100.0  # clamped before the series
    e = [LedgerEntry("1", JobRecord("1", account="a", end=t0 + 7200), U("1", 7200.0, 0.0, 7.2e6, first=t0,
                                                                        last=t0 + 7200))]
    assert usage_report(e, "account", settings=ReportSettings(grid=grid)).total.co2e_kg == pytest.approx(0.4)
    with pytest.raises(ReportError, match="line 3: intensity 'x'"):
        GridIntensity.from_csv(f"time,g\n{t0},1\n{t0 + 1},x\n")
    (tmp_path / "grid.csv").write_text(csv_text)
    s = report_settings({"report": {"grid_intensity_csv": "grid.csv", "price_per_gpu_hour": {"H200": 2}}}, tmp_path)
    # no `default`: an A100 has no price (a report meeting one is refused), not a price of 0
    assert s.grid == grid and s.gpu_hour_price("NVIDIA H200") == 2.0 and s.gpu_hour_price("A100") is None
    with pytest.raises(ReportError, match=r"cfg.toml: report.price_per_kwh: expected a finite number >= 0"):
        report_settings({"report": {"price_per_kwh": "cheap"}}, tmp_path, "cfg.toml")
    # an infinite price or emission factor was taken, and every cost or CO2e figure read inf
    for key, value in (("price_per_kwh", math.inf), ("co2e_kg_per_kwh", math.inf), ("retention_days", math.nan),
                       ("price_per_gpu_hour", {"H200": math.inf})):
        with pytest.raises(ReportError, match=rf"report\.{key}(\.H200)?: expected a finite number >= 0, got"):
            report_settings({"report": {key: value}}, tmp_path)
    with pytest.raises(ReportError, match=r"report.idle_threshold: expected a finite number in \[0, 1\], got inf"):
        report_settings({"report": {"idle_threshold": math.inf}}, tmp_path)
    with pytest.raises(ReportError, match="report.colour: unknown setting"):
        report_settings({"report": {"colour": 1}}, tmp_path)


def test_idle_jobs_worst_first_per_gpu():
    entries = join(
        [JobRecord("1", user="u1", account="a"), JobRecord("2", user="u2", account="a"),
         JobRecord("3", user="u3", account="a")],
        [U("1", 3600.0 * 4, 3600.0, 0.0, gpus=4), U("2", 3600.0, 36.0, 0.0), U("3", 7200.0, 7000.0, 0.0)],
    )
    per_gpu = {"1": [U("1", 3600.0, 3600.0, 0.0, gpu="G0")]
               + [U("1", 3600.0, 0.0, 0.0, gpu=f"G{i}") for i in (1, 2, 3)]}
    rows = idle_jobs(entries, per_gpu, threshold=0.05)
    assert [(r.job_id, r.idle_gpus, r.idle_gpu_hours) for r in rows] == [("1", 3, 3.0), ("2", 1, 1.0)]
    assert rows[0].idle_share == 0.75


def test_pseudonymize_entries_hides_users_in_every_row():
    alias = lambda u: "u-" + u[::-1]  # noqa: E731 - any function of the name
    rep = usage_report(pseudonymize_entries(fixture(), alias), "user", OCT)
    assert {r.group for r in rep.rows} == {"u-ecila", "u-bob", "u-lorac", "(unknown)"}
    assert "alice" not in usage_report_csv(rep)


@pytest.mark.parametrize("text", ["1e15", "-1e15", "1e400", "nan", "inf", "253402300800", "-62135596801",
                                  "9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"])
def test_times_outside_the_calendar_are_refused_when_parsed(text):
    # they used to pass and fail later, printing the period (year ... is out of range) after the report
    for flag, kw in (("--from", {"start": text}), ("--to", {"end": text})):
        with pytest.raises(ReportError, match=f"^{flag} {re.escape(repr(text))}: "):
            parse_period(**kw)
    assert parse_period(start="-62135596800", end="253402300799").to_dict()["end_iso"].startswith("9999-12-31")


def test_gpu_hour_price_is_the_most_specific_pattern_whatever_the_key_order():
    a = report_settings(tomllib.loads('[report.price_per_gpu_hour]\n"H100" = 2.5\n"H100 NVL" = 3.0\ndefault = 1\n'))
    b = report_settings(tomllib.loads('[report.price_per_gpu_hour]\ndefault = 1\n"H100 NVL" = 3.0\n"H100" = 2.5\n'))
    for s in (a, b):
        assert s.gpu_hour_price("NVIDIA H100 NVL") == 3.0  # the longest pattern it contains
        assert s.gpu_hour_price("NVIDIA H100 80GB HBM3") == 2.5 and s.gpu_hour_price("H100") == 2.5
        assert s.gpu_hour_price("NVIDIA A100") == 1.0  # nothing matches: default
    ties = ReportSettings(price_per_gpu_hour={"b": 2.0, "a": 1.0})
    assert ties.gpu_hour_price("ab") == ReportSettings(price_per_gpu_hour={"a": 1.0, "b": 2.0}).gpu_hour_price("ab")
    assert ReportSettings(price_per_gpu_hour={"h100": 2.0}).gpu_hour_price("NVIDIA H100") == 2.0  # any case
    assert ReportSettings().gpu_hour_price("NVIDIA H100") == 0.0


FLOAT_COLUMNS = ("allocated_gpu_hours", "sm_active_gpu_hours", "energy_kwh", "idle_gpu_hours", "slurm_gpu_hours",
                 "unmeasured_gpu_hours")


def _node_fixture() -> tuple[list[LedgerEntry], dict[str, list[JobUsage]]]:
    h = 3600.0
    t1 = T(2026, 10, 10)
    t0 = t1 - h

    def rec(job, hosts, gpus):
        return JobRecord(job, account="a", hosts=hosts, gpus=gpus, start=t0, end=t1)

    per_gpu = {
        # 7: Slurm says 2 GPUs on n1+n2; only n1's agent measured (its GPU, all hour long)
        "7": [U("7", h, h / 2, 0.0, host="n1", gpu="G0", last=t1)],
        # 10: 3 GPUs as 2 + 1 over n1, n2, every one measured: nothing unmeasured, the allocation follows the GPUs
        "10": [U("10", h, 0.0, 0.0, host="n1", gpu=g, last=t1) for g in ("G1", "G2")]
        + [U("10", h, 0.0, 0.0, host="n2", gpu="G3", last=t1)],
        # 11: 2 GPUs on n1+n2, n1 measured 1.5 GPU-h (clock skew), n2 half an hour: the job misses 0 GPU-h
        "11": [U("11", 1.5 * h, 0.0, 0.0, host="n1", gpu="G4", last=t1),
               U("11", 0.5 * h, 0.0, 0.0, host="n2", gpu="G5", last=t1)],
    }
    usages = [U(j, math.fsum(g.allocated_gpu_seconds for g in gs), math.fsum(g.sm_active_gpu_seconds for g in gs),
                0.0, host=gs[0].host, last=t1, gpus=len(gs)) for j, gs in per_gpu.items()]
    records = [rec("7", ("n1", "n2"), 2), rec("10", ("n1", "n2"), 3), rec("11", ("n1", "n2"), 2),
               rec("8", ("n3",), 1),  # never measured: a node nobody measured still has its row
               rec("9", ("n3", "n4"), 2),  # never measured, two nodes
               rec("12", (), 1)]  # never measured, no node named
    return join(records, usages), per_gpu


def test_by_node_every_column_adds_up_to_the_totals_row():
    entries, per_gpu = _node_fixture()
    rep = usage_report(entries, "node", OCT, per_gpu=per_gpu)
    rows = {r.group: r for r in rep.rows}
    assert set(rows) == {"n1", "n2", "n3", "n4", "(unknown)"}
    for col in FLOAT_COLUMNS:
        assert math.fsum(getattr(r, col) for r in rep.rows) == pytest.approx(getattr(rep.total, col)), col
    t = rep.total
    assert (t.jobs, t.unmeasured_jobs, t.slurm_gpu_hours, t.unmeasured_gpu_hours) == (6, 3, 11.0, 5.0)
    # the same totals as any other grouping: a job's Slurm figures are split, never made up
    by_account = usage_report(entries, "account", OCT).total
    for col in FLOAT_COLUMNS:
        assert getattr(t, col) == pytest.approx(getattr(by_account, col)), col
    # job 7 allocated 1 GPU-h on n2 that nobody measured; job 10 is 2 + 1 GPU-h; job 9 is 1 + 1
    assert (rows["n1"].slurm_gpu_hours, rows["n1"].unmeasured_gpu_hours) == (4.0, 0.0)
    assert (rows["n2"].slurm_gpu_hours, rows["n2"].unmeasured_gpu_hours) == (3.0, 1.0)
    assert (rows["n3"].jobs, rows["n3"].unmeasured_jobs, rows["n3"].slurm_gpu_hours) == (2, 2, 2.0)
    assert (rows["n4"].slurm_gpu_hours, rows["n4"].unmeasured_gpu_hours, rows["n4"].allocated_gpu_hours) == (
        1.0, 1.0, 0.0)
    assert (rows["(unknown)"].jobs, rows["(unknown)"].slurm_gpu_hours) == (1, 1.0)
    assert rows["n2"].jobs == 3 and rows["n1"].jobs == 3  # job 7 counts on n2, where Slurm put it


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(["n1", "n2", "n3"]), max_size=3, unique=True),
                          st.integers(0, 4), st.lists(st.tuples(st.sampled_from(["n1", "n2", "n4"]),
                                                                st.floats(0, 3600)), max_size=4)),
                min_size=1, max_size=12))
def test_by_node_rows_add_up_whatever_was_measured_where(jobs):
    t1 = T(2026, 10, 10)
    records, usages, per_gpu = [], [], {}
    for i, (hosts, gpus, measured) in enumerate(jobs):
        job = str(i)
        records.append(JobRecord(job, account="a", hosts=tuple(hosts), gpus=gpus, start=t1 - 3600, end=t1))
        if measured:
            per_gpu[job] = [U(job, s, s / 2, s, host=h, gpu=f"G{k}", last=t1) for k, (h, s) in enumerate(measured)]
            usages.append(U(job, math.fsum(s for _, s in measured), math.fsum(s / 2 for _, s in measured),
                            math.fsum(s for _, s in measured), host=measured[0][0], last=t1, gpus=len(measured)))
    entries = join(records, usages)
    rep = usage_report(entries, "node", OCT, per_gpu=per_gpu)
    by_account = usage_report(entries, "account", OCT).total
    for col in FLOAT_COLUMNS:
        total = getattr(rep.total, col)
        assert math.fsum(getattr(r, col) for r in rep.rows) == pytest.approx(total, rel=1e-12, abs=1e-9), col
        assert total == pytest.approx(getattr(by_account, col), rel=1e-12, abs=1e-9), col


def test_tables_for_people_escape_control_characters_and_count_display_width():
    records = [JobRecord(str(i), user=u, account="a", end=T(2026, 10, 10))
               for i, u in enumerate(["line\nbreak", "zoë-用户", "tab\there", "plain"])]
    entries = join(records, [U(str(i), 3600.0, 0.0, 0.0) for i in range(4)])
    rep = usage_report(entries, "user", OCT)
    text = usage_report_text(rep)
    lines = text.splitlines()[2:]
    assert len(lines) == 6  # header, four users, TOTAL: no row split by a line break
    assert any(line.startswith("line\\nbreak ") for line in lines) and any("tab\\there" in line for line in lines)
    # every row's second column starts at the same terminal column ("用户" takes four)
    starts = {_columns(line[: line.index("  1 " if "  1 " in line else "  Jobs")]) for line in lines[:-1]}
    assert len(starts) == 1, lines
    assert {r.group for r in rep.rows} >= {"line\nbreak", "zoë-用户"}  # the data keeps the exact names
    assert "line\nbreak" in usage_report_csv(rep)


def _columns(text: str) -> int:
    """Terminal columns of a line, computed here rather than by the code under test: CJK takes two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)
