"""`gpuledger priority watch`: keep pending jobs' site factors fresh as jobs end.

The daemon polls every ``poll_s`` seconds. A poll first imports the jobs that ended (``import_jobs``, when given),
and, at most every ``running_every_s``, the records of the jobs running now (``import_running``: so that a running
job counts as Slurm describes it, not as its agents do, and never in a period closed before it ends), then asks
``ledger_state()`` for a cheap fingerprint of the ledger (what changes when a job-end record or usage arrives); when
it changed, or ``resync_s`` passed since the feed was last computed (pending jobs submitted
meanwhile on a default account need their factor too), it runs one cycle: ``compute()`` the feed from the ledger
(which records it in the audit log), then ``apply(feed)`` (write it, apply it to the pending jobs). Cycles start
at most every ``min_interval_s`` seconds, so a busy ledger costs one cycle per interval, not one per record.

A failed import does not force a cycle: the ledger's fingerprint says whether anything arrived. A failed import of
running jobs is tried again ``running_every_s`` later, as a successful one is. A failed apply
is retried at the next poll with the feed already computed (and recorded), which is recomputed only when the
ledger changed or a resync is due: an outage of sacct or slurmctld adds no audit entry per retry. A step that
raises is logged (one line for an expected failure, a traceback for any other) and counted, and the next poll
tries again: one failed cycle never ends the daemon. After :meth:`stop` no step starts: neither the feed (no
fairshare entry) nor the apply (no scontrol command).

Scheduling (interval, resync) runs on the monotonic clock, so a wall-clock step neither stalls nor hurries it;
the wall clock dates the metrics only.

Metrics (Prometheus, on ``--metrics-port``):

- ``gpuledger_priority_lag_seconds``: for the last cycle that took in newly ended jobs, the time from the newest
  such job's end to the moment its factors were applied (the freshness target: at most 60 s);
- ``gpuledger_priority_cycle_duration_seconds``, ``gpuledger_priority_cycles_total{result}`` (``ok``;
  ``partial``: a job scontrol refused, or the poll's import failed, so the feed may lack job ends or charge a
  running job as its agents describe it; ``failed``),
  ``gpuledger_priority_last_success_timestamp_seconds``, ``gpuledger_priority_jobs_changed_total``;
- ``gpuledger_priority_import_failures_total``, ``gpuledger_priority_last_import_timestamp_seconds``;
- ``gpuledger_priority_running_import_failures_total``, ``gpuledger_priority_last_running_import_timestamp_seconds``
  (the import of running jobs, counted as the import of ended jobs is).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuledger.output import os_error

log = logging.getLogger("gpuledger.priority.watch")

__all__ = ["CycleError", "CycleResult", "PriorityWatch", "Stopped"]


@dataclass(frozen=True, slots=True)
class CycleResult:
    newest_end: float | None  # end time (unix s) of the newest ended job whose charge the feed includes
    changed: int  # jobs whose factor was set
    failed: int  # jobs scontrol refused


class CycleError(Exception):
    """An expected failure of a step whose reason the message (or a line printed before) gives: logged as one
    line."""


class Stopped(Exception):
    """:meth:`PriorityWatch.stop` was called part way through a step: what is left of it is not started."""


def _one_line(e: BaseException) -> str:
    return " ".join((os_error(e) if isinstance(e, OSError) else str(e) or type(e).__name__).split())


class PriorityWatch:
    def __init__(
        self,
        compute: Callable[[], Any],
        apply: Callable[[Any], CycleResult],
        ledger_state: Callable[[], Hashable],
        import_jobs: Callable[[], object] | None = None,
        import_running: Callable[[], object] | None = None,
        running_every_s: float = 60.0,
        poll_s: float = 5.0,
        min_interval_s: float = 10.0,
        resync_s: float = 300.0,
        expected: tuple[type[Exception], ...] = (OSError,),
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        if poll_s <= 0 or min_interval_s < 0 or resync_s <= 0 or not running_every_s > 0:
            raise ValueError("poll_s, resync_s and running_every_s must be > 0, min_interval_s >= 0")
        self._compute, self._apply, self._ledger_state, self._import = compute, apply, ledger_state, import_jobs
        self._import_running, self.running_every_s = import_running, running_every_s
        self._last_running = float("-inf")  # monotonic: the last import of running jobs tried
        self.poll_s, self.min_interval_s, self.resync_s = poll_s, min_interval_s, resync_s
        self._expected: tuple[type[Exception], ...] = (CycleError, *expected)
        self._clock, self._monotonic = clock, monotonic
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._last_state: Hashable = object()  # equals nothing: the first poll runs a cycle
        self._last_start = float("-inf")  # monotonic: the last cycle's start
        self._last_feed = float("-inf")  # monotonic: when the feed was last computed
        self._feed: Any = None  # a computed (and recorded) feed not yet applied; compute() never returns None
        self._newest_end: float | None = None
        self._caught_up = False
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lag = Gauge("gpuledger_priority_lag_seconds",
                         "Newest job end taken in by the last cycle that saw new job ends, to its factors applied",
                         registry=r)
        self.duration = Gauge("gpuledger_priority_cycle_duration_seconds", "Duration of the last cycle",
                              registry=r)
        self.cycles = Counter("gpuledger_priority_cycles", "Priority cycles run", ["result"], registry=r)
        self.last_success = Gauge("gpuledger_priority_last_success_timestamp_seconds",
                                  "When the last successful cycle ended", registry=r)
        self.changed = Counter("gpuledger_priority_jobs_changed", "Pending jobs whose site factor was set",
                               registry=r)
        # only where this daemon imports (a timestamp that stays 0 would make the alert fire on a healthy daemon)
        self.import_failures: Counter | None = None
        self.last_import: Gauge | None = None
        if import_jobs is not None:
            self.import_failures = Counter("gpuledger_priority_import_failures", "Imports of ended jobs that failed",
                                           registry=r)
            self.last_import = Gauge("gpuledger_priority_last_import_timestamp_seconds",
                                     "When the last successful import of ended jobs ended", registry=r)
        self.running_import_failures: Counter | None = None
        self.last_running_import: Gauge | None = None
        if import_running is not None:
            self.running_import_failures = Counter("gpuledger_priority_running_import_failures",
                                                   "Imports of running jobs that failed", registry=r)
            self.last_running_import = Gauge("gpuledger_priority_last_running_import_timestamp_seconds",
                                             "When the last successful import of running jobs ended", registry=r)
        for result in ("ok", "partial", "failed"):
            self.cycles.labels(result)

    def stop(self) -> None:
        self._stop.set()

    def stopped(self) -> bool:
        return self._stop.is_set()

    def _failed(self, what: str, e: Exception) -> None:
        if isinstance(e, self._expected):
            log.error("%s: %s", what, _one_line(e))
        else:
            log.exception("%s", what)

    def _imported(self, step: Callable[[], object], last: Gauge, failures: Counter, failed: str) -> bool:
        """Run one import ``step``: whether it succeeded (``last`` dated) or failed (counted, logged with
        ``failed``); Stopped goes to the caller."""
        try:
            step()
        except Stopped:
            raise
        except Exception as e:
            failures.inc()
            self._failed(failed, e)
            return False
        last.set(self._clock())
        return True

    def poll(self) -> bool:
        """One poll: import, then run a cycle if the ledger changed, a resync is due or a computed feed is still
        to be applied (and the interval allows). Returns whether a cycle ran. Never raises for a failed step."""
        now = self._monotonic()
        if now - self._last_start < self.min_interval_s:
            return False
        imported = True
        try:
            if self._import is not None and self.last_import is not None and self.import_failures is not None:
                imported = self._imported(self._import, self.last_import, self.import_failures,
                                          "importing ended jobs failed; the ledger's other changes still count")
            if (self._import_running is not None and self.last_running_import is not None
                    and self.running_import_failures is not None and not self.stopped()
                    and now - self._last_running >= self.running_every_s):
                # tried again a cadence later, failed or not: an outage of slurmdbd gets no call of all the running
                # jobs every poll
                self._last_running = now
                if not self._imported(self._import_running, self.last_running_import, self.running_import_failures,
                                      f"importing running jobs failed; trying again in {self.running_every_s:g} s"):
                    imported = False
        except Stopped:
            return False
        if self.stopped():
            return False
        try:
            state = self._ledger_state()
        except Exception as e:
            self._failed("reading the ledger's state failed; running a cycle anyway", e)
            state = object()
        recompute = state != self._last_state or now - self._last_feed >= self.resync_s
        if not recompute and self._feed is None:
            return False
        self._last_start = now
        step = "the feed"
        try:
            if recompute:
                if self.stopped():
                    raise Stopped
                self._feed = self._compute()
                self._last_state, self._last_feed = state, now
            if self.stopped():
                raise Stopped
            step = "the apply, with the feed computed"
            result = self._apply(self._feed)
        except Stopped:
            log.info("stopped: the rest of the cycle is not started")
            return True
        except Exception as e:
            self.cycles.labels("failed").inc()
            self.duration.set(self._monotonic() - now)
            self._failed(f"priority cycle failed ({step}); retrying at the next poll", e)
            return True
        self._feed = None
        took = self._monotonic() - now
        done = self._clock()
        self.duration.set(took)
        self.changed.inc(result.changed)
        self.cycles.labels("partial" if result.failed or not imported else "ok").inc()
        self.last_success.set(done)
        if result.newest_end is not None and (self._newest_end is None or result.newest_end > self._newest_end):
            if self._caught_up:  # the first cycle catches up on history: no lag to speak of
                self.lag.set(max(0.0, done - result.newest_end))
            self._newest_end = result.newest_end
        self._caught_up = True
        log.info("priority cycle: %d job(s) changed, %d failed, %.2f s%s", result.changed, result.failed, took,
                 "" if imported else " (an import of jobs failed)")
        return True

    def run(self) -> None:
        """Poll until :meth:`stop`."""
        while not self._stop.is_set():
            self.poll()
            self._sleep(self.poll_s)
