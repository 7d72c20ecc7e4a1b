"""SlurmCgroupMapper on fake /proc trees (tmp_path) holding the real captures from Slurm 22.05 jobs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.agent.mappers import make_mapper
from gpuledger.agent.mappers.base import JobMapper
from gpuledger.agent.mappers.slurm_cgroup import JobRef, SlurmCgroupMapper, parse_cgroup
from gpuledger.agent.slurm import JobResolver
from gpuledger.schema.records import GpuProcess, GpuSample, sorted_job_ids

REAL = DATA_ROOT / "slurm" / "real-22.05"

V1_BATCH = (REAL / "inside-job-cgroupv1-proc-self-cgroup.txt").read_text()
V1_STEP0 = (REAL / "inside-step0-cgroupv1-proc-self-cgroup.txt").read_text()
LINUXPROC = (REAL / "inside-job-linuxproc-proc-self-cgroup.txt").read_text()
V2 = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n"
V2_SLUID = "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_0\n"
V1_PLAIN = "7:devices:/slurm/uid_1001/job_77/step_extern/task_0\n4:memory:/slurm/uid_1001/job_77/step_extern\n"
NOT_SLURM = "0::/user.slice/user-1000.slice/session-3.scope\n"


def env_bytes(name: str, **extra: str) -> bytes:
    """A captured `env | grep SLURM_` listing as /proc/PID/environ bytes (NUL-separated)."""
    lines = (REAL / name).read_text().splitlines() + [f"{k}={v}" for k, v in extra.items()]
    return "\0".join(lines + ["PATH=/usr/bin"]).encode() + b"\0"


def make_proc(root: Path, pid: int, cgroup: str | None, environ: bytes | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    if environ is not None:
        (d / "environ").write_bytes(environ)


def sample(index: int, *procs: tuple[int, int | None], uuid: str | None = None, mig: str | None = None) -> GpuSample:
    return GpuSample(
        ts=1795969409.0,
        host="vm",
        gpu_uuid=uuid or f"GPU-{index:08d}-0000-0000-0000-000000000000",
        gpu_index=index,
        mig=mig,
        processes=tuple(GpuProcess(pid, mem) for pid, mem in procs),
    )


# -- parse_cgroup ---------------------------------------------------------------------------------


def test_parse_real_cgroup_v1_batch_step() -> None:
    assert parse_cgroup(V1_BATCH) == JobRef(job_id="16", uid=1002, step="batch")


def test_parse_real_cgroup_v1_srun_step() -> None:
    assert parse_cgroup(V1_STEP0) == JobRef(job_id="16", uid=1002, step="0")


def test_parse_real_linuxproc_has_no_job() -> None:
    assert parse_cgroup(LINUXPROC) is None


@pytest.mark.parametrize(
    "text, ref",
    [
        (V1_PLAIN, JobRef(job_id="77", uid=1001, step="extern")),
        (V2, JobRef(job_id="4242", step="0")),
        ("0::/system.slice/slurmstepd.scope/job_9/step_batch\n", JobRef(job_id="9", step="batch")),
        ("0::/system.slice/slurmstepd.scope/job_9\n", JobRef(job_id="9")),
        # several slurmd on one machine (MULTIPLE_SLURMD): "<NodeName>_slurmstepd.scope" (cgroup_v2.c)
        ("0::/system.slice/n01_slurmstepd.scope/job_9/step_1/user/task_0\n", JobRef(job_id="9", step="1")),
        ("0::/system.slice/gx10-ac12_slurmstepd.scope/job_12/step_0/user/task_0\n", JobRef(job_id="12", step="0")),
        (V2_SLUID, JobRef(sluid="sEKNKTV3WPV500", step="0")),
        (NOT_SLURM, None),
        ("", None),
        ("garbage without colons\n", None),
        # not a SLUID: I, L, O, U are not Crockford digits; wrong length
        ("0::/system.slice/slurmstepd.scope/sEKNKTV3WPV5OO/step_0\n", None),
        ("0::/system.slice/slurmstepd.scope/sEKNKTV3WPV50/step_0\n", None),
        # a job_N directory outside a Slurm root is someone else's
        ("0::/user.slice/job_12/step_0\n", None),
        # the slurmstepd scope itself (the stepd, not a job)
        ("0::/system.slice/slurmstepd.scope/system\n", None),
    ],
)
def test_parse_cgroup_layouts(text: str, ref: JobRef | None) -> None:
    assert parse_cgroup(text) == ref


@given(st.integers(min_value=1, max_value=2**32), st.integers(min_value=0, max_value=2**31),
       st.sampled_from(["batch", "extern", "0", "17", "interactive"]))
def test_parse_cgroup_v1_roundtrip(job: int, uid: int, step: str) -> None:
    text = f"5:devices:/slurm_node-07/uid_{uid}/job_{job}/step_{step}/task_0\n0::/\n"
    assert parse_cgroup(text) == JobRef(job_id=str(job), uid=uid, step=step)


def test_sorted_job_ids_is_numeric() -> None:
    assert sorted_job_ids({"10", "9", "12_10", "12_2", "x"}) == ("9", "10", "12_2", "12_10", "x")


# -- the mapper on fake /proc trees ---------------------------------------------------------------


def test_mapper_is_a_jobmapper_and_registered(tmp_path: Path) -> None:
    assert isinstance(SlurmCgroupMapper(tmp_path), JobMapper)
    assert isinstance(make_mapper("slurm-cgroup", proc_root=str(tmp_path)), SlurmCgroupMapper)


def test_real_v1_capture_maps_job_and_metadata_from_environ(tmp_path: Path) -> None:
    make_proc(tmp_path, 30914, V1_BATCH, env_bytes("inside-job-cgroupv1-env.txt"))
    make_proc(tmp_path, 30934, V1_STEP0, env_bytes("inside-step0-cgroupv1-env.txt"))
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None, trust_environ=True)
    # Job 16 holds node GPUs 1 and 2 (SLURM_JOB_GPUS=1,2; CUDA_VISIBLE_DEVICES=0,1 inside the job).
    out = m.map([sample(0), sample(1, (30914, 2**30)), sample(2, (30934, 2**30), (30914, None))])
    assert [s.job_ids for s in out] == [(), ("16",), ("16",)]
    assert [s.job_shares for s in out] == [(), (), ()]
    meta = m.job_metadata()
    assert list(meta) == ["16"]
    rec = meta["16"]
    assert (rec.user, rec.uid, rec.account, rec.partition, rec.cluster, rec.gpus) == ("bob", 1002, "proj_a", "gpu",
                                                                                      "testcluster", 2)
    assert rec.hosts == ("vm",)
    assert rec.gpu_uuids == (out[1].gpu_uuid, out[2].gpu_uuid)


def test_shared_gpu_shares_by_memory(tmp_path: Path) -> None:
    make_proc(tmp_path, 100, V1_PLAIN)  # job 77
    make_proc(tmp_path, 200, V2)  # job 4242
    make_proc(tmp_path, 201, V2)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    (s,) = m.map([sample(3, (200, 2 * 2**30), (100, 1 * 2**30), (201, 1 * 2**30))])
    assert s.job_ids == ("77", "4242")
    assert s.job_shares == (0.25, 0.75)
    assert math.fsum(s.job_shares) == 1.0


def test_shared_gpu_shares_by_the_time_each_job_ran(tmp_path: Path) -> None:
    """A job computing with little memory pays for the GPU time it used, not for the memory the other holds."""
    make_proc(tmp_path, 100, V1_PLAIN)  # job 77: one process, 1 GiB, kernels 45% of the interval
    make_proc(tmp_path, 200, V2)  # job 4242: two processes, 30 GiB, kernels 10% + 5%
    make_proc(tmp_path, 201, V2)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    procs = (GpuProcess(200, 20 * 2**30, 0.10), GpuProcess(100, 2**30, 0.45), GpuProcess(201, 10 * 2**30, 0.05))
    (s,) = m.map([replace(sample(3), processes=procs)])
    assert s.job_ids == ("77", "4242")
    assert s.job_shares == (0.75, 0.25)
    # one process whose time the driver did not give: memory decides, as before
    unknown = (*procs[:2], GpuProcess(201, 10 * 2**30, None))
    (s,) = m.map([replace(sample(3), processes=unknown)])
    assert s.job_shares == pytest.approx((1 / 31, 30 / 31), rel=1e-15)


def test_shared_gpu_equal_when_a_memory_is_unknown(tmp_path: Path) -> None:
    make_proc(tmp_path, 100, V1_PLAIN)
    make_proc(tmp_path, 200, V2)
    make_proc(tmp_path, 300, "0::/system.slice/slurmstepd.scope/job_5/step_0\n")
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    (s,) = m.map([sample(0, (300, 5), (200, None), (100, 7))])
    assert s.job_ids == ("5", "77", "4242")
    assert math.fsum(s.job_shares) == 1.0
    assert s.job_shares == pytest.approx((1 / 3, 1 / 3, 1 / 3))


def test_vanished_unreadable_and_foreign_pids_are_skipped_and_counted(tmp_path: Path) -> None:
    make_proc(tmp_path, 100, V1_PLAIN)
    make_proc(tmp_path, 101, NOT_SLURM)
    make_proc(tmp_path, 102, LINUXPROC)
    make_proc(tmp_path, 103, None)
    (tmp_path / "103" / "cgroup").mkdir()  # reading a directory raises IsADirectoryError (an OSError)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    (s,) = m.map([sample(0, (999999, 1), (100, 1), (101, 1), (102, 1), (103, 1))])
    assert s.job_ids == ("77",)
    assert m.skipped == {"vanished": 1, "unreadable": 1, "not_in_job": 2}


def test_no_job_processes_leave_the_sample_unchanged(tmp_path: Path) -> None:
    original = replace(sample(0, (424242, 1)), job_ids=("from-source",))
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    assert m.map([original]) == [original]


def test_pid_cgroup_read_once_per_cycle_across_mig_instances(tmp_path: Path) -> None:
    make_proc(tmp_path, 100, V1_PLAIN)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    out = m.map([sample(0, (100, 1), mig="1.0"), sample(0, (100, 1), mig="2.0")])
    assert [s.job_ids for s in out] == [("77",), ("77",)]
    (tmp_path / "100" / "cgroup").unlink()
    # The next cycle reads afresh: the pid is gone now.
    assert m.map([sample(0, (100, 1))])[0].job_ids == ()
    assert m.job_metadata() == {}


def test_linuxproc_env_fallback_is_opt_in(tmp_path: Path) -> None:
    make_proc(tmp_path, 29131, LINUXPROC, env_bytes("inside-job-linuxproc-env.txt"))
    assert SlurmCgroupMapper(proc_root=tmp_path, resolver=None).map([sample(1, (29131, 1))])[0].job_ids == ()
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None, env_fallback=True)
    assert m.map([sample(1, (29131, 1))])[0].job_ids == ("9",)
    assert m.job_metadata()["9"].user == "bob"


def test_array_task_gets_array_id_from_trusted_environ(tmp_path: Path) -> None:
    env = env_bytes("inside-job-cgroupv1-env.txt", SLURM_ARRAY_JOB_ID="12", SLURM_ARRAY_TASK_ID="4")
    make_proc(tmp_path, 1, V1_BATCH, env)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None, trust_environ=True)
    assert m.map([sample(1, (1, 1))])[0].job_ids == ("12_4",)
    assert m.job_metadata()["12_4"].account == "proj_a"


class RecordingRun:
    """A `run=` seam answering with captured real Slurm output, recording the argv it got."""

    def __init__(self, answers: dict[tuple[str, ...], str]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(tuple(argv))
        try:
            return self.answers[tuple(argv)]
        except KeyError:
            raise FileNotFoundError(argv[0]) from None


SCONTROL_11 = (REAL / "scontrol-show-job-d-running-gpu.txt").read_text()


def test_sluid_resolved_through_scontrol_and_metadata_from_resolver(tmp_path: Path) -> None:
    # Slurm 26.05 with SLUID directories; this scontrol text is the real 22.05 record of job 11.
    run = RecordingRun(
        {
            ("scontrol", "show", "job", "-d", "sEKNKTV3WPV500"): SCONTROL_11,
            ("scontrol", "show", "job", "-d", "11"): SCONTROL_11,
        }
    )
    make_proc(tmp_path, 7, V2_SLUID)  # environ unreadable: not created
    clock = [1000.0]
    resolver = JobResolver(run=run, ttl_s=60, clock=lambda: clock[0])
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=resolver)
    for _ in range(3):
        assert m.map([sample(1, (7, 1)), sample(2, (7, 1))])[0].job_ids == ("11",)
    rec = m.job_metadata()["11"]
    assert (rec.user, rec.uid, rec.account, rec.partition, rec.gpus, rec.state) == ("bob", 1002, "proj_a", "gpu", 2,
                                                                                    "RUNNING")
    assert resolver.gpu_indexes("11", host="vm") == (1, 2)
    assert +m.skipped == {}  # a missing environ is not a skipped pid
    # One Slurm call for the SLUID, cached; none for the job (the SLUID answer filled it).
    assert run.calls == [("scontrol", "show", "job", "-d", "sEKNKTV3WPV500")]


def test_a_heterogeneous_jobs_component_goes_by_its_own_job_id(tmp_path: Path) -> None:
    # Component 12+1 of heterogeneous job 12 runs in cgroup job_13, and scontrol names it JobId=13 (HetJobId=12
    # HetJobOffset=1, as scontrol prints a component): "13" is its id, the one accounting's sacct records and
    # squeue's %A name it by too (accounting.slurm), so that its usage joins its record. The scontrol text is the
    # real record of job 11 with its JobId changed and the two het keys added.
    het = SCONTROL_11.replace("JobId=11 ", "JobId=13 HetJobId=12 HetJobOffset=1 ", 1)
    run = RecordingRun({("scontrol", "show", "job", "-d", "13"): het})
    make_proc(tmp_path, 7, "0::/system.slice/slurmstepd.scope/job_13/step_0/user/task_0\n")
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=JobResolver(run=run))
    assert m.map([sample(0, (7, 1))])[0].job_ids == ("13",)
    assert list(m.job_metadata()) == ["13"] and m.job_metadata()["13"].user == "bob"


def test_unresolvable_sluid_is_skipped_and_counted(tmp_path: Path) -> None:
    make_proc(tmp_path, 7, V2_SLUID)
    run = RecordingRun({})
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=JobResolver(run=run, clock=lambda: 0.0))
    assert m.map([sample(0, (7, 1))])[0].job_ids == ()
    assert m.map([sample(0, (7, 1))])[0].job_ids == ()
    assert m.skipped["sluid_unresolved"] == 2
    assert len(run.calls) == 2  # scontrol then squeue, once: the miss is cached


def test_no_resolver_and_no_environ_gives_bare_metadata(tmp_path: Path) -> None:
    make_proc(tmp_path, 5, V2)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None)
    m.map([sample(0, (5, 1))])
    rec = m.job_metadata()["4242"]
    assert rec.job_id == "4242" and rec.user is None and rec.gpu_uuids == (sample(0).gpu_uuid,)


# -- what a job's user controls (its processes' environment) decides nothing ------------------------

# The real record of job 11, as Slurm would print it for the job in the V1 captures (job 16): its id changed, and as
# array task 12_4 (ArrayJobId/ArrayTaskId are the fields scontrol prints for an array's task).
SCONTROL_16 = SCONTROL_11.replace("JobId=11 ", "JobId=16 ", 1)
SCONTROL_16_TASK = SCONTROL_11.replace("JobId=11 ", "JobId=16 ArrayJobId=12 ArrayTaskId=4 ", 1)
FORGED = {"SLURM_ARRAY_JOB_ID": "777", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ACCOUNT": "physics",
          "SLURM_JOB_USER": "mallory"}


def test_a_forged_environment_neither_renames_the_job_nor_chooses_its_owner(tmp_path: Path) -> None:
    make_proc(tmp_path, 1, V1_BATCH, env_bytes("inside-job-cgroupv1-env.txt", **FORGED))
    for answer, job in ((SCONTROL_16, "16"), (SCONTROL_16_TASK, "12_4")):
        run = RecordingRun({("scontrol", "show", "job", "-d", "16"): answer})
        m = SlurmCgroupMapper(proc_root=tmp_path, resolver=JobResolver(run=run, clock=lambda: 0.0))
        assert m.map([sample(1, (1, 1))])[0].job_ids == (job,)
        rec = m.job_metadata()[job]
        assert (rec.user, rec.account) == ("bob", "proj_a")  # Slurm's, not the environment's mallory/physics
    # the registered mapper asks the real scontrol, and reads no environment
    made = make_mapper("slurm-cgroup", proc_root=str(tmp_path))
    assert isinstance(made, SlurmCgroupMapper) and isinstance(made.resolver, JobResolver)
    assert not made.trust_environ


def test_a_job_slurm_does_not_answer_for_goes_by_its_cgroup_id_and_is_asked_again(tmp_path: Path) -> None:
    make_proc(tmp_path, 1, V1_BATCH, env_bytes("inside-job-cgroupv1-env.txt", **FORGED))
    answers: dict[tuple[str, ...], str] = {}
    run = RecordingRun(answers)
    clock = [0.0]
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=JobResolver(run=run, ttl_s=60, clock=lambda: clock[0]))
    for _ in range(3):
        assert m.map([sample(1, (1, 1))])[0].job_ids == ("16",)  # never the environment's 777_3
    assert m.job_metadata()["16"].account is None
    assert len(run.calls) == 1  # the miss is cached for the resolver's TTL
    answers[("scontrol", "show", "job", "-d", "16")] = SCONTROL_16_TASK
    clock[0] = 61.0
    assert m.map([sample(1, (1, 1))])[0].job_ids == ("12_4",)
    assert m.job_metadata()["12_4"].account == "proj_a"


def test_one_process_that_fails_to_map_costs_no_other_job_its_gpu(tmp_path: Path) -> None:
    make_proc(tmp_path, 1, V1_PLAIN)  # job 77
    make_proc(tmp_path, 2, V2)  # job 4242: Slurm's command fails in a way the resolver does not expect

    def run(argv: Sequence[str]) -> str:
        if argv[-1] == "4242":
            raise RuntimeError("boom")
        raise FileNotFoundError(argv[0])

    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=JobResolver(run=run, clock=lambda: 0.0))
    out = m.map([sample(0, (1, 1)), sample(1, (2, 1)), sample(2, (1, 1), (2, 1))])
    assert [s.job_ids for s in out] == [("77",), (), ("77",)]
    assert m.skipped["error"] == 1


def test_other_scripts_digits_in_a_trusted_environment_are_not_numbers(tmp_path: Path) -> None:
    # '²'.isdigit() is True and int('²') raises: the job is still mapped, its GPU count and uid left unknown
    env = env_bytes("inside-job-cgroupv1-env.txt", SLURM_GPUS_ON_NODE="\u00b2", SLURM_JOB_UID="\u0661",
                    SLURM_JOB_GPUS="0-99999999")
    env = env.replace(b"SLURM_GPUS_ON_NODE=2\0", b"").replace(b"SLURM_JOB_UID=1002\0", b"")
    env = env.replace(b"SLURM_JOB_GPUS=1,2\0", b"")
    make_proc(tmp_path, 1, V1_BATCH, env)
    m = SlurmCgroupMapper(proc_root=tmp_path, resolver=None, trust_environ=True)
    assert m.map([sample(1, (1, 1))])[0].job_ids == ("16",)
    rec = m.job_metadata()["16"]
    assert (rec.uid, rec.user) == (None, "bob")
    assert m.skipped == {}
