"""Scale-out end to end with real processes (issue 16): one ledger shared by two `gpuledger collector serve`
processes; 8 agents split across them, each given both collectors' URLs, its own first; collector A frozen and then
SIGKILLed mid-run while its agents hold spooled batches, which they resend to B, where they carry on.

Afterwards every job's usage, per job and per GPU, equals (==, every field) that of one collector on SQLite fed the
same batches in the same order; every batch the agents made is in the ledger exactly once (resending any of them
to the survivor is acknowledged as a duplicate, even those A stored); and fairshare, the priority feed, the usage
report and audit verify give the same answers on the shared ledger as on the single-collector one.

The agents are the agent's own pipeline (``Agent``, the simulated source on a stepped clock, the static job mapper,
``Batcher``, ``SpoolingPusher`` with its spool directory, ``HttpPusher`` with two collector URLs), ticked from this
process so that every sample is known; collectors and PostgreSQL are real processes. Jobs span hosts of both
collectors, start and end mid-run, and the energy counters run throughout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from collector_proc import CollectorProc, free_port, wait_until
from typer.testing import CliRunner

from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.push import Batcher, HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.agent.spool import Spool, SpoolingPusher
from gpuledger.cli import app
from gpuledger.collector.store import open_store
from gpuledger.schema.records import GpuSample, JobRecord

HOSTS = tuple(f"node{i:02d}" for i in range(8))
FIRST_A = HOSTS[:4]  # these agents list collector A first (the one that is killed), the others B
GPUS = 4
STEP_S = 10.0
TICKS = 90
PUSH_EVERY = 3  # ticks per batch, as `agent run --push-every 3`
# Before these ticks: A stops answering (SIGSTOP), is SIGKILLed, restarts (its agents come back to it, the first
# collector in their lists), and is SIGKILLed again while it is ingesting (they fail over to B once more, where
# what B kept in memory of their hosts is stale by then).
FREEZE_AT, KILL_AT, RESTART_AT, KILL_AGAIN_AT = 30, 39, 57, 72
CLUSTER = "scale"

CONFIG = """\
cluster = "scale"

[accounting]
algorithm = "classic"
policy = "blend"
floor = 0.25
half_life_s = 604800
calc_period_s = 3600       # decay ticks hourly: two runs in the same hour see the same decayed usage
priority_weight = 10000

[accounts.proj_a]
shares = 60
[accounts.proj_a.users]
alice = 1
bob = 1

