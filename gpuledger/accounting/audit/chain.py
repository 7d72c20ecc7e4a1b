"""Fairshare entries as deltas, and the one way every reader turns an entry into its full inputs.

A ``fairshare`` entry lists every job in the decay horizon (``inputs.jobs``). Logged in full each cycle that is
the whole horizon again and again, so the recorder logs most entries as a delta on the fairshare entry before it:
``inputs.delta`` = ``{"base": seq, "base_leaf": hex, "jobs": {id: record}, "dropped": [id, ...]}``, the jobs
added or whose logged inputs changed and the jobs no longer charged, in place of ``inputs.jobs``. What changes
every cycle for every job, its decayed charge, is not logged in a delta (for a job that logs its pieces): the
verifier recomputes it from the pieces at the entry's ``now`` (``explain._derive_decay``). Everything else of an
entry is logged in each one: its time, settings, each association's decayed usage, the rows and the feed.

A delta names its base by seq and leaf hash, and the base must be the fairshare entry right before it, so a base
altered, removed or swapped fails verification. The recorder writes a full entry at least every
:data:`FULL_EVERY` entries, and whenever the job records logged since the last full one would pass half the jobs
it charges (``recorders.record_fairshare``), so a read walks a bounded chain. Entries written in full (all of them,
by earlier releases) read as they always did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuledger.collector.auditlog import AuditLog, Entry

DELTA = "delta"  # the key of a delta entry's inputs that holds it
# A full entry at least every this many fairshare entries: the longest chain a read walks (at 20,000 jobs, ~20 MB
# of deltas for a cold read; a full entry about every 8 hours at the watch's 5-minute resync)
FULL_EVERY = 100


@dataclass(frozen=True, slots=True)
class Read:
    """A fairshare entry with its full inputs (``entry.data["inputs"]["jobs"]``: every job it charges, with the
    decayed charge of a delta's job left out), or None with the ``problem`` why it cannot be read; ``deltas``:
    the deltas since the last full entry (this one included), ``changes``: the job records they log."""

    entry: Entry | None
    problem: str | None = None
    deltas: int = 0
    changes: int = 0


def delta_of(e: Entry) -> Mapping[str, Any] | None:
    """Entry ``e``'s delta (None: it is logged in full, or is no fairshare computation; a delta that is not an
    object reads as an empty one, which names no base)."""
    inputs = e.data.get("inputs") if isinstance(e.data, dict) else None
    if not isinstance(inputs, dict) or DELTA not in inputs:
        return None
    d = inputs[DELTA]
    return d if isinstance(d, dict) else {}


def carried(c: Any) -> Any:
    """A job's record as a later delta carries it on: without the decayed charge (its base's ``now``'s) when the
    record logs the pieces it is recomputed from."""
    if isinstance(c, dict) and "decayed" in c and c.get("pieces") is not None:
        return {k: v for k, v in c.items() if k != "decayed"}
    return c


def full_jobs(e: Entry) -> dict[str, Any] | None:
    """The jobs of an entry logged in full (None: it is a delta, or no fairshare computation)."""
    inputs = e.data.get("inputs") if isinstance(e.data, dict) else None
    jobs = inputs.get("jobs") if isinstance(inputs, dict) and DELTA not in inputs else None
    return jobs if isinstance(jobs, dict) else None


def _with_jobs(e: Entry, jobs: dict[str, Any]) -> Entry:
    return dataclasses.replace(e, data={**e.data, "inputs": {**e.data["inputs"], "jobs": jobs}})


def _apply(base: Entry, base_is_full: bool, e: Entry, delta: Mapping[str, Any]) -> tuple[Entry | None, str | None]:
    """Delta entry ``e`` on ``base`` (read, and the fairshare entry before it): ``e`` with its full inputs, or the
    problem why it does not apply."""
    where = f"audit entry {e.seq}"
    seq, leaf = delta.get("base"), delta.get("base_leaf")
    if type(seq) is not int or not isinstance(leaf, str):
        return None, f"{where}: a delta fairshare entry that names no base entry (seq and leaf hash)"
    if seq != base.seq or leaf != base.leaf.hex():
        what = (f"entry {seq}, whose leaf hash is not the {leaf[:12]} it names (altered)" if seq == base.seq
                else f"entry {seq}, not the fairshare entry before it (entry {base.seq})")
        return None, f"{where}: its base is {what}: its inputs cannot be read"
    jobs, dropped = delta.get("jobs"), delta.get("dropped")
    if not isinstance(jobs, dict) or not isinstance(dropped, list) or not all(isinstance(j, str) for j in dropped):
        return None, f"{where}: its delta is not jobs (by id) and the ids of the jobs dropped"
    have = base.data["inputs"]["jobs"]
    strange = [j for j in dropped if j not in have or j in jobs]
    if strange:
        return None, (f"{where}: drops job {strange[0]}, which its base entry {base.seq} does not charge or it "
                      "charges again")
    gone = set(dropped)
    out = {j: carried(c) if base_is_full else c for j, c in have.items() if j not in gone}
    out.update(jobs)
    return _with_jobs(e, out), None


class Chain:
    """Reads the fairshare entries in seq order, each from the one before: one entry's full inputs held at a
    time, each delta applied in time linear in its size plus the jobs it carries on."""

    def __init__(self) -> None:
        self._before: Entry | None = None  # the fairshare entry before, as logged
        self._read = Read(None, "no fairshare entry before it")

    def read(self, e: Entry) -> Read:
        """Fairshare entry ``e`` (the next one after those read before) with its full inputs."""
        delta = delta_of(e)
        before, last = self._before, self._read
        self._before = e
        if delta is None:
            self._read = Read(e if full_jobs(e) is not None else None)
            return self._read
        if before is None:
            self._read = Read(None, f"audit entry {e.seq}: a delta fairshare entry with no fairshare entry before it "
                                    f"(its base, entry {delta.get('base')!r}, is not one)")
        elif last.entry is None:  # the link to the entry before checked first: a base swapped says so
            problem = _apply(before, False, e, delta)[1] if not based_on(e, before) else None
            self._read = Read(None, problem or f"audit entry {e.seq}: its base, entry {before.seq}, cannot be read")
        elif last.deltas >= FULL_EVERY:  # no recorder writes a longer chain (readers refuse one: read_entry)
            self._read = Read(None, f"audit entry {e.seq}: more than {FULL_EVERY} delta entries since a full one")
        else:
            entry, problem = _apply(last.entry, last.deltas == 0, e, delta)
            self._read = Read(entry, problem, last.deltas + 1, last.changes + _changes(delta))
        return self._read


def _changes(delta: Mapping[str, Any]) -> int:
    jobs, dropped = delta.get("jobs"), delta.get("dropped")
    return (len(jobs) if isinstance(jobs, dict) else 0) + (len(dropped) if isinstance(dropped, list) else 0)


def _bases(log: AuditLog, e: Entry) -> tuple[list[Entry], str | None]:
    """``e`` and the entries back along the bases its deltas name, newest first, to the last full entry; and the
    problem where the walk stops short of it: a base that is not the fairshare entry right before (as
    :class:`Chain` holds), or more than :data:`FULL_EVERY` deltas (no recorder writes a longer chain: a forged one
    is not walked on)."""
    out = [e]
    delta = delta_of(e)
    while delta is not None:
        if len(out) > FULL_EVERY:
            return out, f"audit entry {e.seq}: more than {FULL_EVERY} delta entries since a full one"
        at, base = out[-1], delta.get("base")
        prev = log.previous("fairshare", at.seq)
        if prev is None or prev.seq != base:
            return out, (f"audit entry {at.seq}: its base, entry {base!r}, is not the fairshare entry before it: its "
                         "inputs cannot be read")
        out.append(prev)
        delta = delta_of(prev)
    return out, None


def read_entry(log: AuditLog, e: Entry) -> Read:
    """Fairshare entry ``e`` of ``log`` with its full inputs, read back from the last full entry before it along
    the bases the deltas name (a full entry reads as itself)."""
    walked, problem = _bases(log, e)
    if problem is not None:
        return Read(None, problem)
    chain = Chain()
    for at in reversed(walked):
        read = chain.read(at)
    return read


def charges(e: Entry, job_id: str) -> bool | None:
    """Whether fairshare entry ``e`` charges ``job_id`` as it is logged: None when ``e`` is a delta that leaves
    that to its base (it neither logs the job nor drops it); False for an entry that is no computation."""
    delta = delta_of(e)
    if delta is None:
        jobs = full_jobs(e)
        return jobs is not None and job_id in jobs
    jobs, dropped = delta.get("jobs"), delta.get("dropped")
    if isinstance(jobs, dict) and job_id in jobs:
        return True
    if isinstance(dropped, list) and job_id in dropped:
        return False
    return None


def logged_in(log: AuditLog, e: Entry, job_id: str) -> Entry:
    """The entry that logs ``job_id``'s charge as fairshare entry ``e`` reads it: ``e`` itself, or, for a delta
    that carries the job on from its base, the nearest entry back along the bases that logs it (``e`` where the
    walk cannot go on: verify names that)."""
    walked, _ = _bases(log, e)
    for at, prev in zip(walked, walked[1:]):
        if charges(at, job_id) is not None:
            return at
        if not based_on(at, prev):
            return e
    return walked[-1] if charges(walked[-1], job_id) is not None else e


def based_on(e: Entry, base: Entry) -> bool:
    """Whether delta entry ``e`` names ``base`` (its seq and leaf hash) as its base."""
    delta = delta_of(e) or {}
    return delta.get("base") == base.seq and delta.get("base_leaf") == base.leaf.hex()


__all__ = ["DELTA", "FULL_EVERY", "Chain", "Read", "based_on", "carried", "charges", "delta_of", "full_jobs",
           "logged_in", "read_entry"]
