"""Renderers (JSON, CSV) and parsers (sshare -P, usage CSV)."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.fairshare import UsageError, classic, fair_tree
from gpuledger.accounting.fairshare_render import (
    SshareParseError,
    parse_sshare_parsable,
    parse_usage_csv,
    render_csv,
    render_table,
    to_json,
)

REAL = DATA_ROOT / "slurm" / "real-22.05"
TREE = AssocTree.from_csv("account,parent,user,shares\na,,,2\na,,u,1\na,,p,parent\nb,,,1\nb,,v,1\n")
USAGE = {("a", "u"): 10.5, ("a", "p"): 0, ("b", "v"): 0}


def test_json_keys_and_special_values() -> None:
    out = to_json(fair_tree(TREE, USAGE))
    json.dumps(out, allow_nan=False)  # "inf" is a string, never a bare Infinity
    assert list(out[0]) == ["account", "user", "raw_shares", "norm_shares", "raw_usage", "norm_usage",
                            "effective_usage", "fairshare", "level_fs"]
    root, by = out[0], {(o["account"], o["user"]): o for o in out}
    assert root["raw_shares"] is None and root["norm_usage"] is None and root["fairshare"] is None
    assert by[("a", "p")]["raw_shares"] == "parent" and by[("a", "p")]["level_fs"] is None
    assert by[("b", "v")]["level_fs"] == "inf"
    assert by[("a", None)]["fairshare"] is None and by[("a", None)]["user"] is None
    assert by[("a", "u")]["raw_usage"] == 10.5


def test_csv_round_trips_values() -> None:
    rows = classic(TREE, USAGE)
    parsed = list(csv.DictReader(io.StringIO(render_csv(rows))))
    assert [(p["account"], p["user"] or None) for p in parsed] == [(r.account, r.user) for r in rows]
    for p, r in zip(parsed, rows):
        assert float(p["fairshare"]) == r.fairshare
        assert float(p["effective_usage"]) == r.effective_usage


def test_table_omits_levelfs_for_classic_and_widens_for_long_names() -> None:
    # sshare cuts these to "physics_lattice_qc+" and "alexander+", so two accounts and two users print alike
    t = AssocTree.from_csv("account,parent,user,shares\nphysics_lattice_qcd_group_a,,,1\n"
                           "physics_lattice_qcd_group_a,,alexander_hamilton,1\nphysics_lattice_qcd_group_b,,,3\n"
                           "physics_lattice_qcd_group_b,,alexander_humboldt,1\nshort,,,1\nshort,,用户,1\n")
    rows = classic(t, {("physics_lattice_qcd_group_a", "alexander_hamilton"): 123456789012.0})
    text = render_table(rows)
    lines = text.splitlines()
    assert "LevelFS" not in lines[0] and "+" not in text
    for name in ("physics_lattice_qcd_group_a", "physics_lattice_qcd_group_b", "alexander_hamilton",
                 "alexander_humboldt", " 123456789012 "):  # RawUsage whole, not cut to sshare's 11 columns
        assert name in text
    assert len({_columns(line) for line in lines}) == 1  # widened columns stay aligned ("用户" is 4 wide)
    assert [len(d) for d in lines[1].split()][:2] == [29, 18]  # the dashes follow the widened columns
    assert "LevelFS" in render_table(fair_tree(t, {})).splitlines()[0]
    # short names keep sshare's widths exactly
    small = render_table(classic(AssocTree.from_csv("account,parent,user,shares\na,,,1\na,,u,1\n"), {}))
    assert small.splitlines()[1].split(" ")[:2] == ["-" * 20, "-" * 10]
    assert small.splitlines()[0].startswith("Account" + " " * 13 + " " + " " * 6 + "User ")


def test_table_escapes_control_characters_in_names() -> None:
    # association names hold no whitespace, but a terminal escape sequence is no whitespace
    t = AssocTree.from_csv("account,parent,user,shares\nacct,,,1\nacct,,u\x1b[2Jx,1\n")
    text = render_table(classic(t, {}))
    assert "\x1b" not in text and " u\\x1b[2Jx " in text
    assert "u\x1b[2Jx" in render_csv(classic(t, {}))  # machines get the exact name


def test_parse_real_sshare_capture() -> None:
    path = capture(REAL.relative_to(DATA_ROOT) / "sshare-a-l-P.txt")
    rows = parse_sshare_parsable(path.read_text())
    assert len(rows) == 11
    assert rows[0].account == "root" and rows[0].raw_shares is None and rows[0].norm_usage is None
    erin = rows[-1]
    assert (erin.account, erin.user, erin.raw_shares, erin.depth, erin.level_fs) == ("proj_b", "erin", "parent", 2,
                                                                                     None)
    assert rows[1].level_fs == math.inf and rows[6].depth == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("Account|User\nroot|\n", "header lacks 'RawShares'"),
        ("Account|User|RawShares|NormShares|RawUsage|EffectvUsage|FairShare\nroot|||x|1||\n", "line 2: NormShares 'x'"),
        ("Account|User|RawShares|NormShares|RawUsage|EffectvUsage|FairShare\nroot||\n", "line 2: 3 fields"),
    ],
)
def test_sshare_parse_errors(text: str, message: str) -> None:
    with pytest.raises(SshareParseError) as e:
        parse_sshare_parsable(text)
    assert message in str(e.value)


def test_usage_csv() -> None:
    assert parse_usage_csv("account,user,usage\nproj_a,alice,12.5\nroot,root,0\n") == {
        ("proj_a", "alice"): 12.5, ("root", "root"): 0.0}


@pytest.mark.parametrize(
    "text, message",
    [
        ("account,usage\n", "header must be account,user,usage"),
        ("account,user,usage\na,,3\n", "line 2: account and user are required"),
        ("account,user,usage\na,b,lots\n", "line 2: usage 'lots' is not a number"),
        ("account,user,usage\na,b,-1\n", "line 2: usage '-1' must be finite"),
        ("account,user,usage\na,b,1\na,b,2\n", "line 3: duplicate a/b (first on line 2)"),
    ],
)
def test_usage_csv_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_usage_csv(text)
    assert message in str(e.value)


def _columns(text: str) -> int:
    """Terminal columns of a line, computed here rather than by the code under test: CJK takes two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)
