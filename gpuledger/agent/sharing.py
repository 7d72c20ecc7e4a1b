"""Pure rules for splitting one GPU's interval among the jobs (or MIG instances) that share it.

Both rules conserve exactly: the parts, summed with ``math.fsum``, equal the whole bit for bit.
Float rounding leaves a residue of a few ulps; it is put on the largest part, where it is
relatively smallest, so no part ever turns negative.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

def _conserve(parts: list[float], total: float) -> list[float]:
    """Nudge the parts, largest first, until ``math.fsum(parts) == total`` exactly.

    The step is the exactly rounded residue; when it is below half an ulp of the part, the part
    moves by one ulp instead. Moving one part can leave the exact sum on a rounding tie that
    never lands on ``total``; moving the next part breaks the tie.
    """
    if len(parts) == 1:
        return [total]
    order = sorted(range(len(parts)), key=lambda i: -parts[i])
    for k in order:
        for _ in range(4):
            if math.fsum(parts) == total:
                return parts
            residue = math.fsum([total, *(-p for p in parts)])
            new = parts[k] + residue
            if new == parts[k]:
                new = math.nextafter(parts[k], math.inf if residue > 0 else -math.inf)
            if new < 0:
                break
            parts[k] = new
    if math.fsum(parts) != total:
        raise ArithmeticError(f"cannot split {total!r} exactly over {parts!r}")
    return parts


def _proportions(job_ids: Sequence[str], by_job: Mapping[str, int | float | None] | None) -> list[float] | None:
    """Each job's part of the total of ``by_job``, or None unless every job's value is known, finite and
    non-negative and the total is positive."""
    if by_job is None:
        return None
    values = [by_job.get(j) for j in job_ids]
    if not all(v is not None and math.isfinite(v) and v >= 0 for v in values):
        return None
    total = math.fsum(float(v) for v in values)  # type: ignore[arg-type]
    return [float(v) / total for v in values] if total > 0 else None  # type: ignore[arg-type]


def split_shares(job_ids: Sequence[str], mem_by_job: Mapping[str, int | float | None] | None,
                 busy_by_job: Mapping[str, float | None] | None = None) -> tuple[float, ...]:
    """Each job's share of a shared GPU, aligned with ``job_ids``; they sum to exactly 1.0.

    The first basis every job has, in this order:

    1. ``busy_by_job``: the share of the interval in which each job's kernels ran (its processes'
       ``gpu_util_ratio`` summed), when every job's is known and the total is positive. The GPU's
       time is what time-sliced and MPS jobs compete for, so the job that computes pays for it,
       however little memory it holds.
    2. ``mem_by_job``: the jobs' GPU memory, when every job's is known and the total is positive
       (a job using no memory then gets 0).
    3. Equal shares.

    A basis known for some jobs only is not used: no job's share is guessed.
    """
    n = len(job_ids)
    if n == 0:
        return ()
    if len(set(job_ids)) != n:
        raise ValueError(f"duplicate job ids: {list(job_ids)}")
    weights = _proportions(job_ids, busy_by_job) or _proportions(job_ids, mem_by_job) or [1.0 / n] * n
    return tuple(_conserve(weights, 1.0))


def split_mig_energy(
    gpu_energy_delta_j: float,
    instances: Sequence[tuple[K, float, float | None]],
    *,
    idle_floor_j: float | None = None,
) -> dict[K, float]:
    """Split a whole GPU's energy over an interval among its MIG instances.

    ``instances`` are ``(mig_id, slice_fraction, activity)``: the instance's share of the GPU's
    compute slices (e.g. 3/7 for a 3g profile) and its SM activity 0..1 (None when unknown).

    The rule (power and energy exist only for the whole GPU, so this is an attribution, not a
    measurement):

    1. The idle floor ``idle_floor_j`` (idle power x interval, clamped to the GPU's energy;
       None means 0) is what the GPU burns anyway; it is split by slice fraction, as a rent for
       the part of the GPU each instance holds.
    2. The rest (the dynamic energy) is split by ``slice_fraction x activity``: a busy big
       instance drives more power than a busy small one, an idle one drives none.
       If any instance's activity is unknown, or all are zero, the rest is split by slice
       fraction too (we cannot tell who caused it).

    Slice fractions are normalised by their sum, so a partly partitioned GPU still charges all
    of its energy to the instances that exist. The result sums (``math.fsum``) to exactly
    ``gpu_energy_delta_j``.
    """
    if not math.isfinite(gpu_energy_delta_j) or gpu_energy_delta_j < 0:
        raise ValueError(f"energy delta must be finite and >= 0, got {gpu_energy_delta_j}")
    ids = [i[0] for i in instances]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate MIG instance ids: {ids}")
    if not instances:
        if gpu_energy_delta_j > 0:
            raise ValueError("energy to split but no MIG instances")
        return {}
    for mig_id, frac, act in instances:
        if not (math.isfinite(frac) and frac > 0):
            raise ValueError(f"slice fraction of {mig_id!r} must be > 0, got {frac}")
        if act is not None and not (math.isfinite(act) and act >= 0):
            raise ValueError(f"activity of {mig_id!r} must be >= 0, got {act}")
    total = float(gpu_energy_delta_j)
    floor = 0.0 if idle_floor_j is None else min(max(float(idle_floor_j), 0.0), total)
    dynamic = total - floor
    frac_sum = math.fsum(i[1] for i in instances)
    by_slice = [i[1] / frac_sum for i in instances]
    acts = [i[2] for i in instances]
    if any(a is None for a in acts):
        by_activity = by_slice
    else:
        w = [i[1] * a for i, a in zip(instances, acts)]  # type: ignore[operator]
        w_sum = math.fsum(w)
        by_activity = by_slice if w_sum <= 0 else [x / w_sum for x in w]
    parts = [floor * s + dynamic * d for s, d in zip(by_slice, by_activity)]
    parts = _conserve(parts, total)
    return dict(zip(ids, parts))


__all__ = ["split_mig_energy", "split_shares"]
