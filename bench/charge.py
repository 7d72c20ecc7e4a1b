"""Speed of charging a ledger into decayed usage per association (`fairshare`/`priority feed` before the tree
math): N jobs, each with a Slurm record and per-GPU measurements, placed in the hours they were used (the
collector's per-GPU hourly buckets), next to a reference pass over the same jobs with each GPU's charge spread
evenly over its first..last sample (no buckets), in the same process.

    .venv/bin/python bench/charge.py [--jobs N]

The reference is what placement cost before hourly buckets were read; the ratio is what reading them costs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuledger.accounting.associations import AssocTree  # noqa: E402
from gpuledger.accounting.config import AccountingSettings  # noqa: E402
from gpuledger.accounting.engine import association_usage  # noqa: E402
from gpuledger.accounting.ledger import LedgerEntry  # noqa: E402
from gpuledger.schema.records import JobRecord, JobUsage  # noqa: E402

T0 = 1_790_000_000.0 // 3600 * 3600


def make(n: int, seed: int = 0):
    """n jobs of 1-8 GPUs and 1 min - 48 h over 30 days, 50 accounts x 10 users; busy hours of every GPU."""
    rng = random.Random(seed)
    entries, busy = [], {}
    for i in range(n):
        gpus = rng.choice((1, 1, 2, 4, 8))
        start = T0 + rng.random() * 30 * 86400
        dur = 60 + rng.random() * 48 * 3600
        acct, user = f"a{i % 50}", f"u{i % 500}"
        rec = JobRecord(str(i), cluster="c", user=user, account=acct, gpus=gpus, start=start, end=start + dur,
                        state="COMPLETED", tres=(("gres/gpu", float(gpus)),))
        per_gpu = []
        for g in range(gpus):
            uuid = f"GPU-{i}-{g}"
            per_gpu.append(JobUsage(str(i), "n1", uuid, start, start + dur, int(dur // 10) + 1, dur, dur * 0.5,
                                    dur * 300.0, model="NVIDIA H200", cluster="c"))
            h = start // 3600 * 3600
            rows = []
            while h < start + dur:
                rows.append((h, min(h + 3600, start + dur) - max(h, start)))
                h += 3600
            busy[("n1", uuid, "")] = rows
        total = JobUsage(str(i), "n1", "*", start, start + dur, gpus * (int(dur // 10) + 1), dur * gpus,
                         dur * gpus * 0.5, dur * gpus * 300.0, model="NVIDIA H200", gpus=gpus, cluster="c")
        entries.append(LedgerEntry(str(i), rec, total, "c", None, tuple(per_gpu)))
    tree = AssocTree.from_toml({"accounts": {f"a{a}": {"shares": 1, "users": {f"u{u}": 1 for u in range(a, 500, 50)}}
                                             for a in range(50)}})
    return entries, busy, tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    args = ap.parse_args()
    entries, busy, tree = make(args.jobs)
    pieces = sum(len(v) for v in busy.values())
    settings = AccountingSettings(policy="blend")
    now = T0 + 31 * 86400
    t = time.perf_counter()
    ref = association_usage(entries, settings, tree, now)
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    res = association_usage(entries, settings, tree, now, busy=busy)
    t_hours = time.perf_counter() - t
    assert set(res.usage) == set(ref.usage)
    print(f"charge and decay, {args.jobs:,} jobs ({sum(len(e.gpus) for e in entries):,} GPU records, {pieces:,} "
          f"busy GPU-hours): hourly placement {t_hours:.2f} s; reference (first..last spread) {t_ref:.2f} s; "
          f"ratio {t_hours / t_ref:.1f}x")


if __name__ == "__main__":
    main()
