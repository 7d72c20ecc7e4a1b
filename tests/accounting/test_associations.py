"""Association tree parsers: real sacctmgr captures, CSV, TOML, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.associations import Assoc, AssociationError, AssocTree

REAL = DATA_ROOT / "slurm" / "real-22.05"


def real(name: str) -> str:
    return capture(f"slurm/real-22.05/{name}").read_text()


EXPECTED_REAL = {
    Assoc("root", None, None, 1),
    Assoc("root", "root", "root", 1),
    Assoc("proj_a", None, "root", 60),
    Assoc("proj_a", "alice", "proj_a", 1),
    Assoc("proj_a", "bob", "proj_a", 3),
    Assoc("proj_a_ml", None, "proj_a", 2),
    Assoc("proj_a_ml", "dave", "proj_a_ml", 1),
    Assoc("proj_b", None, "root", 40),
    Assoc("proj_b", "alice", "proj_b", 1),
    Assoc("proj_b", "carol", "proj_b", 1),
    Assoc("proj_b", "erin", "proj_b", "parent"),
}


@pytest.mark.parametrize("name", ["sacctmgr-assoc-P.txt", "sacctmgr-assoc-P-noheader.txt", "sacctmgr-assoc-tree-P.txt",
                                  "sacctmgr-assoc-P-client-format.txt"])
def test_real_sacctmgr_captures_give_the_documented_tree(name: str) -> None:
    tree = AssocTree.from_sacctmgr(real(name))
    assert set(tree.assocs) == EXPECTED_REAL
    assert tree.assocs[0].key == ("root", None)
    assert tree.get("proj_b", "erin").shares == "parent"  # type: ignore[union-attr]


def test_plain_sacctmgr_output_is_recognised_and_the_error_says_what_to_run() -> None:
    # The default columns of a real 22.05 `sacctmgr -P show associations`: Partition, Share, limits, no ParentName.
    with pytest.raises(AssociationError) as e:
        AssocTree.from_sacctmgr(real("sacctmgr-assoc-P-default.txt"))
    msg = str(e.value)
    assert "no ParentName column" in msg and "\n" not in msg
    assert "sacctmgr -P show associations format=cluster,account,parentname,user,share" in msg
    assert "--associations slurm" in msg
    # what that command prints on the same cluster is the tree
    assert set(AssocTree.from_sacctmgr(real("sacctmgr-assoc-P-client-format.txt")).assocs) == EXPECTED_REAL


def test_slurm_client_asks_sacctmgr_for_the_columns_a_tree_needs() -> None:
    """The client's argv, replayed through the ``run=`` seam with the capture that command printed."""
    import subprocess

    from gpuledger.accounting.slurm import SlurmClient

    want = (REAL / "sacctmgr-assoc-P-client-format.cmd.txt").read_text().split()[1:]
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, real("sacctmgr-assoc-P-client-format.txt"), "")

    text = SlurmClient(run=run).associations()
    assert calls == [want]
    assert set(AssocTree.from_sacctmgr(text).assocs) == EXPECTED_REAL


def test_csv_and_toml_give_the_same_tree_as_sacctmgr() -> None:
    csv_text = """account,parent,user,shares
root,,root,1
proj_a,,,60
proj_a,,alice,1
proj_a,,bob,3
proj_a_ml,proj_a,,2
proj_a_ml,,dave,1
proj_b,,,40
proj_b,,alice,1
proj_b,,carol,1
proj_b,,erin,parent
"""
    toml = {
        "accounts": {
            "root": {"users": {"root": 1}},
            "proj_a": {"shares": 60, "users": {"alice": 1, "bob": 3}},
            "proj_a_ml": {"parent": "proj_a", "shares": 2, "users": {"dave": 1}},
            "proj_b": {"shares": 40, "users": {"alice": 1, "carol": 1, "erin": "parent"}},
        }
    }
    assert set(AssocTree.from_csv(csv_text).assocs) == EXPECTED_REAL
    assert set(AssocTree.from_toml(toml).assocs) == EXPECTED_REAL


