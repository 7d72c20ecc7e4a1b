"""Reports and feeds bound to the records they used: every store row a charge reads must already be in the audit
log with the same content.

The store is not evidence: whoever can write the data directory can edit it. So before a feed or a signed report
uses the store, :func:`bind` compares each record a charge reads with the newest logged record under its key:
scheduler and agent job records (``job:``), each job's usage total and its per-GPU usage rows (``usage:``; the
charge reads the per-GPU rows), the energy gaps that accounting reassigns from Slurm's records (``gap:``, with the
host's GPU count and the GPU's cluster the reassignment reads), and the hour buckets that place measured charges
in time for decay (``hours:``, one record per host and hour):

- not logged yet: appended (first sight, e.g. a job an agent described);
- a running job's usage that grew, a gap a late sample may still split: appended (interim records change);
- a job that ended, a gap whose end and an hour whose last second lie ``FINAL_AFTER_S`` back (the collector's
  late-sample window) are *final*, appended once (hour buckets are logged only then: the current hour's change
  with every sample); from then on, and for every scheduler job record (which `jobs import` and POST
  /api/v1/jobs log before they store it), a store row that differs from its logged record is a **store change**:
  the caller refuses it unless told to accept it, and then a ``correction`` entry names the entry it corrects,
  field by field, with the reason.

Keys name where a row sits in the store (a usage row's cluster, a job record's cluster), which the operator can
change; so a record is also known by what it is (the job, its host and GPU) and a logged final record is looked
for after the rows are compared: one whose row is gone, or moved to another key, is a store change as well (an
accepted one is a correction whose record is null, naming where the row went). Each bind that appends leaves a
``store_bound`` entry: a final record that first shows up after a bind already saw it final (a row inserted
later, back-dated) is a store change too. What neither can catch is a row forged before any bind saw its time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuledger.accounting.audit.checkpoint import iso_utc
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry, EntryDamaged, job_data, job_key, merkle, plain
from gpuledger.collector.auditlog.canonical import dumps
from gpuledger.output import int_ranges
from gpuledger.schema.records import JobRecord, JobUsage

FINAL_AFTER_S = 600.0  # the collector's default window for late samples: after it a job's usage is complete
HOUR = 3600.0
GpuKey = tuple[str, str, str]  # (host, GPU UUID, MIG instance or "")

JOB, USAGE, GPU_USAGE, GAP, HOURS = "job record", "usage", "per-GPU usage", "gap", "hour buckets"
ROW_DELETED, ROW_MOVED, ROW_ADDED = "(row deleted)", "(row moved)", "(row added late)"
_ROWS = (ROW_DELETED, ROW_MOVED, ROW_ADDED)
_SHORT = {JOB: "jobs", USAGE: "usage", GPU_USAGE: "gpu_usage", GAP: "gaps", HOURS: "hours"}
_PREFIX = {JOB: "job:", USAGE: "usage:", GPU_USAGE: "usage:", GAP: "gap:", HOURS: "hours:"}


class StoreDamaged(EntryDamaged):
    """A store row holds a value no measurement has (NaN, inf) and the log cannot hold: tampering, named."""


def usage_key(u: JobUsage) -> str:
    """A job total has one key per job whatever host it names (a job seen on one host, then on two, is one job).
    A job is (cluster, job_id): a named cluster is part of the key (unnamed, the key is what it always was)."""
    job = f"{u.cluster}/{u.job_id}" if u.cluster else u.job_id
    return f"usage:{job}" if u.gpu_uuid == "*" else f"usage:{job}/{u.host}/{u.gpu_uuid}"


def gap_key(g: Mapping[str, Any]) -> str:
    """A gap is its GPU (MIG instance) and span, as the store keys it."""
    gpu = f"{g['gpu_uuid']}/{g['mig']}" if g.get("mig") else g["gpu_uuid"]
    return f"gap:{g['host']}/{gpu}@{float(g['start'])!r}-{float(g['end'])!r}"


def hours_key(host: str, hour: float) -> str:
    return f"hours:{host}@{iso_utc(hour)}"


def _gpu_name(key: GpuKey) -> str:
    return f"{key[1]}/{key[2]}" if key[2] else key[1]


def record_of(e: Entry) -> dict[str, Any]:
    """The record an entry states: a correction's new record, or the entry's data without its ``final`` mark."""
    d = e.data.get("record", {}) if e.kind == "correction" else e.data
    return {k: v for k, v in d.items() if k != "final"} if isinstance(d, dict) else {}


def is_final(e: Entry) -> bool:
    return e.kind == "correction" or (e.kind in ("usage_record", "gap_record", "hours_record")
                                      and bool(e.data.get("final")))


def is_removed(e: Entry) -> bool:
    """An accepted correction saying the record's row is gone (deleted, or moved to ``moved_to``)."""
    return e.kind == "correction" and isinstance(e.data, dict) and e.data.get("record", {}) is None


