"""From the ledger to fairshare: charge each job by the policy, decay as Slurm does, compute fairshare.

Every job Slurm ran is charged: at least its allocation's unmeasured part (``charge``), so a job no agent saw
still moves fairshare. A job without a scheduler record (only agents describe it: a node with a stolen token could
invent one for any user) is not charged but listed (``unrecorded_jobs``), unless ``charge_unrecorded_jobs`` says
the agents' word is enough: then it is charged from its measurements to the association an agent described
(flagged ``seen_by: agent``), or, when nobody named one, reported as unmatched.

Placement in time (what decay sees): the part charged for Slurm's allocation (unmeasured GPU-time, or all of it
under ``allocated``'s unobserved share) is spread evenly over the allocation's [start, end], as Slurm accrues
it. Each GPU's measured part goes into the hours it was used, from the collector's hourly buckets of that GPU
(``busy_hours``: GPU-seconds that carried a job, each sample interval in the bucket of the hour its end falls
in): bucket h gets the weight min(the job's span on the GPU within that bucket's reach, the GPU's busy seconds
in it), so an hour the agent was silent (busy 0) gets nothing, and a job that shares an hour with the GPU's next
job gets at most its own span of it. A bucket reaches one sample interval back (an interval ending at h + 10 s
began before h); the interval is estimated as observed GPU-seconds / (samples - 1). The buckets are per GPU,
not per job: when two jobs share a GPU-hour at once, each is weighted by its span, not its exact seconds.
Without buckets (a ledger from elsewhere), a GPU's part is spread over its [first, last] sample. Gap energy
reassigned from Slurm's records (``gaps``, charged under ``energy``) is spread over the job's overlap with each
gap, the hours the gap covered.

Pseudonymized history: after ``audit retention`` a record's user is a pseudonym; it still charges the tree's
association whose user pseudonymizes to it (``alias``), so fairshare does not forget it.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gpuledger.accounting.associations import AssocTree, UserKey
from gpuledger.accounting.charge import ChargePolicy, JobCharge, allocation, allocation_runs
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.decay import decayed_usage
from gpuledger.accounting.fairshare import Usage, classic, fair_tree
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.schema.records import JobRecord, JobUsage, split_gpu_id
from gpuledger.schema.text import read_text


@dataclass(frozen=True, slots=True)
class ChargedJob:
    """One job's way into fairshare (what the audit trail's ``fairshare`` entry lists per job)."""

    job_id: str
    cluster: str
    account: str
    user: str
    policy: str
    seen_by: str
    allocated_gpu_seconds: float | None
    observed_gpu_seconds: float
    coverage: float | None
    unmeasured_gpu_seconds: float
    unmeasured_rule: str
    charged: float
    decayed: float
    first_ts: float
    last_ts: float
    gap_energy_joules: float = 0.0  # unattributed gap energy Slurm's record reassigned to the job (``gaps``)
    measured_charge: float = 0.0  # the part of ``charged`` for what was observed (gap charge included)
    unmeasured_charge: float = 0.0  # the part for the allocated time nobody observed (``unmeasured_rule``)
    gap_charge: float = 0.0  # the part of ``measured_charge`` that charges reassigned gap energy
    # how the charge was placed in time, as decay took it: (start, end, amount) pieces, each accruing evenly (what
    # `audit verify` recomputes the decay from); None: not known (a record built from an older entry)
    pieces: tuple[tuple[float, float, float], ...] | None = None


@dataclass(frozen=True, slots=True)
class UsageResult:
    usage: dict[UserKey, float]
    unknown: dict[UserKey, float]  # charged usage of associations the tree does not have (reported, not dropped)
    unmatched_jobs: tuple[str, ...]  # jobs nobody named an association for (no scheduler record, no agent's)
    jobs: tuple[ChargedJob, ...] = ()
    unrecorded_jobs: tuple[str, ...] = ()  # measured jobs Slurm has no record of, not charged (charge_unrecorded_jobs)


HOUR = 3600.0
Busy = Mapping[tuple[str, str, str], Sequence[tuple[float, float]]]


def _gpu_key(u: JobUsage) -> tuple[str, str, str]:
    return (u.host, *split_gpu_id(u.gpu_uuid))


class HourlyPlacer:
    """Places GPUs' measured charges in the hours they were used (module docstring), all at once: the GPUs'
    bucket rows are one pair of arrays, and every (GPU record, amount) is computed in one vectorised pass."""

    def __init__(self, busy: Busy) -> None:
        self._hours: dict[tuple[str, str, str], tuple[list[float], int]] = {}  # GPU -> (its hours, offset)
        hours: list[float] = []
        seconds: list[float] = []
        for key, rows in busy.items():
            own = [h for h, _ in rows]
            self._hours[key] = (own, len(hours))
            hours += own
            seconds += [x for _, x in rows]
        self._h = np.asarray(hours, dtype=float)
        self._s = np.asarray(seconds, dtype=float)

    def place(self, items: Sequence[tuple[JobUsage, float]]) -> list[list[tuple[float, float, float]]]:
        """Per (GPU usage record, amount): its (start, end, amount) pieces; even over first..last where the GPU
        has no bucket with busy time in the record's span."""
        out: list[list[tuple[float, float, float]]] = [[(u.first_ts, u.last_ts, x)] for u, x in items]
        sel, lo_hi = [], []
        for i, (u, _) in enumerate(items):
            found = self._hours.get(_gpu_key(u))
            if found is None:
                continue
            own, offset = found
            interval = u.allocated_gpu_seconds / (u.samples - 1) if u.samples > 1 else 0.0  # between samples
            lo = bisect.bisect_left(own, math.floor(u.first_ts / HOUR) * HOUR)
            hi = bisect.bisect_left(own, u.last_ts + interval)  # buckets h with h - interval < last
            if hi > lo:
                sel.append((i, interval))
                lo_hi.append((offset + lo, hi - lo))
        if not sel:
            return out
        counts = np.fromiter((n for _, n in lo_hi), dtype=np.int64, count=len(lo_hi))
        starts = np.fromiter((o for o, _ in lo_hi), dtype=np.int64, count=len(lo_hi))
        item = np.repeat(np.arange(len(sel)), counts)
        rows = np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts) + starts[item]
        first = np.fromiter((items[i][0].first_ts for i, _ in sel), dtype=float, count=len(sel))[item]
        last = np.fromiter((items[i][0].last_ts for i, _ in sel), dtype=float, count=len(sel))[item]
        step = np.fromiter((st for _, st in sel), dtype=float, count=len(sel))[item]
        h, seconds = self._h[rows], self._s[rows]
        a = np.maximum(h - step, first)  # the time bucket h's intervals cover
        b = np.minimum(h + HOUR - step, last)
        keep = (b > a) & (seconds > 0)
        item, a, b, step = item[keep], a[keep], b[keep], step[keep]
        w = np.minimum(b - a + step, seconds[keep])  # + step: the estimate's slack at the edges
        if not len(w):
            return out
        # Adjacent buckets of one record at the same rate are one even piece (exact: decay is linear), so a GPU
        # busy throughout costs decay a few pieces, not one per hour.
        rate = w / (b - a)
        same = (item[1:] == item[:-1]) & (a[1:] == b[:-1]) & (np.abs(rate[1:] - rate[:-1]) <= 1e-12 * rate[1:])
        run = np.flatnonzero(np.concatenate(([True], ~same)))
        run_end = np.concatenate((run[1:], [len(w)])) - 1
        run_w = np.add.reduceat(w, run)
        run_item = item[run]
        totals = np.bincount(run_item, weights=run_w, minlength=len(sel))
        placed: dict[int, list[tuple[float, float, float]]] = {}
        for k, ra, rb, rw in zip(run_item.tolist(), a[run].tolist(), b[run_end].tolist(), run_w.tolist()):
            placed.setdefault(k, []).append((ra, rb, rw))
        for k, pieces in placed.items():
            i = sel[k][0]
            amount, total = items[i][1], float(totals[k])
            out[i] = [(ra, rb, amount * rw / total) for ra, rb, rw in pieces]
        return out


