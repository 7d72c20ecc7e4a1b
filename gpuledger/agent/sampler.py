"""The agent's loop: sample the GPUs, attach jobs, keep a snapshot for /metrics, hand the batch to sinks.

One bad source read, mapper or sink costs that step of that tick, never the daemon: errors are counted
by kind (``source``, ``mapper``, ``sink``, ``internal``) and each distinct error is logged once, in one line
where it is operational (a backend down, a file unreadable: ``OSError``, a source's ``SourceUnavailable``, the
pusher's ``PushError``), with its traceback where it is a bug (``internal``, or any other exception).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gpuledger.agent.mappers.base import JobMapper
from gpuledger.agent.push import PushError
from gpuledger.agent.sources.base import GpuSource, SourceUnavailable
from gpuledger.schema.records import GpuSample, JobRecord

log = logging.getLogger(__name__)

ERROR_KINDS: tuple[str, ...] = ("source", "mapper", "sink", "internal")
# Distinct errors remembered for "log once"; bounded so errors with ever-changing text cannot grow memory.
_MAX_SEEN_ERRORS = 1024
# What the sources, mappers and sinks raise for a backend down or a file unreadable: no traceback helps there.
# Not RuntimeError: its other kinds (RecursionError, NotImplementedError) are bugs, whose traceback is wanted.
_OPERATIONAL = (OSError, SourceUnavailable, PushError)
# (host, GPU index, GPU UUID, MIG instance or "")
XidKey = tuple[str, int, str, str]


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
        # Xids per GPU since the agent started: those the samples carried, and those the source holds for a GPU
        # lost before its next sample (``held_xids``); replaced wholesale each tick, so a scrape never sees the
        # count step back while held Xids move into a sample. The model is the one the GPU had at its first Xid,
        # so the series keeps its labels when the GPU drops out of the snapshot.
        self.xid_errors_total: dict[XidKey, int] = {}
        self.xid_models: dict[XidKey, str] = {}
        self._xids_sampled: dict[XidKey, int] = {}
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
        self._count_xids(samples)
        if samples:
            for sink in self.sinks:
                try:
                    sink.write(samples)
                except Exception as exc:  # noqa: BLE001 - one sink's failure must not starve the others
                    self._record_error("sink", type(sink).__name__, exc)
        self.ticks_total += 1
        self.last_tick_seconds = self._monotonic() - started
        return samples

    def _count_xids(self, samples: Sequence[GpuSample]) -> None:
        """Cumulative Xids per GPU (:attr:`xid_errors_total`), so /metrics can export them as a counter. A key's
        model is set before its count appears (a reader on another thread finds it) and never changes."""
        for s in samples:
            if s.xid_errors:
                key = (s.host, s.gpu_index, s.gpu_uuid, s.mig or "")
                self._xids_sampled[key] = self._xids_sampled.get(key, 0) + len(s.xid_errors)
                self.xid_models.setdefault(key, s.model)
        total = dict(self._xids_sampled)
        held = getattr(self.source, "held_xids", None)
        try:
            held_now = list(held()) if callable(held) else []
        except Exception as exc:  # noqa: BLE001 - the tick's samples still go to the sinks
            self._record_error("source", f"{type(self.source).__name__}.held_xids", exc)
            # held ones unknown this tick: no count steps back, none goes beyond what was known
            prev = self.xid_errors_total
            self.xid_errors_total = {k: max(total.get(k, 0), prev.get(k, 0)) for k in {*total, *prev}}
            return
        for key, model, n in held_now:
            total[key] = total.get(key, 0) + n
            self.xid_models.setdefault(key, model)
        self.xid_errors_total = total

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
        bug = kind == "internal" or not isinstance(exc, _OPERATIONAL)
        log.error("%s error in %s: %s: %s", kind, where, type(exc).__name__, exc, exc_info=exc if bug else None)
