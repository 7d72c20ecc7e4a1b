"""Imports flow one way: accounting -> collector -> agent. The CLI root (gpuledger/) sits on top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the first-party packages it must never import
FORBIDDEN = {
    "agent": {"collector", "accounting", "gpuledger"},
    "collector": {"accounting", "gpuledger"},
    "accounting": {"gpuledger"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((a.name.split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in sorted(imported_packages(path)):
            if name in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package: str) -> None:
    assert (ROOT / package).is_dir()
    assert violations(package) == []


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    # The check itself must be able to fail: a lazy import inside a function counts too.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from collector.store import SqliteStore\n    import accounting.fairshare\n")
    assert {n for n, _ in imported_packages(f)} == {"collector", "accounting"}
