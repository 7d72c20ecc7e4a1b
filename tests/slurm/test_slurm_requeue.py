"""A requeued job on a real Slurm 22.05 (the session cluster of ``slurm_cluster.py``): while its second run runs,
``SlurmClient.sacct_running`` gives its record the first run, and once it ended the import of ended jobs
(``ENDED_STATES``, what ``priority watch`` imports) does too; the usage report charges both runs' allocation.

Slurm holds a requeued batch job with a BeginTime about two minutes ahead; ``scontrol update StartTime=now`` once
the requeue is through (squeue shows it PENDING) and a few seconds later makes it start at once (``scontrol
release`` does not; checked on 22.05.8).
"""

from __future__ import annotations

import time

import pytest
from slurm_cluster import PARTITION, SlurmCluster  # tests/slurm is on sys.path (rootdir imports)

from gpuledger.accounting.ledger import join
from gpuledger.accounting.report.usage import usage_report
from gpuledger.accounting.slurm import ENDED_STATES
from gpuledger.schema.records import JobRecord

pytestmark = pytest.mark.slurm


def _state(c: SlurmCluster, job_id: str) -> str:
    return c.cmd("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()


def _running_record(c: SlurmCluster, job_id: str) -> JobRecord | None:
    """The job's record from sacct_running, once slurmdbd has its second run (its first among earlier runs)."""
    r = next((r for r in c.client().sacct_running(time.time()) if r.job_id == job_id), None)
    return r if r is not None and r.earlier_runs else None


def _start_now(c: SlurmCluster, job_id: str) -> bool:
    """Start a requeued (pending) job now; True once it runs."""
    if _state(c, job_id) == "PENDING":
        c.cmd("scontrol", "update", f"jobid={job_id}", "starttime=now", check=False)
        time.sleep(1.0)
    return _state(c, job_id) == "RUNNING"


def test_a_requeued_jobs_records_carry_its_earlier_run(slurm_cluster: SlurmCluster) -> None:
    c = slurm_cluster
    c.cmd("scontrol", "update", f"partitionname={PARTITION}", "state=up")
    t0 = time.time()
    job = c.sbatch_as("alice", "--requeue", "--gres=gpu:1", "-A", "proj_a", "--wrap", "sleep 8")
    try:
        c.wait(f"job {job} to run", lambda: _state(c, job) == "RUNNING", timeout_s=60, every_s=0.2)
        time.sleep(2)  # a first run of a second or more
        c.cmd("scontrol", "requeue", job)
        c.wait(f"job {job} requeued", lambda: _state(c, job) == "PENDING", timeout_s=30, every_s=0.1)
        # slurmd revokes the first run's job credential: a run launched in the same second fails ("Job credential
        # revoked", the job FAILED), which Slurm's own BeginTime delay avoids
        time.sleep(3)
        try:
            c.wait(f"job {job} to run again", lambda: _start_now(c, job), timeout_s=60, every_s=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{c.cmd('scontrol', 'show', 'job', job)}\n{c.cmd('squeue')}\n"
                                 f"{c.log_tail()}") from None
        running = c.wait(f"slurmdbd to list job {job}'s second run", lambda: _running_record(c, job),
                         timeout_s=60, every_s=0.5)
        ((start1, end1, hosts1),) = running.earlier_runs
        assert (running.state, running.end, hosts1) == ("RUNNING", None, ("vm",))
        assert t0 - 1 <= start1 < end1 <= running.start  # type: ignore[operator]
        c.wait(f"job {job} to complete", lambda: _state(c, job) == "", timeout_s=60, every_s=0.5)
        ended = c.wait(f"slurmdbd to list job {job}'s end", lambda: next(
            (r for r in c.client().sacct_jobs(t0 - 60, time.time() + 60, states=ENDED_STATES)
             if r.job_id == job and r.end is not None), None), timeout_s=60, every_s=0.5)
    finally:
        c.cmd("scancel", job, check=False)
    assert (ended.state, ended.start, ended.earlier_runs) == ("COMPLETED", running.start, running.earlier_runs)
    assert ended.end is not None and ended.start is not None
    # Slurm's allocation of both runs, at its one GPU
    rep = usage_report(join([ended], []), "account", now=time.time())
    assert rep.total.slurm_gpu_hours * 3600 == pytest.approx((end1 - start1) + (ended.end - ended.start))
