"""Aggregation arithmetic: hand-computed cases and hypothesis properties (order, duplicates, resets, gaps)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.collector.aggregate import ACCEPTED, DUPLICATE, HOUR_S, TOO_LATE, Aggregator, HourAcc, UsageAcc
from gpuledger.schema.records import GpuSample


def S(ts: float, gpu: str = "G0", host: str = "h1", **kw) -> GpuSample:
    return GpuSample(ts=ts, host=host, gpu_uuid=gpu, gpu_index=0, **kw)


def usage(agg: Aggregator, per_gpu: bool = True) -> dict:
    return {(u.job_id, u.host, u.gpu_uuid): u for u in agg.job_usage(per_gpu=per_gpu)}


def feed(samples, **kw) -> Aggregator:
    agg = Aggregator(**kw)
    for s in samples:
        agg.add(s)
    return agg


# -- hand-computed cases --------------------------------------------------------------------------


def test_counter_delta_sm_and_means():
    agg = feed(
        [
            S(
                0,
                energy_joules=1000.0,
                sm_active_ratio=0.2,
                dram_bw_ratio=0.4,
                job_ids=("j",),
                mem_used_bytes=5,
                power_watts=300.0,
            ),
            S(
                10,
                energy_joules=3000.0,
                sm_active_ratio=0.5,
                dram_bw_ratio=0.6,
                job_ids=("j",),
                mem_used_bytes=9,
                power_watts=200.0,
            ),
            S(30, energy_joules=4000.0, sm_active_ratio=1.0, job_ids=("j",), mem_used_bytes=7, power_watts=250.0),
        ]
    )
    u = usage(agg)[("j", "h1", "G0")]
    assert u.allocated_gpu_seconds == pytest.approx(30.0)
    assert u.sm_active_gpu_seconds == pytest.approx(0.5 * 10 + 1.0 * 20)
    assert u.energy_joules == pytest.approx(3000.0)
    assert u.sm_active_mean == pytest.approx(25 / 30)
    assert u.dram_bw_mean == pytest.approx(0.6)  # only the interval where HBM was reported
    assert u.mem_used_peak_bytes == 9 and u.power_peak_watts == 300.0
    assert (u.first_ts, u.last_ts, u.samples) == (0, 30, 3)


def test_counter_step_back_or_jump_is_not_trusted_and_counted():
    # cap 1000 W (configured for the model): (0,10] +1000 J fine; (10,20] back to 400: power integral 300 W x 10;
    # (20,30] +500 fine; (30,40] +20000 J > 1000 W x 10 s: power 5000 W clipped to 1000 W x 10; (40,50] +100.
    agg = feed(
        [
            S(0, energy_joules=5000.0, job_ids=("j",), model="X1"),
            S(10, energy_joules=6000.0, job_ids=("j",)),
            S(20, energy_joules=400.0, power_watts=300.0, job_ids=("j",)),
            S(30, energy_joules=900.0, job_ids=("j",)),
            S(40, energy_joules=20900.0, power_watts=5000.0, job_ids=("j",)),
            S(50, energy_joules=21000.0, job_ids=("j",)),
        ],
        power_caps={"X1": 1000.0, "X": 1.0},
    )
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(1000 + 3000 + 500 + 10000 + 100)
    g = agg.gpus[("h1", "G0", "")]
    assert g.anomalies == 2 and g.energy_j == pytest.approx(14600.0)
    assert sum(h.anomalies for h in agg.hours.values()) == 2


def test_reset_to_zero_without_power_charges_nothing_for_that_interval():
    agg = feed(
        [
            S(0, energy_joules=5000.0, job_ids=("j",)),
            S(10, energy_joules=6000.0, job_ids=("j",)),
            S(20, energy_joules=0.0, job_ids=("j",)),
            S(30, energy_joules=900.0, job_ids=("j",)),
        ]
    )
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(1000 + 0 + 900)
    assert agg.gpus[("h1", "G0", "")].anomalies == 1


def test_reported_power_limit_bounds_the_counter_but_never_raises_the_cap():
    # limit 200 W (x 1.1 headroom: 220 W): +3000 J in 10 s is more than 2200 J -> untrusted, power 250 W clipped
    # to 220 W -> 2200 J.
    # limit 5000 W reported but cap 1500 W (default): +16000 J in 10 s > 15000 J -> untrusted, no power -> 0.
    agg = feed(
        [
            S(0, energy_joules=0.0, job_ids=("j",)),
            S(10, energy_joules=3000.0, power_watts=250.0, power_limit_watts=200.0, job_ids=("j",)),
            S(20, energy_joules=19000.0, power_limit_watts=5000.0, job_ids=("j",)),
        ]
    )
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(2200.0)
    assert agg.gpus[("h1", "G0", "")].anomalies == 2


def test_an_honest_gpu_at_its_power_limit_is_no_counter_anomaly():
    # 700 W enforced; the counter shows 720 W over these 10 s (sample-time jitter, the driver's averaging window)
    agg = feed([S(0, energy_joules=0.0, power_limit_watts=700.0, job_ids=("j",)),
                S(10, energy_joules=7200.0, power_watts=700.0, power_limit_watts=700.0, job_ids=("j",)),
                S(20, energy_joules=7200.0 + 7800.0, power_watts=700.0, power_limit_watts=700.0, job_ids=("j",))])
    # the first step is trusted; the second (780 W) is past 770 W and is not: 700 W x 10 s
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(7200.0 + 7000.0)
    assert agg.gpus[("h1", "G0", "")].anomalies == 1


def test_cap_lookup_exact_then_longest_pattern():
    agg = Aggregator(power_caps={"A10": 150.0, "A100": 400.0, "NVIDIA A100-SXM4-80GB": 500.0})
    assert agg.cap_w("NVIDIA A100-SXM4-80GB") == 500.0
    assert agg.cap_w("NVIDIA A100-PCIE-40GB") == 400.0
    assert agg.cap_w("NVIDIA A10") == 150.0
    assert agg.cap_w("H200") == 1500.0 and agg.cap_w("H200", 700.0) == pytest.approx(770.0)
    assert agg.cap_w("H200", 0.0) == 1500.0 and agg.cap_w("H200", 1400.0) == 1500.0


def test_gap_held_by_the_same_jobs_is_theirs_spread_over_hours():
    # (0,10] observed, 100 J. (10,7210] a 7200 s gap with the same job on both sides: its 9000 J are j's, spread
    # over hours [0,3600) 3590 s, [3600,7200) 3600 s, [7200,...) 10 s; 7200 gap-seconds, no observed seconds.
    agg = feed(
        [
            S(0, energy_joules=0.0, sm_active_ratio=1.0, job_ids=("j",)),
            S(10, energy_joules=100.0, sm_active_ratio=1.0, job_ids=("j",)),
            S(7210, energy_joules=9100.0, sm_active_ratio=1.0, job_ids=("j",)),
        ],
        max_gap_s=300,
    )
    u = usage(agg)[("j", "h1", "G0")]
    assert u.allocated_gpu_seconds == pytest.approx(10.0) and u.gap_gpu_seconds == pytest.approx(7200.0)
    assert u.sm_active_gpu_seconds == pytest.approx(10.0)
    assert u.energy_joules == pytest.approx(9100.0)
    hours = {k[3]: h for k, h in agg.hours.items()}
    assert hours[0.0].energy_j == pytest.approx(100 + 9000 * 3590 / 7200)
    assert hours[3600.0].energy_j == pytest.approx(9000 * 3600 / 7200)
    assert hours[7200.0].energy_j == pytest.approx(9000 * 10 / 7200)
    assert all(h.job_energy_j == pytest.approx(h.energy_j) for h in hours.values())
    assert agg.take_gaps() == {("h1", "G0", "", 10.0, 7210.0): (9000.0, ("j",))}


def test_gap_between_different_jobs_is_unattributed():
    # A's last sample at 10, B's first at 7210: the 9000 J across the gap are nobody's; B gets only (7210, 7220].
    agg = feed(
        [
            S(0, energy_joules=0.0, job_ids=("a",)),
            S(10, energy_joules=100.0, job_ids=("a",)),
            S(7210, energy_joules=9100.0, job_ids=("b",)),
            S(7220, energy_joules=9200.0, job_ids=("b",)),
        ]
    )
    u = usage(agg)
    assert u[("a", "h1", "G0")].energy_joules == pytest.approx(100.0)
    assert u[("b", "h1", "G0")].energy_joules == pytest.approx(100.0)
    assert u[("b", "h1", "G0")].gap_gpu_seconds == 0.0
    assert agg.gpus[("h1", "G0", "")].energy_j == pytest.approx(9200.0)
    unattributed = sum(h.energy_j - h.job_energy_j for h in agg.hours.values())
    assert unattributed == pytest.approx(9000.0)
    assert agg.take_gaps() == {("h1", "G0", "", 10.0, 7210.0): (9000.0, ())}


def test_late_sample_splitting_a_gap_deletes_its_record():
    agg = feed(
        [S(0, energy_joules=0.0, job_ids=("j",)), S(1000, energy_joules=5000.0, job_ids=("j",))],
        max_gap_s=300,
        window_s=2000,
    )
    assert list(agg.take_gaps()) == [("h1", "G0", "", 0.0, 1000.0)]
    agg.add(S(500, energy_joules=2000.0, job_ids=("k",)))  # now two gaps: (0,500] unheld, (500,1000] unheld
    assert agg.take_gaps() == {
        ("h1", "G0", "", 0.0, 1000.0): None,
        ("h1", "G0", "", 0.0, 500.0): (2000.0, ()),
        ("h1", "G0", "", 500.0, 1000.0): (3000.0, ()),
    }
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(0.0, abs=1e-9)


def test_power_integrated_only_without_counter_and_not_across_gaps():
    agg = feed(
        [
            S(0, power_watts=100.0, job_ids=("j",)),
            S(10, power_watts=200.0, job_ids=("j",)),
            S(20, power_watts=300.0, energy_joules=50.0, job_ids=("j",)),  # prev has no counter: integrate
            S(30, power_watts=999.0, energy_joules=150.0, job_ids=("j",)),  # counter delta, power ignored
            S(1000, power_watts=400.0, job_ids=("j",)),
        ],
        max_gap_s=300,
    )  # gap, no counter: nothing
    assert usage(agg)[("j", "h1", "G0")].energy_joules == pytest.approx(2000 + 3000 + 100)


def test_shared_gpu_split_by_shares_and_equally():
    agg = feed(
        [
            S(0, energy_joules=0.0, sm_active_ratio=0.5, job_ids=("a", "b"), job_shares=(0.75, 0.25)),
            S(100, energy_joules=1000.0, sm_active_ratio=0.5, job_ids=("a", "b"), job_shares=(0.75, 0.25)),
            S(200, energy_joules=3000.0, sm_active_ratio=0.5, job_ids=("a", "b")),
        ],
        max_gap_s=300,
    )
    u = usage(agg)
    a, b = u[("a", "h1", "G0")], u[("b", "h1", "G0")]
    assert a.allocated_gpu_seconds == pytest.approx(75 + 50) and b.allocated_gpu_seconds == pytest.approx(25 + 50)
    assert a.energy_joules == pytest.approx(750 + 1000) and b.energy_joules == pytest.approx(250 + 1000)
    assert a.sm_active_mean == pytest.approx(0.5)


def test_interval_belongs_to_the_later_samples_job_and_jobless_samples_charge_nobody():
    agg = feed(
        [
            S(0, energy_joules=0.0),
            S(10, energy_joules=100.0, job_ids=("a",)),
            S(20, energy_joules=300.0, job_ids=("b",)),
            S(30, energy_joules=600.0),
        ]
    )
    u = usage(agg)
    assert u[("a", "h1", "G0")].energy_joules == pytest.approx(100.0)
    assert u[("b", "h1", "G0")].energy_joules == pytest.approx(200.0)
    assert agg.gpu_totals()[("h1", "G0", "")] == pytest.approx((30.0, 600.0))


def mig_rows(ts: float, parent: dict | None, insts: dict[str, dict]) -> list[GpuSample]:
    out = [] if parent is None else [S(ts, model="NVIDIA A100-SXM4-80GB", **parent)]
    out += [S(ts, mig=m, model=f"NVIDIA A100-SXM4-80GB MIG {p}", **kw) for m, (p, kw) in insts.items()]
    return out


@pytest.mark.parametrize("shape", ["parent_only", "instances_repeat", "both", "virtual"])
def test_mig_energy_counted_once_whatever_the_shape(shape):
    # One A100: 3g instance (job a), 2g instance (job b), 2 slices free. 700 J then 700 J over two 10 s intervals.
    # The GPU's key holds 1400 J and 20 s; a gets 3/7, b 2/7 of each interval; 2/7 (400 J) is unattributed.
    def rows(ts, e, w):
        inst = {"1.0": ("3g.40gb", {"job_ids": ("a",)}), "2.0": ("2g.20gb", {"job_ids": ("b",)})}
        if shape == "parent_only":
            return mig_rows(ts, {"energy_joules": e, "power_watts": w}, inst)
        if shape == "virtual":  # the agent's splitter: instances' counters sum to the GPU's, parent stripped
            inst = {
                m: (p, {**kw, "energy_joules": e * f, "power_watts": w * f})
                for (m, (p, kw)), f in zip(inst.items(), (0.6, 0.4))
            }
            return mig_rows(ts, {}, inst)
        inst = {m: (p, {**kw, "energy_joules": e, "power_watts": w}) for m, (p, kw) in inst.items()}
        return mig_rows(ts, {"energy_joules": e, "power_watts": w} if shape == "both" else None, inst)

    agg = Aggregator()
    counts, _ = agg.add_many(rows(0, 1000.0, 70.0) + rows(10, 1700.0, 70.0))
    counts2, _ = agg.add_many(rows(20, 2400.0, 70.0))
    sent = {"parent_only": 3, "instances_repeat": 2, "both": 3, "virtual": 3}[shape]
    assert counts.accepted == 2 * sent and counts2.accepted == sent  # rows made for the GPU are not the sender's
    u = usage(agg)
    assert u[("a", "h1", "G0/1.0")].energy_joules == pytest.approx(1400 * 3 / 7)
    assert u[("b", "h1", "G0/2.0")].energy_joules == pytest.approx(1400 * 2 / 7)
    assert u[("a", "h1", "G0/1.0")].allocated_gpu_seconds == pytest.approx(20 * 3 / 7)
    totals = agg.gpu_totals()
    assert totals[("h1", "G0", "")] == pytest.approx((20.0, 1400.0))
    assert totals[("h1", "G0", "1.0")] == (0.0, 0.0) and totals[("h1", "G0", "2.0")] == (0.0, 0.0)
    hours = list(agg.hours.values())
    assert sum(h.energy_j - h.job_energy_j for h in hours) == pytest.approx(400.0)
    assert sum(h.observed_s - h.alloc_s for h in hours) == pytest.approx(20 * 2 / 7)


def test_mig_unknown_profiles_share_equally_and_parent_jobs_are_dropped():
    rows = [S(t, job_ids=("liar",), energy_joules=e) for t, e in ((0, 0.0), (10, 600.0))]
    rows += [
        S(t, mig=m, job_ids=(j,), energy_joules=e)
        for t, e in ((0, 0.0), (10, 600.0))
        for m, j in (("1", "x"), ("2", "y"))
    ]
    agg = Aggregator()
    agg.add_many(rows)
    u = usage(agg)
    assert ("liar", "h1", "G0") not in u
    assert u[("x", "h1", "G0/1")].energy_joules == pytest.approx(300.0)
    assert u[("y", "h1", "G0/2")].energy_joules == pytest.approx(300.0)


def test_duplicate_late_and_too_late():
    agg = Aggregator(window_s=600.0)
    assert agg.add(S(1000, job_ids=("j",), sm_active_ratio=1.0)) == ACCEPTED
    assert agg.add(S(1010, job_ids=("j",), sm_active_ratio=0.0)) == ACCEPTED
    assert agg.add(S(1010, job_ids=("j",), sm_active_ratio=1.0)) == DUPLICATE
    assert agg.add(S(1005, job_ids=("j",), sm_active_ratio=1.0)) == ACCEPTED  # splits (1000, 1010]
    assert agg.add(S(399, job_ids=("j",))) == TOO_LATE
    assert agg.add(S(410, job_ids=("j",), sm_active_ratio=1.0)) == ACCEPTED  # before the first: in window
    u = usage(agg)[("j", "h1", "G0")]
    # (410,1000] is a gap (590 s > 300 s): no GPU-seconds; (1000,1005] sm 1; (1005,1010] sm 0.
    assert u.allocated_gpu_seconds == pytest.approx(10.0)
    assert u.sm_active_gpu_seconds == pytest.approx(5.0)
    assert u.samples == 4 and u.first_ts == 410


def test_long_stream_evicts_but_still_accepts_late_samples_in_window():
    agg = Aggregator(window_s=600.0)
    for i in range(5000):
        agg.add(S(float(i), job_ids=("j",), energy_joules=float(i)))
    g = agg.gpus[("h1", "G0", "")]
    assert len(g.samples) < 2000  # compacted
    # watermark 4999, window 600: samples at or after 4399 still count
    assert agg.add(S(4398.5, job_ids=("j",), energy_joules=4398.5)) == TOO_LATE
    assert agg.add(S(4399.0, job_ids=("j",))) == DUPLICATE
    assert agg.add(S(4450.5, job_ids=("j",), energy_joules=4450.5)) == ACCEPTED
    u = usage(agg)[("j", "h1", "G0")]
    assert u.allocated_gpu_seconds == pytest.approx(4999.0) and u.energy_joules == pytest.approx(4999.0)


def test_constructor_rejects_bad_parameters():
    with pytest.raises(ValueError, match="max_gap_s"):
        Aggregator(max_gap_s=0)
    with pytest.raises(ValueError, match="power caps"):
        Aggregator(power_caps={"H200": 0})


# -- properties -----------------------------------------------------------------------------------

JOBS = ("1", "2", "3_1")


# The generators below draw ~15 values a sample: their strategies are built once here, not per draw (building one
# costs more than drawing from it).
_JITTER = st.floats(0, 0.9)
_RESET_TO = st.floats(0, 500)
_SHARE = st.floats(0, 1)
_RATIO = st.one_of(st.none(), st.floats(0, 1))
_MEM = st.one_of(st.none(), st.integers(0, 141 * 10**9))
_JOB_ORDER = st.permutations(JOBS)
_SEQ_TICK = st.sampled_from([1.0, 5.0, 10.0, 30.0, 299.0, 301.0, 900.0])
_SEQ_EVENT = st.sampled_from(["up", "up", "up", "reset", "none"])
_SEQ_JOULES_UP = st.floats(0, 5e4)
_SEQ_POWER = st.one_of(st.none(), st.floats(0, 700), st.floats(0, 5000))
_SEQ_POWER_LIMIT = st.sampled_from([None, None, 300.0, 700.0, 2000.0])


@st.composite
def sequences(draw, with_jobless: bool = True) -> list[GpuSample]:
    """Sorted, distinct-time samples of 1-2 GPUs with resets, gaps, missing counters and shared jobs."""
    out = []
    n_jobs_of = st.integers(0 if with_jobless else 1, 2)
    for gpu in draw(st.sampled_from([("G0",), ("G0", "G1")])):
        ts, energy = 1_000_000.0, draw(st.floats(0, 1e6))
        for _ in range(draw(st.integers(1, 25))):
            ts += draw(_SEQ_TICK) + draw(_JITTER)
            ev = draw(_SEQ_EVENT)
            if ev == "reset":
                energy = draw(_RESET_TO)
            elif ev == "up":
                energy += draw(_SEQ_JOULES_UP)
            n_jobs = draw(n_jobs_of)
            jobs = tuple(draw(_JOB_ORDER)[:n_jobs])
            shares: tuple[float, ...] = ()
            if n_jobs == 2 and draw(st.booleans()):
                x = draw(_SHARE)
                shares = (x, 1 - x)
            if out and out[-1].gpu_uuid == gpu and draw(st.booleans()):  # the jobs of the sample before, often
                jobs, shares = out[-1].job_ids, out[-1].job_shares
            out.append(drawn_sample(draw, ts, gpu, jobs, shares, "", None if ev == "none" else energy,
                                    _SEQ_POWER, _SEQ_POWER_LIMIT))
    return out


def drawn_sample(draw, ts: float, gpu: str, jobs: tuple[str, ...], shares: tuple[float, ...], model: str,
                 energy: float | None, power: st.SearchStrategy, power_limit: st.SearchStrategy) -> GpuSample:
    """One sample of host h1 with these fields, its power and limit drawn from the given strategies and its ratios
    and memory drawn (each present or not)."""
    return GpuSample(ts=ts, host="h1", gpu_uuid=gpu, gpu_index=0, job_ids=jobs, job_shares=shares, model=model,
                     energy_joules=energy, power_watts=draw(power), power_limit_watts=draw(power_limit),
                     sm_active_ratio=draw(_RATIO), dram_bw_ratio=draw(_RATIO), tensor_active_ratio=draw(_RATIO),
                     sm_occupancy_ratio=draw(_RATIO), mem_used_bytes=draw(_MEM))


def assert_same_hours(a: Aggregator, b: Aggregator) -> None:
    """Every hour bucket's sums alike (a bucket one of them lacks: all zero there)."""
    zero = HourAcc().values()
    for k in a.hours.keys() | b.hours.keys():
        x, y = (h.values() if (h := agg.hours.get(k)) else zero for agg in (a, b))
        assert x == pytest.approx(y, rel=1e-9, abs=1e-6), k


