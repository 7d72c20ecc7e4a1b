"""How a job's site factor was derived, step by step, each step citing the audit entries that prove it.

Measurements come from the job's total usage record, or, when the log has none, from its per-GPU records: never
both (a job logged per GPU and later as a total would count twice). The charge is recomputed from the logged
record under the logged policy and shown as a formula; every step without an entry is listed as not proven.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpuledger.accounting.audit.binding import is_final, record_of
from gpuledger.accounting.audit.checkpoint import iso_utc
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry
from gpuledger.schema.records import JobUsage


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


def _latest_by_key(entries: list[Entry], prefix: str) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for e in entries:  # oldest first: the newest per key wins
        if e.key and e.key.startswith(prefix) and e.kind in ("job_record", "usage_record", "correction"):
            out[e.key] = e
    return out


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
    usage = _measurements(log, mine, job_id, src.get("usage_entry"))
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
                             + "".join(_corrected(e) for e in usage), _ref(*usage)))
    else:
        ex.missing.append("measurements: no usage_record entry for this job")
    if fs is None:
        ex.missing += ["charged usage: no fairshare entry charges this job",
                       "decayed usage: no fairshare entry charges this job",
                       "fairshare: no fairshare entry charges this job",
                       "site factor: no priority feed charged this job"]
    else:
        _fairshare_steps(ex, fs, src, usage)
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
    return (f" [corrected by entry {e.seq}, which corrects entry {e.data.get('corrects')}: {fields}; "
            f"reason: {e.data.get('reason')}]")


def _measurements(log: AuditLog, mine: list[Entry], job_id: str, used_seq: Any) -> list[Entry]:
    """The usage entry the fairshare used, else the latest job total, else the latest per-GPU records."""
    if isinstance(used_seq, int):
        e = log.get(used_seq)
        if e is not None and e.job_id == job_id:
            return [e]
    usage = _latest_by_key(mine, "usage:")
    total = usage.get(f"usage:{job_id}")
    if total is not None:
        return [total]
    return sorted(usage.values(), key=lambda e: e.seq)


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


def _charge_formula(s: dict[str, Any], rec: dict[str, Any]) -> tuple[str, float | None]:
    from gpuledger.accounting.charge import ChargePolicy

    try:
        pol = ChargePolicy(kind=s.get("policy", "blend"), floor=float(s.get("floor", 0.25)),
                           model_weights=dict(s.get("model_weights") or {}))
        u = JobUsage.from_dict(rec)
    except (TypeError, ValueError, KeyError):
        return "", None
    a, act, en = u.allocated_gpu_seconds, u.sm_active_gpu_seconds, u.energy_joules
    base = {"allocated": f"{a!r} allocated GPU-s", "active": f"{act!r} SM-active GPU-s", "energy": f"{en!r} J",
            "blend": f"{pol.floor!r} x {a!r} + {1 - pol.floor!r} x {act!r}"}[pol.kind]
    w = pol.weight(u.model)
    return base + (f" x model weight {w!r}" if w != 1.0 else ""), pol.charge(u)


def _fairshare_steps(ex: Explanation, fs: Entry, c: dict[str, Any], usage: list[Entry]) -> None:
    ref = _ref(fs)
    s = fs.data.get("settings", {})
    formula, again = ("", None)
    if len(usage) == 1:
        formula, again = _charge_formula(s, record_of(usage[0]))
    charged = c.get("charged")
    # Entries since the allocation frame split the charge: the measured part is what the logged usage record
    # recomputes to (plus reassigned gap energy), the unmeasured part is the rule's; older entries have only the total.
    measured = c["measured_charge"] if "measured_charge" in c else charged
    expected = None if again is None else again + float(c.get("gap_charge") or 0.0)
    check = "" if expected is None or not isinstance(measured, int | float) else (
        " (recomputed from the logged record: same)" if math.isclose(expected, measured, rel_tol=1e-9, abs_tol=1e-9)
        else f" (recomputed from the logged record: {expected!r}, DIFFERS)")
    summary = f"policy {c.get('policy')}: {formula + ' = ' if formula else ''}{measured!r}{check}"
    unmeasured_s = c.get("unmeasured_gpu_seconds") or 0.0
    if "measured_charge" in c and (unmeasured_s or c.get("unmeasured_charge")):
        parts = float(measured or 0.0) + float(c.get("unmeasured_charge") or 0.0)
        adds_up = math.isclose(parts, float(charged or 0.0), rel_tol=1e-9, abs_tol=1e-9)
        summary += (f"; + {unmeasured_s!r} allocated GPU-s nobody measured, charged by rule "
                    f"{c.get('unmeasured_rule')!r}: {c.get('unmeasured_charge')!r}; charged {charged!r}"
                    + ("" if adds_up else " (parts DIFFER)"))
    ex.steps.append(Step("charged usage", summary, ref))
    if c.get("gap_energy_joules"):
        ex.steps.append(Step("gap energy", f"{c['gap_energy_joules']!r} J of sampling gaps' unattributed energy "
                             "reassigned to the job from Slurm's record (accounting.gaps); measured under the "
                             "energy policy", ref))
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


__all__ = ["AuditError", "Explanation", "Step", "explain"]
