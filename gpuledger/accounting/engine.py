"""From the ledger to fairshare: charge each job by the policy, decay as Slurm does, compute fairshare."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuledger.accounting.associations import AssocTree, UserKey
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.decay import decayed_usage
from gpuledger.accounting.fairshare import Usage, classic, fair_tree
from gpuledger.accounting.ledger import LedgerEntry


@dataclass(frozen=True, slots=True)
class UsageResult:
    usage: dict[UserKey, float]
    unknown: dict[UserKey, float]  # charged usage of associations the tree does not have (reported, not dropped)
    unmatched_jobs: tuple[str, ...]  # measured jobs with no scheduler record: no association to charge


def association_usage(
    entries: Iterable[LedgerEntry], settings: AccountingSettings, tree: AssocTree, now: float
) -> UsageResult:
    policy = settings.charge_policy()
    charges = []
    unmatched = []
    for e in entries:
        if e.usage is None:
            continue
        if e.record is None or not e.record.account or not e.record.user:
            unmatched.append(e.job_id)
            continue
        amount = policy.charge(e.usage)
        charges.append(((e.record.account, e.record.user), e.usage.first_ts, e.usage.last_ts, amount))
    decayed = decayed_usage(
        charges, now=now, half_life_s=settings.half_life_s, calc_period_s=settings.calc_period_s,
        reset=settings.usage_reset,
    )
    known = set(tree.user_keys())
    usage = {k: v for k, v in decayed.items() if k in known}
    unknown = {k: v for k, v in decayed.items() if k not in known}
    return UsageResult(usage, unknown, tuple(unmatched))


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
    is ``"slurm"`` (``slurm`` is a SlurmClient, the real one by default), else the config's [accounts]."""
    if source is None:
        return AssocTree.from_toml({"accounts": config.get("accounts", {})})
    if str(source) == LIVE_SLURM:
        from gpuledger.accounting.slurm import SlurmClient

        return AssocTree.from_sacctmgr((slurm or SlurmClient()).associations(), cluster=config.get("cluster"))
    text = Path(source).read_text()
    first = text.lstrip().splitlines()[0].strip().lower() if text.strip() else ""
    if first.replace(" ", "") == "account,parent,user,shares":
        return AssocTree.from_csv(text)
    return AssocTree.from_sacctmgr(text)