def assert_same(a: Aggregator, b: Aggregator) -> None:
    ua, ub = usage(a), usage(b)
    assert ua.keys() == ub.keys()
    for k in ua:
        x, y = ua[k].to_dict(), ub[k].to_dict()
        for f in x:
            if isinstance(x[f], float) and isinstance(y[f], float):
                assert x[f] == pytest.approx(y[f], rel=1e-9, abs=1e-6), (k, f)
            else:
                assert x[f] == y[f], (k, f)
    ta, tb = a.gpu_totals(), b.gpu_totals()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k] == pytest.approx(tb[k], rel=1e-9, abs=1e-6)


def reference(samples: list[GpuSample], max_gap_s: float = 60.0, cap_w: float = 1500.0) -> dict:
    """A deliberately naive batch computation over sorted samples: per job (alloc, sm, energy, gap seconds)."""
    out: dict = {}
    by_gpu: dict = {}
    for s in sorted(samples, key=lambda s: s.ts):
        by_gpu.setdefault(s.gpu_uuid, []).append(s)

    def cap_of(s: GpuSample) -> float:
        return min(cap_w, s.power_limit_watts * 1.1) if s.power_limit_watts else cap_w

    def power_j(seq: list[GpuSample], i: int) -> float:
        """The capped power integral of the interval ending at seq[i] (observed)."""
        p = seq[i].power_watts
        return 0.0 if p is None else min(p, cap_of(seq[i])) * (seq[i].ts - seq[i - 1].ts)

    for seq in by_gpu.values():
        for i in range(1, len(seq)):
            prev, cur = seq[i - 1], seq[i]
            dt = cur.ts - prev.ts
            observed = dt <= max_gap_s
            cap = cap_of(cur)
            e = power_j(seq, i) if observed else 0.0
            if prev.energy_joules is not None and cur.energy_joules is not None:
                d = cur.energy_joules - prev.energy_joules
                if 0 <= d <= cap * dt:
                    e = d
            elif cur.energy_joules is not None and observed:  # after a missed reading: growth since the last one
                c = max((j for j in range(i) if seq[j].energy_joules is not None), default=None)
                if (c is not None and cur.ts - seq[c].ts <= max_gap_s
                        and all((x.job_ids, x.job_shares) == (cur.job_ids, cur.job_shares) for x in seq[c + 1:i])):
                    grown = cur.energy_joules - seq[c].energy_joules
                    if 0 <= grown <= cap * (cur.ts - seq[c].ts):
                        e = max(grown - sum(power_j(seq, k) for k in range(c + 1, i)), 0.0)
            held = bool(cur.job_ids) and sorted(prev.job_ids) == sorted(cur.job_ids)
            if not observed and not held:
                continue
            shares = cur.job_shares or tuple(1 / len(cur.job_ids) for _ in cur.job_ids)
            for j, sh in zip(cur.job_ids, shares):
                r = out.setdefault((j, cur.gpu_uuid), [0.0, 0.0, 0.0, 0.0])
                r[0] += dt * sh if observed else 0.0
                r[1] += (cur.sm_active_ratio or 0.0) * dt * sh if observed else 0.0
                r[2] += e * sh
                r[3] += 0.0 if observed else dt * sh
    return out


