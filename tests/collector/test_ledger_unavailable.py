"""A PostgreSQL ledger that cannot be reached: the batch is refused whole (503 with Retry-After, one log line),
nothing of it is written, and the same collector takes it once the ledger is back."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from collector_proc import metric_value
from servers import free_port

from gpuledger.agent.push import encode_batch
from gpuledger.collector.db import (
    TCP_KEEPALIVE_COUNT,
    TCP_KEEPALIVE_IDLE_S,
    TCP_KEEPALIVE_INTERVAL_S,
    TCP_USER_TIMEOUT_S,
    DatabaseUnavailable,
    PostgresDatabase,
)
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store, StoreUnavailable
from gpuledger.collector.validate import parse_batch
from gpuledger.schema.records import GpuSample

NOW = 1_700_000_000.0


def body(seq: int) -> bytes:
    samples = [GpuSample(ts=NOW - 600 + 10 * (10 * seq + k), host="n1", gpu_uuid="G0", gpu_index=0,
                         energy_joules=1e6 + 700.0 * (10 * seq + k), sm_active_ratio=0.5, job_ids=("7",))
               for k in range(10)]
    return encode_batch("agent-n1", "n1", seq, samples, fmt="msgpack")


def post(s: CollectorServer, seq: int) -> httpx.Response:
    return httpx.post(s.url + "/api/v1/samples", content=body(seq), headers={"Content-Type": "application/msgpack"})


def test_a_connection_lost_mid_batch_is_503_writes_nothing_and_the_batch_goes_through_later(pg_url, tmp_path,
                                                                                            caplog):
    store = Store(pg_url, clock=lambda: NOW)
    reference = Store(tmp_path / "ref.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW).start()
    try:
        assert post(s, 0).status_code == 200
        before = (store.totals(), store.job_usage(per_gpu=True), store.series("n1", "G0", 0, 2e9))
        # the server drops the connection half-way through batch 1's transaction: its samples and aggregates are
        # written, its key is being written, nothing is committed
        store.db.execute("CREATE FUNCTION cut() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.seq = 1 THEN "
                         "PERFORM pg_terminate_backend(pg_backend_pid()); END IF; RETURN NEW; END $$")
        store.db.execute("CREATE TRIGGER cut BEFORE INSERT ON batch_keys FOR EACH ROW EXECUTE FUNCTION cut()")
        with caplog.at_level(logging.ERROR, logger="gpuledger.collector.server"):
            r = post(s, 1)
        assert r.status_code == 503 and r.json()["reason"] == "ledger_unavailable", r.text
        assert int(r.headers["Retry-After"]) > 0
        lines = [m.getMessage() for m in caplog.records if "ledger unavailable" in m.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0]
        assert (store.totals(), store.job_usage(per_gpu=True), store.series("n1", "G0", 0, 2e9)) == before
        assert store.batches_seen() == 1
        store.db.execute("DROP TRIGGER cut ON batch_keys")
        assert post(s, 1).status_code == 200  # the same collector, without a restart
        for seq in (0, 1):
            reference.ingest(parse_batch(body(seq), "application/msgpack", NOW))
        assert store.job_usage(per_gpu=True) == reference.job_usage(per_gpu=True)
        assert store.series("n1", "G0", 0, 2e9) == reference.series("n1", "G0", 0, 2e9)
    finally:
        s.stop()
        store.close()
        reference.close()


def test_a_ledger_nothing_listens_on_is_unavailable_at_once():
    with pytest.raises(StoreUnavailable, match="cannot connect") as e:
        Store(f"postgresql://gl@127.0.0.1:{free_port()}/ledger")
    assert isinstance(e.value, DatabaseUnavailable)  # what every command already answers with exit 1


def test_pooled_connections_notice_a_dead_link_in_tens_of_seconds_not_minutes(pg_url):
    """A link gone silent (a partition, a failover leaving the old primary's address dead) is noticed by the kernel's
    TCP timers, not after tcp_retries2's 15 minutes: every pooled connection's socket has keepalive probes and a TCP
    user timeout (collector.db.TCP_*), and a URL that sets one of them keeps its own. (The commit then fails, the
    batch is answered 503 and resent.)"""
    import socket

    def options(db: PostgresDatabase) -> tuple[int, ...]:
        with db._pool.connection() as conn:
            sock = socket.socket(fileno=conn.pgconn.socket)
            try:
                return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        *(sock.getsockopt(socket.IPPROTO_TCP, o) for o in (
                            socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT, socket.TCP_USER_TIMEOUT)))
            finally:
                sock.detach()  # the connection's socket, not ours to close

    assert TCP_KEEPALIVE_IDLE_S + TCP_KEEPALIVE_INTERVAL_S * TCP_KEEPALIVE_COUNT <= 60 and TCP_USER_TIMEOUT_S <= 60
    ours, tuned = PostgresDatabase(pg_url, max_size=2), PostgresDatabase(pg_url + "?keepalives_idle=42")
    try:
        assert options(ours) == (1, TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTERVAL_S, TCP_KEEPALIVE_COUNT,
                                 TCP_USER_TIMEOUT_S * 1000)
        assert options(tuned)[:2] == (1, 42)
    finally:
        ours.close()
        tuned.close()


def test_a_sqlite_ledger_locked_by_another_process_too_long_is_unavailable_not_an_error(tmp_path):
    import sqlite3

    store = Store(tmp_path / "s.sqlite", clock=lambda: NOW)
    other = sqlite3.connect(tmp_path / "s.sqlite", isolation_level=None)
    try:
        store.ingest(parse_batch(body(0), "application/msgpack", NOW))
        store.db.conn.execute("PRAGMA busy_timeout=100")  # not 10 s: the test waits for it
        other.execute("BEGIN IMMEDIATE")  # another writer holds the file's write lock
        with pytest.raises(StoreUnavailable, match="locked"):
            store.ingest(parse_batch(body(1), "application/msgpack", NOW))
        other.execute("ROLLBACK")
        assert store.ingest(parse_batch(body(1), "application/msgpack", NOW)).accepted == 10
        assert store.totals()["samples"] == 20
    finally:
        other.close()
        store.close()


# -- a ledger that stalls: PostgreSQL waiting for a synchronous standby that is gone (docs/scale.md's HA advice)
def _standby(postgres_server, names: str) -> None:
    postgres_server.psql(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
    postgres_server.psql("SELECT pg_reload_conf()")


def _post_behind_the_stall(postgres_server, url: str, seq: int) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """Posts batch ``seq`` in a thread; returns once its COMMIT waits for the standby."""
    answers: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: answers.__setitem__("r", httpx.post(
        url + "/api/v1/samples", content=body(seq), headers={"Content-Type": "application/msgpack"}, timeout=60)))
    t.start()
    while postgres_server.psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'") != "1":
        assert t.is_alive(), answers
        time.sleep(0.02)
    return t, answers


def test_metrics_answer_during_a_stall_and_a_batch_committed_after_its_503_is_counted_once(postgres_server):
    """/metrics answers during a stall, at once (the figures it reads through the store, which the stuck commit holds,
    as last read, with their age) and shows the stall; the batch answered 503 whose commit then goes in is counted
    as accepted, and the agent's resend as a duplicate, not again."""
    timeout_s = 1.0
    store = Store(postgres_server.new_database(), clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, ledger_timeout_s=timeout_s).start()
    try:
        assert post(s, 0).status_code == 200
        size = metric_value(httpx.get(s.url + "/metrics").text, "gpuledger_collector_store_size_bytes")
        _standby(postgres_server, "gpuledger_test_standby")
        try:
            t, answers = _post_behind_the_stall(postgres_server, s.url, 1)
            t.join()
            assert (answers["r"].status_code, answers["r"].json()["reason"]) == (503, "ledger_timeout")
            t0 = time.monotonic()
            m = httpx.get(s.url + "/metrics", timeout=30)
            assert m.status_code == 200 and time.monotonic() - t0 < 0.8, (m.status_code, m.text[:300])
            assert metric_value(m.text, "gpuledger_collector_ledger_stalled") == 1
            assert metric_value(m.text, "gpuledger_collector_ledger_commit_wait_seconds") >= timeout_s
            assert metric_value(m.text, "gpuledger_collector_store_size_bytes") == size  # as last read
            assert metric_value(m.text, "gpuledger_collector_ledger_readings_age_seconds") >= timeout_s
        finally:
            _standby(postgres_server, "")
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/healthz").status_code != 200:  # the stuck commit goes in
            assert time.monotonic() < deadline, "the stuck commit never finished"
            time.sleep(0.05)
        m = httpx.get(s.url + "/metrics").text
        assert metric_value(m, "gpuledger_collector_samples_accepted_total") == 20  # batch 1 too, answered 503
        assert metric_value(m, "gpuledger_collector_batches_accepted_total") == 2
        assert (metric_value(m, "gpuledger_collector_ledger_stalled"),
                metric_value(m, "gpuledger_collector_ledger_commit_wait_seconds")) == (0, 0)
        r = post(s, 1)  # the agent's resend
        assert r.status_code == 200 and r.json()["duplicate"], r.text
        m = httpx.get(s.url + "/metrics").text
        assert metric_value(m, "gpuledger_collector_samples_accepted_total") == 20
        assert metric_value(m, "gpuledger_collector_batches_deduplicated_total") == 1
    finally:
        s.stop()
        store.close()


def test_sigterm_during_a_stall_ends_within_the_bound_saying_so(postgres_server, tmp_path):
    """`gpuledger collector serve` stopped while its commit is stuck (a read waiting behind it too): it ends within
    its bound, exit status 1 and one line saying the ledger was stalled at shutdown, claiming nothing stored."""
    url = postgres_server.new_database()
    port = free_port()
    env = {**os.environ, "GPULEDGER_COLLECTOR_LEDGER_TIMEOUT_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gpuledger.cli", "collector", "serve", "--data-dir", str(tmp_path),
                             "--port", str(port), "--ledger-url", url], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        r = httpx.post(base + "/api/v1/samples", content=body(0), headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 200, r.text
        _standby(postgres_server, "gpuledger_test_standby")
        try:
            t, answers = _post_behind_the_stall(postgres_server, base, 1)
            reader = threading.Thread(target=lambda: answers.__setitem__("read", httpx.get(base + "/api/v1/totals",
                                                                                           timeout=60)))
            reader.start()
            t.join()
            assert answers["r"].status_code == 503, answers["r"].text
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail("the collector did not end within 20 s of SIGTERM while its ledger stalled")
            took = time.monotonic() - t0
            reader.join(10)
        finally:
            _standby(postgres_server, "")
        assert proc.returncode == 1, (proc.returncode, err)
        assert took < 5 + 1 + 3, took  # max(ledger_timeout_s, STOP_GRACE_S), the committer's second, the exit
        (line,) = [ln for ln in err.splitlines() if "stalled at shutdown" in ln]
        assert line.startswith("error: ") and "resend" in line and "stored" not in line, err
        assert answers["read"].status_code == 503, answers["read"].text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
