"""A PostgreSQL ledger that cannot be reached: the batch is refused whole (503 with Retry-After, one log line),
nothing of it is written, and the same collector takes it once the ledger is back."""

from __future__ import annotations

import logging

import httpx
import pytest
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
