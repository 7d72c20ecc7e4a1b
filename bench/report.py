"""Speed of the monthly usage report (1,000,000 job records, target <= 5 s) and of the audit log over 1,000,000
entries: `audit verify` (target <= 10 s), a signed checkpoint (target < 1 s), a consistency proof (target
< 50 ms), each next to a reference pass over the same data in the same process.

    .venv/bin/python bench/report.py [--jobs N] [--entries N]

Reference passes: for the report, one plain loop reading each job's end time and allocated GPU-seconds; for
`audit verify`, one plain SELECT over every stored row (no hashing); for checkpoint and proofs, hashing the
same number of 32-byte pairs in a plain loop (what a proof costs without reading SQLite).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuledger.accounting.audit import AuditLog, keygen, load_signing_key, make_checkpoint, parse_checkpoint  # noqa: E402
from gpuledger.accounting.ledger import LedgerEntry  # noqa: E402
from gpuledger.accounting.report.period import parse_period  # noqa: E402
from gpuledger.accounting.report.settings import ReportSettings  # noqa: E402
from gpuledger.accounting.report.usage import usage_report  # noqa: E402
from gpuledger.collector.auditlog import merkle  # noqa: E402
from gpuledger.schema.records import JobRecord, JobUsage  # noqa: E402

OCT0 = datetime(2026, 10, 1, tzinfo=UTC).timestamp()


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


def bench_audit(n: int) -> dict[str, float]:
    """Append n entries, then time verify, a checkpoint, consistency and inclusion proofs (each checked)."""
    out: dict[str, float] = {}
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
        out["build"] = time.perf_counter() - t
        t = time.perf_counter()
        rows = 0
        for _ in log._db.execute("SELECT seq, kind, job_id, key, body, leaf FROM entries ORDER BY seq"):
            rows += 1
        out["verify_ref"] = time.perf_counter() - t
        t = time.perf_counter()
        res = log.verify()
        out["verify"] = time.perf_counter() - t
        assert res.ok and res.entries == n == rows
        key = load_signing_key(keygen(Path(d) / "keys" / "k.key").private)
        t = time.perf_counter()
        note = make_checkpoint(log, key)
        out["checkpoint"] = time.perf_counter() - t
        head, _ = parse_checkpoint(note, "bench")
        assert head.size == n and head.root == res.root
        first = n // 2 + 12_345  # neither a power of two nor aligned: the longest kind of proof
        t = time.perf_counter()
        old_root = log.root(first)
        proof = log.consistency_proof(first, n)
        ok = merkle.verify_consistency(first, n, old_root, head.root, proof)
        out["consistency"] = time.perf_counter() - t
        assert ok and old_root == res.root_at(first)
        out["consistency_hashes"] = len(proof)
        t = time.perf_counter()
        ip = log.inclusion_proof(first, n)
        leaf = log.get(first).leaf
        ok = merkle.verify_inclusion(first - 1, n, leaf, ip, head.root)
        out["inclusion"] = time.perf_counter() - t
        assert ok
        pair = b"\x00" * 32
        t = time.perf_counter()
        for _ in range(2 * len(proof) + 40):  # the root of the old tree, the proof and its check: about this many
            pair = merkle.node_hash(pair, pair)
        out["proof_ref"] = time.perf_counter() - t
        log.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--entries", type=int, default=1_000_000)
    args = ap.parse_args()
    dt, ref, kept = bench_report(args.jobs)
    print(f"monthly usage report, {args.jobs:,} job records ({kept:,} in 2026-10), by account, with cost and CO2e: "
          f"{dt:.2f} s (target <= 5 s); reference loop {ref:.2f} s; ratio {dt / ref:.1f}x")
    a = bench_audit(args.entries)
    print(f"audit verify, {args.entries:,} entries: {a['verify']:.2f} s (target <= 10 s); reference SELECT "
          f"{a['verify_ref']:.2f} s; ratio {a['verify'] / a['verify_ref']:.1f}x "
          f"(appending them took {a['build']:.1f} s)")
    print(f"audit checkpoint, {args.entries:,} entries: {a['checkpoint'] * 1e3:.1f} ms (target < 1 s)")
    print(f"consistency proof {args.entries // 2 + 12_345:,} -> {args.entries:,} entries "
          f"({a['consistency_hashes']:.0f} hashes), built from stored subtrees and verified: "
          f"{a['consistency'] * 1e3:.2f} ms (target < 50 ms); "
          f"inclusion proof: {a['inclusion'] * 1e3:.2f} ms; reference: hashing as many pairs in a loop "
          f"{a['proof_ref'] * 1e3:.3f} ms")

if __name__ == "__main__":
    main()
