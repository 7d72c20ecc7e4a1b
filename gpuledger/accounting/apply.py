"""Apply the priority feed to Slurm: each pending job's site factor from its association's measured fairshare.

Two steps, so that the decision can be tested and shown without a cluster:

- :func:`plan_changes` (pure) compares every pending job's current site factor (from ``sprio``) with the
  factor the feed gives the job's (account, user) association, and lists only the jobs where they differ.
  A job whose association is not in the feed, or whose current factor Slurm does not show (a held job has
  priority 0 and sprio leaves it out), is reported and left alone.
- :func:`apply_changes` groups the changes by new factor and sets each group with as few
  ``scontrol update jobid=A,B,C SiteFactor=M`` commands as one command line holds, a few at a time (unless
  ``dry_run``). A command that fails (a job ended meanwhile) is split in halves and retried until the failing
  jobs stand alone, so only they are reported failed. Each batch goes to ``record`` (the audit trail, one
  transaction a call) before its command, as intended, and after it with each change's outcome, so that a run
  stopped at any point (SIGTERM, a full disk) leaves in the log every change Slurm may have made.

An array's pending tasks that still share one job record are one change (one record, ``tasks`` jobs).
A second apply with the same feed changes nothing: the factors already match, so the plan is empty.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from gpuledger.accounting.slurm import PendingJob, SlurmCommandError

log = logging.getLogger(__name__)

__all__ = ["Applied", "AuditNotWritten", "Change", "FeedAssoc", "Outcome", "Plan", "Skipped", "apply_changes",
           "batches", "feed_associations", "plan_changes", "run_apply"]

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


class AuditNotWritten(OSError):
    """The audit log did not take the record apply writes before a command (or after it): that command and every
    later one are not sent. An OSError, so that commands end with the one line they give for a file that cannot
    be written."""


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
    record: Callable[[Sequence[dict[str, Any]]], object] | None = None,
    max_arg_bytes: int = MAX_ARG_BYTES,
    parallel: int = PARALLEL,
    sprio_ids: Mapping[str, str] | None = None,
) -> Applied:
    """Set the changes' factors, one scontrol command per (factor, command-line-full of jobs), up to
    ``parallel`` commands at a time.

    ``record`` (the audit trail; not called in a dry run) gets each batch twice, each time in one call (one
    transaction): before its command, each change with ``status`` ``intended`` (from then on Slurm may set it); after
    it, each change's outcome: ``applied``, ``failed`` (with ``error``: Slurm shows the old factor, or the command was
    not sent) or ``unconfirmed`` (with ``error``: the command failed or was abandoned and the factor could not be read
    back, so Slurm may have set it). A batch whose intent the log does not take is not sent, and no batch after it
    (:class:`AuditNotWritten`).

    A command that fails is bisected: its halves are retried until each failing job is alone, so a job that ended
    meanwhile fails alone (with scontrol's message) and the rest of its batch is applied. A failed command may have
    been carried out all the same (scontrol timed out, or slurmctld answered late: it then still sets the factors),
    so a batch's failed jobs are read back (``site_factors``, when the client has it; ``sprio_ids``: a job id -> the
    id sprio prints for its record, where they differ): a job at its new factor is applied.

    SIGTERM or SIGINT (taken in the main thread) stops the run between batches: no command starts after it, a
    command still running is abandoned and its changes recorded as ``unconfirmed``, the batches not sent fail;
    then the signal goes on to the handler it interrupted (``priority watch`` stops after the cycle; a command
    ends as the signal asks, after one line saying what was left).
    """
    changes = list(changes)
    if dry_run:
        return Applied(tuple(Outcome(c, "dry-run") for c in changes), 0)
    by_id = {c.job_id: c for c in changes}
    by_factor: dict[int, list[str]] = {}
    for c in changes:
        by_factor.setdefault(c.new_factor, []).append(c.job_id)
    work = [(ids, value) for value, job_ids in by_factor.items() for ids in batches(job_ids, max_arg_bytes)]
    work = _spread(work, parallel)
    results: queue.SimpleQueue[tuple[int, _Done] | None] = queue.SimpleQueue()
    sender = _Sender(client, sprio_ids or {}, results)
    failed: dict[str, str] = {}  # job id -> why its change is not known to be applied
    started: list[int] = []  # batches whose command was started

    def note(what: str, rows: Sequence[tuple[str, str, str | None]]) -> None:
        """One ``record`` call: a batch's changes as (job id, status, error)."""
        if record is None:
            return
        items = [{**by_id[j].to_dict(), "status": status, **({"error": err} if err is not None else {})}
                 for j, status, err in rows]
        try:
            record(items)
        except Exception as e:  # the log's own error (disk full, database down): named in the one line
            sent = sum(len(work[i][0]) for i in started)
            before = (f"nothing more was sent to Slurm; the {sent} change(s) sent before are in the log as intended"
                      if sent else "nothing was sent to Slurm")
            raise AuditNotWritten(f"priority apply stopped: the audit log did not take {what} of {len(rows)} job "
                                  f"record(s) ({type(e).__name__}: {e}); {before}") from e

    def confirm(i: int, done: _Done) -> None:
        ids = work[i][0]
        failed.update((j, done.failed[j]) for j in ids if j in done.failed)
        note("the outcome", [(j, "applied", None) if j not in done.failed else
                             (j, "unconfirmed" if j in done.unread else "failed", done.failed[j]) for j in ids])

    todo = deque(range(len(work)))
    running: set[int] = set()
    with _StopOnSignal(results, sender) as stop:
        try:
            while todo or running:
                while todo and len(running) < max(parallel, 1) and stop.signal is None:
                    i = todo[0]
                    note("the planned changes", [(j, "intended", None) for j in work[i][0]])
                    if stop.signal is not None:  # it came while the intent was written: not sent after all
                        unsent = f"not sent: stopped by {stop.name}"
                        failed.update((j, unsent) for j in work[i][0])
                        todo.popleft()
                        note("the outcome", [(j, "failed", unsent) for j in work[i][0]])
                        break
                    todo.popleft()
                    running.add(i)
                    started.append(i)
                    sender.start(i, *work[i])
                if stop.signal is not None or not running:
                    break
                got = results.get()  # a signal wakes it too, with None
                if got is not None:
                    running.discard(got[0])
                    confirm(*got)
                    if got[1].error is not None:
                        raise got[1].error  # the batch could not be sent (a job id scontrol cannot take)
            if stop.signal is not None:
                while (got := _ready(results)) is not None:  # batches that ended before the signal
                    if got[0] in running:
                        running.discard(got[0])
                        confirm(*got)
                why = f"stopped by {stop.name}"
                abandoned = f"{why} while scontrol ran: Slurm may have set it"
                for i in sorted(running):
                    failed.update((j, abandoned) for j in work[i][0])
                    note("the outcome", [(j, "unconfirmed", abandoned) for j in work[i][0]])
                failed.update((j, f"not sent: {why}") for i in todo for j in work[i][0])
                log.warning("priority apply %s: %d of %d change(s) sent; %d still running, recorded as unconfirmed "
                            "(Slurm may have set them); %d not sent", why, sum(len(work[i][0]) for i in started),
                            len(changes), sum(len(work[i][0]) for i in running),
                            sum(len(work[i][0]) for i in todo))
        finally:
            sender.halted = True  # a command abandoned here starts nothing more (no bisection, no read-back)
    outcomes = tuple(Outcome(c, "failed", failed[c.job_id]) if c.job_id in failed else Outcome(c, "applied")
                     for c in changes)
    return Applied(outcomes, sender.calls)