@settings(max_examples=100, deadline=None)
@given(sequences(), st.randoms(use_true_random=False), st.integers(0, 10))
def test_any_permutation_with_duplicates_equals_sorted(seq, rnd, n_dups):
    shuffled = seq + [rnd.choice(seq) for _ in range(n_dups)]
    rnd.shuffle(shuffled)
    a, b = feed(shuffled, window_s=1e9), feed(seq, window_s=1e9)
    assert_same(a, b)
    assert_same_hours(a, b)


@settings(max_examples=100, deadline=None)
@given(sequences())
def test_in_order_stream_matches_naive_reference(seq):
    agg = feed(seq)
    ref = reference(seq)
    got = {(u.job_id, u.gpu_uuid): u for u in agg.job_usage(per_gpu=True)}
    for k, (alloc, sm, energy, gap_s) in ref.items():
        u = got[k]
        assert u.allocated_gpu_seconds == pytest.approx(alloc, rel=1e-9, abs=1e-6)
        assert u.sm_active_gpu_seconds == pytest.approx(sm, rel=1e-9, abs=1e-6)
        assert u.energy_joules == pytest.approx(energy, rel=1e-9, abs=1e-6)
        assert u.gap_gpu_seconds == pytest.approx(gap_s, rel=1e-9, abs=1e-6)
        assert u.energy_joules >= -1e-6


