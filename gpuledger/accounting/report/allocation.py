"""A job's Slurm allocation split over the nodes and GPU models it was measured on: one rule for ``report usage``
(its rows by node and by model, and the price of the GPU-time nobody measured) and ``report reconcile``.

sacct's AllocTRES is the job's total, per typed ``gres/gpu:<type>`` at best, never per node. So a job's allocated
GPU-seconds go first to nodes (:func:`node_allocation`), then, on each node, to models: a Slurm type to the
measured models there that it names (``charge.gres_names``: ``nvidia_h200`` names ``NVIDIA H200``); the untyped
part, or a type that names none of them, to the node's measured models that no type of the job names (a node
that misnames its GPU still measured the GPU Slurm allocated), in proportion to their observed GPU-seconds; else
it stands under Slurm's name ("" when untyped). A cell's unmeasured part is its shortfall (allocated less
observed there), scaled so that each node's cells add up to the node's unmeasured part and the nodes to the job's
(``jobs list``: allocated - observed, never below 0): a cell observed beyond its share never makes another count
twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gpuledger.accounting.charge import gres_names, physical_gpus
from gpuledger.schema.records import JobRecord, JobUsage

Cells = dict[tuple[str, str], tuple[float, float]]  # (host, model) -> (allocated, unmeasured) GPU-seconds


def node_allocation(record: JobRecord | None, gpu_usages: Sequence[JobUsage], slurm_s: float,
                    missing: float) -> dict[str, tuple[float, float]]:
    """A job's Slurm allocation per node: host -> (allocated, unmeasured) GPU-seconds; they add up to ``slurm_s``
    and ``missing``, the job's own figures.

    Split over the nodes its record lists (else the nodes the agents measured it on, else "(unknown)") evenly,
    unless the agents saw every one of those nodes' GPUs: then by their GPU count (``--gpus=3`` over 2 nodes is
    2 + 1). A node's unmeasured part is its shortfall (its share less what the agents observed there), scaled so
    that they add up to the job's unmeasured GPU-seconds."""
    hosts = tuple(dict.fromkeys(record.hosts if record is not None else ())) or tuple(
        dict.fromkeys(u.host for u in gpu_usages)) or ("(unknown)",)
    observed: dict[str, float] = {}
    gpus: dict[str, set[str]] = {}
    for u in gpu_usages:
        observed[u.host] = observed.get(u.host, 0.0) + u.allocated_gpu_seconds
        gpus.setdefault(u.host, set()).add(u.gpu_uuid)
    n_seen = sum(len(g) for g in gpus.values())
    # "*": a job-level record (no per-GPU records loaded) says nothing of the GPUs per node
    if (len(hosts) > 1 and record is not None and set(gpus) == set(hosts) and all("*" not in g for g in gpus.values())
            and n_seen == physical_gpus(record)):
        shares = {h: slurm_s * len(gpus[h]) / n_seen for h in hosts}
    else:
        shares = {h: slurm_s / len(hosts) for h in hosts}
    return {h: (shares[h], short) for h, short in
            _scaled_shortfalls(shares, observed, missing).items()}


def allocation_cells(record: JobRecord | None, alloc: Mapping[str, float] | None, gpu_usages: Sequence[JobUsage],
                     missing: float) -> Cells:
    """A job's Slurm allocation (``alloc``: ``charge.allocation``, per Slurm model) per (host, model), the model
    as measured, else as Slurm names it ("" untyped), by the rule of this module; every node
    :func:`node_allocation` gives the job has a cell, with zeros for a job that allocated nothing."""
    alloc = alloc or {}
    slurm_s = math.fsum(alloc.values())
    if len(alloc) == 1 and len(gpu_usages) == 1:
        u = gpu_usages[0]
        if u.allocated_gpu_seconds > 0 and (record is None or record.hosts in ((), (u.host,))):
            # one node, one GPU record, one Slurm model: all of it is that record's (what the rule below gives;
            # most jobs, and the usage report's speed)
            return {(u.host, u.model): (slurm_s, missing)}
    observed: dict[tuple[str, str], float] = {}
    for u in gpu_usages:
        observed[(u.host, u.model)] = observed.get((u.host, u.model), 0.0) + u.allocated_gpu_seconds
    named = [t for t in alloc if t]
    by_host = node_allocation(record, gpu_usages, slurm_s, missing)
    cells: dict[tuple[str, str], float] = {}
    for host, (share, _) in by_host.items():
        here = {m: s for (h, m), s in observed.items() if h == host}
        unclaimed = {m: s for m, s in here.items() if not any(gres_names(t, m) for t in named)}
        for t, seconds in alloc.items():
            part = seconds * share / slurm_s if slurm_s > 0 else 0.0
            to = {m: s for m, s in here.items() if t and gres_names(t, m)} or unclaimed
            total = math.fsum(to.values())
            if total > 0:
                for m, s in to.items():
                    cells[(host, m)] = cells.get((host, m), 0.0) + part * s / total
            else:
                cells[(host, t)] = cells.get((host, t), 0.0) + part
        if not here and not any(h == host for h, _ in cells):  # allocated nothing (or never ran) and unmeasured
            cells[(host, record.gpu_model if record is not None and record.gpu_model else "")] = 0.0
    out: Cells = {}
    for host, (_, host_short) in by_host.items():
        mine = {m: s for (h, m), s in cells.items() if h == host}
        seen = {m: s for (h, m), s in observed.items() if h == host}
        for m, short in _scaled_shortfalls(mine, seen, host_short).items():
            out[(host, m)] = (mine[m], short)
    return out


def _scaled_shortfalls(allocated: Mapping[str, float], observed: Mapping[str, float],
                       missing: float) -> dict[str, float]:
    """Each key's allocated less observed (never below 0), scaled so that they add up to ``missing``."""
    short = {k: max(0.0, s - observed.get(k, 0.0)) for k, s in allocated.items()}
    total = math.fsum(short.values())
    if total != missing:
        scale = missing / total if total > 0.0 else 0.0
        short = {k: v * scale for k, v in short.items()}
    return short