@dataclass(frozen=True, slots=True)
class _Done:
    """What one batch's commands did: the jobs whose change failed (job id -> error), those of them whose factor
    could not be read back (Slurm may have set it), or the error that kept the batch from being sent."""

    failed: dict[str, str]
    unread: frozenset[str] = frozenset()
    error: Exception | None = None


def _ready(results: queue.SimpleQueue[tuple[int, _Done] | None]) -> tuple[int, _Done] | None:
    """The next finished batch already waiting (signal wake-ups skipped), else None."""
    while True:
        try:
            got = results.get_nowait()
        except queue.Empty:
            return None
        if got is not None:
            return got


class _Sender:
    """Runs each batch in a thread of its own: its command, the bisection of a failed one, the read-back of its
    failed jobs. The main thread stays free to write the audit log (one connection, one thread) and to take a
    signal while a command hangs."""

    def __init__(self, client: SiteFactorSetter, sprio_ids: Mapping[str, str],
                 results: queue.SimpleQueue[tuple[int, _Done] | None]) -> None:
        self.client, self.sprio_ids, self.results = client, sprio_ids, results
        self.halted = False  # set once the run stops: no command starts after it
        self.calls = 0  # scontrol commands run
        self._failures = 0  # jobs reported failed by commands so far, in every batch
        self._lock = threading.Lock()

    def start(self, i: int, ids: list[str], value: int) -> None:
        threading.Thread(target=self._run, args=(i, ids, value), name=f"scontrol-batch-{i}", daemon=True).start()

    def _run(self, i: int, ids: list[str], value: int) -> None:
        try:
            done = self._batch(ids, value)
        except Exception as e:  # not a command's failure (those are in _Done.failed): the caller raises it
            done = _Done({j: f"not sent: {e}" for j in ids}, error=e)
        self.results.put((i, done))

    def _batch(self, ids: list[str], value: int) -> _Done:
        failed: dict[str, str] = {}
        sent = not self.halted
        self._settle(ids, value, failed)
        if not failed:
            return _Done(failed)
        if self.halted:  # no read-back after a stop: the batch's first command held every job, and may yet be done
            return _Done(failed, frozenset(failed) if sent else frozenset())
        now_at, unread = _read_back(self.client)
        for j in list(failed):
            if now_at.get(self.sprio_ids.get(j, j)) == value:
                del failed[j]  # Slurm carried it out despite the error
        return _Done(failed, frozenset(failed) if unread else frozenset())

    def _settle(self, ids: list[str], value: int, failed: dict[str, str]) -> None:
        if self.halted:
            failed.update((j, "not sent: the run stopped") for j in ids)
            return
        with self._lock:
            self.calls += 1
        try:
            self.client.set_site_factors(ids, value)
        except SlurmCommandError as e:
            with self._lock:
                if len(ids) == 1:
                    failed[ids[0]] = str(e)
                    self._failures += 1
                    return
                if self._failures >= MAX_BISECTED_FAILURES:
                    note = f" (one command for {len(ids)} jobs; not retried one by one after {self._failures} failures)"
                    failed.update((j, f"scontrol exited with {e.returncode}: {e.stderr.strip()}{note}") for j in ids)
                    self._failures += len(ids)
                    return
            half = len(ids) // 2
            self._settle(ids[:half], value, failed)
            self._settle(ids[half:], value, failed)


