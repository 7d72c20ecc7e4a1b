"""`collector serve --workers N` (collector.supervisor, collector.worker), real processes over real HTTP: agents push to
two workers on one port and one ledger, on keep-alive connections or on a fresh connection per push (so hosts move
between workers all the time), and the ledger ends exactly as one process (`serve` without --workers) leaves it for
the same batches; /metrics counts what every worker did, whichever answers; a SIGKILLed worker is replaced and its
agents' retries lose nothing and count nothing twice; the supervisor stops everything it started, and nothing it
started outlives it."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from collector_proc import ROOT, CollectorProc, free_port, wait_until
from collector_proc import metric_value as metric
from prometheus_client.multiprocess import MultiProcessCollector
from servers import VictoriaMetricsServer
from test_compactor import alive, children
from typer.testing import CliRunner

from gpuledger.agent.push import encode_batch
from gpuledger.collector.cli import app
from gpuledger.collector.config import MAX_AUTO_WORKERS, load_settings
from gpuledger.collector.supervisor import METRICS_DIR
from gpuledger.schema.records import GpuSample

AGENTS = 40
BATCHES = 8  # per agent
GPUS, STEPS = 2, 10  # a batch: 2 GPUs x 10 seconds
T0 = float(int(time.time()) // 3600 * 3600 - 3 * 3600)  # in the past: collectors refuse the future
PUSHED = AGENTS * BATCHES


def body(agent: int, k: int) -> bytes:
    """Agent ``agent``'s batch ``k``, by the agent's own encoder; a job spans two hosts (two workers may each take
    one)."""
    host = f"node{agent:02d}"
    rng = random.Random(agent * 1000 + k)
    samples = [GpuSample(ts=T0 + k * STEPS + i, host=host, gpu_uuid=f"GPU-{agent}-{g}", gpu_index=g,
                         model="NVIDIA H200", sm_active_ratio=round(rng.random(), 3),
                         dram_bw_ratio=round(rng.random(), 3), power_watts=round(200 + 400 * rng.random(), 1),
                         energy_joules=1e6 + 300.0 * (k * STEPS + i) + rng.random(), mem_used_bytes=2**34 + i,
                         job_ids=(f"job{agent // 2}",))
               for g in range(GPUS) for i in range(STEPS)]
    return encode_batch(f"agent-{agent}", host, k, samples, fmt="msgpack")


BODIES = [[body(a, k) for k in range(BATCHES)] for a in range(AGENTS)]


class Agents:
    """AGENTS threads, each an agent pushing its BATCHES in order (the next once the last got its 200), over one
    keep-alive connection or (``reconnect``) a fresh one per push; with ``retry`` an agent sends a batch again
    after a connection error or a refusal, as the real agent does from its spool, else that is a failure."""

    def __init__(self, url: str, reconnect: bool = False, retry: bool = False, pause_s: float = 0.0) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "", u.port or 0
        self.reconnect, self.retry, self.pause_s = reconnect, retry, pause_s
        self.answers: list[list[dict]] = [[] for _ in range(AGENTS)]
        self.failures: list[str] = []
        self.errors = 0  # connection errors and refusals retried
        self._threads = [threading.Thread(target=self._agent, args=(a,)) for a in range(AGENTS)]

    def start(self) -> Agents:
        for t in self._threads:
            t.start()
        return self

    def join(self) -> Agents:
        for t in self._threads:
            t.join(timeout=120)
        return self

    @property
    def acknowledged(self) -> int:
        return sum(map(len, self.answers))

    def _agent(self, a: int) -> None:
        conn: http.client.HTTPConnection | None = None
        headers = {"Content-Type": "application/msgpack"} | ({"Connection": "close"} if self.reconnect else {})
        for k in range(BATCHES):
            while True:
                try:
                    conn = conn or http.client.HTTPConnection(self.host, self.port, timeout=30)
                    conn.request("POST", "/api/v1/samples", BODIES[a][k], headers)
                    r = conn.getresponse()
                    data = r.read()
                except (OSError, http.client.HTTPException) as e:
                    if conn is not None:
                        conn.close()
                    conn = None
                    if not self.retry:
                        self.failures.append(f"agent {a} batch {k}: {e!r}")
                        return
                    self.errors += 1
                    time.sleep(0.05)
                    continue
                if self.reconnect or r.getheader("Connection") == "close":
                    conn.close()
                    conn = None
                if r.status == 200:
                    self.answers[a].append(json.loads(data))
                    break
                if not self.retry:
                    self.failures.append(f"agent {a} batch {k}: HTTP {r.status} {data[:200]!r}")
                    return
                self.errors += 1
                time.sleep(0.05)
            time.sleep(self.pause_s)
        if conn is not None:
            conn.close()


def usage(url: str) -> dict[str, list[dict]]:
    """Usage per job and per job and GPU, as /api/v1/usage answers (JSON keeps every bit of a float)."""
    key = lambda u: (u["cluster"], u["job_id"], u["host"], u["gpu_uuid"])  # noqa: E731
    with httpx.Client(base_url=url, timeout=30) as c:
        return {what: sorted(c.get("/api/v1/usage", params=params).json(), key=key)
                for what, params in (("jobs", {}), ("per_gpu", {"per_gpu": "1"}))}


def scrape(url: str) -> str:
    """/metrics on a fresh connection (the kernel gives it to either worker)."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def workers_of(supervisor: int) -> list[int]:
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:  # a child that exited since children() listed it
            return b""
    return [p for p in children(supervisor) if b"gpuledger.collector.worker" in cmdline(p)]


