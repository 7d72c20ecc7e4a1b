"""How a job's site factor was derived, step by step, each step citing the audit entries that prove it.

Measurements come from the per-GPU usage records the fairshare entry names (what the charge read), else the job
total it names, else the job's latest total, else its latest per-GPU records: never both (a job logged per GPU and
later as a total would count twice). The measured charge is recomputed from those logged records (and the logged
job record's allocation) under the logged policy and shown as a formula; reassigned gap energy is proven only by
the gap records it came from. The fairshare entry's own outputs are recomputed from its inputs with accounting's
own code (:func:`derive`: decay, each association's usage as the sum of its jobs', the fairshare rows over the tree
they state, each site factor), and a newer entry that drops a job still weighing in fairshare is named
(:func:`dropped`). Every step without an entry, that does not follow, or that the entry lacks the data to
recompute is listed as not proven; :func:`fairshare_problems` finds everything that does not follow (``audit
verify`` fails on it). The factor applied is proven only by the job's newest ``applied`` priority change; a newer
one (sent with no outcome logged, unconfirmed, failed) is listed as not proven (:func:`unsettled`). Fairshare
entries are read with their full inputs through ``chain`` (a delta as the entry it stands for).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gpuledger.accounting.audit.binding import is_final, is_removed, record_of
from gpuledger.accounting.audit.chain import (
    Chain,
    Read,
    based_on,
    charges,
    delta_of,
    full_jobs,
    logged_in,
    read_entry,
)
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
                             + _earlier_runs(d) + _corrected(job), _ref(job)))
    else:
        ex.missing.append("job record: no job_record entry (the scheduler's record was never logged)")
    read, newest = _fairshare_for(log, job_id)
    fs = read.entry if read is not None else None
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
    if fs is None and read is not None and read.problem is not None:
        ex.missing.append(f"fairshare: {read.problem}")
    if fs is None:
        ex.missing += ["charged usage: no fairshare entry charges this job",
                       "decayed usage: no fairshare entry charges this job",
                       "fairshare: no fairshare entry charges this job",
                       "site factor: no priority feed charged this job"]
    else:
        charged = _charged_records(log, lambda: usage, job_id, src)
        _fairshare_steps(ex, log, fs, src, charged, _charged_job_record(log, src, job), derive(fs))
        if newest is not None and newest.seq != fs.seq and isinstance(src, dict) and _still_weighs(newest, src):
            keys = {_charge_key(j, c) for j, c in newest.data["inputs"]["jobs"].items()}
            if _charge_key(job_id, src) not in keys and not _job_gone(log, fs, newest, src, job_id):
                ex.missing.append(f"charged usage: the newest fairshare entry {newest.seq} does not charge this job, "
                                  f"though it still weighs in fairshare (dropped); the steps shown are entry "
                                  f"{fs.seq}'s")
    _applied_step(ex, log.entries(job_id=job_id, kind="priority_change"))
    return ex


# -- priority changes -------------------------------------------------------------------------------------------
# `priority apply` logs each change twice: before its scontrol command ("intended": from then on Slurm may hold
# it) and after it with the outcome. An entry without a status was written before that, once Slurm had taken it.
CHANGE_STATUSES = ("intended", "applied", "failed", "unconfirmed")


def change_status(e: Entry) -> Any:
    """A ``priority_change`` entry's status ("applied" for one written before changes were logged twice)."""
    return e.data.get("status", "applied") if isinstance(e.data, dict) else None


def latest_changes(changes: Iterable[Entry]) -> dict[str, tuple[Entry | None, Entry]]:
    """Per job of ``changes`` (``priority_change`` entries, oldest first): its newest ``applied`` entry (None:
    none) and its newest entry of all, which says what Slurm may hold now."""
    out: dict[str, tuple[Entry | None, Entry]] = {}
    for e in changes:
        job = str(e.job_id)
        applied = e if change_status(e) == "applied" else out[job][0] if job in out else None
        out[job] = (applied, e)
    return out


def _factors(e: Entry) -> str:
    d = e.data if isinstance(e.data, dict) else {}
    return f"{d.get('old_factor')} -> {d.get('new_factor')}"


def unsettled(e: Entry) -> str | None:
    """Why the newest ``priority_change`` entry ``e`` of a job does not prove what Slurm holds (None: it does, as
    ``applied``)."""
    status = change_status(e)
    error = e.data.get("error") if isinstance(e.data, dict) else None
    if status == "applied":
        return None
    if status == "intended":
        return (f"sent to Slurm, outcome not recorded (the run stopped); Slurm may hold {_factors(e)} "
                f"(entry {e.seq}, intended)")
    if status == "unconfirmed":
        return f"site factor {_factors(e)} may have been set (entry {e.seq}, unconfirmed: {error})"
    if status == "failed":
        return f"site factor {_factors(e)} not applied (entry {e.seq}, failed: {error})"
    return f"entry {e.seq}'s status {status!r} is not one of {', '.join(CHANGE_STATUSES)}"


