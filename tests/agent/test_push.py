"""The HTTP pusher against a real (tiny) HTTP server on loopback."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.push import HttpPusher, PushError
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.schema.records import GpuSample
from gpuledger.schema.wire import from_series

ACK = b'{"accepted": 1, "duplicate": false, "duplicate_samples": 0, "too_late": 0}'  # a collector's 200 body


class Collector:
    """Records each POST; answers with ``status`` (settable by the test)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.status = 202
        self.connections: set[int] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                outer.connections.add(self.client_address[1])
                outer.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "json": json.loads(body)}
                )
                reply = ACK if outer.status < 300 else b'{"detail": "bad batch"}'
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/v1/samples"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def samples(n: int = 2) -> list[GpuSample]:
    src = SimulatedSource(host="n7", gpus=n, clock=lambda: 1_700_000_000.0, profiles={0: "training"})
    return StaticMapper({0: "1234"}).map(src.sample())


def test_posts_batches_with_increasing_seq(collector: Collector) -> None:
    pusher = HttpPusher(collector.url, agent_id="n7-agent", host="n7", seq_start=100, token="s3cret")
    batch = samples()
    try:
        assert pusher.write(batch) == 100
        assert pusher.write(batch[:1]) == 101
    finally:
        pusher.close()
    first, second = collector.requests
    assert first["path"] == "/api/v1/samples"
    assert first["headers"]["Content-Type"] == "application/json"
    assert first["headers"]["Authorization"] == "Bearer s3cret"
    assert first["json"]["agent_id"] == "n7-agent" and first["json"]["host"] == "n7"
    assert [first["json"]["seq"], second["json"]["seq"]] == [100, 101]
    # The wire form (one series a GPU) round-trips to the same records.
    assert len(first["json"]["series"]) == 2
    assert from_series(first["json"]["series"], "n7") == batch
    assert len(from_series(second["json"]["series"], "n7")) == 1
    # Keep-alive: both batches over one connection.
    assert len(collector.connections) == 1
    assert pusher.batches_sent == 2


def test_default_seq_is_random_not_the_clock(collector: Collector) -> None:
    a = HttpPusher(collector.url, agent_id="a", host="n7")
    first = a.write(samples(1))
    a.close()
    b = HttpPusher(collector.url, agent_id="a", host="n7")  # a restarted agent without a spool directory
    second = b.write(samples(1))
    b.close()
    assert first != second and 0 <= first < 2**62 and 0 <= second < 2**62


@pytest.mark.parametrize("given,url", [
    ("http://c:8470", "http://c:8470/api/v1/samples"),
    ("127.0.0.1:8470", "http://127.0.0.1:8470/api/v1/samples"),
    ("https://c/", "https://c/api/v1/samples"),
    ("https://proxy/gpuledger", "https://proxy/gpuledger/api/v1/samples"),
    ("http://c:8470/api/v1/samples", "http://c:8470/api/v1/samples"),
])
def test_collector_is_a_base_url(given: str, url: str) -> None:
    from gpuledger.agent.push import samples_url

    assert samples_url(given) == url


def test_fails_over_to_the_next_collector_in_order(collector: Collector, caplog) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    base = collector.url.removesuffix("/api/v1/samples")
    pusher = HttpPusher([dead, base], agent_id="a", host="n7", seq_start=1, timeout=2.0)
    assert pusher.write(samples(1)) == 1 and pusher.batches_sent == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuledger.agent.push"]
    assert f"collector http://{dead}/api/v1/samples unreachable" in line and f"trying {collector.url}" in line
    collector.status = 422  # a refusal of the batch itself is final: no fail-over for it
    pusher2 = HttpPusher([base, dead], agent_id="a", host="n7", seq_start=2)
    with pytest.raises(PushError) as info:
        pusher2.write(samples(1))
    assert info.value.status == 422 and not info.value.failover
    pusher.close()
    pusher2.close()


def test_non_2xx_raises_with_status_and_body(collector: Collector) -> None:
    collector.status = 422
    pusher = HttpPusher(collector.url, agent_id="a", host="n7", seq_start=5)
    with pytest.raises(PushError, match="HTTP 422") as info:
        pusher.write(samples(1))
    assert info.value.status == 422 and "bad batch" in info.value.body
    collector.status = 200
    # The failed batch burnt its number; the next one moves on, and send() can re-send with the old one.
    assert pusher.write(samples(1)) == 6
    pusher.send(5, samples(1))
    assert [r["json"]["seq"] for r in collector.requests] == [5, 6, 5]
    pusher.close()


def test_connection_refused_raises_push_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port now.
    pusher = HttpPusher(f"http://127.0.0.1:{port}/api/v1/samples", agent_id="a", host="n7", timeout=2.0)
    with pytest.raises(PushError, match="ConnectError") as info:
        pusher.write(samples(1))
    assert info.value.status is None
    pusher.close()


