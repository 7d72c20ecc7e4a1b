"""Fairshare edge cases (parent shares, zero shares, zero usage, ties, dampening) and invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.accounting.associations import Assoc, AssocTree
from gpuledger.accounting.fairshare import UsageError, assoc_fairshare, classic, fair_tree


def tree(csv_body: str) -> AssocTree:
    return AssocTree.from_csv("account,parent,user,shares\n" + csv_body)


def by_key(rows):
    return {(r.account, r.user): r for r in rows}


def test_tied_users_share_a_rank_and_later_ranks_skip() -> None:
    t = tree("a,,,1\na,,u1,1\na,,u2,1\na,,u3,1\n")
    fs = assoc_fairshare(fair_tree(t, {("a", "u1"): 5, ("a", "u2"): 5, ("a", "u3"): 50}))
    assert fs == {("a", "u1"): 1.0, ("a", "u2"): 1.0, ("a", "u3"): 1 / 3}


def test_parent_user_ranks_first_with_no_levelfs_and_its_accounts_shares() -> None:
    t = tree("a,,,3\na,,heavy,parent\na,,light,1\nb,,,1\nb,,x,1\n")
    rows = by_key(fair_tree(t, {("a", "heavy"): 1000, ("a", "light"): 1, ("b", "x"): 1}))
    heavy = rows[("a", "heavy")]
    assert heavy.raw_shares == "parent" and heavy.level_fs is None
    assert heavy.norm_shares == rows[("a", None)].norm_shares == 0.75
    assert heavy.fairshare == 1.0 or heavy.fairshare > rows[("a", "light")].fairshare
    # classic: a parent user takes its account's effective usage and shares, hence its factor
    c = by_key(classic(t, {("a", "heavy"): 1000, ("a", "light"): 1, ("b", "x"): 1}))
    assert c[("a", "heavy")].fairshare == c[("a", None)].fairshare
    assert c[("a", "heavy")].effective_usage == c[("a", None)].effective_usage


def test_parent_account_children_become_siblings_of_the_account() -> None:
    t = tree("p,,,1\nx,p,,parent\nx,,xu,4\np,,pu,1\n")
    rows = by_key(fair_tree(t, {("x", "xu"): 10, ("p", "pu"): 10}))
    assert rows[("x", "xu")].norm_shares == 4 / 5  # level shares of p's fs children: xu 4 + pu 1
    assert rows[("x", "xu")].effective_usage == 0.5  # xu / p
    assert rows[("x", None)].level_fs is None and rows[("x", None)].fairshare is None


def test_zero_shares_and_all_siblings_zero() -> None:
    t = tree("z,,,0\nz,,u1,0\nz,,u2,0\nw,,,1\nw,,v,1\n")
    usage = {("z", "u1"): 10, ("z", "u2"): 0, ("w", "v"): 10}
    ft = by_key(fair_tree(t, usage))
    assert ft[("z", "u1")].norm_shares == 0.0 and ft[("z", "u1")].level_fs == 0.0
    assert ft[("z", "u2")].level_fs == 0.0  # S == 0 wins over U == 0
    assert ft[("w", "v")].fairshare == 1.0 and ft[("z", "u1")].fairshare == ft[("z", "u2")].fairshare == 2 / 3
    cl = by_key(classic(t, usage))
    assert cl[("z", "u1")].fairshare == 0.0
    assert cl[("z", "u2")].effective_usage == cl[("z", None)].effective_usage  # level shares 0 -> parent's UE


def test_no_usage_at_all() -> None:
    t = tree("a,,,1\na,,u,1\nb,,,2\nb,,v,1\n")
    ft = fair_tree(t, {})
    assert all(r.fairshare == 1.0 for r in ft if r.user)
    assert all(r.level_fs == math.inf for r in ft if r.account != "root")
    assert all(r.norm_usage in (None, 0.0) for r in ft)
    assert all(r.fairshare == 1.0 for r in classic(t, {}) if r.user)


def test_tied_sibling_accounts_are_walked_separately_as_slurms_code_does() -> None:
    # A and B tie (same shares, same usage). The docs say their children are merged and sorted
    # together (b1 1.0, a1 0.75, a2 0.5, b2 0.25). Slurm's code walks A, then B whose first user
    # starts tied with the last rank given (a2's).
    t = tree("A,,,1\nA,,a1,1\nA,,a2,1\nB,,,1\nB,,b1,1\nB,,b2,1\n")
    usage = {("A", "a1"): 4, ("A", "a2"): 6, ("B", "b1"): 1, ("B", "b2"): 9}
    fs = assoc_fairshare(fair_tree(t, usage))
    assert fs == {("A", "a1"): 1.0, ("A", "a2"): 0.75, ("B", "b1"): 0.75, ("B", "b2"): 0.25}


def test_dampening_divides_the_exponent() -> None:
    t = tree("a,,,1\na,,u,1\nb,,,1\nb,,v,1\n")
    usage = {("a", "u"): 30, ("b", "v"): 10}
    one = assoc_fairshare(classic(t, usage))
    three = assoc_fairshare(classic(t, usage, dampening=3))
    for key in one:
        assert three[key] == pytest.approx(one[key] ** (1 / 3))
    with pytest.raises(ValueError, match="dampening"):
        classic(t, usage, dampening=0)


@pytest.mark.parametrize(
    "usage, message",
    [
        ({("a", "ghost"): 1}, "unknown association ('a', 'ghost')"),
        ({("a", None): 1}, "give usage per user association"),
        ({("a", "u"): -1}, "must be finite and >= 0"),
        ({("a", "u"): float("nan")}, "must be finite and >= 0"),
    ],
)
def test_bad_usage_is_rejected(usage, message) -> None:
    with pytest.raises(UsageError) as e:
        fair_tree(tree("a,,,1\na,,u,1\n"), usage)
    assert message in str(e.value)


def test_deep_tree_has_no_recursion_limit() -> None:
    body = "".join(f"a{i},{'a' + str(i - 1) if i else ''},,1\n" for i in range(3000)) + "a2999,,u,1\n"
    t = tree(body)
    assert assoc_fairshare(fair_tree(t, {("a2999", "u"): 5})) == {("a2999", "u"): 1.0}
    assert classic(t, {("a2999", "u"): 5})[-1].depth == 3001


names = st.text(alphabet="abcdef", min_size=1, max_size=4).filter(lambda s: s != "root")
shares = st.one_of(st.integers(0, 50), st.just("parent"))


@st.composite
def trees_and_usage(draw: st.DrawFn):
    accounts = ["root"]
    assocs: list[Assoc] = []
    for name in draw(st.lists(names, unique=True, max_size=7)):
        parent = draw(st.sampled_from(accounts))
        assocs.append(Assoc(name, None, parent, draw(shares)))
        accounts.append(name)
    usage = {}
    for account in accounts:
        for user in draw(st.lists(names, unique=True, max_size=3)):
            assocs.append(Assoc(account, user, account, draw(shares)))
            usage[(account, user)] = draw(st.one_of(st.just(0.0), st.floats(0, 1e6)))
    return AssocTree(assocs), usage


@settings(max_examples=150, deadline=None)
@given(trees_and_usage())
def test_invariants(tu) -> None:
    t, usage = tu
    for algo in (fair_tree, classic):
        rows = algo(t, usage)
        assert len(rows) == len(t)
        assert rows[0].account == "root" and rows[0].user is None
        by = by_key(rows)
        # an account's raw usage is the sum of its direct children's
        for a in t.assocs:
            if a.user is None:
                kids = [b for b in t.assocs if (b.parent == a.account and b.key != a.key)]
                assert by[a.key].raw_usage == pytest.approx(sum(by[b.key].raw_usage for b in kids), rel=1e-9, abs=1e-6)
        for r in rows:
            assert 0.0 <= r.norm_shares <= 1.0
            if r.norm_usage is not None:
                assert 0.0 <= r.norm_usage <= 1.0
            if r.fairshare is not None:
                assert 0.0 <= r.fairshare <= 1.0
        # doubling every usage changes nothing but RawUsage (exact in binary floating point)
        doubled = algo(t, {k: 2 * v for k, v in usage.items()})
        assert [r._replace(raw_usage=0) for r in doubled] == [r._replace(raw_usage=0) for r in rows]
    fs = assoc_fairshare(fair_tree(t, usage))
    if fs:
        assert max(fs.values()) == 1.0 and min(fs.values()) > 0.0
        n = len(fs)
        assert all(round(v * n) == pytest.approx(v * n) for v in fs.values())  # ranks are k/n


@settings(max_examples=100, deadline=None)
@given(trees_and_usage(), st.floats(1, 1e6))
def test_classic_more_usage_never_raises_own_factor(tu, extra) -> None:
    t, usage = tu
    if not usage:
        return
    key = sorted(usage, key=str)[0]
    before = assoc_fairshare(classic(t, usage))[key]
    after = assoc_fairshare(classic(t, {**usage, key: usage[key] + extra}))[key]
    assert after <= before + 1e-12


@settings(max_examples=150, deadline=None)
@given(trees_and_usage())
def test_vectorised_ranking_equals_the_walk(tu) -> None:
    """fair_tree ranks with the vectorised ``_rank``; ``_rank_walk``, Slurm's walk step by step (the
    reference, which production uses for NaN LevelFS), must give every user the same FairShare."""
    from gpuledger.accounting import fairshare

    t, usage = tu
    rows = fair_tree(t, usage)
    # the LevelFS column as the ranking reads it: a "parent" user inf, a "parent" account Slurm's NO_VAL
    level_fs = [0.0] + [r.level_fs if r.level_fs is not None else (math.inf if r.user else fairshare.NO_VAL)
                        for r in rows[1:]]
    walked = fairshare._rank_walk(fairshare._index(t), level_fs)
    assert [walked[i] for i, r in enumerate(rows) if r.user is not None] == \
        [r.fairshare for r in rows if r.user is not None]
