"""Streaming per-(job, host, GPU) aggregation, exact under duplicates, late samples, resets and gaps.

Per GPU key ``(host, gpu_uuid, mig)`` the recent samples are kept sorted by time. Usage is a sum of
contributions of consecutive pairs ``(prev, cur)``: the interval ``cur.ts - prev.ts`` belongs to
``cur``'s jobs, split by ``cur.job_shares`` (equally when empty). Because usage is such a sum, a late
sample landing between ``prev`` and ``next`` is exact: subtract ``(prev, next)``, add ``(prev, late)``
and ``(late, next)``. Peaks, counts and first/last times only grow, so they need no undo.

Rules (documented here because accounting depends on them; :meth:`Aggregator._apply_pair` is the one
statement of them):

* **Observed interval**: ``dt <= max_gap_s`` (``[collector] max_gap_s``, default 60 s: six of the agent's
  default 10 s sampling intervals). It yields ``dt`` GPU-seconds and the energy below, in the hour bucket
  of its end.
* **Energy of an interval**: the counter delta ``ce - pe`` when both samples carry the counter and
  ``0 <= ce - pe <= cap * dt``, where ``cap`` is the GPU's power limit: the sample's ``power_limit_watts``
  times ``LIMIT_HEADROOM`` (1.1) when reported (never above the configured cap), else the configured cap for
  the model (``power_caps``: the exact model name, else the longest pattern contained in it) or
  ``power_cap_w``. A counter that went
  backwards (reset, driver reload, another source, a replaced GPU) or jumped by more than that is not
  trusted: the interval takes the power integral ``min(power, cap) * dt`` (0 J without a power reading)
  and counts one **counter anomaly** (per GPU and hour). Without a counter the power integral is used. So
  no job is ever charged more than ``cap`` x its GPU-seconds.
* **A missed reading** (a sample without the counter, e.g. an NVML call that timed out for a tick): the interval
  ending at the next sample with the counter takes what the counter grew since the GPU's last reading ``c``, less
  what the intervals since ``c`` were given (their power integrals, 0 J without power), never below 0; so the
  counter's growth across the missed reading is the stretch's energy. Only when ``c`` is at most ``max_gap_s``
  before that sample (no gap in between; what the rule reads back is kept in the window, or read back from the
  store: :meth:`Aggregator.read_floor`), the growth is trusted (``0 <= growth <= cap * elapsed``) and every sample
  after ``c`` has the same jobs and shares (it is theirs; the bound above holds); otherwise the old rule: the
  power integral, no anomaly (:meth:`Aggregator._caught_up`). In the hour buckets, what the catching-up interval
  takes is spread in proportion to time over the intervals of the stretch no reading gave energy (those ending at
  a sample without power, and itself), each in the bucket of its end: a stretch across an hour (or a month) is
  billed in both.
* **Gap**: ``dt > max_gap_s``. The GPU was not observed: no GPU-seconds, no power integral. A trusted
  counter delta across it is still the GPU's energy, spread over the hour buckets the gap covers in
  proportion to time. When the same job set is on both sides of the gap, those jobs held the GPU: they get
  the energy (split by ``cur``'s shares) and the gap's seconds as ``gap_s`` (held, not observed). Otherwise
  it is the GPU's **unattributed** energy. Every gap is kept as a record (GPU, start, end, energy, the
  jobs charged) so that accounting can reassign unattributed gaps from the scheduler's records later.
* **Unattributed (idle) energy** of a GPU = its energy minus the energy charged to jobs
  (``HourAcc.energy_j - HourAcc.job_energy_j`` per hour): jobless intervals, unattributed gaps, MIG slices
  nobody holds. Conservation: per physical GPU, sum over jobs + unattributed = the GPU's energy; likewise
  seconds (``observed_s - alloc_s`` is the unallocated part).
* **MIG and sharing, exactly once** (:func:`normalize_mig`, applied to every batch before folding): a
  physical GPU's power and energy live on its whole-GPU key (``mig == ""``) only, whatever shape a source
  sends (a parent row; only instance rows repeating the parent's values, as dcgm-exporter does; both; or
  the agent's per-instance virtual counters, which sum to the GPU's). Instance rows then carry the whole
  GPU's counter and power, and their job shares are scaled by the instance's slice fraction (compute
  slices of the profile in the model name, ``3g.40gb`` -> 3/7; unknown profiles: equal fractions of the
  instances reported at that instant). Instance keys never add to a GPU's observed seconds, energy or
  anomalies; they only charge jobs. So a job on a 3g slice is charged 3/7 of the GPU's energy and 3/7
  GPU-seconds per second, and the whole-GPU key's seconds and energy are the physical GPU's.
* A sample older than ``watermark - window_s`` of its GPU, or before the GPU's ``sealed_until`` (the store's
  compaction rolled its minutes up to there, whatever late window the compacting process has), is rejected as
  ``too_late``; a second sample of a GPU at the same instant is a ``duplicate`` and ignored (first one wins).
* Time-weighted means weight each interval by the job's GPU-seconds in it (``dt * share``) and only
  where the source reported the value.

Three implementations, on purpose: :meth:`Aggregator.add` (one sample, any order: a late sample needs the
undo/redo of its neighbours' pairs) is the **reference**; :meth:`Aggregator._run_pairs` folds a long in-order
run a column at a time (numpy instead of a Python step per sample), and :meth:`Aggregator._fold_columns` folds
many GPUs' few rows at once (the default agent sends 10 a GPU; a group commit holds many agents' batches), one
matrix row a GPU, where numpy's per-call cost would be most of the work for one GPU alone. Both fast paths take
only runs where every interval is observed and
every counter delta is trusted, and no sample with the counter follows one without it (the missed-reading rule
reads back; a GPU without the counter at all takes them); any other run (gaps, anomalies, a reading after a missed
one, MIG instances) goes sample by sample. A late sample undoes and redoes every interval whose energy reads where
it goes: the two around it and, after a missed reading, the one that catches up (:meth:`Aggregator.add`). Every
sum is the same sequence of ``+=`` in all three. Property tests in ``tests/collector/test_aggregate.py`` hold
them equal bit for bit.

In-order samples cost O(1) amortised; a late sample costs a bisect plus a list insert in its window. With
``load_window`` (the store) a GPU keeps only its newest sample in memory between batches and a late sample
reads its window back from the series store (see :class:`Aggregator`), so memory does not grow with
``window_s`` (``tests/collector/test_store_memory.py`` holds the store's ledger to the in-memory one).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from itertools import chain, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import numpy as np

from gpuledger.agent.mig import gpu_readings, instance_shares
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample, JobUsage, gpu_id

if TYPE_CHECKING:
    from gpuledger.collector.series import Series

GpuKey = tuple[str, str, str]  # (host, gpu_uuid, mig or "")
UsageKey = tuple[str, str, str]  # (job_id, host, gpu_id) where gpu_id is uuid or "uuid/mig"
HourKey = tuple[str, str, str, float]  # GpuKey + bucket start (unix seconds)
GapKey = tuple[str, str, str, float, float]  # GpuKey + gap start and end (unix seconds)

HOUR_S = 3600.0
MADE_SOURCE = "gpuledger-collector"  # the source of a whole-GPU row normalize_mig made
DEFAULT_MAX_GAP_S = 60.0  # six of the agent's default 10 s sampling intervals
MAX_SPREAD_HOURS = 24 * 31  # a longer gap's energy goes to the hour it ends in
DEFAULT_POWER_CAP_W = 1500.0  # above every single GPU's board power limit today (B200: 1000 W)

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
TOO_LATE = "too_late"


def gpu_key(s: GpuSample) -> GpuKey:
    return (s.host, s.gpu_uuid, s.mig or "")


# A GPU at its enforced power limit (where training jobs run) averages a little above it over a second or two (the
# driver caps a longer average; its energy counter and our sample times are read a few ms apart): a counter step
# is trusted up to this much beyond limit x elapsed, so honest intervals at the limit are not counter anomalies.
LIMIT_HEADROOM = 1.1


def _limit_caps(limits: np.ndarray, conf: np.ndarray) -> np.ndarray:
    """:meth:`Aggregator.cap_w` of many rows: each row's reported limit (with the headroom) where it has one, never
    above its configured cap."""
    return np.where(limits > 0, np.minimum(limits * LIMIT_HEADROOM, conf), conf)


class UsageAcc:
    """Running sums of one job on one GPU. Mirrors a row of the store's usage table."""

    __slots__ = (
        "first_ts", "last_ts", "samples", "alloc_s", "sm_s", "energy_j",
        "sm_sum", "sm_w", "dram_sum", "dram_w", "tensor_sum", "tensor_w", "occ_sum", "occ_w",
        "mem_peak", "power_peak", "model", "gap_s",
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
        self.gap_s = 0.0  # seconds held across gaps (not observed; their energy is in energy_j)

    def values(self) -> tuple:
        return _USAGE_VALUES(self)

    def set_sums(self, alloc_s: float, energy_j: float, sm_s: float, sm_sum: float, sm_w: float, dram_sum: float,
                 dram_w: float, tensor_sum: float, tensor_w: float, occ_sum: float, occ_w: float) -> None:
        """The sums the columnar fold adds (``_USAGE_SUMS``' order), in one call."""
        self.alloc_s, self.energy_j, self.sm_s, self.sm_sum, self.sm_w = alloc_s, energy_j, sm_s, sm_sum, sm_w
        self.dram_sum, self.dram_w, self.tensor_sum, self.tensor_w = dram_sum, dram_w, tensor_sum, tensor_w
        self.occ_sum, self.occ_w = occ_sum, occ_w

    def raise_peaks(self, mem_peak: int | None, power_peak: float | None) -> None:
        """Keep the larger of each peak and the one seen (the first of equals; None: not reported)."""
        if mem_peak is not None and (self.mem_peak is None or mem_peak > self.mem_peak):
            self.mem_peak = mem_peak
        if power_peak is not None and (self.power_peak is None or power_peak > self.power_peak):
            self.power_peak = power_peak

    @classmethod
    def from_values(cls, values: Iterable) -> UsageAcc:
        acc = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(acc, f, v)
        return acc


class HourAcc:
    """One GPU's totals in one hour bucket (an interval belongs to the bucket of its end; a gap's energy, and the
    energy caught up after a missed reading, are spread over the buckets they cover). ``energy_j - job_energy_j``
    is the GPU's unattributed energy."""

    __slots__ = ("observed_s", "energy_j", "alloc_s", "sm_s", "samples", "job_energy_j", "anomalies")
    FIELDS: tuple[str, ...] = __slots__

    def __init__(self) -> None:
        self.observed_s = self.energy_j = self.alloc_s = self.sm_s = 0.0
        self.samples = 0
        self.job_energy_j = 0.0
        self.anomalies = 0

    def values(self) -> tuple:
        return _HOUR_VALUES(self)

    @classmethod
    def from_values(cls, values: Iterable) -> HourAcc:
        acc = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(acc, f, v)
        return acc


class WindowRow(NamedTuple):
    """What the window keeps of a sample that came in a series: the fields the pair contributions read."""

    ts: float
    energy_joules: float | None
    power_watts: float | None
    sm_active_ratio: float | None
    dram_bw_ratio: float | None
    tensor_active_ratio: float | None
    sm_occupancy_ratio: float | None
    power_limit_watts: float | None
    job_ids: tuple[str, ...]
    job_shares: tuple[float, ...]


# the float fields an interval's contribution reads (what the window keeps of each sample)
PAIR_FLOATS = ("energy_joules", "power_watts", "sm_active_ratio", "dram_bw_ratio", "tensor_active_ratio",
               "sm_occupancy_ratio", "power_limit_watts")


class WindowSegment:
    """Window samples folded from a series, kept as columns until a late sample needs them one by one."""

    __slots__ = ("ts", "cols", "job_ids", "job_shares")

    def __init__(self, ts: np.ndarray, cols: dict[str, np.ndarray], job_ids: tuple[str, ...],
                 job_shares: tuple[float, ...]) -> None:
        self.ts, self.cols, self.job_ids, self.job_shares = ts, cols, job_ids, job_shares

    def __len__(self) -> int:
        return len(self.ts)

    def tail(self, k: int) -> WindowSegment:
        return WindowSegment(self.ts[k:], {f: v[k:] for f, v in self.cols.items()}, self.job_ids, self.job_shares)

    def rows(self) -> list[WindowRow]:
        n = len(self.ts)
        cols = [self.ts.tolist()]
        for f in PAIR_FLOATS:
            vals = self.cols[f].tolist()
            cols.append([None if v != v else v for v in vals] if np.isnan(self.cols[f]).any() else vals)
        return list(map(WindowRow, *cols, [self.job_ids] * n, [self.job_shares] * n))


class GpuState:
    """One GPU's recent samples (sorted) and its all-time totals.

    The window is ``samples`` (objects) followed by ``pending`` (columns from series, oldest first);
    ``ts`` holds the times of both. :meth:`rows` turns the pending columns into objects when a sample
    must be inserted into the window (a late one); in-order series never need that."""

    __slots__ = ("ts", "samples", "pending", "start", "watermark", "first_ts", "n", "observed_s", "energy_j",
                 "model", "anomalies", "partial", "sealed_until")
    TOTAL_FIELDS: tuple[str, ...] = ("first_ts", "watermark", "n", "observed_s", "energy_j", "model", "anomalies")

    def __init__(self) -> None:
        self.ts: list[float] = []
        self.samples: list = []
        self.pending: list[WindowSegment] = []
        self.start = 0  # samples before this index are evicted (kept until compaction)
        self.watermark = -math.inf  # newest ts seen
        self.first_ts = math.inf
        self.n = 0
        self.observed_s = 0.0
        self.energy_j = 0.0
        self.model = ""
        self.anomalies = 0  # intervals whose counter delta was not trusted
        self.partial = False  # only the newest sample is in memory; the window is in the store (Aggregator.load_window)
        self.sealed_until = -math.inf  # samples before this are final (rolled up): too late whatever the window

    def totals(self) -> tuple:
        return _GPU_TOTALS(self)

    def anchor(self) -> tuple[float, float] | None:
        """(ts, energy counter or NaN) of the newest sample, which starts the next interval; None when empty."""
        if self.pending:
            seg = self.pending[-1]
            return float(seg.ts[-1]), float(seg.cols["energy_joules"][-1])
        if self.samples:
            last = self.samples[-1]
            return last.ts, math.nan if last.energy_joules is None else last.energy_joules
        return None

    def keep_newest(self, ts: float, row: WindowRow) -> None:
        """Hold only the newest sample (``row``, at ``ts``): the rest of the window is in the store (``partial``)."""
        self.ts, self.samples, self.pending, self.start, self.partial = [ts], [row], [], 0, True

    def rows(self) -> list:
        """The window as objects (``ts`` aligned), turning pending columns into rows."""
        if self.pending:
            self.drop(self.start)
            for seg in self.pending:
                self.samples.extend(seg.rows())
            self.pending = []
        return self.samples

    def drop(self, k: int) -> None:
        """Forget the ``k`` oldest window samples (all before ``start``)."""
        if k <= 0:
            return
        del self.ts[:k]
        m = min(k, len(self.samples))
        del self.samples[:m]
        k -= m
        while k:
            seg = self.pending[0]
            if len(seg) <= k:
                k -= len(seg)
                del self.pending[0]
            else:
                self.pending[0] = seg.tail(k)
                k = 0
        self.start = 0


# one C call per row the store writes (a batch writes a usage, GPU and hour row per GPU)
_USAGE_VALUES = attrgetter(*UsageAcc.FIELDS)
# what UsageAcc.set_sums sets, read in the same order
_USAGE_SUMS = attrgetter("alloc_s", "energy_j", "sm_s", "sm_sum", "sm_w", "dram_sum", "dram_w", "tensor_sum",
                         "tensor_w", "occ_sum", "occ_w")
_HOUR_VALUES = attrgetter(*HourAcc.FIELDS)
_GPU_TOTALS = attrgetter(*GpuState.TOTAL_FIELDS)


@dataclass(frozen=True, slots=True)
class AddCounts:
    accepted: int = 0
    duplicate: int = 0
    too_late: int = 0


_TS = attrgetter("ts")
_JOBS = attrgetter("job_ids", "job_shares")
_SMALL_ROWS = 64  # numpy's per-call cost outweighs its per-row gain below about this many rows
_RUN_MIN = 16  # shorter runs go sample by sample: numpy's per-call cost outweighs the per-sample one
_RUN_FLOATS = {f: attrgetter(f) for f in PAIR_FLOATS}
_MEANS = {"sm_active_ratio": ("sm_sum", "sm_w"), "dram_bw_ratio": ("dram_sum", "dram_w"),
          "tensor_active_ratio": ("tensor_sum", "tensor_w"), "sm_occupancy_ratio": ("occ_sum", "occ_w")}


def _seqsum(start: float, terms: np.ndarray) -> float:
    """``start + t0 + t1 + ...`` left to right, as repeated ``+=`` does (cumsum is sequential, sum is not)."""
    if not terms.size:
        return start
    return float(np.cumsum(np.concatenate(([start], terms)))[-1])


class _SeqSums:
    """Many ``acc.attr = _seqsum(acc.attr, terms)`` at once: one sequential cumsum per term count instead of one
    per sum (a 2-D cumsum along rows is the same left-to-right accumulation as the 1-D one, bit for bit)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[object, str, np.ndarray]] = []

    def add(self, obj: object, attr: str, terms: np.ndarray) -> None:
        if terms.size:
            self.items.append((obj, attr, terms))

    def apply(self) -> None:
        by_len: dict[int, list[tuple[object, str, np.ndarray]]] = {}
        for it in self.items:
            by_len.setdefault(it[2].size, []).append(it)
        for n, group in by_len.items():
            if len({(id(o), a) for o, a, _ in group}) != len(group):  # one sum twice: keep the order, one by one
                for o, a, t in group:
                    setattr(o, a, _seqsum(getattr(o, a), t))
                continue
            m = np.empty((len(group), n + 1))
            m[:, 0] = [getattr(o, a) for o, a, _ in group]
            m[:, 1:] = [t for _, _, t in group]
            for (o, a, _), v in zip(group, np.cumsum(m, axis=1)[:, -1].tolist()):
                setattr(o, a, v)


_NAN = np.float64(np.nan).tobytes()
_GPU_SUMS = attrgetter("observed_s", "energy_j")
_HOUR_PHYSICAL = attrgetter("observed_s", "energy_j")
_HOUR_HELD = attrgetter("alloc_s", "job_energy_j", "sm_s")


def _power_integral(power: float | None, cap: float, dt: float) -> float:
    """An interval's energy by its power reading: ``min(power, cap) * dt``, 0 J without one (the columnar paths'
    ``np.minimum(power, caps) * dt`` is the same per element)."""
    return 0.0 if power is None else min(power, cap) * dt


def _sequential_sum(m: np.ndarray) -> np.ndarray:
    """``m[0] + m[1] + ... + m[-1]`` elementwise, left to right: a running sum's end, each element the sequence of
    ``+=`` of its terms (what cumsum along the first axis ends with, bit for bit: never a pairwise sum), in a numpy
    call a term over all the sums at once (cumsum's per-element cost is several times that of ``+=`` here)."""
    total = m[0].copy()
    for term in m[1:]:
        total += term
    return total


def _starts(values: Callable[[object], tuple], objs: list, width: int) -> np.ndarray:
    """The (``width``, len(objs)) matrix of ``values`` of each of ``objs`` (float64), columns in their order."""
    flat = np.fromiter(chain.from_iterable(map(values, objs)), np.float64, width * len(objs))
    return flat.reshape(len(objs), width).T


def _last_values(m: np.ndarray) -> list[float | None]:
    """A (series, row) matrix's last column as floats, None where NaN (not reported)."""
    last = m[:, -1]
    nan = np.isnan(last)
    if not nan.any():
        return last.tolist()
    if nan.all():
        return [None] * len(last)
    return [None if v != v else v for v in last.tolist()]


def _accumulators(held: dict, dirty: set, keys: list, load: Callable[[list], dict], new: Callable[[], object]) -> list:
    """``held``'s accumulators of ``keys`` (a lookup each, in C), those not in memory loaded (one call for them all)
    or new and kept in ``held``; every key marked ``dirty``."""
    accs = list(map(held.get, keys))
    if None in accs:
        missing = [k for k, a in zip(keys, accs) if a is None]
        loaded = load(missing)
        for k in missing:
            held[k] = loaded.get(k) or new()
        accs = [held[k] if a is None else a for k, a in zip(keys, accs)]
    dirty.update(keys)
    return accs


def _float_matrix(xs: list[Series], wires: list[dict[str, bytes]] | None, f: str, n: int) -> np.ndarray:
    """Field ``f`` of series of ``n`` rows each as a (series, row) float64 matrix, NaN where not reported: from
    the wire bytes when every series has them (``wires``: one join, one view), else from their arrays."""
    if wires is not None:
        raw = b"".join(map(dict.get, wires, repeat(f, len(wires)), repeat(_NAN * n, len(wires))))
        return np.frombuffer(raw, dtype="<f8").reshape(len(wires), n)
    return np.array([x.float_col(f) for x in xs], dtype=np.float64).reshape(len(xs), n)


def _mem_peaks(xs: list[Series], wires: list[dict[str, bytes]] | None, n: int) -> list[int | None]:
    """Per series, its largest memory reading, None when it reported none."""
    if wires is not None:
        try:
            raw = b"".join([w["mem_used_bytes"] for w in wires])
        except KeyError:  # not every series reported it
            return [None if (col := w.get("mem_used_bytes")) is None else int(np.frombuffer(col, dtype="<i8").max())
                    for w in wires]
        return np.frombuffer(raw, dtype="<i8").reshape(len(wires), n).max(axis=1).tolist()
    return [_series_mem_peak(x) for x in xs]


def _series_mem_peak(x: Series) -> int | None:
    """A series' largest memory reading, None when it reported none."""
    if "mem_used_bytes" not in x.ints:
        return None
    v, m = x.ints["mem_used_bytes"]
    if m is not None:
        v = v[m]
    return int(v.max()) if v.size else None


def _last_model(models: list[str]) -> str:
    """The last non-empty model (what per-sample ``if s.model: acc.model = s.model`` leaves)."""
    if models and models.count(models[-1]) == len(models):
        return models[-1]
    for m in reversed(models):
        if m:
            return m
    return ""


def _hour_parts(t0: float, t1: float) -> list[tuple[float, float]]:
    """(hour bucket start, seconds of (t0, t1] in it) for every hour the span touches."""
    out = []
    h = math.floor(t0 / HOUR_S) * HOUR_S
    while h < t1:
        part = min(t1, h + HOUR_S) - max(t0, h)
        if part > 0:
            out.append((h, part))
        h += HOUR_S
    return out


def _caught_up_hours(rows: list, since: int, k: int, cur: GpuSample) -> tuple[list[tuple[float, float]], float]:
    """([(hour bucket start, seconds)], all their seconds) of the intervals of the stretch (rows[since], cur] whose
    energy the reading at cur catches up: those no reading gave any (ending at a row without power: 0 J,
    :meth:`Aggregator._caught_up`) and (rows[k], cur] itself; each in the bucket of its end, as every observed
    interval is (:meth:`Aggregator._apply_pair`)."""
    seconds: dict[float, float] = {}
    for m in range(since + 1, k + 1):
        row = rows[m]
        if row.power_watts is None:
            hb = math.floor(row.ts / HOUR_S) * HOUR_S
            seconds[hb] = seconds.get(hb, 0.0) + (row.ts - rows[m - 1].ts)
    hb = math.floor(cur.ts / HOUR_S) * HOUR_S
    seconds[hb] = seconds.get(hb, 0.0) + (cur.ts - rows[k].ts)
    return list(seconds.items()), sum(seconds.values())


class _JobSplit(Protocol):
    """What :func:`_shares` reads: a GpuSample or a Series (one job set for all its rows)."""

    @property
    def job_ids(self) -> tuple[str, ...]: ...

    @property
    def job_shares(self) -> tuple[float, ...]: ...


def _shares(s: _JobSplit) -> tuple[float, ...]:
    if s.job_shares:
        return s.job_shares
    n = len(s.job_ids)
    return (1.0 / n,) * n if n else ()


def _sample(r: object) -> GpuSample:
    """A GpuSample of a row (a GpuSample already, or the validator's struct with the same fields)."""
    return r if isinstance(r, GpuSample) else GpuSample(*(getattr(r, f) for f in SAMPLE_FIELDS))


def normalize_mig(samples: Iterable[GpuSample]) -> list[GpuSample]:
    """Put each MIG GPU's power and energy on its whole-GPU row, once, whatever shape the source sent.

    Per (host, GPU, instant) with instance rows: the GPU's counter and power are the whole-GPU row's when it
    reports them; else, beside a whole-GPU row without them, the sum over instances (the agent's virtual
    per-instance counters); else (instance rows only, dcgm-exporter repeats the GPU's values on each) the
    largest instance value, i.e. the repeated one, counted once. The whole-GPU row (made when missing, with
    ``source == MADE_SOURCE``: stored, but not counted as a sample anyone sent) gets them and no jobs; every
    instance row gets them too, with its job shares scaled by its slice fraction (see the module docstring).
    Returns the rows, other GPUs' unchanged, the made ones last.
    """
    rows = list(samples)
    groups: dict[tuple[str, str, float], list[int]] = {}
    mig_gpus = {(r.host, r.gpu_uuid) for r in rows if r.mig}
    if not mig_gpus:
        return rows
    for i, r in enumerate(rows):
        if (r.host, r.gpu_uuid) in mig_gpus:
            groups.setdefault((r.host, r.gpu_uuid, r.ts), []).append(i)
    extra: list[GpuSample] = []
    for idx in groups.values():
        parent_i = next((i for i in idx if not rows[i].mig), None)
        insts = [i for i in idx if rows[i].mig]
        if not insts:
            continue
        parent = None if parent_i is None else _sample(rows[parent_i])
        inst = [_sample(rows[i]) for i in insts]
        values = gpu_readings(parent, inst)
        for i, x, shares in zip(insts, inst, instance_shares(inst)):
            rows[i] = replace(x, job_shares=shares, **values)
        if parent is None:
            x = inst[0]
            extra.append(GpuSample(ts=x.ts, host=x.host, gpu_uuid=x.gpu_uuid, gpu_index=x.gpu_index,
                                   model=x.model.split(" MIG ")[0], source=MADE_SOURCE, **values))
        elif parent_i is not None:  # always, with a parent
            rows[parent_i] = replace(parent, job_ids=(), job_shares=(), **values)
    return rows + extra


class Aggregator:
    """In-memory streaming aggregation; the store persists what :meth:`take_dirty` names.

    ``load_usage`` / ``load_hour`` fetch accumulators that are not in memory (from the store: a list of keys, a
    dict of those it has), so
    memory holds only the window and what it touches; the defaults start every key from zero.

    ``load_window(gpu_key, floor)`` (the store's ``series_store.window``) returns a GPU's stored samples at or
    after ``floor`` plus the newest one before it. With it, a GPU keeps only its newest sample in memory (the
    start of its next interval) once :meth:`add_series` or :meth:`add_many` is done with it, and its window is
    read back when a late sample needs it (from :meth:`read_floor`), its last ``max_gap_s`` when a reading after a
    missed one does (:meth:`_caught_up`): memory per GPU no longer grows with ``window_s``. The caller must
    store every sample these calls accepted before it hands in more samples of the same GPU (the store writes
    each batch's samples before the next batch is folded). A window read back for a late sample stays in
    memory until a call brings that GPU no late sample.
    """

    def __init__(
        self,
        window_s: float = 600.0,
        max_gap_s: float = DEFAULT_MAX_GAP_S,
        load_usage: Callable[[list[UsageKey]], dict[UsageKey, UsageAcc]] | None = None,
        load_hour: Callable[[list[HourKey]], dict[HourKey, HourAcc]] | None = None,
        power_cap_w: float = DEFAULT_POWER_CAP_W,
        power_caps: Mapping[str, float] | None = None,
        load_window: Callable[[GpuKey, float], list[WindowSegment]] | None = None,
    ) -> None:
        if not window_s >= 0 or not max_gap_s > 0:
            raise ValueError(f"window_s must be >= 0 and max_gap_s > 0, got {window_s!r}, {max_gap_s!r}")
        caps = dict(power_caps or {})
        bad = {k: v for k, v in {"power_cap_w": power_cap_w, **caps}.items()
               if not (isinstance(v, (int, float)) and v > 0)}
        if bad:
            raise ValueError(f"power caps must be positive watts, got {bad!r}")
        self.window_s = float(window_s)
        self.max_gap_s = float(max_gap_s)
        self.power_cap_w = float(power_cap_w)
        self.power_caps = {str(k): float(v) for k, v in caps.items()}
        self._model_caps: dict[str, float] = {}
        self.gaps: dict[GapKey, tuple[float, tuple[str, ...]] | None] = {}  # dirty gap records; None: deleted
        self._load_usage = load_usage or (lambda keys: {})
        self._load_hour = load_hour or (lambda keys: {})
        self._load_window = load_window
        self.gpus: dict[GpuKey, GpuState] = {}
        self.usage: dict[UsageKey, UsageAcc] = {}
        self.hours: dict[HourKey, HourAcc] = {}
        self.dirty_usage: set[UsageKey] = set()
        self.dirty_gpus: set[GpuKey] = set()
        self.dirty_hours: set[HourKey] = set()
        # a GPU's series with at most this many rows in one batch are folded in plain Python floats
        self.small_series_rows = _SMALL_ROWS

    def cap_w(self, model: str, limit: float | None = None) -> float:
        """The most a GPU of ``model`` can draw (W): its reported limit (with ``LIMIT_HEADROOM``), never above the
        configured cap."""
        conf = self._model_caps.get(model)
        if conf is None:
            conf = self.power_caps.get(model)
            if conf is None:
                hits = [p for p in self.power_caps if p and p in model]
                conf = self.power_caps[max(hits, key=len)] if hits else self.power_cap_w
            self._model_caps[model] = conf
        return conf if limit is None or not limit > 0 else min(limit * LIMIT_HEADROOM, conf)

    # -- accumulators -------------------------------------------------------------------------
    def _usage(self, key: UsageKey) -> UsageAcc:
        """:meth:`_usages` of one key, written out: the per-sample path calls this for every interval and job,
        and a list a call (``_accumulators``) made that path about a quarter slower."""
        acc = self.usage.get(key)
        if acc is None:
            acc = self._load_usage([key]).get(key) or UsageAcc()
            self.usage[key] = acc
        self.dirty_usage.add(key)
        return acc

    def _hour(self, key: HourKey) -> HourAcc:
        """:meth:`_hours` of one key, written out as :meth:`_usage` is."""
        acc = self.hours.get(key)
        if acc is None:
            acc = self._load_hour([key]).get(key) or HourAcc()
            self.hours[key] = acc
        self.dirty_hours.add(key)
        return acc

    def _usages(self, keys: list[UsageKey]) -> list[UsageAcc]:
        """:meth:`_usage` of many keys: one load for all not in memory."""
        return _accumulators(self.usage, self.dirty_usage, keys, self._load_usage, UsageAcc)

    def _hours(self, keys: list[HourKey]) -> list[HourAcc]:
        """:meth:`_hour` of many keys."""
        return _accumulators(self.hours, self.dirty_hours, keys, self._load_hour, HourAcc)

    def _pair_energy(self, g: GpuState, rows: list, k: int, cur: GpuSample, dt: float,
                     gap: bool) -> tuple[float, int, int | None]:
        """(joules, anomalies, since) of the interval (rows[k], cur]: the trusted counter delta, else the capped
        power integral (none across a gap); after a missed reading (rows[k] without the counter, cur with it) what
        the counter grew since its last reading rows[since] (:meth:`_caught_up`), ``since`` None otherwise;
        anomalies is 1 when both counters exist but their delta is not trusted."""
        cap = self.cap_w(g.model, cur.power_limit_watts)
        integral = 0.0 if gap else _power_integral(cur.power_watts, cap, dt)
        pe, ce = rows[k].energy_joules, cur.energy_joules
        if ce is None:
            return integral, 0, None
        if pe is None:
            caught = None if gap else self._caught_up(g, rows, k, cur, cap)
            return (integral, 0, None) if caught is None else (caught[0], 0, caught[1])
        d = ce - pe
        if 0.0 <= d <= cap * dt:
            return d, 0, None
        return integral, 1, None

    def _caught_up(self, g: GpuState, rows: list, k: int, cur: GpuSample, cap: float) -> tuple[float, int] | None:
        """(joules, the index of c) of (rows[k], cur] after a missed reading (rows[k] has no counter, cur has): what
        the counter grew since the GPU's last reading c, less the power integrals the intervals since c were given
        (0 J without power), never below 0. None (the power integral applies) unless c is at most ``max_gap_s``
        before cur (so (c, cur] holds no gap, and what this reads is in the window: :meth:`read_floor`), the
        growth is trusted (``0 <= growth <= cap * (cur - c)``) and every row after c has cur's jobs and shares
        (the growth is theirs: no job is charged more than the cap x its GPU-seconds)."""
        horizon = cur.ts - self.max_gap_s
        jobs = (tuple(cur.job_ids), tuple(cur.job_shares))
        given = 0.0
        for m in range(k, -1, -1):
            row = rows[m]
            if row.ts < horizon:
                return None
            e = row.energy_joules
            if e is not None:
                grown = cur.energy_joules - e
                return (max(grown - given, 0.0), m) if 0.0 <= grown <= cap * (cur.ts - row.ts) else None
            if (tuple(row.job_ids), tuple(row.job_shares)) != jobs or not m:
                return None
            # what _pair_energy gave the interval (rows[m - 1], row] (no gap: both are within max_gap_s of cur)
            given += _power_integral(row.power_watts, self.cap_w(g.model, row.power_limit_watts),
                                     row.ts - rows[m - 1].ts)
        return None

    def read_floor(self, watermark: float) -> float:
        """Where the samples the rules read begin for a GPU whose newest sample is at ``watermark``: the late
        window (``window_s``) and, before it, the ``max_gap_s`` a missed reading's rule reads back
        (:meth:`_caught_up`); the window keeps them (:meth:`_evict`), the store reads them back (``_load``)."""
        return watermark - self.window_s - self.max_gap_s

    def _apply_pair(self, gk: GpuKey, g: GpuState, rows: list, k: int, cur: GpuSample, sign: float) -> None:
        """Add (sign=+1) or remove (sign=-1) the contribution of the interval (prev, cur], prev = rows[k] (the
        window's rows up to prev: the energy after a missed reading reads back, :meth:`_caught_up`)."""
        prev = rows[k]
        dt = cur.ts - prev.ts
        gap = dt > self.max_gap_s
        energy, anomaly, since = self._pair_energy(g, rows, k, cur, dt, gap)
        physical = not gk[2]  # a MIG instance key charges jobs only; its GPU's key holds the GPU's totals
        if gap:
            self._apply_gap(gk, g, prev, cur, sign, dt, energy, anomaly if physical else 0)
            return
        if not physical and not cur.job_ids:
            return
        if physical:
            g.observed_s += sign * dt
            g.energy_j += sign * energy
            g.anomalies += int(sign) * anomaly
        hb = math.floor(cur.ts / HOUR_S) * HOUR_S
        hour = self._hour((gk[0], gk[1], gk[2], hb))
        # energy caught up after a missed reading is for the stretch's intervals no reading gave any: in their hours
        spread = None
        if since is not None and math.floor(rows[since + 1].ts / HOUR_S) * HOUR_S != hb:
            parts, seconds = _caught_up_hours(rows, since, k, cur)
            if len(parts) > 1:
                spread = self._spread(gk, parts, seconds, energy)
        if physical:
            hour.observed_s += sign * dt
            if spread is None:
                hour.energy_j += sign * energy
            else:
                for part_hour, part in spread:
                    part_hour.energy_j += sign * part
            hour.anomalies += int(sign) * anomaly
        if not cur.job_ids:
            return
        gpu_s = dt
        sm, dram, ten, occ = cur.sm_active_ratio, cur.dram_bw_ratio, cur.tensor_active_ratio, cur.sm_occupancy_ratio
        gid = gpu_id(gk[1], gk[2])
        for job, share in zip(cur.job_ids, _shares(cur)):
            acc = self._usage((job, gk[0], gid))
            w = sign * gpu_s * share
            acc.alloc_s += w
            hour.alloc_s += w
            e = sign * energy * share
            acc.energy_j += e
            if spread is None:
                hour.job_energy_j += e
            else:  # (every row of the stretch has cur's jobs and shares: _caught_up)
                for part_hour, part in spread:
                    part_hour.job_energy_j += sign * part * share
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

    def _spread(self, gk: GpuKey, parts: list[tuple[float, float]], seconds: float,
                energy: float) -> list[tuple[HourAcc, float]]:
        """(hour, joules) of ``energy`` spent over ``seconds`` in proportion to time, for each (hour bucket start,
        seconds in it) of ``parts``: a gap's energy, or a missed-reading stretch's caught-up energy."""
        return [(self._hour((gk[0], gk[1], gk[2], hb)), energy * part / seconds) for hb, part in parts]

    def _apply_gap(self, gk: GpuKey, g: GpuState, prev: GpuSample, cur: GpuSample, sign: float, dt: float,
                   energy: float, anomaly: int) -> None:
        """A gap (prev, cur]: its energy spread over the hours it covers, charged to the jobs on both sides of it
        (held) or left unattributed, and kept as a gap record: the physical GPU's always; a MIG instance's when it
        charged its jobs (the physical rows carry no jobs, ``normalize_mig``), so accounting does not reassign
        the physical gap as unattributed on top (``accounting.gaps.reassign``)."""
        physical = not gk[2]
        held = bool(cur.job_ids) and set(prev.job_ids) == set(cur.job_ids)
        key = (gk[0], gk[1], gk[2], prev.ts, cur.ts)
        if physical:
            g.energy_j += sign * energy
            g.anomalies += int(sign) * anomaly
            if anomaly:
                self._hour((gk[0], gk[1], gk[2], math.floor(cur.ts / HOUR_S) * HOUR_S)).anomalies += int(sign) * anomaly
            self.gaps[key] = (energy, tuple(cur.job_ids) if held else ()) if sign > 0 else None
        elif held:  # undone (sign < 0) exactly as it was written: deleted
            self.gaps[key] = (energy, tuple(cur.job_ids)) if sign > 0 else None
        if energy == 0.0 and not held:
            return
        parts = _hour_parts(prev.ts, cur.ts)
        if len(parts) > MAX_SPREAD_HOURS:  # bounded work and rows whatever the timestamps: all in the last hour
            parts = [(parts[-1][0], dt)]
        hours = self._spread(gk, parts, dt, energy)
        if physical:
            for hour, e in hours:
                hour.energy_j += sign * e
        if not held:
            return
        gid = gpu_id(gk[1], gk[2])
        for job, share in zip(cur.job_ids, _shares(cur)):
            acc = self._usage((job, gk[0], gid))
            acc.energy_j += sign * energy * share
            acc.gap_s += sign * dt * share
            for hour, e in hours:
                hour.job_energy_j += sign * e * share

    def _apply_point(self, gk: GpuKey, g: GpuState, s: GpuSample) -> None:
        """Per-sample statistics (counts, first/last, peaks): monotone, so never undone."""
        sent = s.source != MADE_SOURCE
        g.n += sent
        if s.ts < g.first_ts:
            g.first_ts = s.ts
        if s.model:
            g.model = s.model
        self._hour((gk[0], gk[1], gk[2], math.floor(s.ts / HOUR_S) * HOUR_S)).samples += sent
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
            acc.raise_peaks(s.mem_used_bytes, s.power_watts)

    # -- ingest -------------------------------------------------------------------------------
    def add(self, s: GpuSample) -> str:
        """Fold one sample in; returns ACCEPTED, DUPLICATE or TOO_LATE."""
        gk = (s.host, s.gpu_uuid, s.mig or "")
        g = self.gpus.get(gk)
        if g is None:
            g = self.gpus[gk] = GpuState()
        ts = s.ts
        # behind the newest sample: the window decides, and the seal (sealed_until <= watermark: a sample newer than
        # the watermark, the hot path, needs neither)
        if ts <= g.watermark and (ts < g.watermark - self.window_s or ts < g.sealed_until):
            return TOO_LATE
        if g.partial and ts <= g.watermark:
            if ts == g.watermark:
                return DUPLICATE
            self._load(gk, g)
        samples = g.rows()
        if ts > g.watermark:  # the hot path: in order
            if samples:
                if g.partial and samples[-1].energy_joules is None and s.energy_joules is not None:
                    self._read_back(gk, g, ts - self.max_gap_s)  # a reading after a missed one reads back
                self._apply_pair(gk, g, samples, len(samples) - 1, s, 1.0)
            g.ts.append(ts)
            samples.append(s)
            g.watermark = ts
            self._apply_point(gk, g, s)
            self._evict(g)
            return ACCEPTED
        i = bisect_left(g.ts, ts, g.start)
        if g.ts[i] == ts:  # i < len because ts <= watermark == g.ts[-1]
            return DUPLICATE
        # Undo every interval whose energy reads the rows where s goes: (prev, nxt] and, after a missed reading,
        # the one ending at the first row with the counter after nxt, when it reads back as far as s
        # (_caught_up); then redo them with s in the window.
        after = self._reads_back_to(samples, i, ts)
        if after is not None:
            self._apply_pair(gk, g, samples, after - 1, samples[after], -1.0)
        if i > 0:
            self._apply_pair(gk, g, samples, i - 1, samples[i], -1.0)
        g.ts.insert(i, ts)
        samples.insert(i, s)
        if i > 0:
            self._apply_pair(gk, g, samples, i - 1, s, 1.0)
        self._apply_pair(gk, g, samples, i, samples[i + 1], 1.0)
        if after is not None:
            self._apply_pair(gk, g, samples, after, samples[after + 1], 1.0)
        self._apply_point(gk, g, s)
        return ACCEPTED

    def _reads_back_to(self, rows: list, i: int, ts: float) -> int | None:
        """The index of the row after rows[i] whose interval's energy reads rows at ``ts`` (before rows[i]): the
        first with the counter after rows[i] (which lacks it) and rows between, at most ``max_gap_s`` after
        ``ts`` (:meth:`_caught_up` reads back no further); None when there is none."""
        if rows[i].energy_joules is not None:
            return None
        horizon = ts + self.max_gap_s
        for j in range(i + 1, len(rows)):
            row = rows[j]
            if row.ts > horizon:
                return None
            if row.energy_joules is not None:
                return j
        return None

    def _read_back(self, gk: GpuKey, g: GpuState, floor: float) -> None:
        """Put the GPU's stored samples from ``floor`` (and the newest before it) that are older than those in
        memory before them (a GPU holding only its newest samples, ``partial``: the rule of a missed reading
        reads back ``max_gap_s``)."""
        if self._load_window is None or g.ts[0] <= floor:
            return
        first = g.ts[0]
        older = [r for seg in self._load_window(gk, floor) for r in seg.rows() if r.ts < first]
        g.ts[:0] = [r.ts for r in older]
        g.samples[:0] = older

    def add_many(self, samples: Iterable[GpuSample]) -> tuple[AddCounts, list[GpuSample]]:
        """Fold samples in time order (so the outcome does not depend on order within a batch).

        Returns the counts and the accepted samples (the ones to store raw), in time order. GPUs never
        share state, so each GPU's samples are folded on their own: a long in-order run (an agent's
        batch, the common case) by :meth:`_add_run` a column at a time, anything else one by one.
        """
        ordered = normalize_mig(samples)
        ordered.sort(key=_TS)
        runs: dict[GpuKey, list[int]] = {}  # positions in ``ordered``: a batch may hold one object twice
        for i, s in enumerate(ordered):
            gk = (s.host, s.gpu_uuid, s.mig or "")
            run = runs.get(gk)
            if run is None:
                runs[gk] = [i]
            else:
                run.append(i)
        rejected: set[int] = set()  # positions of the samples not accepted
        dup = late = 0
        for gk, pos in runs.items():
            if len(pos) >= _RUN_MIN and self._add_run(gk, [ordered[i] for i in pos]):
                self._trim(self.gpus[gk])
                continue
            g = self.gpus.get(gk)
            late_before = g is not None and ordered[pos[0]].ts <= g.watermark
            for i in pos:
                r = self.add(ordered[i])
                if r is not ACCEPTED:
                    rejected.add(i)
                    if ordered[i].source == MADE_SOURCE:  # not the sender's
                        continue
                    if r is DUPLICATE:
                        dup += 1
                    else:
                        late += 1
            if not late_before:  # a GPU that had late samples keeps its window while they come
                self._trim(self.gpus[gk])
        accepted = [s for i, s in enumerate(ordered) if i not in rejected] if rejected else ordered
        n_made = sum(1 for s in accepted if s.source == MADE_SOURCE)
        return AddCounts(len(accepted) - n_made, dup, late), accepted

    def _add_run(self, gk: GpuKey, run: list[GpuSample]) -> bool:
        """Fold one GPU's samples (sorted) if all are newer than its watermark and strictly increasing;
        False (nothing changed) otherwise. Bit-for-bit what :meth:`add` per sample gives: every sum is
        a sequential ``np.cumsum`` over the same terms in the same order (never a pairwise sum)."""
        if gk[2] or any(s.source == MADE_SOURCE for s in run):  # MIG GPUs go one by one (rare; rules differ)
            return False
        g = self.gpus.get(gk)
        ts = np.array(list(map(_TS, run)), dtype=np.float64)
        if g is not None and not ts[0] > g.watermark or not (ts[1:] > ts[:-1]).all():
            return False
        cols = {}
        for f, get in _RUN_FLOATS.items():  # None -> NaN; a NaN reading (never validated in) takes the slow path
            vals = list(map(get, run))
            absent = vals.count(None)
            col = np.array([math.nan if v is None else v for v in vals] if absent else vals, dtype=np.float64)
            if int(np.isnan(col).sum()) != absent:
                return False
            cols[f] = col
        models = [s.model for s in run]
        caps = self._pair_caps("" if g is None else g.model, models, cols["power_limit_watts"])
        if not self._clean(None if g is None else g.anchor(), ts, cols["energy_joules"], caps):
            return False
        if g is None:
            g = self.gpus[gk] = GpuState()
        samples = g.rows()
        # segments with one job set (and shares): a GPU changes jobs rarely, so usually one segment
        jobs = list(map(_JOBS, run))
        cuts = [0]
        if jobs.count(jobs[0]) != len(jobs):
            cuts += [i for i in range(1, len(run)) if jobs[i] != jobs[i - 1]]
        cuts.append(len(run))
        for a, b in zip(cuts, cuts[1:]):
            seg = run[a:b]
            self._run_pairs(gk, g, g.anchor(), seg[0].job_ids, _shares(seg[0]), a, b, ts, cols, caps)
            mem = [mb for s in seg if (mb := s.mem_used_bytes) is not None]
            power = [pw for s in seg if (pw := s.power_watts) is not None]
            # max() keeps the first of equals, as add() does
            self._run_points(gk, g, ts[a:b], [s.model for s in seg], seg[0].job_ids,
                             max(mem) if mem else None, max(power) if power else None)
            g.ts.extend(ts[a:b].tolist())
            samples.extend(seg)
            g.watermark = g.ts[-1]
        self._evict(g)  # where eviction ends depends only on the watermark
        return True

    def add_series(self, series: list[Series]) -> tuple[list[Series], list[GpuSample]]:
        """Fold columnar series a column at a time where that is exact: each GPU's series, in time order,
        strictly increasing, not overlapping and all newer than the GPU's watermark (an agent's batch).
        Returns (the series folded, every other series' samples for :meth:`add_many`, in that order: a GPU's
        folded series come before its samples left for add_many, so with ``load_window`` the folded ones must be
        stored before add_many reads the window back). GPUs never share state."""
        by_gpu: dict[GpuKey, list[Series]] = {}
        mig_gpus = set()
        for s in series:
            by_gpu.setdefault(s.key, []).append(s)
            if s.mig or s.source == MADE_SOURCE:
                mig_gpus.add((s.host, s.gpu_uuid))
        folded: list[Series] = []
        rest: list[GpuSample] = []
        small: list[tuple[GpuKey, list[Series]]] = []  # folded together, a GPU's first series, then its second...
        for gk, ss in by_gpu.items():
            if mig_gpus and (gk[0], gk[1]) in mig_gpus:  # a MIG GPU's rows are normalised together (normalize_mig)
                rest.extend(r for x in ss for r in x.rows())
                continue
            one = len(ss) == 1  # (an agent's batch: one series a GPU)
            if not one:
                ss.sort(key=lambda x: x.ts[0])
            if (ss[0].n if one else sum(x.n for x in ss)) <= self.small_series_rows:  # an agent's: a few rows a GPU
                # each series in order too where a GPU has several (one alone out of order is refused by the
                # fold and goes whole to add_many, which sorts): otherwise a later series would fold first
                if one or (all(a.ts[-1] < b.ts[0] for a, b in zip(ss, ss[1:]))
                           and all((x.ts[1:] > x.ts[:-1]).all() for x in ss)):
                    small.append((gk, ss))
                else:  # interleaved series (job sets alternating): folding one first would make the next late
                    rest.extend(r for x in ss for r in x.rows())
                continue
            g = self.gpus.get(gk)
            last = -math.inf if g is None else g.watermark
            ok = True
            for x in ss:
                t = x.ts
                if not t[0] > last or not (t[1:] > t[:-1]).all():
                    ok = False
                    break
                last = t[-1]
            if ok:
                ok = self._series_clean(gk, ss)
            if not ok:
                rest.extend(r for x in ss for r in x.rows())
                continue
            for x in ss:
                self._fold_series(gk, x)
            folded.extend(ss)
        # Round r folds the r-th series of every GPU (most have one; a GPU's series follow one another). Once one
        # of a GPU's series is refused, it and the GPU's later ones go sample by sample: each GPU's samples are
        # still folded in time order, and the fold leaves what the per-sample path leaves, so where a GPU switches
        # paths does not matter.
        refused: dict[GpuKey, int] = {}  # GPU -> its first series refused
        for r in range(max((len(ss) for _, ss in small), default=0)):
            items = [(gk, ss[r]) for gk, ss in small if len(ss) > r and gk not in refused]
            for (gk, x), ok in zip(items, self._fold_columns(items)):
                if ok:
                    folded.append(x)
                else:
                    refused[gk] = r
        for gk, ss in small:
            if gk in refused:
                rest.extend(row for x in ss[refused[gk]:] for row in x.rows())
        return folded, rest

    def _fold_series(self, gk: GpuKey, s: Series) -> None:
        g = self.gpus.get(gk)
        if g is None:
            g = self.gpus[gk] = GpuState()
        ts = s.ts
        cols = {f: s.float_col(f) for f in PAIR_FLOATS}
        caps = self._series_caps(g.model, s.model, s.n, cols["power_limit_watts"])
        self._run_pairs(gk, g, g.anchor(), s.job_ids, _shares(s), 0, s.n, ts, cols, caps)
        mem_peak = _series_mem_peak(s)
        power = cols["power_watts"]
        power_peak = None if np.isnan(power).all() else float(np.nanmax(power))
        self._run_points(gk, g, ts, [s.model] * s.n, s.job_ids, mem_peak, power_peak)
        g.ts.extend(ts.tolist())
        # the window keeps a copy of what pair contributions read, not the batch's arrays
        g.pending.append(WindowSegment(ts.copy(), {f: c.copy() for f, c in cols.items()}, s.job_ids, s.job_shares))
        g.watermark = g.ts[-1]
        self._evict(g)
        self._trim(g)

    def _fold_columns(self, items: list[tuple[GpuKey, Series]]) -> list[bool]:
        """Fold GPUs' few-row series (one series a GPU, each newer than its GPU's watermark) in matrices: one row
        a series, one numpy pass a field over all of them (an agent's batch holds 8 GPUs of 10 rows, a group
        commit many batches). Returns, per item, whether it was folded; a refused series changed nothing, the
        per-sample path takes it (out of order, a gap, an untrusted counter). Every sum is a sequential sum
        (:func:`_sequential_sum`) over the same terms, in the same order, that :meth:`_apply_pair` adds (never a
        pairwise sum), padded with +0.0 terms where an interval does not exist (a sum that starts at +0.0 never
        becomes -0.0, so adding +0.0 leaves it as it is): the result is the per-sample path's bit for bit."""
        ok = [False] * len(items)
        shapes: dict[tuple[int, int], list[int]] = {}  # (rows, jobs) -> positions: one block of matrices each
        for i, (_, x) in enumerate(items):
            shapes.setdefault((x.n, len(x.job_ids)), []).append(i)
        for (n, n_jobs), pos in shapes.items():
            for i, folded in zip(pos, self._fold_block([items[i] for i in pos], n, n_jobs)):
                ok[i] = folded
        return ok

    def _fold_block(self, items: list[tuple[GpuKey, Series]], n: int, n_jobs: int) -> list[bool]:
        """:meth:`_fold_columns` for series of ``n`` rows and ``n_jobs`` jobs each (never MIG instances)."""
        k = len(items)
        gpus_in_memory = self.gpus
        states = [gpus_in_memory.get(gk) for gk, _ in items]
        xs = [x for _, x in items]
        anchors = [None if g is None else g.anchor() for g in states]
        before = ["" if g is None else g.model for g in states]  # the model known before each series' first row
        ts = np.array([x.ts for x in xs], dtype=np.float64).reshape(k, n)
        all_wire = [x.wire for x in xs]
        wires = None if None in all_wire else cast(list[dict[str, bytes]], all_wire)  # the fast path's, or none
        cols = {f: _float_matrix(xs, wires, f, n) for f in PAIR_FLOATS}
        energy, power, limit = cols["energy_joules"], cols["power_watts"], cols["power_limit_watts"]
        has_anchor = np.array([a is not None for a in anchors])
        prev_t = np.empty_like(ts)
        prev_t[:, 0] = [ts[j, 0] if a is None else a[0] for j, a in enumerate(anchors)]
        prev_t[:, 1:] = ts[:, :-1]
        prev_e = np.empty_like(ts)
        prev_e[:, 0] = [math.nan if a is None else a[1] for a in anchors]
        prev_e[:, 1:] = energy[:, :-1]
        dt = ts - prev_t  # 0 where the GPU's first sample starts no interval
        cap_of = {m: self.cap_w(m) for m in {*before, *(x.model for x in xs)}}  # a few models: cap_w once each
        caps = np.empty_like(ts)
        caps[:, 0] = list(map(cap_of.__getitem__, before))
        caps[:, 1:] = np.array([cap_of[x.model or m] for x, m in zip(xs, before)])[:, None]
        caps = _limit_caps(limit, caps)
        has_e, had_e = ~np.isnan(energy), ~np.isnan(prev_e)
        counter = has_e & had_e
        caught = has_e & ~had_e  # a reading after a missed one: its rule reads back (_caught_up), sample by sample
        caught[:, 0] &= has_anchor
        delta = energy - prev_e
        watermarks = np.array([-math.inf if g is None else g.watermark for g in states])
        good = ts[:, 0] > watermarks
        if n > 1:
            good &= (ts[:, 1:] > ts[:, :-1]).all(axis=1)
        good &= (dt <= self.max_gap_s).all(axis=1)
        good &= ~(counter & ~((delta >= 0.0) & (delta <= caps * dt))).any(axis=1)
        good &= ~caught.any(axis=1)
        take = np.flatnonzero(good)
        if not take.size:
            return good.tolist()
        if take.size < k:
            pick = take.tolist()
            items, xs, states = [items[j] for j in pick], [xs[j] for j in pick], [states[j] for j in pick]
            wires = None if wires is None else [wires[j] for j in pick]
            ts, dt, counter, delta = ts[take], dt[take], counter[take], delta[take]
            caps, power = caps[take], power[take]
            cols = {f: c[take] for f, c in cols.items()}
            has_anchor = has_anchor[take]
            k = len(items)
        joules = np.where(counter, delta, np.where(np.isnan(power), 0.0, np.minimum(power, caps) * dt))
        joules[~has_anchor, 0] = 0.0
        gpus: list[GpuState] = []
        for (gk, _), state in zip(items, states):
            if state is None:
                state = gpus_in_memory[gk] = GpuState()
            gpus.append(state)
        # the GPUs' totals
        sums = np.empty((n + 1, 2, k))
        sums[0] = _starts(_GPU_SUMS, gpus, 2)
        sums[1:, 0] = dt.T
        sums[1:, 1] = joules.T
        for g, (observed, spent) in zip(gpus, _sequential_sum(sums).T.tolist()):
            g.observed_s, g.energy_j = observed, spent
        # hour buckets (one a series unless it crosses an hour): rows, and its intervals' terms masked to it
        bucket = np.floor(ts / HOUR_S) * HOUR_S
        first_hour, last_hour = bucket[:, 0].tolist(), bucket[:, -1].tolist()
        if first_hour == last_hour:
            hours = self._hours([(gk[0], gk[1], "", hb) for (gk, _), hb in zip(items, first_hour)])
            for hour in hours:
                hour.samples += n
            which: np.ndarray | slice = slice(None)
            mask = None
        else:
            spans: list[tuple[int, float, np.ndarray | None]] = []  # (series, hour, its rows there or None: all)
            for j, (b0, b1) in enumerate(zip(first_hour, last_hour)):
                if b0 == b1:
                    spans.append((j, b0, None))
                else:
                    spans.extend((j, hb, bucket[j] == hb) for hb in np.unique(bucket[j]).tolist())
            hours = self._hours([(items[j][0][0], items[j][0][1], "", hb) for j, hb, _ in spans])
            for hour, (_, _, rows) in zip(hours, spans):
                hour.samples += n if rows is None else int(rows.sum())
            which = np.array([j for j, _, _ in spans])
            mask = np.ones((len(spans), n), dtype=bool)
            for s, (_, _, rows) in enumerate(spans):
                if rows is not None:
                    mask[s] = rows
        physical = np.empty((n + 1, 2, len(hours)))
        physical[0] = _starts(_HOUR_PHYSICAL, hours, 2)
        physical[1:, 0] = (dt[which] if mask is None else np.where(mask, dt[which], 0.0)).T
        physical[1:, 1] = (joules[which] if mask is None else np.where(mask, joules[which], 0.0)).T
        for hour, (observed, spent) in zip(hours, _sequential_sum(physical).T.tolist()):
            hour.observed_s, hour.energy_j = observed, spent
        accs: list[UsageAcc] = []
        if n_jobs:
            shares = np.array([_shares(x) for x in xs], dtype=np.float64)  # (series, jobs)
            w = dt[:, :, None] * shares[:, None, :]  # (series, interval, job): dt * share, as _apply_pair's w
            spent = joules[:, :, None] * shares[:, None, :]
            # (sum, series, interval, job): alloc_s, energy_j, sm_s, then each mean's sum and weight (UsageAcc.set_sums'
            # order), the four means' at once
            terms = np.empty((3 + 2 * len(_MEANS), k, n, n_jobs))
            terms[0], terms[1] = w, spent
            ratios = np.stack([cols[f] for f in _MEANS])[..., None]
            present = ~np.isnan(ratios)
            terms[3::2] = np.where(present, ratios * w, 0.0)  # where reported: value x dt x share ...
            terms[4::2] = np.where(present, w, 0.0)  # ... and its weight
            terms[2] = terms[3]  # sm_s: the SM mean's sum
            # (gpu_id: never a MIG instance here)
            if n_jobs == 1:
                accs = self._usages([(x.job_ids[0], gk[0], gk[1]) for gk, x in items])
            else:
                accs = self._usages([(job, gk[0], gk[1]) for gk, x in items for job in x.job_ids])
            usage = np.empty((n + 1, len(terms), k * n_jobs))
            usage[0] = _starts(_USAGE_SUMS, accs, len(terms))
            # an interval a row, then a sum, then a (series, job)
            usage[1:] = terms.transpose(2, 0, 1, 3).reshape(n, len(terms), k * n_jobs)
            for acc, values in zip(accs, _sequential_sum(usage).T.tolist()):
                acc.set_sums(*values)
            # the hours' job sums: per interval, per job (the order _apply_pair adds them in), masked to the hour
            held = np.empty((n * n_jobs + 1, 3, len(hours)))
            held[0] = _starts(_HOUR_HELD, hours, 3)
            jmask = None if mask is None else np.repeat(mask, n_jobs, axis=1)
            flat = terms[:3, which].reshape(3, len(hours), n * n_jobs)  # alloc_s, energy_j, sm_s
            held[1:] = (flat if jmask is None else np.where(jmask, flat, 0.0)).transpose(2, 0, 1)
            for hour, (alloc, job_energy, sm_s) in zip(hours, _sequential_sum(held).T.tolist()):
                hour.alloc_s, hour.job_energy_j, hour.sm_s = alloc, job_energy, sm_s
        # the rows themselves (_apply_point): counts, first and last times, model, peaks; then the window
        firsts, lasts = ts[:, 0].tolist(), ts[:, -1].tolist()
        mem_peaks: list = [None] * k
        power_peaks: list = mem_peaks
        if n_jobs:
            mem_peaks = _mem_peaks(xs, wires, n)
            power_peaks = np.fmax.reduce(power, axis=1).tolist()
        trim = self._load_window is not None
        newest = (list(map(WindowRow, lasts, *map(_last_values, (cols[f] for f in PAIR_FLOATS)),
                           [x.job_ids for x in xs], [x.job_shares for x in xs])) if trim
                  else [None] * k)  # each series' last row, what the window keeps of it
        self.dirty_gpus.update([gk for gk, _ in items])
        at = 0
        for x, g, t0, t1, mem_peak, power_peak, row in zip(xs, gpus, firsts, lasts, mem_peaks, power_peaks, newest):
            g.n += n
            if t0 < g.first_ts:
                g.first_ts = t0
            model = x.model
            if model:
                g.model = model
            if n_jobs:
                if power_peak != power_peak:
                    power_peak = None  # never reported
                elif power_peak == 0.0:  # +0.0 or -0.0: the first of equals, as max() keeps it
                    power_peak = max(p for p in x.float_col("power_watts").tolist() if p == p)
                for acc in accs[at:at + n_jobs]:
                    acc.samples += n
                    if t0 < acc.first_ts:
                        acc.first_ts = t0
                    if t1 > acc.last_ts:
                        acc.last_ts = t1
                        if model:
                            acc.model = model
                    acc.raise_peaks(mem_peak, power_peak)
                at += n_jobs
            g.watermark = t1
            if trim:  # the store has the window: keep the newest row only (see _trim)
                g.keep_newest(t1, row)
                continue
            g.ts.extend(x.ts.tolist())
            # the window keeps a copy of what pair contributions read, not the batch's arrays
            g.pending.append(WindowSegment(x.ts.copy(), {f: x.float_col(f).copy() for f in PAIR_FLOATS}, x.job_ids,
                                           x.job_shares))
            self._evict(g)
        result = np.zeros(len(good), dtype=bool)
        result[take] = True
        return result.tolist()

    # -- the columnar path's preconditions and caps -------------------------------------------
    def _pair_caps(self, g_model: str, models: list[str], limits: np.ndarray) -> np.ndarray:
        """The cap (W) of the interval ending at each row, as :meth:`_apply_pair` takes it one by one: the
        GPU's model as known before that row (the last non-empty one), bounded by the row's reported limit."""
        n = len(models)
        if models.count(models[0]) == n:
            return self._series_caps(g_model, models[0], n, limits)
        conf = np.empty(n)
        model = g_model
        for k, m in enumerate(models):
            conf[k] = self.cap_w(model)
            if m:
                model = m
        return _limit_caps(limits, conf)

    def _series_caps(self, g_model: str, model: str, n: int, limits: np.ndarray) -> np.ndarray:
        conf = np.full(n, self.cap_w(model or g_model))
        conf[0] = self.cap_w(g_model)
        return _limit_caps(limits, conf)

    def _clean(self, anchor: tuple[float, float] | None, ts: np.ndarray, energy: np.ndarray, caps: np.ndarray) -> bool:
        """Whether every interval ending at these rows is observed (no gap) and every counter delta trusted:
        then the columnar path gives what :meth:`_apply_pair` would. ``anchor``: the GPU's newest sample."""
        if anchor is None:
            pt, pe, ct, ce, caps = ts[:-1], energy[:-1], ts[1:], energy[1:], caps[1:]
        else:
            pt, pe = np.concatenate(([anchor[0]], ts[:-1])), np.concatenate(([anchor[1]], energy[:-1]))
            ct, ce = ts, energy
        dt = ct - pt
        if (dt > self.max_gap_s).any():
            return False
        if (np.isnan(pe) & ~np.isnan(ce)).any():  # a reading after a missed one: its rule reads back (_caught_up)
            return False
        d = ce - pe
        both = ~np.isnan(d)
        return bool(((d[both] >= 0.0) & (d[both] <= caps[both] * dt[both])).all())

    def _series_clean(self, gk: GpuKey, ss: list[Series]) -> bool:
        g = self.gpus.get(gk)
        anchor = None if g is None else g.anchor()
        model = "" if g is None else g.model
        for x in ss:
            e = x.float_col("energy_joules")
            caps = self._series_caps(model, x.model, x.n, x.float_col("power_limit_watts"))
            if not self._clean(anchor, x.ts, e, caps):
                return False
            anchor, model = (float(x.ts[-1]), float(e[-1])), x.model or model
        return True

    def _run_pairs(self, gk: GpuKey, g: GpuState, prev: tuple[float, float] | None, job_ids: tuple[str, ...],
                   shares: tuple[float, ...], a: int, b: int, ts: np.ndarray, cols: dict[str, np.ndarray],
                   caps: np.ndarray) -> None:
        """:meth:`_apply_pair` (sign +1) for the intervals ending at rows a..b-1 (one job set), vectorised; only
        for runs that :meth:`_clean` passed (no gap, no untrusted counter). ``prev``: (ts, energy or NaN) of
        the sample before row a, None when the GPU has none; ``caps``: per row, the cap of the interval ending
        there."""
        if prev is None:  # the GPU's first sample starts no interval
            a += 1
            if a >= b:
                return
            p_ts, p_e = ts[a - 1], cols["energy_joules"][a - 1]
        else:
            p_ts, p_e = prev
        cur = slice(a, b)
        t = ts[cur]
        dt = np.diff(t, prepend=p_ts)  # cur.ts - prev.ts, pair by pair
        gpu_s = dt  # every interval observed (_clean)
        ce = cols["energy_joules"][cur]
        pe = np.concatenate(([p_e], ce[:-1]))
        power = cols["power_watts"][cur]
        counter = ~np.isnan(pe) & ~np.isnan(ce)
        energy = np.where(counter, ce - pe, np.where(~np.isnan(power), np.minimum(power, caps[cur]) * dt, 0.0))
        sums = _SeqSums()
        sums.add(g, "observed_s", gpu_s)
        sums.add(g, "energy_j", energy)
        if job_ids:
            sh = np.array(shares, dtype=np.float64)
            w = gpu_s[:, None] * sh  # (pairs, jobs): row-major order is add()'s order of terms
            e = energy[:, None] * sh
            ratios = {f: cols[f][cur] for f in _MEANS}
            sm = ratios["sm_active_ratio"]
            sm_w = sm[:, None] * w
            has_sm = ~np.isnan(sm)
        h0, h1 = math.floor(t[0] / HOUR_S) * HOUR_S, math.floor(t[-1] / HOUR_S) * HOUR_S
        if h0 == h1:  # the usual run: within one hour
            hours = [(h0, np.ones(len(t), dtype=bool))]
        else:
            bucket = np.floor(t / HOUR_S) * HOUR_S
            hours = [(hb, bucket == hb) for hb in np.unique(bucket).tolist()]
        for hb, rows in hours:
            hour = self._hour((gk[0], gk[1], gk[2], hb))
            sums.add(hour, "observed_s", gpu_s[rows])
            sums.add(hour, "energy_j", energy[rows])
            if job_ids:
                sums.add(hour, "alloc_s", w[rows].ravel())
                sums.add(hour, "job_energy_j", e[rows].ravel())
                sums.add(hour, "sm_s", sm_w[rows & has_sm].ravel())
        if job_ids:
            gid = gpu_id(gk[1], gk[2])
            present = {f: ~np.isnan(v) for f, v in ratios.items()}
            for j, job in enumerate(job_ids):
                acc = self._usage((job, gk[0], gid))
                sums.add(acc, "alloc_s", w[:, j])
                sums.add(acc, "energy_j", e[:, j])
                for f, (s_attr, w_attr) in _MEANS.items():
                    m = present[f]
                    if not m.any():
                        continue
                    vw = ratios[f][m] * w[m, j]
                    if f == "sm_active_ratio":
                        sums.add(acc, "sm_s", vw)
                    sums.add(acc, s_attr, vw)
                    sums.add(acc, w_attr, w[m, j])
        sums.apply()

    def _run_points(self, gk: GpuKey, g: GpuState, ts: np.ndarray, models: list[str], job_ids: tuple[str, ...],
                    mem_peak: int | None, power_peak: float | None) -> None:
        """:meth:`_apply_point` for rows at ``ts`` (strictly increasing, all past the watermark, one job set),
        vectorised; ``models`` one per row, the peaks over the rows' reported values."""
        first = float(ts[0])
        g.n += len(ts)
        if first < g.first_ts:
            g.first_ts = first
        model = _last_model(models)
        if model:
            g.model = model
        h0 = math.floor(ts[0] / HOUR_S) * HOUR_S
        if h0 == math.floor(ts[-1] / HOUR_S) * HOUR_S:
            self._hour((gk[0], gk[1], gk[2], h0)).samples += len(ts)
        else:
            buckets, counts = np.unique(np.floor(ts / HOUR_S) * HOUR_S, return_counts=True)
            for hb, c in zip(buckets.tolist(), counts.tolist()):
                self._hour((gk[0], gk[1], gk[2], hb)).samples += c
        self.dirty_gpus.add(gk)
        if not job_ids:
            return
        gid = gpu_id(gk[1], gk[2])
        for job in job_ids:
            acc = self._usage((job, gk[0], gid))
            acc.samples += len(ts)
            if first < acc.first_ts:
                acc.first_ts = first
            newer = int(np.searchsorted(ts, acc.last_ts, side="right"))  # samples with ts > last_ts
            if newer < len(ts):
                acc.last_ts = float(ts[-1])
                model = _last_model(models[newer:])
                if model:
                    acc.model = model
            acc.raise_peaks(mem_peak, power_peak)

    def _evict(self, g: GpuState) -> None:
        # Keep every sample the rules may still read (read_floor: the late window and the max_gap_s before it) plus
        # one before them (the "anchor"), which is the prev of any late sample that can still be accepted.
        limit = self.read_floor(g.watermark)
        ts, start, n = g.ts, g.start, len(g.ts)
        while start + 1 < n and ts[start + 1] < limit:
            start += 1
        g.start = start
        if start > 256 and start * 2 > n:  # compact now and then: amortised O(1)
            g.drop(start)

    # -- persistence hooks --------------------------------------------------------------------
    def restore_gpu(self, gk: GpuKey, totals: tuple, recent: Iterable[GpuSample] = (),
                    segments: Iterable[WindowSegment] = (), sealed_until: float = -math.inf) -> None:
        """Install a GPU's totals and its recent samples (the window plus the anchor) from storage: as
        objects (``recent``, any order) or as time-ordered columns (``segments``, what the store reads), and the
        time its samples are sealed before (``sealed_until``: refused as too late, see the module docstring)."""
        g = GpuState()
        for f, v in zip(GpuState.TOTAL_FIELDS, totals, strict=True):
            setattr(g, f, v)
        g.sealed_until = sealed_until
        recent = sorted(recent, key=lambda x: x.ts)
        g.ts = [s.ts for s in recent]
        g.samples = list(recent)
        for seg in segments:
            g.ts.extend(seg.ts.tolist())
            g.pending.append(seg)
        self.gpus[gk] = g
        self._evict(g)
        self._trim(g)

    def _trim(self, g: GpuState) -> None:
        """With ``load_window``: keep only the GPU's newest sample (as a WindowRow); the rest is in the store."""
        if self._load_window is None or not g.ts or (g.partial and len(g.ts) == 1):
            return
        if g.pending:
            seg = g.pending[-1]
            newest = seg.tail(len(seg) - 1).rows()[0]
        else:
            r = g.samples[-1]
            newest = r if type(r) is WindowRow else WindowRow._make(
                (r.ts, *(getattr(r, f) for f in PAIR_FLOATS), tuple(r.job_ids), tuple(r.job_shares)))
        g.keep_newest(g.ts[-1], newest)

    def _load(self, gk: GpuKey, g: GpuState) -> None:
        """Read a trimmed GPU's window back from the store (a late sample is to be inserted into it)."""
        assert self._load_window is not None
        segments = self._load_window(gk, self.read_floor(g.watermark))
        ts = [t for seg in segments for t in seg.ts.tolist()]
        if not ts or ts[-1] != g.watermark:
            raise RuntimeError(f"GPU {gk}: its stored window ends at {ts[-1] if ts else None}, but its newest "
                               f"sample is at {g.watermark}: samples were aggregated and not stored")
        g.ts, g.samples, g.pending, g.start, g.partial = ts, [], list(segments), 0, False
        self._evict(g)

    def take_dirty(self) -> tuple[set[UsageKey], set[GpuKey], set[HourKey]]:
        d = (self.dirty_usage, self.dirty_gpus, self.dirty_hours)
        self.dirty_usage, self.dirty_gpus, self.dirty_hours = set(), set(), set()
        return d

    def take_dirty_values(self) -> tuple[list[tuple[UsageKey, tuple]], list[tuple[GpuKey, tuple]],
                                         list[tuple[HourKey, tuple]]]:
        """:meth:`take_dirty`'s keys with what is stored of each: (key, ``UsageAcc.values``), (key,
        ``GpuState.totals``), (key, ``HourAcc.values``), a C call a row (the store writes a few hundred a commit)."""
        usage, gpus, hours = self.take_dirty()
        return (list(zip(usage, map(_USAGE_VALUES, map(self.usage.__getitem__, usage)))),
                list(zip(gpus, map(_GPU_TOTALS, map(self.gpus.__getitem__, gpus)))),
                list(zip(hours, map(_HOUR_VALUES, map(self.hours.__getitem__, hours)))))

    def take_gaps(self) -> dict[GapKey, tuple[float, tuple[str, ...]] | None]:
        """The gap records changed since the last call: (energy J, jobs charged; empty = unattributed), or None
        for a gap a late sample split (delete it)."""
        g, self.gaps = self.gaps, {}
        return g

    def reset(self) -> None:
        """Forget everything in memory (the store then restores from what it committed)."""
        self.gpus.clear()
        self.usage.clear()
        self.hours.clear()
        self.take_dirty()
        self.take_gaps()

    def forget_host(self, host: str) -> None:
        """Forget one host's state: its GPUs' windows, cached usage and hour accumulators, gap records and dirty
        marks (another collector wrote the host since: the store restores it from what was committed)."""
        for gk in [k for k in self.gpus if k[0] == host]:
            del self.gpus[gk]
        for uk in [k for k in self.usage if k[1] == host]:
            del self.usage[uk]
        for hk in [k for k in self.hours if k[0] == host]:
            del self.hours[hk]
        for gap in [k for k in self.gaps if k[0] == host]:
            del self.gaps[gap]
        self.dirty_usage = {k for k in self.dirty_usage if k[1] != host}
        self.dirty_gpus = {k for k in self.dirty_gpus if k[0] != host}
        self.dirty_hours = {k for k in self.dirty_hours if k[0] != host}

    def evict(self, hosts: set[str]) -> None:
        """Drop idle hosts' GPU windows, usage and hour accumulators (call only when nothing is dirty): their
        totals and sums are stored, and reloaded exactly when the host sends again."""
        for gk in [k for k in self.gpus if k[0] in hosts]:
            del self.gpus[gk]
        for uk in [k for k in self.usage if k[1] in hosts]:
            del self.usage[uk]
        for hk in [k for k in self.hours if k[0] in hosts]:
            del self.hours[hk]

    def drop_past_hours(self) -> int:
        """Drop hour accumulators that ended two windows before their GPU's newest sample, or whose GPU left
        memory (call only when nothing is dirty); returns how many. A GPU sending on for days would otherwise
        keep one a hour; one a late sample still needs is reloaded exactly (``load_hour``)."""
        old = [k for k in self.hours
               if (g := self.gpus.get(k[:3])) is None or k[3] + HOUR_S + 2 * self.window_s <= g.watermark]
        for k in old:
            del self.hours[k]
        return len(old)

    def drop_caches(self) -> None:
        """Drop clean accumulators; they are reloaded on demand. Call only when nothing is dirty."""
        self.usage.clear()
        self.hours.clear()

    # -- read side (in-memory; the store reads its tables instead) ----------------------------
    def job_usage(self, job_id: str | None = None, per_gpu: bool = False) -> list[JobUsage]:
        rows = [(k, a) for k, a in self.usage.items() if job_id is None or k[0] == job_id]
        return summarize(rows, per_gpu)

    def gpu_totals(self) -> dict[GpuKey, tuple[float, float]]:
        """(GPU-seconds observed, energy joules) per GPU key (a MIG instance's key holds neither)."""
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
        gap_gpu_seconds=a.gap_s,
    )


def merge(accs: Iterable[UsageAcc]) -> UsageAcc:
    """Combine one job's per-GPU accumulators: sums add (so means stay time-weighted), peaks max."""
    out = UsageAcc()
    latest = -math.inf
    for a in accs:
        out.first_ts = min(out.first_ts, a.first_ts)
        out.last_ts = max(out.last_ts, a.last_ts)
        for f in ("samples", "alloc_s", "sm_s", "energy_j", "sm_sum", "sm_w", "dram_sum", "dram_w",
                  "tensor_sum", "tensor_w", "occ_sum", "occ_w", "gap_s"):
            setattr(out, f, getattr(out, f) + getattr(a, f))
        out.raise_peaks(a.mem_peak, a.power_peak)
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
