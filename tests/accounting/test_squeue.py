"""squeue/sprio parsers on real captures, and the priority apply logic (plan, apply, idempotence)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.accounting.apply import Change, apply_changes, batches, feed_associations, plan_changes, run_apply
from gpuledger.accounting.priority import PriorityEntry, priority_feed
from gpuledger.accounting.slurm import (
    PendingJob,
    SlurmClient,
    SlurmCommandError,
    SlurmParseError,
    parse_sprio,
    parse_squeue_json,
    parse_squeue_pending,
)

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


# ------------------------------------------------------------------------------ squeue -r, arrays

def test_squeue_pending_folds_shared_array_tasks_into_one_record() -> None:
    jobs = parse_squeue_pending(read(REAL / "squeue-h-r-t-PD-o-array.txt"))
    assert [(j.job_id, j.sprio_id, j.tasks, j.user, j.account, j.state) for j in jobs] == [
        ("17_4", "18", 1, "carol", "proj_b", "PENDING"),  # split off into record 18 by an update
        ("17_[1-3,5-6]", "17", 5, "carol", "proj_b", "PENDING"),  # five tasks, one record
        ("16", "16", 1, "alice", "proj_a", "PENDING"),
        ("19", "19", 1, "bob", "proj_a", "PENDING"),  # held
    ]
    # sprio of the same moment lists records by their own id: every record but the held one
    assert parse_sprio(read(REAL / "sprio-h-o-array.txt")) == {"16": 0, "17": 0, "18": 5}


def test_squeue_pending_task_ranges_and_het_components() -> None:
    text = "".join(f"40|40_{t}|u|p|gpu|PENDING\n" for t in (9, 1, 2, 3, 5, 7, 8))
    text += "50|50+0|u|p|gpu|PENDING\n51|50+1|u|p|gpu|PENDING\n"
    jobs = parse_squeue_pending(text)
    assert [(j.job_id, j.sprio_id, j.tasks) for j in jobs] == [("40_[1-3,5,7-9]", "40", 7), ("50", "50", 1),
                                                              ("51", "51", 1)]


def test_squeue_pending_errors_name_the_line() -> None:
    with pytest.raises(SlurmParseError, match="squeue line 2: expected"):
        parse_squeue_pending("16|16|alice|proj_a|gpu|PENDING\n16 alice\n")
    with pytest.raises(SlurmParseError, match="record 17 has several lines but '18' is not an array task"):
        parse_squeue_pending("17|17_1|c|p|gpu|PENDING\n17|18|c|p|gpu|PENDING\n")


# ------------------------------------------------------------------------------ apply, through a fake Slurm

class FakeSlurm:
    """Slurm's commands at the subprocess boundary: squeue from the real 22.05 capture (an array included),
    sprio and scontrol over an in-memory table of site factors per record (what slurmctld holds). Like 22.05's
    scontrol, an update of a list sets every job it can and exits 1 if any one failed (a job that ended)."""

    RECORD = {"17_4": "18", "17_[1-3,5-6]": "17", "16": "16", "19": "19"}

    def __init__(self, factors: dict[str, int], ended: set[str] = frozenset()) -> None:
        self.factors = dict(factors)  # record id -> site factor
        self.ended = set(ended)  # scontrol ids of jobs that ended since squeue
        self.updates: list[list[str]] = []

    def __call__(self, argv, *, capture_output, text, env, timeout):
        if argv[0] == "squeue":
            assert argv[1:] == ["-h", "-r", "-t", "PD", "-o", "%A|%i|%u|%a|%P|%T"]
            return subprocess.CompletedProcess(argv, 0, read(REAL / "squeue-h-r-t-PD-o-array.txt"), "")
        if argv[0] == "sprio":
            assert argv[1:] == ["-h", "-o", "%i|%u|%Y|%S"]
            out = "".join(f"{j}|u|1|{v}\n" for j, v in self.factors.items())
            return subprocess.CompletedProcess(argv, 0, out, "")
        if argv[:2] == ["scontrol", "update"]:
            self.updates.append(argv)
            value = int(argv[3].removeprefix("SiteFactor="))
            errs = []
            for job_id in _split_ids(argv[2].removeprefix("jobid=")):
                if job_id in self.ended:
                    errs.append(f"Job has already finished for job {job_id}\n")
                else:
                    self.factors[self.RECORD.get(job_id, job_id)] = value
            return subprocess.CompletedProcess(argv, 1 if errs else 0, "", "".join(errs))
        raise AssertionError(f"unexpected command {argv}")


def _split_ids(text: str) -> list[str]:
    """ "16,17_[1-3,5-6]" -> ["16", "17_[1-3,5-6]"] (commas inside brackets belong to the array expression)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


