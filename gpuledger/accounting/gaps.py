"""Unattributed gap energy reassigned to the jobs Slurm says held the GPU during the gap.

The collector charges a gap's counter delta (``energy_gaps``) to jobs only when its own samples on both sides
carry the same jobs; otherwise it stays unattributed. The scheduler's records (never an agent's description)
can still say who held the GPU meanwhile. For each unattributed gap of length L on GPU g of host h, each
scheduler job j that ran on h (``hosts``) with overlap o_j (seconds of [start, end or now] inside the gap; a
requeued job: each of its runs, on its own hosts) gets

    share_j = o_j / L x f_j,   f_j = 1 if Slurm names g among the job's GPU UUIDs,
                               f_j = 0 if it names UUIDs and g is not one of them,
                               f_j = min(1, k_j / n_h) otherwise,

where k_j is the job's GPUs on h (Slurm's allocated GPUs / its hosts, as reconcile splits them; a MIG slice
counts its fraction) and n_h the
physical GPUs the collector knows on h. Without GPU identities the job is taken to hold each of the host's GPUs
for k/n of the time, the expectation when any k of n could be its: on a host with several jobs, the shares
are then even over the GPUs rather than guessed. If the shares of one gap sum above 1 (an oversubscribed host,
or clock skew), all are scaled down to sum to 1: never more energy than the gap holds. The job gets
``energy x share_j``, placed in time evenly over its overlap with the gap (which spans the hour buckets it fell
in); the gap's remainder stays unattributed. Equal inputs give equal outputs: gaps and jobs are taken in a
fixed order and sums are ``math.fsum``.

A GPU in MIG mode: its instances charge their own jobs for a gap they held (each its slice), and record it; the
physical GPU's record of that gap then says no jobs (its rows carry none), yet is not unattributed. A physical gap
that overlaps a gap one of its instances held is not reassigned: what the instances did not hold stays
unattributed rather than be charged twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuledger.accounting.charge import physical_gpus
from gpuledger.accounting.scope import job_runs
from gpuledger.schema.records import JobRecord

JobKey = tuple[str, str]  # (cluster, job_id)


@dataclass(frozen=True, slots=True)
class GapShare:
    """Part of one gap's energy charged to one job, with the time it covers (placed evenly over [start, end])."""

    cluster: str
    job_id: str
    host: str
    gpu_uuid: str
    start: float
    end: float
    energy_joules: float
    gpu_seconds: float  # the job's GPU-time in the gap: overlap x its share of the GPU


@dataclass(frozen=True, slots=True)
class GapAttribution:
    shares: tuple[GapShare, ...]
    remaining: tuple[tuple[Mapping, float], ...]  # (unattributed gap record, energy still unattributed)

    def by_job(self) -> dict[JobKey, tuple[GapShare, ...]]:
        out: dict[JobKey, list[GapShare]] = {}
        for s in self.shares:
            out.setdefault((s.cluster, s.job_id), []).append(s)
        return {k: tuple(v) for k, v in out.items()}

    def reassigned_joules(self) -> float:
        return math.fsum(s.energy_joules for s in self.shares)

    def unattributed_joules(self) -> float:
        return math.fsum(r for _, r in self.remaining)


def reassign(gaps: Iterable[Mapping], records: Iterable[JobRecord], gpus_per_host: Mapping[str, int],
             now: float, gpu_clusters: Mapping[tuple[str, str], str] | None = None) -> GapAttribution:
    """Reassign the unattributed gaps (``store.energy_gaps()`` rows with no jobs) to scheduler ``records`` by
    the module's rule; ``gpus_per_host`` counts each host's physical GPUs (hosts not in it: each job gets its
    overlap share, scaled as above). ``gpu_clusters``: (host, GPU UUID) -> the cluster its agent named; a job
    of another named cluster on a host of the same name is not its holder."""
    gpu_clusters = gpu_clusters or {}
    # host -> (record, one of its runs' start, end, GPU UUIDs and GPUs on each of its hosts)
    by_host: dict[str, list[tuple[JobRecord, float, float | None, tuple[str, ...], float]]] = {}
    for r in sorted(records, key=lambda r: (r.cluster, r.job_id)):
        # each run that started (scope.job_runs: a requeued job's earlier runs, then the latest) holds Slurm's
        # allocation split evenly over its own hosts; only the latest run's GPUs are known (Slurm's record keeps
        # those alone)
        latest = len(r.earlier_runs)
        for i, (start, end, hosts) in enumerate(job_runs(r)):
            uuids = r.gpu_uuids if i == latest else ()
            for h in dict.fromkeys(hosts):
                by_host.setdefault(h, []).append((r, start, end, uuids, physical_gpus(r) / max(1, len(hosts))))
    gaps = list(gaps)
    held_by_instances: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (host, GPU) -> held MIG gap spans
    for g in gaps:
        if g.get("mig") and g["job_ids"]:
            held_by_instances.setdefault((g["host"], g["gpu_uuid"]), []).append((float(g["start"]), float(g["end"])))
    shares: list[GapShare] = []
    remaining: list[tuple[Mapping, float]] = []
    for g in sorted(gaps, key=lambda g: (g["host"], g["gpu_uuid"], g.get("mig") or "", g["start"], g["end"])):
        if g["job_ids"]:
            continue
        lo, hi = float(g["start"]), float(g["end"])
        if any(a < hi and lo < b for a, b in held_by_instances.get((g["host"], g["gpu_uuid"]), ())):
            continue  # charged by the GPU's MIG instances already
        energy = float(g["energy_joules"])
        length = hi - lo
        found: list[tuple[JobRecord, float, float, float]] = []
        if length > 0 and energy > 0:
            n = gpus_per_host.get(g["host"], 0)
            cluster = gpu_clusters.get((g["host"], g["gpu_uuid"]), "")
            for r, began, ended, uuids, on_host in by_host.get(g["host"], ()):
                if cluster and r.cluster and r.cluster != cluster:
                    continue
                a = max(lo, began)
                b = min(hi, ended if ended is not None else now)
                if b <= a:
                    continue
                if uuids:
                    frac = 1.0 if g["gpu_uuid"] in uuids else 0.0
                else:
                    frac = min(1.0, on_host / n) if n > 0 else 1.0
                if frac > 0:
                    found.append((r, a, b, (b - a) / length * frac))
        total = math.fsum(s for *_, s in found)
        scale = 1.0 / total if total > 1.0 else 1.0
        given = []
        for r, a, b, s in found:
            j = energy * s * scale
            given.append(j)
            shares.append(GapShare(r.cluster, r.job_id, g["host"], g["gpu_uuid"], a, b, j, length * s * scale))
        remaining.append((g, max(0.0, energy - math.fsum(given))))
    return GapAttribution(tuple(shares), tuple(remaining))
