"""The agent's loop: sample the GPUs, attach jobs, keep a snapshot for /metrics, hand the batch to sinks.

One bad source read, mapper or sink costs that step of that tick, never the daemon: errors are counted
by kind (``source``, ``mapper``, ``sink``, ``internal``) and each distinct error is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gpuledger.agent.mappers.base import JobMapper
from gpuledger.agent.sources.base import GpuSource
from gpuledger.schema.records import GpuSample, JobRecord

log = logging.getLogger(__name__)

ERROR_KINDS: tuple[str, ...] = ("source", "mapper", "sink", "internal")
# Distinct errors remembered for "log once"; bounded so errors with ever-changing text cannot grow memory.
_MAX_SEEN_ERRORS = 1024


class SampleSink(Protocol):
    def write(self, samples: Sequence[GpuSample]) -> None: ...


class Agent:
    """Ties a source, job mappers and sinks together; ``snapshot`` is the latest mapped batch."""

    def __init__(
        self,
        source: GpuSource,
        mappers: Sequence[JobMapper] = (),
        clock: Callable[[], float] = time.time,
        sinks: Sequence[SampleSink] = (),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.mappers = tuple(mappers)
        self.sinks = tuple(sinks)
        self._clock = clock
        self._monotonic = monotonic
        # Replaced wholesale each tick (never mutated), so readers on other threads see a whole batch.
        self.snapshot: list[GpuSample] = []
        self.sampled: list[GpuSample] = []  # the source's readings of the snapshot, before the mappers (MIG: device's)
        self.xid_errors_total: dict[tuple[str, int, str, str], int] = {}
        self.ticks_total = 0
        self.errors_total: dict[str, int] = {k: 0 for k in ERROR_KINDS}
        self.last_tick_seconds: float | None = None  # duration of the last tick
        self.last_tick_ts: float | None = None  # clock() when the last tick started
        self._seen_errors: set[tuple[str, str, str]] = set()
        # Job metadata of the jobs the mappers see now (user, account, GPUs, ...), and what was handed to the sinks of
        # those: a job gone is forgotten, so memory and each tick's cost follow the jobs on the node, not its history
        # (the sinks keep a record until a batch carries it).
        self.jobs: dict[str, JobRecord] = {}
        self._jobs_sent: dict[str, JobRecord] = {}

    def open(self) -> None:
        self.source.open()

    def close(self) -> None:
        """Close the source and any sink that has ``close()``; errors are logged, not raised."""
        for thing in (self.source, *self.sinks):
            close = getattr(thing, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - shutting down: report and go on
                log.warning("closing %s failed: %s", type(thing).__name__, exc)

    def tick(self) -> list[GpuSample]:
        """One step: sample, map, keep as snapshot, write to sinks. Never raises for a failing part."""
        started = self._monotonic()
        self.last_tick_ts = self._clock()
        try:
            samples = list(self.source.sample())
        except Exception as exc:  # noqa: BLE001 - a source failure must not end the daemon
            self._record_error("source", type(self.source).__name__, exc)
            # No data is honest: a stale snapshot would export old values as current.
            samples = []
        else:
            self.sampled = samples
            for mapper in self.mappers:
                try:
                    samples = list(mapper.map(samples))
                except Exception as exc:  # noqa: BLE001 - skip this mapper, keep the samples
                    self._record_error("mapper", type(mapper).__name__, exc)
        if not samples:
            self.sampled = []
        self.snapshot = samples
        self._collect_jobs()
        for s in samples:  # cumulative per GPU, so /metrics can export Xids as a counter
            if s.xid_errors:
                key = (s.host, s.gpu_index, s.gpu_uuid, s.mig or "")
                self.xid_errors_total[key] = self.xid_errors_total.get(key, 0) + len(s.xid_errors)
        if samples:
            for sink in self.sinks:
                try:
                    sink.write(samples)
                except Exception as exc:  # noqa: BLE001 - one sink's failure must not starve the others
                    self._record_error("sink", type(sink).__name__, exc)
        self.ticks_total += 1
        self.last_tick_seconds = self._monotonic() - started
        return samples

    def _collect_jobs(self) -> None:
        """Job metadata from the mappers that know it; new or changed records go to sinks that carry them,
        so samples can be accounted without a later join with Slurm."""
        jobs: dict[str, JobRecord] = {}
        for mapper in self.mappers:
            meta = getattr(mapper, "job_metadata", None)
            if meta is None:
                continue
            try:
                jobs.update(meta())
            except Exception as exc:  # noqa: BLE001 - metadata is a bonus; the samples still go out
                self._record_error("mapper", f"{type(mapper).__name__}.job_metadata", exc)
                jobs = {**self.jobs, **jobs}  # that mapper's jobs are not known to be gone: kept this tick
        self.jobs = jobs
        self._jobs_sent = {j: r for j, r in self._jobs_sent.items() if j in jobs}
        changed = [r for j, r in jobs.items() if self._jobs_sent.get(j) != r]
        if not changed:
            return
        for sink in self.sinks:
            write_jobs = getattr(sink, "write_jobs", None)
            if write_jobs is not None:
                try:
                    write_jobs(changed)
                except Exception as exc:  # noqa: BLE001 - as for samples: one sink's failure is its own
                    self._record_error("sink", f"{type(sink).__name__}.write_jobs", exc)
        self._jobs_sent.update((r.job_id, r) for r in changed)

    def run(self, interval_s: float, stop: threading.Event, max_ticks: int | None = None) -> None:
        """Tick every ``interval_s`` seconds on a fixed schedule until ``stop`` is set (or after ``max_ticks``)."""
        if not interval_s > 0:
            raise ValueError(f"agent: interval_s must be positive, got {interval_s!r}")
        next_at = self._monotonic()
        done = 0
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a bug in tick itself still must not end the loop
                self._record_error("internal", "Agent.tick", exc)
            done += 1
            if max_ticks is not None and done >= max_ticks:
                return
            next_at += interval_s
            now = self._monotonic()
            if next_at < now:
                # Fell behind (slow source, suspended host): skip the missed ticks rather than burst.
                next_at = now + interval_s - ((now - next_at) % interval_s)
            # Waiting on the event, not time.sleep, so stop() takes effect at once.
            stop.wait(next_at - now)

    def _record_error(self, kind: str, where: str, exc: BaseException) -> None:
        self.errors_total[kind] = self.errors_total.get(kind, 0) + 1
        key = (kind, type(exc).__name__, str(exc))
        if key in self._seen_errors:
            log.debug("%s error in %s (repeated): %s", kind, where, exc)
            return
        if len(self._seen_errors) < _MAX_SEEN_ERRORS:
            self._seen_errors.add(key)
        log.error("%s error in %s: %s: %s", kind, where, type(exc).__name__, exc, exc_info=exc)
