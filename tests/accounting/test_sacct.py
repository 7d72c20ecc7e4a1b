"""sacct parsers on real captures (Slurm 22.05 to 24.11), their merge, and SlurmClient's sacct live mode."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.slurm import (
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


def test_an_array_cancelled_while_pending_is_one_record_in_both_forms() -> None:
    # sacct --json names the never-split record by its job id and a task bit mask, -P as "5_[1-5,7]": one job
    from datetime import UTC

    from gpuledger.accounting.slurm import merge_sacct, parse_sacct_json, parse_sacct_parsable

    as_json = parse_sacct_json((REAL / "sacct-json-array-cancelled-pending.json").read_text())
    parsable = parse_sacct_parsable((REAL / "sacct-P-array-cancelled-pending.txt").read_text(), tz=UTC)
    assert [r.job_id for r in as_json] == [r.job_id for r in parsable] == ["5_[1-5,7]"]
    (merged,) = merge_sacct(as_json, parsable)
    assert (merged.job_id, merged.state, merged.exit_code) == ("5_[1-5,7]", "CANCELLED", 0)
