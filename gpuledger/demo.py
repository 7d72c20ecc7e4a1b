"""`gpuledger demo`: the main job end to end on the embedded default, in one command.

A collector on a free loopback port with the embedded SQLite store; simulated agents (4 nodes x 8 H200-class GPUs)
pushing over HTTP; a small scheduler that runs jobs of several users and accounts over one simulated hour (simulated
time, accelerated); then accounting: per-job usage, fairshare, the priority feed and a usage report.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.push import Batcher, HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.collector.auditlog.files import private_dir
from gpuledger.collector.config import CollectorSettings
from gpuledger.collector.ledger_url import ENV_NAME as LEDGER_URL_ENV
from gpuledger.collector.ledger_url import STORE_NAME
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.worker import store_options
from gpuledger.output import console as output_console
from gpuledger.output import is_terminal
from gpuledger.schema.records import JobRecord, JobUsage

CONFIG_NAME = "gpuledger.toml"

DEMO_CONFIG = """\
# gpuledger configuration written by `gpuledger demo`; edit freely, the demo never overwrites it.
cluster = "demo"

[accounting]
algorithm = "classic"      # classic | fair-tree
policy = "blend"           # allocated | active | energy | blend
floor = 0.25               # blend: the share of an allocated GPU-second charged even when idle
half_life_s = 604800       # PriorityDecayHalfLife: 7 days
calc_period_s = 300        # PriorityCalcPeriod: 5 minutes
priority_weight = 10000    # site factor = round(weight x fairshare)

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

# (user, account, GPUs, profile, submit minute, duration minutes): 14 jobs, 4 users, 2 accounts, every profile.
JOB_PLAN: tuple[tuple[str, str, int, str, int, int], ...] = (
    ("alice", "proj_a", 8, "training", 0, 60),
    ("alice", "proj_a", 4, "training", 5, 40),
    ("bob", "proj_a", 2, "inference", 0, 30),
    ("bob", "proj_a", 2, "inference", 30, 30),
    ("bob", "proj_a", 1, "idle", 10, 45),
    ("carol", "proj_b", 4, "dataloader-stall", 0, 55),
    ("carol", "proj_b", 2, "training", 20, 35),
    ("dave", "proj_b", 1, "idle", 0, 60),
    ("dave", "proj_b", 2, "inference", 15, 25),
    ("alice", "proj_a", 1, "dataloader-stall", 45, 15),
    ("carol", "proj_b", 1, "inference", 40, 20),
    ("dave", "proj_b", 4, "training", 35, 25),
    ("bob", "proj_a", 4, "dataloader-stall", 25, 30),
    ("carol", "proj_b", 8, "training", 12, 20),
)


@dataclass
class DemoJob:
    job_id: str
    user: str
    account: str
    gpus: int
    profile: str
    submit: float
    duration: float
    node: int | None = None
    gpu_indexes: tuple[int, ...] = ()
    start: float | None = None
    end: float | None = None
    truth_energy_j: float = 0.0  # ground truth from the simulator's own integrals
    truth_sm_active_s: float = 0.0

    @property
    def placed_node(self) -> int:
        """The node of a job that has started."""
        if self.node is None:
            raise RuntimeError(f"demo job {self.job_id} has not started")
        return self.node

    def record(self, cluster: str, host: str) -> JobRecord:
        return JobRecord(
            job_id=self.job_id, cluster=cluster, user=self.user, account=self.account, partition="gpu",
            hosts=(host,), gpus=self.gpus, gpu_model="NVIDIA H200", gpu_indexes=self.gpu_indexes,
            submit=self.submit, start=self.start,
            end=self.end, state="COMPLETED" if self.end is not None else "RUNNING",
            tres=(("gres/gpu", float(self.gpus)),),
        )


@dataclass
class DemoResult:
    data_dir: Path
    collector_url: str
    jobs: list[DemoJob]
    usage: dict[str, JobUsage]
    wall_seconds: float
    samples_pushed: int
    end: float  # the last simulated sample time: "now" for the accounting that follows
    extra: dict = field(default_factory=dict)


MARKER = ".gpuledger-demo"
DEMO_KEY_DIR = "demo-signing-key"  # a demo only: real keys live outside the data dir
# What a demo run writes besides the config and the signing keys, which a rerun keeps.
DEMO_OUTPUTS = (STORE_NAME, STORE_NAME + "-wal", STORE_NAME + "-shm", "audit.sqlite", "audit.sqlite-wal",
                "audit.sqlite-shm", "priority-feed.json", "usage-report.txt", "usage-report.txt.manifest.json",
                "usage-report.json")