def _applied_step(ex: Explanation, changes: Iterable[Entry]) -> None:
    """The factor Slurm was set to: proven by the job's newest ``applied`` entry only; a newer entry that is not one
    (a change sent whose outcome is not logged, unconfirmed, failed) is listed as not proven."""
    latest = latest_changes(changes).get(ex.job_id)
    if latest is None:
        ex.missing.append("applied: no priority_change entry (the factor was not applied to this job yet)")
        return
    applied, newest = latest
    if applied is not None:
        d = applied.data
        ex.steps.append(Step("applied", f"site factor {_factors(applied)} (fairshare {d.get('fairshare')!r})",
                             _ref(applied)))
    why = unsettled(newest)
    if why is not None:
        ex.missing.append("applied: " + ("" if applied is None else f"a change after entry {applied.seq}'s: ") + why)


def _earlier_runs(record: Mapping[str, Any]) -> str:
    """A requeued job's earlier runs as the explanation names them (each is charged as the latest run is)."""
    runs = record.get("earlier_runs")
    if not isinstance(runs, list) or not runs:
        return ""
    return "; requeued, earlier runs " + ", ".join(
        f"{_iso(r[0])}..{_iso(r[1])} on {','.join(map(str, r[2])) or '-'}" if isinstance(r, list) and len(r) == 3
        and isinstance(r[2], list) else repr(r) for r in runs)


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


def _fairshare_for(log: AuditLog, job_id: str) -> tuple[Read | None, Entry | None]:
    """The newest fairshare entry that charged the job with a priority feed, else the newest that charged it, as
    read with its full inputs (``chain.read_entry``); and the newest fairshare entry of all (readable as one),
    read so. One walk back: a delta that neither logs nor drops the job charges it as its base does."""
    fallback = newest = None
    pending: list[Entry] = []  # newer deltas, each on the next: whether they charge the job is their base's say
    for e in log.entries(kind="fairshare", newest_first=True):
        if pending and not based_on(pending[-1], e):
            pending = []  # a broken chain: none of them can be read
        says = charges(e, job_id)
        if says is None:
            pending.append(e)
            continue
        group, pending = [*pending, e], []
        if delta_of(e) is None and full_jobs(e) is None:
            continue  # no computation: neither it nor the deltas on it can be read
        newest = newest or group[0]
        if not says:
            continue
        fed = next((g for g in group if _outputs(g).get("feed")), None)
        if fed is not None:
            return _read_both(log, fed, newest)
        fallback = fallback or group[0]
    if fallback is None:
        return None, read_entry(log, newest).entry if newest is not None else None
    return _read_both(log, fallback, newest)


def _read_both(log: AuditLog, e: Entry, newest: Entry | None) -> tuple[Read, Entry | None]:
    """``e`` and ``newest`` read with their full inputs, one read where they are one entry (most often)."""
    read = read_entry(log, e)
    if newest is None:
        return read, None
    return read, read.entry if newest.seq == e.seq else read_entry(log, newest).entry


def _outputs(e: Entry) -> dict[str, Any]:
    out = e.data.get("outputs") if isinstance(e.data, dict) else None
    return out if isinstance(out, dict) else {}


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


def _step(ex: Explanation, name: str, summary: str, entries: tuple[tuple[int, str], ...], why_not: str | None
          ) -> None:
    """A step the entries prove, or, with ``why_not``, one they do not (what the entry says, and why)."""
    if why_not is None:
        ex.steps.append(Step(name, summary, entries))
    else:
        ex.missing.append(f"{name}: {summary}; {why_not}")