def per_worker_batches(data_dir: Path, pids: list[int]) -> dict[int, float]:
    """Batches each worker counted, from its own counter file in the shared metrics directory."""
    out = {}
    for pid in pids:
        [family] = [m for m in MultiProcessCollector.merge([str(data_dir / METRICS_DIR / f"counter_{pid}.db")])
                    if m.name == "gpuledger_collector_batches_accepted"]
        out[pid] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (from /proc: its fds' socket inodes)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
            inodes.add(fields[9])
    sockets = {f"socket:[{i}]" for i in inodes}
    fds = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fds):
        try:
            if os.readlink(fds / fd) in sockets:
                return True
        except FileNotFoundError:  # a starting worker closes files between the listdir and the readlink
            continue
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """What one collector process (no --workers) stores for the same batches."""
    proc = CollectorProc(tmp_path_factory.mktemp("reference"), free_port()).start()
    try:
        agents = Agents(proc.url).start().join()
        assert not agents.failures, agents.failures[:3]
        return usage(proc.url)
    finally:
        proc.stop()


def serve_workers(tmp_path: Path, *extra: str, port: int | None = None) -> CollectorProc:
    return CollectorProc(tmp_path / "data", free_port() if port is None else port, "--workers", "2", *extra).start()


@pytest.mark.parametrize("connections, engine", [("keep-alive", "sqlite"), ("keep-alive", "postgresql"),
                                                 ("fresh per push", "sqlite")])
def test_two_workers_store_what_one_process_stores(connections, engine, reference, tmp_path, request):
    extra = ("--ledger-url", request.getfixturevalue("pg_url")) if engine == "postgresql" else ()
    proc = serve_workers(tmp_path, *extra)
    try:
        assert proc.output().startswith(f"collector listening on {proc.url}, ") and ", 2 workers" in proc.output()
        pids = workers_of(proc.proc.pid)
        assert len(pids) == 2
        agents = Agents(proc.url, reconnect=connections == "fresh per push").start().join()
        assert not agents.failures, agents.failures[:3]
        assert agents.acknowledged == PUSHED
        assert not any(a["duplicate"] or a["accepted"] != GPUS * STEPS for answers in agents.answers for a in answers)
        # both workers took batches (each counted its own, in its own file), and every batch was stored once
        taken = per_worker_batches(proc.data_dir, pids)
        assert sum(taken.values()) == PUSHED and all(taken.values()), taken
        for _ in range(8):  # whichever worker answers, /metrics is the whole collector's
            text = scrape(proc.url)
            assert metric(text, "gpuledger_collector_batches_accepted_total") == PUSHED
            assert metric(text, "gpuledger_collector_samples_accepted_total") == PUSHED * GPUS * STEPS
            assert metric(text, "gpuledger_collector_batches_deduplicated_total") == 0
            assert metric(text, "gpuledger_collector_ingest_latency_seconds_count") == PUSHED
            assert metric(text, "gpuledger_collector_requests_in_flight") == 1  # this scrape
            assert metric(text, "gpuledger_collector_ingest_queue_depth") == 0
            assert metric(text, "gpuledger_collector_store_size_bytes") > 0
        assert usage(proc.url) == reference  # every job, every GPU, every field, to the last bit
        assert httpx.get(proc.url + "/api/v1/totals").json()["samples"] == PUSHED * GPUS * STEPS
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.output()


