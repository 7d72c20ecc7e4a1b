"""The per-job efficiency report an admin sends to a user (in the spirit of Princeton's jobstats).

Per GPU: SM activity, SM occupancy, HBM bandwidth, tensor activity, memory peak, power peak, energy, and the
Xid errors and clock-throttle events found in the GPU's samples while the job held it. Then efficiency notes from
configurable rules, each with the numbers behind it:

``idle_gpu``        a GPU whose mean SM activity is below ``idle_sm``
``low_efficiency``  the job's SM-active / allocated GPU-time is below ``low_efficiency``
``memory_bound``    mean HBM bandwidth utilisation >= ``memory_bound_dram`` while tensor activity (where reported)
                    stays below ``memory_bound_tensor``: the job waits on memory, not on compute
``fewer_gpus``      the job's summed SM activity and memory peaks fit on fewer GPUs, packing to ``fit_sm`` SM
                    activity and ``fit_mem`` of each GPU's memory
``mig_slice``       a one-GPU job on a MIG-capable GPU that fits a MIG slice under the same packing targets
``xid``             Xid errors (with what the common codes mean)
``throttling``      thermal or power clock-throttling in more than ``throttle_share`` of the samples

Rules read only the per-GPU usage records and the raw samples of those GPUs (``store.series``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, cast

from gpuledger.accounting.report.period import iso_utc
from gpuledger.accounting.scope import OUT_OF_SCOPE_REASONS, OutOfScope
from gpuledger.collector.ledger_store import LedgerReader
from gpuledger.collector.series_store import RAW, SeriesReader
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage, split_gpu_id

GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class Rules:
    idle_sm: float = 0.05
    low_efficiency: float = 0.30
    memory_bound_dram: float = 0.60
    memory_bound_tensor: float = 0.20
    fit_sm: float = 0.80
    fit_mem: float = 0.90
    throttle_share: float = 0.10

    @classmethod
    def from_mapping(cls, m: Mapping[str, float], where: str = "report.rules") -> Rules:
        """From the ``[report.rules]`` table; every value a ratio in 0..1 (fit targets > 0)."""
        known = {f.name for f in fields(cls)}
        kw = {}
        for k, v in m.items():
            if k not in known:
                raise ValueError(f"{where}.{k}: unknown rule setting (known: {', '.join(sorted(known))})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{where}.{k}: expected a ratio in 0..1, got {v!r}")
            if k.startswith("fit_") and v == 0:
                raise ValueError(f"{where}.{k}: a packing target must be > 0")
            kw[k] = float(v)
        return cls(**kw)


# NVML clock-event (throttle) reason bits; the ones that mean "slowed by heat or power" are flagged.
THROTTLE_BITS: dict[int, tuple[str, bool]] = {
    0x1: ("gpu_idle", False),
    0x2: ("applications_clocks", False),
    0x4: ("sw_power_cap", True),
    0x8: ("hw_slowdown", True),
    0x10: ("sync_boost", False),
    0x20: ("sw_thermal", True),
    0x40: ("hw_thermal", True),
    0x80: ("hw_power_brake", True),
    0x100: ("display_clocks", False),
}
XID_MEANING: dict[int, str] = {
    13: "graphics engine exception (often an application bug)",
    31: "GPU memory page fault (often an application bug)",
    43: "GPU stopped processing",
    45: "preemptive cleanup after a fault",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# GPUs with MIG; slices (compute sevenths, memory eighths) of the standard profiles 1g, 2g, 3g, 4g, 7g.
MIG_MODELS: tuple[str, ...] = ("A100", "A30", "H100", "H200", "H20", "H800", "B200", "B100", "GB200", "GH200")
MIG_SLICES: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (3, 4), (4, 4), (7, 8))


class JobReportSource(LedgerReader, SeriesReader, Protocol):
    """A job's records and usage from the ledger, its GPUs' raw samples from the series store."""


@dataclass(frozen=True, slots=True)
class GpuEvents:
    samples: int = 0  # samples of this GPU that carried the job
    mem_total_bytes: int | None = None
    xid: dict[int, int] = field(default_factory=dict)  # code -> samples reporting it
    throttle: dict[str, int] = field(default_factory=dict)  # reason -> samples with the bit set


@dataclass(frozen=True, slots=True)
class GpuView:
    usage: JobUsage
    events: GpuEvents


@dataclass(frozen=True, slots=True)
class Note:
    rule: str
    message: str
    numbers: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Coverage:
    """Slurm's allocation against what agents observed (``accounting.charge``)."""

    seen_by: str  # both | slurm | agent
    slurm_gpu_seconds: float | None  # None without a scheduler record
    observed_gpu_seconds: float
    coverage: float | None
    unmeasured_gpu_seconds: float
    gap_energy_joules: float = 0.0  # unattributed gap energy Slurm's record reassigned to the job (``gaps``)
    # measured outside Slurm's record of the job (``accounting.scope``): not observed above, never charged
    out_of_scope_gpu_seconds: float = 0.0
    out_of_scope_energy_joules: float = 0.0