@pytest.mark.parametrize(
    "text, message",
    [
        ("account,parent,user,shares\nproj_a,nowhere,,1\n",
         "line 2: account 'proj_a' has unknown parent account 'nowhere'"),
        ("account,parent,user,shares\nproj_a,,,1\nproj_a,,,2\n",
         "line 3: duplicate association account 'proj_a' (first at associations CSV line 2)"),
        ("account,parent,user,shares\nproj_a,,,1\nproj_a,,bob,x\n",
         "line 3: shares 'x' is neither an integer nor 'parent'"),
        ("account,parent,user,shares\nproj_a,,,-1\n", "line 2: shares -1 outside"),
        ("account,parent,user,shares\na,b,,1\nb,a,,1\n", "account parent cycle"),
        ("account,parent,user,shares\nproj_a,,,1\nproj_a,root,bob,1\n",
         "line 3: user row for 'bob' must have an empty parent"),
        ("account,parent,user,shares\nghost,,bob,1\n", "line 2: user 'bob' has unknown parent account 'ghost'"),
        ("account,parent,user,shares\nroot,,,1\n", "line 2: the root account is implicit"),
        ("account,user,shares\n", "line 1: header must be account,parent,user,shares"),
        ("account,parent,user,shares\nproj a,,,1\n", "line 2: account name 'proj a' contains whitespace"),
        ("account,parent,user,shares\nproj_a,,,1,9\n", "line 2: 5 fields, expected 4"),
    ],
)
def test_csv_errors_name_the_line_and_problem(text: str, message: str) -> None:
    with pytest.raises(AssociationError) as e:
        AssocTree.from_csv(text)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("testcluster|root|||1\ntestcluster|proj_a|||60\n", "line 2: account 'proj_a' has an empty ParentName"),
        ("testcluster|root|||1\ntestcluster|proj_a||root\n", "line 2: 4 fields, expected 5"),
        ("c1|root|||1\nc2|root|||1\n", "holds clusters ['c1', 'c2']"),
        ("Account|User|Share\nroot||1\n   deep||1\n", "line 3: account 'deep' indented past its parent"),
        ("Cluster|Account|User|ParentName\nc|root|||\n", "header lacks the 'share' column"),
        ("c|root|||1\nc|proj_a||root|lots\n", "line 2: shares 'lots'"),
    ],
)
def test_sacctmgr_errors_name_the_line_and_problem(text: str, message: str) -> None:
    with pytest.raises(AssociationError) as e:
        AssocTree.from_sacctmgr(text)
    assert message in str(e.value)


def test_sacctmgr_cluster_selection_and_trailing_pipe() -> None:
    text = "c1|root|||1|\nc1|a||root|5|\nc2|root|||1|\nc2|b||root|7|\n"
    tree = AssocTree.from_sacctmgr(text, cluster="c2")
    assert {a.key for a in tree.assocs} == {("root", None), ("b", None)}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"accounts": {"a": {"shares": True}}}, "accounts.a.shares: shares must be an integer"),
        ({"accounts": {"a": {"users": {"bob": 1.5}}}}, "accounts.a.users.bob: shares must be an integer"),
        ({"accounts": {"a": {"parent": "zz"}}}, "accounts.a: account 'a' has unknown parent account 'zz'"),
        ({"accounts": {"root": {"shares": 3}}}, "accounts.root: the root account takes no parent or shares"),
        ({"accounts": {"a": {"share": 3}}}, "accounts.a: unknown key(s) ['share']"),
        ({"acounts": {}}, "unknown key(s) ['acounts']"),
    ],
)
def test_toml_errors_name_the_path(data: dict, message: str) -> None:
    with pytest.raises(AssociationError) as e:
        AssocTree.from_toml(data)
    assert message in str(e.value)


names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6).filter(lambda s: s != "root")
shares = st.one_of(st.integers(0, 1000), st.just("parent"))


@st.composite
def trees(draw: st.DrawFn) -> list[Assoc]:
    accounts = ["root"]
    assocs: list[Assoc] = []
    for name in draw(st.lists(names, unique=True, max_size=8)):
        parent = draw(st.sampled_from(accounts))
        assocs.append(Assoc(name, None, parent, draw(shares)))
        accounts.append(name)
    for account in accounts:
        for user in draw(st.lists(names, unique=True, max_size=3)):
            assocs.append(Assoc(account, user, account, draw(shares)))
    return assocs


@settings(max_examples=60, deadline=None)
@given(trees())
def test_csv_and_sacctmgr_round_trip(assocs: list[Assoc]) -> None:
    csv_lines = ["account,parent,user,shares"]
    sacct_lines = ["Cluster|Account|User|ParentName|Share", "c|root|||1"]
    for a in assocs:
        if a.user:
            csv_lines.append(f"{a.account},,{a.user},{a.shares}")
            sacct_lines.append(f"c|{a.account}|{a.user}||{a.shares}")
        else:
            csv_lines.append(f"{a.account},{'' if a.parent == 'root' else a.parent},,{a.shares}")
            sacct_lines.append(f"c|{a.account}||{a.parent}|{a.shares}")
    expected = set(assocs) | {Assoc("root", None, None, 1)}
    assert set(AssocTree.from_csv("\n".join(csv_lines)).assocs) == expected
    assert set(AssocTree.from_sacctmgr("\n".join(sacct_lines)).assocs) == expected


def test_the_config_names_a_tree_file_relative_to_itself(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpuledger.cli import app

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "tree.txt").write_text(real("sacctmgr-assoc-P-client-format.txt"))
    (tmp_path / "etc" / "g.toml").write_text('[accounting]\nassociations = "tree.txt"\n')
    usage = tmp_path / "u.csv"
    usage.write_text("account,user,usage\nproj_a,bob,5\n")
    r = CliRunner().invoke(app, ["fairshare", "--config", str(tmp_path / "etc" / "g.toml"), "--usage", str(usage),
                                 "--format", "json", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    import json

    assert {(x["account"], x["user"]) for x in json.loads(r.stdout) if x["user"]} == {
        (a.account, a.user) for a in EXPECTED_REAL if a.user}
    (tmp_path / "etc" / "g.toml").write_text("[accounting]\n")
    r = CliRunner().invoke(app, ["fairshare", "--config", str(tmp_path / "etc" / "g.toml"), "--usage", str(usage),
                                 "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "no association tree: pass --associations slurm|FILE" in r.stderr