def check_conservation_and_bound(agg: Aggregator) -> None:
    """Per physical GPU: sum over jobs + unattributed = the GPU's energy and seconds, unattributed never negative,
    and every job's energy at most the cap x its GPU-seconds (observed + held across gaps)."""
    per_gpu = agg.job_usage(per_gpu=True)
    for (host, gpu, mig), g in agg.gpus.items():
        if mig:
            assert (g.observed_s, g.energy_j, g.anomalies) == (0.0, 0.0, 0)
            continue
        rows = [u for u in per_gpu if u.host == host and u.gpu_uuid.split("/")[0] == gpu]
        hours = [h for k, h in agg.hours.items() if k[:2] == (host, gpu)]
        unattributed_j = sum(h.energy_j - h.job_energy_j for h in hours)
        unallocated_s = sum(h.observed_s - h.alloc_s for h in hours)
        tol = 1e-9 * (1 + g.energy_j)
        assert sum(u.energy_joules for u in rows) + unattributed_j == pytest.approx(g.energy_j, rel=1e-9, abs=1e-6)
        assert sum(h.energy_j for h in hours) == pytest.approx(g.energy_j, rel=1e-9, abs=1e-6)
        assert unattributed_j >= -tol - 1e-6
        assert sum(u.allocated_gpu_seconds for u in rows) + unallocated_s == pytest.approx(
            g.observed_s, rel=1e-9, abs=1e-6
        )
        assert unallocated_s >= -1e-6
        assert g.anomalies == sum(h.anomalies for h in hours) >= 0
    for u in per_gpu:
        gpu_s = u.allocated_gpu_seconds + u.gap_gpu_seconds
        assert u.energy_joules <= agg.power_cap_w * gpu_s * (1 + 1e-9) + 1e-6, u


@settings(max_examples=60, deadline=None)
@given(sequences(), st.randoms(use_true_random=False))
def test_conservation_and_energy_bound(seq, rnd):
    rnd.shuffle(seq)
    check_conservation_and_bound(feed(seq, window_s=1e9))


