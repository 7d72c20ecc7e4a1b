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
    result = runner.invoke(app, ["sources"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 3}
    assert "yes" in rows["simulated"]
    assert "--url" in rows["dcgm-exporter"]
    assert "no" in rows["dcgm"] and "bindings" in result.stdout
    if not _driver_present():
        assert "no" in rows["nvml"] and "nvmlInit failed" in rows["nvml"]




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
    assert "serving /metrics on 127.0.0.1:" in result.output and "stopped after" in result.output
    assert len(received) >= 2
    batch = msgpack.unpackb(received[0])  # the agent's default wire: msgpack, complete columns as raw bytes
    assert batch["host"] == "h7" and batch["agent_id"] == "h7" and len(from_series(batch["series"], "h7")) == 2