@dataclass(frozen=True, slots=True)
class StoreChange:
    job_id: str  # "" for gaps and hour buckets
    record: str  # JOB | USAGE | GPU_USAGE | GAP | HOURS
    field: str  # or ROW_DELETED, ROW_MOVED (a logged final record's row is gone), ROW_ADDED (one the log missed)
    logged: Any
    stored: Any
    seq: int  # the logged entry the store disagrees with (for a new row: the bind that should have seen it)
    key: str = ""

    def what(self) -> str:
        """The record, with its key where the job does not name it (a GPU's row, a gap, an hour) and the change
        does not show it (a row deleted, moved or added shows its key)."""
        return (self.record if self.record in (JOB, USAGE) or not self.key or self.field in _ROWS
                else f"{self.record} {self.key}")

    def label(self) -> str:
        return f"job {self.job_id} {self.what()}" if self.job_id else self.what()


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


@dataclass(frozen=True, slots=True)
class _Rec:
    """One store row as the log keeps it."""

    cls: str
    kind: str
    key: str
    job_id: str | None
    want: dict[str, Any]  # the record, without the final mark
    final: bool
    final_at: float | None  # when it is (or will be) final; None while that is unknown (a job without an end)
    ident: tuple[Any, ...] | None  # what the row is, wherever the store keys it (None: its key says it all)


