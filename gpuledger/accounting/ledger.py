"""The ledger: Slurm's job records joined with the agents' measurements, job by (cluster, job_id).

A job seen by only one side is kept and flagged, never silently dropped: ``seen_by`` is ``both``, ``slurm`` (no
measurement: charged at its allocation) or ``agent`` (no scheduler record: charged from measurements, described
at most by an agent's metadata).

Clusters: usage carries the cluster its agent named, scheduler records the one sacct printed. Either may be
unnamed (""): then it joins the other side's record of the same job id when exactly one cluster has that id.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuledger.accounting.gaps import GapAttribution, GapShare, reassign
from gpuledger.accounting.scope import OutOfScope, in_scope, mig_bounds, scaled
from gpuledger.collector.ledger_store import AGENT, SLURM, LedgerReader
from gpuledger.schema.records import JobRecord, JobUsage, job_sort_key

JobKey = tuple[str, str]  # (cluster, job_id)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    job_id: str
    record: JobRecord | None  # the scheduler's record (the authority)
    usage: JobUsage | None  # measured, summed over the job's GPUs
    cluster: str = ""
    agent_record: JobRecord | None = None  # an agent's description; used only without a scheduler record
    gpus: tuple[JobUsage, ...] = ()  # measured, per GPU
    gap_shares: tuple[GapShare, ...] = ()  # unattributed gap energy reassigned to the job (``gaps``)
    # measured usage outside the scheduler's record of the job (another host, other times; ``scope``): not in
    # ``usage`` or ``gpus``, never charged
    out_of_scope: tuple[OutOfScope, ...] = ()

    @property
    def gap_energy_joules(self) -> float:
        return math.fsum(s.energy_joules for s in self.gap_shares)

    @property
    def gap_gpu_seconds(self) -> float:
        return math.fsum(s.gpu_seconds for s in self.gap_shares)

    @property
    def energy_joules(self) -> float:
        """Measured energy: the agents' samples plus the gap energy reassigned by Slurm's record."""
        return (self.usage.energy_joules if self.usage is not None else 0.0) + self.gap_energy_joules

    @property
    def out_of_scope_gpu_seconds(self) -> float:
        """Observed GPU-seconds outside the scheduler's record of the job (``out_of_scope``): measured, not charged."""
        return math.fsum(c.gpu_seconds for c in self.out_of_scope)

    @property
    def out_of_scope_energy_joules(self) -> float:
        return math.fsum(c.energy_joules for c in self.out_of_scope)

    @property
    def out_of_scope_reasons(self) -> tuple[str, ...]:
        """Why (``scope.OutOfScope.reason``), each once, sorted."""
        return tuple(sorted({c.reason for c in self.out_of_scope}))

    @property
    def key(self) -> JobKey:
        return (self.cluster, self.job_id)

    @property
    def seen_by(self) -> str:
        """'both', 'slurm' (no measurement) or 'agent' (no scheduler record)."""
        if self.record is None:
            return "agent"
        return "both" if self.usage is not None else "slurm"

    @property
    def only(self) -> str | None:
        """'scheduler' when no measurement exists, 'measured' when Slurm does not know the job, else None."""
        return {"slurm": "scheduler", "agent": "measured"}.get(self.seen_by)

    @property
    def described(self) -> JobRecord | None:
        """Who the job belongs to: the scheduler's record, else the agent's description."""
        return self.record if self.record is not None else self.agent_record

    @property
    def account(self) -> str:
        d = self.described
        return d.account if d and d.account else "(unknown)"

    @property
    def user(self) -> str:
        d = self.described
        return d.user if d and d.user else "(unknown)"

    @property
    def measured(self) -> tuple[JobUsage, ...]:
        """Per-GPU usage records, or the job-level one where per-GPU records were not loaded."""
        return self.gpus or ((self.usage,) if self.usage is not None else ())

    @property
    def label(self) -> str:
        """The job id, with its cluster where one is named: ``1234@alpha``."""
        return f"{self.job_id}@{self.cluster}" if self.cluster else self.job_id


def _resolver(slurm_keys: Iterable[JobKey]) -> Callable[[JobKey], JobKey]:
    """Maps a key of the agents' side to the scheduler's key it names (see the module docstring)."""
    keys = set(slurm_keys)
    by_id: dict[str, list[str]] = {}
    for c, j in keys:
        by_id.setdefault(j, []).append(c)

    def resolve(key: JobKey) -> JobKey:
        if key in keys:
            return key
        cluster, job_id = key
        clusters = by_id.get(job_id, [])
        if cluster == "" and len(clusters) == 1:
            return (clusters[0], job_id)
        if "" in clusters:
            return ("", job_id)
        return key

    return resolve