REAL_FEED = [PriorityEntry("proj_a", "alice", 0.2, 2000, 9.0, 0.6, 0.3),
             PriorityEntry("proj_b", "carol", 0.9, 9000, 1.0, 0.1, 0.4)]  # bob missing


def logged(recorded: list[list[dict]], intended: bool = False) -> dict[str, str]:
    """Job id -> status of the ``record`` calls' outcomes (or, with ``intended``, of their intents)."""
    return {c["job_id"]: c["status"] for batch in recorded for c in batch if (c["status"] == "intended") == intended}


def test_apply_batches_by_factor_records_each_batch_before_and_after_and_is_idempotent() -> None:
    slurm = FakeSlurm({"16": 0, "17": 0, "18": 5})
    client = SlurmClient(run=slurm)
    recorded: list[list[dict]] = []
    plan, applied = run_apply(client, REAL_FEED, record=recorded.append, now=5.0)
    assert [(o.change.job_id, o.change.tasks, o.status) for o in applied.outcomes] == [
        ("17_4", 1, "applied"), ("17_[1-3,5-6]", 5, "applied"), ("16", 1, "applied")]
    # one command per factor; the array's shared record addressed by its pending tasks
    assert sorted(slurm.updates) == [["scontrol", "update", "jobid=16", "SiteFactor=2000"],
                                     ["scontrol", "update", "jobid=17_4,17_[1-3,5-6]", "SiteFactor=9000"]]
    assert applied.calls == 2 and plan.jobs == 8
    assert slurm.factors == {"16": 2000, "17": 9000, "18": 9000}
    # per batch one call (one transaction in the audit trail) before its command, one after: both intents first
    assert len(recorded) == 4 and all(c["status"] == "intended" for batch in recorded[:2] for c in batch)
    assert [[(c["job_id"], c["user"], c["old_factor"], c["new_factor"], c["raw_usage"], c["time"]) for c in batch]
            for batch in recorded[:2]] == [
        [("17_4", "carol", 5, 9000, 1.0, 5.0), ("17_[1-3,5-6]", "carol", 0, 9000, 1.0, 5.0)],
        [("16", "alice", 0, 2000, 9.0, 5.0)]]
    assert logged(recorded) == {"17_4": "applied", "17_[1-3,5-6]": "applied", "16": "applied"}
    assert [(s.job_id, s.reason) for s in plan.skipped] == [
        ("19", "association bob@proj_a is not in the priority feed")]
    # same inputs again: nothing to change, nothing recorded, no scontrol
    plan2, applied2 = run_apply(client, REAL_FEED, record=recorded.append)
    assert plan2.changes == () and applied2.outcomes == () and applied2.calls == 0 and len(recorded) == 4
    assert plan2.unchanged == ("17_4", "17_[1-3,5-6]", "16") and len(slurm.updates) == 2


def test_dry_run_changes_nothing() -> None:
    slurm = FakeSlurm({"16": 0, "17": 0, "18": 5})
    recorded: list = []
    _, applied = run_apply(SlurmClient(run=slurm), REAL_FEED, dry_run=True, record=recorded.append)
    assert [o.status for o in applied.outcomes] == ["dry-run"] * 3
    assert slurm.updates == [] and recorded == [] and slurm.factors["16"] == 0


