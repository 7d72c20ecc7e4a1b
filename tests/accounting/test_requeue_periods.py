"""A requeued job in the period reports: each run counts in the period it ended (``report.period.run_ends``), with
its own measured usage, allocation, unmeasured time and prices, so a requeue never changes the report of a closed
period, and ``report reconcile`` holds each run's allocation against what was measured in it, on its own hosts."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from gpuledger.accounting.html import render_html
from gpuledger.accounting.ledger import join, load
from gpuledger.accounting.report.period import ALL_TIME, in_period, not_ended_note, parse_period
from gpuledger.accounting.report.reconcile import reconcile
from gpuledger.accounting.report.settings import ReportSettings
from gpuledger.accounting.report.usage import UsageReport, UsageRow, usage_report
from gpuledger.accounting.scope import in_scope
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage


def T(y: int, m: int, d: int, hh: int = 0, mm: int = 0) -> float:
    return datetime(y, m, d, hh, mm, tzinfo=UTC).timestamp()


NOV, DEC = parse_period("2026-11"), parse_period("2026-12")
PRICES = ReportSettings(currency="EUR", price_per_kwh=0.2, price_per_gpu_hour={"H100": 3.0, "default": 1.0})
H = 3600.0
# job 500: its first run on n1 ends in November; requeued (node failure), it runs again on n2 in December
R1, R2 = T(2026, 11, 30, 22), T(2026, 12, 1, 1)
RUN1 = JobRecord("500", cluster="c", user="bob", account="B", partition="gpu", hosts=("n1",), gpus=1,
                 submit=R1 - 600, start=R1, end=R1 + H, state="REQUEUED")
RUN2 = replace(RUN1, hosts=("n2",), submit=R1 + H, start=R2, end=R2 + H, state="COMPLETED", exit_code=0)


def samples(host: str, start: float, n: int = 361) -> tuple[GpuSample, ...]:
    """Job 500 on one H100 of ``host`` at 700 W, half busy, a sample every 10 s from ``start``."""
    return tuple(GpuSample(ts=start + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, sm_active_ratio=0.5,
                           power_watts=700.0, energy_joules=7000.0 * k, job_ids=("500",), model="NVIDIA H100")
                 for k in range(n))


def reports(store: Store, now: float) -> dict[str, object]:
    """Every report of November, December and all time as of ``now``."""
    gpus = load(store, now=now)
    per_gpu: dict[str, list[JobUsage]] = {}
    for u in store.job_usage(per_gpu=True):
        per_gpu.setdefault(u.job_id, []).append(u)
    out: dict[str, object] = {}
    for name, per in (("nov", NOV), ("dec", DEC), ("all", ALL_TIME)):
        lo, hi = (per.start, per.end) if per is not ALL_TIME else (None, None)
        for by in ("account", "node", "model"):
            out[f"{name}-{by}"] = usage_report(gpus, by, per, PRICES, per_gpu, now)
        out[f"{name}-reconcile"] = reconcile(gpus, store.gpu_hours(lo, hi), per, now,
                                             gpu_energy=store.gpu_energy(lo, hi))
    return out


def without_waits(rep: UsageReport) -> list[UsageRow]:
    # the queue wait is the latest run's: Slurm's record keeps no earlier run's submission (JobRecord.earlier_runs)
    return [replace(r, queue_wait_mean_h=None, queue_wait_jobs=0) for r in [*rep.rows, rep.total]]


def test_a_closed_periods_report_is_the_same_after_the_job_is_requeued(tmp_path):
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T(2026, 12, 5))
    try:
        store.ingest(Batch("a1", 1, "n1", samples("n1", R1), cluster="c"))
        store.put_jobs([RUN1])  # its first run ended, requeued: the record sacct -D gave then
        before = reports(store, T(2026, 12, 1, 0, 30))
        store.ingest(Batch("a2", 1, "n2", samples("n2", R2), cluster="c"))
        store.put_jobs([RUN2])  # the second run, imported when it ended
        (entry,) = load(store, now=T(2026, 12, 5))
        after = reports(store, T(2026, 12, 5))
        rows = store.job_usage(per_gpu=True)
    finally:
        store.close()
    assert entry.record is not None and entry.record.earlier_runs == ((R1, R1 + H, ("n1",)),)
    measured = {u.host: u for u in rows}
    for by in ("account", "node", "model"):  # November as it was; December the second run alone
        assert without_waits(after[f"nov-{by}"]) == without_waits(before[f"nov-{by}"]), by
    nov, dec = after["nov-account"].total, after["dec-account"].total
    assert nov.jobs == dec.jobs == 1 and nov.slurm_gpu_hours == dec.slurm_gpu_hours == 1.0
    assert nov.allocated_gpu_hours == measured["n1"].allocated_gpu_seconds / H
    assert dec.allocated_gpu_hours == measured["n2"].allocated_gpu_seconds / H
    assert nov.cost == pytest.approx(3.0 + measured["n1"].energy_joules / 3.6e6 * 0.2)
    assert before["nov-account"].total.queue_wait_jobs == 1 and nov.queue_wait_jobs == 0
    assert dec.queue_wait_mean_h == pytest.approx((R2 - RUN2.submit) / H)  # type: ignore[operator]
    # the runs partition: November + December = all time, the job counted once in each of them
    whole = after["all-account"].total
    assert whole.jobs == 1
    for column in ("allocated_gpu_hours", "sm_active_gpu_hours", "energy_kwh", "cost", "slurm_gpu_hours",
                   "billed_gpu_hours", "unmeasured_gpu_hours"):
        assert getattr(nov, column) + getattr(dec, column) == pytest.approx(getattr(whole, column)), column
    # reconcile: November's rows as they were, each run's allocation on its own node against what it measured
    rec_nov, rec_dec = after["nov-reconcile"], after["dec-reconcile"]
    assert rec_nov.rows == before["nov-reconcile"].rows
    for rec, host in ((rec_nov, "n1"), (rec_dec, "n2")):
        (row,) = [r for r in rec.rows if r.account == "B"]
        assert (row.node, row.jobs, row.slurm_gpu_hours) == (host, 1, 1.0)
        assert row.observed_gpu_hours == measured[host].allocated_gpu_seconds / H
        assert row.unmeasured_gpu_hours == pytest.approx(1.0 - row.observed_gpu_hours)
        assert not any("disagree" in n for n in rec.notes), rec.notes  # observed ... = the collector's hours


def test_each_run_is_allocated_on_its_own_hosts(tmp_path):
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T(2026, 12, 5))
    try:
        store.ingest(Batch("a1", 1, "n1", samples("n1", R1), cluster="c"))
        store.ingest(Batch("a2", 1, "n2", samples("n2", R2), cluster="c"))
        store.put_jobs([RUN1, RUN2])
        everything = reports(store, T(2026, 12, 5))
    finally:
        store.close()
    # all time, both runs: each node holds its own run's hour (the latest run's hosts held both before)
    by_node = {r.group: r for r in everything["all-node"].rows}
    assert {h: r.slurm_gpu_hours for h, r in by_node.items()} == {"n1": 1.0, "n2": 1.0}
    assert {h: r.jobs for h, r in by_node.items()} == {"n1": 1, "n2": 1} and everything["all-node"].total.jobs == 1
    rec = {r.node: r for r in everything["all-reconcile"].rows if r.account == "B"}
    assert {h: r.slurm_gpu_hours for h, r in rec.items()} == {"n1": 1.0, "n2": 1.0}
    assert all(r.coverage == pytest.approx(1.0, abs=0.01) and r.jobs == 1 for r in rec.values())
    assert everything["all-reconcile"].total.jobs == 1


@pytest.mark.parametrize("apart", [100.0, 1000.0])  # windows with the slack overlapping, and not
def test_a_usage_record_spanning_both_runs_is_split_between_them_and_nothing_twice(apart):
    # requeued onto the same node and GPU: the collector's one record of the job spans both runs
    run2 = replace(RUN1, start=R1 + H + apart, end=R1 + 2 * H + apart, state="COMPLETED",
                   earlier_runs=((R1, R1 + H, ("n1",)),))
    first = R1 + 1800  # its agent started half an hour into the first run
    span = R1 + 2 * H + apart - first
    row = JobUsage("500", "n1", "GPU-n1", first, first + span, 720, span, span / 2, span * 700.0, model="NVIDIA H100")
    (entry,) = join([run2], [row], [row], now=T(2026, 12, 5))
    (charged,), _ = in_scope(run2, [row], T(2026, 12, 5))
    nov, dec = (usage_report([entry], "account", p, now=T(2026, 12, 5)).total for p in (NOV, DEC))
    assert nov.allocated_gpu_hours + dec.allocated_gpu_hours == pytest.approx(charged.allocated_gpu_seconds / H)
    assert nov.energy_kwh + dec.energy_kwh == pytest.approx(charged.energy_joules / 3.6e6)
    if apart == 100.0:  # the runs' windows cut at the middle of their overlap, R1 + 3650 s
        assert (nov.allocated_gpu_hours * H, dec.allocated_gpu_hours * H) == pytest.approx((1850.0, 3650.0))
    else:  # each run's window with its slack, none of the time between the runs
        assert (nov.allocated_gpu_hours * H, dec.allocated_gpu_hours * H) == pytest.approx((1920.0, 3720.0))
    assert (nov.slurm_gpu_hours, dec.slurm_gpu_hours) == (1.0, 1.0)
    (part,) = in_period([entry], NOV, T(2026, 12, 5))  # what `report idle` and --influx read
    assert part.record is not None and (part.record.start, part.record.end, part.record.state) == (
        R1, R1 + H, "REQUEUED")
    assert math.isclose(part.usage.allocated_gpu_seconds, nov.allocated_gpu_hours * H)  # type: ignore[union-attr]


def test_a_running_requeued_jobs_earlier_run_counts_in_the_closed_period_it_ended():
    # the second run started on 30 November, 23:30, on n2 and still runs
    now, again = T(2026, 12, 1, 0, 30), T(2026, 11, 30, 23, 30)
    running = replace(RUN2, start=again, end=None, state="RUNNING", exit_code=None,
                      earlier_runs=((R1, R1 + H, ("n1",)),))
    usages = [JobUsage("500", "n1", "GPU-n1", R1, R1 + H, 360, H, H / 2, 0.0),
              JobUsage("500", "n2", "GPU-n2", again, now, 360, H, 900.0, 0.0)]
    entries = join([running], usages, usages, now=now)
    nov, dec = (usage_report(entries, "account", p, PRICES, now=now).total for p in (NOV, DEC))
    assert (nov.jobs, nov.slurm_gpu_hours, nov.allocated_gpu_hours) == (1, 1.0, 1.0)
    assert (dec.jobs, dec.slurm_gpu_hours, dec.allocated_gpu_hours) == (1, 1.0, 1.0)  # its run so far
    note = not_ended_note(entries, NOV, now) or ""
    assert note.endswith("(of them, 1 requeued job(s) count here with the earlier runs that ended in the period)")
    # requeued and waiting to run again: its earlier run in November, nothing in the open December
    waiting = join([replace(running, start=None, state="PENDING", hosts=())], usages[:1], usages[:1], now=now)
    assert [usage_report(waiting, "account", p, now=now).total.jobs for p in (NOV, DEC)] == [1, 0]
    assert usage_report(waiting, "account", NOV, now=now).total.allocated_gpu_hours == 1.0


def test_the_html_charts_draw_each_run_in_the_period_its_table_counts_it():
    """The usage chart's bars add up to the table's allocated GPU-hours in each period: the earlier run in November's
    page, the latest alone in December's (the chart once drew the whole job where its latest run ended)."""
    now = T(2026, 12, 5)
    run2 = replace(RUN2, earlier_runs=((R1, R1 + H, ("n1",)),))
    usages = [JobUsage("500", "n1", "GPU-n1", R1, R1 + H, 360, H, H / 2, 0.0, model="NVIDIA H100"),
              JobUsage("500", "n2", "GPU-n2", R2, R2 + H / 2, 180, H / 2, 900.0, 0.0, model="NVIDIA H100")]
    entries = join([run2], usages, usages, now=now)
    for per, hours in ((NOV, 1.0), (DEC, 0.5)):
        rep = usage_report(entries, "account", per, now=now)
        page = render_html(rep, entries, now=now)
        usage_chart = page.split('id="chart-usage"')[1].split("</svg>")[0]
        bars = [float(v) for v in re.findall(r'data-value="([^"]+)"', usage_chart)]
        assert rep.total.allocated_gpu_hours == hours
        assert math.fsum(bars) == pytest.approx(hours), per.label