@dataclass(frozen=True, slots=True)
class JobReport:
    job_id: str
    record: JobRecord | None
    total: JobUsage | None
    gpus: list[GpuView]
    notes: list[Note]
    cluster: str = ""
    allocation: Coverage | None = None
    out_of_scope: tuple[OutOfScope, ...] = ()  # what was cut, per GPU record, and why (``LedgerEntry``)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "cluster": self.cluster,
            "allocation": asdict(self.allocation) if self.allocation else None,
            "out_of_scope": [c.to_dict() for c in self.out_of_scope],
            "record": self.record.to_dict() if self.record else None,
            "total": self.total.to_dict() if self.total else None,
            "gpus": [{"usage": g.usage.to_dict(),
                      "events": {**asdict(g.events), "xid": {str(k): v for k, v in g.events.xid.items()}}}
                     for g in self.gpus],
            "notes": [asdict(n) for n in self.notes],
        }


def gpu_events(samples: Iterable[GpuSample], job_id: str) -> GpuEvents:
    """Xid and throttle counts (and the memory size) over the samples of one GPU that carry ``job_id``."""
    n, mem_total = 0, None
    xid: Counter[int] = Counter()
    thr: Counter[str] = Counter()
    for s in samples:
        if job_id not in s.job_ids:
            continue
        n += 1
        if s.mem_total_bytes is not None:
            mem_total = max(mem_total or 0, s.mem_total_bytes)
        for code in set(s.xid_errors):
            xid[code] += 1
        if s.throttle_reasons:
            for bit, (name, _) in THROTTLE_BITS.items():
                if s.throttle_reasons & bit:
                    thr[name] += 1
    return GpuEvents(n, mem_total, dict(sorted(xid.items())), dict(sorted(thr.items())))


def load_job_report(store: JobReportSource, job_id: str, rules: Rules | None = None, cluster: str | None = None,
                    now: float | None = None) -> JobReport:
    """Gather a job's records from the store (``job_records``, ``job_usage``, ``series``) and build its report.

    Raises LookupError when the store knows nothing of the job, or when the id is in several clusters and
    ``cluster`` does not say which.
    """
    import time

    from gpuledger.accounting.charge import allocated_gpu_seconds
    from gpuledger.accounting.ledger import gap_attribution, join

    entries = join([(r, src) for r, src in store.job_records() if r.job_id == job_id], store.job_usage(job_id),
                   store.job_usage(job_id, per_gpu=True), gap_attribution(store, now).by_job(), now)
    if cluster is not None:
        entries = [e for e in entries if e.cluster == cluster]
    if not entries:
        where = f" in cluster {cluster!r}" if cluster is not None else ""
        raise LookupError(f"job {job_id}{where}: neither a scheduler record nor a measurement in the store")
    if len(entries) > 1:
        raise LookupError(f"job {job_id} is in clusters {', '.join(repr(e.cluster) for e in entries)}: "
                          f"name one with --cluster")
    (e,) = entries
    record, total, per_gpu = e.described, e.usage, e.gpus
    slurm_s = allocated_gpu_seconds(e.record, time.time() if now is None else now)
    observed = total.allocated_gpu_seconds if total is not None else 0.0
    coverage = Coverage(e.seen_by, slurm_s, observed, observed / slurm_s if slurm_s else None,
                        0.0 if slurm_s is None else max(0.0, slurm_s - observed), e.gap_energy_joules,
                        e.out_of_scope_gpu_seconds, e.out_of_scope_energy_joules)
    views = []
    for u in per_gpu:
        uuid, mig = split_gpu_id(u.gpu_uuid)
        # the raw tier: events need every sample (none left once raw retention dropped them)
        samples = cast(list[GpuSample], store.series(u.host, uuid, u.first_ts, u.last_ts, mig=mig or None, tier=RAW))
        ev = gpu_events(samples, job_id)
        views.append(GpuView(u, ev))
    return build_job_report(job_id, record, total, views, rules or Rules(), e.cluster, coverage, e.out_of_scope)


