"""Imports flow one way: schema <- agent <- collector <- accounting <- the CLI root; dashboards read schema and agent.

`gpuledger.schema` (records, wire format) imports nothing of ours; the agent never imports the collector or
accounting; the collector never imports accounting. The CLI root (`gpuledger/cli.py`, `gpuledger/demo.py`) sits
on top and may import everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuledger"
PARTS = ("schema", "agent", "collector", "accounting", "dashboards")
# part -> the parts of ours it must never import ("root": gpuledger's own top-level modules, the CLI and demo)
FORBIDDEN = {
    "schema": {"agent", "collector", "accounting", "dashboards", "root"},
    "agent": {"collector", "accounting", "dashboards", "root"},
    "collector": {"accounting", "dashboards", "root"},
    "accounting": {"dashboards", "root"},
    "dashboards": {"collector", "accounting", "root"},  # reads the agent's metric names
}


def imported_parts(path: Path, package: str) -> set[tuple[str, int]]:
    """(part of gpuledger, line) for every import in a file, relative imports resolved against `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            elif node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] != "gpuledger":
                if parts[0] in PARTS:  # an old top-level name: never valid any more
                    found.add((f"top-level {parts[0]}", node.lineno))
                continue
            if len(parts) == 1:
                found.add(("root", node.lineno))
            else:
                found.add((parts[1] if parts[1] in PARTS else "root", node.lineno))
    return found


def violations(part: str) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / part).rglob("*.py")):
        package = ".".join(("gpuledger",) + path.relative_to(PACKAGE).parent.parts)
        for name, line in sorted(imported_parts(path, package)):
            if name in FORBIDDEN[part] or name.startswith("top-level"):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_flow_one_way(part: str) -> None:
    assert (PACKAGE / part).is_dir()
    assert violations(part) == []


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    # The check itself must be able to fail: lazy imports inside functions and relative imports count too.
    f = tmp_path / "m.py"
    f.write_text(
        "def f():\n    from gpuledger.collector.store import X\n    import gpuledger.accounting.fairshare\n"
        "    from ..collector import y\n    import collector\n    from gpuledger import cli\n"
    )
    found = {n for n, _ in imported_parts(f, "gpuledger.agent")}
    assert found == {"collector", "accounting", "top-level collector", "root"}


def test_no_top_level_packages_besides_gpuledger() -> None:
    # The old top-level names must not come back beside the namespace.
    root = PACKAGE.parent
    assert not [p for p in PARTS if (root / p / "__init__.py").exists()]
