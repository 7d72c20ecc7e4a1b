"""The collector through real HTTP on a free loopback port."""

from __future__ import annotations

import gzip
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample, JobRecord

NOW = 1_700_000_000.0


def batch(seq: int, samples: list[GpuSample], agent: str = "a1", host: str = "n1") -> dict:
    return {"agent_id": agent, "seq": seq, "host": host, "samples": [s.to_dict() for s in samples]}


def samples(start: float, n: int, job: str = "7") -> list[GpuSample]:
    return [GpuSample(ts=start + 10 * i, host="n1", gpu_uuid="GPU-a", gpu_index=0, sm_active_ratio=0.5,
                      energy_joules=1000.0 * i, mem_used_bytes=10**9, job_ids=(job,)) for i in range(n)]


@pytest.fixture
def srv(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW).start()
    with httpx.Client(base_url=s.url, timeout=10) as client:
        yield s, client
    s.stop()
    store.close()


def test_ingest_then_query_usage(srv):
    s, c = srv
    r = c.post("/api/v1/samples", json=batch(0, samples(NOW - 100, 5)))
    assert r.status_code == 200 and r.json() == {"accepted": 5, "duplicate": False, "duplicate_samples": 0,
                                                 "too_late": 0}
    (u,) = c.get("/api/v1/usage").json()
    assert u["job_id"] == "7" and u["allocated_gpu_seconds"] == pytest.approx(40.0)
    assert u["sm_active_gpu_seconds"] == pytest.approx(20.0) and u["energy_joules"] == pytest.approx(4000.0)
    assert u["efficiency"] == pytest.approx(0.5)
    (g,) = c.get("/api/v1/usage", params={"job": "7", "per_gpu": "1"}).json()
    assert g["gpu_uuid"] == "GPU-a"
    assert c.get("/api/v1/usage", params={"job": "nope"}).json() == []
    assert c.get("/api/v1/totals").json()["energy_joules"] == pytest.approx(4000.0)
    assert c.get("/healthz").json() == {"status": "ok"}


def test_malformed_batch_gets_4xx_naming_the_problem_and_nothing_is_stored(srv):
    s, c = srv
    good = samples(NOW - 100, 3)
    bad = batch(4, good)
    bad["samples"][2]["sm_active_ratio"] = 1.7
    r = c.post("/api/v1/samples", json=bad)
    assert r.status_code == 400
    msg = r.json()["error"]
    assert "agent_id='a1'" in msg and "seq=4" in msg and "sample[2].sm_active_ratio" in msg
    assert c.get("/api/v1/usage").json() == []
    assert s.store.series("n1", "GPU-a", 0, 2e9) == []
    # the same seq, corrected, is then accepted: a rejected batch did not burn its id
    assert c.post("/api/v1/samples", json=batch(4, good)).json()["accepted"] == 3
    assert c.post("/api/v1/samples", content=b"{oops", headers={"Content-Type": "application/json"}).status_code == 400
    assert c.post("/api/v1/samples", content=b"x", headers={"Content-Type": "text/csv"}).status_code == 415
    assert c.get("/api/v1/nothing").status_code == 404
    assert c.get("/api/v1/totals", params={"start": "soon"}).status_code == 400


def test_duplicate_batch_acknowledged_once(srv):
    s, c = srv
    b = batch(1, samples(NOW - 100, 4))
    first = c.post("/api/v1/samples", json=b).json()
    second = c.post("/api/v1/samples", json=b).json()
    assert first["accepted"] == 4 and not first["duplicate"]
    assert second == {"accepted": 0, "duplicate": True, "duplicate_samples": 0, "too_late": 0}
    assert len(s.store.series("n1", "GPU-a", 0, 2e9)) == 4
    metrics = c.get("/metrics").text
    assert "gpuledger_collector_batches_deduplicated_total 1.0" in metrics
    assert "gpuledger_collector_samples_accepted_total 4.0" in metrics
    assert "gpuledger_collector_ingest_latency_seconds_count 2.0" in metrics
    # one at a time, each its own group commit: two commits of one batch each
    assert "gpuledger_collector_group_commit_batches_count 2.0" in metrics
    assert "gpuledger_collector_group_commit_batches_sum 2.0" in metrics
    assert "gpuledger_collector_group_commit_seconds_count 2.0" in metrics
    assert "gpuledger_collector_store_size_bytes" in metrics


def test_compressed_and_msgpack_bodies(srv):
    import msgpack

    s, c = srv
    body = gzip.compress(json.dumps(batch(1, samples(NOW - 100, 2))).encode())
    r = c.post("/api/v1/samples", content=body, headers={"Content-Type": "application/json",
                                                         "Content-Encoding": "gzip"})
    assert r.json()["accepted"] == 2
    r = c.post("/api/v1/samples", content=msgpack.packb(batch(2, samples(NOW - 50, 2, job="8"))),
               headers={"Content-Type": "application/msgpack"})
    assert r.json()["accepted"] == 2


def test_oversized_body_is_413_and_server_survives(tmp_path):
    store = Store(tmp_path / "c.sqlite")
    s = CollectorServer(store, max_body_bytes=1000, clock=lambda: NOW).start()
    try:
        with httpx.Client(base_url=s.url) as c:
            r = c.post("/api/v1/samples", json=batch(0, samples(NOW - 100, 20)))
            assert r.status_code == 413 and "exceeds" in r.json()["error"]
            assert c.get("/healthz").status_code == 200
        # a raw request without Content-Length, and one that hangs up half-way
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 411 " in sock.recv(4096)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"agent")
        assert httpx.get(s.url + "/healthz").status_code == 200
    finally:
        s.stop()
        store.close()