def test_a_job_that_ended_meanwhile_fails_alone() -> None:
    slurm = FakeSlurm({"16": 0, "17": 0, "18": 5})
    client = SlurmClient(run=slurm)
    plan = plan_changes(client.pending_jobs(), REAL_FEED, client.site_factors(), now=0.0)
    slurm.ended.add("17_4")  # ends between the plan and the update
    recorded: list[list[dict]] = []
    applied = apply_changes(client, plan.changes, dry_run=False, record=recorded.append)
    assert [(o.change.job_id, o.status) for o in applied.outcomes] == [
        ("17_4", "failed"), ("17_[1-3,5-6]", "applied"), ("16", "applied")]
    assert "already finished" in (applied.outcomes[0].error or "")
    assert logged(recorded) == {"17_4": "failed", "17_[1-3,5-6]": "applied", "16": "applied"}
    assert [c["error"] for batch in recorded for c in batch if c["status"] == "failed"] == [applied.outcomes[0].error]
    # the failed batch was split in halves until the ended job stood alone
    assert sorted(u[2] for u in slurm.updates) == ["jobid=16", "jobid=17_4", "jobid=17_4,17_[1-3,5-6]",
                                                   "jobid=17_[1-3,5-6]"]
    assert applied.calls == 4


class StallingSlurm(FakeSlurm):
    """slurmctld stalls: the scontrol update for ``value`` times out, though slurmctld carries it out later (or,
    with ``applies`` False, never); with ``sprio_stalls`` the read-back times out too."""

    def __init__(self, factors: dict[str, int], value: int, applies: bool, sprio_stalls: bool = False) -> None:
        super().__init__(factors)
        self.value, self.applies, self.sprio_stalls, self.planned = value, applies, sprio_stalls, False

    def __call__(self, argv, *, capture_output, text, env, timeout):
        if argv[0] == "sprio" and self.sprio_stalls and self.planned:
            raise subprocess.TimeoutExpired(argv, timeout)
        if argv[:2] == ["scontrol", "update"] and argv[3] == f"SiteFactor={self.value}":
            self.planned = True
            if self.applies:
                super().__call__(argv, capture_output=capture_output, text=text, env=env, timeout=timeout)
            raise subprocess.TimeoutExpired(argv, timeout)
        return super().__call__(argv, capture_output=capture_output, text=text, env=env, timeout=timeout)


def test_a_timed_out_scontrol_that_slurm_carried_out_is_applied_and_recorded() -> None:
    # slurmctld restarting: scontrol gives up after its timeout, slurmctld sets the factors all the same. A later
    # apply finds them set and records nothing: this one must record them.
    slurm = StallingSlurm({"16": 0, "17": 0, "18": 5}, value=9000, applies=True)
    recorded: list[list[dict]] = []
    _, applied = run_apply(SlurmClient(run=slurm), REAL_FEED, record=recorded.append, now=5.0)
    assert [(o.change.job_id, o.status) for o in applied.outcomes] == [
        ("17_4", "applied"), ("17_[1-3,5-6]", "applied"), ("16", "applied")]
    assert logged(recorded) == {"16": "applied", "17_4": "applied", "17_[1-3,5-6]": "applied"}


def test_a_timed_out_scontrol_that_cannot_be_confirmed_is_recorded_as_unconfirmed() -> None:
    slurm = StallingSlurm({"16": 0, "17": 0, "18": 5}, value=9000, applies=False, sprio_stalls=True)
    recorded: list[list[dict]] = []
    _, applied = run_apply(SlurmClient(run=slurm), REAL_FEED, record=recorded.append, now=5.0)
    status = {o.change.job_id: o.status for o in applied.outcomes}
    assert status == {"17_4": "failed", "17_[1-3,5-6]": "failed", "16": "applied"}
    assert all("no answer within" in (o.error or "") for o in applied.outcomes if o.status == "failed")
    assert logged(recorded) == {"16": "applied", "17_4": "unconfirmed", "17_[1-3,5-6]": "unconfirmed"}
    assert {c["new_factor"] for batch in recorded for c in batch if c["status"] == "unconfirmed"} == {9000}
    # and when the read-back works but shows the old factor, the change failed: recorded so, with the error
    slurm = StallingSlurm({"16": 0, "17": 0, "18": 5}, value=9000, applies=False)
    recorded = []
    _, applied = run_apply(SlurmClient(run=slurm), REAL_FEED, record=recorded.append, now=5.0)
    assert logged(recorded) == {"16": "applied", "17_4": "failed", "17_[1-3,5-6]": "failed"}


