"""What accounting appends to the audit log: usage, fairshare computations with their inputs, priority changes.

Job records are appended by the collector and `jobs import` (``collector.auditlog.record_job_records``) before
they are stored; usage as feeds and reports bind to it (``binding.bind``). A query (`gpuledger fairshare` without
``--record``) appends nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuledger.accounting.audit.binding import usage_key
from gpuledger.accounting.audit.chain import DELTA, FULL_EVERY, Read, carried, read_entry
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry, plain
from gpuledger.collector.auditlog.canonical import dumps
from gpuledger.schema.records import JobUsage


def record_usage(log: AuditLog, usages: Iterable[JobUsage], final: bool = False) -> int:
    """Append a ``usage_record`` entry per usage (job total or per GPU) that is new or changed."""
    return len(log.append_many(
        ("usage_record", {**plain(u.to_dict()), "final": final}, u.job_id, usage_key(u)) for u in usages
    ))


@dataclass(frozen=True, slots=True)
class JobCharge:
    """One job's way into fairshare: charged under the policy, placed in time as ``pieces`` (start, end, amount),
    then decayed to ``now``. A fairshare entry that logs a job's pieces lets `audit verify` recompute its decay
    exactly (``explain.derive``); without them it is recomputed as spread evenly over first..last."""

    job_id: str
    account: str
    user: str
    policy: str
    charged: float
    decayed: float
    first_ts: float
    last_ts: float
    pieces: tuple[tuple[float, float, float], ...] | None = None  # None: not logged


def job_charges(
    entries: Iterable[Any], settings: Any, now: float, decay: Callable[..., Mapping[Any, float]] | None = None
) -> list[JobCharge]:
    """Per job: the charge under ``settings``' policy and its decayed value at ``now``.

    ``entries`` are ledger entries; ``settings`` an AccountingSettings. Decay is linear, so the per-job decayed
    values of an association sum to the association's decayed usage that fairshare uses.
    """
    from gpuledger.accounting.charge import allocation

    if decay is None:
        from gpuledger.accounting.decay import decayed_usage

        decay = decayed_usage
    policy = settings.charge_policy()
    rows = []
    for e in entries:
        if e.usage is None or e.record is None or not e.record.account or not e.record.user:
            continue
        rows.append((e.job_id, e.record.account, e.record.user, e.usage.first_ts, e.usage.last_ts,
                     policy.charge(e.usage, allocation(e.record, now))))
    period = settings.calc_period_s
    # decay wants an integer period (Slurm's PriorityCalcPeriod is whole seconds); settings may carry 300.0
    period = int(period) if float(period).is_integer() else period
    decayed = decay(
        [(j, first, last, amount) for j, _, _, first, last, amount in rows],
        now=now, half_life_s=settings.half_life_s, calc_period_s=period, reset=settings.usage_reset,
    )
    return [JobCharge(j, a, u, policy.kind, amount, float(decayed.get(j, 0.0)), first, last, ((first, last, amount),))
            for j, a, u, first, last, amount in rows]


def record_fairshare(
    log: AuditLog,
    *,
    now: float,
    settings: Any,
    charges: Iterable[Any],  # per-job records with job_id and user: engine.ChargedJob (or JobCharge above)
    usage: Mapping[tuple[str, str], float],
    rows: Iterable[Any],
    feed: Iterable[Any] = (),
    sources: Mapping[str, Mapping[str, Any]] | None = None,
    full: bool | None = None,
) -> Entry:
    """Append one ``fairshare`` entry: inputs (settings, per-job charges with how each was placed in time, its
    ``pieces``, and the entries of the job, usage, per-GPU usage and gap records each was computed from, decayed
    usage per association) and outputs (the fairshare rows and the site factors of the priority feed).

    The jobs are logged as a delta on the newest fairshare entry (``chain``) where that saves enough: not after
    :data:`chain.FULL_EVERY` deltas, nor once the job records the deltas since the last full entry log would pass
    half the jobs charged, nor when it leaves out fewer than :data:`DELTA_SAVES` job records. ``full``: True logs
    it in full; False as a delta wherever there is a readable base short of FULL_EVERY (tests, benchmarks)."""
    cfg = settings.model_dump() if hasattr(settings, "model_dump") else plain(settings)
    sources = sources or {}
    jobs = {c.job_id: {**plain(c), "user": log.alias(c.user), **dict(sources.get(c.job_id, {}))} for c in charges}
    assoc = [{"account": a, "user": log.alias(u), "decayed_usage": v} for (a, u), v in sorted(usage.items())]
    out_rows = []
    for r in rows:
        if isinstance(r, Mapping) or dataclasses.is_dataclass(r) or hasattr(r, "_asdict"):
            d = (dict(r._asdict()) if hasattr(r, "_asdict") else dict(r) if isinstance(r, Mapping)
                 else dataclasses.asdict(r))
        else:
            d = {k: getattr(r, k) for k in _ROW_FIELDS if hasattr(r, k)}
        # Fair Tree's LevelFS is inf where usage is 0; JSON has no inf, so non-finite floats are written as text.
        d = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
        d["user"] = log.alias(d.get("user"))
        out_rows.append(plain(d))
    out_feed = []
    for f in feed:
        d = plain(f) if not isinstance(f, Mapping) else plain(dict(f))
        d["user"] = log.alias(d.get("user"))
        out_feed.append(d)
    data = {"now": now, "settings": cfg, "inputs": {"jobs": jobs, "associations": assoc},
            "outputs": {"rows": out_rows, "feed": out_feed}}
    written = {j: carried(c) for j, c in jobs.items()}  # as a delta on this entry carries them on
    base = Read(None) if full is True else _newest_read(log)
    entry = None
    if base.entry is not None and base.deltas < FULL_EVERY:
        logged, gone = _changed(base.entry.data["inputs"]["jobs"], written)
        changes = base.changes + len(logged) + len(gone)
        if full is False or (2 * changes <= len(jobs) and len(jobs) - len(logged) >= DELTA_SAVES):
            delta = {"base": base.entry.seq, "base_leaf": base.entry.leaf.hex(), "jobs": logged, "dropped": gone}
            # written only while its base is still the newest fairshare entry (checked in the append's transaction)
            entry = log.append("fairshare", {**data, "inputs": {DELTA: delta, "associations": assoc}},
                               newest=("fairshare", base.entry.seq))
            read = Read(entry, None, base.deltas + 1, changes)
    if entry is None:  # in full: by choice, or another fairshare entry came first and is no longer the base
        entry = log.append("fairshare", data)
        assert entry is not None  # no dedupe key: always written
        read = Read(entry, None, 0, 0)
    # what the next delta is computed against: this entry read as a delta on it carries its jobs on
    _last_read[log.location] = dataclasses.replace(read, entry=dataclasses.replace(entry, data={
        **entry.data, "inputs": {**entry.data["inputs"], "jobs": written}}))
    return entry


# The recorder's own read of the newest fairshare entry, per log: `priority watch` records a cycle after cycle in
# one process, and reading the entry back from the log would walk its chain each time. The entry's leaf hash
# commits to the bases its delta names, so a read is reused only for the entry with that seq and leaf.
_last_read: dict[str, Read] = {}
DELTA_SAVES = 100  # job records a delta must leave out of the entry to be worth the walk back to a full one


def _changed(have: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The jobs of ``now`` whose logged record is not ``have``'s (added or changed, compared as their canonical
    text), and the ids of ``have``'s that ``now`` lacks."""
    logged = {j: c for j, c in now.items() if j not in have or dumps(c) != dumps(carried(have[j]))}
    return logged, [j for j in have if j not in now]


