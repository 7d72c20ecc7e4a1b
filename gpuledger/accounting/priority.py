"""The priority feed: per association, the measured fairshare and the Slurm site factor it implies.

Slurm adds a job's site factor to its priority as is. With ``PriorityWeightFairshare=0`` and the site factor set
from this feed (``scontrol update jobid=N SiteFactor=M`` or ``job_submit.lua``), measured fairshare replaces
allocation-based fairshare: ``site_factor = round(weight x fairshare)``, so ``weight`` plays the role of
``PriorityWeightFairshare``.

Two files carry the feed: the JSON document (everything a person or a program may want to know) and a flat file
for ``job_submit.lua`` inside slurmctld, which reads it with plain string functions on every submission:

    # gpuledger-priority-feed v1 generated_at=1795969360.000 audit_entry=118 audit_leaf=6bb074fc...d2 entries=2
    proj_a alice 5000
    proj_b carol 10000

The header names the format, the audit log's ``fairshare`` entry the feed was computed from (its number and leaf
hash, so that ``audit verify`` can compare every line with what the log holds) and the entry count last (a reader
rejects a file whose count does not match); it changes with every write, so a reader may cache the parsed table
until the first line changes. The JSON document names the entry the same way (``audit_entry``, ``audit_leaf``).
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
from gpuledger.schema.text import ascii_int

DEFAULT_WEIGHT = 10_000
FEED_NAME = "priority-feed.json"  # in the data dir, where `priority feed`, `apply` and `watch` write it by default
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


@dataclass(frozen=True, slots=True)
class FeedSource:
    """The audit log's ``fairshare`` entry a feed was computed from."""

    seq: int
    leaf: str  # its leaf hash, hex


def feed_document(entries: Iterable[PriorityEntry], meta: Mapping[str, Any], source: FeedSource | None = None
                  ) -> dict[str, Any]:
    """The feed's JSON document: ``meta``, the fairshare entry it was computed from (``audit_entry`` and
    ``audit_leaf``, when ``source`` is given) and one record per association."""
    named = {"audit_entry": source.seq, "audit_leaf": source.leaf} if source is not None else {}
    return {**meta, **named, "associations": [asdict(e) for e in entries]}


def flat_feed(document: Mapping[str, Any]) -> str:
    """The flat form of a feed document: a header line, then ``account user site_factor`` per association.

    Slurm's account and user names hold no whitespace; one that does would break the line format, so it is an
    error naming the entry rather than a line the lua would misread.
    """
    assocs = list(document.get("associations", ()))
    source = ""
    if document.get("audit_entry") is not None:
        source = f" audit_entry={int(document['audit_entry'])} audit_leaf={document['audit_leaf']}"
    lines = [f"{FLAT_MAGIC} generated_at={float(document.get('generated_at', 0.0)):.3f}{source} "
             f"entries={len(assocs)}"]
    for i, a in enumerate(assocs):
        account, user, factor = str(a["account"]), str(a["user"]), int(a["site_factor"])
        if not account or not user or any(ch.isspace() for ch in account + user):
            raise ValueError(f"priority feed entry {i}: account {account!r} / user {user!r} empty or with whitespace")
        lines.append(f"{account} {user} {factor}")
    return "\n".join(lines) + "\n"


class FeedFormatError(ValueError):
    """A flat feed that is not one; the message names the line."""


@dataclass(frozen=True, slots=True)
class FlatFeed:
    header: dict[str, str]  # the header's key=value fields (generated_at, audit_entry, audit_leaf, entries)
    lines: list[tuple[int, str, str, int]]  # (line number, account, user, site factor)


def parse_flat_feed(text: str) -> FlatFeed:
    """Read a flat feed as ``contrib/slurm/job_submit.lua`` reads it (the magic, ``entries=N`` last in the header,
    ``account user factor`` lines, as many as the header says)."""
    first, _, rest = text.partition("\n")
    if not first.startswith(FLAT_MAGIC + " "):
        raise FeedFormatError(f"line 1 is not '{FLAT_MAGIC} ...'")
    header = dict(f.partition("=")[::2] for f in first[len(FLAT_MAGIC):].split())
    want = ascii_int(header.get("entries", "")) if first.split()[-1].startswith("entries=") else None
    if want is None:
        raise FeedFormatError("line 1 does not end in entries=N")
    lines = []
    for n, line in enumerate(rest.split("\n"), 2):
        if not line:
            continue
        parts = line.split(" ")
        names = len(parts) == 3 and parts[0] and parts[1] and not any(ch.isspace() for ch in parts[0] + parts[1])
        factor = ascii_int(parts[2].removeprefix("-")) if names else None
        if factor is None:
            raise FeedFormatError(f"line {n} is not 'account user factor': {line[:80]!r}")
        lines.append((n, parts[0], parts[1], -factor if parts[2].startswith("-") else factor))
    if len(lines) != want:
        raise FeedFormatError(f"{len(lines)} entries, the header says {want}")
    return FlatFeed(header, lines)


def flat_path(json_path: str | os.PathLike[str]) -> Path:
    """Where the flat feed goes beside a JSON feed: the same name with ``.txt``."""
    return Path(json_path).with_suffix(".txt")


def write_feed(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write the JSON feed and the flat one beside it (:func:`flat_path`), each atomically; both name the fairshare
    entry the document does (``audit_entry``, ``audit_leaf``). Both texts are built before either file is
    replaced: a bad entry leaves both files as they were."""
    if flat_path(path) == Path(path):
        raise ValueError(f"priority feed {path}: the JSON feed's name must not end in .txt (the flat feed goes there)")
    text = json.dumps(document, indent=2) + "\n"
    flat_text = flat_feed(document)
    out = write_atomically(path, text)
    write_atomically(flat_path(path), flat_text)
    return out