[accounts.proj_b]
shares = 40
[accounts.proj_b.users]
carol = 1
dave = 1
"""


@dataclass(frozen=True)
class PlannedJob:
    job_id: str
    user: str
    account: str
    profile: str
    gpus: dict[str, tuple[int, ...]]  # host -> GPU indexes
    start: int  # first tick that carries the job
    end: int  # first tick that no longer does


# Multi-node jobs across both collectors' hosts; 7001, 7002 and 7005 run through the freeze and the kills, 7006
# starts on a failed-over host, 7007 at the second kill; every profile, and free GPUs in between (unattributed
# energy).
PLAN = (
    PlannedJob("7001", "alice", "proj_a", "training",
               {"node00": (0, 1, 2, 3), "node01": (0, 1, 2), "node04": (0, 1, 2, 3), "node05": (0, 1, 2, 3)}, 0, TICKS),
    PlannedJob("7002", "bob", "proj_a", "inference", {"node02": (0, 1), "node06": (0, 1)}, 5, 70),
    PlannedJob("7003", "carol", "proj_b", "dataloader-stall", {"node03": (0, 1, 2, 3)}, 0, 60),
    PlannedJob("7004", "dave", "proj_b", "idle", {"node02": (2,), "node07": (0,)}, 10, 80),
    PlannedJob("7005", "carol", "proj_b", "training", {"node02": (3,), "node06": (2, 3), "node07": (2, 3)}, 30, 75),
    PlannedJob("7006", "bob", "proj_a", "inference", {"node01": (3,), "node07": (1,)}, 50, TICKS),
    PlannedJob("7007", "dave", "proj_b", "training", {"node03": (0, 1, 2), "node06": (0, 1)}, KILL_AGAIN_AT, TICKS),
)


class Recorder:
    """Between the Batcher and the SpoolingPusher: keeps each batch the agent made, (seq, samples)."""

    def __init__(self, sink: SpoolingPusher) -> None:
        self.sink = sink
        self.batches: list[tuple[int, tuple[GpuSample, ...]]] = []

    def write(self, samples: Sequence[GpuSample]) -> None:
        seq = self.sink.write(samples)
        self.batches.append((seq, tuple(samples)))

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        self.sink.write_jobs(records)

    def close(self) -> None:
        self.sink.close()


@dataclass
class Node:
    host: str
    source: SimulatedSource
    mapper: StaticMapper
    spooler: SpoolingPusher
    recorder: Recorder
    agent: Agent


def make_node(host: str, urls: list[str], spool_dir: Path, clock: Callable[[], float]) -> Node:
    source = SimulatedSource(host=host, gpus=GPUS, seed=HOSTS.index(host), clock=clock)
    mapper = StaticMapper()
    # a long timeout: a frozen collector must hold the request until it is killed, not time it out
    pusher = HttpPusher(urls, agent_id=f"agent-{host}", host=host, timeout=60.0, fmt="msgpack", cluster=CLUSTER)
    spooler = SpoolingPusher(pusher, Spool(spool_dir), fmt="msgpack", backoff_base_s=0.05, backoff_max_s=0.5).start()
    recorder = Recorder(spooler)
    agent = Agent(source, [mapper], clock=clock, sinks=[Batcher(recorder, PUSH_EVERY)])
    return Node(host, source, mapper, spooler, recorder, agent)


def apply_plan(tick: int, nodes: dict[str, Node]) -> None:
    """Jobs that start or end at this tick: the GPUs' workload and the mapper's table change together."""
    for job in PLAN:
        for host, indexes in job.gpus.items():
            for g in indexes:
                if tick == job.start:
                    nodes[host].source.set_profile(g, job.profile)
                    nodes[host].mapper.set(g, job.job_id)
                elif tick == job.end:
                    nodes[host].source.set_profile(g, None)
                    nodes[host].mapper.clear(g)


def job_records(t0: float) -> list[dict[str, Any]]:
    """The scheduler's records of the plan (a job's samples at ticks start..end-1 cover its allocation)."""
    out = []
    for j in PLAN:
        start, end = t0 + (j.start - 1) * STEP_S, t0 + (j.end - 1) * STEP_S
        n = sum(map(len, j.gpus.values()))
        out.append(JobRecord(job_id=j.job_id, cluster=CLUSTER, user=j.user, account=j.account, partition="gpu",
                             hosts=tuple(j.gpus), gpus=n, gpu_model="NVIDIA H200", submit=start - 60.0, start=start,
                             end=end, state="COMPLETED", tres=(("gres/gpu", float(n)),)).to_dict())
    return out


@dataclass
class Ledger:
    """Where a run's ledger is, as the commands are told: ``args`` for every gpuledger command."""

    args: list[str]
    url: str | None
    data_dir: Path

    def store(self) -> Any:
        return open_store(self.url, self.data_dir)


@dataclass
class ScaleRun:
    t0: float
    shared: Ledger
    reference: Ledger
    survivor: str  # collector B's URL
    reference_url: str
    nodes: dict[str, Node]
    held_at_kill: dict[str, int]  # spool depth of A's agents when A was killed
    a_returncodes: list[int | None]  # of A's two lives
    usage: dict[str, Any] = field(default_factory=dict)  # "shared"/"reference" -> per job / per GPU answers


def _usage(url: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=30) as c:
        return {"jobs": c.get("/api/v1/usage").json(), "per_gpu": c.get("/api/v1/usage?per_gpu=1").json(),
                "totals": c.get("/api/v1/totals").json()}


def _post_jobs(url: str, t0: float) -> None:
    r = httpx.post(url + "/api/v1/jobs", json=job_records(t0), timeout=30)
    assert r.status_code == 200, r.text


def _ledgers(kind: str, tmp: Path, postgres: Any) -> tuple[list[str], list[str], Ledger]:
    """The two collectors' extra arguments and data dirs for a shared ledger of ``kind``."""
    if kind == "postgresql":
        url = postgres.new_database("scale")
        # each collector its own data dir; the commands read the survivor's (outputs, and the audit log while it
        # is kept there)
        ledger = Ledger(["--ledger-url", url, "--data-dir", str(tmp / "b")], url, tmp / "b")
        return ["--ledger-url", url], ["--ledger-url", url], ledger
    # one SQLite file under both collectors (the same data dir)
    ledger = Ledger(["--data-dir", str(tmp / "shared")], None, tmp / "shared")
    return [], [], ledger


LEDGER_KINDS = ["sqlite", "postgresql"]  # both: several collectors may share either