class DemoDirError(RuntimeError):
    """The data directory holds files that a demo did not write: the demo never touches it."""


def check_demo_dir(data_dir: Path) -> None:
    """Refuse a --data-dir the demo may not use (a file, a directory it did not make, a place it cannot create),
    before anything in it is written or deleted."""
    if data_dir.exists() and not data_dir.is_dir():
        raise DemoDirError(f"--data-dir {data_dir} is not a directory")
    # Only the marker says a demo made the directory. Without it, anything there may be a site's: its ledger lives
    # elsewhere ([ledger] url) yet its audit log, feed and signed reports have the names a demo rerun replaces.
    try:
        if data_dir.is_dir() and not (data_dir / MARKER).exists() and any(data_dir.iterdir()):
            raise DemoDirError(f"{data_dir} holds files the demo did not write (no {MARKER}); "
                               f"give the demo an empty or new --data-dir")
        private_dir(data_dir)
    except OSError as e:
        raise DemoDirError(f"--data-dir {data_dir}: {e.strerror or e}") from None


def _fresh_demo_dir(data_dir: Path) -> None:
    """A rerun starts from an empty ledger (job ids repeat), but only in a directory a demo made."""
    check_demo_dir(data_dir)  # without the marker: a new or empty directory
    marker = data_dir / MARKER
    if marker.exists():
        for name in DEMO_OUTPUTS:
            (data_dir / name).unlink(missing_ok=True)
    else:  # first, so that a run that fails half way leaves a directory its rerun may clear
        marker.write_text("written by `gpuledger demo`: a rerun replaces this directory's ledger\n")


def _plan(seed: int, t0: float, span_s: float) -> list[DemoJob]:
    """Jittered, deterministic job plan scaled to the simulated span."""
    rng = random.Random(seed)
    scale = span_s / 3600.0
    jobs = []
    for i, (user, account, gpus, profile, sub_min, dur_min) in enumerate(JOB_PLAN):
        submit = t0 + scale * 60.0 * (sub_min + rng.uniform(0, 2))
        duration = scale * 60.0 * max(5.0, dur_min - rng.uniform(0, 5))
        jobs.append(DemoJob(str(1001 + i), user, account, gpus, profile, submit, duration))
    return jobs


