"""The accounting section of the gpuledger TOML configuration, validated by pydantic.

Example (``gpuledger.toml``)::

    cluster = "demo"

    [accounting]
    algorithm = "classic"          # or "fair-tree"
    policy = "blend"               # allocated | active | energy | blend
    floor = 0.25                   # blend: what an idle allocated GPU-second still costs
    unmeasured = "allocated"       # allocated GPU-time no agent observed: allocated (as fully used) | floor | mean
    full_power_watts = 700         # energy policy: what an unmeasured GPU-second costs "fully used"
    half_life_s = 604800           # PriorityDecayHalfLife (7 days, Slurm's default; 0 = no decay)
    calc_period_s = 300            # PriorityCalcPeriod (5 minutes, Slurm's default)
    usage_reset = "NONE"           # PriorityUsageResetPeriod
    timezone = ""                  # zone the reset periods are cut in (IANA name; "" = this machine's, as Slurm)
    priority_weight = 10000        # site factor = round(weight x fairshare)
    associations = "slurm"         # the tree when no --associations is given: "slurm" (sacctmgr) or a file
    [accounting.model_weights]     # like TRESBillingWeights per GPU model
    "H200" = 1.0

    [accounts.proj_a]              # the association tree (see accounting.associations)
    shares = 60
    [accounts.proj_a.users]
    alice = 1
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuledger.accounting.charge import ChargePolicy
from gpuledger.collector.config import ConfigError, read_toml

__all__ = ["AccountingSettings", "ConfigError", "accounting_settings", "load_config"]


class AccountingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["classic", "fair-tree"] = "fair-tree"
    policy: Literal["allocated", "active", "energy", "blend"] = "blend"
    floor: float = Field(0.25, ge=0.0, le=1.0, allow_inf_nan=False)
    unmeasured: Literal["allocated", "floor", "mean"] = "allocated"
    full_power_watts: float = Field(700.0, gt=0, allow_inf_nan=False)
    half_life_s: float = Field(7 * 86400.0, ge=0, allow_inf_nan=False)
    calc_period_s: int = Field(300, gt=0)
    usage_reset: Literal["NONE", "NOW", "DAILY", "WEEKLY", "MONTHLY", "QUARTERLY", "YEARLY"] = "NONE"
    timezone: str = ""
    # A job Slurm has no record of is described only by its agents, and a node's token may be stolen: a node could
    # invent a job and put its GPU time on any user. Charged to fairshare only when a site says its agents' word is
    # enough (no scheduler records imported at all); Slurm's own fairshare charges only the jobs it knows.
    charge_unrecorded_jobs: bool = False

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        if v:
            try:
                ZoneInfo(v)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(
                    f"unknown time zone {v!r} (an IANA name like Europe/Berlin, or \"\" for local)") from None
        return v
    # scontrol takes a SiteFactor within +/-2147483645: a larger weight would fail on every job
    priority_weight: int = Field(10_000, ge=0, le=2_147_483_645)
    dampening: float = Field(1.0, gt=0, allow_inf_nan=False)
    model_weights: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = {}
    # Where the association tree comes from when a command is not given --associations: "slurm" (sacctmgr on
    # this host) or a file (relative to the configuration file); unset: the [accounts] table.
    associations: str | None = None

    def charge_policy(self) -> ChargePolicy:
        return ChargePolicy(kind=self.policy, floor=self.floor, model_weights=self.model_weights,
                            unmeasured=self.unmeasured, full_power_watts=self.full_power_watts)


def load_config(path: str | Path) -> dict[str, Any]:
    """gpuledger.toml, parsed (``collector.config.read_toml``: the one reader of it); ConfigError naming the file."""
    return read_toml(Path(path))


def accounting_settings(data: dict[str, Any], path: str | Path = "<config>") -> AccountingSettings:
    try:
        return AccountingSettings.model_validate(data.get("accounting", {}))
    except ValidationError as e:
        where = "; ".join(f"accounting.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{path}: {where}") from None