def test_bisection_finds_each_failing_job_in_a_large_batch() -> None:
    class Setter:
        def __init__(self) -> None:
            self.calls, self.factors = 0, {}

        def set_site_factors(self, ids, value):
            self.calls += 1
            bad = [j for j in ids if int(j) % 250 == 7]
            self.factors.update((j, value) for j in ids if j not in bad)
            if bad:
                raise SlurmCommandError(["scontrol"], 1, f"Job has already finished for job {bad[0]}")

    changes = [Change(str(i), "a", "u", None, None, 0.5, 0, 5000, 0.0) for i in range(10_000)]
    s = Setter()
    applied = apply_changes(s, changes, dry_run=False)
    failed = {o.change.job_id for o in applied.outcomes if o.status == "failed"}
    assert failed == {str(i) for i in range(7, 10_000, 250)}  # 40 jobs, each alone
    assert all(s.factors[str(i)] == 5000 for i in range(10_000) if str(i) not in failed)
    assert applied.calls == s.calls < 40 * 2 * 14  # about two commands per failure per halving


def test_an_error_that_hits_every_job_is_not_bisected_to_the_end() -> None:
    class Denied:
        calls = 0

        def set_site_factors(self, ids, value):
            self.calls += 1
            raise SlurmCommandError(["scontrol"], 1, "Access/permission denied")

    changes = [Change(str(i), "a", "u", None, None, 0.5, 0, 5000, 0.0) for i in range(5_000)]
    applied = apply_changes(Denied(), changes, dry_run=False)
    assert applied.count("failed") == 5_000 and applied.calls < 400  # not ~2 per job
    assert "permission denied" in (applied.outcomes[-1].error or "")


def test_batches_respect_the_argument_length() -> None:
    ids = [str(100_000 + i) for i in range(30_000)]
    got = batches(ids, max_arg_bytes=100_000)
    assert [j for b in got for j in b] == ids
    assert all(len("jobid=" + ",".join(b)) <= 100_000 for b in got)
    assert len(got) == 3  # 7 bytes a job: ~14,285 jobs a command


def test_large_groups_are_spread_over_concurrent_commands() -> None:
    class Setter:
        def __init__(self) -> None:
            self.commands: list[tuple[int, int]] = []

        def set_site_factors(self, ids, value):
            self.commands.append((len(ids), value))

    changes = [Change(str(i), "a", "u", None, None, 0.5, 0, 5000 if i < 1000 else 7000, 0.0) for i in range(1100)]
    s = Setter()
    applied = apply_changes(s, changes, dry_run=False, parallel=4)
    assert applied.count("applied") == 1100 and applied.calls == 4
    assert sorted(s.commands) == [(100, 7000), (250, 5000), (250, 5000), (500, 5000)]
    s = Setter()
    apply_changes(s, changes, dry_run=False, parallel=1)  # one command per factor
    assert sorted(s.commands) == [(100, 7000), (1000, 5000)]


def test_set_site_factors_rejects_odd_job_ids() -> None:
    with pytest.raises(ValueError, match="not N, N_T or N_"):
        SlurmClient(run=FakeSlurm({})).set_site_factor("12 Priority=1", 5)
    with pytest.raises(ValueError, match="not N, N_T or N_"):
        SlurmClient(run=FakeSlurm({})).set_site_factors(["12", "13_[1-3]x"], 5)


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