@st.composite
def mig_batches(draw) -> list[list[GpuSample]]:
    """One MIG GPU in any source shape, with resets, jumps and jobs coming and going on its instances."""
    shape = draw(st.sampled_from(["parent_only", "instances_repeat", "both", "virtual", "mixed"]))
    profiles = draw(
        st.sampled_from([("3g.40gb", "2g.20gb"), ("7g.80gb",), ("1g.10gb", "1g.10gb", "4g.40gb"), ("", "")])
    )
    ts, energy, batches = 1_000_000.0, draw(st.floats(0, 1e6)), []
    for _ in range(draw(st.integers(1, 6))):
        batch = []
        for _ in range(draw(st.integers(1, 5))):
            ts += draw(st.sampled_from([1.0, 10.0, 30.0, 100.0, 4000.0]))
            energy = draw(st.floats(0, 500)) if draw(st.integers(0, 8)) == 0 else energy + draw(st.floats(0, 2e4))
            power = draw(st.one_of(st.none(), st.floats(0, 3000)))
            sh = shape if shape != "mixed" else draw(st.sampled_from(["parent_only", "instances_repeat", "both"]))
            if sh != "instances_repeat":
                on_parent = sh != "virtual"
                batch.append(
                    GpuSample(
                        ts=ts,
                        host="h1",
                        gpu_uuid="G0",
                        gpu_index=0,
                        model="A100",
                        energy_joules=energy if on_parent else None,
                        power_watts=power if on_parent else None,
                        job_ids=draw(st.sampled_from([(), ("liar",)])),
                    )
                )
            for k, p in enumerate(profiles):
                jobs = draw(st.sampled_from([(), (f"j{k}",), (f"j{k}", "x")]))
                part = 1 / len(profiles)
                e, w = {
                    "parent_only": (None, None),
                    "virtual": (energy * part, None if power is None else power * part),
                }.get(sh, (energy, power))
                batch.append(
                    GpuSample(
                        ts=ts,
                        host="h1",
                        gpu_uuid="G0",
                        gpu_index=0,
                        mig=str(k),
                        job_ids=jobs,
                        model=f"A100 MIG {p}" if p else "A100",
                        energy_joules=e,
                        power_watts=w,
                    )
                )
        batches.append(batch)
    return batches


@settings(max_examples=80, deadline=None)
@given(mig_batches())
def test_mig_conservation_and_bound_for_every_shape(batches):
    agg = Aggregator(window_s=1e9)
    for b in batches:
        agg.add_many(b)
    check_conservation_and_bound(agg)
    assert not any(k[0] == "liar" for k in agg.usage)


@settings(max_examples=40, deadline=None)
@given(sequences())
def test_per_job_summary_combines_gpus_consistently(seq):
    agg = feed(seq)
    per_gpu = agg.job_usage(per_gpu=True)
    for u in agg.job_usage():
        mine = [g for g in per_gpu if g.job_id == u.job_id]
        assert u.gpus == len(mine) and u.gpu_uuid == "*"
        assert u.allocated_gpu_seconds == pytest.approx(sum(g.allocated_gpu_seconds for g in mine))
        assert u.energy_joules == pytest.approx(sum(g.energy_joules for g in mine))
        assert u.samples == sum(g.samples for g in mine)
        assert u.first_ts == min(g.first_ts for g in mine) and u.last_ts == max(g.last_ts for g in mine)
        # time-weighted over all the job's GPU-seconds where SM activity was reported, not a mean of means
        accs = [a for k, a in agg.usage.items() if k[0] == u.job_id]
        w = sum(a.sm_w for a in accs)
        if w > 0:
            assert u.sm_active_mean == pytest.approx(sum(a.sm_sum for a in accs) / w)
        else:
            assert u.sm_active_mean is None


def test_per_job_mean_is_time_weighted_across_gpus():
    agg = feed(
        [
            S(0, gpu="A", sm_active_ratio=1.0, job_ids=("j",)),
            S(100, gpu="A", sm_active_ratio=1.0, job_ids=("j",)),
            S(0, gpu="B", sm_active_ratio=0.0, job_ids=("j",)),
            S(300, gpu="B", sm_active_ratio=0.0, job_ids=("j",)),
        ],
        max_gap_s=300,
    )
    (u,) = agg.job_usage()
    assert u.gpus == 2 and u.allocated_gpu_seconds == pytest.approx(400.0)
    assert u.sm_active_mean == pytest.approx(0.25)  # a mean of means would say 0.5


def test_usage_acc_round_trips_values():
    a = UsageAcc()
    a.alloc_s, a.mem_peak, a.model = 3.0, 7, "H200"
    assert UsageAcc.from_values(a.values()).values() == a.values()
    assert math.isinf(UsageAcc().first_ts)


def test_late_sample_between_a_reset_is_exact():
    seq = [
        S(0, energy_joules=900.0, job_ids=("j",)),
        S(10, energy_joules=1000.0, job_ids=("j",)),
        S(30, energy_joules=50.0, job_ids=("j",)),
    ]
    late = S(20, energy_joules=20.0, job_ids=("j",))  # the reset happened before t=20
    a = feed(seq + [late])
    b = feed(sorted(seq + [late], key=lambda s: s.ts))
    assert_same(a, b)
    # (10,20] steps back: untrusted, no power reading -> 0 J and one anomaly (not two: the late sample's undo
    # removed the anomaly of (10,30]); (20,30] +30 J
    assert usage(a)[("j", "h1", "G0")].energy_joules == pytest.approx(100 + 0 + 30)
    assert a.gpus[("h1", "G0", "")].anomalies == b.gpus[("h1", "G0", "")].anomalies == 1


# -- the columnar in-order path (add_many) is bit-for-bit the per-sample one ----------------------


# long_runs' own strategies (with those above sequences()).
_TICK = st.sampled_from([1.0, 1.0, 10.0, 30.0])
_LONG_GAP = st.sampled_from([301.0, 900.0, 5000.0])
_ODD_EVENT = st.sampled_from(["reset", "jump"])
_WATTS_UP = st.floats(0, 140)
_JOB_CHANGE = st.integers(0, 30)
_JOB_COUNT = st.integers(0, 2)
_ONE_IN_6 = st.integers(0, 5)
_ONE_IN_501 = st.integers(0, 500)
_MODEL = st.sampled_from(["", "H200", "H200", "H200", "A10"])
_POWER = st.one_of(st.none(), st.floats(0, 700), st.floats(0, 3000))
_POWER_LIMIT = st.sampled_from([None, None, None, 600.0, 2000.0])