def _allocation_pieces(r: JobRecord, now: float, amount: float) -> list[tuple[float, float, float]]:
    """``amount`` (a charge of Slurm's allocation: the unmeasured part) as pieces accruing evenly over the spans it
    was held (:func:`charge.allocation_runs`: a requeued job's earlier runs, then [start, end or now]), each its share
    by duration."""
    runs = allocation_runs(r, now)
    total = sum(b - a for a, b in runs)
    if len(runs) == 1 or total <= 0:
        return [(runs[-1][0], runs[-1][1], amount)] if runs else []
    return [(a, b, amount * (b - a) / total) for a, b in runs if b > a]


def _until_tick(pieces: list[tuple[float, float, float]], tick: float) -> list[tuple[float, float, float]]:
    """A running job's pieces up to the last decay tick: slurmctld adds what a running job accrued only at its
    ticks, so what came after the last one is not in Slurm's usage yet (a piece accrues evenly, so its part before
    the tick is in proportion)."""
    out = []
    for a, b, x in pieces:
        if b <= tick:
            out.append((a, b, x))
        elif a < tick:
            out.append((a, tick, x * (tick - a) / (b - a)))
    return out


def hourly_pieces(u: JobUsage, amount: float, busy: Sequence[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """One GPU's measured charge placed in the hours it was used; ``busy`` its (hour start, busy GPU-seconds)."""
    return HourlyPlacer({_gpu_key(u): busy}).place([(u, amount)])[0]


def _measured_items(e: LedgerEntry, c: JobCharge, policy: ChargePolicy,
                    alloc: Mapping[str, float] | None = None) -> list[tuple[JobUsage, float]]:
    """A job's measured charge from samples (not reassigned gaps) split over its GPU records, by what each was
    charged (``alloc``: its Slurm allocation per model, as the charge weighed them)."""
    sampled = c.measured - c.gap_charge
    if sampled <= 0:
        return []
    gpus = e.measured
    weights = [policy.charge(u, alloc) for u in gpus]
    if sum(weights) <= 0:
        weights = [max(u.allocated_gpu_seconds, 0.0) for u in gpus]
    if sum(weights) <= 0:
        weights = [1.0] * len(gpus)
    total = sum(weights)
    return [(u, sampled * w / total) for u, w in zip(gpus, weights)]


def association_usage(
    entries: Iterable[LedgerEntry], settings: AccountingSettings, tree: AssocTree, now: float,
    alias: Callable[[str], str] | None = None, busy: Busy | None = None,
) -> UsageResult:
    """Decayed usage per association at ``now``; ``busy`` (the store's ``busy_hours``) places measured charges
    in the hours they were used, ``alias`` maps pseudonymized users back to the tree's (module docstring)."""
    policy = settings.charge_policy()
    known: set[UserKey] = {(a, u) for a, u in tree.user_keys() if u is not None}
    # a pseudonymized record's user -> the tree's user it stands for
    unalias = {(a, alias(u)): (a, u) for a, u in known} if alias is not None else {}
    placer = HourlyPlacer(busy) if busy else None
    rows: list[tuple[LedgerEntry, UserKey, JobCharge]] = []
    items: list[tuple[JobUsage, float]] = []
    owner: list[int] = []  # items[k] belongs to rows[owner[k]]
    unmatched = []
    unrecorded = []
    for e in entries:
        if e.record is None and not settings.charge_unrecorded_jobs:
            if e.usage is not None:
                unrecorded.append(e.label)
            continue
        d = e.described
        if d is None or not d.account or not d.user:
            if e.usage is not None or e.record is not None:
                unmatched.append(e.label)
            continue
        alloc = allocation(e.record, now)
        c = policy.charge_job(alloc, e.measured, e.gap_energy_joules, e.gap_gpu_seconds)
        if c.total <= 0 and e.usage is None:
            continue
        key = (d.account, d.user)
        key = key if key in known else unalias.get(key, key)
        mine = _measured_items(e, c, policy, alloc)
        owner += [len(rows)] * len(mine)
        items += mine
        rows.append((e, key, c))
    placed = placer.place(items) if placer is not None else [[(u.first_ts, u.last_ts, x)] for u, x in items]
    spans: list[dict[tuple[float, float], float]] = [{} for _ in rows]  # a job's GPUs mostly share spans
    for k, pieces in zip(owner, placed):
        for a, b, x in pieces:
            spans[k][(a, b)] = spans[k].get((a, b), 0.0) + x
    charges: list[tuple[Any, float, float, float]] = []
    ranges = []
    placements: list[tuple[tuple[float, float, float], ...]] = []
    for (e, key, c), own in zip(rows, spans):
        r = e.record
        pieces = [(a, b, x) for (a, b), x in own.items()]
        if c.gap_charge > 0:
            # reassigned gap energy accrues evenly over the job's overlap with each gap
            pieces += [(s.start, s.end, c.gap_charge * s.energy_joules / c.gap_energy_joules) for s in e.gap_shares]
        if c.unmeasured > 0 and r is not None:
            pieces += _allocation_pieces(r, now, c.unmeasured)
        if r is not None and (r.end is None or r.end > now):
            pieces = _until_tick(pieces, math.floor(now / settings.calc_period_s) * settings.calc_period_s)
        placements.append(tuple(pieces))
        charges += [((key, e.key), a, b, x) for a, b, x in pieces]
        ranges.append((min((p[0] for p in pieces), default=now), max((p[1] for p in pieces), default=now)))
    decayed = decayed_usage(
        charges, now=now, half_life_s=settings.half_life_s, calc_period_s=settings.calc_period_s,
        reset=settings.usage_reset, tz=settings.timezone,
    )
    per_assoc: dict[UserKey, float] = {}
    per_job: dict[Any, float] = {}
    for (assoc, job), v in decayed.items():
        per_assoc[assoc] = per_assoc.get(assoc, 0.0) + v
        per_job[job] = per_job.get(job, 0.0) + v
    for _, key, _ in rows:
        per_assoc.setdefault(key, 0.0)
    usage = {k: v for k, v in per_assoc.items() if k in known}
    unknown = {k: v for k, v in per_assoc.items() if k not in known}
    jobs = tuple(
        ChargedJob(e.job_id, e.cluster, key[0], key[1], settings.policy, e.seen_by, c.allocated_gpu_seconds,
                   c.observed_gpu_seconds, c.coverage, c.unmeasured_gpu_seconds, settings.unmeasured, c.total,
                   per_job.get(e.key, 0.0), first, last,
                   c.gap_energy_joules, c.measured, c.unmeasured, c.gap_charge, pieces)
        for (e, key, c), (first, last), pieces in zip(rows, ranges, placements))
    return UsageResult(usage, unknown, tuple(unmatched), jobs, tuple(unrecorded))


def audit_charges(jobs: Iterable[ChargedJob]) -> list[ChargedJob]:
    """The per-job charges as the audit trail lists them (by job id): a job id that two clusters share is
    written ``<job_id>@<cluster>`` so that neither hides the other."""
    jobs = list(jobs)
    seen = Counter(j.job_id for j in jobs)
    return [replace(j, job_id=f"{j.job_id}@{j.cluster}") if seen[j.job_id] > 1 else j for j in jobs]


def compute(tree: AssocTree, usage: Usage, algorithm: str, dampening: float = 1.0) -> list[Any]:
    if algorithm == "classic":
        return classic(tree, usage, dampening=dampening)
    if algorithm == "fair-tree":
        return fair_tree(tree, usage)
    raise ValueError(f"unknown fairshare algorithm {algorithm!r}: use classic or fair-tree")


# `--associations slurm`: ask the local Slurm (sacctmgr) instead of reading a file (a file named so: ./slurm).
LIVE_SLURM = "slurm"


def load_tree(source: Path | str | None, config: Mapping[str, Any], slurm: Any = None) -> AssocTree:
    """From a file (sacctmgr -P output or CSV, told apart by the CSV header), from the local Slurm when the source
    is ``"slurm"`` (``slurm`` is a SlurmClient, the real one by default), else the config's [accounts]. sacctmgr's
    rows are the config's ``cluster``'s, where it names one."""
    if source is None:
        return AssocTree.from_toml({"accounts": config.get("accounts", {})})
    if str(source) == LIVE_SLURM:
        from gpuledger.accounting.slurm import SlurmClient

        return AssocTree.from_sacctmgr((slurm or SlurmClient()).associations(), cluster=config.get("cluster"))
    text = read_text(source)
    first = text.lstrip().splitlines()[0].strip().lower() if text.strip() else ""
    if first.replace(" ", "") == "account,parent,user,shares":
        return AssocTree.from_csv(text)
    return AssocTree.from_sacctmgr(text, cluster=config.get("cluster"))
