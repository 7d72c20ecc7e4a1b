#!/usr/bin/env python3
"""How much a fairshare cycle adds to the audit log, logged in full and as a delta, and what `audit verify` costs.

N jobs in the decay horizon (ended over the last 30 days) and M running; each cycle (300 s later) the M running
jobs have ended and M others run: a delta logs those 2M jobs, a full entry all of them. Charges, decay, rows and
feed are accounting's own (``engine.association_usage``, ``compute``, ``priority_feed``) over jobs logged as
`priority feed` logs them (job records, job-total usage records); the per-job record is the production one
(``engine.ChargedJob`` with its pieces and the entries it came from).

Prints the bytes of the entry's hashed body appended per fairshare entry (the log also stores its leaf, its
index rows and the Merkle nodes: under 200 bytes an entry), then `audit verify`'s time (``verify.verify_all``,
all its checks) over a log of 1 + K entries of each kind written from the same cycles, and what each entry after
the second adds to it (that time less verify's over the log's first two entries, copied aside when written): what
a month of entries costs, the jobs in the horizon checked once whatever the log's length.

    .venv/bin/python bench/audit_growth.py [--jobs 20000] [--ended 50] [--entries 5]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuledger.accounting.associations import AssocTree  # noqa: E402
from gpuledger.accounting.audit import (  # noqa: E402
    open_log,
    record_fairshare,
    record_job_records,
    record_usage,
    usage_key,
    verify_all,
)
from gpuledger.accounting.config import AccountingSettings  # noqa: E402
from gpuledger.accounting.engine import association_usage, audit_charges, compute  # noqa: E402
from gpuledger.accounting.ledger import join  # noqa: E402
from gpuledger.accounting.priority import priority_feed  # noqa: E402
from gpuledger.collector.auditlog import job_key  # noqa: E402
from gpuledger.schema.records import JobRecord, JobUsage  # noqa: E402

ACCOUNTS, USERS = 20, 10  # users per account
DAY = 86400.0


class Fleet:
    """The jobs of cycle k: ``jobs`` ended over the 30 days before cycle 0, and ``ended`` more per cycle."""

    def __init__(self, jobs: int, ended: int, t0: float) -> None:
        self.jobs, self.ended, self.t0 = jobs, ended, t0
        self.tree = AssocTree.from_toml({"accounts": {f"a{a}": {"shares": 1 + a % 3, "users": {
            f"u{a}x{u}": 1 + u % 2 for u in range(USERS)}} for a in range(ACCOUNTS)}})
        self.settings = AccountingSettings(algorithm="classic", policy="blend", priority_weight=1000)

    def now(self, k: int) -> float:
        return self.t0 + 300.0 * k

    def _job(self, i: int, k: int) -> tuple[JobRecord, JobUsage]:
        """Job i as cycle k sees it: jobs past ``self.jobs`` start one per cycle group and run 600 s."""
        a, u = i % ACCOUNTS, (i // ACCOUNTS) % USERS
        if i < self.jobs:
            start = self.t0 - 30 * DAY + (i * 30 * DAY) / self.jobs
            end: float | None = start + 3600.0 * (1 + i % 4)
        else:
            start = self.now((i - self.jobs) // self.ended) - 150.0
            end = start + 600.0
        if end is not None and end > self.now(k):
            end = None  # still running
        last = end if end is not None else self.now(k)
        gpus = 1 + i % 4
        rec = JobRecord(str(i), cluster="c", user=f"u{a}x{u}", account=f"a{a}", gpus=gpus, start=start, end=end,
                        state="COMPLETED" if end is not None else "RUNNING")
        busy = (last - start) * gpus
        use = JobUsage(str(i), "n1", "*", start, last, int((last - start) // 10) + 1, busy, 0.6 * busy,
                       400.0 * busy, cluster="c")
        return rec, use

    def cycle(self, k: int) -> tuple[list[JobRecord], list[JobUsage]]:
        jobs = [self._job(i, k) for i in range(self.jobs + self.ended * (k + 1))]
        return [r for r, _ in jobs], [u for _, u in jobs]


def record_cycle(log: Any, fleet: Fleet, k: int, full: bool | None) -> tuple[int, float]:
    """Cycle k as `priority feed` records it: its records, then its fairshare entry; (body bytes, seconds)."""
    records, usages = fleet.cycle(k)
    now = fleet.now(k)
    record_job_records(log, records)
    record_usage(log, usages, final=False)
    jobs = {k2: e.seq for k2, e in log.latest_by_prefix("job:").items()}
    used = {k2: e.seq for k2, e in log.latest_by_prefix("usage:").items()}
    entries = join(records, usages, now=now)
    result = association_usage(entries, fleet.settings, fleet.tree, now)
    rows = compute(fleet.tree, result.usage, "classic")
    by_id = {e.job_id: e for e in entries}
    charges = audit_charges(result.jobs)
    sources = {c.job_id: {"usage_entry": used.get(usage_key(by_id[c.job_id].usage)),
                          "job_entry": jobs.get(job_key(by_id[c.job_id].record))} for c in charges}
    t = time.perf_counter()
    entry = record_fairshare(log, now=now, settings=fleet.settings, charges=charges, usage=result.usage, rows=rows,
                             feed=priority_feed(rows, 1000), sources=sources, full=full)
    took = time.perf_counter() - t
    assert log.path is not None
    db = sqlite3.connect(log.path)
    (size,) = db.execute("SELECT length(body) FROM entries WHERE seq=?", (entry.seq,)).fetchone()
    db.close()
    assert ("delta" in entry.data["inputs"]) == (full is not True and k > 0), "not the kind of entry asked for"
    return size, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000, help="jobs ended inside the decay horizon (N)")
    ap.add_argument("--ended", type=int, default=50, help="jobs that end each cycle (M)")
    ap.add_argument("--entries", type=int, default=5, help="fairshare entries of each kind after the first (K)")
    args = ap.parse_args()
    fleet = Fleet(args.jobs, args.ended, t0=(time.time() // 3600) * 3600)
    with tempfile.TemporaryDirectory() as tmp:
        logs = {}
        for kind, full in (("full", True), ("delta", None)):
            d = Path(tmp) / kind
            with open_log(d) as log:
                sizes = [record_cycle(log, fleet, k, full) for k in range(2)]
            shutil.copytree(d, Path(tmp) / f"{kind}-2", ignore=shutil.ignore_patterns("*.lock"))  # 1 + 1 entries
            with open_log(d) as log:
                sizes += [record_cycle(log, fleet, k, full) for k in range(2, args.entries + 1)]
            logs[kind] = (d, sizes)
        n = args.jobs + args.ended
        print(f"{n} jobs charged in the first entry ({args.jobs} ended, {args.ended} running), "
              f"{args.ended} ending and {args.ended} starting per cycle")
        print("bytes appended per fairshare entry (its hashed body), and the recorder's time:")
        full_sizes, delta_sizes = logs["full"][1], logs["delta"][1]
        print(f"  full entry:   {full_sizes[-1][0]:>12,} bytes  {full_sizes[-1][1] * 1e3:8.0f} ms")
        print(f"  delta entry:  {delta_sizes[-1][0]:>12,} bytes  {delta_sizes[-1][1] * 1e3:8.0f} ms  "
              f"({full_sizes[-1][0] / delta_sizes[-1][0]:.0f}x smaller)")
        print(f"`audit verify` over 1 full + {args.entries} entries of each kind:")
        took: dict[Path, float] = {}
        for d in [logs[kind][0] for kind in ("full", "delta")] + [Path(tmp) / "full-2", Path(tmp) / "delta-2"]:
            with open_log(d) as log:
                t = time.perf_counter()
                v = verify_all(log, None, feeds=[])
                took[d] = time.perf_counter() - t
                assert v.ok, v.problems[:3]
                total = log.path.stat().st_size if log.path is not None else 0
            if d in (logs["full"][0], logs["delta"][0]):
                print(f"  {d.name:>5} entries: {took[d]:6.2f} s ({took[d] / (args.entries + 1):.2f} s an entry), "
                      f"log file {total / 1e6:.1f} MB")
        # what each further entry adds (a month of them is this many times 8,640): the time over the log less that
        # over its first two entries (the jobs ended before them checked once, whatever the log's length)
        if args.entries > 1:
            print(f"each entry after the second adds (verify over 1 + {args.entries} entries less over 1 + 1):")
            for kind in ("full", "delta"):
                extra = (took[logs[kind][0]] - took[Path(tmp) / f"{kind}-2"]) / (args.entries - 1)
                print(f"  {kind:>5} entries: {extra:6.3f} s an entry")


if __name__ == "__main__":
    main()
