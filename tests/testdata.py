"""Where the tests' captured real outputs live (tests/data/, origins in its README), and a reader that fails,
never skips, when a capture is missing."""

from __future__ import annotations

from pathlib import Path

from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

DATA_ROOT = Path(__file__).resolve().parent / "data"


def capture(relative: str | Path) -> Path:
    """The path of a capture under tests/data/; a missing one is a test failure, not a skip."""
    path = DATA_ROOT / relative
    assert path.is_file(), f"missing capture {path}: every capture a test reads is committed under tests/data/"
    return path


def measure_jobs_3_and_999(store: Store) -> None:
    """Samples of job 3 (a job of the slurm/real-22.05 captures) and of job 999 (which Slurm never reported) into
    ``store``, as a collector stores them."""
    samples = tuple(GpuSample(ts=1795969360.0 + 10 * k, host="vm", gpu_uuid="GPU-0", gpu_index=0,
                              sm_active_ratio=0.5, energy_joules=1000.0 * k, job_ids=(job,))
                    for k, job in enumerate(["3", "3", "3", "999", "999"]))
    store.ingest(Batch("t", 1, "vm", samples))
