"""Reports and feeds bound to the records they used: every job and usage record they read from the store must
already be in the audit log with the same content.

The store is not evidence: whoever can write the data directory can edit it. So before a feed or a signed report
uses the store's records, :func:`bind` compares each with the newest logged record under its key:

- not logged yet: appended (first sight, e.g. a job an agent described);
- a running job's usage that grew: appended (interim usage is expected to change);
- a job that ended ``FINAL_AFTER_S`` ago (the collector's late-sample window) has *final* usage, appended once;
  from then on, and for every scheduler job record (which `jobs import` and POST /api/v1/jobs log before they
  store it), a store row that differs from its logged record is a **store change**: the caller refuses it
  unless told to accept it, and then a ``correction`` entry names the entry it corrects, field by field, with
  the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuledger.collector.auditlog import AuditLog, Entry, job_data, job_key, merkle, plain
from gpuledger.collector.auditlog.canonical import dumps
from gpuledger.output import int_ranges
from gpuledger.schema.records import JobRecord, JobUsage

FINAL_AFTER_S = 600.0  # the collector's default window for late samples: after it a job's usage is complete


def usage_key(u: JobUsage) -> str:
    """A job total has one key per job whatever host it names (a job seen on one host, then on two, is one job).
    A job is (cluster, job_id): a named cluster is part of the key (unnamed, the key is what it always was)."""
    job = f"{u.cluster}/{u.job_id}" if u.cluster else u.job_id
    return f"usage:{job}" if u.gpu_uuid == "*" else f"usage:{job}/{u.host}/{u.gpu_uuid}"


def record_of(e: Entry) -> dict[str, Any]:
    """The record an entry states: a correction's new record, or the entry's data without its ``final`` mark."""
    d = e.data.get("record", {}) if e.kind == "correction" else e.data
    return {k: v for k, v in d.items() if k != "final"} if isinstance(d, dict) else {}


def is_final(e: Entry) -> bool:
    return e.kind == "correction" or (e.kind == "usage_record" and bool(e.data.get("final")))


@dataclass(frozen=True, slots=True)
class StoreChange:
    job_id: str
    record: str  # "usage" | "job record"
    field: str
    logged: Any
    stored: Any
    seq: int  # the logged entry the store disagrees with


@dataclass
class Bound:
    entries: dict[str, Entry] = field(default_factory=dict)  # log key -> the entry that states the record used
    changes: list[StoreChange] = field(default_factory=list)
    appended: int = 0
    unlogged: list[str] = field(default_factory=list)  # keys not in the log (only when nothing is appended)

    def used(self) -> list[Entry]:
        return sorted(self.entries.values(), key=lambda e: e.seq)

    def seq_of(self, key: str) -> int | None:
        e = self.entries.get(key)
        return e.seq if e else None


def _diff(logged: dict[str, Any], stored: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, logged.get(k), stored.get(k)) for k in sorted(set(logged) | set(stored))
            if dumps(logged.get(k)) != dumps(stored.get(k))]


def bind(
    log: AuditLog,
    jobs: Sequence[JobRecord],
    usages: Iterable[JobUsage],
    now: float,
    *,
    accept_reason: str | None = None,
    write: bool = True,
    final_after_s: float = FINAL_AFTER_S,
) -> Bound:
    """Compare the store's records with the log; append what is new, and corrections when ``accept_reason``.

    With store changes and no ``accept_reason`` nothing is appended (the caller refuses); with ``write=False``
    nothing is appended either (``audit verify --store``).
    """
    out = Bound()
    ends = {(r.cluster, r.job_id): r.end for r in jobs}
    ends_by_id = {r.job_id: r.end for r in jobs}  # usage of an unnamed cluster: the job's record by id
    new: list[tuple[str, Any, str, str]] = []  # kind, data, job id, key
    corrections: list[tuple[Entry, dict[str, Any], str, str, list[tuple[str, Any, Any]]]] = []
    for r in jobs:
        key, want = job_key(r), plain(job_data(log, r))
        last = log.latest(key)
        if last is None:
            new.append(("job_record", want, r.job_id, key))
            continue
        out.entries[key] = last
        diff = _diff(record_of(last), want)
        if not diff:
            continue
        if not r.cluster:  # described by an agent, not the scheduler: it is filled in as the job runs
            new.append(("job_record", want, r.job_id, key))
        else:
            out.changes += [StoreChange(r.job_id, "job record", f, a, b, last.seq) for f, a, b in diff]
            corrections.append((last, want, r.job_id, key, diff))
    for u in usages:
        key = usage_key(u)
        end = ends.get((u.cluster, u.job_id), ends_by_id.get(u.job_id) if not u.cluster else None)
        final = end is not None and now - end >= final_after_s
        want = {**plain(u.to_dict()), "final": final}
        last = log.latest(key)
        if last is None:
            new.append(("usage_record", want, u.job_id, key))
            continue
        out.entries[key] = last
        diff = _diff(record_of(last), {k: v for k, v in want.items() if k != "final"})
        if not diff:
            if final and not is_final(last):
                new.append(("usage_record", want, u.job_id, key))  # the same numbers, now final: logged once
        elif is_final(last):
            out.changes += [StoreChange(u.job_id, "usage", f, a, b, last.seq) for f, a, b in diff]
            corrections.append((last, {**want, "final": True}, u.job_id, key, diff))
        else:
            new.append(("usage_record", want, u.job_id, key))
    if not write or (out.changes and accept_reason is None):
        out.unlogged = [k for _, _, _, k in new]
        return out
    items = list(new)
    for last, want, job, key, diff in corrections:
        changes = [{"field": f, "logged": a, "stored": b} for f, a, b in diff]
        items.append(("correction", {"corrects": last.seq, "reason": accept_reason, "record": want,
                                     "changes": changes}, job, key))
    for e in log.append_many(items):
        if e.key is not None:  # every item above has one
            out.entries[e.key] = e
        out.appended += 1
    return out


def inputs_root(entries: Sequence[Entry]) -> dict[str, Any]:
    """The Merkle root (RFC 9162) over the leaf hashes of exactly these entries, in log order, and which they are."""
    es = sorted(entries, key=lambda e: e.seq)
    return {"count": len(es), "root": merkle.root_of([e.leaf for e in es]).hex(),
            "entries": int_ranges(e.seq for e in es)}




def parse_ranges(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi - lo > 10_000_000:
            raise ValueError(f"bad entry range {part!r}")
        out += range(lo, hi + 1)
    return out
