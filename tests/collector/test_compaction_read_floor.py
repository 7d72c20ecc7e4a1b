"""Compaction expires raw samples only below each GPU's read floor (``Aggregator.read_floor``: its late window and,
before it, the ``max_gap_s`` a missed reading's rule reads back), on both ledger engines: a late sample arriving after
compaction and a restart is counted exactly as by a store that never compacted."""

from __future__ import annotations

import pytest

from gpuledger.collector.series_store import RAW, Retention
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000  # an hour boundary
DAY = 86400.0
WINDOW_S, MAX_GAP_S = 600.0, 60.0
RET = Retention(raw_chunk_s=60.0)  # one raw chunk a minute: expiry can cut anywhere near the window's edge
W = H + 3620.0  # the GPU's newest sample; W - 620 is a minute (and chunk) boundary, where the seal falls
MISSED = {W - 630, W - 620, W - 610, W - 600, W - 590}  # readings without the energy counter
LATE = W - 595  # a reading inside the window (W - 600), after the seal (W - 620), amid the missed readings
NOW = W + 10 * DAY  # every raw chunk is past the clock's retention (7 days)


def sample(ts: float) -> GpuSample:
    # the counter grows 150 J/s at 100 W of reported power: after a missed reading the counter's growth (the
    # caught-up energy) differs from the power integral, so whether the rule could read back shows in the totals
    return GpuSample(ts=ts, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0,
                     energy_joules=None if ts in MISSED else 1e6 + 150.0 * (ts - H), job_ids=("7",))


def make_store(url) -> Store:
    return Store(url, window_s=WINDOW_S, max_gap_s=MAX_GAP_S, retention=RET, clock=lambda: NOW)


def late_after_restart(url, compact: bool) -> tuple[list, list, dict]:
    """Ingest 2,000 s of one GPU (all but LATE), compact as of NOW or not, restart, ingest LATE: the ledger's
    energy per GPU, usage per job and GPU, and totals."""
    store = make_store(url)
    assert store.ingest(Batch("a", 0, "n1", tuple(sample(W - 10 * j) for j in range(200, -1, -1)))).accepted == 201
    if compact:
        before = len(store.series("n1", "G0", 0, 2e9, tier=RAW))
        assert store.compact(NOW, all_host_chunks=True).deleted_chunks > 0
        # raw samples were expired, and those the rule reads back (the window, and max_gap_s before it) were not
        assert 0 < len(store.series("n1", "G0", 0, 2e9, tier=RAW)) < before
        assert {s.ts for s in store.series("n1", "G0", W - WINDOW_S - MAX_GAP_S, W, tier=RAW)} >= {
            W - 10 * j for j in range(66)}
    store.close()
    store = make_store(url)  # restored from the ledger and the raw samples left: the GPU's newest sample only
    try:
        assert store.ingest(Batch("a", 1, "n1", (sample(LATE),))).accepted == 1
        return store.gpu_energy(), store.job_usage(per_gpu=True), store.totals()
    finally:
        store.close()


def test_compaction_keeps_what_a_late_sample_after_a_missed_reading_reads_back(new_ledger):
    """LATE, a reading with the counter, lands amid missed readings: the interval ending at the next reading (W - 580)
    is undone, its caught-up energy read back to the last reading before the missed ones (W - 640), below the late
    window (W - 600) but within max_gap_s of W - 580, and (W - 600, LATE] is caught up from there too. Compaction
    must have kept that reading (without it both take the power integral, and the undo takes away other joules than
    the ingest gave); the totals then equal those of a store that never compacted."""
    compacted = late_after_restart(new_ledger(), compact=True)
    assert compacted == late_after_restart(new_ledger(), compact=False)
    energy, _, totals = compacted
    # every interval observed (10 s apart, or 5 s around LATE), and the energy the counter's growth: 150 J/s
    assert totals["samples"] == 202 and energy[0]["energy_joules"] == pytest.approx(150.0 * 2000)