def _fairshare_steps(ex: Explanation, log: AuditLog, fs: Entry, c: dict[str, Any], usage: list[Entry],
                     job: Entry | None, dv: Derivation) -> None:
    logged = logged_in(log, fs, ex.job_id)  # a delta carries the job's charge on from the entry that logs it
    ref = _ref(fs) if logged.seq == fs.seq else _ref(logged, fs)
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
    _step(ex, "charged usage", summary, ref + _ref(*usage) if usage else ref,
          "its logged records do not recompute to it" if k.differs or k.parts_differ else None)
    if gaps:
        ex.steps.append(Step("gap energy", f"{c['gap_energy_joules']!r} J of sampling gaps' unattributed energy "
                             f"reassigned to the job from Slurm's record (accounting.gaps) out of {len(gaps)} gap "
                             "record(s); measured under the energy policy"
                             + "".join(sorted({_corrected(g) for g in gaps})), _ref(*gaps) + ref))
    acct, user = c.get("account"), c.get("user")
    key = (acct, user)
    a_total = (_assoc(fs.data["inputs"].get("associations", []), acct, user) or {}).get("decayed_usage")
    how = [f"{what} {dv.recomputed[('decayed usage', k)]}" for what, k in (("recomputed", ex.job_id),
                                                                           ("the association's is", key))
           if ("decayed usage", k) in dv.recomputed]
    _step(ex, "decayed usage", f"half-life {s.get('half_life_s')} s, calc period {s.get('calc_period_s')} s, "
          f"usage from {_iso(c.get('first_ts'))} to {_iso(c.get('last_ts'))} decayed to {_iso(fs.data.get('now'))}: "
          f"{c.get('decayed', dv.derived.get(ex.job_id))!r} of association {user}@{acct}'s {a_total!r}"
          + (f" ({'; '.join(how)})" if how else ""),
          ref, dv.why_not("decayed usage", ex.job_id, key))
    outputs = fs.data.get("outputs", {})
    row = _assoc(outputs.get("rows", []), acct, user)
    fair_not = dv.why_not("fairshare", key)
    if row is not None:
        again = dv.recomputed.get(("fairshare", key))
        _step(ex, "fairshare", f"{s.get('algorithm')}: norm shares {row.get('norm_shares')!r}, effective usage "
              f"{row.get('effective_usage')!r} -> fairshare {row.get('fairshare')!r}"
              + (f" (recomputed {again}: same)" if again else ""), ref, fair_not)
    else:
        ex.missing.append(f"fairshare: the fairshare entry {fs.seq} has no row for {user}@{acct}")
    feed = _assoc(outputs.get("feed", []), acct, user)
    if feed is not None:
        factor_not = dv.why_not("site factor", key) or (
            None if fair_not is None and row is not None else "the fairshare it is made of is not proven")
        again = dv.recomputed.get(("site factor", key))
        _step(ex, "site factor", f"round({s.get('priority_weight')} x {feed.get('fairshare')!r}) = "
              f"{feed.get('site_factor')}" + (f" (recomputed, {again})" if again else ""), ref, factor_not)
    else:
        ex.missing.append(f"site factor: the fairshare entry {fs.seq} that charged this job carries no priority feed")


# -- what a fairshare entry's outputs follow from --------------------------------------------------------------
# Logged numbers are compared to 1e-9 relative: a sum recomputed in another order (the tree's users sort by their
# pseudonyms here, by their names when the entry was written) differs in the last bits, a forged number does not.
_TOLERANCE = 1e-9
_ROW_NUMBERS = ("norm_shares", "raw_usage", "norm_usage", "effective_usage", "fairshare", "level_fs")
_FEED_NUMBERS = ("fairshare", "raw_usage", "effective_usage", "norm_shares")
_LISTED = 10  # problems of one kind named per entry; the rest are counted


def _number(v: Any) -> float | None:
    """A logged number (non-finite floats are logged as text: 'inf'); None for anything else (a bool too)."""
    t = type(v)
    if t is float or t is int:
        return float(v)
    if t is str and v in ("inf", "-inf", "nan"):
        return float(v)
    return None


def _finite(v: Any) -> float | None:
    t = type(v)  # called per job and value of every fairshare entry: the plain types first
    return float(v) if (t is float or t is int) and math.isfinite(v) else None


def _agree(logged: Any, again: Any) -> bool:
    x, y = _number(logged), _number(again)
    if x is None or y is None:
        return logged is None and again is None
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y or math.isclose(x, y, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)


def _label(key: tuple[Any, Any]) -> str:
    """An association as the messages name it: user@account, or the account."""
    return f"account {key[0]}" if key[1] is None else f"{key[1]}@{key[0]}"


@dataclass
class Derivation:
    """What of one fairshare entry's outputs follows from its inputs, recomputed with accounting's own code: each
    job's decayed charge (``decay``), each association's usage (the sum of its jobs'), every fairshare row
    (``engine.compute`` over the tree the rows state), every site factor (``priority.site_factor``).

    ``problems``: what does not follow, one sentence each naming the entry (``audit verify`` fails on them);
    ``unproven``: per (step, job id or association, or None for the whole entry), why `audit explain` cannot call
    that step proven (it does not follow, or the entry lacks what recomputing it needs); ``recomputed``: per
    (step, job id or association), how a step that follows was recomputed."""

    seq: int
    problems: list[str] = field(default_factory=list)
    unproven: dict[tuple[str, Any], str] = field(default_factory=dict)
    recomputed: dict[tuple[str, Any], str] = field(default_factory=dict)
    derived: dict[str, float] = field(default_factory=dict)  # per job of a delta entry: its decayed charge
    _counts: dict[str, int] = field(default_factory=dict)

    def fail(self, step: str, key: Any, why: str) -> None:
        n = self._counts[step] = self._counts.get(step, 0) + 1
        if n <= _LISTED:
            self.problems.append(f"audit entry {self.seq}: {why}")
        self.unproven.setdefault((step, key), f"{why} (does not follow)")

    def lack(self, step: str, key: Any, why: str) -> None:
        self.unproven.setdefault((step, key), why)

    def why_not(self, step: str, *keys: Any) -> str | None:
        return next((self.unproven[(step, k)] for k in (*keys, None) if (step, k) in self.unproven), None)

    def close(self) -> None:
        for step, n in self._counts.items():
            if n > _LISTED:
                self.problems.append(f"audit entry {self.seq}: and {n - _LISTED} more {step} value(s) that do not "
                                     "follow")


