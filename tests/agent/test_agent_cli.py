"""The ``agent`` typer sub-app: once, sources, run."""

from __future__ import annotations

import json

import msgpack
import pynvml
import pytest
from http_page import serve
from testdata import DATA_ROOT, capture  # noqa: F401
from typer.testing import CliRunner

from gpuledger.agent.cli import app
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample
from gpuledger.schema.wire import from_series

runner = CliRunner()
CAPTURES = DATA_ROOT / "dcgm-exporter"


def _driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_once_simulated_json() -> None:
    result = runner.invoke(app, ["once", "--source", "simulated", "--format", "json", "--gpus", "3", "--seed", "7",
                                 "--host", "h1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data) == 3
    for d in data:
        assert list(d) == list(SAMPLE_FIELDS)
        s = GpuSample.from_dict(d)
        assert s.host == "h1" and s.source == "simulated"
    assert [d["gpu_index"] for d in data] == [0, 1, 2]


def test_once_simulated_table() -> None:
    result = runner.invoke(app, ["once", "--source", "simulated", "--format", "table", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    assert "2 GPU sample(s)" in result.stdout and "sim-node" in result.stdout


def test_once_unknown_source_and_missing_url() -> None:
    bad = runner.invoke(app, ["once", "--source", "nope"])
    assert bad.exit_code != 0 and "unknown source" in bad.output
    no_url = runner.invoke(app, ["once", "--source", "dcgm-exporter"])
    assert no_url.exit_code != 0 and "--url" in no_url.output


def test_once_nvml_unavailable_exits_2() -> None:
    if _driver_present():
        pytest.skip("an NVIDIA driver is present; the -m gpu contract test covers nvml there")
    result = runner.invoke(app, ["once", "--source", "nvml"])
    assert result.exit_code == 2
    assert "nvmlInit failed" in result.output


def test_sources_reports_why() -> None:
    result = runner.invoke(app, ["sources", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["source"]: r for r in json.loads(result.stdout)}
    assert rows["simulated"]["works"] is True
    assert "--url" in rows["dcgm-exporter"]["why_not"]
    assert rows["dcgm"]["works"] is False and "bindings" in rows["dcgm"]["why_not"]
    if not _driver_present():
        assert rows["nvml"]["works"] is False and "nvmlInit failed" in rows["nvml"]["why_not"]
    table = runner.invoke(app, ["sources"])  # in a pipe: plain text, every reason whole on its row
    lines = {ln.split()[0]: ln for ln in table.stdout.splitlines()[2:] if ln.strip()}
    assert lines["simulated"].split()[1] == "yes" and rows["dcgm"]["why_not"] in lines["dcgm"]




def test_once_dcgm_exporter_url() -> None:
    server = serve((CAPTURES / "l4-1gpu-k8s-full.prom").read_bytes())
    try:
        result = runner.invoke(app, ["once", "--source", "dcgm-exporter", "--url",
                                     f"http://127.0.0.1:{server.server_port}/metrics", "--host", "n1"])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    (d,) = json.loads(result.stdout)
    assert d["host"] == "n1" and d["energy_joules"] == 4742.776 and d["model"] == "NVIDIA L4"


def test_run_pushes_to_collector_and_stops() -> None:
    received: list[bytes] = []
    collector = serve(b"", received)
    try:
        result = runner.invoke(app, [
            "run", "--source", "simulated", "--gpus", "2", "--host", "h7",
            "--collector", f"http://127.0.0.1:{collector.server_port}/api/v1/samples",
            "--metrics-port", "0", "--interval", "0.1", "--duration", "0.35",
        ])
    finally:
        collector.shutdown()
        collector.server_close()
    assert result.exit_code == 0, result.output
    assert "serving /metrics on 0.0.0.0:" in result.output  # the default: a central Prometheus can scrape it
    assert "stopped after 4 cycle(s)" in result.output  # 0.35 s at 0.1 s: cycles at 0, 0.1, 0.2, 0.3
    assert len(received) == 4
    batch = msgpack.unpackb(received[0])  # the agent's default wire: msgpack, complete columns as raw bytes
    assert batch["host"] == "h7" and batch["agent_id"] == "h7" and len(from_series(batch["series"], "h7")) == 2


def test_run_duration_counts_cycles_not_wall_time() -> None:
    # --duration 0.6 at --interval 0.1 is 6 cycles (0.0 .. 0.5), never a 7th at 0.6
    result = runner.invoke(app, ["run", "--source", "simulated", "--gpus", "1", "--metrics-port", "0",
                                 "--metrics-addr", "127.0.0.1", "--interval", "0.1", "--duration", "0.6"])
    assert result.exit_code == 0, result.output
    assert "serving /metrics on 127.0.0.1:" in result.output
    assert "stopped after 6 cycle(s)" in result.output


def test_once_simulated_load_mixed_has_busy_gpus_and_jobs() -> None:
    result = runner.invoke(app, ["once", "--source", "simulated", "--load", "mixed", "--gpus", "8", "--host", "n1"])
    assert result.exit_code == 0, result.output
    samples = [GpuSample.from_dict(d) for d in json.loads(result.stdout)]
    jobs = [s.job_ids for s in samples]
    # two 2-GPU training jobs, two inference jobs, an allocated-idle GPU, a stalling loader: six distinct jobs
    assert jobs[0] == jobs[1] and jobs[4] == jobs[5] and jobs[0] != jobs[4]
    assert len(set(jobs)) == 6 and all(len(j) == 1 for j in jobs)
    assert all(s.sm_active_ratio > 0.8 for s in samples[:2] + samples[4:6])  # training
    assert all(s.dram_bw_ratio > 0.6 for s in (samples[2], samples[6]))  # memory-bound inference
    assert samples[3].sm_active_ratio == 0.0 and samples[3].mem_used_bytes > 0  # allocated but idle
    again = runner.invoke(app, ["once", "--source", "simulated", "--load", "mixed", "--gpus", "8", "--host", "n1"])
    assert [s["job_ids"] for s in json.loads(again.stdout)] == [list(j) for j in jobs]  # stable per host


def test_load_refused_for_unknown_name_and_other_sources() -> None:
    bad = runner.invoke(app, ["once", "--source", "simulated", "--load", "busy"])
    assert bad.exit_code == 2 and "unknown load 'busy'" in bad.output
    other = runner.invoke(app, ["once", "--source", "dcgm-exporter", "--url", "http://127.0.0.1:1/metrics",
                                "--load", "training"])
    assert other.exit_code == 2 and "only the simulated source" in other.output


def test_default_load_leaves_gpus_free() -> None:
    result = runner.invoke(app, ["once", "--source", "simulated", "--gpus", "2"])
    assert all(d["sm_active_ratio"] == 0.0 and d["job_ids"] == [] for d in json.loads(result.stdout))
