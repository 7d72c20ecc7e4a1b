"""gpuledger.agent.slurm parsers on the real Slurm 22.05 captures, and JobResolver caching through a `run=` seam."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.agent.slurm import (
    JobResolver,
    SlurmParseError,
    expand_hostlist,
    job_record,
    parse_gres_idx,
    parse_index_list,
    parse_job_environ,
    parse_scontrol_show_job,
    parse_squeue_json,
    parse_tres,
)

REAL = DATA_ROOT / "slurm" / "real-22.05"
SCONTROL = (REAL / "scontrol-show-job-d-running-gpu.txt").read_text()
SQUEUE = (REAL / "squeue-json.json").read_text()


def environ(name: str) -> bytes:
    return b"\0".join(line.encode() for line in (REAL / name).read_text().splitlines()) + b"\0"


def test_scontrol_show_job_d_real() -> None:
    (job,) = parse_scontrol_show_job(SCONTROL)
    assert job["job_id"] == job["raw_job_id"] == "11"
    assert (job["user"], job["uid"], job["account"], job["partition"], job["state"]) == ("bob", 1002, "proj_a", "gpu",
                                                                                         "RUNNING")
    assert job["hosts"] == ("vm",)
    assert job["gpus"] == 2  # gres/gpu=2; the typed gres/gpu:h200=2 is the same GPUs
    assert job["gpu_indexes"] == (1, 2)
    assert job["gpu_indexes_by_node"] == {"vm": (1, 2)}
    assert dict(job["tres"])["mem"] == 2000 * 2**20
    assert job["start"] == datetime(2026, 11, 29, 16, 23, 29).timestamp()  # local time, as scontrol prints
    assert job["end"] is None  # EndTime=Unknown
    assert job["raw"]["AllocNode:Sid"] == "localhost:27473"
    assert job["raw"]["JOB_GRES"] == "gpu:h200:2"
    assert job["sluid"] is None


def test_scontrol_several_records_multi_node_and_array() -> None:
    text = (
        "JobId=1235 ArrayJobId=1234 ArrayTaskId=7 JobName=my job with spaces\n"
        "   UserId=carol(1003) GroupId=carol(1003) MCS_label=N/A\n"
        "   JobState=RUNNING Reason=None Dependency=(null)\n"
        "   Partition=gpu AllocNode:Sid=login:1\n"
        "   NodeList=gpu[01-02]\n"
        "   TRES=cpu=16,mem=64G,node=2,billing=100,gres/gpu=5\n"
        "     Nodes=gpu01 CPU_IDs=0-7 Mem=32768 GRES=gpu:a100:4(IDX:0-3)\n"
        "     Nodes=gpu02 CPU_IDs=0-7 Mem=32768 GRES=gpu:a100:1(IDX:6)\n"
        "   \n\n"
        "JobId=20 JobName=x SLUID=sEKNKTV3WPV500\n"
        "   UserId=dave(1004) Account=proj_a_ml\n"
        "   JobState=PENDING Partition=gpu NodeList=(null)\n"
        "   \n"
    )
    a, b = parse_scontrol_show_job(text)
    assert a["job_id"] == "1234_7" and a["raw_job_id"] == "1235"
    assert a["raw"]["JobName"] == "my job with spaces"
    assert a["hosts"] == ("gpu01", "gpu02")
    assert a["gpu_indexes_by_node"] == {"gpu01": (0, 1, 2, 3), "gpu02": (6,)}
    assert a["gpus"] == 5
    assert b["sluid"] == "sEKNKTV3WPV500" and b["hosts"] == () and b["gpu_indexes"] == ()
    assert parse_scontrol_show_job("") == []
    assert parse_scontrol_show_job("slurm_load_jobs error: Invalid job id specified\n") == []


def test_squeue_json_real() -> None:
    jobs = {j["job_id"]: j for j in parse_squeue_json(SQUEUE)}
    assert sorted(jobs, key=int) == [str(i) for i in range(1, 15)]  # finished jobs are included
    running = {k for k, j in jobs.items() if j["state"] == "RUNNING"}
    assert running == {"10", "11"}
    assert jobs["11"]["gpu_indexes_by_node"] == {"vm": (1, 2)}
    assert jobs["10"]["gpu_indexes"] == (0,)
    bob = jobs["11"]
    assert (bob["user"], bob["uid"], bob["account"], bob["cluster"]) == ("bob", 1002, "proj_a", "testcluster")
    assert jobs["11"]["gpus"] == 2
    assert jobs["12"]["state"] == "PENDING" and jobs["12"]["gpus"] is None and jobs["12"]["start"] is None
    # The two formats agree on the same instant (scontrol prints local time, squeue epochs).
    # The capture host ran in UTC: squeue's epoch is scontrol's "StartTime=2026-11-29T16:23:29".
    assert jobs["11"]["start"] == datetime(2026, 11, 29, 16, 23, 29, tzinfo=UTC).timestamp()


def test_squeue_json_wrapped_numbers_of_newer_versions() -> None:
    doc = {
        "jobs": [
            {
                "job_id": 31,
                "array_job_id": {"set": True, "infinite": False, "number": 30},
                "array_task_id": {"set": True, "infinite": False, "number": 1},
                "job_state": ["RUNNING"],
                "user_name": "erin",
                "user_id": 1005,
                "account": "proj_b",
                "partition": "gpu",
                "nodes": "n1",
                "start_time": {"set": True, "infinite": False, "number": 1795969409},
                "end_time": {"set": False, "infinite": False, "number": 0},
                "gres_detail": ["gpu:h100:2(IDX:0,3)"],
                "job_resources": {"nodes": {"allocation": [{"name": "n1"}]}},
                "tres_alloc_str": "cpu=4,gres/gpu=2",
                "sluid": "s0123456789ABC",
            }
        ]
    }
    (j,) = parse_squeue_json(json.dumps(doc))
    assert (j["job_id"], j["raw_job_id"], j["state"], j["sluid"]) == ("30_1", "31", "RUNNING", "s0123456789ABC")
    assert j["gpu_indexes_by_node"] == {"n1": (0, 3)} and j["start"] == 1795969409.0 and j["end"] is None


def test_job_environ_batch_and_step_real() -> None:
    batch = parse_job_environ(environ("inside-job-cgroupv1-env.txt"))
    step = parse_job_environ(environ("inside-step0-cgroupv1-env.txt"))
    assert batch is not None and step is not None
    for meta in (batch, step):
        assert (meta["job_id"], meta["user"], meta["uid"], meta["account"], meta["partition"]) == ("16", "bob", 1002,
                                                                                                   "proj_a", "gpu")
        # CUDA_VISIBLE_DEVICES=0,1 inside the job is renumbered; the node's GPUs are 1 and 2.
        assert meta["gpu_indexes"] == (1, 2)
        assert meta["gpus"] == 2
        assert meta["cluster"] == "testcluster"
    linuxproc = parse_job_environ(environ("inside-job-linuxproc-env.txt"))
    assert linuxproc is not None and linuxproc["job_id"] == "9" and linuxproc["gpu_indexes"] == (1, 2)


def test_job_environ_outside_a_job_and_odd_values() -> None:
    assert parse_job_environ(b"PATH=/bin\0HOME=/root\0") is None
    assert parse_job_environ(b"") is None
    meta = parse_job_environ(b"SLURM_JOBID=5\0SLURM_STEP_GPUS=3\0SLURM_JOB_UID=x\0\xff\xfe=1\0")
    assert meta is not None and meta["job_id"] == "5" and meta["gpu_indexes"] == (3,)
    assert meta["gpus"] == 1 and meta["uid"] is None
    meta = parse_job_environ(b"SLURM_JOB_ID=6\0SLURM_JOB_GPUS=GPU-1234\0")
    assert meta is not None and meta["gpu_indexes"] == () and meta["gpus"] is None
    # the user writes the environment: a node list that is none costs its hosts, never the job
    meta = parse_job_environ(b"SLURM_JOB_ID=7\0SLURM_JOB_NODELIST=n[\0SLURM_STEP_GPUS=1\0")
    assert meta is not None and meta["job_id"] == "7" and meta["hosts"] == () and meta["gpu_indexes"] == (1,)


def test_small_parsers() -> None:
    assert parse_gres_idx("gpu:h200:2(IDX:1-2)") == (2, (1, 2))
    assert parse_gres_idx("gpu:2(IDX:0,2-3)") == (2, (0, 2, 3))
    assert parse_gres_idx("gpu:a100:1(IDX:N/A)") == (1, ())
    assert parse_gres_idx("gpu:a100:2(IDX:0-1),gpu:v100:1(IDX:4)") == (3, (0, 1, 4))
    assert parse_gres_idx("") == (None, ())
    assert parse_index_list("(null)") == ()
    assert expand_hostlist("gpu[01-03,07],login1") == ("gpu01", "gpu02", "gpu03", "gpu07", "login1")
    assert expand_hostlist("(null)") == ()
    assert parse_tres("cpu=2,mem=1G,bad,gres/gpu=x") == (("cpu", 2.0), ("mem", 2.0**30))


@given(st.lists(st.integers(min_value=0, max_value=64), unique=True, max_size=16))
def test_index_list_roundtrip(idx: list[int]) -> None:
    idx.sort()
    # Compress into Slurm's range form and parse back.
    parts: list[str] = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    assert parse_index_list(",".join(parts)) == tuple(idx)


class Run:
    def __init__(self, answers: dict[tuple[str, ...], str]) -> None:
        self.answers, self.calls = answers, []

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(tuple(argv))
        if tuple(argv) not in self.answers:
            raise subprocess.CalledProcessError(1, list(argv))
        return self.answers[tuple(argv)]


def test_resolver_caches_with_ttl() -> None:
    run = Run({("scontrol", "show", "job", "-d", "11"): SCONTROL})
    now = [0.0]
    r = JobResolver(run=run, ttl_s=60, clock=lambda: now[0])
    rec = r.job("11")
    assert rec is not None and (rec.user, rec.account, rec.gpus) == ("bob", "proj_a", 2)
    assert r.gpu_indexes("11") == (1, 2) and r.gpu_indexes("11", host="other") == ()
    now[0] = 59.0
    r.job("11")
    assert len(run.calls) == 1
    now[0] = 61.0
    r.job("11")
    assert len(run.calls) == 2


def test_resolver_caches_misses_and_survives_missing_slurm() -> None:
    run = Run({})
    now = [0.0]
    r = JobResolver(run=run, ttl_s=30, clock=lambda: now[0])
    assert r.job("99") is None and r.job("99") is None
    assert len(run.calls) == 1
    now[0] = 31.0
    assert r.gpu_indexes("99") == ()
    assert len(run.calls) == 2


def test_resolver_sluid_via_squeue_json_when_scontrol_does_not_know_it() -> None:
    doc = json.loads(SQUEUE)
    doc["jobs"][10]["sluid"] = "sEKNKTV3WPV500"  # job 11; the field name is our 26.05 assumption
    run = Run({("squeue", "--json"): json.dumps(doc)})
    r = JobResolver(run=run, ttl_s=60, clock=lambda: 0.0)
    assert r.job_id_for_sluid("sEKNKTV3WPV500") == "11"
    assert r.job_id_for_sluid("sEKNKTV3WPV500") == "11"
    assert run.calls == [("scontrol", "show", "job", "-d", "sEKNKTV3WPV500"), ("squeue", "--json")]
    # squeue's answer filled the job cache too: no scontrol call for job 11.
    assert r.meta("11")["gpu_indexes"] == (1, 2) and len(run.calls) == 2


def test_resolver_bad_squeue_output_is_a_miss() -> None:
    r = JobResolver(run=Run({("squeue", "--json"): "not json"}), clock=lambda: 0.0)
    assert r.job_id_for_sluid("sEKNKTV3WPV500") is None


def test_job_record_from_meta() -> None:
    (meta,) = parse_scontrol_show_job(SCONTROL)
    rec = job_record(meta, gpu_uuids=("GPU-a",))
    assert rec.job_id == "11" and rec.gpu_uuids == ("GPU-a",) and ("gres/gpu", 2.0) in rec.tres
    assert rec.to_dict()["job_id"] == "11"


@pytest.mark.parametrize("name", ["inside-job-cgroupv1-env.txt", "inside-step0-cgroupv1-env.txt",
                                  "inside-job-linuxproc-env.txt"])
def test_every_env_capture_names_its_account(name: str) -> None:
    meta = parse_job_environ(environ(name))
    assert meta is not None and job_record(meta).account == "proj_a"


def test_parse_tres_strict_when_told_where() -> None:
    # the one TRES parser: lenient for an agent's metadata, strict (naming where) for imported records
    assert parse_tres(" ", where="AllocTRES") == ()
    assert parse_tres("cpu=1,mem=1M", where="AllocTRES") == (("cpu", 1.0), ("mem", 2.0**20))
    with pytest.raises(SlurmParseError, match=r"AllocTRES: '' in 'cpu=1,,gpu=2' is not name=value"):
        parse_tres("cpu=1,,gpu=2", where="AllocTRES")
    with pytest.raises(SlurmParseError, match=r"AllocTRES: value of 'gpu' in 'gpu=x' is not a number"):
        parse_tres("gpu=x", where="AllocTRES")


def test_expand_hostlist_refuses_what_no_hostlist_is_before_building_it():
    # valid lists as before: zero padding by the low bound's width, a suffix, empty items skipped
    assert expand_hostlist("n[1-2],m[01-02]x,,login1") == ("n1", "n2", "m01x", "m02x", "login1")
    assert expand_hostlist("x[09-11,7]") == ("x09", "x10", "x11", "x7")
    assert len(expand_hostlist("n[1-65536]")) == 65536
    # int("a") used to escape as a bare ValueError; node[3-1] was no host; node[1-3000000] built 3 million names
    for text, message in (("node[a-b]", r"'a-b' is not a number or a range LO-HI"),
                          ("node[3-1]", r"'3-1' is not"), ("node[]", r"'' is not"), ("node[1,,2]", r"'' is not"),
                          ("n[²]", r"'²' is not"), ("n[" + "9" * 5000 + "]", r"is not a number"),
                          ("node[1-3", r"unbalanced brackets"),
                          ("node[1-3000000]", r"more than 65536 hosts"), ("n[1-60000],m[1-6000]", r"more than 65536")):
        with pytest.raises(SlurmParseError, match=message):
            expand_hostlist(text)
