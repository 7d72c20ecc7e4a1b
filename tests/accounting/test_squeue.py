"""squeue/sprio parsers on real captures, and the priority apply logic (plan, apply, idempotence)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.apply import Change, apply_changes, feed_associations, plan_changes, run_apply
from gpuledger.accounting.priority import PriorityEntry, priority_feed
from gpuledger.accounting.slurm import PendingJob, SlurmClient, SlurmParseError, parse_sprio, parse_squeue_json

DATA = DATA_ROOT / "slurm"
REAL = DATA / "real-22.05"


def read(path: Path) -> str:
    return capture(path.relative_to(DATA_ROOT)).read_text()


# ------------------------------------------------------------------------------ parsers

def test_squeue_json_2205_pending_only_by_default() -> None:
    jobs = parse_squeue_json(read(REAL / "squeue-json.json"))
    assert [(j.job_id, j.user, j.account, j.partition, j.state, j.priority, j.reason) for j in jobs] == [
        ("12", "alice", "proj_a", "gpu", "PENDING", 1, "PartitionDown"),
        ("13", "carol", "proj_b", "gpu", "PENDING", 10714, "PartitionDown"),
        ("14", "dave", "proj_a_ml", "gpu", "PENDING", 4285, "PartitionDown"),
    ]
    assert all(j.site_factor is None for j in jobs)  # squeue does not print it
    # 22.05 ignores -t with --json: the finished jobs it still holds are there too
    every = parse_squeue_json(read(REAL / "squeue-json.json"), states=None)
    states = {j.job_id: j.state for j in every}
    assert len(every) == 14
    assert (states["3"], states["10"], states["8"]) == ("FAILED", "RUNNING", "CANCELLED")


def test_squeue_json_agrees_with_squeue_text() -> None:
    # squeue -h -t PD -o '%i|%u|%a|%P|%Q' of the same moment
    text = [ln.split("|") for ln in read(REAL / "squeue-h-t-PD-o.txt").split()]
    want = {(i, u, a, p, int(q)) for i, u, a, p, q in text}
    jobs = parse_squeue_json(read(REAL / "squeue-json.json"))
    got = {(j.job_id, j.user, j.account, j.partition, j.priority) for j in jobs}
    assert got == want


@pytest.mark.parametrize("name,job_id,user,prio", [
    ("slurmrestd-24.05.3-v0.0.41-slurm-job-gpus-running.json", "9", "dperez", 272),
    ("slurmrestd-24.11.5-v0.0.42-slurm-job-gpus-running.json", "6374", "vhartman", 818),
])
def test_squeue_json_2405_2411_wrapped_numbers(name: str, job_id: str, user: str, prio: int) -> None:
    assert parse_squeue_json(read(DATA / name)) == []
    (j,) = parse_squeue_json(read(DATA / name), states=None)
    assert (j.job_id, j.user, j.state, j.priority, j.reason) == (job_id, user, "RUNNING", prio, None)


def test_sprio_real_2205() -> None:
    assert parse_sprio(read(REAL / "sprio-h-o.txt")) == {"12": -1500, "13": 5000, "14": 0}


def test_bad_squeue_and_sprio_input() -> None:
    with pytest.raises(SlurmParseError, match=r"jobs\[0\] \(job 5\): no job_state"):
        parse_squeue_json('{"jobs": [{"job_id": 5}]}')
    with pytest.raises(SlurmParseError, match=r"sprio line 2: site factor 'x' is not an integer"):
        parse_sprio("1|alice|5|7\n2|bob|5|x\n")
    with pytest.raises(SlurmParseError, match="sprio line 1: expected fields"):
        parse_sprio("1 alice 5\n")


# ------------------------------------------------------------------------------ plan

def job(job_id: str, user: str, account: str, state: str = "PENDING") -> PendingJob:
    return PendingJob(job_id, user, account, "gpu", state)


class Row:
    """A fairshare row as accounting.fairshare returns them (the attributes priority_feed reads)."""

    def __init__(self, account: str, user: str | None, fairshare: float | None, raw_usage: float) -> None:
        self.account, self.user, self.fairshare, self.raw_usage = account, user, fairshare, raw_usage
        self.effective_usage, self.norm_shares = raw_usage / 100.0, 0.5


FEED = priority_feed([Row("proj_a", None, None, 60.0), Row("proj_a", "alice", 0.25, 50.0),
                      Row("proj_a", "bob", 0.75, 10.0), Row("proj_b", "carol", 1.0, 0.0)], weight=10_000)


def test_plan_sets_only_changed_factors_and_reports_the_rest() -> None:
    pending = [job("1", "alice", "proj_a"), job("2", "bob", "proj_a"), job("3", "carol", "proj_b"),
               job("4", "dave", "proj_c"), job("5", "alice", "proj_a"), job("6", "bob", "proj_a", "RUNNING"),
               job("7", "carol", "proj_b")]
    current = {"1": 0, "2": 7500, "3": -20, "4": 0, "5": 2500, "6": 0}  # 7: held, not in sprio
    plan = plan_changes(pending, FEED, current, now=1_800_000_000.0)
    assert [(c.job_id, c.old_factor, c.new_factor) for c in plan.changes] == [("1", 0, 2500), ("3", -20, 10000)]
    alice = plan.changes[0]
    assert (alice.account, alice.user, alice.fairshare, alice.raw_usage, alice.effective_usage, alice.time) == \
           ("proj_a", "alice", 0.25, 50.0, 0.5, 1_800_000_000.0)
    assert plan.unchanged == ("2", "5")
    assert [(s.job_id, s.reason) for s in plan.skipped] == [
        ("4", "association dave@proj_c is not in the priority feed"),
        ("7", "current site factor unknown (sprio does not list the job: held?)"),
    ]
    assert json.loads(json.dumps(alice.to_dict()))["new_factor"] == 2500


def test_plan_reads_the_feed_file_form() -> None:
    doc = json.loads(json.dumps({"associations": [
        {"account": "proj_a", "user": "alice", "fairshare": 0.5, "site_factor": 5000, "raw_usage": 3.0}]}))
    plan = plan_changes([job("1", "alice", "proj_a")], doc["associations"], {"1": 0}, now=0.0)
    assert [(c.new_factor, c.raw_usage, c.effective_usage) for c in plan.changes] == [(5000, 3.0, None)]


def test_feed_errors_name_the_entry() -> None:
    e = PriorityEntry("proj_a", "alice", 0.5, 5000, 1.0, 0.1, 0.5)
    with pytest.raises(ValueError, match="entry 1: association alice@proj_a appears twice"):
        feed_associations([e, e])
    with pytest.raises(ValueError, match="entry 0: .*site_factor"):
        feed_associations([{"account": "a", "user": "u", "fairshare": 0.5}])


# ------------------------------------------------------------------------------ apply, through a fake Slurm

class FakeSlurm:
    """Slurm's commands at the subprocess boundary: squeue --json from the real 22.05 capture, sprio and
    scontrol over an in-memory table of site factors (what slurmctld holds)."""

    def __init__(self, factors: dict[str, int], started: set[str] = frozenset()) -> None:
        self.factors = dict(factors)
        self.started = set(started)
        self.updates: list[list[str]] = []

    def __call__(self, argv, *, capture_output, text, env, timeout):
        if argv[:2] == ["squeue", "--json"]:
            return subprocess.CompletedProcess(argv, 0, read(REAL / "squeue-json.json"), "")
        if argv[0] == "sprio":
            assert argv[1:] == ["-h", "-o", "%i|%u|%Y|%S"]
            out = "".join(f"{j}|u|1|{v}\n" for j, v in self.factors.items() if j not in self.started)
            return subprocess.CompletedProcess(argv, 0, out, "")
        if argv[:2] == ["scontrol", "update"]:
            self.updates.append(argv)
            job_id = argv[2].removeprefix("jobid=")
            if job_id in self.started:
                return subprocess.CompletedProcess(argv, 1, "", "Job is no longer pending execution for job "
                                                   f"{job_id}\n")
            self.factors[job_id] = int(argv[3].removeprefix("SiteFactor="))
            return subprocess.CompletedProcess(argv, 0, "", "")
        raise AssertionError(f"unexpected command {argv}")


REAL_FEED = [PriorityEntry("proj_a", "alice", 0.2, 2000, 9.0, 0.6, 0.3),
             PriorityEntry("proj_b", "carol", 0.9, 9000, 1.0, 0.1, 0.4)]  # dave@proj_a_ml missing


def test_apply_sets_records_and_is_idempotent() -> None:
    slurm = FakeSlurm({"12": -1500, "13": 5000, "14": 0})
    client = SlurmClient(run=slurm)
    recorded: list[Change] = []
    plan, outcomes = run_apply(client, REAL_FEED, record=recorded.append, now=5.0)
    assert [(o.change.job_id, o.status) for o in outcomes] == [("12", "applied"), ("13", "applied")]
    assert slurm.updates == [["scontrol", "update", "jobid=12", "SiteFactor=2000"],
                             ["scontrol", "update", "jobid=13", "SiteFactor=9000"]]
    assert slurm.factors == {"12": 2000, "13": 9000, "14": 0}
    assert [(c.job_id, c.user, c.old_factor, c.new_factor, c.raw_usage, c.time) for c in recorded] == [
        ("12", "alice", -1500, 2000, 9.0, 5.0), ("13", "carol", 5000, 9000, 1.0, 5.0)]
    assert [s.job_id for s in plan.skipped] == ["14"]
    # same inputs again: nothing to change, nothing recorded
    plan2, outcomes2 = run_apply(client, REAL_FEED, record=recorded.append)
    assert plan2.changes == () and outcomes2 == [] and len(recorded) == 2
    assert plan2.unchanged == ("12", "13") and len(slurm.updates) == 2


def test_dry_run_changes_nothing() -> None:
    slurm = FakeSlurm({"12": -1500, "13": 5000, "14": 0})
    recorded: list[Change] = []
    _, outcomes = run_apply(SlurmClient(run=slurm), REAL_FEED, dry_run=True, record=recorded.append)
    assert [o.status for o in outcomes] == ["dry-run", "dry-run"]
    assert slurm.updates == [] and recorded == [] and slurm.factors["12"] == -1500


def test_a_job_that_started_meanwhile_fails_alone() -> None:
    slurm = FakeSlurm({"12": -1500, "13": 5000, "14": 0})
    client = SlurmClient(run=slurm)
    plan = plan_changes(client.pending_jobs(), REAL_FEED, client.site_factors(), now=0.0)
    slurm.started.add("12")  # job 12 starts between the plan and the update
    recorded: list[Change] = []
    outcomes = apply_changes(client, plan.changes, dry_run=False, record=recorded.append)
    assert [(o.change.job_id, o.status) for o in outcomes] == [("12", "failed"), ("13", "applied")]
    assert "no longer pending" in (outcomes[0].error or "")
    assert [c.job_id for c in recorded] == ["13"]


def test_set_site_factor_rejects_odd_job_ids() -> None:
    with pytest.raises(ValueError, match="not N or N_T"):
        SlurmClient(run=FakeSlurm({})).set_site_factor("12 Priority=1", 5)


# ------------------------------------------------------------------------------ one squeue parser

@pytest.mark.parametrize("path", [REAL / "squeue-json.json",
                                  DATA / "slurmrestd-24.05.3-v0.0.41-slurm-job-gpus-running.json",
                                  DATA / "slurmrestd-24.11.5-v0.0.42-slurm-job-gpus-running.json"])
def test_agent_and_accounting_read_squeue_alike(path: Path) -> None:
    """Accounting's pending jobs are the agent's parse of the same text, field for field."""
    from gpuledger.agent.slurm import parse_squeue_json as agent_parse

    text = read(path)
    metas = agent_parse(text)
    jobs = parse_squeue_json(text, states=None)
    assert len(jobs) == len(metas) > 0
    for job, meta in zip(jobs, metas):
        assert (job.job_id, job.user, job.account, job.partition, job.state, job.priority, job.reason, job.submit) \
            == (meta["job_id"], meta["user"], meta["account"], meta["partition"], meta["state"], meta["priority"],
                meta["reason"], meta["submit"])


def test_squeue_state_words_and_bad_records_are_read_one_way() -> None:
    """Where the two parsers differed: the agent kept a state's flags ("CANCELLED by 1000") and a record
    without a job id; both sides now give the state word and refuse the record, naming it."""
    from gpuledger.agent.slurm import parse_squeue_json as agent_parse

    doc = {"jobs": [{"job_id": 7, "job_state": ["CANCELLED by 1000"], "submit_time": True, "user_name": "erin"}]}
    (meta,) = agent_parse(json.dumps(doc))
    (job,) = parse_squeue_json(json.dumps(doc), states=("CANCELLED",))
    assert meta["state"] == job.state == "CANCELLED"
    assert meta["submit"] is job.submit is None  # a JSON true is not a time
    bad = json.dumps({"jobs": [{"job_state": "RUNNING"}]})
    for parse in (agent_parse, parse_squeue_json):
        with pytest.raises(SlurmParseError, match=r"squeue JSON jobs\[0\]: job_id None is not an integer"):
            parse(bad)
