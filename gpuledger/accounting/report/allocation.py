"""A job's Slurm allocation split over the nodes and GPU models it was measured on: one rule for ``report usage``
(its rows by node and by model, and the price of the GPU-time nobody measured) and ``report reconcile``.

sacct's AllocTRES is the job's total, per typed ``gres/gpu:<type>`` at best, never per node. So a job's allocated
GPU-seconds go to nodes first (:func:`node_allocation`: each node's share, and its unmeasured part, the node's
shortfall, adding up to the job's unmeasured GPU-seconds as ``jobs list`` counts them: allocated - observed, never
below 0), then to (node, model) cells, each Slurm model ("" untyped) of the job as a whole:

1. to the GPUs measured as a model it names (``charge.gres_names``, the rule of ``charge.model_value``:
   ``nvidia_h200`` names ``NVIDIA H200``); the untyped part, and a type naming no measured model, to the GPUs
   measured as a model no type names; in proportion to what each has, never beyond its allocation;
2. what was measured as a model no type names and no such part held (a node that misnames its GPU still measured
   the GPU Slurm allocated): the rest of any Slurm model;
3. its part of the job's unmeasured GPU-seconds (in proportion to what it has left after 1 and 2) over the nodes'
   unmeasured parts: first on the nodes where it was measured, then on nodes where nothing of the job was, only
   then on a node measured as another Slurm model's (when nothing else can hold it: AllocTRES does not say);
4. the rest of each node's share to the Slurm models measured there, then what remains of each Slurm model.

A cell stands under the measured model the Slurm model held on that node, else under Slurm's name. So each
Slurm model's cells add up to its allocation, and their unmeasured parts to its allocation less what was measured
as it (where nothing was measured beyond a model's allocation: observed beyond it, by clock skew or the scope's
slack, still lowers the job's unmeasured GPU-seconds as a whole, as ``jobs list`` counts them); each node's cells
add up to its share and its unmeasured part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

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
    by_host = node_allocation(record, gpu_usages, slurm_s, missing)
    left = {t: s for t, s in alloc.items() if s > 0}
    models = {m for _, m in observed}
    namers = {m: [t for t in left if t and gres_names(t, m)] for m in models}
    free = [t for t in left if not any(t and gres_names(t, m) for m in models)]  # untyped, or naming none
    covered: dict[tuple[str, str, str], float] = {}  # (Slurm model, host, model) -> allocated GPU-seconds
    # 1. job-wide, each Slurm model to the GPUs measured as a model it names (the untyped part, and a type naming
    #    none, to those no type names), up to its allocation
    _cover(covered, left, observed, lambda m: namers[m] or free)
    # 2. what was measured as a model no type names and no free part held (a node misnaming its GPU): the rest of
    #    any Slurm model
    held: dict[tuple[str, str], float] = {}
    for (_, h, m), s in covered.items():
        held[(h, m)] = held.get((h, m), 0.0) + s
    _cover(covered, left, {k: s - held.get(k, 0.0) for k, s in observed.items() if not namers[k[1]]},
           lambda m: list(left))
    # 3. each Slurm model's part of the job's unmeasured GPU-seconds (in proportion to what it has left) over the
    #    nodes' shortfalls, first where it was measured, then where nothing of the job was
    rest = math.fsum(left.values())
    weights = left if rest > 0 else {t: s for t, s in alloc.items() if s > 0}
    total_w = math.fsum(weights.values())
    unmeasured = {t: missing * w / total_w for t, w in weights.items()} if missing > 0 and total_w > 0 else {}
    where: dict[str, set[str]] = {}  # Slurm model -> the nodes where it held measured GPUs
    for t, h, _ in covered:
        where.setdefault(t, set()).add(h)
    shares = {h: share for h, (share, _) in by_host.items()}
    short_at = _spread(unmeasured, {h: short for h, (_, short) in by_host.items()}, where, shares)
    # 4. the rest of each node's share (its share less its unmeasured part) to the Slurm models measured there,
    #    none beyond what they held, then the rest of each Slurm model's allocation over what is left of the nodes'
    #    shares, by the order of 3
    held_at: dict[tuple[str, str], float] = {}
    for (t, h, _), s in covered.items():
        held_at[(t, h)] = held_at.get((t, h), 0.0) + s
    on_host: dict[str, float] = {}
    for (_, h), s in held_at.items():
        on_host[h] = on_host.get(h, 0.0) + s
    room = {h: max(0.0, share - short) for h, (share, short) in by_host.items()}
    alloc_at = {(t, h): s * min(1.0, room[h] / on_host[h]) for (t, h), s in held_at.items() if h in room}
    type_left = {t: s - unmeasured.get(t, 0.0) for t, s in alloc.items() if s > 0}
    for (t, h), s in alloc_at.items():
        type_left[t] -= s
        room[h] -= s
    for key, s in _spread(type_left, room, where, shares).items():
        alloc_at[key] = alloc_at.get(key, 0.0) + s
    for key, s in short_at.items():
        alloc_at[key] = alloc_at.get(key, 0.0) + s
    cells: dict[tuple[str, str], list[float]] = {}
    for i, placed in ((0, alloc_at), (1, short_at)):
        for (t, h), s in placed.items():
            # on a node, as the measured models this Slurm model held there (in proportion), else as Slurm names it
            mine = {m: c for (tt, hh, m), c in covered.items() if tt == t and hh == h}
            total = math.fsum(mine.values())
            for m, c in (mine.items() if total > 0 else ((t, 1.0),)):
                cells.setdefault((h, m), [0.0, 0.0])[i] += s * (c / total if total > 0 else 1.0)
    for host in by_host:
        if not any(h == host for h, _ in cells):  # allocated nothing (or never ran) and unmeasured
            cells[(host, record.gpu_model if record is not None and record.gpu_model else "")] = [0.0, 0.0]
    return {k: (a, s) for k, (a, s) in cells.items()}


def _cover(covered: dict[tuple[str, str, str], float], left: dict[str, float],
           observed: Mapping[tuple[str, str], float], claimants: Callable[[str], Sequence[str]]) -> None:
    """Observed GPU-seconds per (host, model) allocated (into ``covered``) to the Slurm models ``claimants`` names
    for the model, in proportion to what each has ``left``, none beyond it; ``left`` follows."""
    asked: dict[str, list[tuple[tuple[str, str], float]]] = {}
    for (h, m), s in observed.items():
        ts = [t for t in claimants(m) if left.get(t, 0.0) > 0]
        w = math.fsum(left[t] for t in ts)
        if s <= 0 or w <= 0:
            continue
        for t in ts:
            asked.setdefault(t, []).append(((h, m), s * left[t] / w))
    for t, asks in asked.items():
        total = math.fsum(a for _, a in asks)
        f = min(1.0, left[t] / total)
        for (h, m), a in asks:
            covered[(t, h, m)] = covered.get((t, h, m), 0.0) + a * f
        left[t] = max(0.0, left[t] - total * f)


def _spread(amounts: Mapping[str, float], room: Mapping[str, float], where: Mapping[str, set[str]],
            fallback: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """Each Slurm model's amount (GPU-seconds) over the nodes' room: first on the nodes where it was measured
    (``where``), then on the nodes where no Slurm model was (nothing of the job measured there), then on any node
    with room left, each in proportion to what is left and the room; what no room holds (rounding) in proportion
    to ``fallback``. So a Slurm model lands on a node that measured another one's GPUs only when nothing else can
    hold it."""
    left = {t: a for t, a in amounts.items() if a > 0}
    free = {h: c for h, c in room.items() if c > 0}
    out: dict[tuple[str, str], float] = {}
    eps = 1e-12 * max(1.0, math.fsum(left.values()))

    def put(t: str, h: str, x: float) -> None:
        if x > 0:
            out[(t, h)] = out.get((t, h), 0.0) + x
            left[t] -= x
            free[h] = free.get(h, 0.0) - x

    offers = {}
    for h, c in free.items():
        ts = [t for t in left if h in where.get(t, ())]
        w = math.fsum(left[t] for t in ts)
        for t in ts:
            offers[(t, h)] = c * left[t] / w
    asked: dict[str, float] = {}
    for (t, _), o in offers.items():
        asked[t] = asked.get(t, 0.0) + o
    cut = {t: min(1.0, left[t] / a) for t, a in asked.items()}
    for (t, h), o in offers.items():
        put(t, h, o * cut[t])
    known = set().union(*where.values())
    for hosts in ([h for h in free if h not in known], list(free)):
        todo = {t: a for t, a in left.items() if a > eps}
        space = {h: free[h] for h in hosts if free[h] > eps}
        d = max(math.fsum(todo.values()), math.fsum(space.values()))
        for t, a in todo.items():
            for h, c in space.items():
                put(t, h, a * c / d)
    todo = {t: a for t, a in left.items() if a > eps}
    weights = {h: w for h, w in fallback.items() if w > 0} or dict.fromkeys(room, 1.0)
    w_total = math.fsum(weights.values())
    for t, a in todo.items():
        for h, w in weights.items():
            put(t, h, a * w / w_total)
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
