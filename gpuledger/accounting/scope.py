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

What is not charged is kept, with the reason, so reports and the audit log can show it. Jobs without a scheduler
record (seen only by agents) are charged as measured: nothing says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpuledger.schema.records import JobRecord, JobUsage

SLACK_S = 120.0


@dataclass(frozen=True, slots=True)
class OutOfScope:
    """A per-GPU usage record (or the part of it) not charged to its job, and why."""

    usage: JobUsage  # as the collector stored it
    charged_fraction: float  # 0: none of it; else the share of it inside the job's record
    reason: str  # "host" (a host the record does not list) or "time" (outside the record's start..end)


def in_scope(record: JobRecord | None, rows: Sequence[JobUsage], now: float,
             ) -> tuple[tuple[JobUsage, ...], tuple[OutOfScope, ...]]:
    """``rows`` (one job's per-GPU usage) as far as they lie within ``record``: (the rows to charge, some
    prorated; what was cut and why). Without a record, or one without a start, every row is charged."""
    if record is None or record.start is None:
        return tuple(rows), ()
    lo = record.start - SLACK_S
    hi = (now if record.end is None else record.end) + SLACK_S
    hosts = set(record.hosts)
    kept: list[JobUsage] = []
    cut: list[OutOfScope] = []
    for u in rows:
        if hosts and u.host != "*" and u.host not in hosts:
            cut.append(OutOfScope(u, 0.0, "host"))
            continue
        fraction = _inside(u.first_ts, u.last_ts, lo, hi)
        if fraction >= 1.0:
            kept.append(u)
            continue
        cut.append(OutOfScope(u, fraction, "time"))
        if fraction > 0.0:
            kept.append(_prorated(u, fraction, max(u.first_ts, lo), min(u.last_ts, hi)))
    return tuple(kept), tuple(cut)


def _inside(first: float, last: float, lo: float, hi: float) -> float:
    """The share of ``[first, last]`` inside ``[lo, hi]`` (a single instant: 1 or 0)."""
    if last <= first:
        return 1.0 if lo <= first <= hi else 0.0
    return max(0.0, min(last, hi) - max(first, lo)) / (last - first)


def _prorated(u: JobUsage, fraction: float, first: float, last: float) -> JobUsage:
    return replace(u, first_ts=first, last_ts=last, samples=max(1, round(u.samples * fraction)),
                   allocated_gpu_seconds=u.allocated_gpu_seconds * fraction,
                   sm_active_gpu_seconds=u.sm_active_gpu_seconds * fraction,
                   energy_joules=u.energy_joules * fraction, gap_gpu_seconds=u.gap_gpu_seconds * fraction)
