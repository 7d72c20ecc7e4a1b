"""MIG power and energy: they exist only for the whole GPU; count them exactly once, as shares of its instances.

Sources emit, per MIG-mode GPU, one whole-GPU sample (``mig=None``) with the physical GPU's power and energy
counter -- whether the source read them from the device (NVML, DCGM) or from a dcgm-exporter page that has a
parent row, only instance rows repeating the parent's values, or both (``parse_dcgm_exporter`` merges them
into one reading) -- and one sample per MIG GPU instance with its own activity and no power or energy.

This stage, run in the agent after the sources, moves them onto the instances. The rule (the records'
contract with the collector: per physical GPU, the instances' power sums to the GPU's power and their energy
counters' deltas sum to the GPU's counter delta; the whole-GPU sample of a MIG GPU carries neither):

- **Power**, every tick: the GPU's power split by :func:`agent.sharing.split_mig_energy` (the idle floor
  ``idle_watts`` by slice fraction, the rest by slice fraction x activity).
- **Energy**: each instance has a virtual, monotonic counter. When a GPU is first seen, its counter value is
  split by slice fraction, so the instances' counters sum to the GPU's counter from the first sample on (a
  one-shot reading shows the GPU's energy once, not zero times). Then each interval's counter delta (the power
  integral where the GPU has no counter) is split by the same rule as power. An instance that appears later
  starts at 0 and takes shares from its second sample on (a series' first sample has no interval downstream).
- **Activity** is the instance's SM activity, or else its utilisation (on dcgm-exporter MIG instances that is
  ``GR_ENGINE_ACTIVE``: the stock counters leave SM activity out); with either unknown for any instance, the
  dynamic part is split by slice fraction too. Slice fractions come from the profile name ("3g.40gb" = 3/7;
  an A30 has 4 slices); unknown profiles count as equal slices.

So the sum over instances equals the GPU exactly, and nothing downstream can count the GPU twice. (Per-GPU
power on a dashboard is the sum over the GPU's instances.) These activity-weighted shares are what the agent's
/metrics and the stored series show per instance; they are **not** what a job is charged. The ledger's rule is
the collector's (``collector.aggregate.normalize_mig``, the reference): it sums the instances' counters back into
the GPU's and shares it among the instances by slice size, so a node cannot move energy between the jobs on its
instances, and a source that sends only the GPU's counter is charged the same way.

The virtual counters live in this stage: after an agent restart they start again from the GPU's counter split
by slice, so an instance's counter can step back or forward by the difference between its activity-weighted
and its by-slice history. Downstream that is a counter discontinuity like a driver reload: the interval
across it must not be charged from the counter step (issue #12's rule: a counter that goes back or jumps
beyond power limit x time is not trusted and the power integral is used; the instances carry their power
share on every sample for that).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from gpuledger.agent.sharing import split_mig_energy
from gpuledger.schema.records import GpuSample

# "NVIDIA A100-SXM4-80GB MIG 3g.40gb" / "1g.10gb+me": compute slices out of the GPU's (NVIDIA's MIG user guide,
# supported GPUs): 4 on the A30 (1g.6gb x 4 ... 4g.24gb), 7 on A100, H100, H200 and Blackwell.
_PROFILE = re.compile(r"(\d+)g\.\d+gb")
_FOUR_SLICES = re.compile(r"\bA30\b")
COMPUTE_SLICES = 7


def compute_slices(model: str) -> int:
    """Compute slices of the physical GPU a model name (the GPU's, or an instance's "<GPU> MIG <profile>") names."""
    return 4 if _FOUR_SLICES.search(model.split(" MIG ")[0]) else COMPUTE_SLICES


def slice_fraction(model: str) -> float | None:
    m = _PROFILE.search(model)
    return min(1.0, int(m.group(1)) / compute_slices(model)) if m else None


class MigEnergySplitter:
    """A sample stage (same shape as a job mapper) that apportions each MIG GPU's power and energy to its instances."""

    def __init__(self, idle_watts: float | None = None) -> None:
        self._idle_watts = idle_watts
        self._prev: dict[tuple[str, str], tuple[float, float | None]] = {}  # GPU -> (ts, parent counter)
        self._virtual: dict[tuple[str, str, str | None], float] = {}  # instance -> virtual counter (J)

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
            first_sight = key not in self._prev
            delta, dt = self._delta(key, s)
            fractions = _fractions(insts)
            power = self._split(s.power_watts, insts, fractions, self._idle_watts)
            if first_sight:
                # Each instance's counter starts at its slice of the GPU's counter: the sum is the GPU's counter.
                start = self._split(s.energy_joules, insts, fractions, None, by_slice=True) or {}
                for i in insts:
                    self._virtual[(i.host, i.gpu_uuid, i.mig)] = start.get(i.mig, 0.0)
                shares: dict[str | None, float] = {}
            else:
                # An instance seen for the first time starts at 0 and takes no share yet: downstream, a series'
                # first sample has no interval, so a share given now would be lost rather than charged.
                known = [(i, f) for i, f in zip(insts, fractions) if (i.host, i.gpu_uuid, i.mig) in self._virtual]
                floor = self._idle_watts * dt if self._idle_watts is not None and dt > 0 else None
                shares = self._split(delta, [i for i, _ in known], [f for _, f in known], floor) or {}
            for i in insts:
                vkey = (i.host, i.gpu_uuid, i.mig)
                self._virtual[vkey] = self._virtual.get(vkey, 0.0) + shares.get(i.mig, 0.0)
                # Neither a counter nor power: nothing was measured, and a counter stuck at 0 would claim 0 J.
                energy = self._virtual[vkey] if (s.energy_joules is not None or s.power_watts is not None) else None
                replaced[id(i)] = replace(i, energy_joules=energy,
                                          power_watts=None if power is None else power.get(i.mig))
            replaced[id(s)] = replace(s, energy_joules=None, power_watts=None)
        return [replaced.get(id(s), s) for s in samples]

    @staticmethod
    def _split(total: float | None, insts: Sequence[GpuSample], fractions: Sequence[float], idle: float | None,
               *, by_slice: bool = False) -> dict[str | None, float] | None:
        """``total`` split over ``insts`` by the module's rule (``idle`` is the floor, in the unit of ``total``)."""
        if total is None or not insts:
            return None
        total = max(float(total), 0.0)
        if by_slice:
            return split_mig_energy(total, [(i.mig, f, None) for i, f in zip(insts, fractions)])
        floor = None if idle is None else min(idle, total)
        return split_mig_energy(total, [(i.mig, f, _activity(i)) for i, f in zip(insts, fractions)],
                                idle_floor_j=floor)

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


def _fractions(insts: Sequence[GpuSample]) -> list[float]:
    fractions = [slice_fraction(i.model) for i in insts]
    if any(f is None for f in fractions):  # unknown profiles: equal slices
        return [1.0] * len(insts)
    return fractions  # type: ignore[return-value]


def _activity(s: GpuSample) -> float | None:
    """SM activity, else utilisation (GR_ENGINE_ACTIVE on a dcgm-exporter MIG instance); None when neither."""
    return s.sm_active_ratio if s.sm_active_ratio is not None else s.gpu_util_ratio
