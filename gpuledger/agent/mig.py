"""MIG energy attribution: power and energy exist only for the whole GPU; charge them to its instances.

Sources emit the parent GPU's sample (``mig=None``) with power and the energy counter, and one sample per MIG GPU
instance with its own activity and no power or energy. This stage, run in the agent after the sources, moves the
GPU's energy onto its instances by the rule of :func:`agent.sharing.split_mig_energy` (the idle floor by slice
fraction, the dynamic rest by slice fraction x SM activity): each instance gets a virtual, monotonic energy counter
and the matching mean power, and the parent keeps neither. So a job on an instance is charged its share, the sum
over instances equals the GPU's energy exactly, and nothing downstream can count the GPU twice. (Per-GPU power on a
dashboard is the sum over the GPU's instances.)
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace
from typing import Sequence

from gpuledger.schema.records import GpuSample
from gpuledger.agent.sharing import split_mig_energy

# "NVIDIA A100-SXM4-80GB MIG 3g.40gb" / "1g.10gb+me": compute slices out of 7 on A100/H100/H200.
_PROFILE = re.compile(r"(\d+)g\.\d+gb")
COMPUTE_SLICES = 7


def slice_fraction(model: str) -> float | None:
    m = _PROFILE.search(model)
    return int(m.group(1)) / COMPUTE_SLICES if m else None


class MigEnergySplitter:
    """A sample stage (same shape as a job mapper) that apportions each MIG GPU's energy to its instances."""

    def __init__(self, idle_watts: float | None = None) -> None:
        self._idle_watts = idle_watts
        self._prev: dict[tuple[str, str], tuple[float, float | None]] = {}  # GPU -> (ts, parent counter)
        self._virtual: dict[tuple[str, str, str], float] = {}  # instance -> virtual counter (J)

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        instances: dict[tuple[str, str], list[GpuSample]] = defaultdict(list)
        for s in samples:
            if s.mig is not None:
                instances[(s.host, s.gpu_uuid)].append(s)
        if not instances:
            return list(samples)
        replaced: dict[int, GpuSample] = {}
        for s in samples:
            key = (s.host, s.gpu_uuid)
            if s.mig is not None or key not in instances:
                continue
            insts = instances[key]
            delta, dt = self._delta(key, s)
            # An instance seen for the first time starts its counter at 0 and takes no share yet: downstream, a
            # series' first sample has no interval, so a share given now would be lost rather than charged.
            known = [i for i in insts if (i.host, i.gpu_uuid, i.mig) in self._virtual]
            fractions = [slice_fraction(i.model) for i in known]
            if any(f is None for f in fractions):  # unknown profiles: equal slices
                fractions = [1.0] * len(known)
            floor = self._idle_watts * dt if self._idle_watts is not None and dt > 0 else None
            shares = split_mig_energy(
                delta, [(i.mig, f, i.sm_active_ratio) for i, f in zip(known, fractions)],
                idle_floor_j=None if floor is None else min(floor, delta),
            ) if known else {}
            for i in insts:
                vkey = (i.host, i.gpu_uuid, i.mig)
                share = shares.get(i.mig, 0.0)
                self._virtual[vkey] = self._virtual.get(vkey, 0.0) + share
                power = share / dt if dt > 0 and i.mig in shares else None
                replaced[id(i)] = replace(i, energy_joules=self._virtual[vkey], power_watts=power)
            replaced[id(s)] = replace(s, energy_joules=None, power_watts=None)
        return [replaced.get(id(s), s) for s in samples]

    def _delta(self, key: tuple[str, str], parent: GpuSample) -> tuple[float, float]:
        """Energy since the previous parent sample and the interval; a counter that went back is a reset."""
        prev = self._prev.get(key)
        self._prev[key] = (parent.ts, parent.energy_joules)
        if prev is None:
            return 0.0, 0.0
        dt = max(parent.ts - prev[0], 0.0)
        e, pe = parent.energy_joules, prev[1]
        if e is None or pe is None:  # integrate power only where no counter exists
            return (parent.power_watts or 0.0) * dt, dt
        return (e - pe if e >= pe else e), dt