def test_a_killed_worker_is_replaced_and_its_agents_retries_lose_nothing_and_count_nothing_twice(reference,
                                                                                               tmp_path):
    proc = serve_workers(tmp_path)
    try:
        victim, survivor = workers_of(proc.proc.pid)
        agents = Agents(proc.url, retry=True, pause_s=0.1).start()
        wait_until(lambda: agents.acknowledged >= PUSHED // 4, "a quarter of the batches", timeout=60)
        before = metric(scrape(proc.url), "gpuledger_collector_batches_accepted_total")
        os.kill(victim, signal.SIGKILL)  # while 40 agents push, some of them to it
        at_kill = agents.acknowledged
        agents.join()
        assert at_kill < PUSHED, "the kill came too late to be mid-ingest"
        assert agents.acknowledged == PUSHED, agents.failures
        assert agents.errors > 0  # the agents it held lost their connections, and retried
        [new] = wait_until(lambda: [p for p in workers_of(proc.proc.pid) if p not in (victim, survivor)],
                           "the supervisor to start another worker")
        wait_until(lambda: listening(new, int(proc.url.rsplit(":", 1)[1])), "the new worker to listen")
        assert alive(survivor)
        assert f"(pid {victim}) was killed by SIGKILL; starting another in 1 s" in proc.output()
        # nothing acknowledged lost, nothing stored twice: the ledger is one process's, to the last bit
        assert usage(proc.url) == reference
        for _ in range(6):
            text = scrape(proc.url)
            accepted = metric(text, "gpuledger_collector_batches_accepted_total")
            dup = metric(text, "gpuledger_collector_batches_deduplicated_total")
            # the dead worker's counts stay in the sums (a batch it committed but never answered is a duplicate
            # when retried); its live gauges left with it
            assert before <= accepted <= PUSHED and accepted + dup >= PUSHED
            assert metric(text, "gpuledger_collector_requests_in_flight") == 1
            assert metric(text, "gpuledger_collector_ingest_queue_depth") == 0
        # every batch sent again, now also to the new worker: each is a duplicate
        again = Agents(proc.url, reconnect=True).start().join()
        assert not again.failures and all(a["duplicate"] for answers in again.answers for a in answers)
        assert usage(proc.url) == reference
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.output()


def test_the_series_shippers_counters_are_the_whole_collectors(tmp_path):
    # each worker ships the shared queue; what /metrics says was shipped is what all of them shipped
    with VictoriaMetricsServer(tmp_path / "vm", flags=("-dedup.minScrapeInterval=1ms",)) as vm:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "gpuledger.toml").write_text(f'[collector]\nseries_url = "{vm.url}"\n')
        proc = serve_workers(tmp_path)
        try:
            agents = Agents(proc.url).start().join()
            assert not agents.failures, agents.failures[:3]
            samples = PUSHED * GPUS * STEPS

            def shipped() -> bool:
                text = scrape(proc.url)  # the workers copy their shippers' counts every few seconds
                return (metric(text, "gpuledger_collector_series_backlog_samples") == 0
                        and metric(text, "gpuledger_collector_series_shipped_samples_total") == samples)

            wait_until(shipped, "the queue shipped and counted", timeout=30)
            for _ in range(4):
                text = scrape(proc.url)
                assert metric(text, "gpuledger_collector_series_shipped_samples_total") == samples
                assert metric(text, "gpuledger_collector_series_ship_failures_total") == 0
        finally:
            proc.stop()
        assert proc.proc.returncode == 0, proc.output()