def build_job_report(
    job_id: str, record: JobRecord | None, total: JobUsage | None, gpus: Sequence[GpuView], rules: Rules,
    cluster: str = "", coverage: Coverage | None = None, out_of_scope: Sequence[OutOfScope] = (),
) -> JobReport:
    return JobReport(job_id, record, total, list(gpus), efficiency_notes(total, gpus, rules), cluster, coverage,
                     tuple(out_of_scope))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def efficiency_notes(total: JobUsage | None, gpus: Sequence[GpuView], r: Rules) -> list[Note]:
    notes: list[Note] = []
    if total is None or not gpus:
        return notes
    idle = []
    for g in gpus:
        u = g.usage
        if u.sm_active_mean is not None and u.sm_active_mean < r.idle_sm:
            idle.append(g)
            notes.append(Note("idle_gpu", f"GPU {u.host}/{u.gpu_uuid} was idle: mean SM activity "
                              f"{_pct(u.sm_active_mean)} (< {_pct(r.idle_sm)}) over "
                              f"{u.allocated_gpu_seconds / 3600:.2f} allocated GPU-hours",
                              {"gpu": f"{u.host}/{u.gpu_uuid}", "sm_active_mean": u.sm_active_mean,
                               "threshold": r.idle_sm, "allocated_gpu_hours": u.allocated_gpu_seconds / 3600}))
    eff = total.efficiency
    if eff is not None and eff < r.low_efficiency and len(idle) < len(gpus):
        notes.append(Note("low_efficiency", f"the job kept its GPUs' SMs busy {_pct(eff)} of the allocated time "
                          f"(< {_pct(r.low_efficiency)}): {total.sm_active_gpu_seconds / 3600:.2f} of "
                          f"{total.allocated_gpu_seconds / 3600:.2f} GPU-hours",
                          {"efficiency": eff, "threshold": r.low_efficiency,
                           "sm_active_gpu_hours": total.sm_active_gpu_seconds / 3600,
                           "allocated_gpu_hours": total.allocated_gpu_seconds / 3600}))
    dram, tensor = total.dram_bw_mean, total.tensor_active_mean
    if dram is not None and dram >= r.memory_bound_dram and (tensor is None or tensor < r.memory_bound_tensor):
        notes.append(Note("memory_bound", f"memory-bound: mean HBM bandwidth utilisation {_pct(dram)} (>= "
                          f"{_pct(r.memory_bound_dram)}) with tensor activity {_pct(tensor)} and SM activity "
                          f"{_pct(total.sm_active_mean)}; larger batches or fused kernels raise arithmetic intensity",
                          {"dram_bw_mean": dram, "tensor_active_mean": tensor, "sm_active_mean": total.sm_active_mean,
                           "threshold_dram": r.memory_bound_dram, "threshold_tensor": r.memory_bound_tensor}))
    notes.extend(_fit_notes(total, gpus, r))
    for g in gpus:
        u, ev = g.usage, g.events
        for code, n in ev.xid.items():
            notes.append(Note("xid", f"GPU {u.host}/{u.gpu_uuid}: Xid {code} in {n} sample(s)"
                              + (f": {XID_MEANING[code]}" if code in XID_MEANING else ""),
                              {"gpu": f"{u.host}/{u.gpu_uuid}", "xid": code, "samples": n}))
        if ev.samples:
            hot = {k: v for k, v in ev.throttle.items()
                   if any(k == name and bad for name, bad in THROTTLE_BITS.values())}
            worst = max(hot.values(), default=0)
            if worst / ev.samples > r.throttle_share:
                notes.append(Note("throttling", f"GPU {u.host}/{u.gpu_uuid}: clocks throttled by heat or power in "
                                  f"{worst / ev.samples:.0%} of {ev.samples} samples "
                                  f"({', '.join(f'{k} {v}' for k, v in hot.items())})",
                                  {"gpu": f"{u.host}/{u.gpu_uuid}", "samples": ev.samples, "reasons": hot,
                                   "share": worst / ev.samples, "threshold": r.throttle_share}))
    return notes


