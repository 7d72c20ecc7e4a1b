"""The wheel: one top-level name (``gpuledger``), the dashboards inside, and exporting them from an installed,
non-editable copy (no checkout on the path)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASH_DIR = ROOT / "gpuledger" / "dashboards"
PARTS = ("agent", "collector", "accounting", "dashboards", "schema")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel . --no-deps`` of a copy of the sources (a checkout's build/ can hold stale modules)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "gpuledger", src / "gpuledger", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("gpuledger-*.whl")
    return whl


def test_wheel_has_one_top_level_name_and_the_dashboards(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"gpuledger"}
    for part in PARTS:
        assert any(n.startswith(f"gpuledger/{part}/") for n in names), part
    assert not any(n.startswith("tests/") or "nvml_fake" in n for n in names)
    committed = sorted(p.relative_to(ROOT).as_posix() for p in DASH_DIR.glob("*/*.json"))
    assert len(committed) == 8
    assert sorted(n for n in names if n.startswith("gpuledger/dashboards/") and n.endswith(".json")) == committed
    assert "gpuledger/dashboards/provisioning/datasources/gpuledger.yaml" in names


def test_installed_wheel_imports_and_exports_the_dashboards(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [p for p in PARTS if (target / p).exists()]  # nothing beside gpuledger
    # The installed copy first on the path, run away from the checkout; dependencies from this environment.
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = "import gpuledger, gpuledger.collector, gpuledger.dashboards; print(gpuledger.__file__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(target)
    out = tmp_path / "grafana"
    r = subprocess.run([sys.executable, "-m", "gpuledger.cli", "dashboards", "export", str(out)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "10 written" in r.stderr
    for p in DASH_DIR.glob("*/*.json"):
        assert (out / p.parent.name / p.name).read_bytes() == p.read_bytes()