def run_demo(
    data_dir: Path,
    *,
    nodes: int = 4,
    gpus_per_node: int = 8,
    hours: float = 1.0,
    step_s: float = 10.0,
    seed: int = 0,
    cluster: str = "demo",
    progress: Callable[[int, int], None] | None = None,
    extra_sinks: Sequence[Any] = (),
    end: float | None = None,
) -> DemoResult:
    """Run the simulated cluster through the real HTTP path and return jobs, ground truth and measured usage.

    ``extra_sinks`` also receive every agent's samples (e.g. an InfluxDB sink to fill dashboards in tests).
    ``end`` is where simulated time ends (default: the last full hour, UTC).
    """
    _fresh_demo_dir(data_dir)
    cfg = data_dir / CONFIG_NAME
    if not cfg.exists():
        cfg.write_text(DEMO_CONFIG)
    wall0 = time.perf_counter()
    span = hours * 3600.0
    # Simulated time ends at the last full hour, so the data lands where a real cluster's would (never "in the
    # future"). Everything is an offset from this anchor (job plan, stall phases, the fairshare's "now"), and the
    # anchor sits on the grid of Slurm's decay periods and the store's rollups, so a seed gives the same numbers
    # whatever the wall clock says.
    t_end = float(int(time.time()) // 3600 * 3600) if end is None else float(end)
    t0 = t_end - span - step_s * 2
    now = [t0]
    clock = lambda: now[0]  # noqa: E731 - the one shared simulated clock

    # the ledger's settings as `collector serve` records them from the demo's configuration (no [collector] table):
    # a collector started on the demo's data dir afterwards counts on with the same ones
    store = Store(data_dir / STORE_NAME, **store_options(CollectorSettings.model_validate({})))
    server = CollectorServer(store, host="127.0.0.1", port=0)
    server.start()
    url = server.url
    sources, mappers, agents = [], [], []
    try:
        for n in range(nodes):
            host = f"node{n + 1:02d}"
            src = SimulatedSource(host=host, gpus=gpus_per_node, seed=seed * 1000 + n, clock=clock)
            mapper = StaticMapper()
            # Sample every step, push every minute of simulated time (one durable commit per minute and node).
            pusher = Batcher(HttpPusher(f"{url}/api/v1/samples", agent_id=f"demo-{host}", host=host),
                             every=max(1, int(60 // step_s)))
            sources.append(src)
            mappers.append(mapper)
            agents.append(Agent(src, [mapper], clock=clock, sinks=[pusher, *extra_sinks]))
        for a in agents:
            a.open()
        jobs = _plan(seed, t0 + step_s, span * 0.95)
        pending = sorted(jobs, key=lambda j: j.submit)
        running: list[DemoJob] = []
        free = [set(range(gpus_per_node)) for _ in range(nodes)]
        steps = int(round((span + step_s) / step_s))
        pushed = 0
        for k in range(steps + 1):
            now[0] = t0 + k * step_s
            for a in agents:
                pushed += len(a.tick())
                if any(a.errors_total.values()):
                    raise RuntimeError(f"demo agent failed: {dict(a.errors_total)}")
            t = now[0]
            # Jobs end, then pending jobs start where they fit (first fit on one node, in submit order).
            for j in [j for j in running if j.start is not None and t >= j.start + j.duration]:
                _finish(j, t, sources[j.placed_node], mappers[j.placed_node])
                free[j.placed_node].update(j.gpu_indexes)
                running.remove(j)
            for j in [j for j in pending if j.submit <= t]:
                node = next((n for n in range(nodes) if len(free[n]) >= j.gpus), None)
                if node is None:
                    continue
                j.node, j.gpu_indexes, j.start = node, tuple(sorted(free[node])[: j.gpus]), t
                free[node].difference_update(j.gpu_indexes)
                for g in j.gpu_indexes:
                    e, s = sources[node].truth(g)
                    j.truth_energy_j -= e
                    j.truth_sm_active_s -= s
                    sources[node].set_profile(g, j.profile)
                    mappers[node].set(g, j.job_id)
                pending.remove(j)
                running.append(j)
            if progress:
                progress(k + 1, steps + 1)
        for a in agents:  # push what the batchers hold before asking for usage
            for sink in a.sinks:
                flush = getattr(sink, "flush", None)
                if flush is not None:
                    flush()
        for j in running:  # still running at the end of the window: close the books at the last sample
            _finish(j, now[0], sources[j.placed_node], mappers[j.placed_node], state_end=False)
        records = [j.record(cluster, f"node{j.placed_node + 1:02d}") for j in jobs if j.start is not None]
        with httpx.Client(timeout=30) as client:
            r = client.post(f"{url}/api/v1/jobs", json=[rec.to_dict() for rec in records])
            r.raise_for_status()
            r = client.get(f"{url}/api/v1/usage")
            r.raise_for_status()
            usage = {d["job_id"]: JobUsage.from_dict(d) for d in r.json()}
        return DemoResult(data_dir, url, jobs, usage, time.perf_counter() - wall0, pushed, now[0])
    finally:
        for a in agents:
            a.close()
        server.stop()
        store.close()


def _finish(j: DemoJob, t: float, src: SimulatedSource, mapper: StaticMapper, state_end: bool = True) -> None:
    for g in j.gpu_indexes:
        e, s = src.truth(g)
        j.truth_energy_j += e
        j.truth_sm_active_s += s
        if state_end:
            src.set_profile(g, None)
            mapper.clear(g)
    if state_end:
        j.end = t


def command_name(argv0: str | None = None, which: Callable[[str], str | None] = shutil.which) -> str:
    """How to type `gpuledger` again in this shell: the bare name when PATH finds this same program, else the path
    it was started by (`.venv/bin/gpuledger` after `make demo`), else `python -m gpuledger`."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if Path(argv0).name != "gpuledger":
        return f"{shlex.quote(sys.executable)} -m gpuledger"
    found = which("gpuledger")
    if "/" not in argv0 and found:  # started through PATH
        return "gpuledger"
    if found and Path(found).resolve() == Path(argv0).resolve():
        return "gpuledger"
    return shlex.quote(argv0)


def main(data_dir: Path, *, nodes: int, gpus: int, hours: float, step: float, seed: int) -> DemoResult:
    """The `gpuledger demo` command: run, then print the per-job table and fairshare and write feed + report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from gpuledger.accounting.audit import PRIVATE_KEY_NAME, bind, keygen, load_signing_key, open_log, sign_report
    from gpuledger.accounting.cli import FEED_NAME, build_feed
    from gpuledger.accounting.config import accounting_settings, load_config
    from gpuledger.accounting.fairshare_render import render_table
    from gpuledger.accounting.ledger import load as load_ledger
    from gpuledger.accounting.priority import write_feed
    from gpuledger.accounting.report.jobs import GROUP_COLUMNS, JOB_COLUMNS, by_account_user, job_rows
    from gpuledger.accounting.report.tables import plain_table, show, to_json

    check_demo_dir(data_dir)  # before the banner: a refused directory prints one line and nothing else
    console = output_console()
    console.print(
        f"[bold]gpuledger demo[/bold]: {nodes} nodes x {gpus} simulated H200 GPUs, {len(JOB_PLAN)} jobs, "
        f"{hours:g} simulated hour(s) at {step:g} s steps -> {data_dir}"
    )
    if is_terminal():  # a progress bar is for people: a pipe or a file gets the result lines only
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("agents -> collector", total=None)
            res = run_demo(data_dir, nodes=nodes, gpus_per_node=gpus, hours=hours, step_s=step, seed=seed,
                           progress=lambda done, total: bar.update(task, completed=done, total=total))
    else:
        res = run_demo(data_dir, nodes=nodes, gpus_per_node=gpus, hours=hours, step_s=step, seed=seed)
    console.print(f"collector at {res.collector_url} ingested {res.samples_pushed} samples "
                  f"in {res.wall_seconds:.1f} s wall time")

    store = Store(data_dir / STORE_NAME)
    try:
        entries = load_ledger(store)
        jobs, usages, stored = store.jobs(), store.job_usage(), [r for r, _ in store.job_records()]
    finally:
        store.close()
    # simulated time, not the wall clock: a running job's allocation and the fairshare's decay are the same for every
    # run of a seed
    now = res.end
    jobs_table = job_rows(entries, now=now)
    show("Jobs (measured)", JOB_COLUMNS, jobs_table)  # rich on a terminal, plain text in a pipe

    settings = accounting_settings(load_config(data_dir / CONFIG_NAME))
    # audited with its inputs; the feed names the fairshare entry it came from, as `priority feed` writes it
    rows, feed = build_feed(data_dir, None, now=now)
    console.print(f"[bold]Fairshare[/bold] ({settings.algorithm}, charge policy {settings.policy}):")
    console.print(render_table(rows), markup=False, highlight=False)
    feed_path = write_feed(data_dir / FEED_NAME, feed)
    groups = by_account_user(jobs_table)
    report_path = data_dir / "usage-report.txt"
    report_path.write_text(
        "Usage by account and user\n\n" + plain_table(GROUP_COLUMNS, groups)
        + "\nJobs\n\n" + plain_table(JOB_COLUMNS, jobs_table)
    )
    (data_dir / "usage-report.json").write_text(to_json(groups) + "\n")
    # The report carries a signed manifest binding the records it used and the audit log's head. A demo keeps its
    # key in the data dir for convenience; in production `gpuledger audit keygen` puts it outside, out of reach of
    # whoever can rewrite the log.
    key_path = data_dir / DEMO_KEY_DIR / PRIVATE_KEY_NAME
    if not key_path.exists():
        keygen(key_path)
    with open_log(data_dir) as log:
        bound = bind(log, jobs, usages, now, stored_jobs=stored)
        manifest = sign_report(report_path, load_signing_key(key_path), log, now=now, used=bound.used(),
                               inputs={"config": CONFIG_NAME, "jobs": len(jobs_table)},
                               period={"from": min(j.submit for j in res.jobs), "to": now})
    show("Usage by account and user", GROUP_COLUMNS, groups)
    console.print(f"priority feed: {feed_path}")
    console.print(f"usage report:  {report_path} (and {report_path.with_suffix('.json')}), signed: {manifest}")
    cmd, d = command_name(), shlex.quote(str(data_dir))
    # The demo always writes its own embedded ledger, never a site's. A GPULEDGER_LEDGER_URL in the environment
    # would send the next commands to that ledger instead: then they name the demo's.
    if os.environ.get(LEDGER_URL_ENV):
        d += " --ledger-url " + shlex.quote(str(data_dir / STORE_NAME))
    console.print(f"next: {cmd} fairshare --data-dir {d}   |   {cmd} report usage --data-dir {d}",
                  markup=False, highlight=False, soft_wrap=True)
    return res