# A heterogeneous job's component as earlier releases stored Slurm's record of it ("12+1": leader + offset). Slurm
# numbers a het job's components consecutively from the leader (HetJobId + HetJobOffset is the component's own job
# id, which agents measure and which imports now store), so such a record is read as the component's, unless the
# ledger holds the component's record under its own id (imported since), which stands.
_LEGACY_HET = re.compile(r"\d+\+\d+")


def join(records: Iterable[JobRecord | tuple[JobRecord, str]], usages: Iterable[JobUsage],
         per_gpu: Iterable[JobUsage] = (), gap_shares: Mapping[JobKey, tuple[GapShare, ...]] | None = None,
         now: float | None = None) -> list[LedgerEntry]:
    """Entries from job records (scheduler records, or (record, source) pairs from ``job_records()``), job-level
    usage, per-GPU usage and the gap energy reassigned to scheduler jobs (:func:`gap_attribution`); sorted by
    job id then cluster. A scheduler job's measured usage is held to its record (``scope``, with ``now`` for a
    job still running): what lies outside is kept aside in ``out_of_scope``, and the job-level usage is then
    the sum of what is left."""
    now = time.time() if now is None else now
    slurm: dict[JobKey, JobRecord] = {}
    agent: list[JobRecord] = []
    legacy: list[JobRecord] = []
    for item in records:
        rec, src = item if isinstance(item, tuple) else (item, SLURM)
        if src == AGENT:
            agent.append(rec)
        elif _LEGACY_HET.fullmatch(rec.job_id):
            legacy.append(rec)
        else:
            slurm[(rec.cluster, rec.job_id)] = rec
    for rec in legacy:  # after the records under raw ids, which supersede them
        leader, offset = rec.job_id.split("+")
        raw = str(int(leader) + int(offset))
        slurm.setdefault((rec.cluster, raw), replace(rec, job_id=raw))
    resolve = _resolver(slurm)
    by_agent: dict[JobKey, JobRecord] = {}
    for rec in agent:
        by_agent.setdefault(resolve((rec.cluster, rec.job_id)), rec)
    by_use: dict[JobKey, list[JobUsage]] = {}
    for u in usages:
        by_use.setdefault(resolve((u.cluster, u.job_id)), []).append(u)
    by_gpu: dict[JobKey, list[JobUsage]] = {}
    bounded: dict[JobKey, list[OutOfScope]] = {}  # records of a GPU counted more than once (scope.mig_bounds)
    per_gpu = list(per_gpu)
    bounds = mig_bounds(per_gpu)
    for i, u in enumerate(per_gpu):
        key = resolve((u.cluster, u.job_id))
        share = bounds.get(i)
        if share is not None:
            bounded.setdefault(key, []).append(OutOfScope(u, share, "mig"))
            if share <= 0.0:
                continue
            u = scaled(u, share)
        by_gpu.setdefault(key, []).append(u)
    keys = sorted(set(slurm) | set(by_use) | set(by_agent), key=lambda k: (job_sort_key(k[1]), k[0]))
    out = []
    for k in keys:
        uses = by_use.get(k, [])
        # an unnamed agent side joined to a named record: two usage records of one job (rare) are summed
        usage = uses[0] if len(uses) == 1 else (sum_usage(uses) if uses else None)
        gpus = tuple(by_gpu.get(k, ()))
        record = slurm.get(k)
        cut: tuple[OutOfScope, ...] = tuple(bounded.get(k, ()))
        if cut:  # the job-level record sums what is left of its GPUs
            usage = sum_usage(list(gpus)) if gpus else None
        if record is not None and (gpus or usage is not None):
            kept, outside = in_scope(record, gpus or (usage,), now)  # type: ignore[arg-type]
            if outside:
                if gpus:
                    gpus = kept
                usage = sum_usage(list(kept)) if kept else None
                cut += outside
        out.append(LedgerEntry(k[1], record, usage, k[0], by_agent.get(k), gpus,
                               (gap_shares or {}).get(k, ()) if k in slurm else (), cut))
    return out


