#!/usr/bin/env python3
"""Compaction's CPU beside ingest, in one process: a store filled as ``bench/ingest.py --shapes 80`` fills it
(--hosts hosts x 8 GPUs, one 80-sample batch a host = 10 s of its GPUs, the hosts in turn, each batch through the
agent's encoder and the collector's parser, in group commits of --group batches), ``Store.compact`` after every
--pass-batches batches (about what the collector ingests between two of the compactor's passes, 5 s apart), for
--passes passes. Prints each pass's CPU (the compacting thread's: ingest is not counted), compaction CPU seconds per
million samples ingested, and a digest of everything compaction wrote (chunks, host chunks, roll-up states, seals,
expiries) and of query answers (raw and rolled-up series, totals): two trees with the same digest stored and
answered the same.

Compaction's pacing (``COMPACTION_CPU_SHARE``: it sleeps so as to take at most that share of a core) is lifted here:
the CPU it spends is the same, the bench just does not wait. ``--profile FILE``: cProfile of the compact calls.

    .venv/bin/python bench/compaction.py                  # 1,000 hosts, 12 passes (splits and roll-ups included)
    .venv/bin/python bench/compaction.py --hosts 250      # a quarter of the work, the same figures per sample
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ingest import GPUS, Data  # noqa: E402

import gpuledger.collector.store as store_module  # noqa: E402
from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.collector.store import Store  # noqa: E402
from gpuledger.collector.validate import parse_batch  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

T0 = 1_700_000_000.0  # the data's first second (fixed: the digest depends on it)
TABLES = {  # what compaction writes, in an order that does not depend on the engine's row order
    "chunks": "SELECT tier, host, gpu_uuid, mig, bucket, t_min, t_max, n, data FROM chunks "
              "ORDER BY tier, host, gpu_uuid, mig, bucket, t_min",
    "host_chunks": "SELECT host, t_min, t_max, n, data FROM host_chunks ORDER BY host, t_min, id",
    "rollup_state": "SELECT host, gpu_uuid, mig, tier, until FROM rollup_state ORDER BY host, gpu_uuid, mig, tier",
    "sealed": "SELECT host, gpu_uuid, mig, until FROM sealed ORDER BY host, gpu_uuid, mig",
    "expired": "SELECT host, gpu_uuid, mig, tier, until FROM expired ORDER BY host, gpu_uuid, mig, tier",
}


def digest(store: Store, hosts: int, end: float) -> dict[str, str]:
    """sha256 of each compaction table's rows and of query answers (a few GPUs' raw, 1-minute and 1-hour series,
    the totals)."""
    out = {}
    for name, sql in TABLES.items():
        h = hashlib.sha256()
        for row in store.db.execute(sql):
            h.update(repr(row).encode())
        out[name] = h.hexdigest()[:16]
    h = hashlib.sha256()
    for host in sorted({0, hosts // 2, hosts - 1}):
        for g in (0, GPUS - 1):
            for step in (None, 60.0, 3600.0):
                h.update(repr(store.series(f"node{host:04d}", f"GPU-{host:04d}-{g}", T0, end, step)).encode())
    h.update(repr(store.totals()).encode())
    out["queries"] = h.hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--pass-batches", type=int, default=6000,
                    help="batches ingested between two passes (ingest.py's collector: ~100k samples/s x 5 s)")
    ap.add_argument("--group", type=int, default=16, help="batches a group commit")
    ap.add_argument("--profile", type=Path, help="write a cProfile of the compact calls here (pstats)")
    a = ap.parse_args()
    if min(a.hosts, a.passes, a.pass_batches, a.group) < 1:
        ap.error("--hosts, --passes, --pass-batches and --group must be positive")
    steps = 80 // GPUS
    data = Data(a.hosts, T0, steps)
    clock = [T0]
    store_module.COMPACTION_CPU_SHARE = 1.0  # no pacing sleeps: the same CPU, no wait
    profile = cProfile.Profile() if a.profile else None
    with tempfile.TemporaryDirectory(prefix="gl-compaction-") as tmp:
        store = Store(Path(tmp) / "gpuledger.sqlite", clock=lambda: clock[0])
        sent = [0] * a.hosts  # batches of each host so far
        samples = 0
        nxt = 0
        compact_cpu = 0.0
        print(f"{'pass':>4} {'data s/host':>11} {'CPU s':>7} {'split':>6} {'minutes':>8} {'hours':>6} {'merged':>7}")
        for p in range(a.passes):
            todo = a.pass_batches if p else a.hosts  # the first: each host's first batch (new series)
            while todo:
                group = []
                for _ in range(min(a.group, todo)):
                    h = nxt
                    nxt = (nxt + 1) % a.hosts
                    host, ss = data.batch(h, sent[h])
                    clock[0] = max(clock[0], T0 + (sent[h] + 1) * steps)  # the agents' clock: just after the batch
                    body = encode_batch(host, host, sent[h], [GpuSample.from_dict(d) for d in ss], fmt="msgpack")
                    group.append(parse_batch(body, "application/msgpack", clock[0]))
                    sent[h] += 1
                    todo -= 1
                for result in store.ingest_group(group):
                    if isinstance(result, Exception):
                        raise result
                samples += len(group) * 80
            t = time.thread_time()
            if profile:
                profile.enable()
            st = store.compact(now=clock[0])
            if profile:
                profile.disable()
            spent = time.thread_time() - t
            compact_cpu += spent
            print(f"{p + 1:>4} {max(sent) * steps:>11} {spent:>7.3f} {st.split_chunks:>6} {st.rolled_minutes:>8} "
                  f"{st.rolled_hours:>6} {st.merged_chunks:>7}")
        print(f"compaction: {compact_cpu:.2f} CPU s over {a.passes} passes, {samples:,} samples ingested: "
              f"{compact_cpu / samples * 1e6:.2f} CPU s per million samples")
        print("digest:", " ".join(f"{k}={v}" for k, v in digest(store, a.hosts, clock[0]).items()))
        store.close()
    if profile:
        profile.dump_stats(str(a.profile))


if __name__ == "__main__":
    main()
