"""Shared-GPU and MIG splitting conserve exactly (math.fsum equality), whatever the inputs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.agent.sharing import split_mig_energy, split_shares

job_lists = st.lists(st.from_regex(r"[1-9][0-9]{0,7}(_[0-9]{1,3})?", fullmatch=True), min_size=1, max_size=12,
                     unique=True)
mems = st.one_of(st.none(), st.integers(min_value=0, max_value=2**47))


@given(job_lists, st.data())
def test_split_shares_sum_to_exactly_one(jobs: list[str], data: st.DataObject) -> None:
    mem = data.draw(st.one_of(st.none(), st.fixed_dictionaries({j: mems for j in jobs})))
    shares = split_shares(jobs, mem)
    assert len(shares) == len(jobs)
    assert math.fsum(shares) == 1.0
    assert all(0.0 <= s <= 1.0 for s in shares)


@given(job_lists, st.lists(st.integers(min_value=1, max_value=2**40), min_size=12, max_size=12))
def test_split_shares_follow_memory_when_all_known(jobs: list[str], mem_values: list[int]) -> None:
    mem = dict(zip(jobs, mem_values))
    shares = split_shares(jobs, mem)
    total = sum(mem.values())
    for j, s in zip(jobs, shares):
        assert s == pytest.approx(mem[j] / total, rel=1e-12, abs=1e-15)


def test_split_shares_equal_when_memory_unknown_or_zero() -> None:
    assert split_shares(["1", "2", "3"], None) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert split_shares(["1", "2"], {"1": 10, "2": None}) == (0.5, 0.5)
    assert split_shares(["1", "2"], {"1": 10}) == (0.5, 0.5)  # one job's memory missing
    assert split_shares(["1", "2"], {"1": 0, "2": 0}) == (0.5, 0.5)
    assert split_shares(["1", "2"], {"1": 3 * 2**30, "2": 2**30}) == (0.75, 0.25)
    assert split_shares([], None) == ()
    assert math.fsum(split_shares([str(i) for i in range(7)], None)) == 1.0


def test_split_shares_follow_the_time_each_job_ran_before_memory() -> None:
    # job 1 computes 60% of the interval holding 1 GiB; job 2 holds 30 GiB and computes 20%
    mem = {"1": 2**30, "2": 30 * 2**30}
    assert split_shares(["1", "2"], mem, {"1": 0.6, "2": 0.2}) == (0.75, 0.25)
    assert split_shares(["1", "2"], mem, {"1": 0.6, "2": 0.0}) == (1.0, 0.0)  # only job 1 ran: it pays it all
    # a basis known for some jobs only is not used: memory, then equal shares
    assert split_shares(["1", "2"], mem, {"1": 0.6, "2": None}) == pytest.approx((1 / 31, 30 / 31), rel=1e-15)
    assert split_shares(["1", "2"], mem, {"1": 0.6}) == pytest.approx((1 / 31, 30 / 31), rel=1e-15)
    assert split_shares(["1", "2"], {"1": 1, "2": None}, {"1": 0.6, "2": None}) == (0.5, 0.5)
    # nobody ran (an idle interval): the memory rule
    assert split_shares(["1", "2"], mem, {"1": 0.0, "2": 0.0}) == pytest.approx((1 / 31, 30 / 31), rel=1e-15)
    assert split_shares(["1", "2"], mem, {"1": math.nan, "2": 0.5}) == pytest.approx((1 / 31, 30 / 31), rel=1e-15)


@given(job_lists, st.data())
def test_split_shares_by_time_sum_to_exactly_one(jobs: list[str], data: st.DataObject) -> None:
    busy = data.draw(st.fixed_dictionaries({j: st.one_of(st.none(), st.floats(0.0, 1.0)) for j in jobs}))
    shares = split_shares(jobs, None, busy)
    assert math.fsum(shares) == 1.0
    assert all(0.0 <= s <= 1.0 for s in shares)
    total = math.fsum(v for v in busy.values() if v is not None)
    if None not in busy.values() and total > 0:
        for j, s in zip(jobs, shares):
            assert s == pytest.approx(busy[j] / total, rel=1e-9, abs=1e-12)


def test_split_shares_rejects_duplicates() -> None:
    with pytest.raises(ValueError):
        split_shares(["1", "1"], None)


instance_lists = st.lists(
    st.tuples(
        st.floats(min_value=1e-3, max_value=1.0),
        st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0)),
    ),
    min_size=1,
    max_size=7,
)


@settings(max_examples=300)
@given(
    st.floats(min_value=0.0, max_value=1e9, allow_nan=False),
    instance_lists,
    st.one_of(st.none(), st.floats(min_value=0.0, max_value=2e9)),
)
def test_mig_energy_is_conserved(energy: float, raw: list[tuple[float, float | None]], floor: float | None) -> None:
    instances = [(f"{i}.0", frac, act) for i, (frac, act) in enumerate(raw)]
    parts = split_mig_energy(energy, instances, idle_floor_j=floor)
    assert set(parts) == {i[0] for i in instances}
    assert math.fsum(parts.values()) == energy
    assert all(v >= 0.0 for v in parts.values())


def test_mig_energy_rule_floor_by_slice_rest_by_activity() -> None:
    # 700 J over the interval, 100 J of it idle floor; a 3g slice busy at 0.8, a 4g slice idle.
    parts = split_mig_energy(700.0, [("1.0", 3 / 7, 0.8), ("2.0", 4 / 7, 0.0)], idle_floor_j=100.0)
    assert parts["2.0"] == pytest.approx(100.0 * 4 / 7)
    assert parts["1.0"] == pytest.approx(100.0 * 3 / 7 + 600.0)
    assert math.fsum(parts.values()) == 700.0


def test_mig_energy_two_busy_instances_weighted_by_slice_times_activity() -> None:
    parts = split_mig_energy(90.0, [("a", 0.5, 1.0), ("b", 0.25, 1.0)])
    assert parts == {"a": pytest.approx(60.0), "b": pytest.approx(30.0)}


def test_mig_energy_unknown_or_zero_activity_falls_back_to_slices() -> None:
    assert split_mig_energy(10.0, [("a", 1 / 7, None), ("b", 6 / 7, 1.0)]) == {
        "a": pytest.approx(10 / 7),
        "b": pytest.approx(60 / 7),
    }
    assert split_mig_energy(8.0, [("a", 0.25, 0.0), ("b", 0.25, 0.0)]) == {"a": 4.0, "b": 4.0}


def test_mig_energy_floor_is_clamped_to_the_energy() -> None:
    parts = split_mig_energy(50.0, [("a", 0.5, 1.0), ("b", 0.5, 0.0)], idle_floor_j=80.0)
    assert parts == {"a": 25.0, "b": 25.0}


def test_mig_energy_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        split_mig_energy(-1.0, [("a", 1.0, None)])
    with pytest.raises(ValueError):
        split_mig_energy(1.0, [])
    with pytest.raises(ValueError):
        split_mig_energy(1.0, [("a", 0.0, None)])
    with pytest.raises(ValueError):
        split_mig_energy(1.0, [("a", 0.5, None), ("a", 0.5, None)])
    assert split_mig_energy(0.0, []) == {}