def test_the_supervisor_stops_what_it_started_and_nothing_it_started_outlives_it(tmp_path):
    proc = serve_workers(tmp_path, port=0)
    port = int(proc.url.rsplit(":", 1)[1])
    started = children(proc.proc.pid)
    workers = workers_of(proc.proc.pid)
    assert port != 0 and len(started) == 3 and len(workers) == 2  # two workers and the compactor
    assert all(listening(pid, port) for pid in workers)  # port 0: the others bound the first one's port
    assert not listening(proc.proc.pid, port)  # the supervisor serves nothing
    proc.stop()  # SIGTERM
    assert proc.proc.returncode == 0, proc.output()
    assert not any(map(alive, started))
    assert "Traceback" not in proc.output() and not (proc.data_dir / METRICS_DIR).exists()

    proc.start()
    started = children(proc.proc.pid)
    assert len(started) == 3
    proc.kill()  # SIGKILL: the supervisor cannot stop them; they see their standard input end
    for pid in started:
        wait_until(lambda pid=pid: not alive(pid), f"process {pid} to exit with its supervisor gone", timeout=15)


@pytest.mark.parametrize("how, value", [("flag", "0"), ("flag", "-2"), ("flag", "two"), ("flag", "1.5"),
                                        ("env", "0"), ("file", "0"), ("file", '"many"'), ("file", "true")])
def test_bad_workers_values_exit_2_with_one_line(how, value, tmp_path):
    args, env = ["serve", "--data-dir", str(tmp_path / "data"), "--port", "0"], {}
    if how == "flag":
        args += ["--workers", value]
    elif how == "env":
        env["GPULEDGER_COLLECTOR_WORKERS"] = value
    else:
        (tmp_path / "c.toml").write_text(f"[collector]\nworkers = {value}\n")
        args += ["--config", str(tmp_path / "c.toml")]
    r = CliRunner().invoke(app, args, env=env)
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: ") and "collector.workers" in r.output
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_workers_with_compaction_in_the_collectors_own_process_is_refused(tmp_path):
    (tmp_path / "c.toml").write_text('[collector]\ncompaction = "thread"\n')
    r = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), "--config", str(tmp_path / "c.toml"),
                                 "--workers", "2"])
    assert r.exit_code == 2 and 'compaction = "thread"' in r.output and r.output.count("\n") == 1, r.output


def test_auto_is_one_worker_per_usable_cpu(tmp_path):
    settings = load_settings(tmp_path, env={"GPULEDGER_COLLECTOR_WORKERS": "auto"})
    assert settings.workers == min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS)
    assert load_settings(tmp_path, overrides={"workers": "3"}).workers == 3


def test_a_worker_that_cannot_start_ends_the_collector_with_its_error(tmp_path):
    unreachable = f"postgresql://gpuledger@127.0.0.1:{free_port()}/gpuledger"  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "gpuledger.cli", "collector", "serve", "--data-dir", str(tmp_path),
                        "--port", "0", "--workers", "2", "--ledger-url", unreachable], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1, r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr  # no "listening", one line: the worker's error
    assert r.stderr.startswith("error: ") and "cannot connect" in r.stderr


def test_a_worker_reports_where_it_listens_and_stops_when_its_standard_input_ends(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / METRICS_DIR).mkdir()
    doc = {"settings": {"port": 0}, "data_dir": str(data), "ledger_url": None, "port": 0,
           "metrics_dir": str(data / METRICS_DIR)}
    w = subprocess.Popen([sys.executable, "-m", "gpuledger.collector.worker"], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write(json.dumps(doc) + "\n")
        w.stdin.flush()
        report = json.loads(w.stdout.readline())
        assert report["url"] == f"http://127.0.0.1:{report['port']}" and report["port"] > 0
        assert httpx.get(report["url"] + "/healthz").json() == {"status": "ok"}
        w.stdin.close()
        assert w.wait(timeout=20) == 0
    finally:
        if w.poll() is None:
            w.kill()