def _tree(rows: list[Any]) -> Any:
    """The association tree the fairshare rows state (sshare order: each row's depth and raw shares name its place
    and shares); None when the rows do not carry them (``AssociationError`` when they do not form a tree)."""
    from gpuledger.accounting.associations import ROOT, Assoc, AssociationError, AssocTree

    assocs, where = [], []
    accounts: list[Any] = []  # accounts[d]: the account at depth d on the way down to this row
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "depth" not in r or "raw_shares" not in r:
            return None
        depth, shares = r["depth"], r["raw_shares"]
        account: Any = r.get("account")
        user: Any = r.get("user")
        if type(depth) is not int or not 0 <= depth <= len(accounts) or (depth == 0) != (i == 0):
            raise AssociationError(f"fairshare row {i}: depth {depth!r} is not below an account row")
        if depth == 0:
            if account != ROOT or user is not None:
                raise AssociationError(f"fairshare row 0: {account!r} is not the root account")
            accounts = [ROOT]
            continue
        parent = accounts[depth - 1]
        if user is None:
            del accounts[depth:]
            accounts.append(account)
        assocs.append(Assoc(account, user, parent, shares))
        where.append(f"fairshare row {i}")
    return AssocTree(assocs, where)


def _decay_args(s: Mapping[str, Any]) -> dict[str, Any] | None:
    """The settings the entry's decay ran with, as ``decay.decayed_usage`` takes them (None: the entry lacks them)."""
    half_life, period = _finite(s.get("half_life_s")), _finite(s.get("calc_period_s"))
    if half_life is None or period is None or not isinstance(s.get("usage_reset", "NONE"), str):
        return None
    tz = s.get("timezone") or None
    return {"half_life_s": half_life, "calc_period_s": int(period) if period.is_integer() else period,
            "reset": s.get("usage_reset", "NONE"), "tz": tz if isinstance(tz, str) else None}


def _pieces(c: Mapping[str, Any], charged: float) -> list[tuple[float, float, float]] | str | None:
    """The (start, end, amount) pieces the entry says a job's charge was placed in time as (None: it does not say;
    text: why they are not pieces of this charge)."""
    raw = c.get("pieces")
    if raw is None:
        return None
    if not isinstance(raw, list):
        return "its pieces are not a list"
    out = []
    for p in raw:
        a, b, x = (_finite(v) for v in p) if isinstance(p, list) and len(p) == 3 else (None, None, None)
        if a is None or b is None or x is None or a > b or x < 0:
            return f"its piece {p!r} is not (start, end, amount) with start <= end and amount >= 0"
        out.append((a, b, x))
    total = math.fsum(x for _, _, x in out)
    if total > charged and not _agree(total, charged):
        return f"its pieces add up to {total!r}, more than its charge {charged!r}"
    return out


class _JobDecay(NamedTuple):  # (a tuple: made for every job of an entry logged in full)
    """What one job's logged charge gives its decay (:func:`_job_decay`): kept between the entries that carry the
    same record on (a delta carries its base's records, the very objects, which nothing changes)."""

    record: Any  # the job's logged record it was read from
    delta: bool  # read as a delta entry's job
    fail: str | None  # why its decayed charge does not follow
    read: tuple[Any, float] | None  # (association, logged decayed charge; 0.0 for a delta's, derived)
    charges: tuple[tuple[str, float, float, float], ...] | None  # (job id, start, end, amount): what decay takes
    logged_pieces: bool
    derived: bool  # its decayed charge is the recomputed one (a delta's job that logs its pieces)


