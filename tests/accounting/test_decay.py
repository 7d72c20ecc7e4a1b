"""Slurm's decay: hand-computed cases, a tick-by-tick simulation oracle, config parsing."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.decay import (
    SlurmConfigError,
    decayed_usage,
    decayed_usage_batch,
    last_reset_boundary,
    parse_priority_config,
    parse_slurm_duration,
    slurm_decay_factor,
)

REAL = DATA_ROOT / "slurm" / "real-22.05"
DF = 1 - 0.693 / 300  # Slurm's per-second factor for a 5-minute half-life


@pytest.mark.parametrize(
    "text, seconds",
    [("0-00:05:00", 300), ("00:05:00", 300), ("1-00:00:00", 86400), ("5", 300), ("7-0", 7 * 86400),
     ("2:30", 150), ("1-2:3", 93780), ("14-0", 14 * 86400)],
)
def test_parse_slurm_duration(text: str, seconds: int) -> None:
    assert parse_slurm_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "UNLIMITED", "1-", "5m", "1:2:3:4"])
def test_parse_slurm_duration_rejects(text: str) -> None:
    with pytest.raises(SlurmConfigError, match="bad Slurm duration"):
        parse_slurm_duration(text)


def test_real_scontrol_config() -> None:
    path = capture(REAL.relative_to(DATA_ROOT) / "scontrol-show-config-priority.txt")
    cfg = parse_priority_config(path.read_text())
    assert (cfg.half_life_s, cfg.calc_period_s, cfg.reset_period, cfg.flags) == (300, 60, "NONE", ())
    assert cfg.fair_tree and cfg.dampening == 1 and cfg.max_age_s == 86400
    assert cfg.weights == {"Age": 1000, "Assoc": 1000, "FairShare": 10000, "JobSize": 0, "Partition": 0, "QOS": 1000}


def test_config_errors_name_the_line() -> None:
    with pytest.raises(SlurmConfigError, match="line 2: PriorityDecayHalfLife"):
        parse_priority_config("PriorityType = x\nPriorityDecayHalfLife   = soon\n")
    with pytest.raises(SlurmConfigError, match="line 1: unknown PriorityUsageResetPeriod"):
        parse_priority_config("PriorityUsageResetPeriod = HOURLY\n")
    assert not parse_priority_config("PriorityFlags = NO_FAIR_TREE,SMALL_RELATIVE_TO_TIME\n").fair_tree


def test_factor() -> None:
    assert slurm_decay_factor(300) == DF and slurm_decay_factor(0) == 1.0
    assert DF**300 == pytest.approx(0.5, abs=5e-4)  # Slurm's approximation of a half-life


# Hand-computed, rate 1 per second, period 300 s, half-life 300 s.
@pytest.mark.parametrize(
    "start, end, now, expected",
    [
        (0, 600, 600, 300 * DF**600 + 300 * DF**300),  # added at ticks 300, 600; the first decays again
        (0, 450, 600, 300 * DF**600 + 150 * DF**150 * DF**300),  # ends mid-period, decayed at tick 600
        (0, 1000, 700, 300 * DF**600 + 300 * DF**300),  # running: [600, 700] not added until tick 900
        (100, 200, 250, 100 * DF**100),  # ended before the next tick: not decayed yet
        (100, 200, 300, 100 * DF**100 * DF**300),
        (50, 50, 400, 1 * DF**300),  # instantaneous charge of 1 at t=50, decayed at the tick 300
    ],
)
def test_hand_computed(start, end, now, expected) -> None:
    amount = end - start if end > start else 1.0
    got = decayed_usage([("k", start, end, amount)], now=now, half_life_s=300, calc_period_s=300)
    assert got["k"] == pytest.approx(expected, rel=1e-12)


def test_no_decay_and_daily_reset() -> None:
    midnight = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    charge = [("k", midnight - 600, midnight + 600, 1200)]
    assert decayed_usage(charge, midnight + 600, half_life_s=0) == {"k": 1200}
    # the reset at the midnight tick zeroes [-600, -300] but keeps [-300, 0], added after the reset
    assert decayed_usage(charge, midnight + 600, half_life_s=0, reset="DAILY") == {"k": 900}


@pytest.mark.parametrize(
    "period, when, boundary",
    [
        ("DAILY", datetime(2026, 11, 29, 16, 22), datetime(2026, 11, 29)),
        ("WEEKLY", datetime(2026, 11, 28, 9, 0), datetime(2026, 11, 22)),  # Saturday -> last Sunday
        ("WEEKLY", datetime(2026, 11, 29, 9, 0), datetime(2026, 11, 29)),  # a Sunday
        ("MONTHLY", datetime(2026, 11, 29), datetime(2026, 11, 1)),
        ("QUARTERLY", datetime(2026, 11, 29), datetime(2026, 10, 1)),
        ("YEARLY", datetime(2026, 11, 29), datetime(2026, 1, 1)),
    ],
)
def test_reset_boundaries(period, when, boundary) -> None:
    ts = when.replace(tzinfo=UTC).timestamp()
    assert last_reset_boundary(period, ts) == boundary.replace(tzinfo=UTC).timestamp()
    assert last_reset_boundary("NONE", ts) is None


def test_bad_charges() -> None:
    with pytest.raises(ValueError, match="charge 2 .*end 1 before start 5"):
        decayed_usage([("a", 0, 1, 1), ("b", 5, 1, 1)], now=10, half_life_s=60)
    with pytest.raises(ValueError, match="negative amount"):
        decayed_usage([("a", 0, 1, -1)], now=10, half_life_s=60)


def simulate(charges, now, df, P, reset_tick):
    """Oracle: walk every tick and job end like slurmctld's decay thread."""
    usage: dict = {}
    events = []  # (time, order, key, a, b, rate); order 0 = a job end between ticks
    for key, s, e, amount in charges:
        usage.setdefault(key, 0.0)
        if e == s:
            events.append((s, 0 if s % P else 2, key, s, s, None, amount))
            continue
        rate = amount / (e - s)
        t = math.floor(s / P) * P + P
        while t < e:
            events.append((t, 2, key, max(s, t - P), t, rate, None))
            t += P
        events.append((e, 0 if e % P else 2, key, max(s, math.ceil(e / P) * P - P), e, rate, None))
    ticks = range(0, math.floor(now / P) * P + 1, P)
    for t in ticks:
        events.append((t, 1, None, 0, 0, None, None))
    for t, order, key, a, b, rate, amount in sorted(events, key=lambda ev: (ev[0], ev[1])):
        if t > now:
            break
        if order == 1:  # the tick: reset, then decay everything
            if t == reset_tick:
                usage = {k: 0.0 for k in usage}
            usage = {k: v * df**P for k, v in usage.items()}
        else:
            usage[key] += amount if rate is None else rate * (b - a) * df ** (b - a)
    return usage


