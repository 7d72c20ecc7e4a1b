"""Measured usage held to the scheduler's record of its job: where and when Slurm says the job ran.

An agent names the job on each GPU it samples, and a node's token may be stolen: a node could name a job Slurm ran
on another host, or at another time (job ids are sequential, so even future ones), and have its own GPU time
charged to that job's user. Slurm's record is the authority on where and when a job ran, so a per-GPU usage record
of a job that has one is charged only as far as it lies within it:

- a record of a host the job's record does not list (when it lists hosts) is not charged to the job;
- a record is charged for the part of its span ``[first_ts, last_ts]`` inside ``[start - SLACK_S, end + SLACK_S]``
  (``end``: now while the job runs), its additive figures (GPU-seconds, energy, gap seconds, samples) in
  proportion: the span's samples are taken as spread evenly over it, which holds for an agent's steady cadence.
  ``SLACK_S`` covers a job's first and last samples falling just outside Slurm's times (the sample interval, a
  prolog or epilog, clock skew between a node and slurmctld).

A requeued job ran more than once under its id (``JobRecord.earlier_runs``: each earlier run's start, end and
hosts). Each run is held to the rules above on its own, and a record is charged for the share of its span inside
the union of the windows of the runs on its host: a record spanning two runs (one GPU, one agent, the job
requeued onto the same node) is charged for both, not for the time between them, its samples again taken as
spread evenly over its span. That assumption is the coarsest where the gap between runs is long and the agent
sampled nothing in it (the collector then keeps the job's GPU-seconds of the gap apart, as ``gap_gpu_seconds``,
which is prorated with the rest). A report counts each run in the period it ended (``report.period``): a record's
part in a run is its share inside that run's window of its share inside them all (:func:`in_runs`; the windows of
two runs less than 2 x ``SLACK_S`` apart cut at the middle of their overlap), so its parts add up to what is charged.

What is not charged is kept, with the reason, so reports and the audit log can show it. Jobs without a scheduler
record (seen only by agents) are charged as measured: nothing says otherwise, but for one physical GPU counted
more than once by MIG rows that do not fit it (:func:`mig_bounds`), which holds for every job.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuledger.agent.mig import slice_fraction
from gpuledger.schema.records import JobRecord, JobUsage, split_gpu_id

SLACK_S = 120.0


@dataclass(frozen=True, slots=True)
class OutOfScope:
    """A per-GPU usage record (or the part of it) not charged to its job, and why."""

    usage: JobUsage  # as the collector stored it
    charged_fraction: float  # 0: none of it; else the share of it inside the job's record
    reason: str  # "host" (a host the record does not list), "time" (outside its start..end), "mig" (mig_bounds)

    @property
    def gpu_seconds(self) -> float:
        """The observed GPU-seconds not charged."""
        return self.usage.allocated_gpu_seconds * (1.0 - self.charged_fraction)

    @property
    def energy_joules(self) -> float:
        """The measured energy not charged."""
        return self.usage.energy_joules * (1.0 - self.charged_fraction)

    def to_dict(self) -> dict[str, Any]:
        """What ``jobs list`` and ``report job`` show of it (SI units)."""
        u = self.usage
        return {"reason": self.reason, "host": u.host, "gpu_uuid": u.gpu_uuid, "model": u.model,
                "first_ts": u.first_ts, "last_ts": u.last_ts, "charged_fraction": self.charged_fraction,
                "gpu_seconds": self.gpu_seconds, "energy_joules": self.energy_joules}


# what each reason says, for people
OUT_OF_SCOPE_REASONS = {"host": "on a host Slurm's record of the job does not list",
                        "time": f"outside the job's start..end in Slurm's record, of every run of a requeued job "
                                f"(with {SLACK_S:g} s of slack)",
                        "mig": "MIG records that would count one physical GPU twice"}


def in_scope(record: JobRecord | None, rows: Sequence[JobUsage], now: float,
             ) -> tuple[tuple[JobUsage, ...], tuple[OutOfScope, ...]]:
    """``rows`` (one job's per-GPU usage) as far as they lie within ``record``'s runs: (the rows to charge, some
    prorated; what was cut and why). Without a record, or one without a run that started, every row is charged."""
    runs = _run_windows(record, now) if record is not None else []
    if not runs:
        return tuple(rows), ()
    kept: list[JobUsage] = []
    cut: list[OutOfScope] = []
    for u in rows:
        windows = _merged([(lo, hi) for _, lo, hi in _host_windows(runs, u.host)])
        if not windows:
            cut.append(OutOfScope(u, 0.0, "host"))
            continue
        fraction = _inside(u.first_ts, u.last_ts, windows)
        if fraction >= 1.0:
            kept.append(u)
            continue
        cut.append(OutOfScope(u, fraction, "time"))
        if fraction > 0.0:
            inside = [(max(u.first_ts, lo), min(u.last_ts, hi)) for lo, hi in windows
                      if lo <= u.last_ts and u.first_ts <= hi]
            kept.append(_prorated(u, fraction, inside[0][0], inside[-1][1]))
    return tuple(kept), tuple(cut)


def job_runs(record: JobRecord) -> list[tuple[float, float | None, tuple[str, ...]]]:
    """A job's runs as this module numbers them: (start, end, hosts) of each earlier run of a requeued job, oldest
    first, then the latest run's where it started (end None while it runs)."""
    runs: list[tuple[float, float | None, tuple[str, ...]]] = list(record.earlier_runs)
    if record.start is not None:
        runs.append((record.start, record.end, record.hosts))
    return runs


def _run_windows(record: JobRecord, now: float) -> list[tuple[float, float, tuple[str, ...]]]:
    """Each run's (:func:`job_runs`) window with the slack, and its hosts: [start - SLACK_S, (end or now) +
    SLACK_S]."""
    return [(start - SLACK_S, (now if end is None else end) + SLACK_S, hosts) for start, end, hosts in job_runs(record)]


def _host_windows(runs: Sequence[tuple[float, float, tuple[str, ...]]], host: str) -> list[tuple[int, float, float]]:
    """The windows of the runs that hold a record of ``host`` (a run that lists no hosts holds any, as a record
    without hosts always did; "*": summed over hosts) as (run, lo, hi) in time order, those of two runs that overlap
    (less than 2 x SLACK_S apart) cut at the middle of the overlap: they partition the union of the windows, so
    that a record's parts in the runs (:func:`in_runs`) add up to what :func:`in_scope` charges of it."""
    out: list[tuple[int, float, float]] = []
    for i, (lo, hi, hosts) in sorted(enumerate(runs), key=lambda run: run[1][0]):
        if hosts and host != "*" and host not in hosts:
            continue
        if out and lo < out[-1][2]:
            j, before, end = out[-1]
            cut = max(before, (end + lo) / 2)
            out[-1] = (j, before, cut)
            lo, hi = cut, max(hi, end)
        out.append((i, lo, hi))
    return out


def in_runs(record: JobRecord, u: JobUsage, runs: Collection[int], now: float) -> JobUsage | None:
    """The part of ``u``, a record :func:`in_scope` charged to the job, in some of the job's runs (``runs``:
    positions in :func:`job_runs`), None where it has none: the share of its span inside those runs' windows on its
    host (cut where two overlap: :func:`_host_windows`) of its share inside every run's, its additive figures in
    proportion (its samples taken as spread evenly over its span, as :func:`in_scope` takes them). So the parts of a
    record in runs that partition the job's add up to the record. A record inside no run's window (one
    :func:`in_scope` did not hold, or held at another ``now``) is the nearest run's (:func:`nearest_run`)."""
    first, last = u.first_ts, u.last_ts
    windows = _host_windows(_run_windows(record, now), u.host)
    if last <= first:  # an instant: the run whose window holds it
        held = next((i for i, lo, hi in windows if lo <= first <= hi), None)
        fraction = None if held is None else float(held in runs)
        mine = [(first, last)]
    else:
        overlaps = [(i, max(first, lo), min(last, hi)) for i, lo, hi in windows if lo < last and first < hi]
        mine = [(a, b) for i, a, b in overlaps if i in runs]
        total = math.fsum(b - a for _, a, b in overlaps)
        fraction = math.fsum(b - a for a, b in mine) / total if total > 0.0 else None
    if fraction is None:
        fraction = float(nearest_run(record, first, last, now) in runs)
        mine = [(first, last)]
    if fraction <= 0.0:
        return None
    return u if fraction >= 1.0 else _prorated(u, fraction, mine[0][0], mine[-1][1])


def nearest_run(record: JobRecord, first: float, last: float, now: float) -> int:
    """The run (a position in :func:`job_runs`; the record has one) nearest the span ``[first, last]`` in time:
    the least distance from its middle to a run's [start, end or now], the earlier run of a tie. Where a job's
    measurements that no run holds (out of scope) and its gap energy count (``report.period``)."""
    mid = (first + last) / 2
    spans = [(start, now if end is None else end) for start, end, _ in job_runs(record)]
    return min(range(len(spans)), key=lambda i: max(0.0, spans[i][0] - mid, mid - spans[i][1]))


def _inside(first: float, last: float, windows: Sequence[tuple[float, float]]) -> float:
    """The share of ``[first, last]`` inside the union of ``windows`` (disjoint; a single instant: 1 or 0)."""
    if last <= first:
        return 1.0 if any(lo <= first <= hi for lo, hi in windows) else 0.0
    return min(1.0, sum(max(0.0, min(last, hi) - max(first, lo)) for lo, hi in windows) / (last - first))


def _prorated(u: JobUsage, fraction: float, first: float, last: float) -> JobUsage:
    return replace(u, first_ts=first, last_ts=last, samples=max(1, round(u.samples * fraction)),
                   allocated_gpu_seconds=u.allocated_gpu_seconds * fraction,
                   sm_active_gpu_seconds=u.sm_active_gpu_seconds * fraction,
                   energy_joules=u.energy_joules * fraction, gap_gpu_seconds=u.gap_gpu_seconds * fraction)


def mig_bounds(rows: Sequence[JobUsage]) -> dict[int, float]:
    """Per-GPU usage records that would count one physical GPU more than once (positions in ``rows`` -> the share
    of them to charge): a node's word is all that says a GPU was in MIG mode, and the collector normalises its
    rows one batch at a time.

    - A whole-GPU record with jobs overlapping (in time) an instance record of the same GPU: the instances hold
      the GPU then (its whole-GPU rows carry no jobs in MIG mode), so none of it.
    - Instance records overlapping each other with slice fractions (``agent.mig.slice_fraction``) summing above
      1 (two "7g" instances): each in proportion, 1 / the sum.

    Honest records never meet either case (MIG mode changes only on an idle GPU; concurrent instances fit the
    GPU), so they are charged whole."""
    by_gpu: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    for i, u in enumerate(rows):
        uuid, mig = split_gpu_id(u.gpu_uuid)
        whole, inst = by_gpu.setdefault((u.host, uuid), ([], []))
        (inst if mig else whole).append(i)
    out: dict[int, float] = {}
    for whole, inst in by_gpu.values():
        if not inst:
            continue
        spans = _merged([(rows[i].first_ts, rows[i].last_ts) for i in inst])
        for i in whole:
            u = rows[i]
            if any(a <= u.last_ts and u.first_ts <= b for a, b in spans):
                out[i] = 0.0
        # a sweep over the instances in time: those overlapping one another, by slice
        slices = {i: (split_gpu_id(rows[i].gpu_uuid)[1], slice_fraction(rows[i].model)) for i in inst}
        active: list[int] = []
        for i in sorted(inst, key=lambda i: rows[i].first_ts):
            active = [j for j in active if rows[j].last_ts >= rows[i].first_ts]
            active.append(i)
            per_mig: dict[str, float] = {}
            for j in active:
                mig, f = slices[j]
                if f is not None:
                    per_mig[mig] = max(per_mig.get(mig, 0.0), f)
            total = sum(per_mig.values())
            if total > 1.0 + 1e-9:
                for j in active:
                    out[j] = min(out.get(j, 1.0), 1.0 / total)
    return out


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def scaled(u: JobUsage, fraction: float) -> JobUsage:
    """``u``'s additive figures (GPU-seconds, energy, gap seconds) times ``fraction``, its span as it was."""
    return _prorated(u, fraction, u.first_ts, u.last_ts)