def sum_usage(uses: list[JobUsage]) -> JobUsage:
    """Usage records of one job as one: sums add, peaks max, spans join; each mean weighted by its record's
    allocated GPU-seconds (the collector weights by the seconds the value was reported: the same where a source
    reports it throughout)."""
    first = uses[0]
    hosts = {u.host for u in uses}

    def mean(field: str) -> float | None:
        pairs = [(v, u.allocated_gpu_seconds) for u in uses if (v := getattr(u, field)) is not None]
        weight = math.fsum(w for _, w in pairs)
        return math.fsum(v * w for v, w in pairs) / weight if weight > 0 else (pairs[0][0] if pairs else None)

    def peak(field: str) -> Any:
        values = [v for u in uses if (v := getattr(u, field)) is not None]
        return max(values) if values else None

    return replace(first, host=first.host if len(hosts) == 1 else "*",
                   gpu_uuid=first.gpu_uuid if len(uses) == 1 else "*",
                   first_ts=min(u.first_ts for u in uses), last_ts=max(u.last_ts for u in uses),
                   samples=sum(u.samples for u in uses),
                   allocated_gpu_seconds=math.fsum(u.allocated_gpu_seconds for u in uses),
                   sm_active_gpu_seconds=math.fsum(u.sm_active_gpu_seconds for u in uses),
                   energy_joules=math.fsum(u.energy_joules for u in uses), gpus=sum(u.gpus for u in uses),
                   gap_gpu_seconds=math.fsum(u.gap_gpu_seconds for u in uses),
                   sm_active_mean=mean("sm_active_mean"), dram_bw_mean=mean("dram_bw_mean"),
                   tensor_active_mean=mean("tensor_active_mean"), sm_occupancy_mean=mean("sm_occupancy_mean"),
                   mem_used_peak_bytes=peak("mem_used_peak_bytes"), power_peak_watts=peak("power_peak_watts"))


@dataclass(frozen=True, slots=True)
class GapInputs:
    """What reassigning gap energy reads from the store: the gaps, each host's physical GPUs, each GPU's cluster."""

    gaps: tuple[dict, ...]
    gpus_per_host: Mapping[str, int]
    gpu_clusters: Mapping[tuple[str, str], str]

    def records(self) -> list[dict]:
        """The gaps as the audit log binds them: an unattributed one with the GPU count and the cluster its
        reassignment reads (a GPU added to the host later changes what an old gap charges)."""
        return [dict(g) if g["job_ids"] else {**g, "host_gpus": self.gpus_per_host.get(g["host"], 0),
                                               "cluster": self.gpu_clusters.get((g["host"], g["gpu_uuid"]), "")}
                for g in self.gaps]

    def holding(self, share: GapShare) -> list[dict]:
        """The unattributed gaps a share of energy came from (its span lies inside theirs, on its GPU)."""
        return [g for g in self.gaps if not g["job_ids"] and g["host"] == share.host
                and g["gpu_uuid"] == share.gpu_uuid and g["start"] <= share.start and share.end <= g["end"]]


def gap_inputs(store: LedgerReader, start: float | None = None, end: float | None = None) -> GapInputs:
    """The store's gaps that ended in [start, end), with what :func:`gap_attribution` reads beside them."""
    per_host: dict[str, int] = {}
    for g in store.gpu_energy():
        per_host[g["host"]] = per_host.get(g["host"], 0) + 1
    clusters = {(h["host"], h["gpu_uuid"]): h["cluster"] for h in store.gpu_hours() if not h["mig"]}
    return GapInputs(tuple(store.energy_gaps(start, end)), per_host, clusters)


def gap_attribution(store: LedgerReader, now: float | None = None, start: float | None = None,
                    end: float | None = None, inputs: GapInputs | None = None) -> GapAttribution:
    """The store's unattributed gaps (ended in [start, end); or ``inputs``, as bound to the audit log)
    reassigned to its scheduler records (``gaps``); a host's GPU count is the physical GPUs the collector knows
    on it."""
    inputs = gap_inputs(store, start, end) if inputs is None else inputs
    slurm = [r for r, src in store.job_records() if src != AGENT]
    return reassign(inputs.gaps, slurm, inputs.gpus_per_host, time.time() if now is None else now,
                    inputs.gpu_clusters)


def load(store: LedgerReader, now: float | None = None, gaps: GapAttribution | None = None) -> list[LedgerEntry]:
    """Every job of the store, with the gap energy reassigned to it (``gaps``, else :func:`gap_attribution`)."""
    gaps = gap_attribution(store, now) if gaps is None else gaps
    return join(store.job_records(), store.job_usage(), store.job_usage(per_gpu=True), gaps.by_job(), now)