@st.composite
def long_runs(draw) -> list[GpuSample]:
    """Sorted samples of 1-2 GPUs in long runs (so add_many takes its columnar path), with job changes,
    shares, resets, gaps, hour crossings and missing values."""
    out = []
    for gpu in draw(st.sampled_from([("G0",), ("G0", "G1")])):
        ts, energy = 3_600_000.0 - draw(st.floats(0, 2000)), draw(st.floats(0, 1e6))
        jobs, shares = ("1",), ()
        rare = draw(st.integers(50, 3000))  # 1 in ``rare`` intervals is a gap, a reset or a jump: most runs are clean
        odd = st.integers(0, rare)
        # readings without the counter: 1 in 6, rare (a reading after a missed one goes sample by sample), or all
        # (a GPU without the counter: the columnar paths take it)
        missed = draw(st.sampled_from([lambda d: d(_ONE_IN_6) == 0, lambda d: d(_ONE_IN_501) == 0,
                                       lambda d: True]))
        for _ in range(draw(st.integers(1, 120))):
            dt = draw(_TICK) + draw(_JITTER)
            if draw(odd) == 0:
                dt = draw(_LONG_GAP)
            ts += dt
            ev = "none" if missed(draw) else "up"
            if draw(odd) == 0:
                ev = draw(_ODD_EVENT)
            if ev == "reset":
                energy = draw(_RESET_TO)
            elif ev == "jump":
                energy += 1e7
            elif ev == "up":
                energy += draw(_WATTS_UP) * dt
            if draw(_JOB_CHANGE) == 0:  # a job change now and then
                jobs = tuple(draw(_JOB_ORDER)[: draw(_JOB_COUNT)])
                shares = ()
                if len(jobs) == 2 and draw(st.booleans()):
                    x = draw(_SHARE)
                    shares = (x, 1 - x)
            out.append(drawn_sample(draw, ts, gpu, jobs, shares, draw(_MODEL), None if ev == "none" else energy,
                                    _POWER, _POWER_LIMIT))
    return out


CAPS = {"A10": 150.0, "H200": 1000.0}


def test_columnar_path_takes_clean_runs_only():
    clean = [S(float(t), energy_joules=100.0 * t, power_watts=100.0, job_ids=("j",), model="H200") for t in range(40)]
    assert Aggregator()._add_run(("h1", "G0", ""), clean)
    gap = clean[:20] + [S(s.ts + 1000, energy_joules=s.energy_joules, job_ids=("j",)) for s in clean[20:]]
    assert not Aggregator()._add_run(("h1", "G0", ""), gap)
    back = clean[:20] + [S(s.ts, energy_joules=s.energy_joules - 5000, job_ids=("j",)) for s in clean[20:]]
    assert not Aggregator()._add_run(("h1", "G0", ""), back)
    jump = clean[:20] + [S(s.ts, energy_joules=s.energy_joules + 1e6, job_ids=("j",)) for s in clean[20:]]
    assert not Aggregator()._add_run(("h1", "G0", ""), jump)
    assert not Aggregator(power_caps={"H200": 50.0})._add_run(("h1", "G0", ""), clean)  # 100 W > 50 W cap


def test_a_missed_reading_takes_the_counters_growth_since_the_reading_before():
    def run(**kw):
        return feed([S(0.0, energy_joules=0.0, power_watts=100.0, job_ids=("j",)),
                     S(10.0, energy_joules=1000.0, power_watts=100.0, job_ids=("j",)),
                     S(20.0, job_ids=("j",)),  # missed: neither power nor the counter
                     S(30.0, power_watts=200.0, job_ids=("j",)),  # power only: 2000 J given
                     S(40.0, energy_joules=5000.0, power_watts=100.0, job_ids=kw.pop("jobs", ("j",)))], **kw)

    agg = run()
    assert agg.gpu_totals()[("h1", "G0", "")] == (40.0, 5000.0)  # (30,40]: 4000 - 0 - 2000 J
    assert usage(agg)[("j", "h1", "G0")].energy_joules == 5000.0 and agg.gpus[("h1", "G0", "")].anomalies == 0
    # not trusted, or the reading before too far back, or the jobs changed in the stretch: the power integral
    assert run(power_cap_w=130.0).gpu_totals()[("h1", "G0", "")][1] == 1000.0 + 1300.0 + 1000.0  # 4000 J > 130 W x 30 s
    assert run(max_gap_s=25.0).gpu_totals()[("h1", "G0", "")][1] == 1000.0 + 2000.0 + 1000.0
    other = run(jobs=("k",))
    assert other.gpu_totals()[("h1", "G0", "")][1] == 4000.0 and usage(other)[("k", "h1", "G0")].energy_joules == 1000.0


def test_a_missed_reading_stretch_across_an_hour_is_billed_in_each_hour_by_time():
    """The energy a reading after missed ones catches up is the stretch's since the last reading: per hour bucket
    it goes where the stretch's intervals do (each in the bucket of its end), in proportion to their seconds; the
    GPU's and the job's totals are those of the counter, whatever the arrival order."""
    h = 3_600_000.0  # an hour boundary
    j = ("j",)
    # 500 W; the readings at h-10 and h missed (neither power nor the counter): (h, h+10] catches up 15000 J over
    # (h-20, h+10], whose interval ending at h-10 (10 s) is the hour before's, the two ending at h and h+10 hour h's
    seq = [S(h - 30, energy_joules=0.0, power_watts=500.0, job_ids=j),
           S(h - 20, energy_joules=5000.0, power_watts=500.0, job_ids=j),
           S(h - 10, job_ids=j), S(h, job_ids=j),
           S(h + 10, energy_joules=20000.0, power_watts=500.0, job_ids=j),
           S(h + 20, energy_joules=25000.0, power_watts=500.0, job_ids=j)]
    for order in (seq, seq[::-1], [*seq[:2], seq[4], seq[2], seq[5], seq[3]]):  # in order, reversed, late ones
        agg = feed(order)
        assert agg.gpu_totals()[("h1", "G0", "")] == (50.0, 25000.0)
        assert usage(agg)[("j", "h1", "G0")].energy_joules == 25000.0
        rows = {k[3]: (a.observed_s, a.energy_j, a.job_energy_j, a.alloc_s) for k, a in agg.hours.items()}
        # 500 W in each hour, as the counter says: (h-30, h-20] 5000 J, then a third of 15000 J before the hour
        assert rows == {h - HOUR_S: (20.0, 10000.0, 10000.0, 20.0), h: (30.0, 15000.0, 15000.0, 30.0)}, order
        check_conservation_and_bound(agg)


def test_a_missed_reading_stretch_within_one_hour_stays_in_it():
    """Intervals that all end in one hour (from a reading at the hour itself too) keep the caught-up energy there."""
    h = 3_600_000.0
    j = ("j",)
    agg = feed([S(h - 40, energy_joules=0.0, job_ids=j), S(h - 30, job_ids=j),
                S(h - 20, energy_joules=9000.0, job_ids=j)])
    assert {k[3]: a.energy_j for k, a in agg.hours.items()} == {h - HOUR_S: 9000.0}
    agg = feed([S(h, energy_joules=0.0, job_ids=j), S(h + 10, job_ids=j), S(h + 20, energy_joules=9000.0, job_ids=j)])
    assert {k[3]: a.energy_j for k, a in agg.hours.items()} == {h: 9000.0}  # from a reading at the hour itself