charge = st.tuples(st.sampled_from("xyz"), st.integers(0, 3000), st.integers(0, 1500), st.floats(0, 1e4))


@settings(max_examples=200, deadline=None)
@given(st.lists(charge, max_size=6), st.integers(0, 5000), st.sampled_from([60, 300]), st.sampled_from([0, 120, 600]))
def test_matches_tick_by_tick_simulation(raw, now, period, half_life) -> None:
    charges = [(k, s, s + d, a) for k, s, d, a in raw]
    got = decayed_usage(charges, now=now, half_life_s=half_life, calc_period_s=period)
    want = simulate(charges, now, slurm_decay_factor(half_life), period, reset_tick=None)
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(charge, max_size=5), st.integers(0, 86400), st.sampled_from([60, 300]))
def test_daily_reset_matches_simulation(raw, offset, period) -> None:
    midnight = 20 * 86400  # an epoch day boundary (UTC)
    charges = [(k, midnight - 3000 + s, midnight - 3000 + s + d, a) for k, s, d, a in raw]
    now = midnight - 3000 + offset
    got = decayed_usage(charges, now=now, half_life_s=600, calc_period_s=period, reset="DAILY")
    boundary = midnight if now >= midnight else midnight - 86400
    want = simulate(charges, now, slurm_decay_factor(600), period, reset_tick=boundary)
    for k in got:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-9)


# float times, ticks and job ends off and on the grid, instantaneous charges, several pieces per key
timed = st.tuples(st.sampled_from("xyz"), st.one_of(st.integers(0, 3000), st.floats(0, 3000)),
                  st.one_of(st.just(0), st.integers(0, 1500), st.floats(0, 1500)), st.floats(0, 1e4))


@settings(max_examples=300, deadline=None)
@given(st.lists(timed, max_size=12), st.one_of(st.integers(0, 5000), st.floats(0, 5000)),
       st.sampled_from([60, 300]), st.sampled_from([0, 120, 600]), st.sampled_from(["NONE", "DAILY"]),
       st.sampled_from([0, 86400 - 1800]))
def test_batch_is_the_reference_to_the_bit(raw, now, period, half_life, reset, day) -> None:
    charges = [(k, day + s, day + s + d, a) for k, s, d, a in raw]
    args = {"now": day + now, "half_life_s": half_life, "calc_period_s": period, "reset": reset, "tz": "UTC"}
    want = decayed_usage(charges, **args)
    got = decayed_usage_batch(charges, **args)
    assert list(got) == list(want)  # the same keys in the same order
    assert [v.hex() for v in got.values()] == [float(v).hex() for v in want.values()]


def test_batch_rejects_as_the_reference() -> None:
    with pytest.raises(ValueError, match="charge 2 .*end 1 before start 5"):
        decayed_usage_batch([("a", 0, 1, 1), ("b", 5, 1, 1)], now=10, half_life_s=60)
    with pytest.raises(ValueError, match="charge 1 .*must be finite"):
        decayed_usage_batch([("a", 0, math.inf, 1)], now=10, half_life_s=60)
    with pytest.raises(ValueError, match="calc_period_s"):
        decayed_usage_batch([("a", 0, 1, 1)], now=10, half_life_s=60, calc_period_s=0)
    assert decayed_usage_batch([], now=10, half_life_s=60) == {}