def _fit_notes(total: JobUsage, gpus: Sequence[GpuView], r: Rules) -> list[Note]:
    """Would the job fit on fewer GPUs, or one GPU on a MIG slice? Only when activity and memory are known."""
    sms = [v for g in gpus if (v := g.usage.sm_active_mean) is not None]
    peaks = [v for g in gpus if (v := g.usage.mem_used_peak_bytes) is not None]
    sizes = [v for g in gpus if (v := g.events.mem_total_bytes) is not None]
    n = len(gpus)
    if not n or len(sms) < n or len(peaks) < n or len(sizes) < n:
        return []
    sm_sum = math.fsum(sms)
    mem_sum = sum(peaks)
    size = min(sizes)
    out = []
    if n > 1:
        k = max(1, math.ceil(sm_sum / r.fit_sm - 1e-9), math.ceil(mem_sum / (size * r.fit_mem) - 1e-9))
        if k < n:
            out.append(Note("fewer_gpus", f"would fit on {k} GPU(s) instead of {n}: summed SM activity {sm_sum:.2f} "
                            f"GPUs' worth (packing to {_pct(r.fit_sm)}), memory peaks {mem_sum / GIB:.1f} GiB of "
                            f"{size / GIB:.1f} GiB per GPU (packing to {_pct(r.fit_mem)})",
                            {"gpus": n, "fits_on": k, "sum_sm_active": sm_sum, "sum_mem_peak_bytes": mem_sum,
                             "mem_total_bytes": size, "fit_sm": r.fit_sm, "fit_mem": r.fit_mem}))
    model = total.model.upper()
    if n == 1 and any(m in model for m in MIG_MODELS) and "/" not in gpus[0].usage.gpu_uuid:
        sm, peak = sms[0], peaks[0]
        for g7, m8 in MIG_SLICES:
            if g7 / 7 * r.fit_sm >= sm and m8 / 8 * size * r.fit_mem >= peak:
                break
        if g7 < 7:
            out.append(Note("mig_slice", f"would fit a MIG {g7}g slice ({m8 / 8 * size / GIB:.0f} GiB): "
                            f"mean SM activity {_pct(sm)} of the whole GPU, memory peak {peak / GIB:.1f} GiB",
                            {"slice": f"{g7}g", "slice_compute": g7 / 7, "slice_mem_bytes": m8 / 8 * size,
                             "sm_active_mean": sm, "mem_peak_bytes": peak, "mem_total_bytes": size,
                             "fit_sm": r.fit_sm, "fit_mem": r.fit_mem}))
    return out


# -- rendering --------------------------------------------------------------------------------------------------
def to_json(rep: JobReport) -> str:
    return json.dumps(rep.to_dict(), indent=2)


def _f(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, spec)


