"""Streaming per-(job, host, GPU) aggregation, exact under duplicates, late samples, resets and gaps.

Per GPU key ``(host, gpu_uuid, mig)`` the recent samples are kept sorted by time. Usage is a sum of
contributions of consecutive pairs ``(prev, cur)``: the interval ``cur.ts - prev.ts`` belongs to
``cur``'s jobs, split by ``cur.job_shares`` (equally when empty). Because usage is such a sum, a late
sample landing between ``prev`` and ``next`` is exact: subtract ``(prev, next)``, add ``(prev, late)``
and ``(late, next)``. Peaks, counts and first/last times only grow, so they need no undo.

Rules (documented here because accounting depends on them):

* An interval longer than ``max_gap_s`` is a gap: the GPU was not observed, so it yields no
  GPU-seconds and no power integral; an energy-counter delta across it is still exact and is kept.
* Energy: the counter delta when both samples carry the counter; a counter that went backwards was
  reset (driver reload), so the energy since the reset is ``cur.energy_joules``; never negative.
  Power is integrated (``cur.power_watts * dt``) only where a counter is missing.
* MIG instances: power and energy exist only for the whole GPU. Sources put them on the whole-GPU
  sample only (dcgm-exporter's copies on every instance are merged once), and the agent's
  ``agent.mig.MigEnergySplitter`` then moves them onto the instances (a virtual counter each, summing
  to the GPU's energy) and strips them from the whole-GPU sample. So energy is counted wherever a
  sample carries it, and a GPU's energy is never counted twice.
* A sample older than ``watermark - window_s`` of its GPU is rejected as ``too_late``; a second
  sample of a GPU at the same instant is a ``duplicate`` and ignored (first one wins).
* Time-weighted means weight each interval by the job's GPU-seconds in it (``dt * share``) and only
  where the source reported the value.

In-order samples cost O(1) amortised; a late sample costs a bisect plus a list insert in its window.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.records import GpuSample, JobUsage

GpuKey = tuple[str, str, str]  # (host, gpu_uuid, mig or "")
UsageKey = tuple[str, str, str]  # (job_id, host, gpu_id) where gpu_id is uuid or "uuid/mig"
HourKey = tuple[str, str, str, float]  # GpuKey + bucket start (unix seconds)

HOUR_S = 3600.0

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
TOO_LATE = "too_late"


def gpu_key(s: GpuSample) -> GpuKey:
    return (s.host, s.gpu_uuid, s.mig or "")


def gpu_id(uuid: str, mig: str) -> str:
    """The GPU name in usage records: the UUID, or ``uuid/mig`` for a MIG instance."""
    return f"{uuid}/{mig}" if mig else uuid


class UsageAcc:
    """Running sums of one job on one GPU. Mirrors a row of the store's usage table."""

    __slots__ = (
        "first_ts", "last_ts", "samples", "alloc_s", "sm_s", "energy_j",
        "sm_sum", "sm_w", "dram_sum", "dram_w", "tensor_sum", "tensor_w", "occ_sum", "occ_w",
        "mem_peak", "power_peak", "model",
    )
    FIELDS: tuple[str, ...] = __slots__

    def __init__(self) -> None:
        self.first_ts = math.inf
        self.last_ts = -math.inf
        self.samples = 0
        self.alloc_s = self.sm_s = self.energy_j = 0.0
        self.sm_sum = self.sm_w = self.dram_sum = self.dram_w = 0.0
        self.tensor_sum = self.tensor_w = self.occ_sum = self.occ_w = 0.0
        self.mem_peak: int | None = None
        self.power_peak: float | None = None
        self.model = ""

    def values(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    @classmethod
    def from_values(cls, values: Iterable) -> UsageAcc:
        acc = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(acc, f, v)
        return acc


class HourAcc:
    """One GPU's totals in one hour bucket (an interval belongs to the bucket of its end)."""

    __slots__ = ("observed_s", "energy_j", "alloc_s", "sm_s", "samples")
    FIELDS: tuple[str, ...] = __slots__

    def __init__(self) -> None:
        self.observed_s = self.energy_j = self.alloc_s = self.sm_s = 0.0
        self.samples = 0

    def values(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    @classmethod
    def from_values(cls, values: Iterable) -> HourAcc:
        acc = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(acc, f, v)
        return acc


class GpuState:
    """One GPU's recent samples (sorted) and its all-time totals."""

    __slots__ = ("ts", "samples", "start", "watermark", "first_ts", "n", "observed_s", "energy_j", "model")
    TOTAL_FIELDS: tuple[str, ...] = ("first_ts", "watermark", "n", "observed_s", "energy_j", "model")

    def __init__(self) -> None:
        self.ts: list[float] = []
        self.samples: list[GpuSample] = []
        self.start = 0  # samples before this index are evicted (kept until compaction)
        self.watermark = -math.inf  # newest ts seen
        self.first_ts = math.inf
        self.n = 0
        self.observed_s = 0.0
        self.energy_j = 0.0
        self.model = ""

    def totals(self) -> tuple:
        return tuple(getattr(self, f) for f in self.TOTAL_FIELDS)


@dataclass(frozen=True, slots=True)
class AddCounts:
    accepted: int = 0
    duplicate: int = 0
    too_late: int = 0


def _shares(s: GpuSample) -> tuple[float, ...]:
    if s.job_shares:
        return s.job_shares
    n = len(s.job_ids)
    return (1.0 / n,) * n if n else ()


class Aggregator:
    """In-memory streaming aggregation; the store persists what :meth:`take_dirty` names.

    ``load_usage`` / ``load_hour`` fetch an accumulator that is not in memory (from the store), so
    memory holds only the window and what it touches; the defaults start every key from zero.
    """

    def __init__(
        self,
        window_s: float = 600.0,
        max_gap_s: float = 300.0,
        load_usage: Callable[[UsageKey], UsageAcc | None] | None = None,
        load_hour: Callable[[HourKey], HourAcc | None] | None = None,
    ) -> None:
        if not window_s >= 0 or not max_gap_s > 0:
            raise ValueError(f"window_s must be >= 0 and max_gap_s > 0, got {window_s!r}, {max_gap_s!r}")
        self.window_s = float(window_s)
        self.max_gap_s = float(max_gap_s)
        self._load_usage = load_usage or (lambda k: None)
        self._load_hour = load_hour or (lambda k: None)
        self.gpus: dict[GpuKey, GpuState] = {}
        self.usage: dict[UsageKey, UsageAcc] = {}
        self.hours: dict[HourKey, HourAcc] = {}
        self.dirty_usage: set[UsageKey] = set()
        self.dirty_gpus: set[GpuKey] = set()
        self.dirty_hours: set[HourKey] = set()

    # -- accumulators -------------------------------------------------------------------------
    def _usage(self, key: UsageKey) -> UsageAcc:
        acc = self.usage.get(key)
        if acc is None:
            acc = self._load_usage(key) or UsageAcc()
            self.usage[key] = acc
        self.dirty_usage.add(key)
        return acc

    def _hour(self, key: HourKey) -> HourAcc:
        acc = self.hours.get(key)
        if acc is None:
            acc = self._load_hour(key) or HourAcc()
            self.hours[key] = acc
        self.dirty_hours.add(key)
        return acc

    def _apply_pair(self, gk: GpuKey, g: GpuState, prev: GpuSample, cur: GpuSample, sign: float) -> None:
        """Add (sign=+1) or remove (sign=-1) the contribution of the interval (prev, cur]."""
        dt = cur.ts - prev.ts
        observed = dt <= self.max_gap_s
        gpu_s = dt if observed else 0.0
        energy = 0.0
        pe, ce = prev.energy_joules, cur.energy_joules
        if pe is not None and ce is not None:
            energy = ce - pe if ce >= pe else ce  # backwards = reset: energy since the reset
        elif observed and cur.power_watts is not None:
            energy = cur.power_watts * dt
        if gpu_s == 0.0 and energy == 0.0:
            return
        g.observed_s += sign * gpu_s
        g.energy_j += sign * energy
        hour = self._hour((gk[0], gk[1], gk[2], math.floor(cur.ts / HOUR_S) * HOUR_S))
        hour.observed_s += sign * gpu_s
        hour.energy_j += sign * energy
        if not cur.job_ids:
            return
        sm, dram, ten, occ = cur.sm_active_ratio, cur.dram_bw_ratio, cur.tensor_active_ratio, cur.sm_occupancy_ratio
        gid = gpu_id(gk[1], gk[2])
        for job, share in zip(cur.job_ids, _shares(cur)):
            acc = self._usage((job, gk[0], gid))
            w = sign * gpu_s * share
            acc.alloc_s += w
            hour.alloc_s += w
            acc.energy_j += sign * energy * share
            if sm is not None:
                acc.sm_s += sm * w
                hour.sm_s += sm * w
                acc.sm_sum += sm * w
                acc.sm_w += w
            if dram is not None:
                acc.dram_sum += dram * w
                acc.dram_w += w
            if ten is not None:
                acc.tensor_sum += ten * w
                acc.tensor_w += w
            if occ is not None:
                acc.occ_sum += occ * w
                acc.occ_w += w

    def _apply_point(self, gk: GpuKey, g: GpuState, s: GpuSample) -> None:
        """Per-sample statistics (counts, first/last, peaks): monotone, so never undone."""
        g.n += 1
        if s.ts < g.first_ts:
            g.first_ts = s.ts
        if s.model:
            g.model = s.model
        self._hour((gk[0], gk[1], gk[2], math.floor(s.ts / HOUR_S) * HOUR_S)).samples += 1
        self.dirty_gpus.add(gk)
        if not s.job_ids:
            return
        gid = gpu_id(gk[1], gk[2])
        for job in s.job_ids:
            acc = self._usage((job, gk[0], gid))
            acc.samples += 1
            if s.ts < acc.first_ts:
                acc.first_ts = s.ts
            if s.ts > acc.last_ts:
                acc.last_ts = s.ts
                if s.model:
                    acc.model = s.model
            if s.mem_used_bytes is not None and (acc.mem_peak is None or s.mem_used_bytes > acc.mem_peak):
                acc.mem_peak = s.mem_used_bytes
            if s.power_watts is not None and (acc.power_peak is None or s.power_watts > acc.power_peak):
                acc.power_peak = s.power_watts

    # -- ingest -------------------------------------------------------------------------------
    def add(self, s: GpuSample) -> str:
        """Fold one sample in; returns ACCEPTED, DUPLICATE or TOO_LATE."""
        gk = (s.host, s.gpu_uuid, s.mig or "")
        g = self.gpus.get(gk)
        if g is None:
            g = self.gpus[gk] = GpuState()
        ts = s.ts
        if ts > g.watermark:  # the hot path: in order
            if g.samples:
                self._apply_pair(gk, g, g.samples[-1], s, 1.0)
            g.ts.append(ts)
            g.samples.append(s)
            g.watermark = ts
            self._apply_point(gk, g, s)
            self._evict(g)
            return ACCEPTED
        if ts < g.watermark - self.window_s:
            return TOO_LATE
        i = bisect_left(g.ts, ts, g.start)
        if g.ts[i] == ts:  # i < len because ts <= watermark == g.ts[-1]
            return DUPLICATE
        nxt = g.samples[i]
        prev = g.samples[i - 1] if i > 0 else None
        if prev is not None:
            self._apply_pair(gk, g, prev, nxt, -1.0)
            self._apply_pair(gk, g, prev, s, 1.0)
        self._apply_pair(gk, g, s, nxt, 1.0)
        g.ts.insert(i, ts)
        g.samples.insert(i, s)
        self._apply_point(gk, g, s)
        return ACCEPTED

    def add_many(self, samples: Iterable[GpuSample]) -> tuple[AddCounts, list[GpuSample]]:
        """Fold samples in time order (so the outcome does not depend on order within a batch).

        Returns the counts and the accepted samples (the ones to store raw).
        """
        accepted: list[GpuSample] = []
        dup = late = 0
        for s in sorted(samples, key=lambda x: x.ts):
            r = self.add(s)
            if r is ACCEPTED:
                accepted.append(s)
            elif r is DUPLICATE:
                dup += 1
            else:
                late += 1
        return AddCounts(len(accepted), dup, late), accepted

    def _evict(self, g: GpuState) -> None:
        # Keep every sample inside the window plus one before it (the "anchor"), which is the prev
        # of any late sample that can still be accepted.
        limit = g.watermark - self.window_s
        ts, start, n = g.ts, g.start, len(g.ts)
        while start + 1 < n and ts[start + 1] < limit:
            start += 1
        if start > 256 and start * 2 > n:  # compact now and then: amortised O(1)
            del g.ts[:start]
            del g.samples[:start]
            start = 0
        g.start = start

    # -- persistence hooks --------------------------------------------------------------------
    def restore_gpu(self, gk: GpuKey, totals: tuple, recent: list[GpuSample]) -> None:
        """Install a GPU's totals and its recent samples (the window plus the anchor) from storage."""
        g = GpuState()
        for f, v in zip(GpuState.TOTAL_FIELDS, totals, strict=True):
            setattr(g, f, v)
        recent = sorted(recent, key=lambda x: x.ts)
        g.ts = [s.ts for s in recent]
        g.samples = list(recent)
        self.gpus[gk] = g
        self._evict(g)

    def take_dirty(self) -> tuple[set[UsageKey], set[GpuKey], set[HourKey]]:
        d = (self.dirty_usage, self.dirty_gpus, self.dirty_hours)
        self.dirty_usage, self.dirty_gpus, self.dirty_hours = set(), set(), set()
        return d

    def reset(self) -> None:
        """Forget everything in memory (the store then restores from what it committed)."""
        self.gpus.clear()
        self.usage.clear()
        self.hours.clear()
        self.take_dirty()

    def drop_caches(self) -> None:
        """Drop clean accumulators; they are reloaded on demand. Call only when nothing is dirty."""
        self.usage.clear()
        self.hours.clear()

    # -- read side (in-memory; the store reads its tables instead) ----------------------------
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False) -> list[JobUsage]:
        rows = [(k, a) for k, a in self.usage.items() if job_id is None or k[0] == job_id]
        return summarize(rows, per_gpu)

    def gpu_totals(self) -> dict[GpuKey, tuple[float, float]]:
        """(GPU-seconds observed, energy joules) per GPU."""
        return {k: (g.observed_s, g.energy_j) for k, g in self.gpus.items()}


def _mean(s: float, w: float) -> float | None:
    return s / w if w > 0 else None


def usage_record(job_id: str, host: str, gpu: str, a: UsageAcc, gpus: int = 1) -> JobUsage:
    return JobUsage(
        job_id=job_id, host=host, gpu_uuid=gpu, first_ts=a.first_ts, last_ts=a.last_ts, samples=a.samples,
        allocated_gpu_seconds=a.alloc_s, sm_active_gpu_seconds=a.sm_s, energy_joules=a.energy_j,
        sm_active_mean=_mean(a.sm_sum, a.sm_w), dram_bw_mean=_mean(a.dram_sum, a.dram_w),
        tensor_active_mean=_mean(a.tensor_sum, a.tensor_w), sm_occupancy_mean=_mean(a.occ_sum, a.occ_w),
        mem_used_peak_bytes=a.mem_peak, power_peak_watts=a.power_peak, model=a.model, gpus=gpus,
    )


def merge(accs: Iterable[UsageAcc]) -> UsageAcc:
    """Combine one job's per-GPU accumulators: sums add (so means stay time-weighted), peaks max."""
    out = UsageAcc()
    latest = -math.inf
    for a in accs:
        out.first_ts = min(out.first_ts, a.first_ts)
        out.last_ts = max(out.last_ts, a.last_ts)
        for f in ("samples", "alloc_s", "sm_s", "energy_j", "sm_sum", "sm_w", "dram_sum", "dram_w",
                  "tensor_sum", "tensor_w", "occ_sum", "occ_w"):
            setattr(out, f, getattr(out, f) + getattr(a, f))
        if a.mem_peak is not None and (out.mem_peak is None or a.mem_peak > out.mem_peak):
            out.mem_peak = a.mem_peak
        if a.power_peak is not None and (out.power_peak is None or a.power_peak > out.power_peak):
            out.power_peak = a.power_peak
        if a.model and a.last_ts >= latest:
            out.model, latest = a.model, a.last_ts
    return out


def summarize(rows: Iterable[tuple[UsageKey, UsageAcc]], per_gpu: bool) -> list[JobUsage]:
    """JobUsage per (job, host, GPU), or per job summed over its GPUs (gpu_uuid "*", host the job's
    only host or "*" when it spans several; ``gpus`` the distinct GPU count)."""
    rows = sorted(rows, key=lambda r: r[0])
    if per_gpu:
        return [usage_record(k[0], k[1], k[2], a) for k, a in rows]
    by_job: dict[str, list[tuple[UsageKey, UsageAcc]]] = {}
    for k, a in rows:
        by_job.setdefault(k[0], []).append((k, a))
    out = []
    for job, items in by_job.items():
        hosts = {k[1] for k, _ in items}
        host = next(iter(hosts)) if len(hosts) == 1 else "*"
        out.append(usage_record(job, host, "*", merge(a for _, a in items), gpus=len({(k[1], k[2]) for k, _ in items})))
    return out
