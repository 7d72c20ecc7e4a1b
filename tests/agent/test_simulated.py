"""The simulated source: deterministic, plausible per profile, and exact about energy."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.agent.sources import make_source
from gpuledger.agent.sources.simulated import PROFILES, SimulatedSource
from gpuledger.schema.records import RATIO_FIELDS


class FakeClock:
    """Hand-driven time: the simulation advances only when the test says so."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def run(src: SimulatedSource, clock: FakeClock, steps: int, dt: float = 10.0) -> list[list]:
    out = [src.sample()]
    for _ in range(steps):
        clock.advance(dt)
        out.append(src.sample())
    return out


def test_registry_builds_it() -> None:
    src = make_source("simulated", gpus=2, clock=FakeClock())
    assert isinstance(src, SimulatedSource) and src.name == "simulated"
    assert len(src.sample()) == 2


def test_same_seed_same_values_and_different_seed_differs() -> None:
    profiles = {0: "training", 1: "inference", 2: "dataloader-stall", 3: "idle"}
    a = run(SimulatedSource(gpus=5, seed=7, clock=(ca := FakeClock()), profiles=profiles), ca, 20)
    b = run(SimulatedSource(gpus=5, seed=7, clock=(cb := FakeClock()), profiles=profiles), cb, 20)
    c = run(SimulatedSource(gpus=5, seed=8, clock=(cc := FakeClock()), profiles=profiles), cc, 20)
    assert a == b
    assert [s.power_watts for batch in a for s in batch] != [s.power_watts for batch in c for s in batch]


def test_sample_shape_and_identity() -> None:
    clock = FakeClock()
    src = SimulatedSource(host="n1", gpus=3, clock=clock, profiles={0: "training"})
    batch = src.sample()
    assert [s.gpu_index for s in batch] == [0, 1, 2]
    for s in batch:
        assert s.ts == clock.t and s.host == "n1" and s.model == "NVIDIA H200" and s.source == "simulated"
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", s.gpu_uuid)
        assert s.mem_total_bytes == 141_000_000_000
        assert s.mig is None
        for f in RATIO_FIELDS:
            v = getattr(s, f)
            assert v is None or 0.0 <= v <= 1.0
    assert len({s.gpu_uuid for s in batch}) == 3
    # UUIDs depend on (host, index) only, not on the seed.
    assert SimulatedSource(host="n1", gpus=3, seed=99, clock=clock).sample()[2].gpu_uuid == batch[2].gpu_uuid
    assert SimulatedSource(host="n2", gpus=3, clock=clock).sample()[2].gpu_uuid != batch[2].gpu_uuid


def test_first_sample_has_realistic_counter_and_no_elapsed_energy() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=2, clock=clock, profiles={0: "training"})
    first = src.sample()
    assert all(1e6 <= s.energy_joules <= 50e6 for s in first)
    assert src.truth(0) == (0.0, 0.0)
    # Same time again: zero-length interval, counter unchanged.
    assert [s.energy_joules for s in src.sample()] == [s.energy_joules for s in first]


@pytest.mark.parametrize(
    ("profile", "sm", "dram", "power"),
    [
        ("training", (0.8, 1.0), (0.3, 0.5), (560.0, 700.0)),
        ("inference", (0.2, 0.4), (0.7, 0.9), (300.0, 480.0)),
        ("idle", (0.0, 0.0), (0.0, 0.0), (75.0, 78.0)),
        (None, (0.0, 0.0), (0.0, 0.0), (75.0, 78.0)),
    ],
)
def test_profile_levels(profile, sm, dram, power) -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=1, clock=clock, profiles={0: profile})
    samples = [b[0] for b in run(src, clock, 60)]
    for s in samples:
        assert sm[0] <= s.sm_active_ratio <= sm[1], s
        assert dram[0] <= s.dram_bw_ratio <= dram[1], s
        assert power[0] <= s.power_watts <= power[1], s
        assert 75.0 <= s.power_watts <= 700.0
    if profile in ("training", "inference"):
        assert all(s.gpu_util_ratio >= 0.85 and s.sm_clock_hz == 1.98e9 for s in samples)
        assert all(s.mem_used_bytes > 50e9 for s in samples)
        assert all(s.tensor_active_ratio <= s.sm_active_ratio for s in samples)
    if profile == "idle":
        # Allocated but idle: nothing runs, yet a context holds some memory.
        assert all(s.sm_active_ratio == 0.0 and s.gpu_util_ratio == 0.0 and s.mem_used_bytes > 0 for s in samples)
    if profile is None:
        assert all(s.mem_used_bytes == 0 and s.sm_clock_hz < 1e9 for s in samples)


def test_temperature_rises_with_power() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=2, clock=clock, profiles={0: "training", 1: "idle"})
    busy, idle = run(src, clock, 5)[-1]
    assert busy.temp_celsius > idle.temp_celsius + 20


