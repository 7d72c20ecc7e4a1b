"""The collector's HTTP transport through real sockets: bounded heads, pipelining, refused bodies, idle
connections by the thousand, the connection cap and the idle clock."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from gpuledger.agent.push import encode_batch
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample

NOW = 1_700_000_000.0
N1 = "node-one-token-0123456789"


def honest(seq: int, host: str = "n1") -> bytes:
    """An agent's batch: 8 GPUs x 10 s, msgpack columns (the agent's own encoder)."""
    s = [GpuSample(ts=NOW - 600 + 10 * seq + k, host=host, gpu_uuid=f"GPU-{host}-{g}", gpu_index=g,
                   sm_active_ratio=0.5, job_ids=("7",)) for g in range(8) for k in range(10)]
    return encode_batch(f"agent-{host}", host, seq, s, fmt="msgpack")


def post(body: bytes, token: str | None = None, path: str = "/api/v1/samples") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


GET_HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture
def srv(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, request_timeout_s=2.0).start()
    yield s
    s.stop()
    store.close()


def connect(s: CollectorServer) -> socket.socket:
    host, port = s.url.split("://")[1].split(":")
    c = socket.create_connection((host, int(port)), timeout=10)
    return c


def read_response(c: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from ``c`` (what was read beyond it stays in ``buf``): status, headers (lower-case), body."""
    while b"\r\n\r\n" not in buf:
        chunk = c.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {bytes(buf[:200])!r}")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = c.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a body")
        rest += chunk
    buf[:] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


