"""``collector`` CLI: usage read straight from the store; serve runs until interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
from typer.testing import CliRunner

from gpuledger.collector.cli import app, store_path
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample


def _fill(data_dir):
    store = Store(store_path(data_dir))
    mk = lambda ts, j: GpuSample(ts=ts, host="n1", gpu_uuid="G0", gpu_index=0, sm_active_ratio=0.5,  # noqa: E731
                                 energy_joules=ts * 100, dram_bw_ratio=0.25, job_ids=(j,))
    store.ingest(Batch("a", 0, "n1", tuple(mk(1000.0 + 10 * i, "11" if i < 5 else "12") for i in range(10))))
    store.close()


def test_usage_json_and_table(tmp_path):
    _fill(tmp_path)
    r = CliRunner().invoke(app, ["usage", "--data-dir", str(tmp_path), "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = {u["job_id"]: u for u in json.loads(r.output)}
    assert rows["11"]["allocated_gpu_seconds"] == 40.0 and rows["12"]["allocated_gpu_seconds"] == 50.0
    assert rows["12"]["energy_joules"] == 5000.0
    r = CliRunner().invoke(app, ["usage", "--job", "12"], env={"GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "12" in r.output and "0.014" in r.output and "50%" in r.output and "11 " not in r.output


def test_usage_without_store_says_where_it_looked(tmp_path):
    r = CliRunner().invoke(app, ["usage", "--data-dir", str(tmp_path / "none")])
    assert r.exit_code == 2 and "no gpuledger store" in r.output


def test_serve_runs_until_sigterm(tmp_path):
    code = "from gpuledger.collector.cli import app; app()"
    p = subprocess.Popen([sys.executable, "-c", code, "serve", "--data-dir", str(tmp_path), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "listening on http://" in line, line + p.stderr.read()
        url = line.split("listening on ")[1].split(",")[0]
        assert httpx.get(url + "/healthz", timeout=5).json() == {"status": "ok"}
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
    assert p.returncode == 0
    assert os.path.exists(store_path(tmp_path))


def test_serve_stores_in_the_ledger_url_and_logs_in_the_data_dir(tmp_path):
    # a SQLite ledger elsewhere: the store is that file, posted job records are logged in the data dir's audit log
    ledger, data = tmp_path / "ledger.sqlite", tmp_path / "data"
    code = "from gpuledger.collector.cli import app; app()"
    p = subprocess.Popen([sys.executable, "-c", code, "serve", "--data-dir", str(data), "--port", "0",
                          "--ledger-url", str(ledger)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert f"ledger {ledger}," in line, line + p.stderr.read()
        url = line.split("listening on ")[1].split(",")[0]
        job = {"job_id": "7", "user": "alice", "account": "proj_a", "gpus": 1, "start": 1000.0, "end": 2000.0}
        r = httpx.post(url + "/api/v1/jobs", json=[job], timeout=5)
        assert r.status_code == 200 and r.json()["changed"] == 1, r.text
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
    assert p.returncode == 0
    assert not os.path.exists(store_path(data)) and os.path.exists(data / "audit.sqlite")
    store = Store(ledger)
    try:
        assert [j.job_id for j in store.jobs()] == ["7"]
    finally:
        store.close()