def _newest_read(log: AuditLog) -> Read:
    newest = next(log.entries(kind="fairshare", newest_first=True), None)
    if newest is None:
        return Read(None)
    last = _last_read.get(log.location)
    if last is not None and last.entry is not None and (last.entry.seq, last.entry.leaf) == (newest.seq, newest.leaf):
        return last
    return read_entry(log, newest)


_ROW_FIELDS = ("account", "user", "raw_shares", "norm_shares", "raw_usage", "norm_usage", "effective_usage",
               "fairshare", "level_fs")


def record_priority_change(log: AuditLog) -> Callable[[Any], Entry | None]:
    """One ``priority_change`` entry for one change (see :func:`record_priority_changes`)."""
    def record(change: Any) -> Entry | None:
        out = record_priority_changes(log)([change])
        return out[0] if out else None

    return record


def record_priority_changes(log: AuditLog) -> Callable[[Iterable[Any]], list[Entry]]:
    """The ``record=`` callable for ``accounting.apply.apply_changes``: one ``priority_change`` entry per change,
    all changes of one call in one transaction.

    A change is a dataclass or mapping; its ``job_id`` (or ``jobid``) field names the job and any ``user`` field
    is pseudonymized like the rest of the log.
    """
    def record(changes: Iterable[Any]) -> list[Entry]:
        items = []
        for change in changes:
            d = plain(change)
            if not isinstance(d, dict):
                raise AuditError(f"priority change {change!r} is not a record with fields")
            job = d.get("job_id", d.get("jobid"))
            if job is None:
                raise AuditError(f"priority change {d!r} names no job_id")
            if "user" in d:
                d["user"] = log.alias(d["user"])
            items.append(("priority_change", d, str(job), None))
        return log.append_many(items)

    return record