def test_unencodable_sample_raises_push_error(collector: Collector) -> None:
    bad = GpuSample(ts=1.0, host="n7", gpu_uuid="GPU-x", gpu_index=0, power_watts=float("nan"))
    pusher = HttpPusher(collector.url, agent_id="a", host="n7")
    with pytest.raises(PushError, match="cannot be encoded as JSON"):
        pusher.write([bad])
    assert collector.requests == []
    pusher.close()


def test_rejects_bad_config() -> None:
    for bad, needle in (("ftp://c", "scheme"), ("http://c:port", "port"), ("http://", "host"),
                        ("http://c/?x=1", "query")):
        with pytest.raises(ValueError, match=needle):
            HttpPusher(bad, agent_id="a", host="h")
    with pytest.raises(ValueError, match="agent_id"):
        HttpPusher("http://x/api/v1/samples", agent_id="", host="h")


def test_as_agent_sink_a_down_collector_does_not_stop_the_agent(collector: Collector) -> None:
    pusher = HttpPusher(collector.url, agent_id="a", host="h", seq_start=1)
    agent = Agent(SimulatedSource(host="h", gpus=2), sinks=[pusher])
    agent.tick()
    collector.status = 503
    agent.tick()
    collector.status = 200
    agent.tick()
    agent.close()
    assert [r["json"]["seq"] for r in collector.requests] == [1, 2, 3]
    assert agent.errors_total["sink"] == 1 and agent.ticks_total == 3


def test_batcher_pushes_every_n_ticks_and_on_close() -> None:
    from gpuledger.agent.push import Batcher

    class Recorder:  # a sink at the boundary: records what it is handed
        def __init__(self) -> None:
            self.batches: list[list[GpuSample]] = []
            self.closed = False

        def write(self, samples):
            self.batches.append(list(samples))

        def close(self):
            self.closed = True

    inner = Recorder()
    b = Batcher(inner, every=3)
    ticks = [[GpuSample(ts=float(t), host="h", gpu_uuid=f"G{g}", gpu_index=g) for g in range(2)] for t in range(7)]
    for t in ticks:
        b.write(t)
    assert [len(x) for x in inner.batches] == [6, 6]
    assert [s.ts for s in inner.batches[1]] == [3.0, 3.0, 4.0, 4.0, 5.0, 5.0]
    b.close()
    assert [len(x) for x in inner.batches] == [6, 6, 2] and inner.closed
    with pytest.raises(ValueError, match="must be >= 1"):
        Batcher(inner, every=0)