def _job_decay(job_id: str, c: Any, delta: bool) -> _JobDecay:
    """One job of ``_derive_decay``: its logged record checked and read as the charges decay takes."""
    if not isinstance(c, dict):
        return _JobDecay(c, delta, f"job {job_id}'s charge is not a record", None, None, False, False)
    derived = False
    if delta and "decayed" not in c:
        if c.get("pieces") is None:
            return _JobDecay(c, delta, f"job {job_id} logs neither its decayed charge nor the pieces it is recomputed "
                                       "from", None, None, False, False)
        derived = True
    charged, decayed = _finite(c.get("charged")), 0.0 if derived else _finite(c.get("decayed"))
    first, last = _finite(c.get("first_ts")), _finite(c.get("last_ts"))
    if charged is None or decayed is None or first is None or last is None or first > last or decayed < 0:
        return _JobDecay(c, delta, f"job {job_id}'s charge {c.get('charged')!r}, decayed charge {c.get('decayed')!r} "
                                   "and times are not a charge decayed", None, None, False, derived)
    read = ((c.get("account"), c.get("user")), decayed)
    pieces = _pieces(c, charged)
    if isinstance(pieces, str):
        return _JobDecay(c, delta, f"job {job_id}: {pieces}", None if derived else read, None, False, derived)
    placed = pieces if pieces is not None else [(first, last, charged)]
    return _JobDecay(c, delta, None, read, tuple((job_id, a, b, x) for a, b, x in placed), pieces is not None,
                     derived)


def _derive_decay(dv: Derivation, fs: Entry, jobs: Mapping[str, Any], now: float, s: Mapping[str, Any],
                  delta: bool = False, known: dict[str, _JobDecay] | None = None) -> dict[str, tuple[Any, float]]:
    """Each job's decayed charge recomputed (``decay.decayed_usage_batch``) from the pieces of it the entry logs,
    else from its charge spread evenly over first..last; returns the jobs whose numbers can be read:
    job id -> (association, logged decayed charge). A ``delta`` entry logs no decayed charge for a job that logs
    its pieces (``chain``): it is the recomputed one (``dv.derived``). ``known``: the jobs read for the entry
    before (:class:`_JobDecay`), replaced by this entry's where it is a delta."""
    from gpuledger.accounting.decay import decayed_usage_batch

    args = _decay_args(s)
    if args is None:
        dv.lack("decayed usage", None, f"entry {fs.seq} does not log the decay settings (half-life, calc period)")
    read: dict[str, tuple[Any, float]] = {}
    placed: dict[str, tuple[tuple[str, float, float, float], ...]] = {}
    logged_pieces: set[str] = set()
    derived: set[str] = set()
    now_known: dict[str, _JobDecay] = {}
    for job_id, c in jobs.items():
        job = known.get(job_id) if known is not None else None
        if job is None or job.record is not c or job.delta != delta:
            job = _job_decay(job_id, c, delta)
        now_known[job_id] = job
        if job.fail is not None:
            dv.fail("decayed usage", job_id, job.fail)
        if job.derived:
            derived.add(job_id)
        if job.read is not None:
            read[job_id] = job.read
        if job.charges is not None:
            placed[job_id] = job.charges
            if job.logged_pieces:
                logged_pieces.add(job_id)
    if known is not None:  # only a delta's jobs kept: the next delta carries them on (a full entry's are copied)
        known.clear()
        known.update(now_known if delta else {})
    if logged_pieces:  # a job without them beside jobs with them: its decay taken out of what can be recomputed
        for job_id in [j for j in placed if j not in logged_pieces]:
            dv.fail("decayed usage", job_id, f"job {job_id} logs no pieces, though the entry's other jobs do")
            del placed[job_id]
    if args is None or not placed:
        for job_id in derived:  # not recomputed: not read either
            read.pop(job_id, None)
        return read
    try:
        again = decayed_usage_batch([p for ps in placed.values() for p in ps], now=now, **args)
        # decay never grows usage, and usage used later decays less: the most a charge can have decayed to is all
        # of it used at its last time (before now); for the jobs whose decay does not recompute
        most = decayed_usage_batch([(j, min(float(jobs[j]["last_ts"]), now), min(float(jobs[j]["last_ts"]), now),
                                     float(jobs[j]["charged"])) for j in placed
                                    if j not in logged_pieces and not _agree(read[j][1], again.get(j, 0.0))],
                                   now=now, **args)
    except ValueError as e:
        dv.lack("decayed usage", None, f"entry {fs.seq}'s decay cannot be recomputed: {e}")
        for job_id in derived:
            read.pop(job_id, None)
        return read
    for job_id in placed:
        decayed, want = read[job_id][1], again.get(job_id, 0.0)  # no pieces: nothing to decay
        if job_id in derived:
            read[job_id] = (read[job_id][0], want)
            dv.derived[job_id] = want
            dv.recomputed[("decayed usage", job_id)] = "from its logged pieces (a delta entry logs it only so)"
            continue
        if _agree(decayed, want):
            dv.recomputed[("decayed usage", job_id)] = ("from its logged pieces: same" if job_id in logged_pieces
                                                        else "from its charge spread evenly over first..last: same")
            continue
        if job_id in logged_pieces:
            dv.fail("decayed usage", job_id, f"job {job_id}'s decayed charge {decayed!r} is not what its logged "
                                             f"pieces decay to ({want!r})")
        elif decayed > most.get(job_id, 0.0) and not _agree(decayed, most.get(job_id, 0.0)):
            dv.fail("decayed usage", job_id, f"job {job_id}'s decayed charge {decayed!r} is more than its charge "
                                             f"decays to even if all of it was used at its last time "
                                             f"({most.get(job_id, 0.0)!r})")
        else:
            dv.lack("decayed usage", job_id, f"entry {fs.seq} does not log where in time job {job_id}'s charge was "
                                             f"placed (hour by hour), so its decay cannot be recomputed (spread "
                                             f"evenly over first..last it decays to {want!r})")
    return read


