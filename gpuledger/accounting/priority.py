"""The priority feed: per association, the measured fairshare and the Slurm site factor it implies.

Slurm adds a job's site factor to its priority as is. With ``PriorityWeightFairshare=0`` and the site factor set
from this feed (``scontrol update jobid=N SiteFactor=M`` or ``job_submit.lua``), measured fairshare replaces
allocation-based fairshare: ``site_factor = round(weight x fairshare)``, so ``weight`` plays the role of
``PriorityWeightFairshare``.

Two files carry the feed: the JSON document (everything a person or a program may want to know) and a flat file
for ``job_submit.lua`` inside slurmctld, which reads it with plain string functions on every submission:

    # gpuledger-priority-feed v1 generated_at=1795969360.000 entries=2
    proj_a alice 5000
    proj_b carol 10000

The header names the format and the entry count (a reader rejects a file whose count does not match) and changes
with every write, so a reader may cache the parsed table until the first line changes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuledger.output import write_atomically

DEFAULT_WEIGHT = 10_000
FLAT_MAGIC = "# gpuledger-priority-feed v1"


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
    """``weight x fairshare`` rounded half up: Python's round() takes halves to the even neighbour, so Fair Tree's
    k/32 ranks at weight 10000 went 312.5 -> 312 but 937.5 -> 938."""
    if not 0.0 <= fairshare <= 1.0:
        raise ValueError(f"fairshare {fairshare!r} outside 0..1")
    return math.floor(weight * fairshare + 0.5)


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


def flat_feed(document: Mapping[str, Any]) -> str:
    """The flat form of a feed document: a header line, then ``account user site_factor`` per association.

    Slurm's account and user names hold no whitespace; one that does would break the line format, so it is an
    error naming the entry rather than a line the lua would misread.
    """
    assocs = list(document.get("associations", ()))
    lines = [f"{FLAT_MAGIC} generated_at={float(document.get('generated_at', 0.0)):.3f} entries={len(assocs)}"]
    for i, a in enumerate(assocs):
        account, user, factor = str(a["account"]), str(a["user"]), int(a["site_factor"])
        if not account or not user or any(ch.isspace() for ch in account + user):
            raise ValueError(f"priority feed entry {i}: account {account!r} / user {user!r} empty or with whitespace")
        lines.append(f"{account} {user} {factor}")
    return "\n".join(lines) + "\n"


def flat_path(json_path: str | os.PathLike[str]) -> Path:
    """Where the flat feed goes beside a JSON feed: the same name with ``.txt``."""
    return Path(json_path).with_suffix(".txt")


def write_feed(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write the JSON feed and the flat one beside it (:func:`flat_path`), each atomically. Both texts are built
    before either file is replaced: a bad entry leaves both files as they were."""
    if flat_path(path) == Path(path):
        raise ValueError(f"priority feed {path}: the JSON feed's name must not end in .txt (the flat feed goes there)")
    text = json.dumps(document, indent=2) + "\n"
    flat_text = flat_feed(document)
    out = write_atomically(path, text)
    write_atomically(flat_path(path), flat_text)
    return out
