"""A deterministic simulated GPU node (H200-class by default), for demos and tests without hardware.

Each sample at time ``t`` reports the interval ``(t_prev, t]``: the ratios and the power are constant over
that interval (the mean a GPM/DCGM reading would give), and the energy counter grows by exactly
``power * dt``. The source keeps the ground truth (``truth``) so tests and the demo can check what the
collector computes against what "really" happened.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuledger.schema.records import GpuSample


@dataclass(frozen=True, slots=True)
class Levels:
    """Mean activity over an interval (ratios in 0..1) and memory in use as a share of the total."""

    sm_active: float
    sm_occupancy: float
    dram_bw: float
    tensor_active: float
    gpu_util: float
    mem_used_ratio: float


@dataclass(frozen=True, slots=True)
class Profile:
    """A workload shape. With ``stall`` set, ``stall_s`` of every ``period_s`` seconds run at the stall levels."""

    name: str
    busy: Levels
    stall: Levels | None = None
    period_s: float = 90.0
    stall_s: float = 20.0
    noise: float = 0.02  # std-dev added to non-zero ratios (absolute)


PROFILES: dict[str, Profile] = {
    # Compute-bound training: SMs busy, tensor cores busy, power near TDP.
    "training": Profile("training", Levels(0.90, 0.50, 0.40, 0.60, 1.0, 0.85)),
    # Memory-bound inference (decode): HBM busy, SMs mostly waiting.
    "inference": Profile("inference", Levels(0.30, 0.20, 0.80, 0.15, 0.95, 0.60)),
    # Training whose input pipeline stalls: 20 s of every 90 s the GPU waits for data.
    "dataloader-stall": Profile(
        "dataloader-stall",
        Levels(0.90, 0.50, 0.40, 0.60, 1.0, 0.85),
        stall=Levels(0.05, 0.03, 0.02, 0.0, 0.10, 0.85),
    ),
    # Allocated but idle: a context holds some memory, nothing runs.
    "idle": Profile("idle", Levels(0.0, 0.0, 0.0, 0.0, 0.0, 0.03), noise=0.0),
}
# A free GPU (no job): nothing runs and no memory is held.
_FREE = Profile("free", Levels(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), noise=0.0)

# Node loads for `agent run|once --source simulated --load NAME`: each GPU's profile (None = free), the pattern
# repeated over the node's GPUs. Neighbouring GPUs with the same profile form one job, as on a real node.
# "mixed" is the demo's mix on one node, so that even 4 GPUs show it: per 8 GPUs a 2-GPU training job, inference,
# an allocated-but-idle GPU, another 2-GPU training job, inference, and training whose data loader stalls.
LOADS: dict[str, tuple[str | None, ...]] = {
    "free": (None,),
    "training": ("training",),
    "inference": ("inference",),
    "dataloader-stall": ("dataloader-stall",),
    "idle": ("idle",),
    "mixed": ("training", "training", "inference", "idle", "training", "training", "inference", "dataloader-stall"),
}


def load_plan(load: str, host: str, gpus: int) -> dict[int, tuple[str, str]]:
    """GPU index -> (profile, job id) for a named load; free GPUs are absent. Job ids are numeric and stable for
    a host (so reruns of a hand-run pipeline charge the same jobs), consecutive within the node."""
    try:
        pattern = LOADS[load]
    except KeyError:
        raise ValueError(f"simulated source: unknown load {load!r}; known: {', '.join(LOADS)}") from None
    profiles = list(itertools.islice(itertools.cycle(pattern), gpus))
    base = 100_000 + int(hashlib.sha1(host.encode()).hexdigest()[:8], 16) % 800_000 * 10
    plan: dict[int, tuple[str, str]] = {}
    job = 0
    for i, p in enumerate(profiles):
        if p is None:
            continue
        # One job for a run of one profile, but an allocated-idle GPU is always its own job.
        if i == 0 or profiles[i - 1] != p or p == "idle" or i % len(pattern) == 0:
            job += 1
        plan[i] = (p, str(base + job))
    return plan

# Power weights of each activity: f = sum(w * level), clipped to 0..1, power = idle + (tdp - idle) * f.
# Chosen so training lands near 90 % of TDP and inference mid-range, as on real Hopper parts.
_W_SM, _W_DRAM, _W_TENSOR = 0.55, 0.35, 0.40
_BOOST_CLOCK_HZ = 1.98e9
_HBM_CLOCK_HZ = 2.619e9
_THROTTLE_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle
_THROTTLE_SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
_IDLE_CLOCK_HZ = 345e6
_AMBIENT_C = 30.0
_TEMP_RISE_C = 45.0  # at TDP


def gpu_uuid_for(host: str, index: int) -> str:
    """A stable UUID in NVML's format, derived from (host, index)."""
    h = hashlib.sha1(f"{host}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _stalled_time(profile: Profile, offset: float, t: float) -> float:
    """Seconds spent in stall windows from ``offset`` up to ``t`` (a cumulative function)."""
    y = t - offset
    return math.floor(y / profile.period_s) * profile.stall_s + min(y % profile.period_s, profile.stall_s)


def _blend(a: Levels, b: Levels, wb: float) -> Levels:
    wa = 1.0 - wb
    return Levels(
        a.sm_active * wa + b.sm_active * wb,
        a.sm_occupancy * wa + b.sm_occupancy * wb,
        a.dram_bw * wa + b.dram_bw * wb,
        a.tensor_active * wa + b.tensor_active * wb,
        a.gpu_util * wa + b.gpu_util * wb,
        a.mem_used_ratio * wa + b.mem_used_ratio * wb,
    )


def _clip(x: float, lo: float = 0.0, hi: float = 1.0) -> float:
    return lo if x < lo else hi if x > hi else x


class _Gpu:
    __slots__ = ("index", "uuid", "profile", "rng", "stall_offset", "last_ts", "energy", "truth_energy", "truth_sm",
                 "job_ids", "anchor")

    def __init__(self, index: int, uuid: str, profile: Profile, rng: random.Random) -> None:
        self.index = index
        self.uuid = uuid
        self.profile = profile
        self.rng = rng
        # Stall phases differ per GPU so a node's GPUs do not stall in lockstep; they count from the GPU's first
        # sample (``anchor``), not from the epoch, so a seed gives the same numbers whatever the wall clock says.
        self.stall_offset = rng.uniform(0.0, 90.0)
        self.anchor: float | None = None
        self.last_ts: float | None = None
        # A realistic counter: some megajoules accumulated since the driver loaded.
        self.energy = rng.uniform(1e6, 50e6)
        self.truth_energy = 0.0
        self.truth_sm = 0.0
        self.job_ids: tuple[str, ...] = ()


class SimulatedSource:
    """Simulated GPUs whose values follow per-GPU workload profiles; deterministic for a seed and clock."""

    name = "simulated"

    def __init__(
        self,
        host: str = "sim-node",
        gpus: int = 8,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model: str = "NVIDIA H200",
        tdp_watts: float = 700.0,
        idle_watts: float = 75.0,
        mem_total_bytes: int = 141_000_000_000,
        profiles: Mapping[int, str | Profile | None] | None = None,
        load: str | None = None,
    ) -> None:
        """``profiles`` sets GPUs' workloads (no job ids: a mapper or the caller names the jobs); ``load`` names a
        whole node's mix from :data:`LOADS`, and then the samples carry simulated job ids as well."""
        if not isinstance(gpus, int) or gpus < 0:
            raise ValueError(f"simulated source: gpus must be a non-negative integer, got {gpus!r}")
        if not (0.0 <= idle_watts < tdp_watts):
            raise ValueError(f"simulated source: need 0 <= idle_watts < tdp_watts, got {idle_watts!r}, {tdp_watts!r}")
        if mem_total_bytes <= 0:
            raise ValueError(f"simulated source: mem_total_bytes must be positive, got {mem_total_bytes!r}")
        self.host = host
        self.seed = seed
        self.model = model
        self.tdp_watts = float(tdp_watts)
        self.idle_watts = float(idle_watts)
        self.mem_total_bytes = int(mem_total_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        # One generator per GPU, seeded from (seed, host, index): adding a GPU or a profile change on
        # one GPU never shifts another GPU's noise. Never the global `random`.
        self._gpus = [
            _Gpu(i, gpu_uuid_for(host, i), _FREE, random.Random(f"{seed}/{host}/{i}")) for i in range(gpus)
        ]
        for index, (planned, job_id) in (load_plan(load, host, gpus) if load else {}).items():
            self.set_profile(index, planned)
            self._gpus[index].job_ids = (job_id,)
        for index, profile in (profiles or {}).items():
            self.set_profile(index, profile)

    # -- GpuSource protocol -------------------------------------------------------------------------
    def open(self) -> None:
        """Nothing to acquire."""

    def close(self) -> None:
        """Nothing to release."""

    def sample(self) -> list[GpuSample]:
        now = float(self._clock())
        with self._lock:
            return [self._advance(g, now) for g in self._gpus]

    # -- control and ground truth -------------------------------------------------------------------
    def set_profile(self, gpu_index: int, profile: str | Profile | None) -> None:
        """Change a GPU's workload from its next sample on (``None`` = a free GPU)."""
        resolved = self._resolve(profile, gpu_index)
        with self._lock:
            self._gpu(gpu_index).profile = resolved

    def profile(self, gpu_index: int) -> str | None:
        p = self._gpu(gpu_index).profile
        return None if p is _FREE else p.name

    def truth(self, gpu_index: int) -> tuple[float, float]:
        """(energy joules, SM-active seconds) integrated since the first sample: the exact ground truth."""
        with self._lock:
            g = self._gpu(gpu_index)
            return g.truth_energy, g.truth_sm

    def uuid(self, gpu_index: int) -> str:
        return self._gpu(gpu_index).uuid

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    # -- internals ----------------------------------------------------------------------------------
    def _gpu(self, gpu_index: int) -> _Gpu:
        if not isinstance(gpu_index, int) or not 0 <= gpu_index < len(self._gpus):
            raise IndexError(f"simulated source {self.host!r}: no GPU index {gpu_index!r} (have {len(self._gpus)})")
        return self._gpus[gpu_index]

    @staticmethod
    def _resolve(profile: str | Profile | None, gpu_index: int) -> Profile:
        if profile is None:
            return _FREE
        if isinstance(profile, Profile):
            return profile
        try:
            return PROFILES[profile]
        except (KeyError, TypeError):
            raise ValueError(
                f"simulated source: unknown profile {profile!r} for GPU {gpu_index}; "
                f"known: {', '.join(sorted(PROFILES))} or None"
            ) from None

    def _advance(self, g: _Gpu, now: float) -> GpuSample:
        # A clock that steps back yields a zero-length interval, never negative energy.
        start = now if g.last_ts is None or now < g.last_ts else g.last_ts
        dt = now - start
        if g.anchor is None:
            g.anchor = now
        p = g.profile
        levels = p.busy
        if p.stall is not None:
            offset = g.anchor + g.stall_offset
            if dt > 0:
                stalled = _stalled_time(p, offset, now) - _stalled_time(p, offset, start)
                frac = _clip(stalled / dt)
            else:
                frac = 1.0 if (now - offset) % p.period_s < p.stall_s else 0.0
            levels = _blend(p.busy, p.stall, frac)

        rng = g.rng
        sigma = p.noise

        def noisy(x: float) -> float:
            # Exact zeros stay zero: an idle GPU reports SM 0, not jitter around it.
            return _clip(x + rng.gauss(0.0, sigma)) if x > 0.0 and sigma > 0.0 else x

        sm = noisy(levels.sm_active)
        occ = min(noisy(levels.sm_occupancy), sm) if levels.sm_occupancy > 0 else 0.0
        dram = noisy(levels.dram_bw)
        tensor = min(noisy(levels.tensor_active), sm) if levels.tensor_active > 0 else 0.0
        util = levels.gpu_util
        if util > 0 and sigma > 0:
            util = _clip(util + rng.gauss(0.0, sigma / 2))

        f = _clip(_W_SM * sm + _W_DRAM * dram + _W_TENSOR * tensor)
        span = self.tdp_watts - self.idle_watts
        power = self.idle_watts + span * f + abs(rng.gauss(0.0, 0.5)) + (rng.gauss(0.0, 3.0) if f > 0 else 0.0)
        power = _clip(power, self.idle_watts, self.tdp_watts)

        energy_step = power * dt
        g.energy += energy_step
        g.truth_energy += energy_step
        g.truth_sm += sm * dt
        g.last_ts = now if g.last_ts is None else max(g.last_ts, now)

        mem_used = int(self.mem_total_bytes * levels.mem_used_ratio)
        temp = _AMBIENT_C + _TEMP_RISE_C * (power - self.idle_watts) / span + rng.gauss(0.0, 0.3)
        return GpuSample(
            ts=now,
            host=self.host,
            gpu_uuid=g.uuid,
            gpu_index=g.index,
            model=self.model,
            sm_active_ratio=sm,
            sm_occupancy_ratio=occ,
            dram_bw_ratio=dram,
            tensor_active_ratio=tensor,
            gpu_util_ratio=util,
            mem_used_bytes=mem_used,
            mem_total_bytes=self.mem_total_bytes,
            power_watts=power,
            energy_joules=g.energy,
            temp_celsius=round(temp, 1),
            sm_clock_hz=_BOOST_CLOCK_HZ if util > 0.0 else _IDLE_CLOCK_HZ,
            # Derived, not drawn, so the random stream (and every value above) stays as it was for a seed.
            fp64_active_ratio=0.0,
            fp32_active_ratio=0.15 * sm,
            fp16_active_ratio=0.5 * tensor,
            mem_copy_util_ratio=dram,
            mem_clock_hz=_HBM_CLOCK_HZ,
            pcie_tx_bytes_per_second=2.0e9 * dram,
            pcie_rx_bytes_per_second=6.0e9 * dram,
            throttle_reasons=(_THROTTLE_IDLE if util == 0.0
                              else _THROTTLE_SW_POWER_CAP if power > 0.97 * self.tdp_watts else 0),
            ecc_errors_total=0,
            remapped_rows_total=0,
            job_ids=g.job_ids,
            source=self.name,
        )
