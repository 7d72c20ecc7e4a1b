"""Apply the priority feed to Slurm: each pending job's site factor from its association's measured fairshare.

Two steps, so that the decision can be tested and shown without a cluster:

- :func:`plan_changes` (pure) compares every pending job's current site factor (from ``sprio``) with the
  factor the feed gives the job's (account, user) association, and lists only the jobs where they differ.
  A job whose association is not in the feed, or whose current factor Slurm does not show (a held job has
  priority 0 and sprio leaves it out), is reported and left alone.
- :func:`apply_changes` runs ``scontrol update jobid=N SiteFactor=M`` for each change (unless ``dry_run``) and
  hands each applied change, with its inputs, to ``record`` (the ledger's audit trail).

A second apply with the same feed changes nothing: the factors already match, so the plan is empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from gpuledger.accounting.slurm import PendingJob, SlurmCommandError

__all__ = ["Change", "FeedAssoc", "Outcome", "Plan", "Skipped", "apply_changes", "feed_associations",
           "plan_changes", "run_apply"]


@dataclass(frozen=True, slots=True)
class FeedAssoc:
    """What the feed says of one association (the inputs a change is explained by)."""

    account: str
    user: str
    fairshare: float
    site_factor: int
    raw_usage: float | None = None
    effective_usage: float | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """One site factor to set, with everything it was computed from (for the audit trail)."""

    job_id: str
    account: str
    user: str
    raw_usage: float | None
    effective_usage: float | None
    fairshare: float
    old_factor: int
    new_factor: int
    time: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Skipped:
    job_id: str
    account: str | None
    user: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    changes: tuple[Change, ...]
    unchanged: tuple[str, ...]  # pending jobs whose factor already equals the feed's
    skipped: tuple[Skipped, ...]  # reported, not changed


@dataclass(frozen=True, slots=True)
class Outcome:
    change: Change
    status: str  # "applied" | "dry-run" | "failed"
    error: str | None = None


class SiteFactorSetter(Protocol):
    def set_site_factor(self, job_id: str, value: int) -> None: ...


def _field(e: Any, name: str) -> Any:
    return e[name] if isinstance(e, Mapping) else getattr(e, name)


def _opt_float(e: Any, name: str) -> float | None:
    v = e.get(name) if isinstance(e, Mapping) else getattr(e, name, None)
    return None if v is None else float(v)


def feed_associations(entries: Iterable[Any]) -> dict[tuple[str, str], FeedAssoc]:
    """Feed entries (``PriorityEntry`` objects or the dicts of the feed file's ``associations``) by
    (account, user). A repeated association or a missing key is an error naming the entry."""
    out: dict[tuple[str, str], FeedAssoc] = {}
    for i, e in enumerate(entries):
        try:
            a = FeedAssoc(
                account=str(_field(e, "account")),
                user=str(_field(e, "user")),
                fairshare=float(_field(e, "fairshare")),
                site_factor=int(_field(e, "site_factor")),
                raw_usage=_opt_float(e, "raw_usage"),
                effective_usage=_opt_float(e, "effective_usage"),
            )
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"priority feed entry {i}: {exc!r} (needs account, user, fairshare, site_factor)") \
                from None
        key = (a.account, a.user)
        if key in out:
            raise ValueError(f"priority feed entry {i}: association {a.user}@{a.account} appears twice")
        out[key] = a
    return out


def plan_changes(
    pending_jobs: Iterable[PendingJob],
    feed_entries: Iterable[Any],
    current_factors: Mapping[str, int],
    now: float | None = None,
) -> Plan:
    """Which pending jobs need a new site factor. ``current_factors`` is job id -> site factor (sprio)."""
    feed = feed_associations(feed_entries)
    stamp = time.time() if now is None else now
    changes: list[Change] = []
    unchanged: list[str] = []
    skipped: list[Skipped] = []
    for job in pending_jobs:
        if job.state != "PENDING":
            continue
        assoc = feed.get((job.account or "", job.user or ""))
        if assoc is None:
            skipped.append(Skipped(job.job_id, job.account, job.user,
                                   f"association {job.user}@{job.account} is not in the priority feed"))
            continue
        old = current_factors.get(job.job_id)
        if old is None:
            skipped.append(Skipped(job.job_id, job.account, job.user,
                                   "current site factor unknown (sprio does not list the job: held?)"))
            continue
        if old == assoc.site_factor:
            unchanged.append(job.job_id)
            continue
        changes.append(Change(job.job_id, assoc.account, assoc.user, assoc.raw_usage, assoc.effective_usage,
                              assoc.fairshare, old, assoc.site_factor, stamp))
    return Plan(tuple(changes), tuple(unchanged), tuple(skipped))


def apply_changes(
    client: SiteFactorSetter,
    changes: Iterable[Change],
    dry_run: bool,
    record: Callable[[Change], None] | None = None,
) -> list[Outcome]:
    """Set each change's factor; ``record`` gets each change that Slurm accepted (not in a dry run).

    A job that started or ended since the plan makes scontrol fail: that change is reported as failed and
    the others still go ahead.
    """
    out: list[Outcome] = []
    for c in changes:
        if dry_run:
            out.append(Outcome(c, "dry-run"))
            continue
        try:
            client.set_site_factor(c.job_id, c.new_factor)
        except SlurmCommandError as e:
            out.append(Outcome(c, "failed", str(e)))
            continue
        if record is not None:
            record(c)
        out.append(Outcome(c, "applied"))
    return out


class _ApplyClient(SiteFactorSetter, Protocol):
    def pending_jobs(self) -> list[PendingJob]: ...
    def site_factors(self) -> dict[str, int]: ...


def run_apply(
    client: _ApplyClient,
    feed_entries: Iterable[Any],
    dry_run: bool = False,
    record: Callable[[Change], None] | None = None,
    now: float | None = None,
) -> tuple[Plan, list[Outcome]]:
    """The whole cycle against a live cluster: squeue, sprio, plan, scontrol."""
    pending = client.pending_jobs()
    plan = plan_changes(pending, feed_entries, client.site_factors(), now=now)
    return plan, apply_changes(client, plan.changes, dry_run, record)