def _flat(d: Mapping[str, Any]) -> dict[str, Any]:
    """Nested mappings one level down as ``field.name`` (an hour record's GPUs), so a diff names the GPU."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update((f"{k}.{s}", x) for s, x in v.items())
        else:
            out[k] = v
    return out


def _diff(logged: dict[str, Any], stored: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    a, b = _flat(logged), _flat(stored)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if dumps(a.get(k)) != dumps(b.get(k))]


def _plain(value: Any, cls: str, key: str, job_id: str | None) -> dict[str, Any]:
    try:
        return plain(value)
    except AuditError as e:  # only an edit puts inf or NaN in a row the collector wrote
        who = f"job {job_id} {cls}" if job_id else cls
        raise StoreDamaged(f"store row {key} ({who}): {str(e).removeprefix('$.')} (tampered)") from None


def _identity(cls: str, d: Mapping[str, Any]) -> tuple[Any, ...] | None:
    if cls == JOB:
        return (JOB, d.get("job_id"))
    if cls in (USAGE, GPU_USAGE):
        return (cls, d.get("job_id")) if cls == USAGE else (cls, d.get("job_id"), d.get("host"), d.get("gpu_uuid"))
    return None


def _usage_recs(usages: Iterable[JobUsage], cls: str, ends: Mapping[tuple[str, str], float | None],
                ends_by_id: Mapping[str, float | None], now: float, final_after_s: float) -> Iterable[_Rec]:
    for u in usages:
        key = usage_key(u)
        end = ends.get((u.cluster, u.job_id), ends_by_id.get(u.job_id) if not u.cluster else None)
        want = _plain(u.to_dict(), cls, key, u.job_id)
        yield _Rec(cls, "usage_record", key, u.job_id, want, end is not None and now - end >= final_after_s,
                   None if end is None else end + final_after_s, _identity(cls, want))


def _records(log: AuditLog, jobs: Sequence[JobRecord], usages: Iterable[JobUsage],
             per_gpu: Iterable[JobUsage] | None, gaps: Iterable[Mapping[str, Any]] | None,
             busy: Mapping[GpuKey, Sequence[tuple[float, float]]] | None, now: float, final_after_s: float,
             ) -> list[_Rec]:
    out = []
    for r in jobs:
        key = job_key(r)
        want = _plain(job_data(log, r), JOB, key, r.job_id)
        out.append(_Rec(JOB, "job_record", key, r.job_id, want, False,
                        None if r.end is None else r.end + final_after_s, _identity(JOB, want)))
    ends = {(r.cluster, r.job_id): r.end for r in jobs}
    ends_by_id = {r.job_id: r.end for r in jobs}  # usage of an unnamed cluster: the job's record by id
    out += _usage_recs(usages, USAGE, ends, ends_by_id, now, final_after_s)
    if per_gpu is not None:
        out += _usage_recs(per_gpu, GPU_USAGE, ends, ends_by_id, now, final_after_s)
    for g in gaps or ():
        key = gap_key(g)
        want = _plain(dict(g), GAP, key, None)
        end = float(g["end"])
        out.append(_Rec(GAP, "gap_record", key, None, want, now - end >= final_after_s, end + final_after_s, None))
    by_hour: dict[tuple[str, float], dict[str, float]] = {}
    for gpu, rows in (busy or {}).items():
        for hour, seconds in rows:
            if now - (hour + HOUR) >= final_after_s:  # the current hour changes with every sample: logged once final
                by_hour.setdefault((gpu[0], float(hour)), {})[_gpu_name(gpu)] = seconds
    for (host, hour), gpus in sorted(by_hour.items()):
        key = hours_key(host, hour)
        want = _plain({"host": host, "hour": hour, "busy": dict(sorted(gpus.items()))}, HOURS, key, None)
        out.append(_Rec(HOURS, "hours_record", key, None, want, True, hour + HOUR + final_after_s, None))
    return out


@dataclass(frozen=True, slots=True)
class _Seen:
    """The newest ``store_bound`` entry that bound a class of records: what it saw as final, it logged."""

    now: float
    seq: int
    hours_since: float | None


def _bound_at(log: AuditLog) -> dict[str, _Seen]:
    out: dict[str, _Seen] = {}
    for e in log.latest_by_prefix("bound:").values():
        d = e.data if isinstance(e.data, dict) else {}
        t, classes, since = d.get("now"), d.get("bound"), d.get("hours_since")
        if not isinstance(t, (int, float)) or not isinstance(classes, dict):
            continue
        for cls in classes:
            if cls not in out or out[cls].now < t:
                out[cls] = _Seen(float(t), e.seq, since if isinstance(since, (int, float)) else None)
    return out


def _logged_class(cls: str, e: Entry) -> str | None:
    """Which class of record a logged entry under a ``usage:`` key states (a total names GPU "*")."""
    if cls not in (USAGE, GPU_USAGE):
        return cls
    gpu = record_of(e).get("gpu_uuid")
    return USAGE if gpu == "*" else GPU_USAGE if isinstance(gpu, str) else None


def _required(cls: str, e: Entry, now: float, final_after_s: float, hours_floor: float | None) -> bool:
    """Whether a logged record must still have its row: it is final (a job record: the job ended the late window
    ago), and an hour bucket is one the caller read (from ``hours_floor`` on)."""
    d = record_of(e)
    if cls == JOB:
        end = d.get("end")
        return isinstance(end, (int, float)) and now - end >= final_after_s
    if cls == HOURS and hours_floor is not None:
        hour = d.get("hour")
        if not isinstance(hour, (int, float)) or hour < hours_floor:
            return False
    return is_final(e)


def bind(
    log: AuditLog,
    jobs: Sequence[JobRecord],
    usages: Iterable[JobUsage],
    now: float,
    *,
    per_gpu: Iterable[JobUsage] | None = None,
    gaps: Iterable[Mapping[str, Any]] | None = None,
    busy: Mapping[GpuKey, Sequence[tuple[float, float]]] | None = None,
    busy_since: float | None = None,
    stored_jobs: Iterable[JobRecord] = (),
    accept_reason: str | None = None,
    write: bool = True,
    final_after_s: float = FINAL_AFTER_S,
) -> Bound:
    """Compare the store's records with the log; append what is new, and corrections when ``accept_reason``.

    ``jobs`` and ``usages`` (job totals) are always bound; ``per_gpu`` (the per-GPU usage rows), ``gaps``
    (``ledger.GapInputs.records()``) and ``busy`` (``store.busy_hours(busy_since)``) when given: a class of
    records not given is neither compared nor looked for. ``stored_jobs``: job rows the store holds besides
    ``jobs`` (agents' descriptions a scheduler record hides), which are not missing.

    With store changes and no ``accept_reason`` nothing is appended (the caller refuses); with ``write=False``
    nothing is appended either (``audit verify --store``).
    """
    out = Bound()
    recs = _records(log, jobs, usages, per_gpu, gaps, busy, now, final_after_s)
    given = [JOB, USAGE] + [c for c, v in ((GPU_USAGE, per_gpu), (GAP, gaps), (HOURS, busy)) if v is not None]
    logged: dict[str, dict[str, Entry]] = {}
    for cls in given:
        p = _PREFIX[cls]
        if p not in logged:
            logged[p] = log.latest_by_prefix(p)
    seen = _bound_at(log)
    hours_floor = None if busy_since is None or not math.isfinite(busy_since) else math.floor(busy_since / HOUR) * HOUR
    present = {r.key for r in recs} | {job_key(r) for r in stored_jobs}
    new: list[tuple[str, Any, str | None, str]] = []  # kind, data, job id, key
    # (entry corrected or None, the record now (None: its row is gone), job id, key, changes, extra fields)
    corrections: list[tuple[Entry | None, dict[str, Any] | None, str | None, str, list[tuple[str, Any, Any]],
                            dict[str, Any]]] = []

    def change(rec_cls: str, job: str | None, key: str, diff: list[tuple[str, Any, Any]], seq: int) -> None:
        out.changes.extend(StoreChange(job or "", rec_cls, f, a, b, seq, key) for f, a, b in diff)

    first: list[_Rec] = []
    for rec in recs:
        last = logged[_PREFIX[rec.cls]].get(rec.key)
        if last is None or is_removed(last):
            first.append(rec)
            continue
        out.entries[rec.key] = last
        diff = _diff(record_of(last), rec.want)
        if rec.cls == JOB:
            if not diff:
                continue
            if not rec.want.get("cluster"):  # described by an agent, not the scheduler: filled in as the job runs
                new.append((rec.kind, rec.want, rec.job_id, rec.key))
            else:
                change(JOB, rec.job_id, rec.key, diff, last.seq)
                corrections.append((last, rec.want, rec.job_id, rec.key, diff, {}))
        elif not diff:
            if rec.final and not is_final(last):
                new.append((rec.kind, {**rec.want, "final": True}, rec.job_id, rec.key))  # now final: logged once
        elif is_final(last):
            change(rec.cls, rec.job_id, rec.key, diff, last.seq)
            corrections.append((last, {**rec.want, "final": True}, rec.job_id, rec.key, diff, {}))
        else:
            new.append((rec.kind, {**rec.want, "final": rec.final}, rec.job_id, rec.key))

    # Logged final records whose row is gone: deleted, or moved to a key the log never saw (paired by identity).
    unseen = {rec.ident: rec for rec in first if rec.ident is not None}
    named = {rec.job_id for rec in recs if rec.cls == JOB and rec.want.get("cluster") and rec.key in logged["job:"]}
    moved: set[str] = set()
    for cls in given:
        for key, e in logged[_PREFIX[cls]].items():
            if key in present or is_removed(e) or _logged_class(cls, e) != cls:
                continue
            if not _required(cls, e, now, final_after_s, hours_floor):
                continue
            d = record_of(e)
            if cls == JOB and not d.get("cluster") and d.get("job_id") in named:
                continue  # an unnamed scheduler record that `jobs import` merged into its cluster's (logged) one
            ident = _identity(cls, d)
            to = unseen.get(ident) if ident is not None else None
            if to is not None:
                diff = _diff(d, to.want) or [(ROW_MOVED, key, to.key)]
                moved.add(to.key)
            else:
                diff = [(ROW_DELETED, key, None)]
            change(cls, e.job_id, key, diff, e.seq)
            corrections.append((e, None, e.job_id, key, diff, {"moved_to": to.key if to is not None else None}))

    for rec in first:
        data = rec.want if rec.cls == JOB else {**rec.want, "final": rec.final}
        s = seen.get(_SHORT[rec.cls])
        if (s is not None and rec.key not in moved and rec.final_at is not None and rec.final_at <= s.now
                and (rec.cls != HOURS or s.hours_since is None or rec.want["hour"] >= s.hours_since)):
            # final when the last bind read the store, yet not logged by it: the row was not there then
            diff = [(ROW_ADDED, None, rec.key)]
            change(rec.cls, rec.job_id, rec.key, diff, s.seq)
            corrections.append((None, data, rec.job_id, rec.key, diff, {}))
        else:
            new.append((rec.kind, data, rec.job_id, rec.key))

    if not write or (out.changes and accept_reason is None):
        out.unlogged = [k for _, _, _, k in new]
        return out
    items = list(new)
    for last, want, job, key, diff, extra in corrections:
        changes = [{"field": f, "logged": a, "stored": b} for f, a, b in diff]
        items.append(("correction", {"corrects": last.seq if last is not None else None, "reason": accept_reason,
                                     "record": want, "changes": changes, **extra}, job, key))
    # what this bind saw, whatever it appended: a final row that shows up later was not in the store now
    bound = {_SHORT[c]: sum(1 for rec in recs if rec.cls == c) for c in given}
    items.append(("store_bound", {"now": now, "final_after_s": final_after_s, "bound": bound,
                                  "hours_since": hours_floor}, None, "bound:" + "+".join(sorted(bound))))
    for e in log.append_many(items):
        if e.kind == "store_bound":
            continue
        if e.key is not None and not is_removed(e):
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