class Dripping:
    """A server (or a proxy) that reads the request, then answers one byte every ``every_s``: each read is within
    any per-read timeout, the whole answer takes for ever."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/api/v1/samples"
        self.every_s = every_s
        self.accepted = 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            try:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b" " * 100000:
                    if self._stop.wait(self.every_s):
                        return
                    conn.send(bytes([byte]))
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()


def test_an_answer_that_trickles_in_fails_at_the_deadline_and_close_returns(tmp_path) -> None:
    import time

    from gpuledger.agent.push import MAX_HUNG_REQUESTS
    from gpuledger.agent.spool import Spool, SpoolingPusher

    srv = Dripping(every_s=0.2)
    try:
        pusher = HttpPusher(srv.url, agent_id="a", host="n7", timeout=1.0, deadline_s=1.5, seq_start=1)
        t0 = time.monotonic()
        with pytest.raises(PushError, match="no complete answer within 1.5 s") as info:
            pusher.write(samples(1))
        assert 1.4 < time.monotonic() - t0 < 5 and info.value.status is None and info.value.failover
        for _ in range(MAX_HUNG_REQUESTS - 1):
            with pytest.raises(PushError, match="no complete answer"):
                pusher.write(samples(1))
        t0 = time.monotonic()  # as many requests hang as allowed: the next fails at once, opening no connection
        with pytest.raises(PushError, match=f"{MAX_HUNG_REQUESTS} earlier requests are still waiting"):
            pusher.write(samples(1))
        assert time.monotonic() - t0 < 0.5 and srv.accepted == MAX_HUNG_REQUESTS
        pusher.close()
        # the spooling sender: the batch stays spooled, and the agent's shutdown is not held
        sp = SpoolingPusher(HttpPusher(srv.url, agent_id="a", host="n7", timeout=1.0, deadline_s=1.0),
                            Spool(tmp_path), backoff_base_s=0.1, backoff_max_s=0.2).start()
        sp.write(samples(1))
        deadline = time.monotonic() + 10
        while sp.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sp.failures >= 1 and "no complete answer" in (sp.last_error or "") and sp.spool.depth == 1
        t0 = time.monotonic()
        sp.close()
        assert time.monotonic() - t0 < 5 and sp.spool.depth == 1
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="deadline_s"):
        HttpPusher(srv.url, agent_id="a", host="n7", deadline_s=0)


def test_job_records_of_a_batch_no_collector_took_ride_with_the_next(collector: Collector, tmp_path) -> None:
    from gpuledger.agent.push import DirectSink
    from gpuledger.agent.spool import Spool, SpoolingPusher
    from gpuledger.schema.records import JobRecord

    rec = JobRecord(job_id="4242", user="alice", account="proj_a")
    direct = DirectSink(HttpPusher(collector.url, agent_id="a", host="n7", seq_start=1))
    direct.write_jobs([rec])
    collector.status = 503  # down for one batch: dropped (no spool), its job record kept for the next
    direct.write(samples(1))
    collector.status = 200
    direct.write(samples(1))
    direct.write(samples(1))
    carried = [[j["job_id"] for j in r["json"].get("jobs", [])] for r in collector.requests]
    assert carried == [["4242"], ["4242"], []]
    assert direct.stats()["unsent_batches"] == 1 and direct.stats()["rejected_batches"] == 0
    # a batch refused for good drops its records with it (they may be why it was refused)
    collector.status = 400
    direct.write_jobs([JobRecord(job_id="7")])
    direct.write(samples(1))
    collector.status = 200
    direct.write(samples(1))
    assert "jobs" not in collector.requests[-1]["json"] and direct.stats()["rejected_batches"] == 1
    direct.close()

    # spooled: a batch the spool cannot store (its directory gone) is posted at once; one no collector takes then
    # is dropped and counted, and gives its records back
    collector.requests.clear()
    spool_dir = tmp_path / "spool"
    sp = SpoolingPusher(HttpPusher(collector.url, agent_id="a", host="n7"), Spool(spool_dir), fmt="json",
                        compress=None, sleep=lambda s: None)
    sp.write(samples(1))  # reserves a block of sequence numbers: the next writes only spool
    sp.write_jobs([rec])
    moved = tmp_path / "moved"
    spool_dir.rename(moved)
    collector.status = 503
    sp.write(samples(1))
    assert (sp.stats()["unsent_batches"], sp.stats()["unsent_samples"]) == (1, 1)
    assert "1 batch(es) (1 samples) neither spooled nor delivered" in sp.summary()
    collector.status = 200
    sp.write(samples(1))  # still no spool: delivered directly, with the records
    moved.rename(spool_dir)
    sp.write(samples(1))
    assert sp.drain() is True and sp.delivered() == 3
    assert [[j["job_id"] for j in r["json"].get("jobs", [])] for r in collector.requests] == [
        ["4242"], ["4242"], [], []]
    sp.close()


def test_metrics_of_a_pusher_without_a_spool_are_exported(collector: Collector) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuledger.agent.exposition import make_registry
    from gpuledger.agent.push import Batcher, DirectSink

    for sink in (DirectSink(HttpPusher(collector.url, agent_id="a", host="h", seq_start=1)),
                 Batcher(DirectSink(HttpPusher(collector.url, agent_id="a", host="h", seq_start=1)), 1)):
        collector.requests.clear()
        agent = Agent(SimulatedSource(host="h", gpus=2), sinks=[sink])
        collector.status = 200
        agent.tick()
        collector.status = 503
        agent.tick()
        collector.status = 422
        agent.tick()
        text = generate_latest(make_registry(agent)).decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["gpuledger_agent_push_sent_batches_total"] == 1
        assert values["gpuledger_agent_push_unsent_batches_total"] == 1
        assert values["gpuledger_agent_push_unsent_samples_total"] == 2
        assert values["gpuledger_agent_push_rejected_batches_total"] == 1
        assert values["gpuledger_agent_push_rejected_samples_total"] == 2
        assert "gpuledger_agent_spool_batches" not in values  # no spool, no spool figures
        agent.close()


def test_a_batch_carries_no_more_job_records_than_the_collector_takes(collector: Collector) -> None:
    from gpuledger.agent.push import BatchLimits, DirectSink
    from gpuledger.schema.records import JobRecord

    direct = DirectSink(HttpPusher(collector.url, agent_id="a", host="n7", seq_start=1, limits=BatchLimits(jobs=2)))
    direct.write_jobs([JobRecord(job_id=str(j)) for j in range(5)])
    for _ in range(4):
        direct.write(samples(1))
    carried = [[j["job_id"] for j in r["json"].get("jobs", [])] for r in collector.requests]
    assert carried == [["0", "1"], ["2", "3"], ["4"], []]  # the rest wait for the next batch, none is lost
    direct.close()