class _StopOnSignal:
    """SIGTERM and SIGINT while apply runs: the run stops between batches (``signal`` set, ``sender`` halted, the
    main thread woken). On leaving, the signal goes on to the handler it interrupted: a callable one is called (the
    watch daemon's stop); the default one ends the process as the signal asks, unless an error is on its way out.
    A second signal acts at once. Only the main thread takes signals: elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, wake: queue.SimpleQueue[Any], sender: _Sender) -> None:
        self.signal: int | None = None
        self._wake, self._sender = wake, sender
        self._previous: dict[int, Any] = {}
        self._installed = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._caught) for s in self.SIGNALS}
            self._installed = True
        return self

    def _restore(self) -> None:
        if self._installed:
            for s, h in self._previous.items():
                signal.signal(s, signal.SIG_DFL if h is None else h)
            self._installed = False

    def _caught(self, signum: int, frame: object) -> None:
        # plain assignments and SimpleQueue.put only: this may run in the middle of any line of the main thread
        if self.signal is None:
            self.signal = signum
            self._sender.halted = True
            self._restore()
        self._wake.put(None)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._restore()
        if self.signal is None:
            return
        previous = self._previous.get(self.signal)
        if previous is signal.default_int_handler and exc_type is not None:
            return  # its KeyboardInterrupt would replace the error on its way out (and its one line)
        if callable(previous):
            previous(self.signal, None)
        elif previous in (signal.SIG_DFL, None) and exc_type is None:
            signal.raise_signal(self.signal)


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
    record: Callable[[Sequence[dict[str, Any]]], object] | None = None,
    now: float | None = None,
    max_arg_bytes: int = MAX_ARG_BYTES,
    parallel: int = PARALLEL,
) -> tuple[Plan, Applied]:
    """The whole cycle against a live cluster: squeue, sprio, plan, scontrol."""
    pending = client.pending_jobs()
    plan = plan_changes(pending, feed_entries, client.site_factors(), now=now)
    return plan, apply_changes(client, plan.changes, dry_run, record, max_arg_bytes, parallel,
                               {job.job_id: job.sprio_id for job in pending})
