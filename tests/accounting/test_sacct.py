"""sacct parsers on real captures (Slurm 22.05 to 24.11), their merge, and SlurmClient's sacct live mode."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401
from typer.testing import CliRunner

from gpuledger.accounting.slurm import (
    ENDED_STATES,
    SlurmClient,
    SlurmCommandError,
    SlurmParseError,
    exit_code_from_text,
    gpus_from_tres,
    merge_sacct,
    parse_sacct_json,
    parse_sacct_parsable,
    parse_tres_text,
)
from gpuledger.cli import app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

DATA = DATA_ROOT / "slurm"
REAL = DATA / "real-22.05"
MiB = 2**20


def read(path: Path) -> str:
    return capture(path.relative_to(DATA_ROOT)).read_text()


def utc(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()


# ------------------------------------------------------------------------------ the real 22.05 cluster's jobs

# (job id, user, account, GPUs, state, exit code per sacct -P) as README.md of the capture describes them.
REAL_JOBS = [
    ("1", "alice", "proj_a", 1, "COMPLETED", 0),
    ("2", "bob", "proj_a", 2, "COMPLETED", 0),
    ("3", "carol", "proj_b", 1, "FAILED", 3),
    ("4", "dave", "proj_a_ml", 1, "COMPLETED", 0),
    ("5", "erin", "proj_b", 2, "COMPLETED", 0),
    ("6", "alice", "proj_b", 0, "CANCELLED", 0),
    ("8", "alice", "proj_a", 1, "CANCELLED", -15),
    ("9", "bob", "proj_a", 2, "COMPLETED", 0),
    ("10", "alice", "proj_a", 1, "RUNNING", None),
    ("11", "bob", "proj_a", 2, "RUNNING", None),
    ("12", "alice", "proj_a", 0, "PENDING", None),
    ("13", "carol", "proj_b", 0, "PENDING", None),
    ("14", "dave", "proj_a_ml", 0, "PENDING", None),
]


def test_sacct_parsable_real_2205_skips_steps_and_counts_typed_gpus_once() -> None:
    recs = parse_sacct_parsable(read(REAL / "sacct-a-P-S-today.txt"), tz=UTC)
    assert [(r.job_id, r.user, r.account, r.gpus, r.state, r.exit_code) for r in recs] == REAL_JOBS
    by = {r.job_id: r for r in recs}
    one = by["1"]
    assert one.cluster == "testcluster" and one.partition == "gpu" and one.gpu_model == "h200"
    assert one.submit == utc("2026-11-29T16:22:40") and one.end == utc("2026-11-29T16:22:43")
    assert dict(one.tres) == {"billing": 11, "cpu": 1, "gres/gpu:h200": 1, "gres/gpu": 1, "mem": 1000 * MiB,
                              "node": 1}
    assert by["10"].end is None and by["12"].start is None
    assert by["6"].gpu_model is None  # empty AllocTRES: cancelled as it was allocated


def test_sacct_json_real_2205_agrees_with_parsable_except_the_exit_code_bug() -> None:
    js = parse_sacct_json(read(REAL / "sacct-json-a-S-today.json"))
    ps = parse_sacct_parsable(read(REAL / "sacct-a-P-S-today.txt"), tz=UTC)
    assert [r.job_id for r in js] == [r.job_id for r in ps]
    for j, p in zip(js, ps):
        # the two forms of the same jobs: the JSON epochs equal the -P UTC texts
        assert (j.user, j.account, j.partition, j.cluster, j.gpus, j.gpu_model, j.state) == \
               (p.user, p.account, p.partition, p.cluster, p.gpus, p.gpu_model, p.state), j.job_id
        assert (j.submit, j.start, j.end) == (p.submit, p.start, p.end), j.job_id
    by = {r.job_id: r for r in js}
    # 22.05's JSON says SUCCESS/0 for FAILED job 3 (and cancelled job 6): unknown, not a wrong 0
    assert by["3"].exit_code is None and by["6"].exit_code is None
    assert by["8"].exit_code == -15  # signals are reported right
    assert by["1"].exit_code == 0 and by["1"].hosts == ("vm",) and by["12"].hosts == ()
    assert by["11"].tres == (("cpu", 2.0), ("mem", 2000.0 * MiB), ("node", 1.0), ("billing", 22.0),
                             ("gres/gpu", 2.0), ("gres/gpu:h200", 2.0))


def test_merge_takes_exit_codes_from_parsable_and_keeps_one_sided_jobs() -> None:
    js = parse_sacct_json(read(REAL / "sacct-json-a-S-today.json"))
    ps = parse_sacct_parsable(read(REAL / "sacct-a-P-S-today.txt"), tz=UTC)
    merged = merge_sacct(js, ps)
    assert [(r.job_id, r.user, r.account, r.gpus, r.state, r.exit_code) for r in merged] == REAL_JOBS
    # one side only: JSON-only job 1 stays as is, -P-only job 17 is appended
    extra = parse_sacct_parsable(read(REAL / "sacct-a-P-cancelled-by.txt"), tz=UTC)
    merged = merge_sacct(js[:1], extra)
    assert [r.job_id for r in merged] == ["1", "17"]
    assert merged[0] == js[0]
    # a field the JSON left empty is filled from -P (uid is not in sacct's JSON)
    with_uid = parse_sacct_parsable("JobID|UID|ExitCode|State\n1|1001|0:0|COMPLETED\n")
    assert merge_sacct(js[:1], with_uid)[0].uid == 1001


def test_cancelled_by_state_text_is_normalised() -> None:
    (r,) = parse_sacct_parsable(read(REAL / "sacct-a-P-cancelled-by.txt"), tz=UTC)
    assert (r.job_id, r.state, r.exit_code, r.gpus) == ("17", "CANCELLED", 0, 0)


# ------------------------------------------------------------------------------ other versions' layouts

def test_sacct_json_2205_9_array_task_multi_node() -> None:
    (r,) = parse_sacct_json(read(DATA / "sacct-json-22.05.9.json"))
    assert r.job_id == "20247445_100"
    assert r.hosts == ("ng30103", "ng30203", "ng30706", "ng30707")
    assert (r.gpus, r.gpu_model, r.state, r.exit_code) == (16, None, "FAILED", None)
    assert (r.user, r.account, r.cluster) == ("hudson", "rrg-bengioy-ad_gpu", "narval")
    assert r.end - r.start == 124403


@pytest.mark.parametrize("name", ["sacct-json-23.02.6.json", "sacct-json-23.11.5.json"])
def test_sacct_json_2302_2311_wrapped_numbers_running_job(name: str) -> None:
    (r,) = parse_sacct_json(read(DATA / name))
    assert (r.job_id, r.user, r.account, r.partition, r.hosts) == ("4", "masterkohga", "mila", "main", ("mila02",))
    assert (r.state, r.gpus, r.end, r.exit_code) == ("RUNNING", 2, None, None)
    assert r.start == 1613725209.0
    assert ("energy", -2.0) not in r.tres  # Slurm's "not set" sentinel is dropped


@pytest.mark.parametrize("name,job_id,partition", [
    ("slurmrestd-24.05.3-v0.0.41-slurmdb-job-gpus-completed.json", "10", "gpu"),
    ("slurmrestd-24.11.5-v0.0.42-slurmdb-job-gpus-completed.json", "6372", "ia"),
])
def test_sacct_json_2405_2411_completed(name: str, job_id: str, partition: str) -> None:
    (r,) = parse_sacct_json(read(DATA / name))
    assert (r.job_id, r.user, r.account, r.partition, r.state, r.exit_code) == \
           (job_id, "acuevas", "acoustic", partition, "COMPLETED", 0)
    assert r.end - r.start == 30
    # This cluster's AccountingStorageTRES lacks gres/gpu: accounting recorded no GPU, and we say so.
    assert r.gpus == 0


def test_sacct_parsable_headerless_xdmod_sample() -> None:
    cols = ("jobid|jobidraw|cluster|partition|qos|account|group|gid|user|uid|submit|eligible|start|end|elapsed|"
            "exitcode|state|nnodes|ncpus|reqcpus|reqmem|reqtres|alloctres|timelimit|nodelist|jobname").split("|")
    recs = parse_sacct_parsable(read(DATA / "sacct-P-xdmod-phillips-sample.txt"), tz=UTC, header=cols)
    assert len(recs) == 55
    gpu_jobs = {r.job_id: r.gpus for r in recs if r.gpus}
    assert gpu_jobs == {"163485": 2, "196835": 2}
    by = {r.job_id: r for r in recs}
    assert (by["163485"].state, by["163485"].uid, by["163485"].user) == ("CANCELLED", 380693, "noror")
    assert by["165381"].hosts == tuple(f"cpn-f13-0{n}-0{i}" for n in (3, 4, 5, 6) for i in (1, 2))
    assert (by["165381"].state, by["165381"].exit_code) == ("TIMEOUT", 1)
    assert dict(by["165381"].tres)["mem"] == 62.5 * 2**30


# ------------------------------------------------------------------------------ GPU counting, exit codes

def test_gpus_typed_only_and_mixed_models() -> None:
    assert gpus_from_tres(parse_tres_text("cpu=4,gres/gpu:a100=2,gres/gpu:h100=1")) == (3, "a100,h100")
    assert gpus_from_tres(parse_tres_text("gres/gpu=6,gres/gpu:h100=2,gres/gpu:h200=4")) == (6, "h100,h200")
    assert gpus_from_tres(parse_tres_text("cpu=1,mem=1000M,gres/gpumem=38888M,gres/gpuutil=90")) == (0, None)
    assert gpus_from_tres(()) == (0, None)


@given(st.dictionaries(st.sampled_from(["a100", "h100", "h200", "l40s"]), st.integers(1, 8), min_size=1),
       st.booleans(), st.randoms())
def test_gpus_count_once_in_any_order(typed: dict[str, int], with_total: bool, rnd) -> None:
    items = [f"gres/gpu:{m}={n}" for m, n in typed.items()] + ["cpu=2", "billing=7", "mem=4G"]
    if with_total:
        items.append(f"gres/gpu={sum(typed.values())}")
    rnd.shuffle(items)
    count, model = gpus_from_tres(parse_tres_text(",".join(items)))
    assert count == sum(typed.values())
    assert model == ",".join(sorted(typed))


def test_exit_code_text() -> None:
    assert exit_code_from_text("3:0") == 3
    assert exit_code_from_text("0:15") == -15
    assert exit_code_from_text("0:0") == 0
    assert exit_code_from_text("") is None


# ------------------------------------------------------------------------------ bad input says what and where

def test_bad_parsable_input_names_line_and_field() -> None:
    with pytest.raises(SlurmParseError, match=r"line 3: 2 fields, header has 3"):
        parse_sacct_parsable("JobID|State|ExitCode\n1|COMPLETED|0:0\n2|FAILED\n")
    with pytest.raises(SlurmParseError, match=r"line 2 \(job 7\) Start: '2026/11/29' is not a time"):
        parse_sacct_parsable("JobID|Start\n7|2026/11/29\n")
    with pytest.raises(SlurmParseError, match=r"job 7\) AllocTRES: 'gpu' in 'cpu=1,gpu' is not name=value"):
        parse_sacct_parsable("JobID|AllocTRES\n7|cpu=1,gpu\n")
    with pytest.raises(SlurmParseError, match=r"job 7\) ExitCode: 'x:1' is not CODE:SIGNAL"):
        parse_sacct_parsable("JobID|State|ExitCode\n7|FAILED|x:1\n")
    with pytest.raises(SlurmParseError, match="no JobID column"):
        parse_sacct_parsable(read(REAL / "sacct-a-P-S-today.txt").split("\n", 1)[1])
    assert parse_sacct_parsable("") == []


def test_bad_json_input_names_position_and_job() -> None:
    with pytest.raises(SlurmParseError, match=r"sacct JSON: not JSON \(line 2, column 1"):
        parse_sacct_json('{"jobs": [\n}')
    with pytest.raises(SlurmParseError, match="'jobs' list"):
        parse_sacct_json('{"meta": {}}')
    ok = '{"job_id": 1, "user": "a", "state": {"current": "COMPLETED"}, "time": {}}'
    with pytest.raises(SlurmParseError, match=r"jobs\[1\]: job_id 'x' is not an integer"):
        parse_sacct_json(f'{{"jobs": [{ok}, {{"job_id": "x"}}]}}')
    # a job with nothing but an id is not sacct output: refused, not imported as a blank job
    with pytest.raises(SlurmParseError,
                       match=r"job 1 \(jobs\[0\]\): no 'user', 'state', 'time'; expected `sacct --json`"):
        parse_sacct_json('{"jobs": [{"job_id": 1}]}')
    assert [r.user for r in parse_sacct_json(f'{{"jobs": [{ok}]}}')] == ["a"]


HEADER = "JobID|Start|End|AllocTRES|NodeList"


@pytest.mark.parametrize("line, message", [
    # each used to be stored (-2 GPUs, 1e308 GPUs: Infinity in every listing, a feed refused for the whole cluster;
    # an end before the start) or to end the import with "unexpected ValueError" (nan, node[a-b])
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=nan|n1", r"line 3 \(job 9\) AllocTRES: gres/gpu=nan is not"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=-2|n1", r"gres/gpu=-2 is not a whole number of GPUs"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1e308|n1", r"gres/gpu=1e\+308 is not a whole number"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu:h200=1.5|n1", r"gres/gpu:h200=1.5 is not a whole number"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|cpu=inf|n1", r"AllocTRES: cpu=inf is not a finite number"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=2|node[a-b]",
     r"line 3 \(job 9\) NodeList: hostlist 'node\[a-b\]': 'a-b' is not a number"),
    ("9|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=2|node[1-3000000]", r"NodeList: .* more than 65536 hosts"),
    ("9|2026-12-01T19:40:00|2026-12-01T19:10:00|gres/gpu=2|n1",
     r"line 3 \(job 9\): End 2026-12-01T19:10:00Z is before Start 2026-12-01T19:40:00Z"),
])
def test_a_record_no_job_can_have_is_refused_naming_line_and_job(line: str, message: str) -> None:
    with pytest.raises(SlurmParseError, match=message):
        parse_sacct_parsable(f"{HEADER}\n1|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1|n1\n{line}\n",
                             tz=UTC)


def test_a_json_record_no_job_can_have_is_refused_naming_the_job() -> None:
    def doc(tres: str, nodes: str = "n1", start: str = "1796151000", end: str = "1796152800") -> str:
        return ('{"jobs": [{"job_id": 4, "user": "a", "state": {"current": "COMPLETED"}, "nodes": "' + nodes
                + f'", "time": {{"start": {start}, "end": {end}}}, "tres": {{"allocated": [{tres}]}}}}]}}')

    def gpu(count: str) -> str:
        return f'{{"type": "gres", "name": "gpu", "count": {count}}}'

    assert parse_sacct_json(doc(gpu("2")))[0].gpus == 2
    assert parse_sacct_json(doc(gpu("-2")))[0].gpus == 0  # Slurm's "not set" sentinel, as before
    for tres, nodes, start, end, message in (
            (gpu("NaN"), "n1", "1796151000", "1796152800", r"job 4: gres/gpu=nan is not a finite number"),
            (gpu("1e308"), "n1", "1796151000", "1796152800", r"job 4: gres/gpu=1e\+308 is not a whole number"),
            (gpu("2"), "n[x]", "1796151000", "1796152800", r"job 4 NodeList: hostlist 'n\[x\]'"),
            (gpu("2"), "n1", "1796152800", "1796151000", r"job 4: End .* is before Start"),
            (gpu("2"), "n1", "1796151000", "1e308", r"job 4: End 1e\+308 is not a time")):
        with pytest.raises(SlurmParseError, match=message):
            parse_sacct_json(doc(tres, nodes, start, end))


# ------------------------------------------------------------------------------ live mode through the run seam

class Replay:
    """Stands in for subprocess.run: answers each Slurm command with a captured real output."""

    def __init__(self, outputs: dict[str, tuple[int, str, str]]) -> None:
        self.outputs = outputs
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv, *, capture_output, text, env, timeout):
        assert capture_output and text and timeout > 0
        self.calls.append((argv, env))
        key = " ".join(argv[:2])
        if key not in self.outputs:
            raise FileNotFoundError(argv[0])
        rc, out, err = self.outputs[key]
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_client_sacct_jobs_runs_both_forms_in_utc_and_merges() -> None:
    run = Replay({
        "sacct --json": (0, read(REAL / "sacct-json-a-S-today.json"), ""),
        "sacct -P": (0, read(REAL / "sacct-a-P-S-today.txt"), ""),
    })
    client = SlurmClient(run=run, env={"SLURM_CONF": "/tmp/x/slurm.conf"})
    recs = client.sacct_jobs(utc("2026-11-29T00:00:00"), datetime(2026, 11, 30, 1, 0, tzinfo=UTC))
    assert [(r.job_id, r.exit_code) for r in recs] == [(j[0], j[5]) for j in REAL_JOBS]
    (a_json, env1), (a_p, env2) = run.calls
    for argv, env in run.calls:
        assert argv[argv.index("-S") + 1] == "2026-11-29T00:00:00"
        assert argv[argv.index("-E") + 1] == "2026-11-30T01:00:00"
        assert "-a" in argv and env["TZ"] == "UTC" and env["SLURM_CONF"] == "/tmp/x/slurm.conf"
    assert any(a.startswith("--format=JobID,") for a in a_p) and "-X" in a_p
    assert "-D" in a_json and "-D" in a_p  # every run of a requeued job


# ------------------------------------------------------------------------------ a requeued job (sacct -D)

REQUEUE = DATA / "requeue-22.05"
# job 1 ran on vm, was requeued by `scontrol requeue`, and ran again there (REQUEUE/README.md)
FIRST_RUN = (utc("2026-12-02T06:17:30"), utc("2026-12-02T06:17:31"), ("vm",))


def test_a_requeued_jobs_runs_are_one_record_of_the_latest_run_with_the_earlier_ones() -> None:
    parsable = parse_sacct_parsable(read(REQUEUE / "sacct-P-X-D-requeued.txt"), tz=UTC)
    assert parsable == parse_sacct_parsable(read(REQUEUE / "sacct-P-D-requeued.txt"), tz=UTC)  # steps skipped
    as_json = parse_sacct_json(read(REQUEUE / "sacct-json-D-requeued.json"))
    for (r,) in (parsable, as_json, merge_sacct(as_json, parsable)):
        assert (r.job_id, r.user, r.hosts, r.state, r.exit_code) == ("1", "alice", ("vm",), "COMPLETED", 0)
        assert (r.start, r.end) == (utc("2026-12-02T06:17:33"), utc("2026-12-02T06:17:36"))
        assert r.earlier_runs == (FIRST_RUN,)
    # without -D sacct -P shows the latest run alone: the same record, no earlier run
    (latest,) = parse_sacct_parsable(read(REQUEUE / "sacct-P-X-requeued.txt"), tz=UTC)
    assert latest == replace(parsable[0], earlier_runs=())
    assert JobRecord.from_dict(json.loads(json.dumps(parsable[0].to_dict()))) == parsable[0]


def test_runs_fold_per_job_the_latest_by_start_and_a_run_not_started_is_the_latest() -> None:
    header = "JobID|Cluster|Start|End|State|NodeList"
    text = "\n".join([header,
                      "7|c1|2026-12-01T10:00:00|2026-12-01T11:00:00|REQUEUED|n1",
                      "8|c1|2026-12-01T10:00:00|2026-12-01T10:30:00|COMPLETED|n3",
                      "7|c2|2026-12-01T09:00:00|2026-12-01T09:10:00|COMPLETED|m1",  # another cluster's job 7
                      "7|c1|2026-12-01T12:00:00|2026-12-01T13:00:00|REQUEUED|n2",
                      "7|c1|Unknown|Unknown|PENDING|None assigned"])
    recs = parse_sacct_parsable(text, tz=UTC)
    assert [(r.cluster, r.job_id, r.state, r.earlier_runs) for r in recs] == [
        ("c1", "7", "PENDING", ((utc("2026-12-01T10:00:00"), utc("2026-12-01T11:00:00"), ("n1",)),
                                (utc("2026-12-01T12:00:00"), utc("2026-12-01T13:00:00"), ("n2",)))),
        ("c1", "8", "COMPLETED", ()), ("c2", "7", "COMPLETED", ())]
    # a job listed once per record, as before -D: the records as they were, in sacct's order
    once = "\n".join([header, "8|c1|2026-12-01T10:00:00|2026-12-01T10:30:00|COMPLETED|n3",
                       "7|c1|2026-12-01T10:00:00|2026-12-01T11:00:00|COMPLETED|n1"])
    assert [(r.job_id, r.earlier_runs) for r in parse_sacct_parsable(once, tz=UTC)] == [("8", ()), ("7", ())]


def running_lines(parsable: str) -> str:
    """The header and the lines of running jobs (their steps too) of a captured ``sacct -P``: what sacct prints
    for ``--state=R,S``."""
    header, *lines = parsable.splitlines()
    state = header.split("|").index("State")
    return "\n".join([header, *(ln for ln in lines if ln.split("|")[state] in ("RUNNING", "SUSPENDED"))]) + "\n"


def test_client_sacct_running_is_one_parsable_call_of_the_jobs_running_at_an_instant() -> None:
    # a cluster runs ~20k jobs at once: one sacct -P -X call, no JSON (a running job has no exit code to add)
    run = Replay({"sacct -P": (0, running_lines(read(REAL / "sacct-a-P-S-today.txt")), "")})
    recs = SlurmClient(run=run).sacct_running(utc("2026-11-29T16:23:46"))
    assert [(r.job_id, r.user, r.gpus, r.state, r.start, r.end, r.exit_code) for r in recs] == [
        ("10", "alice", 1, "RUNNING", utc("2026-11-29T16:23:28"), None, None),
        ("11", "bob", 2, "RUNNING", utc("2026-11-29T16:23:29"), None, None)]
    (argv, env), (requeued, _) = run.calls  # the second: the earlier runs of requeued jobs among them
    assert argv[argv.index("-S") + 1] == argv[argv.index("-E") + 1] == "2026-11-29T16:23:46"
    assert {"-P", "-X", "-D", "-a", "--state=R,S"} <= set(argv) and env["TZ"] == "UTC"
    assert any(a.startswith("--format=JobID,JobIDRaw,") for a in argv)
    assert "--state=RQ" in requeued and requeued[requeued.index("-E") + 1] == "2026-11-29T16:23:46"
    assert all(r.earlier_runs == () for r in recs)  # (the replay's answer holds no REQUEUED run)
    # no job running: one call
    run = Replay({"sacct -P": (0, "JobID|JobIDRaw|State\n", "")})
    assert SlurmClient(run=run).sacct_running(utc("2026-11-29T16:23:46")) == [] and len(run.calls) == 1


class ReplayByState(Replay):
    """A Replay that answers ``sacct -P`` by its ``--state`` argument."""

    def __call__(self, argv, **kw):
        state = next(a for a in argv if a.startswith("--state="))
        return super().__call__(["sacct", state, *argv[1:]], **kw)


def test_sacct_running_gives_a_requeued_jobs_record_its_earlier_run() -> None:
    # real 22.05 (REQUEUE/README.md): job 2 requeued and running again; sacct -D --state=R,S at an instant lists its
    # running run alone, --state=RQ since the earliest running job's submission (less an hour) its first run
    run = ReplayByState({"sacct --state=R,S": (0, read(REQUEUE / "sacct-P-X-D-running-requeued.txt"), ""),
                         "sacct --state=RQ": (0, read(REQUEUE / "sacct-P-X-D-RQ-requeued.txt"), "")})
    bob, alice = SlurmClient(run=run).sacct_running(utc("2026-12-02T12:52:08"))
    assert (bob.job_id, bob.user, bob.earlier_runs) == ("1", "bob", ())
    assert (alice.job_id, alice.state, alice.start, alice.end) == ("2", "RUNNING", utc("2026-12-02T12:52:04"), None)
    assert alice.earlier_runs == ((utc("2026-12-02T12:52:01"), utc("2026-12-02T12:52:03"), ("vm",)),)
    _, (requeued, env) = run.calls
    assert (requeued[requeued.index("-S") + 1], requeued[requeued.index("-E") + 1]) == (
        "2026-12-02T11:51:58", "2026-12-02T12:52:08")  # bob's Submit less an hour: alice's is her requeue
    assert {"-P", "-X", "-D", "-a"} <= set(requeued) and env["TZ"] == "UTC"
    # a REQUEUED run of a job that runs no more (not among the running ones) is not made into one
    run = ReplayByState({"sacct --state=R,S": (0, running_lines(read(REAL / "sacct-a-P-S-today.txt")), ""),
                         "sacct --state=RQ": (0, read(REQUEUE / "sacct-P-X-D-RQ-requeued.txt"), "")})
    assert [r.job_id for r in SlurmClient(run=run).sacct_running(utc("2026-11-29T16:23:46"))] == ["10", "11"]


def test_the_ended_jobs_import_asks_for_requeued_runs_too() -> None:
    # sacct -D with a state filter lists a run only in a state named: without RQ, the import of ended jobs
    # (`priority watch`) got a requeued job's latest run alone, though its window held both
    assert [r.earlier_runs for r in parse_sacct_parsable(read(REQUEUE / "sacct-P-X-D-ended-no-RQ-requeued.txt"),
                                                         tz=UTC)] == [()]
    run = Replay({"sacct --json": (0, read(REQUEUE / "sacct-json-D-ended-requeued.json"), ""),
                  "sacct -P": (0, read(REQUEUE / "sacct-P-X-D-ended-requeued.txt"), "")})
    (job,) = SlurmClient(run=run).sacct_jobs(utc("2026-12-02T12:50:58"), utc("2026-12-02T12:52:21"),
                                             states=ENDED_STATES)
    assert (job.job_id, job.state, job.exit_code, job.start, job.end) == (
        "2", "COMPLETED", 0, utc("2026-12-02T12:52:04"), utc("2026-12-02T12:52:19"))
    assert job.earlier_runs == ((utc("2026-12-02T12:52:01"), utc("2026-12-02T12:52:03"), ("vm",)),)
    for argv, _ in run.calls:
        assert "RQ" in next(a for a in argv if a.startswith("--state=")).removeprefix("--state=").split(",")


def test_client_errors_carry_command_and_stderr() -> None:
    run = Replay({"sacct --json": (1, "", "sacct: error: Problem talking to the database: Connection refused\n")})
    with pytest.raises(SlurmCommandError, match="Connection refused") as e:
        SlurmClient(run=run).sacct_jobs(0, 1)
    assert e.value.argv[:2] == ["sacct", "--json"] and e.value.returncode == 1
    with pytest.raises(SlurmCommandError, match="command not found"):
        SlurmClient(run=Replay({})).pending_jobs()


def test_live_sacct_leaves_out_a_record_no_job_can_have_naming_it_and_imports_the_others(caplog) -> None:
    # a file given to `jobs import` is all or nothing; sacct run live (`--slurm`, `priority watch`) skips Slurm's one
    # bad record, which would otherwise stop every import of the cluster's jobs, run after run
    gpu = '{"type": "gres", "name": "gpu", "count": 1}'
    json_doc = ('{"jobs": [' + ", ".join(
        f'{{"job_id": {j}, "user": "a", "state": {{"current": "COMPLETED"}}, "nodes": "n1", "time": {{"start": '
        f'{start}, "end": {end}}}, "tres": {{"allocated": [{gpu}]}}}}'
        for j, start, end in ((4, 1796151000, 1796152800), (5, 1796152800, 1796151000), (6, 1796151000, 1796152800)))
        + "]}")
    parsable = (f"{HEADER}\n4|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1|n1\n"
                "5|2026-12-01T19:40:00|2026-12-01T19:10:00|gres/gpu=1|n1\n"
                "6|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1|n1\n"
                "7|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1|n1\n")  # 7: in -P only, kept
    run = Replay({"sacct --json": (0, json_doc, ""), "sacct -P": (0, parsable, "")})
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        recs = SlurmClient(run=run).sacct_jobs(0, 1)
    assert [r.job_id for r in recs] == ["4", "6", "7"]
    assert any("job 5" in r.getMessage() and "before Start" in r.getMessage() for r in caplog.records)


def test_a_job_whose_two_forms_together_have_impossible_times_is_left_out_live_and_refused_from_files(
        caplog, tmp_path: Path) -> None:
    # job 8: the JSON saw it start on 1 December and not yet end, -P gives it an end the day before (each form alone
    # a job's times); merged, it ends before it starts. Live, that one job is left out with a warning naming it (it
    # used to stop the whole import, run after run); files the user gave are refused as a whole, exit 2.
    gpu = '{"type": "gres", "name": "gpu", "count": 1}'
    json_doc = ('{"jobs": [' + ", ".join(
        f'{{"job_id": {j}, "user": "a", "state": {{"current": "COMPLETED"}}, "nodes": "n1", "time": {{"start": '
        f'{start}, "end": {end}}}, "tres": {{"allocated": [{gpu}]}}}}'
        for j, start, end in ((4, 1796151000, 1796152800), (8, 1796152800, 0))) + "]}")
    parsable = (f"{HEADER}\n4|2026-12-01T19:10:00|2026-12-01T19:40:00|gres/gpu=1|n1\n"
                "8|2026-11-30T10:00:00|2026-11-30T11:00:00|gres/gpu=1|n1\n")  # a day before: in any zone
    run = Replay({"sacct --json": (0, json_doc, ""), "sacct -P": (0, parsable, "")})
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        recs = SlurmClient(run=run).sacct_jobs(0, 1)
    assert [(r.job_id, r.start, r.end) for r in recs] == [("4", 1796151000.0, 1796152800.0)]
    assert [r.getMessage() for r in caplog.records] == [
        "sacct record left out: job 8 (sacct JSON and -P together): End 2026-11-30T11:00:00Z is before Start "
        "2026-12-01T19:20:00Z"]

    (tmp_path / "sacct.json").write_text(json_doc)
    (tmp_path / "sacct.txt").write_text(parsable)
    r = CliRunner().invoke(app, ["jobs", "import", "--data-dir", str(tmp_path / "d"), "--sacct-json",
                                 str(tmp_path / "sacct.json"), "--sacct-parsable", str(tmp_path / "sacct.txt")])
    assert r.exit_code == 2, r.output
    assert "job 8 (sacct JSON and -P together): End" in r.output and "imported" not in r.output
    assert not (tmp_path / "d").exists()  # nothing stored


def test_an_array_cancelled_while_pending_is_one_record_in_both_forms() -> None:
    # sacct --json names the never-split record by its job id and a task bit mask, -P as "5_[1-5,7]": one job
    from datetime import UTC

    from gpuledger.accounting.slurm import merge_sacct, parse_sacct_json, parse_sacct_parsable

    as_json = parse_sacct_json((REAL / "sacct-json-array-cancelled-pending.json").read_text())
    parsable = parse_sacct_parsable((REAL / "sacct-P-array-cancelled-pending.txt").read_text(), tz=UTC)
    assert [r.job_id for r in as_json] == [r.job_id for r in parsable] == ["5_[1-5,7]"]
    (merged,) = merge_sacct(as_json, parsable)
    assert (merged.job_id, merged.state, merged.exit_code) == ("5_[1-5,7]", "CANCELLED", 0)


# ------------------------------------------------------------------------------ heterogeneous jobs

HET_T0 = 1791158400  # 2026-10-05T00:00:00Z


def het_sacct_json() -> str:
    """`sacct --json` of heterogeneous job 12, its components 12+0 (job id 12, on n1) and 12+1 (job id 13, on n2),
    one GPU each, 2026-10-05 00:00-01:00 UTC. Made from the real 23.11.5 capture's one job (no public capture of a
    heterogeneous job was found): ``job_id``, ``het`` (as 23.11 prints it for a component: the leader's id and the
    wrapped offset; a job that is none has ``{"job_id": 0, "job_offset": {"set": false, ...}}``, as in the capture),
    nodes, GPUs, times and state replaced."""
    doc = json.loads(read(DATA / "sacct-json-23.11.5.json"))
    (base,) = doc["jobs"]
    doc["jobs"] = []
    for raw, offset, node in ((12, 0, "n1"), (13, 1, "n2")):
        job = copy.deepcopy(base)
        job.update(job_id=raw, nodes=node, cluster="c", user="alice", account="a",
                   het={"job_id": 12, "job_offset": {"set": True, "infinite": False, "number": offset}},
                   state={"current": ["COMPLETED"], "reason": "None"})
        job["tres"]["allocated"] = [t for t in job["tres"]["allocated"] if t["type"] != "gres"] + [
            {"type": "gres", "name": "gpu", "id": 1001, "count": 1}]
        job["time"].update(submission=HET_T0, eligible=HET_T0, start=HET_T0, end=HET_T0 + 3600, elapsed=3600)
        doc["jobs"].append(job)
    return json.dumps(doc)


# sacct -P -X of the same job, in the form sacct prints a heterogeneous job's components (JobID leader+offset,
# JobIDRaw the component's own id; Slurm's heterogeneous_jobs.html); steps as sacct lists them without -X
HET_PARSABLE = (
    "JobID|JobIDRaw|Cluster|User|Account|NodeList|AllocTRES|Submit|Start|End|State|ExitCode\n"
    "12+0|12|c|alice|a|n1|cpu=1,gres/gpu=1,node=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|"
    "COMPLETED|0:0\n"
    "12+0.batch|12.batch|c||a|n1|cpu=1,gres/gpu=1,node=1|2026-10-05T00:00:00|2026-10-05T00:00:00|"
    "2026-10-05T01:00:00|COMPLETED|0:0\n"
    "12+1|13|c|alice|a|n2|cpu=1,gres/gpu=1,node=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|"
    "COMPLETED|3:0\n"
    "12+1.0|13.0|c||a|n2|cpu=1,gres/gpu=1,node=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|"
    "COMPLETED|3:0\n")


def test_a_heterogeneous_jobs_components_go_by_their_own_job_ids_in_both_forms() -> None:
    # the ids the components' cgroups (job_12, job_13), scontrol and squeue's %A name them by, and so the agents
    as_json = parse_sacct_json(het_sacct_json())
    parsable = parse_sacct_parsable(HET_PARSABLE, tz=UTC)
    assert [(r.job_id, r.hosts, r.gpus) for r in as_json] == [("12", ("n1",), 1), ("13", ("n2",), 1)]
    assert [(r.job_id, r.hosts, r.gpus, r.exit_code) for r in parsable] == [("12", ("n1",), 1, 0),
                                                                             ("13", ("n2",), 1, 3)]
    assert [(r.job_id, r.start, r.end, r.exit_code) for r in merge_sacct(as_json, parsable)] == [
        ("12", HET_T0, HET_T0 + 3600, 0), ("13", HET_T0, HET_T0 + 3600, 3)]
    # without JobIDRaw: the leader's own id is the job's; any other component's is nowhere in the line
    no_raw = "\n".join("|".join(f for i, f in enumerate(ln.split("|")) if i != 1) for ln in HET_PARSABLE.splitlines())
    with pytest.raises(SlurmParseError, match=r"sacct -P line 4: heterogeneous job component 12\+1 without a "
                                              "JobIDRaw column.*add JobIDRaw"):
        parse_sacct_parsable(no_raw, tz=UTC)
    assert [r.job_id for r in parse_sacct_parsable(no_raw.split("\n12+1|")[0], tz=UTC)] == ["12"]
    with pytest.raises(SlurmParseError, match=r"line 2: JobIDRaw '12x' is not a job id"):
        parse_sacct_parsable(HET_PARSABLE.replace("12+0|12|", "12+0|12x|"), tz=UTC)


def test_live_sacct_asks_for_jobidraw_and_names_het_components_by_it() -> None:
    run = Replay({"sacct --json": (0, het_sacct_json(), ""), "sacct -P": (0, HET_PARSABLE, "")})
    assert [r.job_id for r in SlurmClient(run=run).sacct_jobs(0, 1)] == ["12", "13"]
    fmt = next(a for a in run.calls[1][0] if a.startswith("--format="))
    assert "JobIDRaw" in fmt.removeprefix("--format=").split(",")


def het_measured(d: Path, records: Sequence[JobRecord] = ()) -> Path:
    """A data dir whose agents on n1 and n2 measured jobs "12" and "13" for an hour (as their cgroups name het job
    12's components), with ``records`` stored beside, priced 1.0 a GPU-hour."""
    store = Store(d / "gpuledger.sqlite", clock=lambda: HET_T0 + 30 * 86400)
    try:
        for seq, (host, job) in enumerate((("n1", "12"), ("n2", "13")), 1):
            store.ingest(Batch("ag-" + host, seq, host, tuple(
                GpuSample(ts=HET_T0 + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, model="NVIDIA H200",
                          sm_active_ratio=0.9, energy_joules=3000.0 * k, job_ids=(job,)) for k in range(361)),
                cluster="c"))
        if records:
            store.put_jobs(records)
    finally:
        store.close()
    (d / "gpuledger.toml").write_text("[report.price_per_gpu_hour]\ndefault = 1.0\n")
    return d


def het_billed(d: Path) -> tuple[list[tuple], dict]:
    """``jobs list``'s (job id, seen by, user, Slurm and observed GPU-seconds) and ``report usage``'s total for
    October 2026, by user."""
    runner = CliRunner()
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(d), "--format", "json"])
    assert r.exit_code == 0, r.output
    jobs = [(j["job_id"], j["seen_by"], j["user"], j["slurm_gpu_seconds"], j["observed_gpu_seconds"])
            for j in json.loads(r.stdout)]
    r = runner.invoke(app, ["report", "usage", "--data-dir", str(d), "--period", "2026-10", "--by", "user",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    return jobs, json.loads(r.stdout)["total"]


def test_measured_usage_of_a_het_component_joins_slurms_record_of_it_and_bills_once(tmp_path: Path) -> None:
    d = het_measured(tmp_path / "d")
    (tmp_path / "sacct.json").write_text(het_sacct_json())
    (tmp_path / "sacct.txt").write_text(HET_PARSABLE)
    r = CliRunner().invoke(app, ["jobs", "import", "--data-dir", str(d), "--sacct-json",
                                 str(tmp_path / "sacct.json"), "--sacct-parsable", str(tmp_path / "sacct.txt")])
    assert r.exit_code == 0, r.output
    jobs, total = het_billed(d)
    assert jobs == [("12", "both", "alice", 3600.0, 3600.0), ("13", "both", "alice", 3600.0, 3600.0)]
    # two GPU-hours allocated, two billed (not the agents' two and Slurm's unmeasured two)
    assert (total["jobs"], total["billed_gpu_hours"], total["unmeasured_gpu_hours"], total["cost"]) == (2, 2.0, 0.0,
                                                                                                       2.0)


# ------------------------------------------------------------------------------ zone-less local times at DST changes

# US clocks go back at 2026-11-01 02:00 EDT to 01:00 EST: 01:00-01:59 happens twice, first at -04:00, then -05:00.
NEW_YORK = ZoneInfo("America/New_York")
DST_HEADER = "JobID|User|AllocTRES|Submit|Start|End|State"


def test_an_end_before_its_start_in_the_repeated_hour_is_the_second_occurrence(caplog) -> None:
    # 01:50 (first, EDT) -> 01:10 (second, EST): 20 minutes; read as first occurrences it ended before it started.
    # Submitted 01:40: the first occurrence (the second is after the start). Everything decided: no warning.
    text = f"{DST_HEADER}\n300|alice|gres/gpu=1|2026-11-01T01:40:00|2026-11-01T01:50:00|2026-11-01T01:10:00|COMPLETED\n"
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        (r,) = parse_sacct_parsable(text, tz=NEW_YORK)
    assert (r.submit, r.start, r.end) == (utc("2026-11-01T05:40:00"), utc("2026-11-01T05:50:00"),
                                          utc("2026-11-01T06:10:00"))
    assert caplog.records == []
    # an end before its start in any reading is still no job's
    with pytest.raises(SlurmParseError, match=r"line 2 \(job 302\): End 2026-11-01T04:00:00Z is before Start"):
        parse_sacct_parsable(f"{DST_HEADER}\n302|a|gres/gpu=1||2026-11-01T01:10:00|2026-11-01T00:00:00|COMPLETED\n",
                             tz=NEW_YORK)


def test_an_undecided_time_in_the_repeated_hour_is_the_first_occurrence_with_a_warning_naming_both(caplog) -> None:
    # 00:30 -> 01:30: 1 h if the end was the first 01:30, 2 h if the second; nothing in the record says which
    text = f"{DST_HEADER}\n301|bob|gres/gpu=1|2026-10-31T23:00:00|2026-11-01T00:30:00|2026-11-01T01:30:00|COMPLETED\n"
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        (r,) = parse_sacct_parsable(text, tz=NEW_YORK)
    assert (r.start, r.end) == (utc("2026-11-01T04:30:00"), utc("2026-11-01T05:30:00"))
    (msg,) = [rec.getMessage() for rec in caplog.records]
    assert msg.startswith("sacct -P line 2 (job 301) End 2026-11-01T01:30:00: ")
    assert "read as 2026-11-01T05:30:00Z, it may be 2026-11-01T06:30:00Z; the job ran 3600 s or 7200 s" in msg
    assert "TZ=UTC" in msg
    # a caller whose JSON has the job's epochs (which decide) takes the warnings instead of their being logged
    caplog.clear()
    ambiguous: list[tuple[str, str]] = []
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        parse_sacct_parsable(text, tz=NEW_YORK, ambiguous=ambiguous)
    assert caplog.records == [] and ambiguous == [("301", msg)]
    # the same text in UTC is one instant: nothing to warn of
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpuledger.accounting.slurm"):
        (r,) = parse_sacct_parsable(text, tz=UTC)
    assert r.end == utc("2026-11-01T01:30:00") and caplog.records == []


def test_het_components_an_earlier_release_stored_as_leader_plus_offset_join_the_agents_job_ids(tmp_path: Path) -> None:
    # an earlier release stored Slurm's records of job 12's components as "12+0" and "12+1"; their agents measured
    # "12" and "13" (Slurm numbers the components from the leader): read as those, billed once; where the ledger
    # holds a component's record under its own id too (imported since), that one stands
    old = [JobRecord(job_id, cluster="c", user="alice", account="a", hosts=(host,), gpus=1, start=HET_T0,
                     end=HET_T0 + 3600, state="COMPLETED") for job_id, host in (("12+0", "n1"), ("12+1", "n2"))]
    d = het_measured(tmp_path / "d", [*old, replace(old[1], job_id="13", user="bob")])
    jobs, total = het_billed(d)
    assert jobs == [("12", "both", "alice", 3600.0, 3600.0), ("13", "both", "bob", 3600.0, 3600.0)]
    assert (total["jobs"], total["billed_gpu_hours"], total["unmeasured_gpu_hours"]) == (2, 2.0, 0.0)
