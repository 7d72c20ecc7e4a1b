"""Speed of the monthly usage report (1,000,000 job records, target <= 5 s) and of `audit verify`
(1,000,000 audit entries, target <= 10 s), each next to a reference pass over the same data in the same process.

    .venv/bin/python bench/report.py [--jobs N] [--entries N]

Reference passes: for the report, one plain loop reading each job's end time and allocated GPU-seconds; for the
audit log, one plain SELECT over every stored row (no hashing). The ratio says what the real work costs on top.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuledger.accounting.audit import AuditLog  # noqa: E402
from gpuledger.accounting.ledger import LedgerEntry  # noqa: E402
from gpuledger.accounting.report.period import parse_period  # noqa: E402
from gpuledger.accounting.report.settings import ReportSettings  # noqa: E402
from gpuledger.accounting.report.usage import usage_report  # noqa: E402
from gpuledger.schema.records import JobRecord, JobUsage  # noqa: E402

OCT0 = datetime(2026, 10, 1, tzinfo=timezone.utc).timestamp()


def make_entries(n: int, seed: int = 0) -> list[LedgerEntry]:
    """n jobs that all end in October 2026 (so the monthly report covers every one of them), 50 accounts
    (interleaved, as jobs of many accounts end side by side), 500 users, 3 GPU models."""
    rng = random.Random(seed)
    models = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
    out = []
    for i in range(n):
        start = OCT0 + rng.random() * 29 * 86400
        dur = 60 + rng.random() * 86000
        gpus = rng.choice((1, 1, 2, 4, 8))
        alloc = dur * gpus
        eff = rng.random()
        job = str(i)
        rec = JobRecord(job, user=f"user{i % 500}", account=f"acct{i % 50}", partition="gpu", gpus=gpus,
                        submit=start - rng.random() * 3600, start=start, end=start + dur)
        use = JobUsage(job, "n1", "*", start, start + dur, 100, alloc, alloc * eff, alloc * 350.0,
                       sm_active_mean=eff, dram_bw_mean=rng.random(), model=models[i % 3], gpus=gpus)
        out.append(LedgerEntry(job, rec, use))
    return out


def bench_report(n: int) -> tuple[float, float, int]:
    entries = make_entries(n)
    period = parse_period("2026-10")
    settings = ReportSettings(currency="EUR", price_per_kwh=0.25, co2e_kg_per_kwh=0.35,
                              price_per_gpu_hour={"H200": 3.2, "H100": 2.5, "default": 1.5})
    t = time.perf_counter()
    total, kept = 0.0, 0
    a, b = period.start, period.end
    for e in entries:  # reference: the cheapest loop that selects the month and reads one number
        if a <= e.record.end < b:  # type: ignore[union-attr, operator]
            total += e.usage.allocated_gpu_seconds  # type: ignore[union-attr]
            kept += 1
    ref = time.perf_counter() - t
    t = time.perf_counter()
    rep = usage_report(entries, "account", period, settings)
    dt = time.perf_counter() - t
    assert rep.total.jobs == kept and abs(rep.total.allocated_gpu_hours * 3600 - total) <= 1e-6 * total
    return dt, ref, kept


def bench_verify(n: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "audit.sqlite"
        log = AuditLog(path)
        t = time.perf_counter()
        chunk = 100_000
        for lo in range(0, n, chunk):
            log.append_many(
                ("usage_record", {"job_id": str(i), "allocated_gpu_seconds": i * 1.5, "sm_active_gpu_seconds": i * 0.7,
                                  "energy_joules": i * 350.25, "host": "n1", "gpu_uuid": "*"}, str(i), None)
                for i in range(lo, min(lo + chunk, n)))
        build = time.perf_counter() - t
        t = time.perf_counter()
        rows = 0
        for _ in log._db.execute("SELECT seq, kind, job_id, body, prev, hash FROM entries ORDER BY seq"):
            rows += 1
        ref = time.perf_counter() - t
        t = time.perf_counter()
        res = log.verify()
        dt = time.perf_counter() - t
        log.close()
        assert res.ok and res.entries == n == rows
    return dt, ref, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--entries", type=int, default=1_000_000)
    args = ap.parse_args()
    dt, ref, kept = bench_report(args.jobs)
    print(f"monthly usage report, {args.jobs:,} job records ({kept:,} in 2026-10), by account, with cost and CO2e: "
          f"{dt:.2f} s (target <= 5 s); reference loop {ref:.2f} s; ratio {dt / ref:.1f}x")
    dt, ref, build = bench_verify(args.entries)
    print(f"audit verify, {args.entries:,} entries: {dt:.2f} s (target <= 10 s); reference SELECT {ref:.2f} s; "
          f"ratio {dt / ref:.1f}x (appending them took {build:.1f} s)")


if __name__ == "__main__":
    main()