def test_jobs_endpoint(srv):
    s, c = srv
    recs = [JobRecord("1", cluster="c", user="ann", hosts=("n1",)).to_dict(), JobRecord("2", cluster="c").to_dict()]
    assert c.post("/api/v1/jobs", json=recs).json() == {"received": 2, "changed": 2}
    assert c.post("/api/v1/jobs", json=recs).json() == {"received": 2, "changed": 0}
    assert [j["job_id"] for j in c.get("/api/v1/jobs").json()] == ["1", "2"]
    r = c.post("/api/v1/jobs", json=[{"job_id": 5}])
    assert r.status_code == 400 and "job[0].job_id" in r.json()["error"]


def test_concurrent_agents_all_counted(srv):
    import threading

    s, c = srv
    errors: list[str] = []

    def agent(k: int) -> None:
        with httpx.Client(base_url=s.url, timeout=20) as cl:
            for seq in range(8):
                smp = [GpuSample(ts=NOW - 1000 + 10 * (seq * 5 + i), host=f"n{k}", gpu_uuid="GPU-a", gpu_index=0,
                                 energy_joules=100.0 * (seq * 5 + i), job_ids=(f"j{k}",)) for i in range(5)]
                r = cl.post("/api/v1/samples", json=batch(seq, smp, agent=f"a{k}", host=f"n{k}"))
                if r.status_code != 200 or r.json()["accepted"] != 5:
                    errors.append(r.text)

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    usage = {u["job_id"]: u for u in c.get("/api/v1/usage").json()}
    assert sorted(usage) == ["j0", "j1", "j2", "j3"]
    for u in usage.values():
        assert u["samples"] == 40 and u["allocated_gpu_seconds"] == pytest.approx(390.0)
        assert u["energy_joules"] == pytest.approx(3900.0)


@pytest.fixture(scope="module")
def shared_srv(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("fuzz") / "c.sqlite")
    s = CollectorServer(store, clock=lambda: NOW).start()
    with httpx.Client(base_url=s.url, timeout=10) as client:
        yield s, client
    s.stop()
    store.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(
        st.sampled_from(["agent_id", "seq", "host", "samples", "x"]),
        st.one_of(st.none(), st.integers(), st.text(max_size=4), st.lists(st.dictionaries(
            st.sampled_from(["ts", "host", "gpu_uuid", "gpu_index", "power_watts"]),
            st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3)), max_size=5), max_size=2)),
        max_size=5)),
))
def test_fuzzed_bodies_never_5xx_and_store_nothing(shared_srv, body):
    s, c = shared_srv
    r = c.post("/api/v1/samples", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code < 500
    if r.status_code != 200:
        assert "error" in r.json()
    else:  # only a fully valid batch passes; it holds samples of its own host only
        assert r.json()["accepted"] >= 0
    assert c.get("/healthz").status_code == 200


def test_stop_is_prompt(tmp_path):
    store = Store(tmp_path / "c.sqlite")
    s = CollectorServer(store).start()
    t = time.monotonic()
    s.stop()
    store.close()
    assert time.monotonic() - t < 5


def test_a_sqlite_ledger_another_process_holds_is_503_within_the_deadline_and_reads_go_on(tmp_path):
    """Workers and the compactor take turns at a SQLite ledger through its writers' lock file: one that holds it
    (stuck on a stalled disk) makes this collector's batches wait. Each is answered 503 within ledger_timeout_s, the
    next one at once, /healthz 503, while reads go on (they wait for no writer); once the lock is let go the waiting
    batch is committed, /healthz is 200 and the agent's resend a duplicate."""
    import subprocess
    import sys

    path = tmp_path / "c.sqlite"
    store = Store(path, clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, ledger_timeout_s=0.5).start()
    holder = None
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            assert c.post("/api/v1/samples", json=batch(0, samples(NOW - 100, 3))).status_code == 200
            hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
                    "print(flush=True); sys.stdin.read()")
            holder = subprocess.Popen([sys.executable, "-c", hold, f"{path}-writer.lock"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
            assert holder.stdout is not None and holder.stdout.readline() == b"\n"  # it holds the lock
            late = batch(1, samples(NOW - 50, 4))
            t0 = time.monotonic()
            r = c.post("/api/v1/samples", json=late)
            assert (r.status_code, r.json()["reason"]) == (503, "ledger_timeout") and "Retry-After" in r.headers
            assert 0.5 <= time.monotonic() - t0 < 2.5
            r = c.post("/api/v1/samples", json=batch(2, samples(NOW - 20, 2)))
            assert (r.status_code, r.json()["reason"]) == (503, "ledger_stalled")
            health = c.get("/healthz")
            assert health.status_code == 503 and health.json()["reason"] == "ledger_stalled"
            assert c.get("/api/v1/totals").json()["samples"] == 3  # reads answer all along
            holder.communicate(b"", timeout=10)  # the other process lets go
            deadline = time.monotonic() + 10
            while c.get("/healthz").status_code != 200:
                assert time.monotonic() < deadline, "the waiting batch was never committed"
                time.sleep(0.02)
            assert c.post("/api/v1/samples", json=late).json()["duplicate"]  # committed after its 503
            assert c.get("/api/v1/totals").json()["samples"] == 7
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        s.stop()
        store.close()
