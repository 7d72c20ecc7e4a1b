"""`gpuledger priority watch`: keep pending jobs' site factors fresh as jobs end.

The daemon polls every ``poll_s`` seconds. A poll asks ``ledger_state()`` for a cheap fingerprint of the ledger
(what changes when a job-end record or usage arrives); when it changed, or ``resync_s`` passed since the last
cycle (pending jobs submitted meanwhile on a default account need their factor too), it runs one cycle:
recompute the feed from the ledger, write it, apply it to the pending jobs. Cycles start at most every
``min_interval_s`` seconds, so a busy ledger costs one cycle per interval, not one per record.

What a cycle does is the ``cycle`` callable (the CLI builds it from the feed and apply code); this module only
decides when, keeps going, and measures. A cycle that raises is logged and counted, and the next poll tries
again: one failed cycle never ends the daemon.

Metrics (Prometheus, on ``--metrics-port``):

- ``gpuledger_priority_lag_seconds``: for the last cycle that took in newly ended jobs, the time from the newest
  such job's end to the moment its factors were applied (the freshness target: at most 60 s);
- ``gpuledger_priority_cycle_duration_seconds``, ``gpuledger_priority_cycles_total{result}``,
  ``gpuledger_priority_last_success_timestamp_seconds``, ``gpuledger_priority_jobs_changed_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("gpuledger.priority.watch")

__all__ = ["CycleResult", "PriorityWatch"]


@dataclass(frozen=True, slots=True)
class CycleResult:
    newest_end: float | None  # end time (unix s) of the newest ended job whose charge the feed includes
    changed: int  # jobs whose factor was set
    failed: int  # jobs scontrol refused


class PriorityWatch:
    def __init__(
        self,
        cycle: Callable[[], CycleResult],
        ledger_state: Callable[[], Hashable],
        poll_s: float = 5.0,
        min_interval_s: float = 10.0,
        resync_s: float = 300.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        if poll_s <= 0 or min_interval_s < 0 or resync_s <= 0:
            raise ValueError("poll_s and resync_s must be > 0, min_interval_s >= 0")
        self._cycle = cycle
        self._ledger_state = ledger_state
        self.poll_s, self.min_interval_s, self.resync_s = poll_s, min_interval_s, resync_s
        self._clock = clock
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._last_state: Hashable = object()  # equals nothing: the first poll runs a cycle
        self._last_start = float("-inf")
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
        for result in ("ok", "partial", "failed"):
            self.cycles.labels(result)

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> bool:
        """One poll: run a cycle if the ledger changed or a resync is due (and the interval allows). Returns
        whether a cycle ran. Never raises for a failed cycle."""
        now = self._clock()
        if now - self._last_start < self.min_interval_s:
            return False
        try:
            state = self._ledger_state()
        except Exception:
            log.exception("reading the ledger's state failed; running a cycle anyway")
            state = object()
        if state == self._last_state and now - self._last_start < self.resync_s:
            return False
        self._last_start = now
        try:
            result = self._cycle()
        except Exception:
            self.cycles.labels("failed").inc()
            self.duration.set(self._clock() - now)
            log.exception("priority cycle failed; retrying at the next poll")
            return True
        done = self._clock()
        self._last_state = state
        self.duration.set(done - now)
        self.changed.inc(result.changed)
        self.cycles.labels("partial" if result.failed else "ok").inc()
        self.last_success.set(done)
        if result.newest_end is not None and (self._newest_end is None or result.newest_end > self._newest_end):
            if self._caught_up:  # the first cycle catches up on history: no lag to speak of
                self.lag.set(max(0.0, done - result.newest_end))
            self._newest_end = result.newest_end
        self._caught_up = True
        log.info("priority cycle: %d job(s) changed, %d failed, %.2f s", result.changed, result.failed,
                 done - now)
        return True

    def run(self) -> None:
        """Poll until :meth:`stop`."""
        while not self._stop.is_set():
            self.poll()
            self._sleep(self.poll_s)