def test_the_fast_paths_leave_a_stretch_across_an_hour_to_the_per_sample_path():
    """add_many's columnar run and add_series' folds (the matrix one and the per-series one) leave what add() one by
    one leaves, bit for bit, for a long run whose missed readings straddle an hour."""
    from gpuledger.collector.series import series_from_samples

    h = 3_600_000.0
    run = [S(h - 200 + 10.0 * i, energy_joules=None if i in (18, 19, 20) else 3000.0 * i, power_watts=300.0,
             job_ids=("j", "k"), job_shares=(0.25, 0.75)) for i in range(40)]
    slow = feed(run)
    assert {k[3] for k in slow.hours} == {h - HOUR_S, h}
    fast = Aggregator()
    fast.add_many(run[:20])
    fast.add_many(run[20:])
    assert state(fast) == state(slow)
    for small in (10**9, 0):  # the matrix fold and _fold_series
        agg = Aggregator()
        agg.small_series_rows = small
        folded, rest = agg.add_series([series_from_samples(run[:20])])  # ends in missed readings: folded
        assert len(folded) == 1 and not rest
        folded, rest = agg.add_series([series_from_samples(run[20:])])  # reads back: sample by sample
        assert not folded and len(rest) == 20
        agg.add_many(rest)
        assert_same_sums(agg, slow)
        assert agg.gpu_totals() == slow.gpu_totals()
    # each hour 300 W x its seconds, all the jobs'
    for a in slow.hours.values():
        assert a.energy_j == pytest.approx(300.0 * a.observed_s, rel=1e-12)
        assert a.job_energy_j == pytest.approx(a.energy_j, rel=1e-12)
    assert usage(slow)[("j", "h1", "G0")].energy_joules == pytest.approx(0.25 * 3000.0 * 39, rel=1e-12)


def test_columnar_paths_refuse_a_reading_after_a_missed_one_only():
    from gpuledger.collector.series import series_from_samples

    gk = ("h1", "G0", "")
    clean = [S(float(t), energy_joules=100.0 * t, power_watts=100.0, job_ids=("j",)) for t in range(40)]
    missed = [replace(s, energy_joules=None) if s.ts == 20 else s for s in clean]
    none = [replace(s, energy_joules=None) for s in clean]  # a GPU without the counter
    assert not Aggregator()._add_run(gk, missed) and Aggregator()._add_run(gk, none)
    assert Aggregator()._add_run(gk, missed[:21])  # ends in the missed reading: nothing reads back yet
    for small in (10**9, 0):  # the matrix fold and _fold_series
        agg = Aggregator()
        agg.small_series_rows = small
        folded, rest = agg.add_series([series_from_samples(missed[:21])])
        assert len(folded) == 1 and not rest
        folded, rest = agg.add_series([series_from_samples(missed[21:])])  # its anchor missed the counter
        assert not folded and len(rest) == 19
        agg.add_many(rest)
        assert agg.gpu_totals()[gk] == (39.0, 3900.0)
        agg = Aggregator()
        agg.small_series_rows = small
        assert [len(agg.add_series([series_from_samples(part)])[0]) for part in (none[:21], none[21:])] == [1, 1]


def test_every_arrival_order_of_a_missed_reading_stretch_gives_the_same_totals():
    """Every order of the samples after the in-order ones (all within the late window) gives the totals, hour
    buckets and job energy of in-order arrival; with a 10 s window the reading the rule reads back is out of the
    late window, and kept (Aggregator.read_floor). The totals exactly: every value is an integer number of joules,
    so no sum depends on the order of its terms. The hours to the last ulps: a stretch across the hour may spread
    thirds of joules (while a sample is still to come), and a late sample's undo and redo add them in another
    order."""
    import itertools

    h = 3_600_000.0  # an hour boundary: the stretch crosses it
    before = h - HOUR_S
    j, jk = ("j",), ("j", "k")
    cases = [  # (window_s, in order, then every order of the rest, GPU energy, job energy, hour energy)
        # (h-10, h] catches up 4000 - 2000 J of (h-30, h]: the rest of (h-20, h-10]'s power, half of it for
        # (h-30, h-20] (the hour before's) and half for itself (the hour h's)
        (600.0, [S(h - 40, energy_joules=0.0, power_watts=100.0, job_ids=j)],
         [S(h - 30, energy_joules=1000.0, power_watts=100.0, job_ids=j), S(h - 20, job_ids=j),
          S(h - 10, power_watts=200.0, job_ids=j), S(h, energy_joules=5000.0, power_watts=100.0, job_ids=j),
          S(h + 10, job_ids=jk), S(h + 20, energy_joules=6500.0, power_watts=100.0, job_ids=jk),
          S(h + 30, energy_joules=7000.0, job_ids=("k",))],
         7000.0, {"j": 5750.0, "k": 1250.0}, {before: 3000.0 + 1000.0, h: 1000.0 + 1500.0 + 500.0}),
        (10.0, [S(h - 20, energy_joules=0.0, job_ids=j), S(h - 10, energy_joules=1000.0, job_ids=j),
                S(h, energy_joules=3000.0, job_ids=j)],
         [S(h + 10, job_ids=j), S(h + 15, power_watts=200.0, job_ids=j), S(h + 20, energy_joules=6000.0, job_ids=j)],
         6000.0, {"j": 6000.0}, {before: 1000.0, h: 5000.0}),
    ]
    for window_s, head, tail, gpu_j, job_j, hour_j in cases:
        def totals(agg):
            return (agg.gpu_totals(), {k: u.energy_joules for k, u in usage(agg).items()},
                    {k: a.observed_s for k, a in agg.hours.items()})

        def hours(agg):  # (bucket, field) -> value: what pytest.approx compares
            return {(k[3], f): getattr(a, f) for k, a in agg.hours.items() for f in ("energy_j", "job_energy_j")}

        first = feed([*head, *tail], window_s=window_s)
        want, want_hours = totals(first), hours(first)
        assert want[0][("h1", "G0", "")][1] == gpu_j
        assert want[1] == {(job, "h1", "G0"): e for job, e in job_j.items()}
        # every hour's energy is the jobs' (no idle time here)
        assert want_hours == pytest.approx({(hb, f): e for hb, e in hour_j.items()
                                            for f in ("energy_j", "job_energy_j")}, rel=1e-12)
        for order in itertools.permutations(tail):
            agg = feed([*head, *order], window_s=window_s)
            assert totals(agg) == want, order
            assert hours(agg) == pytest.approx(want_hours, rel=1e-12), order


def state(agg: Aggregator) -> tuple:
    gpus = {k: (g.totals(), g.ts[g.start :], g.samples[g.start :]) for k, g in agg.gpus.items()}
    return ({k: a.values() for k, a in agg.usage.items()}, {k: a.values() for k, a in agg.hours.items()}, gpus)


def random_batches(seq: list[GpuSample], rnd, n_late: int) -> list[list[GpuSample]]:
    """Batches of random sizes, ``n_late`` of them with an earlier sample mixed in again (a late or duplicate
    one: that GPU then goes one by one)."""
    batches, i = [], 0
    while i < len(seq):
        n = rnd.choice([1, 5, 16, 40, 200])
        batches.append(seq[i : i + n])
        i += n
    for _ in range(n_late):
        k = rnd.randrange(len(batches))
        batches[k] = batches[k] + [rnd.choice(seq)]
    return batches


