"""Charge policies: what a job's measured usage costs in fairshare terms.

``allocated``  allocated GPU-seconds (what Slurm itself would charge)
``active``     SM-active GPU-seconds (sum of SM activity x interval)
``energy``     joules
``blend``      allocated GPU-seconds x (floor + (1 - floor) x SM activity): an idle allocation still costs the floor
Per-GPU-model weights multiply the charge, like Slurm's TRESBillingWeights for typed GRES.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuledger.schema.records import JobUsage

PolicyKind = Literal["allocated", "active", "energy", "blend"]
POLICIES: tuple[str, ...] = ("allocated", "active", "energy", "blend")


@dataclass(frozen=True, slots=True)
class ChargePolicy:
    kind: PolicyKind = "blend"
    floor: float = 0.25
    model_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"charge policy {self.kind!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"charge policy floor {self.floor!r} must lie in 0..1")
        for model, w in self.model_weights.items():
            if not w >= 0:
                raise ValueError(f"charge weight for GPU model {model!r} must be >= 0, got {w!r}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ChargePolicy:
        """From the ``[accounting.charge]`` table: ``policy``, ``floor``, ``[...model_weights]``."""
        return cls(
            kind=cfg.get("policy", "blend"),
            floor=float(cfg.get("floor", 0.25)),
            model_weights={str(k): float(v) for k, v in cfg.get("model_weights", {}).items()},
        )

    def weight(self, model: str) -> float:
        # Exact model name first, then a case-insensitive substring ("H200" matches "NVIDIA H200").
        if model in self.model_weights:
            return self.model_weights[model]
        low = model.lower()
        for name, w in self.model_weights.items():
            if name.lower() in low:
                return w
        return 1.0

    def charge(self, u: JobUsage) -> float:
        """The charged amount for one usage record (per GPU or per job)."""
        if self.kind == "allocated":
            base = u.allocated_gpu_seconds
        elif self.kind == "active":
            base = u.sm_active_gpu_seconds
        elif self.kind == "energy":
            base = u.energy_joules
        else:
            base = self.floor * u.allocated_gpu_seconds + (1.0 - self.floor) * u.sm_active_gpu_seconds
        return base * self.weight(u.model)