def test_energy_counter_is_exact_integral_of_power() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=4, clock=clock, profiles={0: "training", 1: "inference", 2: "dataloader-stall"})
    batches = [src.sample()]
    dts = [10.0, 0.5, 37.25, 10.0, 1e-3, 300.0, 10.0]
    for i, dt in enumerate(dts * 10):
        if i == 20:
            src.set_profile(3, "training")
        clock.advance(dt)
        batches.append(src.sample())
    for g in range(4):
        series = [b[g] for b in batches]
        integral = 0.0
        sm_seconds = 0.0
        for prev, cur in zip(series, series[1:]):
            integral += cur.power_watts * (cur.ts - prev.ts)
            sm_seconds += cur.sm_active_ratio * (cur.ts - prev.ts)
        counted = series[-1].energy_joules - series[0].energy_joules
        truth_e, truth_sm = src.truth(g)
        assert counted == pytest.approx(integral, rel=1e-12)
        assert truth_e == pytest.approx(integral, rel=1e-12)
        assert truth_sm == pytest.approx(sm_seconds, rel=1e-12)
        # The counter never decreases.
        assert all(b.energy_joules >= a.energy_joules for a, b in zip(series, series[1:]))


@settings(max_examples=40, deadline=None)
@given(
    dts=st.lists(st.floats(min_value=0.0, max_value=600.0, allow_nan=False), min_size=1, max_size=40),
    seed=st.integers(0, 2**32),
    profile=st.sampled_from([*PROFILES, None]),
)
def test_energy_property(dts: list[float], seed: int, profile: str | None) -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=1, seed=seed, clock=clock, profiles={0: profile})
    first = src.sample()[0]
    integral = 0.0
    prev = first
    for dt in dts:
        clock.advance(dt)
        cur = src.sample()[0]
        integral += cur.power_watts * (cur.ts - prev.ts)
        assert src.idle_watts <= cur.power_watts <= src.tdp_watts
        prev = cur
    assert src.truth(0)[0] == pytest.approx(integral, rel=1e-9, abs=1e-6)
    assert prev.energy_joules - first.energy_joules == pytest.approx(integral, rel=1e-9, abs=1e-6)


def test_clock_stepping_back_adds_no_energy() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=1, clock=clock, profiles={0: "training"})
    src.sample()
    clock.advance(10)
    e1 = src.sample()[0].energy_joules
    clock.advance(-5)
    assert src.sample()[0].energy_joules == e1
    clock.advance(10)  # 5 s past the last good sample
    s = src.sample()[0]
    assert s.energy_joules == pytest.approx(e1 + 5 * s.power_watts, rel=1e-12)


def test_dataloader_stall_shows_periodic_drops() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=1, clock=clock, profiles={0: "dataloader-stall"})
    batches = run(src, clock, 180, dt=5.0)  # 15 minutes at 5 s
    series = [b[0] for b in batches[1:]]
    low = [s.ts for s in series if s.sm_active_ratio < 0.2]
    high = [s for s in series if s.sm_active_ratio > 0.8]
    assert low and high
    # Drops start once per 90 s period: group consecutive low samples into episodes.
    starts = [t for i, t in enumerate(low) if i == 0 or t - low[i - 1] > 5.0]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 9 and all(g == pytest.approx(90.0, abs=5.0) for g in gaps)
    # Stalls sit near idle power; busy intervals near TDP.
    assert max(s.power_watts for s in series if s.sm_active_ratio < 0.2) < 200
    assert min(s.power_watts for s in high) > 500
    # Over whole periods the SM-active time is 70/90 * 0.9 + 20/90 * 0.05.
    _, sm_seconds = src.truth(0)
    expected = (70 / 90 * 0.90 + 20 / 90 * 0.05) * 900
    assert sm_seconds == pytest.approx(expected, rel=0.03)


def test_set_profile_changes_the_next_interval_and_validates() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=2, clock=clock)
    src.sample()
    assert src.profile(0) is None
    src.set_profile(0, "training")
    clock.advance(10)
    s = src.sample()[0]
    assert s.sm_active_ratio > 0.8 and src.profile(0) == "training"
    src.set_profile(0, None)
    clock.advance(10)
    assert src.sample()[0].sm_active_ratio == 0.0
    with pytest.raises(ValueError, match="unknown profile 'bogus'"):
        src.set_profile(1, "bogus")
    with pytest.raises(IndexError, match="no GPU index 5"):
        src.set_profile(5, "idle")
    with pytest.raises(ValueError, match="gpus"):
        SimulatedSource(gpus=-1)
    with pytest.raises(ValueError, match="idle_watts"):
        SimulatedSource(idle_watts=800.0)


def test_fast_enough_for_the_demo() -> None:
    clock = FakeClock()
    src = SimulatedSource(gpus=32, clock=clock, profiles={i: list(PROFILES)[i % 4] for i in range(32)})
    t0 = time.perf_counter()
    run(src, clock, 360)
    assert time.perf_counter() - t0 < 2.0


def test_reports_the_secondary_fields_the_dashboards_chart() -> None:
    t = [1000.0]
    src = SimulatedSource(gpus=2, seed=1, clock=lambda: t[0], profiles={0: "training", 1: None})
    src.sample()
    t[0] += 10.0
    busy, free = src.sample()
    assert busy.fp32_active_ratio == pytest.approx(0.15 * busy.sm_active_ratio)
    assert busy.fp16_active_ratio == pytest.approx(0.5 * busy.tensor_active_ratio)
    assert busy.mem_copy_util_ratio == busy.dram_bw_ratio and busy.mem_clock_hz == 2.619e9
    assert busy.pcie_rx_bytes_per_second > busy.pcie_tx_bytes_per_second > 0
    assert free.throttle_reasons == 0x1 and busy.throttle_reasons in (0, 0x4)  # idle vs. working
    assert (busy.ecc_errors_total, busy.remapped_rows_total) == (0, 0)
