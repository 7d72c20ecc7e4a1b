"""Write the dashboards and Grafana provisioning files that ship inside the package to a folder.

They are package data (``pyproject.toml``), read through ``importlib.resources``, so an installed wheel exports
the same files as a checkout. ``gpuledger dashboards export DIR`` lays them out as Grafana's file provider
reads them: ``DIR/influxdb/*.json``, ``DIR/prometheus/*.json``, ``DIR/provisioning/{datasources,dashboards}/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from gpuledger.dashboards.grafana import FLAVOURS

PACKAGE = "gpuledger.dashboards"
PROVISIONING_KINDS = ("datasources", "dashboards")


class ExportError(ValueError):
    """The destination cannot take the files; the message names the path and why."""


@dataclass(frozen=True, slots=True)
class Exported:
    written: list[Path]
    unchanged: list[Path]


def packaged_files() -> dict[str, Traversable]:
    """Relative path (with '/') -> the packaged file: every dashboard and provisioning file."""
    root = files(PACKAGE)
    out: dict[str, Traversable] = {}
    for flavour in FLAVOURS:
        for item in root.joinpath(flavour).iterdir():
            if item.name.endswith(".json"):
                out[f"{flavour}/{item.name}"] = item
    for kind in PROVISIONING_KINDS:
        for item in root.joinpath("provisioning", kind).iterdir():
            if item.name.endswith(".yaml"):
                out[f"provisioning/{kind}/{item.name}"] = item
    if not any(name.endswith(".json") for name in out):
        raise ExportError(f"no dashboards in the installed package {PACKAGE} (a broken installation?)")
    return dict(sorted(out.items()))


def export(dest: Path, overwrite: bool = False) -> Exported:
    """Copy every packaged file under ``dest``. A file already there with other content is an error (nothing is
    written then) unless ``overwrite``; one with the same content is left alone."""
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"{dest}: exists and is not a directory")
    plan = [(dest / name, item.read_bytes()) for name, item in packaged_files().items()]
    unchanged = [p for p, data in plan if p.is_file() and p.read_bytes() == data]
    for path, _ in plan:
        if path.exists() and not path.is_file():
            raise ExportError(f"{path}: exists and is not a file")
    differing = [p for p, data in plan if p.is_file() and p not in unchanged]
    if differing and not overwrite:
        raise ExportError(f"{differing[0]}: exists with other content ({len(differing)} such file(s)); "
                          "use --force to overwrite")
    written = []
    for path, data in plan:
        if path in unchanged:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # never a half-written dashboard
        written.append(path)
    return Exported(written, unchanged)
