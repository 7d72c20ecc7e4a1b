"""Apply the priority feed to Slurm: each pending job's site factor from its association's measured fairshare.

Two steps, so that the decision can be tested and shown without a cluster:

- :func:`plan_changes` (pure) compares every pending job's current site factor (from ``sprio``) with the
  factor the feed gives the job's (account, user) association, and lists only the jobs where they differ.
  A job whose association is not in the feed, or whose current factor Slurm does not show (a held job has
  priority 0 and sprio leaves it out), is reported and left alone.
- :func:`apply_changes` groups the changes by new factor and sets each group with as few
  ``scontrol update jobid=A,B,C SiteFactor=M`` commands as one command line holds, a few at a time (unless
  ``dry_run``). A command that fails (a job ended meanwhile) is split in halves and retried until the failing
  jobs stand alone, so only they are reported failed. Every applied change, with its inputs, goes to ``record``
  in one call (the ledger's audit trail writes them in one transaction).

An array's pending tasks that still share one job record are one change (one record, ``tasks`` jobs).
A second apply with the same feed changes nothing: the factors already match, so the plan is empty.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from gpuledger.accounting.slurm import PendingJob, SlurmCommandError

log = logging.getLogger(__name__)

__all__ = ["Applied", "Change", "FeedAssoc", "Outcome", "Plan", "Skipped", "apply_changes", "batches",
           "feed_associations", "plan_changes", "run_apply"]

# Linux caps one argument at 128 KiB (MAX_ARG_STRLEN); "jobid=A,B,..." is one argument. Kept well below.
MAX_ARG_BYTES = 100_000
# Past this many jobs that failed alone, a failing command is not bisected further: an error that hits every job
# (not root, slurmctld down) would otherwise cost two commands per job.
MAX_BISECTED_FAILURES = 100
# scontrol sends one RPC per listed job (an array's shared record is one), each with a munge credential, and
# waits for each answer; a few commands at once let slurmctld's RPC threads and munged overlap that latency
# (bench/priority.py: about 1.9x faster than one command at 10,000 jobs). A command holds at least MIN_SPLIT jobs.
PARALLEL = 4
MIN_SPLIT = 250


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
    tasks: int = 1  # jobs the record stands for (an array's pending tasks sharing one record)

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
    jobs: int = 0  # pending jobs looked at, array tasks counted one by one


@dataclass(frozen=True, slots=True)
class Outcome:
    change: Change
    status: str  # "applied" | "dry-run" | "failed"
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    outcomes: tuple[Outcome, ...]  # in the plan's order
    calls: int  # scontrol commands run

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)


class SiteFactorSetter(Protocol):
    def set_site_factors(self, job_ids: Sequence[str], value: int) -> None: ...


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
    jobs = 0
    for job in pending_jobs:
        if job.state != "PENDING":
            continue
        jobs += job.tasks
        assoc = feed.get((job.account or "", job.user or ""))
        if assoc is None:
            skipped.append(Skipped(job.job_id, job.account, job.user,
                                   f"association {job.user}@{job.account} is not in the priority feed"))
            continue
        old = current_factors.get(job.sprio_id)
        if old is None:
            skipped.append(Skipped(job.job_id, job.account, job.user,
                                   "current site factor unknown (sprio does not list the job: held?)"))
            continue
        if old == assoc.site_factor:
            unchanged.append(job.job_id)
            continue
        changes.append(Change(job.job_id, assoc.account, assoc.user, assoc.raw_usage, assoc.effective_usage,
                              assoc.fairshare, old, assoc.site_factor, stamp, job.tasks))
    return Plan(tuple(changes), tuple(unchanged), tuple(skipped), jobs)


def batches(job_ids: Sequence[str], max_arg_bytes: int = MAX_ARG_BYTES) -> list[list[str]]:
    """Split ``job_ids`` into lists whose ``jobid=A,B,C`` argument stays within ``max_arg_bytes``."""
    out: list[list[str]] = []
    cur: list[str] = []
    size = len("jobid=")
    for j in job_ids:
        add = len(j) + (1 if cur else 0)
        if cur and size + add > max_arg_bytes:
            out.append(cur)
            cur, size, add = [], len("jobid="), len(j)
        cur.append(j)
        size += add
    if cur:
        out.append(cur)
    return out


def apply_changes(
    client: SiteFactorSetter,
    changes: Iterable[Change],
    dry_run: bool,
    record: Callable[[Sequence[Change | dict[str, Any]]], object] | None = None,
    max_arg_bytes: int = MAX_ARG_BYTES,
    parallel: int = PARALLEL,
    sprio_ids: Mapping[str, str] | None = None,
) -> Applied:
    """Set the changes' factors, one scontrol command per (factor, command-line-full of jobs), up to
    ``parallel`` commands at a time.

    ``record`` gets all changes Slurm accepted, in one call, after the last command (not in a dry run). A
    command that fails is bisected: its halves are retried until each failing job is alone, so a job that
    ended meanwhile fails alone (with scontrol's message) and the rest of its batch is applied.

    A failed command may have been carried out all the same (scontrol timed out, or slurmctld answered late: it
    then still sets the factors), and a later apply finds such jobs at their factor and records nothing. So after
    any failure the factors are read back (``site_factors``, when the client has it; ``sprio_ids``: a job id ->
    the id sprio prints for its record, where they differ): a job at its new factor is applied and recorded; when
    they cannot be read, the failed changes are recorded as ``unconfirmed`` (with the error), so that every change
    Slurm may have made is in the audit trail.
    """
    changes = list(changes)
    if dry_run:
        return Applied(tuple(Outcome(c, "dry-run") for c in changes), 0)
    by_factor: dict[int, list[str]] = {}
    for c in changes:
        by_factor.setdefault(c.new_factor, []).append(c.job_id)
    work = [(ids, value) for value, job_ids in by_factor.items() for ids in batches(job_ids, max_arg_bytes)]
    work = _spread(work, parallel)
    errors: dict[str, str] = {}
    calls = 0
    lock = threading.Lock()

    def settle(ids: list[str], value: int) -> None:
        nonlocal calls
        with lock:
            calls += 1
        try:
            client.set_site_factors(ids, value)
        except SlurmCommandError as e:
            with lock:
                if len(ids) == 1:
                    errors[ids[0]] = str(e)
                    return
                if len(errors) >= MAX_BISECTED_FAILURES:
                    note = f" (one command for {len(ids)} jobs; not retried one by one after {len(errors)} failures)"
                    errors.update((j, f"scontrol exited with {e.returncode}: {e.stderr.strip()}{note}") for j in ids)
                    return
            half = len(ids) // 2
            settle(ids[:half], value)
            settle(ids[half:], value)

    if parallel > 1 and len(work) > 1:
        with ThreadPoolExecutor(min(parallel, len(work))) as pool:
            list(pool.map(lambda w: settle(*w), work))
    else:
        for ids, value in work:
            settle(ids, value)
    unconfirmed: list[Change] = []
    if errors:
        now_at, unread = _read_back(client)
        for c in changes:
            if c.job_id in errors and now_at.get((sprio_ids or {}).get(c.job_id, c.job_id)) == c.new_factor:
                del errors[c.job_id]  # Slurm carried it out despite the error
            elif c.job_id in errors and unread:
                unconfirmed.append(c)
    outcomes = tuple(Outcome(c, "failed", errors[c.job_id]) if c.job_id in errors else Outcome(c, "applied")
                     for c in changes)
    applied: list[Any] = [o.change for o in outcomes if o.status == "applied"]
    applied += [{**c.to_dict(), "status": "unconfirmed", "error": errors[c.job_id]} for c in unconfirmed]
    if record is not None and applied:
        record(applied)
    return Applied(outcomes, calls)


def _read_back(client: SiteFactorSetter) -> tuple[dict[str, int], bool]:
    """The pending jobs' factors now (after a failed command), and whether they could not be read."""
    read = getattr(client, "site_factors", None)
    if read is None:
        return {}, True
    try:
        return read(), False
    except SlurmCommandError as e:
        log.warning("factors not read back after a failed scontrol (%s): the failed changes are recorded as "
                    "unconfirmed", e)
        return {}, True


def _spread(work: list[tuple[list[str], int]], parallel: int) -> list[tuple[list[str], int]]:
    """Split the largest commands until there are ``parallel`` of them (none below MIN_SPLIT jobs), so that the
    concurrent commands share the work evenly."""
    work = list(work)
    while len(work) < parallel:
        i = max(range(len(work)), key=lambda k: len(work[k][0]), default=None)
        if i is None or len(work[i][0]) < 2 * MIN_SPLIT:
            break
        ids, value = work.pop(i)
        half = len(ids) // 2
        work[i:i] = [(ids[:half], value), (ids[half:], value)]
    return work


class _ApplyClient(SiteFactorSetter, Protocol):
    def pending_jobs(self) -> list[PendingJob]: ...
    def site_factors(self) -> dict[str, int]: ...


def run_apply(
    client: _ApplyClient,
    feed_entries: Iterable[Any],
    dry_run: bool = False,
    record: Callable[[Sequence[Change | dict[str, Any]]], object] | None = None,
    now: float | None = None,
    max_arg_bytes: int = MAX_ARG_BYTES,
    parallel: int = PARALLEL,
) -> tuple[Plan, Applied]:
    """The whole cycle against a live cluster: squeue, sprio, plan, scontrol."""
    pending = client.pending_jobs()
    plan = plan_changes(pending, feed_entries, client.site_factors(), now=now)
    return plan, apply_changes(client, plan.changes, dry_run, record, max_arg_bytes, parallel,
                               {job.job_id: job.sprio_id for job in pending})
