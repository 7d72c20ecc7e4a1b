"""Job mappers, by name (lazy)."""

from __future__ import annotations

import importlib
from typing import Any

from gpuledger.agent.mappers.base import JobMapper

MAPPERS: dict[str, str] = {
    "static": "gpuledger.agent.mappers.static:StaticMapper",
    "slurm-cgroup": "gpuledger.agent.mappers.slurm_cgroup:SlurmCgroupMapper",
    "mapping-dir": "gpuledger.agent.mappers.mapping_dir:MappingDirMapper",
}


def make_mapper(name: str, **options: Any) -> JobMapper:
    try:
        target = MAPPERS[name]
    except KeyError:
        raise ValueError(f"unknown job mapper {name!r}; known: {', '.join(sorted(MAPPERS))}") from None
    mod, _, cls = target.partition(":")
    return getattr(importlib.import_module(mod), cls)(**options)


__all__ = ["JobMapper", "MAPPERS", "make_mapper"]