@settings(max_examples=150, deadline=None)
@given(long_runs(), st.randoms(use_true_random=False), st.integers(0, 6))
def test_add_many_columnar_path_is_bit_exact(seq, rnd, n_late):
    batches = random_batches(seq, rnd, n_late)
    fast, slow = Aggregator(power_caps=CAPS), Aggregator(power_caps=CAPS)
    for b in batches:
        counts, accepted = fast.add_many(b)
        results = [slow.add(s) for s in sorted(b, key=lambda s: s.ts)]
        assert counts.accepted == results.count(ACCEPTED) == len(accepted)
        assert counts.duplicate == results.count(DUPLICATE) and counts.too_late == results.count(TOO_LATE)
        assert fast.take_dirty() == slow.take_dirty()
    assert state(fast) == state(slow)  # exact equality: floats bit for bit


# -- the series path (add_series) is bit-for-bit the per-sample one too ---------------------------


def as_series(samples: list[GpuSample]) -> list:
    """Consecutive samples with the same constants as one Series each (what an agent's batch holds)."""
    from gpuledger.collector.series import series_from_samples

    out, run = [], []
    for s in samples:
        key = (s.gpu_uuid, s.model, s.job_ids, s.job_shares)
        if run and key != (run[-1].gpu_uuid, run[-1].model, run[-1].job_ids, run[-1].job_shares):
            out.append(series_from_samples(run))
            run = []
        run.append(s)
    if run:
        out.append(series_from_samples(run))
    return out


def pair_fields(rows) -> list[tuple]:
    return [
        (
            r.ts,
            r.energy_joules,
            r.power_watts,
            r.sm_active_ratio,
            r.dram_bw_ratio,
            r.tensor_active_ratio,
            r.sm_occupancy_ratio,
            tuple(r.job_ids),
            tuple(r.job_shares),
        )
        for r in rows
    ]


def fold_both(fast: Aggregator, slow: Aggregator, series: list, samples: list) -> None:
    """One batch: ``series`` through add_series (what it leaves through add_many) into ``fast``, its ``samples``
    one by one through add() into ``slow``; both accept as many and dirty the same keys."""
    folded, rest = fast.add_series(series)
    counts, _ = fast.add_many(rest)
    results = [slow.add(s) for s in sorted(samples, key=lambda s: s.ts)]
    assert sum(x.n for x in folded) + counts.accepted == results.count(ACCEPTED)
    assert fast.take_dirty() == slow.take_dirty()


def assert_same_sums(fast: Aggregator, slow: Aggregator) -> None:
    assert {k: a.values() for k, a in fast.usage.items()} == {k: a.values() for k, a in slow.usage.items()}
    assert {k: a.values() for k, a in fast.hours.items()} == {k: a.values() for k, a in slow.hours.items()}


@pytest.mark.parametrize("small_rows", [0, 64, 10**9], ids=["columnar", "by-size", "plain-python"])
@settings(max_examples=100, deadline=None)
@given(long_runs(), st.randoms(use_true_random=False), st.integers(0, 4))
def test_add_series_is_bit_exact(small_rows, seq, rnd, n_late):
    """Both series paths (numpy columns; plain Python floats for a batch's few rows per GPU) against add()."""
    batches = random_batches(seq, rnd, n_late)
    fast, slow = Aggregator(power_caps=CAPS), Aggregator(power_caps=CAPS)
    fast.small_series_rows = small_rows
    for b in batches:
        series = as_series(sorted(b, key=lambda s: (s.gpu_uuid, s.ts)))
        rnd.shuffle(series)  # a batch's series in any order
        fold_both(fast, slow, series, b)
    assert_same_sums(fast, slow)
    for k, g in slow.gpus.items():
        f = fast.gpus[k]
        assert f.totals() == g.totals()
        assert f.ts[f.start :] == g.ts[g.start :]
        assert pair_fields(f.rows()[f.start :]) == pair_fields(g.samples[g.start :])


def test_matrix_fold_takes_clean_in_order_series_only():
    from gpuledger.collector.series import series_from_samples

    gk = ("h1", "G0", "")

    def one(samples):
        return [(gk, series_from_samples(samples))]

    clean = [S(float(t), energy_joules=100.0 * t, power_watts=100.0, job_ids=("j",), model="H200") for t in range(10)]
    agg = Aggregator()
    assert agg._fold_columns(one(clean)) == [True]
    later = [S(s.ts + 10, energy_joules=s.energy_joules + 1000, power_watts=100.0, job_ids=("j",)) for s in clean]
    assert agg._fold_columns(one(later)) == [True]
    assert agg.gpus[gk].observed_s == 19.0 and agg.gpus[gk].energy_j == 1900.0
    before = state(agg)
    assert agg._fold_columns(one(later)) == [False]  # not after the watermark
    gap = [S(s.ts + 1000, energy_joules=s.energy_joules + 1e5, job_ids=("j",)) for s in later]
    assert agg._fold_columns(one(gap)) == [False]
    back = [S(s.ts + 10, energy_joules=s.energy_joules - 5000, job_ids=("j",)) for s in later]
    assert agg._fold_columns(one(back)) == [False]
    jump = [S(s.ts + 10, energy_joules=s.energy_joules + 1e6, job_ids=("j",)) for s in later]
    assert agg._fold_columns(one(jump)) == [False]
    assert state(agg) == before  # a refused series changes nothing
    assert Aggregator(power_caps={"H200": 50.0})._fold_columns(one(clean)) == [False]  # 100 W > 50 W cap


def test_matrix_fold_refuses_one_gpu_and_folds_the_others():
    from gpuledger.collector.series import series_from_samples

    agg = Aggregator()
    first = [(("h1", f"G{g}", ""), series_from_samples([S(float(t), gpu=f"G{g}", energy_joules=100.0 * t,
                                                           job_ids=("j",)) for t in range(10)])) for g in range(4)]
    assert agg._fold_columns(first) == [True] * 4
    bad = 2  # its counter steps back: the per-sample path's
    second = [(gk, series_from_samples([S(float(t), gpu=gk[1], energy_joules=100.0 * t - (5000.0 if g == bad else 0.0),
                                          job_ids=("j",)) for t in range(10, 20)])) for g, (gk, _) in enumerate(first)]
    assert agg._fold_columns(second) == [True, True, False, True]
    assert [agg.gpus[gk].watermark for gk, _ in first] == [19.0, 19.0, 9.0, 19.0]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.data_too_large, HealthCheck.too_slow, HealthCheck.large_base_example])
@given(st.lists(long_runs(), min_size=2, max_size=4), st.randoms(use_true_random=False))
def test_many_gpus_in_one_call_are_bit_exact(runs, rnd):
    """A group commit hands add_series many hosts' series at once: the matrices hold them all, each GPU as the
    per-sample path would have it."""
    fast, slow = Aggregator(power_caps=CAPS), Aggregator(power_caps=CAPS)
    per_host = [[replace(s, host=f"h{i}") for s in run] for i, run in enumerate(runs)]
    batches = [random_batches(seq, rnd, 0) for seq in per_host]
    for k in range(max(map(len, batches))):
        group = [s for b in batches if k < len(b) for s in b[k]]
        series = [x for b in batches if k < len(b) for x in as_series(sorted(b[k], key=lambda s: (s.gpu_uuid, s.ts)))]
        rnd.shuffle(series)
        fold_both(fast, slow, series, group)
    assert_same_sums(fast, slow)
    assert {k: g.totals() for k, g in fast.gpus.items()} == {k: g.totals() for k, g in slow.gpus.items()}