def derive(fs: Entry, trees: dict[Any, Any] | None = None, known: dict[str, _JobDecay] | None = None
           ) -> Derivation:
    """Recompute what fairshare entry ``fs``'s outputs follow from (:class:`Derivation`); ``trees`` caches the
    association trees of the rows between calls (consecutive entries mostly share one), ``known`` each job's
    logged record as read (``_derive_decay``; most records are carried on from the entry before). Linear in the
    entry's size (the tree's index is built once per tree)."""
    from gpuledger.accounting.associations import AssociationError
    from gpuledger.accounting.engine import compute
    from gpuledger.accounting.priority import site_factor

    dv = Derivation(fs.seq)
    d = fs.data
    try:
        s, now = d["settings"], float(d["now"])
        jobs, assocs = d["inputs"]["jobs"], d["inputs"]["associations"]
        rows, feed = d["outputs"]["rows"], d["outputs"].get("feed") or []
        if not (isinstance(s, dict) and isinstance(jobs, dict) and isinstance(assocs, list)
                and isinstance(rows, list) and isinstance(feed, list) and math.isfinite(now)):
            raise TypeError
    except (KeyError, TypeError, ValueError, AttributeError):
        dv.fail("fairshare", None, "its data is not a fairshare computation (now, settings, inputs.jobs, "
                                   "inputs.associations, outputs.rows)")
        dv.close()
        return dv
    read = _derive_decay(dv, fs, jobs, now, s, delta_of(fs) is not None, known)

    # each association's usage: the sum of its jobs' decayed charges
    by_assoc: dict[Any, list[float]] = {}
    for key, decayed in read.values():
        by_assoc.setdefault(key, []).append(decayed)
    row_of = {(r.get("account"), r.get("user")): r for r in rows if isinstance(r, dict)}
    usage: dict[Any, float] = {}
    for a in assocs:
        key = (a.get("account"), a.get("user")) if isinstance(a, dict) else (None, None)
        v = _finite(a.get("decayed_usage")) if isinstance(a, dict) else None
        if v is None or key in usage:
            dv.fail("decayed usage", key, f"the usage of {_label(key)} is not one number ({a!r})")
            continue
        usage[key] = v
        mine = by_assoc.get(key, [])
        want = math.fsum(mine)
        if not _agree(v, want):
            dv.fail("decayed usage", key, f"{_label(key)}'s decayed usage {v!r} is not the sum of its {len(mine)} "
                                          f"job(s)' decayed charges ({want!r})")
        else:
            dv.recomputed[("decayed usage", key)] = f"the sum of its {len(mine)} job(s)' decayed charges"
    for key, mine in by_assoc.items():
        if key not in usage and key in row_of:
            dv.fail("decayed usage", key, f"{_label(key)} has {len(mine)} charged job(s) (decayed "
                                          f"{math.fsum(mine)!r}) but no usage in the entry (dropped)")
    forged = sorted(_label(k) for (step, k) in dv.unproven if step == "decayed usage" and isinstance(k, tuple))
    if forged:
        dv.lack("fairshare", None, f"it is computed from usage that does not follow ({', '.join(forged[:3])}"
                                   + (", ..." if len(forged) > 3 else "") + ")")

    # every row: the logged shares and usage through the project's fairshare
    again: dict[Any, Any] = {}
    try:
        shape = tuple((r.get("account"), r.get("user"), r.get("raw_shares"), r.get("depth")) if isinstance(r, dict)
                      else None for r in rows)
        tree = trees.get(shape) if trees is not None else None
        if tree is None:
            tree = _tree(rows)
            if trees is not None and tree is not None:
                trees.clear()  # one tree kept: the next entry's is mostly the same
                trees[shape] = tree
        if tree is None:
            dv.lack("fairshare", None, f"entry {fs.seq}'s rows do not state the tree (depth and shares), so its "
                                       "fairshare cannot be recomputed")
        else:
            for key in [k for k in usage if k not in tree]:
                dv.fail("fairshare", key, f"usage for {_label(key)}, which the tree of the rows does not have")
            algorithm = str(s.get("algorithm"))
            in_tree = {k: v for k, v in usage.items() if k in tree}
            dampening = float(s.get("dampening", 1.0))

            def differences(algo: str) -> dict[Any, list[str]]:
                again.clear()
                again.update(((r.account, r.user), r) for r in compute(tree, in_tree, algo, dampening))
                out = {}
                for key, r in row_of.items():
                    r2 = again.get(key)
                    differ = [f"{f} {r.get(f)!r} (recomputed {getattr(r2, f)!r})" for f in _ROW_NUMBERS
                              if r2 is not None and not _agree(r.get(f), getattr(r2, f))]
                    if differ:
                        out[key] = differ
                return out

            wrong = differences(algorithm)
            other = {"classic": "fair-tree", "fair-tree": "classic"}.get(algorithm)
            # Entries written before they logged each job's pieces named the configured algorithm even where
            # `fairshare --algorithm` ran the other one: rows that follow from that one are not proven, not forged.
            if wrong and other is not None and not any(isinstance(c, dict) and "pieces" in c for c in jobs.values()) \
                    and not differences(other):
                dv.lack("fairshare", None, f"entry {fs.seq}'s rows follow from {other}, not from the {algorithm} it "
                                           "names (an entry of a release that logged the configured algorithm, not "
                                           "the one `fairshare --algorithm` ran)")
                wrong = {}
                again.clear()
            elif wrong:
                differences(algorithm)  # (``again``: the logged algorithm's rows, for the steps below)
            for key, differ in wrong.items():
                dv.fail("fairshare", key, f"{_label(key)}'s fairshare row does not follow from the logged shares "
                                          f"and usage ({algorithm}): {', '.join(differ)}")
            for key in row_of:
                if key not in wrong and key in again:
                    dv.recomputed[("fairshare", key)] = "from the logged tree, shares and usage"
    except (AssociationError, ValueError, TypeError) as e:
        dv.fail("fairshare", None, f"its rows are not a fairshare computation: {e}")

    # every site factor: round-half-up(weight x the association's fairshare), the fairshare its row's
    weight = s.get("priority_weight")
    in_feed = set()
    for f in feed:
        key = (f.get("account"), f.get("user")) if isinstance(f, dict) else (None, None)
        in_feed.add(key)
        fair = _finite(f.get("fairshare")) if isinstance(f, dict) else None
        factor = f.get("site_factor") if isinstance(f, dict) else None
        try:
            want_factor = site_factor(fair, weight) if fair is not None and type(weight) is int else None
        except ValueError:
            want_factor = None
        if want_factor is None or type(factor) is not int:
            dv.fail("site factor", key, f"{_label(key)}'s feed entry is not a fairshare in 0..1 and a site factor "
                                        f"(weight {weight!r}): {f!r}")
            continue
        if factor != want_factor:
            dv.fail("site factor", key, f"{_label(key)}'s site factor {factor} does not follow from its fairshare "
                                        f"{fair!r}: round-half-up({weight} x {fair!r}) = {want_factor}")
        else:
            dv.recomputed[("site factor", key)] = "halves up: same"
        row = row_of.get(key)
        differ = [f"{k} {f.get(k)!r} (row {row.get(k)!r})" for k in _FEED_NUMBERS
                  if row is not None and not _agree(f.get(k), row.get(k))]
        if row is None or differ:
            dv.fail("site factor", key, f"{_label(key)}'s feed entry is not its fairshare row's: "
                                        + (", ".join(differ) if differ else "no row"))
    if feed:
        for key, r in row_of.items():
            if key[1] is not None and r.get("fairshare") is not None and key not in in_feed:
                dv.fail("site factor", key, f"{_label(key)} has a fairshare row but no site factor in the feed")
    dv.close()
    return dv