@pytest.fixture(scope="module", params=LEDGER_KINDS)
def scale_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"scale-{kind}")
    postgres = request.getfixturevalue("postgres_server") if kind == "postgresql" else None
    extra_a, extra_b, shared = _ledgers(kind, tmp, postgres)
    dirs = (tmp / "a", tmp / "b") if kind == "postgresql" else (shared.data_dir, shared.data_dir)
    a = CollectorProc(dirs[0], free_port(), *extra_a)
    b = CollectorProc(dirs[1], free_port(), *extra_b)
    ref = CollectorProc(tmp / "reference", free_port())
    procs = [a, b, ref]
    t_end = float(int(time.time())) - 120.0  # every sample in the past: collectors refuse the future
    t0 = t_end - (TICKS - 1) * STEP_S
    now = [t0]
    try:
        a.start()
        b.start()
        nodes = {h: make_node(h, [a.url, b.url] if h in FIRST_A else [b.url, a.url], tmp / "spool" / h,
                              lambda: now[0]) for h in HOSTS}
        held: dict[str, int] = {}
        returncodes: list[int | None] = []
        for k in range(TICKS):
            if k == FREEZE_AT:
                assert a.proc is not None
                a.proc.send_signal(signal.SIGSTOP)  # A hangs: its agents' requests wait, new batches spool
            elif k == KILL_AT:
                held = {h: nodes[h].spooler.spool.depth for h in FIRST_A}
                a.kill()  # SIGKILL: the waiting requests fail, A's agents send everything to B
                returncodes.append(a.proc.returncode if a.proc is not None else None)
            elif k == RESTART_AT:
                a = CollectorProc(a.data_dir, a.port, *extra_a)
                procs.append(a)
                a.start()
            elif k == KILL_AGAIN_AT:
                a.kill()
                returncodes.append(a.proc.returncode if a.proc is not None else None)
            now[0] = t0 + k * STEP_S
            apply_plan(k, nodes)
            for n in nodes.values():
                n.agent.tick()
        wait_until(lambda: all(n.spooler.spool.depth == 0 for n in nodes.values()), "the agents' spools to drain",
                   timeout=60)
        for n in nodes.values():
            n.agent.close()
        _post_jobs(b.url, t0)
        # The reference: one collector on SQLite, fed the same batches in the same order, nothing failing.
        ref.start()
        pushers = {h: HttpPusher(ref.url, agent_id=f"agent-{h}", host=h, fmt="msgpack", cluster=CLUSTER) for h in HOSTS}
        for i in range(TICKS // PUSH_EVERY):
            for h in HOSTS:
                seq, samples = nodes[h].recorder.batches[i]
                pushers[h].send(seq, samples)
        for p in pushers.values():
            p.close()
        _post_jobs(ref.url, t0)
        reference = Ledger(["--data-dir", str(ref.data_dir)], None, ref.data_dir)
        run = ScaleRun(t0, shared, reference, b.url, ref.url, nodes, held, returncodes)
        run.usage = {"shared": _usage(b.url), "reference": _usage(ref.url)}
        yield run
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # a stopped collector cannot act on SIGTERM
            p.stop()


def test_agents_of_the_killed_collector_failed_over_with_batches_in_their_spools(scale_run):
    assert scale_run.a_returncodes == [-signal.SIGKILL, -signal.SIGKILL]
    # A hung for 9 ticks (3 batches of each of its agents) before it died: none of them could be acknowledged
    assert all(d >= (KILL_AT - FREEZE_AT) // PUSH_EVERY for d in scale_run.held_at_kill.values()), \
        scale_run.held_at_kill
    for n in scale_run.nodes.values():
        assert not any(n.agent.errors_total.values()), (n.host, n.agent.errors_total)
        assert n.agent.ticks_total == TICKS
        assert sum(len(s) for _, s in n.recorder.batches) == TICKS * GPUS  # nothing lost inside the agent
        assert n.spooler.spool.depth == 0 and n.spooler.rejected_batches == 0
        assert n.spooler.spool.dropped_batches == 0


def differences(rows: list[dict[str, Any]], expected: list[dict[str, Any]]) -> list[tuple]:
    """(job, host, GPU, field, value, expected value) wherever two usage answers differ, records missing included."""
    key = lambda u: (u["cluster"], u["job_id"], u["host"], u["gpu_uuid"])  # noqa: E731
    got, want = {key(u): u for u in rows}, {key(u): u for u in expected}
    out: list[tuple] = [(*k, "record", got.get(k), want.get(k)) for k in sorted(got.keys() ^ want.keys())]
    for k in sorted(got.keys() & want.keys()):
        out += [(*k, f, got[k].get(f), v) for f, v in want[k].items() if got[k].get(f) != v]
    return out


def test_every_jobs_usage_equals_a_single_collector_run_exactly(scale_run):
    shared, reference = scale_run.usage["shared"], scale_run.usage["reference"]
    assert {u["job_id"] for u in reference["jobs"]} == {j.job_id for j in PLAN}
    for what in ("jobs", "per_gpu"):  # per job, and per job and GPU: every field, to the last bit
        diff = differences(shared[what], reference[what])
        assert not diff, "\n".join(map(repr, diff))
    hosts = {j.job_id: set(j.gpus) for j in PLAN}
    for u in reference["jobs"]:  # the plan is what was measured: multi-node jobs on both collectors' hosts
        assert u["gpus"] == sum(map(len, next(j for j in PLAN if j.job_id == u["job_id"]).gpus.values()))
        assert u["host"] == (next(iter(hosts[u["job_id"]])) if len(hosts[u["job_id"]]) == 1 else "*")
        assert u["energy_joules"] > 0 and u["allocated_gpu_seconds"] > 0
    assert shared["totals"]["samples"] == reference["totals"]["samples"] == len(HOSTS) * GPUS * TICKS
    for k, v in reference["totals"].items():  # sums over hourly buckets: the engine adds them in its own order
        assert shared["totals"][k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), k


def test_every_batch_is_stored_exactly_once(scale_run):
    made = sum(len(n.recorder.batches) for n in scale_run.nodes.values())
    assert made == len(HOSTS) * TICKS // PUSH_EVERY
    store = scale_run.shared.store()
    try:
        assert store.batches_seen() == made
    finally:
        store.close()
    # Every batch again, to the survivor: each one is known, those A stored before it died included.
    with httpx.Client(base_url=scale_run.survivor, timeout=30) as c:
        for n in scale_run.nodes.values():
            pusher = HttpPusher(scale_run.survivor, agent_id=f"agent-{n.host}", host=n.host, fmt="msgpack",
                                cluster=CLUSTER, client=c)
            for seq, samples in n.recorder.batches:
                body = pusher.encode(seq, samples, "msgpack", "zstd")
                r = c.post("/api/v1/samples", content=body,
                           headers={"Content-Type": "application/msgpack", "Content-Encoding": "zstd"})
                assert r.status_code == 200 and r.json()["duplicate"] is True, (n.host, seq, r.text)
    assert _usage(scale_run.survivor) == scale_run.usage["shared"]


def _cli(args: list[str]) -> str:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (args, r.output)
    return r.stdout


def _accounting(ledger: Ledger, config: Path, out: Path) -> dict[str, Any]:
    """What the accounting commands say of one ledger (JSON where they print it)."""
    common = [*ledger.args, "--config", str(config)]
    feed = json.loads(_cli(["priority", "feed", *common, "--output", str(out / "feed.json"), "--format", "json"]))
    for made in ("generated_at", "audit_entry", "audit_leaf"):  # when, and which entry of each ledger's own log
        feed.pop(made)
    verify = _cli(["audit", "verify", *ledger.args])
    entries = re.search(r"(\d+) entries, Merkle tree intact", verify)
    assert entries is not None, verify
    return {
        "fairshare": json.loads(_cli(["fairshare", *common, "--format", "json"])),
        "feed": feed,
        "usage_by_account": json.loads(_cli(["report", "usage", *common, "--by", "account", "--format", "json"])),
        "usage_by_user": json.loads(_cli(["report", "usage", *common, "--by", "user", "--format", "json"])),
        "audit_entries": int(entries[1]),
    }


def test_accounting_commands_agree_with_the_single_collector_ledger(scale_run, tmp_path):
    config = tmp_path / "gpuledger.toml"
    config.write_text(CONFIG)
    for _attempt in range(2):  # the decayed usage is the same within one decay period (an hour): retry once
        period = time.time() // 3600
        (tmp_path / "shared").mkdir(exist_ok=True)
        (tmp_path / "reference").mkdir(exist_ok=True)
        shared = _accounting(scale_run.shared, config, tmp_path / "shared")
        reference = _accounting(scale_run.reference, config, tmp_path / "reference")
        if time.time() // 3600 == period:
            break
    assert shared == reference
    users = {(r["account"], r["user"]): r for r in reference["fairshare"] if r["user"]}
    assert set(users) == {("proj_a", "alice"), ("proj_a", "bob"), ("proj_b", "carol"), ("proj_b", "dave")}
    assert all(r["raw_usage"] > 0 for r in users.values())  # every user ran jobs: measured usage was charged
    assert {(e["account"], e["user"]) for e in reference["feed"]["associations"]} >= set(users)
    assert sum(r["jobs"] for r in reference["usage_by_account"]["rows"]) == len(PLAN)
    assert reference["audit_entries"] > 0
