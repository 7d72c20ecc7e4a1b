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
  one-shot reading shows the GPU's energy once, not zero times). Then each interval's counter delta is split by
  the same rule as power. A sample without the counter (a failed read) gives its power integral, or nothing
  where power is unreadable too; the next counter reading gives the counter's growth since its last reading less
  what power gave meanwhile (where power gave more, the next readings' growth pays the surplus back first), so a
  gap's energy is counted once. An instance that appears later starts at 0 and
  takes shares from its second sample on (a series' first sample has no interval downstream); the counter of one
  that is gone (a MIG reconfiguration) passes to the instances left, by slice fraction, so the sum stays the
  GPU's counter. Where none is left (a re-partition that replaced every instance), the new instances take the
  counters of the gone and the interval's share. A GPU seen out of MIG mode starts afresh when it is in MIG mode
  again.
- **Activity** is the instance's SM activity, or else its utilisation (on dcgm-exporter MIG instances that is
  ``GR_ENGINE_ACTIVE``: the stock counters leave SM activity out); with either unknown for any instance, the
  dynamic part is split by slice fraction too. Slice fractions come from the profile name ("3g.40gb" = 3/7;
  an A30 has 4 slices); unknown profiles count as equal slices.

So the sum over instances equals the GPU exactly, and nothing downstream can count the GPU twice. These
activity-weighted shares travel to the collector; they are **not** what a job is charged. The ledger's rule is
the collector's (``collector.aggregate.normalize_mig``, the reference): it sums the instances' counters back into
the GPU's (:func:`gpu_readings`) and shares it among the instances by slice size (:func:`instance_shares`), so a
node cannot move energy between the jobs on its instances, and a source that sends only the GPU's counter is
charged the same way.

**Series** (the agent's /metrics, and what the collector stores and ships: :func:`as_series`) show a MIG GPU's
power, power limit and energy counter once, on its whole-GPU series, and its jobs on its instances' series, each
job's share scaled by its instance's slice fraction, as the ledger charges; the instances' series carry no power
or energy. The virtual counters live in this stage: after an agent restart they start again from the GPU's
counter split by slice, so one instance's counter steps back or forward by the difference between its
activity-weighted and its by-slice history, which Prometheus would read as a reset (counting the GPU's lifetime
energy again) or as energy drawn. Their sum steps far less: it starts again from the GPU's counter, which it
tracked up to rounding, unless the driver's counter restarted meanwhile (a driver reload: the virtual counters
count on). So the agent's /metrics shows the driver's own counter on the whole-GPU series (``as_series``'s
``device``), which resets only when the driver's does. Downstream the collector charges from the sum; a step at a
restart is a counter discontinuity there, whose interval takes the power integral (issue #12's rule).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypedDict

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
        self._prev: dict[tuple[str, str], _Parent] = {}  # GPU -> its previous whole-GPU sample
        self._virtual: dict[tuple[str, str], dict[str | None, float]] = {}  # GPU -> instance -> virtual counter (J)

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        instances: dict[tuple[str, str], list[GpuSample]] = defaultdict(list)
        for s in samples:
            if s.mig is not None:
                instances[(s.host, s.gpu_uuid)].append(s)
        for s in samples:  # out of MIG mode: its counters would no longer sum to the GPU's when it is back in it
            if s.mig is None and (key := (s.host, s.gpu_uuid)) in self._prev and key not in instances:
                del self._prev[key]
                self._virtual.pop(key, None)
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
                counters = self._virtual[key] = {i.mig: start.get(i.mig, 0.0) for i in insts}
                shares: dict[str | None, float] = {}
            else:
                counters = self._virtual.setdefault(key, {})
                heirs = _heirs(insts, fractions, counters)
                self._pass_on_gone(counters, insts, heirs)
                floor = self._idle_watts * dt if self._idle_watts is not None and dt > 0 else None
                shares = self._split(delta, [i for i, _ in heirs], [f for _, f in heirs], floor) or {}
            for i in insts:
                counters[i.mig] = counters.get(i.mig, 0.0) + shares.get(i.mig, 0.0)
                # Neither a counter nor power: nothing was measured, and a counter stuck at 0 would claim 0 J.
                energy = counters[i.mig] if (s.energy_joules is not None or s.power_watts is not None) else None
                replaced[id(i)] = replace(i, energy_joules=energy,
                                          power_watts=None if power is None else power.get(i.mig))
            replaced[id(s)] = replace(s, energy_joules=None, power_watts=None)
        return [replaced.get(id(s), s) for s in samples]

    def _pass_on_gone(self, counters: dict[str | None, float], insts: Sequence[GpuSample],
                      heirs: Sequence[tuple[GpuSample, float]]) -> None:
        """The counters of instances no longer reported (a MIG reconfiguration) go to the heirs (:func:`_heirs`),
        by slice fraction: the instances' counters keep summing to the GPU's, so the whole GPU's series never steps
        back (:func:`as_series`) and the collector's sum stays trusted."""
        present = {i.mig for i in insts}
        gone = [m for m in counters if m not in present]
        if not gone:
            return
        left = math.fsum(counters.pop(m) for m in gone)
        passed = self._split(left, [i for i, _ in heirs], [f for _, f in heirs], None, by_slice=True) or {}
        for m, e in passed.items():
            counters[m] = counters.get(m, 0.0) + e

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
        """Energy since the previous whole-GPU sample, and the interval. The counter is the measure: a sample
        without it credits its power integral (nothing where power is unreadable too), and the next counter
        reading credits what the counter grew since its last reading less what power credited meanwhile; where
        power credited more than the counter grew, the surplus stays owed and later growth pays it back first. So
        the energy of a gap is counted once, neither lost nor twice, over the gap and after it. A counter that went
        back is a reset (from 0)."""
        prev = self._prev.get(key)
        e = parent.energy_joules
        if prev is None:
            self._prev[key] = _Parent(parent.ts, e, 0.0)
            return 0.0, 0.0
        dt = max(parent.ts - prev.ts, 0.0)
        if e is None:
            credit = (parent.power_watts or 0.0) * dt
            # without a counter to reconcile with (a GPU that has none), power's credit is simply the energy
            credited = prev.credited_j + credit if prev.counter_j is not None else 0.0
            self._prev[key] = _Parent(parent.ts, prev.counter_j, credited)
            return credit, dt
        if prev.counter_j is None:  # no reading to count from yet: this interval is power's
            delta, owed = (parent.power_watts or 0.0) * dt, 0.0
        else:
            grown = e - prev.counter_j if e >= prev.counter_j else e
            # power overstated the gap: what it credited beyond the counter's growth is paid back from later growth
            delta, owed = max(grown - prev.credited_j, 0.0), max(prev.credited_j - grown, 0.0)
        self._prev[key] = _Parent(parent.ts, e, owed)
        return delta, dt


@dataclass(frozen=True)
class _Parent:
    """A MIG GPU's previous whole-GPU sample: its time, its last counter reading (kept across samples that
    have none) and the joules credited from power beyond that reading's growth (credited in a gap, not yet
    matched by the counter)."""

    ts: float
    counter_j: float | None
    credited_j: float


def _heirs(insts: Sequence[GpuSample], fractions: Sequence[float],
           counters: dict[str | None, float]) -> list[tuple[GpuSample, float]]:
    """Who takes an interval's energy and the counters of instances gone: the instances seen before (one seen
    for the first time starts at 0 and takes no share yet: downstream, an instance series' first sample has no
    interval), or every instance present where none was (a re-partition that replaced them all), so the
    instances' counters keep summing to the GPU's."""
    pairs = list(zip(insts, fractions))
    return [(i, f) for i, f in pairs if i.mig in counters] or pairs


# The readings only the whole GPU has: on a MIG instance's row they are (a share of) its GPU's.
GpuReading = Literal["energy_joules", "power_watts", "power_limit_watts"]
GPU_READINGS: tuple[GpuReading, ...] = ("energy_joules", "power_watts", "power_limit_watts")


class GpuReadings(TypedDict, total=False):
    """Keyword arguments to GpuSample: a MIG GPU's own readings (:data:`GPU_READINGS`)."""

    energy_joules: float | None
    power_watts: float | None
    power_limit_watts: float | None


NO_READINGS: GpuReadings = {"energy_joules": None, "power_watts": None, "power_limit_watts": None}


def gpu_readings(parent: GpuSample | None, instances: Sequence[GpuSample]) -> GpuReadings:
    """A MIG GPU's power, power limit and energy counter at one instant, whatever shape the source sent: the
    whole-GPU row's (``parent``) where it reports them; else, beside a whole-GPU row without them, the sum over
    the instances (this stage's shares, which sum to the GPU's); else (instance rows only: dcgm-exporter repeats
    the GPU's values on each) the largest instance value, i.e. the repeated one, counted once."""
    values: GpuReadings = {}
    for f in GPU_READINGS:
        own = None if parent is None else getattr(parent, f)
        vals = [v for v in (getattr(x, f) for x in instances) if v is not None]
        if own is not None or not vals:
            values[f] = own
        elif parent is not None and f != "power_limit_watts":
            values[f] = math.fsum(vals)  # virtual per-instance shares of the GPU's
        else:
            values[f] = max(vals)  # the GPU's value repeated on each instance
    return values


def instance_shares(instances: Sequence[GpuSample]) -> list[tuple[float, ...]]:
    """Each instance's jobs' shares of the physical GPU (aligned with ``job_ids``): their shares of the instance
    (equal where none are given) times its fraction of the GPU, its profile's compute slices (``3g.40gb`` -> 3/7);
    where a profile is not known, equal fractions of the instances reported at that instant; profiles claiming
    more than the GPU are scaled down to it."""
    sliced = [slice_fraction(x.model) for x in instances]
    fractions = [f for f in sliced if f is not None]
    if len(fractions) < len(sliced):  # a profile not known: equal slices
        fractions = [1.0 / len(instances)] * len(instances)
    total = sum(fractions)
    if total > 1.0:  # profiles claiming more than the GPU: scale down
        fractions = [f / total for f in fractions]
    out = []
    for x, frac in zip(instances, fractions):
        n = len(x.job_ids)
        shares = x.job_shares or ((1.0 / n,) * n if n else ())
        out.append(tuple(sh * frac for sh in shares))
    return out


def as_series(samples: Sequence[GpuSample], device: Sequence[GpuSample] = ()) -> list[GpuSample]:
    """The samples as a GPU's series show them (the agent's /metrics; the collector's stored and shipped series hold
    the same): per MIG GPU and instant, its power, power limit and energy counter once, on its whole-GPU row
    (:func:`gpu_readings`), which holds no job; its instances' rows hold none of them, and their jobs' shares of
    the physical GPU (:func:`instance_shares`, as the ledger charges). Other rows are unchanged, and so is a MIG
    GPU at an instant without its whole-GPU row (every source sends one).

    ``device``: the source's own readings of the same instant (before this stage moved them onto the instances),
    where the caller has them (the agent's /metrics): a whole-GPU row then shows the device's counter itself, which
    no agent restart steps back (the instances' virtual counters start again from it, and their sum may differ
    from it by rounding: a step back of 1e-6 J is a reset to Prometheus, which then counts the GPU's lifetime),
    and no energy at an instant the device's counter was not read (never the instances' sum in its place)."""
    mig_gpus = {(s.host, s.gpu_uuid) for s in samples if s.mig}
    if not mig_gpus:
        return list(samples)
    own = {(d.host, d.gpu_uuid, d.ts): d for d in device if not d.mig and (d.host, d.gpu_uuid) in mig_gpus}
    groups: dict[tuple[str, str, float], list[int]] = {}
    for i, s in enumerate(samples):
        if (s.host, s.gpu_uuid) in mig_gpus:
            groups.setdefault((s.host, s.gpu_uuid, s.ts), []).append(i)
    out = list(samples)
    for idx in groups.values():
        parent = next((i for i in idx if not samples[i].mig), None)
        insts = [i for i in idx if samples[i].mig]
        if parent is None or not insts:
            continue
        rows = [samples[i] for i in insts]
        p = samples[parent]
        read = own.get((p.host, p.gpu_uuid, p.ts), p)
        readings = gpu_readings(read, rows)
        if read is not p and read.energy_joules is None:
            # the device's counter unread this tick: the instances' sum in its place would step back to the
            # device's own value on the next tick, a counter reset to Prometheus
            readings["energy_joules"] = None
        out[parent] = replace(p, job_ids=(), job_shares=(), **readings)
        for i, x, shares in zip(insts, rows, instance_shares(rows)):
            out[i] = replace(x, job_shares=shares, **NO_READINGS)
    return out


def _fractions(insts: Sequence[GpuSample]) -> list[float]:
    fractions = [slice_fraction(i.model) for i in insts]
    if any(f is None for f in fractions):  # unknown profiles: equal slices
        return [1.0] * len(insts)
    return fractions  # type: ignore[return-value]


def _activity(s: GpuSample) -> float | None:
    """SM activity, else utilisation (GR_ENGINE_ACTIVE on a dcgm-exporter MIG instance); None when neither."""
    return s.sm_active_ratio if s.sm_active_ratio is not None else s.gpu_util_ratio