def _still_weighs(fs: Entry, c: Mapping[str, Any]) -> bool:
    """Whether a job charged with ``c`` (by an earlier entry) still weighs in fairshare at ``fs``'s time: it was
    last used inside ``fs``'s decay horizon (``privacy.decay_horizon_start``)."""
    from gpuledger.accounting.privacy import decay_horizon_start

    s, last = fs.data.get("settings", {}), _finite(c.get("last_ts"))
    args = _decay_args(s) if isinstance(s, dict) else None
    now = _finite(fs.data.get("now"))
    if args is None or last is None or now is None:
        return False
    try:
        return last >= decay_horizon_start(now, args["half_life_s"], args["reset"], args["tz"])
    except ValueError:
        return False


def _job_gone(log: AuditLog, before: Entry, fs: Entry, c: Mapping[str, Any], job_id: str) -> bool:
    """What explains entry ``fs`` dropping a job that entry ``before`` charged with ``c``: the job's record accepted
    as gone or naming nobody to charge, or, for a job only agents described, every usage record of it accepted as
    gone; or ``fs`` no longer taking the agents' word (its settings' ``charge_unrecorded_jobs`` false: entries from
    before the setting took it) for a job ``before`` charged as only agents described it (``seen_by``), with no
    record of it logged between the two entries (Slurm's would be; one logged after ``fs`` says nothing of it)."""
    job = job_id.partition("@")[0]
    key = f"job:{c.get('cluster', '')}/{job}"
    settings = fs.data.get("settings")
    if (c.get("seen_by") == "agent" and isinstance(settings, dict) and settings.get("charge_unrecorded_jobs") is False
            and not any(e.key == key and before.seq < e.seq < fs.seq for e in log.entries(job_id=job))):
        return True  # (a record logged in between is Slurm's: an agent's first description stands)
    latest = log.latest(key)
    if latest is None:
        return not _latest_by_key(list(log.entries(job_id=job)), "usage:")
    d = record_of(latest)
    return is_removed(latest) or not d.get("account") or not d.get("user")


