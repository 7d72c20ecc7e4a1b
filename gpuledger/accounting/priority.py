"""The priority feed: per association, the measured fairshare and the Slurm site factor it implies.

Slurm adds a job's site factor to its priority as is. With ``PriorityWeightFairshare=0`` and the site factor set
from this feed (``scontrol update jobid=N SiteFactor=M`` or ``job_submit.lua``), measured fairshare replaces
allocation-based fairshare: ``site_factor = round(weight x fairshare)``, so ``weight`` plays the role of
``PriorityWeightFairshare``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_WEIGHT = 10_000


@dataclass(frozen=True, slots=True)
class PriorityEntry:
    account: str
    user: str
    fairshare: float
    site_factor: int
    raw_usage: float
    effective_usage: float
    norm_shares: float


def site_factor(fairshare: float, weight: int = DEFAULT_WEIGHT) -> int:
    if not 0.0 <= fairshare <= 1.0:
        raise ValueError(f"fairshare {fairshare!r} outside 0..1")
    return int(round(weight * fairshare))


def priority_feed(rows: Iterable[Any], weight: int = DEFAULT_WEIGHT) -> list[PriorityEntry]:
    """One entry per user association (fairshare rows with a user and a fairshare value)."""
    out = []
    for r in rows:
        if r.user is None or r.fairshare is None:
            continue
        out.append(
            PriorityEntry(
                account=r.account,
                user=r.user,
                fairshare=float(r.fairshare),
                site_factor=site_factor(float(r.fairshare), weight),
                raw_usage=float(r.raw_usage),
                effective_usage=float(r.effective_usage),
                norm_shares=float(r.norm_shares),
            )
        )
    return out


def feed_document(entries: Iterable[PriorityEntry], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {**meta, "associations": [asdict(e) for e in entries]}


def write_feed(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write atomically (temp file + rename) so a reader such as job_submit.lua never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
