"""Real processes: SIGKILL the collector mid-ingest; stop it while a real agent spools, restart, compare."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from collector_proc import ROOT, CollectorProc, free_port, wait_until

from gpuledger.schema.records import GpuSample

GPUS = 3
BATCHES = 100


def make_batch(k: int, seq: int, t0: float) -> dict:
    # One sample per GPU a second apart: the whole run spans less than the store's late-arrival window,
    # so a batch re-sent after later ones still counts.
    samples = [GpuSample(ts=t0 + seq, host=f"n{k}", gpu_uuid=f"GPU-{k}-{g}", gpu_index=g, sm_active_ratio=0.5,
                         energy_joules=100.0 * seq, job_ids=(f"j{k}",)).to_dict() for g in range(GPUS)]
    return {"agent_id": f"a{k}", "seq": seq, "host": f"n{k}", "samples": samples}


def usage(url: str) -> dict[str, dict]:
    return {u["job_id"]: u for u in httpx.get(url + "/api/v1/usage", timeout=10).json()}


def test_sigkill_mid_ingest_loses_no_acknowledged_batch_and_stores_none_twice(tmp_path):
    port = free_port()
    c = CollectorProc(tmp_path, port).start()
    t0 = time.time() - 3600
    agents = (0, 1, 2)
    acked: dict[int, set[int]] = {k: set() for k in agents}
    stop = threading.Event()

    def push(k: int) -> None:
        with httpx.Client(base_url=c.url, timeout=5) as client:
            for seq in range(BATCHES):
                if stop.is_set():
                    return
                try:
                    r = client.post("/api/v1/samples", json=make_batch(k, seq, t0))
                except httpx.HTTPError:
                    return  # the collector died under us: this batch and the rest are unacknowledged
                if r.status_code == 200:
                    acked[k].add(seq)

    threads = [threading.Thread(target=push, args=(k,)) for k in agents]
    for t in threads:
        t.start()
    while sum(map(len, acked.values())) < 40:
        time.sleep(0.005)
    c.kill()  # SIGKILL while three clients have requests in flight
    stop.set()
    for t in threads:
        t.join()
    assert all(len(acked[k]) < BATCHES for k in agents), "the kill came too late to be mid-ingest"

    c = CollectorProc(tmp_path, port).start()
    try:
        before = usage(c.url)
        for k in agents:  # every acknowledged batch survived (a few unacknowledged ones may have committed too)
            assert before[f"j{k}"]["samples"] >= GPUS * len(acked[k])
        # The agents resend everything unacknowledged, and (to show dedupe) every acknowledged batch too.
        dup = 0
        with httpx.Client(base_url=c.url, timeout=10) as client:
            for k in agents:
                for seq in range(BATCHES):
                    r = client.post("/api/v1/samples", json=make_batch(k, seq, t0))
                    assert r.status_code == 200, r.text
                    if seq in acked[k]:
                        assert r.json()["duplicate"] is True
                    dup += r.json()["duplicate"]
                    assert r.json()["too_late"] == 0
        after = usage(c.url)
        for k in agents:
            u = after[f"j{k}"]
            assert u["samples"] == GPUS * BATCHES  # each sample exactly once
            assert u["allocated_gpu_seconds"] == pytest.approx(GPUS * (BATCHES - 1) * 1.0)
            assert u["energy_joules"] == pytest.approx(GPUS * 100.0 * (BATCHES - 1))
        assert dup == sum(before[f"j{k}"]["samples"] for k in agents) // GPUS
        metrics = httpx.get(c.url + "/metrics").text
        assert f"gpuledger_collector_batches_deduplicated_total {float(dup)}" in metrics
    finally:
        c.stop()


def _agent(spool: Path, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "gpuledger.cli", "agent", "run", "--source", "simulated", "--host", "sim1",
         "--gpus", "2", "--interval", "0.1", "--collector", url + "/api/v1/samples", "--metrics-port", "0",
         "--spool-dir", str(spool)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )


def _spooled(spool: Path) -> list[str]:
    return sorted(p.name for p in spool.iterdir() if not p.name.startswith("."))


def test_spool_delivers_everything_in_order_across_collector_and_agent_restarts(tmp_path):
    data, spool, kept = tmp_path / "data", tmp_path / "spool", tmp_path / "kept"
    port = free_port()
    # window 0: a sample older than its GPU's newest counts as too late, so too_late == 0 proves the order.
    c = CollectorProc(data, port, "--window", "0").start()
    a = _agent(spool, c.url)
    agents = [a]
    try:
        wait_until(lambda: httpx.get(c.url + "/api/v1/totals").json()["samples"] >= 10, "first samples")
        c.kill()  # the collector is gone for a while: the agent spools
        wait_until(lambda: len(_spooled(spool)) >= 8, "spooled batches")
        a.send_signal(signal.SIGKILL)  # and the agent dies too, holding a spool
        a.wait(timeout=10)
        b = _agent(spool, c.url)  # a restarted agent resumes the spool
        agents.append(b)
        wait_until(lambda: len(_spooled(spool)) >= 16, "more spooled batches")
        shutil.copytree(spool, kept)  # what must arrive
        c = CollectorProc(data, port, "--window", "0").start()
        wait_until(lambda: not any(n in _spooled(spool) for n in _spooled(kept)), "spool drained")
        b.send_signal(signal.SIGTERM)
        out, _ = b.communicate(timeout=20)
        assert b.returncode == 0, out
        # Every batch that was spooled is in the collector: sending it again is acknowledged as a duplicate.
        for name in _spooled(kept):
            enc = {"zst": "zstd", "gz": "gzip"}.get(name.rsplit(".", 1)[-1], "")
            ctype = "application/msgpack" if ".msgpack" in name else "application/json"
            r = httpx.post(c.url + "/api/v1/samples", content=(kept / name).read_bytes(),
                           headers={"Content-Type": ctype, "Content-Encoding": enc})
            assert r.status_code == 200 and r.json()["duplicate"] is True, (name, r.text)
        metrics = httpx.get(c.url + "/metrics").text
        assert "gpuledger_collector_samples_rejected_total{reason=\"too_late\"}" not in metrics
        # B's own batches all arrived too: its final count of cycles is covered by the samples stored.
        cycles = int(out.split("stopped after ")[1].split(" ")[0])
        assert httpx.get(c.url + "/api/v1/totals").json()["samples"] >= 2 * (cycles + 10)
    finally:
        for p in agents:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)
        c.stop()
    # After a clean stop nothing is left behind unsent.
    assert _spooled(spool) == []
