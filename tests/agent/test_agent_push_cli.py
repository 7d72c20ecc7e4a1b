"""`gpuledger agent run --collector ...` as an admin runs it (a real process, a real collector): the base URL
works with or without a scheme, collectors fail over in order, each failure is one line saying what happens
to the data, a summary at exit, and a non-zero exit when nothing could be delivered."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store


def agent(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", "agent", "run", "--source", "simulated", "--gpus",
                           "2", "--host", "h7", "--metrics-port", "0", "--interval", "0.2", "--duration", "0.9",
                           *args], capture_output=True, text=True, timeout=timeout)


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def collector(tmp_path):
    store = Store(tmp_path / "c.sqlite")
    s = CollectorServer(store).start()
    yield s
    s.stop()
    store.close()


def test_base_url_without_scheme_and_fail_over(collector):
    dead = dead_address()
    base = collector.url.removeprefix("http://")  # host:port, as `collector serve` users type it
    r = agent("--collector", dead, "--collector", base)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    fails = [line for line in r.stderr.splitlines() if dead in line]
    assert fails and all(f"trying http://{base}/api/v1/samples" in line for line in fails)
    assert collector.store.totals()["samples"] >= 8  # at least 4 cycles x 2 GPUs
    (summary,) = [line for line in r.stdout.splitlines() if line.startswith("collector: delivered")]
    assert "dropped 0 batch(es)" in summary


def test_nothing_delivered_is_one_line_per_failure_a_summary_and_exit_1(tmp_path):
    dead = dead_address()
    r = agent("--collector", dead)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    fails = [line for line in r.stderr.splitlines() if "unreachable" in line]
    assert len(fails) >= 3 and all("dropped (no --spool-dir to keep it)" in line for line in fails)
    assert "collector: delivered 0 batch(es)" in r.stdout
    assert f"error: nothing could be delivered to {dead}" in r.stderr
    # with a spool the data is kept, and said so; still nothing delivered: exit 1
    r = agent("--collector", dead, "--spool-dir", str(tmp_path / "spool"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert any("kept in the spool" in line for line in r.stderr.splitlines())
    assert "left in the spool for the next start" in r.stdout


def test_a_4xx_is_not_unreachable(collector):
    # an endpoint that answers 404 on every path: the agent says what the collector answered
    r = agent("--collector", collector.url + "/no/such/prefix")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "HTTP 404" in line]
    assert lines and not any("unreachable" in line for line in lines)


def test_bad_collector_url_is_one_line_exit_2():
    r = agent("--collector", "ftp://x")
    words = " ".join(r.stderr.replace("\u2502", " ").split())  # however the usage error is framed and wrapped
    assert r.returncode == 2 and "Traceback" not in r.stderr and "scheme must be http or https" in words


def test_pushes_of_many_cycles_go_as_batches_of_whole_cycles_within_max_batch_samples(collector):
    # 5 cycles of 4 GPUs pushed at once, 8 samples a batch at most: 2 + 2 + 1 cycles
    r = agent("--collector", collector.url, "--gpus", "4", "--push-every", "5", "--max-batch-samples", "8",
              "--duration", "1.0")
    assert r.returncode == 0, r.stderr
    assert "collector: delivered 3 batch(es) (20 samples, 0 of them not stored" in r.stdout
    assert collector.store.batches_seen() == 3 and collector.store.totals()["samples"] == 20
    r = agent("--collector", collector.url, "--max-batch-samples", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--max-batch-samples" in r.stderr
    r = agent("--collector", collector.url, "--max-gpu-jobs", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--max-gpu-jobs" in r.stderr
