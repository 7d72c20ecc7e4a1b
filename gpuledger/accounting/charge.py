"""Charge policies: what a job costs in fairshare terms. Allocation is the frame, measurement fills it.

The scheduler's record says who held which GPUs when: a job's **allocated** GPU-seconds are Slurm's elapsed time
x GPUs (per GPU model from AllocTRES' typed ``gres/gpu:<type>``). The agents' usage says what was **observed**
(GPU-seconds in which a sample carried the job); ``coverage = observed / allocated``.

Policies (on the observed part):

``allocated``  allocated GPU-seconds (what Slurm itself charges), whether or not anything was measured
``active``     SM-active GPU-seconds (sum of SM activity x interval)
``energy``     joules
``blend``      GPU-seconds x (floor + (1 - floor) x SM activity): an idle allocation still costs the floor

Under the measured policies the **unmeasured** GPU-seconds (allocated - observed, never below 0) are charged by
``unmeasured``: ``allocated`` (default, conservative: as if fully used, 1 per GPU-second; for ``energy`` the
configured ``full_power_watts``), ``floor`` (the blend floor per GPU-second; ``energy``: floor x full power) or
``mean`` (the job's own measured charge per observed GPU-second; as ``allocated`` when nothing was observed).
So an allocation nobody measured is never free. Gap energy reassigned from Slurm's records (``gaps``) is measured
energy under ``energy``, and the GPU-seconds it covers are not unmeasured (a gap is never charged twice). A job
without a scheduler record is charged from its measurements alone (and flagged by the ledger).

Per-GPU-model weights multiply the charge, like Slurm's TRESBillingWeights for typed GRES, found by the one rule
of :func:`model_value` (which also finds a report's prices): the exact model name, else the longest pattern
contained in it (case-insensitive; ties by name), else, for Slurm's gres type (``h200``), the model it names
(:func:`gres_names`: "NVIDIA H200"). MIG GPU-seconds are physical-GPU
fractions on both sides of the frame, so a slice is never weighted twice: the aggregation already counts a MIG
instance's GPU-seconds as its compute-slice fraction (3g = 3/7), and a Slurm allocation of a typed MIG gres
(``gres/gpu:3g.40gb``, ``a100_3g.40gb``) is counted here the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuledger.accounting.slurm import gpu_tres
from gpuledger.agent.mig import slice_fraction
from gpuledger.schema.records import JobRecord, JobUsage

PolicyKind = Literal["allocated", "active", "energy", "blend"]
POLICIES: tuple[str, ...] = ("allocated", "active", "energy", "blend")
UNMEASURED_RULES: tuple[str, ...] = ("allocated", "floor", "mean")
_RUNNING = ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING")


def allocation_runs(record: JobRecord | None, now: float) -> list[tuple[float, float]]:
    """The spans the job held its allocation, up to ``now``: a requeued job's earlier runs
    (``JobRecord.earlier_runs``; its allocation is taken to be the latest run's), then [start, end or now] unless the
    latest run never started or is pending (ended without an end time: nothing to charge). The one rule of how much
    (:func:`allocation`) and when (``engine``: the allocation's charge accrues over these spans) Slurm's allocation
    is charged."""
    if record is None:
        return []
    runs = [(start, max(start, min(end, now))) for start, end, _ in record.earlier_runs]
    if record.start is None:
        return runs  # requeued, waiting to run again (or never ran)
    end = record.end
    if end is None:
        if record.state is not None and record.state not in _RUNNING:
            return runs  # pending, or ended without an end time: no allocation to charge but the earlier runs'
        end = now
    runs.append((record.start, max(record.start, min(end, now))))
    return runs


def _elapsed(record: JobRecord | None, now: float) -> float | None:
    """Seconds the job held its allocation (:func:`allocation_runs`); None if it never ran."""
    runs = allocation_runs(record, now)
    return sum(b - a for a, b in runs) if runs else None


def _gpu_counts(record: JobRecord) -> tuple[float, dict[str, float]]:
    """Allocated GPUs in all, and per typed ``gres/gpu:<type>`` (``slurm.gpu_tres``); no TRES: ``gpus``."""
    if not record.tres:
        return float(record.gpus or 0), {}
    total, typed = gpu_tres(record.tres)
    if total is None:
        total = sum(typed.values()) if typed else float(record.gpus or 0)
    return total, typed


def physical_gpus(record: JobRecord) -> float:
    """A job's allocated physical GPUs (AllocTRES, else ``gpus``): a typed MIG slice counts its fraction, as
    :func:`allocation` counts it."""
    total, typed = _gpu_counts(record)
    return math.fsum(n * (slice_fraction(m) or 1.0) for m, n in typed.items() if n > 0) + max(
        0.0, total - sum(typed.values()))


def allocated_gpu_seconds(record: JobRecord | None, now: float) -> float | None:
    """Slurm-allocated GPU-seconds of a job, all models together (:func:`allocation`, summed; for reports)."""
    per_model = allocation(record, now)
    return None if per_model is None else math.fsum(per_model.values())


def allocation(record: JobRecord | None, now: float) -> dict[str, float] | None:
    """Slurm-allocated GPU-seconds per GPU model ("" when untyped) of a job: (end or now) - start, x GPUs.

    None when there is no scheduler record or it has no start (never ran); {} for a job without GPUs. A typed
    ``gres/gpu:<type>`` entry of AllocTRES gives the model; the untyped count covers what the typed ones don't.
    """
    elapsed = _elapsed(record, now)
    if elapsed is None:
        return None
    total, typed = _gpu_counts(record)  # type: ignore[arg-type]
    # a typed MIG gres counts its slice's fraction of the physical GPU, as the aggregation counts its samples
    out = {m: n * elapsed * (slice_fraction(m) or 1.0) for m, n in typed.items() if n > 0}
    rest = total - sum(typed.values())
    if rest > 0:
        out[record.gpu_model if record.gpu_model and not typed else ""] = rest * elapsed  # type: ignore[union-attr]
    return out


def bounded_weight(model: str, alloc: Mapping[str, float] | None, weight: Callable[[str, bool], float]) -> float:
    """A measured GPU's weight (a fairshare model weight, a report's price): ``weight(model, False)``, the model as
    the agent named it, unless Slurm's record (``alloc``, :func:`allocation`) gave the job typed GPUs
    (``gres/gpu:<type>``, a model rather than a MIG profile) none of which names the agent's model
    (:func:`gres_names`) or weighs as it: Slurm's record is the authority on what the job held, and a node may
    misname its GPU. Then Slurm's type's weight (``weight(type, True)``; the allocation's mean weight over
    several types)."""
    w = weight(model, False)
    typed = {m: s for m, s in (alloc or {}).items() if m and slice_fraction(m) is None}
    if not typed or any(gres_names(t, model) for t in typed):
        return w
    allowed = {weight(m, True) for m in typed}
    if w in allowed:
        return w
    if len(allowed) == 1:
        return next(iter(allowed))
    total = math.fsum(typed.values())
    return math.fsum(s * weight(m, True) for m, s in typed.items()) / total if total > 0 else w


def _model_words(name: str) -> list[str]:
    """A GPU model's name as words: lowercase, ``_`` and ``-`` as spaces, without a leading ``nvidia``."""
    words = name.lower().replace("_", " ").replace("-", " ").split()
    return words[1:] if words[:1] == ["nvidia"] else words


def gres_names(gres: str, model: str) -> bool:
    """Whether a Slurm gres type (``nvidia_h200``, ``h100``, ``a100-sxm4-80gb``) names a measured model
    (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3``): each of its words is one of the model's, so ``a10`` is not an
    ``A100``."""
    want, have = _model_words(gres), set(_model_words(model))
    return bool(want) and all(w in have for w in want)


def model_value(table: Mapping[str, float], name: str, gres: bool = False) -> float | None:
    """What a table keyed by GPU model (``model_weights``, ``[report.price_per_gpu_hour]``) gives a GPU: the one
    lookup rule of weights and prices. The exact key; else the longest key contained in ``name`` (case-insensitive,
    ties by name: "H200" matches "NVIDIA H200"), so a result never depends on the order of the keys; else, when
    ``name`` is Slurm's name for the GPU (``gres``: a gres type such as ``h200`` or ``nvidia_h200``), a key it
    names (:func:`gres_names`, the rule ``report reconcile`` pairs them by: ``h200`` names "NVIDIA H200"), of
    several the one with the fewest words, ties by name. None: no key matches."""
    if name in table:
        return table[name]
    low = name.lower()
    hits = [(len(k), k) for k in table if k.lower() in low]
    if hits:
        return table[max(hits)[1]]
    if gres:
        named = [(len(_model_words(k)), k) for k in table if gres_names(name, k)]
        if named:
            return table[min(named)[1]]
    return None


@dataclass(frozen=True, slots=True)
class JobCharge:
    """One job's charge and how it was made up (units: GPU-seconds, or joules under ``energy``)."""

    allocated_gpu_seconds: float | None  # Slurm's; None without a scheduler record
    observed_gpu_seconds: float
    unmeasured_gpu_seconds: float
    measured: float  # charge of what was observed (weighted)
    unmeasured: float  # charge of the unmeasured part (weighted)
    total: float
    gap_energy_joules: float = 0.0  # gap energy Slurm's record reassigned to the job (``gaps``)
    gap_charge: float = 0.0  # the part of ``measured`` that charges it (``energy`` only)

    @property
    def coverage(self) -> float | None:
        """Observed / allocated GPU-seconds (None without an allocation; may exceed 1 on clock skew)."""
        a = self.allocated_gpu_seconds
        return None if not a else self.observed_gpu_seconds / a


@dataclass(frozen=True, slots=True)
class ChargePolicy:
    kind: PolicyKind = "blend"
    floor: float = 0.25
    model_weights: Mapping[str, float] = field(default_factory=dict)
    unmeasured: str = "allocated"
    full_power_watts: float = 700.0

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"charge policy {self.kind!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"charge policy floor {self.floor!r} must lie in 0..1")
        if self.unmeasured not in UNMEASURED_RULES:
            raise ValueError(f"unmeasured rule {self.unmeasured!r} is not one of {', '.join(UNMEASURED_RULES)}")
        if not (math.isfinite(self.full_power_watts) and self.full_power_watts > 0):
            raise ValueError(f"full_power_watts {self.full_power_watts!r} must be a positive number")
        for model, w in self.model_weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(f"charge weight for GPU model {model!r} must be a finite number >= 0, got {w!r}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ChargePolicy:
        """From the ``[accounting.charge]`` table: ``policy``, ``floor``, ``unmeasured``, ``[...model_weights]``."""
        return cls(
            kind=cfg.get("policy", "blend"),
            floor=float(cfg.get("floor", 0.25)),
            model_weights={str(k): float(v) for k, v in cfg.get("model_weights", {}).items()},
            unmeasured=cfg.get("unmeasured", "allocated"),
            full_power_watts=float(cfg.get("full_power_watts", 700.0)),
        )

    def weight(self, model: str, gres: bool = False) -> float:
        """The weight of a GPU model (``gres``: of Slurm's gres type) by :func:`model_value`, else 1."""
        w = model_value(self.model_weights, model, gres)
        return 1.0 if w is None else w

    def allocation_weight(self, slurm_model: str, alloc: Mapping[str, float], gpus: Sequence[JobUsage]) -> float:
        """The weight of a job's GPUs that Slurm allocated as ``slurm_model`` (a key of ``alloc``, the job's
        :func:`allocation`: a gres type, an agent's description, "" untyped): the job's measured model that it
        names (:func:`gres_names`; as :func:`bounded_weight` weighs those GPUs), else Slurm's name's. Untyped: the
        job's first measured model's, else as its typed GPUs."""
        if not slurm_model:
            first = next((u.model for u in gpus if u.model), "")
            if first:
                return self.weight(first)
            slurm_model = next((m for m in alloc if m), "")
            if not slurm_model:
                return self.weight("")
        measured = next((u.model for u in gpus if u.model and gres_names(slurm_model, u.model)), None)
        return self.weight(measured) if measured is not None else self.weight(slurm_model, True)

    def _base(self, u: JobUsage) -> float:
        if self.kind == "allocated":
            return u.allocated_gpu_seconds
        if self.kind == "active":
            return u.sm_active_gpu_seconds
        if self.kind == "energy":
            return u.energy_joules
        return self.floor * u.allocated_gpu_seconds + (1.0 - self.floor) * u.sm_active_gpu_seconds

    def measured_weight(self, u: JobUsage, alloc: Mapping[str, float] | None = None) -> float:
        """A usage record's weight: :func:`bounded_weight` of its model, the job's allocation and the model
        weights."""
        return bounded_weight(u.model, alloc, self.weight)

    def charge(self, u: JobUsage, alloc: Mapping[str, float] | None = None) -> float:
        """The charged amount of one usage record's measurements (per GPU or per job); ``alloc``: the job's
        Slurm allocation per model, which bounds the weight (:meth:`measured_weight`)."""
        return self._base(u) * self.measured_weight(u, alloc)

    def _full_rate(self) -> float:
        return self.full_power_watts if self.kind == "energy" else 1.0

    def charge_job(self, alloc: Mapping[str, float] | None, gpus: Sequence[JobUsage], gap_joules: float = 0.0,
                   gap_gpu_seconds: float = 0.0) -> JobCharge:
        """A job's charge from its Slurm allocation per model (:func:`allocation`; None without a scheduler
        record), its per-GPU usage records and the gap energy Slurm's record reassigned to it (``gaps``: joules
        and the GPU-seconds they cover). Under ``energy`` that energy is measured (weighted by the job's model)
        and its GPU-seconds leave the unmeasured part, so a gap is never charged both ways; the other policies
        measure nothing in a gap and record the joules only."""
        observed = math.fsum(u.allocated_gpu_seconds for u in gpus)
        measured = math.fsum(self.charge(u, alloc) for u in gpus)
        gap_charge = gap_joules * self.allocation_weight("", alloc or {}, gpus) if self.kind == "energy" else 0.0
        measured += gap_charge
        if alloc is None:
            return JobCharge(None, observed, 0.0, measured, 0.0, measured, gap_joules, gap_charge)
        allocated = math.fsum(alloc.values())
        weighted_alloc = math.fsum(s * self.allocation_weight(m, alloc, gpus) for m, s in alloc.items())
        unmeasured_s = max(0.0, allocated - observed)
        if self.kind == "allocated":
            # Slurm's allocation is the charge; the measured part is the observed share of it
            share = min(observed, allocated) / allocated if allocated > 0 else 0.0
            return JobCharge(allocated, observed, unmeasured_s, weighted_alloc * share,
                             weighted_alloc * (1.0 - share), weighted_alloc, gap_joules, 0.0)
        mean_weight = weighted_alloc / allocated if allocated > 0 else 1.0
        if self.unmeasured == "allocated" or (self.unmeasured == "mean" and observed <= 0):
            rate = self._full_rate()
        elif self.unmeasured == "floor":
            rate = self.floor * self._full_rate()
        else:  # the job's own measured rate per observed GPU-second, unweighted
            rate = math.fsum(self._base(u) for u in gpus) / observed
        if self.kind == "energy":
            unmeasured_s = max(0.0, unmeasured_s - gap_gpu_seconds)
        unmeasured = unmeasured_s * rate * mean_weight
        return JobCharge(allocated, observed, unmeasured_s, measured, unmeasured, measured + unmeasured, gap_joules,
                         gap_charge)
