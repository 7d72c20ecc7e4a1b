#!/usr/bin/env python3
"""Where the collector's CPU goes for the default agent's batch (80 samples: 8 GPUs x 10 s) in steady state, in
process (no HTTP, no compaction): what `bench/ingest.py` measures end to end, taken apart.

- validation: ``parse_batch`` of the agent's own msgpack body (``agent.push.encode_batch``);
- the group commit: ``Store.ingest_group`` of G batches of distinct hosts the store already holds, CPU (this
  thread's) and wall per batch, for each group size G: what a commit costs once (BEGIN, the dedupe lookup, the
  fold's numpy calls, COMMIT and its fsync) against what each batch adds; and each host's first batch, one a
  commit (the run's first round: what a fleet's first pushes to a new ledger cost);
- the parts of a G=32 group commit, under cProfile (its overhead inflates the Python parts; the shares are
  indicative, the microseconds above are not profiled).

Data: ``bench/ingest.py``'s generator (10 fields as random walks, every GPU on a Slurm job running one process),
--hosts hosts; the store is embedded SQLite (WAL, synchronous=FULL) in a temporary directory.

    .venv/bin/python bench/batch_cost.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ingest import GPUS, Data  # noqa: E402

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.collector.store import Store  # noqa: E402
from gpuledger.collector.validate import Batch, parse_batch  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

MSGPACK = "application/msgpack"
# (label, file, function): cumulative time of each, a share of the group commit's
PARTS = [
    ("fold (Aggregator.add_series)", "aggregate.py", "add_series"),
    ("host chunk (encode + INSERT)", "series_store.py", "write_host_series"),
    ("usage, GPU, hour upserts", "ledger_store.py", "write_aggregates"),
    ("dedupe lookup", "ledger_store.py", "batches_seen_of"),
    ("dedupe keys stored", "ledger_store.py", "record_batches"),
    ("hosts claimed", "store.py", "_claim_hosts"),
    ("BEGIN + COMMIT", "db.py", "_begun"),
]


class Bodies:
    """Host h's batch k as the agent encodes it; k goes on per host, so every batch is the next one."""

    def __init__(self, hosts: int) -> None:
        self.data = Data(hosts, time.time() - 3 * 86400, 80 // GPUS)
        self.next_k = 0
        self.hosts = hosts

    def round(self, processes: bool = True) -> list[bytes]:
        """The next batch of every host (``processes``: False leaves the samples' process lists out)."""
        k, self.next_k = self.next_k, self.next_k + 1
        out = []
        for h in range(self.hosts):
            host, rows = self.data.batch(h, k)
            if not processes:
                for d in rows:
                    del d["processes"]
            out.append(encode_batch(host, host, k, [GpuSample.from_dict(d) for d in rows], fmt="msgpack"))
        return out


def commit_in_groups(store: Store, batches: list[Batch], size: int) -> tuple[float, float]:
    """(CPU s, wall s) of committing ``batches`` in groups of ``size``."""
    c0, w0 = time.thread_time(), time.perf_counter()
    for i in range(0, len(batches), size):
        for outcome in store.ingest_group(batches[i:i + size]):
            if isinstance(outcome, Exception) or outcome.accepted != 80:
                raise SystemExit(f"a batch was not stored whole: {outcome!r}")
    return time.thread_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=256, help="hosts (8 GPUs each); a round is one batch of each")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per group size (the median is shown)")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="group sizes, comma-separated")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    bodies = Bodies(a.hosts)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "gpuledger.sqlite")
        try:
            now = time.time()

            def parsed(round_bodies: list[bytes]) -> list[Batch]:
                return [parse_batch(b, MSGPACK, now) for b in round_bodies]

            # the hosts' first batches, one a commit: a fleet's first pushes to a new ledger (or new nodes)
            first_cpu, first_wall = commit_in_groups(store, parsed(bodies.round()), 1)
            commit_in_groups(store, parsed(bodies.round()), 32)  # (the first steady round warms the caches)
            round_bodies = bodies.round()
            bare = bodies.round(processes=False)  # a reference in this run: what the process lists cost
            for label, which in (("", round_bodies), (", without process lists", bare)):
                c0 = time.thread_time()
                for _ in range(a.rounds):
                    for b in which:
                        parse_batch(b, MSGPACK, now)
                parse_us = (time.thread_time() - c0) / (a.rounds * a.hosts) * 1e6
                print(f"validation (parse_batch, msgpack, 80 samples{label}): {parse_us:6.1f} us CPU a batch")
            commit_in_groups(store, parsed(round_bodies), 32)
            commit_in_groups(store, parsed(bare), 32)
            print("group commit (Store.ingest_group), steady state, per batch:")
            print("  group   CPU us   wall us   (the median round's)")
            cpu_us: dict[int, float] = {}
            for size in sizes:
                runs = [commit_in_groups(store, parsed(bodies.round()), size) for _ in range(a.rounds)]
                cpu_us[size] = statistics.median(c for c, _ in runs) / a.hosts * 1e6
                wall_us = statistics.median(w for _, w in runs) / a.hosts * 1e6
                print(f"  {size:5d}  {cpu_us[size]:7.1f}  {wall_us:8.1f}")
            runs = [commit_in_groups(store, parsed(bodies.round(processes=False)), 32) for _ in range(a.rounds)]
            print(f"     32  {statistics.median(c for c, _ in runs) / a.hosts * 1e6:7.1f}  "
                  f"{statistics.median(w for _, w in runs) / a.hosts * 1e6:8.1f}   without process lists")
            first_us = first_cpu / a.hosts * 1e6
            print(f"      1  {first_us:7.1f}  {first_wall / a.hosts * 1e6:8.1f}   "
                  "each host's first batch (the ledger holds nothing of it; the run's first round)")
            if 1 in cpu_us:
                print(f"  a host's first batch / the steady state's, groups of 1: {first_us / cpu_us[1]:.2f}x CPU")
            if 1 in cpu_us and 32 in cpu_us:  # c(G) = B + F / G, solved from G = 1 and G = 32
                fixed = (cpu_us[1] - cpu_us[32]) * 32 / 31
                print(f"  from groups of 1 and 32: {fixed:.0f} us CPU a group, {cpu_us[1] - fixed:.0f} us a batch")
            profile = cProfile.Profile()
            batches = [b for _ in range(a.rounds) for b in parsed(bodies.round())]
            profile.enable()
            commit_in_groups(store, batches, 32)
            profile.disable()
        finally:
            store.close()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    cumulative: dict[tuple[str, str], float] = {}
    for (file, _, func), (_, _, _, ct, _) in stats.items():
        key = (Path(file).name, func)
        cumulative[key] = cumulative.get(key, 0.0) + ct
    total = cumulative[("store.py", "ingest_group")]
    print(f"a 32-batch group commit's parts, under cProfile ({total / len(batches) * 1e6:.0f} us a batch profiled):")
    named = 0.0
    for label, file, func in PARTS:
        t = cumulative.get((file, func), 0.0)
        named += t
        print(f"  {label:32s} {t / total:6.1%}")
    print(f"  {'the rest':32s} {1 - named / total:6.1%}")
    print(f"workload: {a.hosts} hosts x {GPUS} GPUs, 10 fields and a process a sample, 80-sample batches, "
          f"{a.rounds} rounds per figure")


if __name__ == "__main__":
    main()
