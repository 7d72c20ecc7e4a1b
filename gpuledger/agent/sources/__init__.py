"""GPU sources, by name. Lazy: a source's module (and its library) is imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from gpuledger.agent.sources.base import GpuSource, SourceUnavailable

# name -> "module:Class"; modules import their backends lazily so `agent sources` can say what is missing.
SOURCES: dict[str, str] = {
    "simulated": "gpuledger.agent.sources.simulated:SimulatedSource",
    "nvml": "gpuledger.agent.sources.nvml:NvmlSource",
    "dcgm": "gpuledger.agent.sources.dcgm:DcgmSource",
    "dcgm-exporter": "gpuledger.agent.sources.dcgm_exporter:DcgmExporterSource",
}


def source_class(name: str) -> type:
    try:
        target = SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown GPU source {name!r}; known: {', '.join(sorted(SOURCES))}") from None
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)


def make_source(name: str, **options: Any) -> GpuSource:
    return source_class(name)(**options)


__all__ = ["GpuSource", "SourceUnavailable", "SOURCES", "make_source", "source_class"]
