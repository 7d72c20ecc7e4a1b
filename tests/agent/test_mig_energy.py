"""MIG energy attribution: the GPU's energy moves onto its instances, summing exactly, never counted twice."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvml_fake import MIB, FakeGpu, FakeMigInstance, FakeNvml, FakeProcess, Scenario, busy_gpm

from gpuledger.agent.mig import MigEnergySplitter, slice_fraction
from gpuledger.agent.sources.nvml import NvmlSource
from gpuledger.schema.records import GpuSample


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def test_slice_fraction_from_profile_names():
    assert slice_fraction("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == 3 / 7
    assert slice_fraction("NVIDIA H200 MIG 1g.18gb+me") == 1 / 7
    assert slice_fraction("NVIDIA H200") is None
    # the A30 has 4 compute slices, not 7 (the captured A30 page: 4 x 1g.6gb fill the GPU)
    assert slice_fraction("NVIDIA A30 MIG 1g.6gb") == 1 / 4
    assert slice_fraction("NVIDIA A30 MIG 4g.24gb") == 1.0
    assert slice_fraction("NVIDIA A30X MIG 1g.6gb") == 1 / 7  # not an A30 by name: the common 7


def test_four_jobs_on_a_full_a30_are_charged_all_of_its_energy():
    from gpuledger.collector.aggregate import Aggregator

    agg = Aggregator()  # the rows as dcgm-exporter gives them: each instance repeats the GPU's counter
    rows = []
    for t in (0.0, 10.0, 20.0):
        rows.append(GpuSample(ts=1e9 + t, host="n1", gpu_uuid="A30-0", gpu_index=0, model="NVIDIA A30",
                              energy_joules=70.0 * t, power_watts=70.0))
        rows += [GpuSample(ts=1e9 + t, host="n1", gpu_uuid="A30-0", gpu_index=0, mig=str(gi),
                           model="NVIDIA A30 MIG 1g.6gb", energy_joules=70.0 * t, power_watts=70.0,
                           job_ids=(f"j{gi}",)) for gi in range(4)]
    agg.add_many(rows)
    usage = {u.job_id: u for u in agg.job_usage()}
    assert sorted(usage) == ["j0", "j1", "j2", "j3"]
    assert sum(u.energy_joules for u in usage.values()) == pytest.approx(1400.0)
    assert all(u.allocated_gpu_seconds == pytest.approx(20.0 / 4) for u in usage.values())


def test_nvml_mig_energy_split_by_activity_and_conserved():
    clock = Clock()
    gpu = FakeGpu(
        "GPU-mig", name="NVIDIA A100-SXM4-80GB", power_w=300.0,
        mig=[FakeMigInstance(1, "3g.40gb", gpm=busy_gpm(sm=80)), FakeMigInstance(2, "3g.40gb", gpm=busy_gpm(sm=10))],
        processes=[FakeProcess(100, 10 * MIB, gpu_instance=1), FakeProcess(200, 10 * MIB, gpu_instance=2)],
        gpm=busy_gpm(sm=45),
    )
    lib = FakeNvml(Scenario([gpu]), clock=clock)
    src = NvmlSource(lib=lib, host="n1", clock=clock)
    src.open()
    split = MigEnergySplitter(idle_watts=60.0)
    totals: dict[str, float] = {}
    counters = []
    for _ in range(5):
        out = split.map(src.sample())
        # The GPU's own counter at the same instant (the fake's energy follows its power on the clock).
        counters.append(lib.nvmlDeviceGetTotalEnergyConsumption(lib.nvmlDeviceGetHandleByIndex(0)) / 1000.0)
        clock.t += 2.0
        parent = next(s for s in out if s.mig is None)
        assert parent.energy_joules is None and parent.power_watts is None  # moved, never counted twice
        for s in out:
            if s.mig is not None:
                totals[s.mig] = s.energy_joules
    # The counters start at the GPU's counter split by slice, then each cycle's delta is split among the
    # instances: their virtual counters add up to the GPU's counter.
    assert counters[-1] - counters[0] == 4 * 2.0 * 300.0
    assert math.isclose(math.fsum(totals.values()), counters[-1], rel_tol=1e-12)
    assert totals["1"] - totals["2"] > 0  # the busy instance pays more
    assert totals["2"] > counters[0] / 2  # the idle one still pays its floor


def _inst(ts: float, mig: str, sm: float | None) -> GpuSample:
    return GpuSample(ts=ts, host="h", gpu_uuid="G", gpu_index=0, model=f"X MIG {mig}g.10gb", mig=mig,
                     sm_active_ratio=sm)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.1, 100), st.floats(0, 5000), st.floats(0, 1), st.floats(0, 1)),
                   min_size=1, max_size=20),
    idle=st.one_of(st.none(), st.floats(0, 200)),
)
def test_split_conserves_energy_exactly(steps, idle):
    split = MigEnergySplitter(idle_watts=idle)
    ts, counter = 0.0, 1e6
    expected = counter  # the instances' counters start at the GPU's counter, split by slice
    out = []
    for i, (dt, de, a1, a2) in enumerate([(0.0, 0.0, 0.0, 0.0)] + steps):
        ts += dt
        counter += de
        expected += de if i else 0.0
        parent = GpuSample(ts=ts, host="h", gpu_uuid="G", gpu_index=0, model="X", energy_joules=counter)
        out = split.map([parent, _inst(ts, "1", a1), _inst(ts, "2", a2)])
    got = [s.energy_joules for s in out if s.mig is not None]
    assert math.isclose(math.fsum(got), expected, rel_tol=1e-9, abs_tol=1e-6)
    assert all(g >= 0 for g in got)


A100 = "NVIDIA A100-SXM4-80GB"


def _gpu(ts: float, counter: float | None, power: float | None) -> GpuSample:
    return GpuSample(ts=ts, host="h", gpu_uuid="G", gpu_index=0, model=A100, energy_joules=counter, power_watts=power)


def _instances(ts: float, layout: dict[str, str]) -> list[GpuSample]:
    return [GpuSample(ts=ts, host="h", gpu_uuid="G", gpu_index=0, model=f"{A100} MIG {profile}", mig=m,
                      sm_active_ratio=0.5) for m, profile in layout.items()]


def _instance_sum(out: list[GpuSample]) -> float:
    return math.fsum(s.energy_joules for s in out if s.mig is not None and s.energy_joules is not None)


def test_a_repartition_that_replaces_every_instance_keeps_the_gpus_energy():
    """7 x 1g.10gb re-partitioned into one 7g.80gb between two ticks (300 W): no instance is carried over, and
    the interval's energy still goes to the instances, so their counters sum to the GPU's counter."""
    split = MigEnergySplitter()
    seven = {str(gi): "1g.10gb" for gi in range(7, 14)}
    for k in range(6):
        ts, counter = 1e9 + 10.0 * k, 5e6 + 3000.0 * k
        out = split.map([_gpu(ts, counter, 300.0), *_instances(ts, seven if k < 3 else {"0": "7g.80gb"})])
        assert math.isclose(_instance_sum(out), counter, rel_tol=1e-12), k


def test_a_tick_without_the_counter_loses_no_energy_and_counts_none_twice():
    """300 W, the counter growing 3000 J per 10 s tick. Tick 3 reads neither power nor the counter; tick 5 reads
    power (a momentary 100 W) but not the counter. The counter's next reading settles both gaps: the instances'
    counters sum to the GPU's, neither one interval short nor power's credit counted again."""
    split = MigEnergySplitter(idle_watts=60.0)
    layout = {"1": "3g.40gb", "2": "4g.40gb"}
    for k in range(8):
        ts, counter = 1e9 + 10.0 * k, 5e6 + 3000.0 * k
        read = {3: (None, None), 5: (None, 100.0)}.get(k, (counter, 300.0))
        out = split.map([_gpu(ts, *read), *_instances(ts, layout)])
        if k == 3:  # nothing measured: no instance claims a counter value
            assert all(s.energy_joules is None for s in out)
        elif read[0] is not None:
            assert math.isclose(_instance_sum(out), counter, rel_tol=1e-12), k


def test_power_that_overstated_a_gap_is_paid_back_from_the_counters_later_growth():
    """The counter grows 1000 J per 10 s tick (100 W) but ticks 3-5 read only power, a momentary 700 W: power
    credits 21,000 J where the counter grew 3000 J. The surplus is not kept: later growth pays it back, and the
    instances' counters sum to the GPU's counter again (never more than it for good)."""
    split = MigEnergySplitter()
    layout = {"1": "3g.40gb", "2": "4g.40gb"}
    for k in range(30):
        ts, counter = 1e9 + 10.0 * k, 5e6 + 1000.0 * k
        read = (None, 700.0) if k in (3, 4, 5) else (counter, 100.0)
        out = split.map([_gpu(ts, *read), *_instances(ts, layout)])
        if k >= 23:  # 17,000 J owed at tick 6, paid back at 1000 J a tick
            assert math.isclose(_instance_sum(out), counter, rel_tol=1e-12), k
        elif read[0] is not None:
            assert _instance_sum(out) >= counter - 1e-6, k
