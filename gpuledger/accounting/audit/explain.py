"""How a job's site factor was derived, step by step, each step citing the audit entries that prove it.

Measurements come from the per-GPU usage records the fairshare entry names (what the charge read), else the job
total it names, else the job's latest total, else its latest per-GPU records: never both (a job logged per GPU and
later as a total would count twice). The measured charge is recomputed from those logged records (and the logged
job record's allocation) under the logged policy and shown as a formula; every step without an entry is listed as
not proven, and reassigned gap energy is proven only by the gap records it came from. :func:`charge_problems`
finds every charge explain would show as DIFFERS (``audit verify`` fails on them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuledger.accounting.audit.binding import is_final, is_removed, record_of
from gpuledger.accounting.audit.checkpoint import iso_utc
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry
from gpuledger.schema.records import JobRecord, JobUsage


@dataclass(frozen=True, slots=True)
class Step:
    name: str  # job record | measurements | charged usage | decayed usage | fairshare | site factor | applied
    summary: str
    entries: tuple[tuple[int, str], ...]  # (seq, leaf hash hex) of the audit entries that prove it


@dataclass
class Explanation:
    job_id: str
    steps: list[Step] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "step: why it is not proven"
    chain_ok: bool = True
    chain_problem: str | None = None
    entries: int = 0


def _ref(*es: Entry) -> tuple[tuple[int, str], ...]:
    return tuple((e.seq, e.leaf.hex()) for e in es)


def _iso(t: Any) -> str:
    return iso_utc(t) if isinstance(t, (int, float)) else "?"


def _assoc(items: list[dict[str, Any]], acct: Any, user: Any) -> dict[str, Any] | None:
    return next((r for r in items if r.get("account") == acct and r.get("user") == user), None)


def _latest_entries(entries: list[Entry], prefix: str) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for e in entries:  # oldest first: the newest per key wins
        if e.key and e.key.startswith(prefix) and e.kind in ("job_record", "usage_record", "correction"):
            out[e.key] = e
    return out


def _latest_by_key(entries: list[Entry], prefix: str) -> dict[str, Entry]:
    """The newest record per key (a row accepted as gone states none)."""
    return {k: e for k, e in _latest_entries(entries, prefix).items() if not is_removed(e)}


def explain(log: AuditLog, job_id: str, verify: bool = True) -> Explanation:
    ex = Explanation(job_id)
    if verify:
        res = log.verify()
        ex.chain_ok, ex.entries = res.ok, res.entries
        ex.chain_problem = None if res.ok else str(res.problem)
    mine = list(log.entries(job_id=job_id))
    jobs = _latest_by_key(mine, "job:")
    job = max(jobs.values(), key=lambda e: e.seq) if jobs else None
    if job is not None:
        d = record_of(job)
        ex.steps.append(Step("job record", f"account {d.get('account')}, user {d.get('user')}, {d.get('gpus')} GPU(s), "
                             f"start {_iso(d.get('start'))}, end {_iso(d.get('end'))}, state {d.get('state')}"
                             + _corrected(job), _ref(job)))
    else:
        ex.missing.append("job record: no job_record entry (the scheduler's record was never logged)")
    fs = _fairshare_for(log, job_id)
    src = fs.data["inputs"]["jobs"][job_id] if fs is not None else {}
    usage = _measurements(log, lambda: mine, job_id, src)
    # rows accepted as gone (deleted, or moved to a key the log had not seen): what the measurements lost
    gone = [e for e in _latest_entries(mine, "usage:").values() if is_removed(e)]
    if usage:
        recs = [record_of(e) for e in usage]
        total = len(usage) == 1 and recs[0].get("gpu_uuid") == "*"
        alloc = sum(r.get("allocated_gpu_seconds", 0.0) for r in recs)
        active = sum(r.get("sm_active_gpu_seconds", 0.0) for r in recs)
        energy = sum(r.get("energy_joules", 0.0) for r in recs)
        first = min(r.get("first_ts", 0.0) for r in recs)
        last = max(r.get("last_ts", 0.0) for r in recs)
        samples = sum(r.get("samples", 0) for r in recs)
        final = all(is_final(e) for e in usage)
        what = "job total" if total else f"{len(usage)} per-GPU record(s), summed"
        ex.steps.append(Step("measurements", f"{what} ({'final' if final else 'interim: the job had not ended'}): "
                             f"first sample {_iso(first)}, last sample {_iso(last)}, {samples} samples; "
                             f"{alloc:.6g} allocated GPU-s, {active:.6g} SM-active GPU-s, {energy:.6g} J"
                             + "".join(_corrected(e) for e in (*usage, *gone)), _ref(*usage, *gone)))
    else:
        ex.missing.append("measurements: no usage_record entry for this job")
    if fs is None:
        ex.missing += ["charged usage: no fairshare entry charges this job",
                       "decayed usage: no fairshare entry charges this job",
                       "fairshare: no fairshare entry charges this job",
                       "site factor: no priority feed charged this job"]
    else:
        charged = _charged_records(log, lambda: usage, job_id, src)
        _fairshare_steps(ex, log, fs, src, charged, _charged_job_record(log, src, job))
    changes = list(log.entries(job_id=job_id, kind="priority_change"))
    if changes:
        last_c = changes[-1].data
        ex.steps.append(Step("applied", f"site factor {last_c.get('old_factor')} -> {last_c.get('new_factor')} "
                             f"(fairshare {last_c.get('fairshare')!r})", _ref(*changes)))
    else:
        ex.missing.append("applied: no priority_change entry (the factor was not applied to this job yet)")
    return ex


def _corrected(e: Entry) -> str:
    if e.kind != "correction":
        return ""
    fields = ", ".join(f"{c.get('field')} {c.get('logged')!r} -> {c.get('stored')!r}"
                       for c in e.data.get("changes", []))
    reason = e.data.get("reason")
    if e.data.get("corrects") is None:
        return f" [entry {e.seq} accepted a final row the log had not seen before: {fields}; reason: {reason}]"
    if is_removed(e):
        moved = e.data.get("moved_to")
        return (f" [entry {e.seq} accepted that the row of entry {e.data.get('corrects')} is gone"
                + (f" (moved to {moved})" if moved else "") + f": {fields}; reason: {reason}]")
    return f" [corrected by entry {e.seq}, which corrects entry {e.data.get('corrects')}: {fields}; reason: {reason}]"


def _cited(log: AuditLog, seqs: Any, job_id: str | None, kinds: tuple[str, ...]) -> list[Entry] | None:
    """The entries ``seqs`` names, when each is there, of one of ``kinds`` (and of the job); else None."""
    if not isinstance(seqs, list) or not seqs or not all(type(s) is int for s in seqs):
        return None
    es = [log.get(s) for s in seqs]
    ok = all(e is not None and e.kind in kinds and not is_removed(e)
             and (job_id is None or e.job_id == job_id.partition("@")[0]) for e in es)
    return [e for e in es if e is not None] if ok else None


def _measurements(log: AuditLog, mine: Callable[[], list[Entry]], job_id: str, src: Mapping[str, Any]
                  ) -> list[Entry]:
    """The per-GPU usage entries the fairshare charged, else the job total it names, else the latest job total,
    else the latest per-GPU records."""
    cited = _cited(log, src.get("gpu_entries"), job_id, ("usage_record", "correction"))
    if cited is not None:
        return cited
    cited = _cited(log, [src.get("usage_entry")], job_id, ("usage_record", "correction"))
    if cited is not None:
        return cited
    usage = _latest_by_key(mine(), "usage:")
    total = usage.get(f"usage:{job_id}")
    if total is not None:
        return [total]
    return sorted(usage.values(), key=lambda e: e.seq)


def _charged_records(log: AuditLog, fallback: Callable[[], list[Entry]], job_id: str, c: Mapping[str, Any]
                     ) -> list[Entry]:
    """The usage records a charge was computed from: those its fairshare entry names (none: nothing was measured
    then, whatever was logged since); ``fallback`` for an entry written before entries named them."""
    if "usage_entry" not in c and "gpu_entries" not in c:
        return fallback()
    return (_cited(log, c.get("gpu_entries"), job_id, ("usage_record", "correction"))
            or _cited(log, [c.get("usage_entry")], job_id, ("usage_record", "correction")) or [])


def _fairshare_for(log: AuditLog, job_id: str) -> Entry | None:
    """The newest fairshare entry that charged the job with a priority feed, else the newest that charged it."""
    fallback = None
    for e in log.entries(kind="fairshare", newest_first=True):
        try:
            if job_id not in e.data["inputs"]["jobs"]:
                continue
        except (KeyError, TypeError):
            continue
        if e.data.get("outputs", {}).get("feed"):
            return e
        fallback = fallback or e
    return fallback


def _policy(s: Mapping[str, Any]) -> Any:
    from gpuledger.accounting.charge import ChargePolicy

    return ChargePolicy(kind=s.get("policy", "blend"), floor=float(s.get("floor", 0.25)),
                        model_weights=dict(s.get("model_weights") or {}),
                        unmeasured=s.get("unmeasured", "allocated"),
                        full_power_watts=float(s.get("full_power_watts", 700.0)))


def _charged_job_record(log: AuditLog, src: Mapping[str, Any], latest: Entry | None) -> Entry | None:
    """The job record entry the fairshare charged the job's allocation from (else the job's latest one)."""
    cited = _cited(log, [src.get("job_entry")], None, ("job_record", "correction"))
    return cited[0] if cited else latest


def _charge_formula(s: Mapping[str, Any], c: Mapping[str, Any], usage: list[Entry], job: Entry | None,
                    now: Any) -> tuple[str, float | None]:
    """How the measured charge is made of the logged records, and its value recomputed from them (None when it
    cannot be: a record missing, a policy that needs the allocation and no job record)."""
    from gpuledger.accounting.charge import allocation
    from gpuledger.accounting.scope import in_scope

    try:
        pol = _policy(s)
        us = [JobUsage.from_dict(record_of(e)) for e in usage]
        gap = float(c.get("gap_energy_joules") or 0.0)
        alloc = None
        if "measured_charge" not in c:  # before the allocation frame: the charge was the records' alone
            again = math.fsum(pol.charge(u) for u in us) + float(c.get("gap_charge") or 0.0)
        else:
            if c.get("seen_by") != "agent":
                if job is None:
                    return "", None
                record = JobRecord.from_dict(record_of(job))
                alloc = allocation(record, float(now))
                us = list(in_scope(record, us, float(now))[0])  # as the charge held them to the record
            again = pol.charge_job(alloc, us, gap, 0.0).measured  # gap GPU-seconds move only the unmeasured part
    except (TypeError, ValueError, KeyError, AttributeError):
        return "", None
    if len(us) != 1:
        return f"the charges of {len(us)} per-GPU records", again
    u = us[0]
    a, act, en = u.allocated_gpu_seconds, u.sm_active_gpu_seconds, u.energy_joules
    base = {"allocated": f"{a!r} allocated GPU-s", "active": f"{act!r} SM-active GPU-s", "energy": f"{en!r} J",
            "blend": f"{pol.floor!r} x {a!r} + {1 - pol.floor!r} x {act!r}"}[pol.kind]
    w = pol.measured_weight(u, alloc)
    return base + (f" x model weight {w!r}" if w != 1.0 else ""), again


@dataclass(frozen=True, slots=True)
class _Check:
    formula: str
    measured: Any
    expected: float | None
    differs: bool  # the logged records do not recompute to the logged measured charge
    parts_differ: bool  # measured + unmeasured is not the logged total


def _check(fs: Entry, c: Mapping[str, Any], usage: list[Entry], job: Entry | None) -> _Check:
    s = fs.data.get("settings", {})
    formula, expected = _charge_formula(s, c, usage, job, fs.data.get("now")) if usage else ("", None)
    # Entries since the allocation frame split the charge: the measured part is what the logged usage records
    # recompute to (with reassigned gap energy), the unmeasured part is the rule's; older entries have the total.
    measured = c["measured_charge"] if "measured_charge" in c else c.get("charged")
    differs = (expected is not None and isinstance(measured, int | float)
               and not math.isclose(expected, measured, rel_tol=1e-9, abs_tol=1e-9))
    parts = float(measured or 0.0) + float(c.get("unmeasured_charge") or 0.0) if "measured_charge" in c else None
    parts_differ = parts is not None and not math.isclose(parts, float(c.get("charged") or 0.0), rel_tol=1e-9,
                                                          abs_tol=1e-9)
    return _Check(formula, measured, expected, differs, parts_differ)


def _fairshare_steps(ex: Explanation, log: AuditLog, fs: Entry, c: dict[str, Any], usage: list[Entry],
                     job: Entry | None) -> None:
    ref = _ref(fs)
    s = fs.data.get("settings", {})
    k = _check(fs, c, usage, job)
    charged = c.get("charged")
    records = "record" if len(usage) == 1 else "records"
    check = "" if k.expected is None or not isinstance(k.measured, int | float) else (
        f" (recomputed from the logged {records}: {k.expected!r}, DIFFERS)" if k.differs
        else f" (recomputed from the logged {records}: same)")
    gaps = _cited_gaps(ex, log, fs, c)
    if gaps is None and c.get("gap_charge"):
        check += f" (of which {c['gap_charge']!r} charges gap energy that is not proven)"
    summary = f"policy {c.get('policy')}: {k.formula + ' = ' if k.formula else ''}{k.measured!r}{check}"
    unmeasured_s = c.get("unmeasured_gpu_seconds") or 0.0
    if "measured_charge" in c and (unmeasured_s or c.get("unmeasured_charge") or k.parts_differ):
        summary += (f"; + {unmeasured_s!r} allocated GPU-s nobody measured, charged by rule "
                    f"{c.get('unmeasured_rule')!r}: {c.get('unmeasured_charge')!r}; charged {charged!r}"
                    + (" (parts DIFFER)" if k.parts_differ else ""))
    ex.steps.append(Step("charged usage", summary, ref + _ref(*usage) if usage else ref))
    if gaps:
        ex.steps.append(Step("gap energy", f"{c['gap_energy_joules']!r} J of sampling gaps' unattributed energy "
                             f"reassigned to the job from Slurm's record (accounting.gaps) out of {len(gaps)} gap "
                             "record(s); measured under the energy policy"
                             + "".join(sorted({_corrected(g) for g in gaps})), _ref(*gaps) + ref))
    acct, user = c.get("account"), c.get("user")
    a_total = (_assoc(fs.data["inputs"].get("associations", []), acct, user) or {}).get("decayed_usage")
    ex.steps.append(Step("decayed usage", f"half-life {s.get('half_life_s')} s, "
                         f"calc period {s.get('calc_period_s')} s, "
                         f"usage from {_iso(c.get('first_ts'))} to {_iso(c.get('last_ts'))} decayed to "
                         f"{_iso(fs.data.get('now'))}: {c.get('decayed')!r} of association {user}@{acct}'s {a_total!r}",
                         ref))
    outputs = fs.data.get("outputs", {})
    row = _assoc(outputs.get("rows", []), acct, user)
    if row is not None:
        ex.steps.append(Step("fairshare", f"{s.get('algorithm')}: norm shares {row.get('norm_shares')!r}, "
                             f"effective usage {row.get('effective_usage')!r} -> "
                             f"fairshare {row.get('fairshare')!r}", ref))
    else:
        ex.missing.append(f"fairshare: the fairshare entry {fs.seq} has no row for {user}@{acct}")
    feed = _assoc(outputs.get("feed", []), acct, user)
    if feed is not None:
        ex.steps.append(Step("site factor", f"round({s.get('priority_weight')} x {feed.get('fairshare')!r}) = "
                             f"{feed.get('site_factor')}", ref))
    else:
        ex.missing.append(f"site factor: the fairshare entry {fs.seq} that charged this job carries no priority feed")


def _cited_gaps(ex: Explanation, log: AuditLog, fs: Entry, c: Mapping[str, Any]) -> list[Entry] | None:
    """The gap records a job's reassigned energy came from, when the fairshare entry names them all; else the
    gap energy goes to ``ex.missing`` (it is the fairshare entry's word only) and None."""
    if not c.get("gap_energy_joules"):
        return None
    cited = _cited(log, c.get("gap_entries"), None, ("gap_record", "correction"))
    if cited is None:
        ex.missing.append(f"gap energy: {c['gap_energy_joules']!r} J reassigned from sampling gaps that no logged "
                          f"gap record proves (fairshare entry {fs.seq} names none)")
    return cited


def _entries_of(log: AuditLog, job_id: str) -> list[Entry]:
    return list(log.entries(job_id=job_id))


def charge_problems(log: AuditLog) -> list[tuple[int, str]]:
    """Every charge `audit explain` would show as DIFFERS: per job, in the fairshare entry explain takes for it
    (the newest with a priority feed that charged it, else the newest that charged it); (entry, message)."""
    with_feed: dict[str, Entry] = {}
    without: dict[str, Entry] = {}
    for fs in log.entries(kind="fairshare", newest_first=True):
        try:
            jobs, feed = fs.data["inputs"]["jobs"], fs.data.get("outputs", {}).get("feed")
        except (KeyError, TypeError, AttributeError):
            continue
        if isinstance(jobs, dict):
            for j in jobs:
                (with_feed if feed else without).setdefault(j, fs)
    out = []
    for job_id, fs in {**without, **with_feed}.items():
        c = fs.data["inputs"]["jobs"][job_id]
        if not isinstance(c, dict):
            continue
        usage = _charged_records(log, functools.partial(_measurements, log, functools.partial(_entries_of, log, job_id),
                                                        job_id, c), job_id, c)
        jobs = _latest_by_key(list(log.entries(job_id=job_id)), "job:") if not c.get("job_entry") else {}
        latest = max(jobs.values(), key=lambda e: e.seq) if jobs else None
        k = _check(fs, c, usage, _charged_job_record(log, c, latest))
        if k.differs:
            out.append((fs.seq, f"audit entry {fs.seq}: job {job_id}'s measured charge {k.measured!r} is not what "
                                f"the logged records it names recompute to ({k.expected!r}): DIFFERS"))
        if k.parts_differ:
            out.append((fs.seq, f"audit entry {fs.seq}: job {job_id}'s measured and unmeasured charges do not add up "
                                f"to its charge {c.get('charged')!r}: parts DIFFER"))
    return out


__all__ = ["AuditError", "Explanation", "Step", "charge_problems", "explain"]
