"""`gpuledger dashboards export DIR`: the packaged files, laid out for Grafana; nothing overwritten unasked."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.dashboards.export import packaged_files
from gpuledger.dashboards.grafana import FLAVOURS

DASH_DIR = Path(__file__).resolve().parents[2] / "gpuledger" / "dashboards"
COMMITTED = sorted(
    [p.relative_to(DASH_DIR).as_posix() for f in FLAVOURS for p in (DASH_DIR / f).glob("*.json")]
    + [p.relative_to(DASH_DIR).as_posix() for p in (DASH_DIR / "provisioning").glob("*/*.yaml")]
)


def export(dest: Path, *extra: str):
    return CliRunner().invoke(app, ["dashboards", "export", str(dest), *extra])


def test_export_writes_every_committed_file(tmp_path: Path) -> None:
    assert sorted(packaged_files()) == COMMITTED and len(COMMITTED) == 10
    r = export(tmp_path / "out")
    assert r.exit_code == 0, r.output
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == COMMITTED
    for name in COMMITTED:
        assert (tmp_path / "out" / name).read_bytes() == (DASH_DIR / name).read_bytes(), name
    again = export(tmp_path / "out")
    assert again.exit_code == 0 and "0 written, 10 unchanged" in again.output


def test_export_never_overwrites_a_changed_file_unasked(tmp_path: Path) -> None:
    assert export(tmp_path).exit_code == 0
    edited = tmp_path / "prometheus" / "job.json"
    edited.write_text("{}\n")
    (tmp_path / "influxdb" / "job.json").unlink()
    r = export(tmp_path)
    assert r.exit_code == 2
    assert f"{edited}: exists with other content" in r.output and "--force" in r.output
    assert edited.read_text() == "{}\n" and not (tmp_path / "influxdb" / "job.json").exists()  # nothing written
    r = export(tmp_path, "--force")
    assert r.exit_code == 0, r.output
    assert edited.read_bytes() == (DASH_DIR / "prometheus" / "job.json").read_bytes()


def test_export_into_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    r = export(tmp_path / "f")
    assert r.exit_code == 2 and "exists and is not a directory" in r.output
