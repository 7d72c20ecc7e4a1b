"""Imports flow one way: schema <- agent <- collector <- accounting <- the CLI root; dashboards read schema and agent;
`gpuledger.output` (how commands print tables, JSON, CSV) imports nothing of ours and serves every part.

`gpuledger.schema` (records, wire format) imports nothing of ours; the agent never imports the collector or
accounting; the collector never imports accounting. The CLI root (`gpuledger/cli.py`, `gpuledger/demo.py`) sits
on top and may import everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuledger"
PARTS = ("schema", "output", "agent", "collector", "accounting", "dashboards")
# part -> the parts of ours it must never import ("root": gpuledger's own top-level modules, the CLI and demo)
FORBIDDEN = {
    "schema": {"output", "agent", "collector", "accounting", "dashboards", "root"},
    "output": {"schema", "agent", "collector", "accounting", "dashboards", "root"},  # how commands print
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


def module_imports() -> dict[str, set[str]]:
    """gpuledger module -> the gpuledger modules it imports (anywhere in the file, relative imports resolved)."""
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:  # the module a dotted name lives in ("pkg.mod.Class" -> "pkg.mod")
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    keep = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(keep + ([base] if base else []))
                # "from pkg import submodule" needs the submodule, not what pkg/__init__ defines
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            deps |= {m for t in targets if t.startswith("gpuledger") and (m := resolve(t)) and m != name}
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_import_cycles() -> None:
    # e.g. the dashboard builder and the dashboard declarations once imported each other
    assert import_cycles(module_imports()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