def _charge_key(job_id: str, c: Any) -> tuple[Any, str]:
    """A charge's job: (cluster, job id); an entry writes ``<id>@<cluster>`` where two clusters share an id."""
    return (c.get("cluster") if isinstance(c, dict) else None, job_id.partition("@")[0])


def dropped(log: AuditLog, before: Entry, fs: Entry) -> list[str]:
    """The jobs fairshare entry ``before`` charged that the next one, ``fs``, does not, though they still weigh in
    fairshare at its time and their record still names whom to charge: one sentence each."""
    jobs, earlier = fs.data.get("inputs", {}).get("jobs", {}), before.data.get("inputs", {}).get("jobs", {})
    if not isinstance(jobs, dict) or not isinstance(earlier, dict):
        return []
    # a job charged still under its id as the same job is not dropped (most are: a delta carries the very record)
    rest = [(j, c) for j, c in earlier.items() if jobs.get(j) is not c]
    rest = [(j, c) for j, c in rest if j not in jobs or _charge_key(j, jobs[j]) != _charge_key(j, c)]
    now = {_charge_key(j, c) for j, c in jobs.items()} if rest else set()
    gone = [j for j, c in rest if isinstance(c, dict) and _charge_key(j, c) not in now
            and _still_weighs(fs, c) and not _job_gone(log, before, fs, c, j)]
    out = [f"audit entry {fs.seq}: job {j}, charged by entry {before.seq} and still inside the decay horizon (last "
           f"used {_iso(earlier[j].get('last_ts'))}), is not charged (dropped)" for j in gone[:_LISTED]]
    if len(gone) > _LISTED:
        out.append(f"audit entry {fs.seq}: and {len(gone) - _LISTED} more job(s) of entry {before.seq} dropped")
    return out


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


def fairshare_problems(log: AuditLog) -> list[tuple[int, str]]:
    """What of the logged fairshare computations does not follow, as (entry, message): in every fairshare entry,
    each output recomputed from its inputs (:func:`derive`) and each job the entry before charged that it drops
    while it still weighs (:func:`dropped`); and per job, in the entry `audit explain` takes for it (the newest
    with a priority feed that charged it, else the newest that charged it), a charge explain shows as DIFFERS.
    One pass over the fairshare entries, each recomputed in time linear in its size."""
    with_feed: dict[str, tuple[Entry, Any]] = {}
    without: dict[str, tuple[Entry, Any]] = {}
    out = []
    trees: dict[Any, Any] = {}
    known: dict[str, _JobDecay] = {}
    before: Entry | None = None
    chain = Chain()  # each entry read with its full inputs, a delta from the entry before
    for logged in log.entries(kind="fairshare"):
        read = chain.read(logged)
        if read.problem is not None:
            out.append((logged.seq, read.problem))
        fs = read.entry
        if fs is None:
            if delta_of(logged) is None:
                out += [(logged.seq, p) for p in derive(logged, trees, known).problems]
            continue
        dv = derive(fs, trees, known)
        out += [(fs.seq, p) for p in dv.problems]
        try:
            jobs, feed = fs.data["inputs"]["jobs"], fs.data.get("outputs", {}).get("feed")
        except (KeyError, TypeError, AttributeError):
            continue
        if before is not None:
            out += [(fs.seq, p) for p in dropped(log, before, fs)]
        before = fs
        # per job the time and settings it was charged at, not the entry: one entry's jobs held at a time
        at = dataclasses.replace(fs, data={"now": fs.data.get("now"), "settings": fs.data.get("settings", {})})
        for j, c in jobs.items():
            (with_feed if feed else without)[j] = (at, c)
    for job_id, (fs, c) in {**without, **with_feed}.items():
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


__all__ = ["CHANGE_STATUSES", "AuditError", "Derivation", "Explanation", "Step", "change_status", "derive", "dropped",
           "explain", "fairshare_problems", "latest_changes", "unsettled"]