def closed_by_server(c: socket.socket) -> bool:
    """The server has closed ``c`` (reads end), after whatever it still had to say."""
    try:
        while c.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_heads_are_bounded_431_414_and_the_server_goes_on(srv):
    for head, status in (
        (b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", 431),  # one huge header
        (b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
        (b"GET /healthz?" + b"q" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    ):
        with connect(srv) as c:
            c.sendall(head)
            code, headers, body = read_response(c, bytearray())
            assert code == status and headers["connection"] == "close" and json.loads(body)["error"]
            assert closed_by_server(c)
    with connect(srv) as c:  # a head that never ends is cut at the bound, however slowly it comes
        c.sendall(b"GET /healthz HTTP/1.1\r\n")
        for _ in range(80):
            c.sendall(b"X-Drip: " + b"b" * 1000 + b"\r\n")
        code, _, _ = read_response(c, bytearray())
        assert code == 431
    with connect(srv) as c:  # not HTTP at all
        c.sendall(b"\x16\x03\x01\x02\x00hello\r\n\r\n")
        code, headers, body = read_response(c, bytearray())
        assert code == 400 and "malformed request" in json.loads(body)["error"]
    assert httpx.get(srv.url + "/healthz").status_code == 200


def test_pipelined_requests_are_answered_one_at_a_time_in_order(srv):
    with connect(srv) as c:
        c.sendall(GET_HEALTH + post(honest(0)) + b"GET /api/v1/totals HTTP/1.1\r\nHost: x\r\n\r\n"
                  + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n" + GET_HEALTH)
        buf = bytearray()
        answers = [read_response(c, buf) for _ in range(5)]
        assert [a[0] for a in answers] == [200, 200, 200, 404, 200]
        assert json.loads(answers[1][2])["accepted"] == 80
        assert json.loads(answers[2][2])["samples"] == 80  # the batch was stored before the query was read
        assert all("connection" not in a[1] for a in answers)  # kept alive throughout
        # the head and body of the next request may come byte by byte, the blank line split across reads
        for b in post(honest(1)):
            c.sendall(bytes([b]))
        code, _, body = read_response(c, buf)
        assert code == 200 and json.loads(body)["accepted"] == 80


def test_chunked_and_unannounced_bodies_are_411_and_close(srv):
    with connect(srv) as c:
        c.sendall(b"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        code, headers, body = read_response(c, bytearray())
        assert code == 411 and "chunked" in json.loads(body)["error"] and headers["connection"] == "close"
        assert closed_by_server(c)
    with connect(srv) as c:
        c.sendall(b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n")
        code, headers, _ = read_response(c, bytearray())
        assert code == 411 and headers["connection"] == "close"
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'gpuledger_collector_batches_rejected_total{reason="malformed",status="411"} 2.0' in metrics


def test_a_body_cut_short_by_a_half_close_is_400_and_a_large_one_is_413_unread(srv):
    with connect(srv) as c:
        c.sendall(b"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"agent")
        c.shutdown(socket.SHUT_WR)
        code, _, body = read_response(c, bytearray())
        assert code == 400 and "body ended after 7 of 500 bytes" in json.loads(body)["error"]
    with connect(srv) as c:  # answered from the head: the client never sends the 1 GB
        c.sendall(b"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        code, headers, _ = read_response(c, bytearray())
        assert code == 413 and headers["connection"] == "close"
    with connect(srv) as c:  # a request sent whole before a half-close is answered in full
        c.sendall(GET_HEALTH)
        c.shutdown(socket.SHUT_WR)
        assert read_response(c, bytearray())[0] == 200
    with connect(srv) as c:  # a client that waits for 100 Continue before its body gets it
        body = honest(3)
        c.sendall(post(body).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1)[:-len(body)])
        buf = bytearray()
        assert read_response(c, buf)[0] == 100
        c.sendall(body)
        assert read_response(c, buf)[0] == 200


def test_thousands_of_idle_keep_alive_connections_are_held_and_an_honest_push_goes_through(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, auth=Authenticator({"n1": N1})).start()
    idle: list[socket.socket] = []
    try:
        for _ in range(2000):
            idle.append(connect(s))
        for c in idle:  # each has been answered once: a keep-alive connection between two pushes
            c.sendall(GET_HEALTH)
        for c in idle:
            assert read_response(c, bytearray())[0] == 200
        t0 = time.monotonic()
        r = httpx.post(s.url + "/api/v1/samples", content=honest(0), timeout=10,
                       headers={"Content-Type": "application/msgpack", "Authorization": f"Bearer {N1}"})
        assert r.status_code == 200 and r.json()["accepted"] == 80
        assert time.monotonic() - t0 < 2.0
        for c in idle[::100]:  # all still open and served
            c.sendall(GET_HEALTH)
            assert read_response(c, bytearray())[0] == 200
        t0 = time.monotonic()
    finally:
        s.stop()  # closes them all
        for c in idle:
            c.close()
        store.close()
    assert time.monotonic() - t0 < 5


def test_connections_beyond_the_cap_are_closed_at_once_and_logged(tmp_path, caplog):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, max_connections=3).start()
    try:
        held = [connect(s) for _ in range(3)]
        for c in held:  # accepted and counted
            c.sendall(GET_HEALTH)
            assert read_response(c, bytearray())[0] == 200
        with connect(s) as extra:
            extra.sendall(GET_HEALTH)
            with pytest.raises(ConnectionError):
                read_response(extra, bytearray())
        assert any("connections open (limit 3)" in m.getMessage() for m in caplog.records)
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server has seen the close
            try:
                with connect(s) as again:
                    again.sendall(GET_HEALTH)
                    assert read_response(again, bytearray())[0] == 200
                break
            except ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for c in held:
            c.close()
    finally:
        s.stop()
        store.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, idle_timeout_s=0.5).start()
    try:
        with connect(s) as c:
            c.sendall(GET_HEALTH)
            assert read_response(c, bytearray())[0] == 200
            t0 = time.monotonic()
            assert closed_by_server(c)
            assert 0.3 < time.monotonic() - t0 < 3
        with connect(s) as c:  # a connection that never sends is closed too
            t0 = time.monotonic()
            assert closed_by_server(c)
            assert time.monotonic() - t0 < 3
    finally:
        s.stop()
        store.close()


class _FailingSeries:
    """A series reader with a bug: every read raises."""

    def series(self, *args: object, **kwargs: object) -> list:
        raise ZeroDivisionError("a bug in a reader")


def test_an_unexpected_failure_is_a_500_for_that_request_only(tmp_path, caplog):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, series=_FailingSeries()).start()
    try:
        with connect(s) as c:
            c.sendall(b"GET /api/v1/series?host=n1&uuid=G&start=1&end=2 HTTP/1.1\r\nHost: x\r\n\r\n")
            code, headers, body = read_response(c, bytearray())
            assert code == 500 and json.loads(body) == {"error": "internal error"} and headers["connection"] == "close"
        (rec,) = [r for r in caplog.records if "internal error on GET /api/v1/series" in r.getMessage()]
        assert rec.exc_info and rec.exc_info[0] is ZeroDivisionError  # logged with its traceback
        assert httpx.get(s.url + "/healthz").status_code == 200
        assert "gpuledger_collector_internal_errors_total 1.0" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
        store.close()


def test_a_client_gone_mid_request_gives_back_its_node_slot(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, auth=Authenticator({"n1": N1}), max_per_host=1).start()

    def in_flight(n: int) -> None:  # requests being handled, this scrape included
        deadline = time.monotonic() + 5
        while f"gpuledger_collector_requests_in_flight {n}.0" not in httpx.get(s.url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    push = {"Content-Type": "application/msgpack", "Authorization": f"Bearer {N1}"}
    try:
        with connect(s) as c:  # the node's one slot, held from the headers on
            c.sendall(post(honest(0), N1)[:-100])
            in_flight(2)
            r = httpx.post(s.url + "/api/v1/samples", content=honest(1), timeout=10, headers=push)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        in_flight(1)  # it hung up: its request and its slot are given back
        r = httpx.post(s.url + "/api/v1/samples", content=honest(1), timeout=10, headers=push)
        assert r.status_code == 200 and r.json()["accepted"] == 80
    finally:
        s.stop()
        store.close()