def to_text(rep: JobReport) -> str:
    lines = [f"Job {rep.job_id}" + (f" (cluster {rep.cluster})" if rep.cluster else "")]
    r, t = rep.record, rep.total
    a = rep.allocation
    if a is not None and a.seen_by == "agent":
        lines.append("  (no scheduler record: measured only, seen_by agent"
                     + ("; user and account as an agent described them)" if r is not None else ")"))
    if a is not None and a.slurm_gpu_seconds is not None:
        lines.append(f"  Slurm allocated {a.slurm_gpu_seconds / 3600:.2f} GPU-h, "
                     f"observed {a.observed_gpu_seconds / 3600:.2f} GPU-h, coverage {_pct(a.coverage)}, "
                     f"unmeasured {a.unmeasured_gpu_seconds / 3600:.2f} GPU-h")
    for c in rep.out_of_scope:
        u = c.usage
        lines.append(f"  out of scope, not charged: {c.gpu_seconds / 3600:.2f} GPU-h, {c.energy_joules / 3.6e6:.3f} "
                     f"kWh on {u.host}/{u.gpu_uuid} ({c.reason}: {OUT_OF_SCOPE_REASONS.get(c.reason, c.reason)})")
    if a is not None and a.gap_energy_joules > 0:
        lines.append(f"  gap energy {a.gap_energy_joules / 3.6e6:.3f} kWh: unattributed counter delta across "
                     "sampling gaps while Slurm says the job held the node's GPUs (not in the total below)")
    if r is not None:
        lines.append(f"  user {r.user or '-'}  account {r.account or '-'}  partition {r.partition or '-'}  "
                     f"state {r.state or '-'}  GPUs {r.gpus if r.gpus is not None else '-'}")
        if r.start is not None and r.end is not None:
            lines.append(f"  run time {(r.end - r.start) / 3600:.2f} h" + (
                f", queued {(r.start - r.submit) / 3600:.2f} h" if r.submit is not None else ""))
        if r.earlier_runs:  # a requeued job: charged for every run
            lines.append(f"  requeued: {len(r.earlier_runs)} earlier run(s), " + ", ".join(
                f"{iso_utc(a)}..{iso_utc(b)} on {','.join(h) or '-'}" for a, b, h in r.earlier_runs))
    elif a is None:
        lines.append("  (no scheduler record: measured only)")
    if t is not None:
        lines.append(f"  allocated {t.allocated_gpu_seconds / 3600:.2f} GPU-h, "
                     f"SM-active {t.sm_active_gpu_seconds / 3600:.2f} GPU-h, efficiency {_pct(t.efficiency)}, "
                     f"energy {t.energy_joules / 3.6e6:.3f} kWh")
    else:
        lines.append("  (no measurement within Slurm's record of the job)" if rep.out_of_scope
                     else "  (no measurement)")
    if rep.gpus:
        head = ["GPU", "SM active", "SM occ.", "HBM bw", "Tensor", "Mem peak GiB", "Power peak W", "Energy kWh",
                "GPU-h", "Xid", "Throttle"]
        cells = [head]
        for g in rep.gpus:
            u, ev = g.usage, g.events
            cells.append([f"{u.host}/{u.gpu_uuid}", _pct(u.sm_active_mean), _pct(u.sm_occupancy_mean),
                          _pct(u.dram_bw_mean), _pct(u.tensor_active_mean), _f(u.mem_used_peak_bytes, ".1f", GIB),
                          _f(u.power_peak_watts, ".0f"), _f(u.energy_joules, ".3f", 3.6e6),
                          _f(u.allocated_gpu_seconds, ".2f", 3600),
                          ",".join(f"{k}x{v}" for k, v in ev.xid.items()) or "-",
                          ",".join(f"{k}:{v}" for k, v in ev.throttle.items()) or "-"])
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines.append("")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.append("")
    if rep.notes:
        lines.append("Efficiency notes:")
        lines += [f"  - [{n.rule}] {n.message}" for n in rep.notes]
    else:
        lines.append("Efficiency notes: none")
    return "\n".join(lines) + "\n"
