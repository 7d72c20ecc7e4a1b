"""The on-disk spool and the spooling pusher, against a scripted HTTP server and the real collector."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import zstandard
from prometheus_client import generate_latest

from gpuledger.agent.exposition import make_registry
from gpuledger.agent.push import HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.agent.spool import Spool, SpoolingPusher
from gpuledger.schema.records import GpuSample

ACK = b'{"accepted": 2, "duplicate": false, "duplicate_samples": 0, "too_late": 0}'  # a collector's 200 body


def samples(n: int = 2, ts: float = 1_700_000_000.0) -> list[GpuSample]:
    return [GpuSample(ts=ts, host="n1", gpu_uuid=f"GPU-{i}", gpu_index=i, power_watts=100.0) for i in range(n)]


class Scripted:
    """Answers POSTs with the next status of ``script`` (then ``default``), with ``headers`` and ``body`` (a 2xx:
    ``ack``); records each decoded batch. A script entry may be a function of the decoded batch giving the status."""

    def __init__(self, script: list | None = None, default: int = 200, body: bytes = b"{}",
                 headers: dict[str, str] | None = None, ack: bytes = ACK) -> None:
        self.script, self.default, self.body, self.ack = list(script or []), default, body, ack
        self.headers = dict(headers or {})
        self.received: list[dict] = []  # every request, whatever was answered
        self.statuses: list[int] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "zstd":
                    body = zstandard.ZstdDecompressor().decompress(body)
                batch = json.loads(body)
                outer.received.append(batch)
                status = outer.script.pop(0) if outer.script else outer.default
                if callable(status):
                    status = status(batch)
                outer.statuses.append(status)
                reply = outer.ack if 200 <= status < 300 else outer.body
                self.send_response(status)
                for name, value in outer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/v1/samples"

    def acked(self) -> list[int]:
        return [r["seq"] for r, s in zip(self.received, self.statuses) if 200 <= s < 300]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made: list[Scripted] = []

    def make(*a, **kw) -> Scripted:
        made.append(Scripted(*a, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def test_spool_is_ordered_bounded_and_survives_reopening(tmp_path):
    sp = Spool(tmp_path, max_bytes=10_000, max_batches=3)
    for seq in (5, 3, 9, 7):  # four into a spool of three: the oldest (lowest seq) goes
        sp.put(seq, b"x" * 100, samples=seq)
    assert sp.seqs() == [5, 7, 9] and (sp.dropped_batches, sp.dropped_samples) == (1, 3)
    (tmp_path / ".00000000000000000011-1.json.tmp").write_bytes(b"half")  # a write cut by a crash
    (tmp_path / "README").write_text("not a batch")
    again = Spool(tmp_path, max_bytes=250, max_batches=10)  # reopened with a smaller byte bound
    assert again.seqs() == [7, 9] and again.bytes == 200 and again.dropped_batches == 1
    assert not (tmp_path / ".00000000000000000011-1.json.tmp").exists()
    b, body = again.oldest()
    assert (b.seq, b.samples, body) == (7, 7, b"x" * 100)
    again.put(12, b"y" * 1000, samples=1)  # bigger than the bound alone: kept, everything older dropped
    assert again.seqs() == [12] and again.dropped_batches == 3


def test_delivers_in_order_with_jittered_exponential_backoff(tmp_path, scripted):
    srv = scripted([503, 503, 503])  # down for three attempts (a 5xx is retried), then fine
    sleeps: list[float] = []
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=100), Spool(tmp_path / "s"),
                       backoff_base_s=1.0, backoff_max_s=3.0, rng=random.Random(7), sleep=sleeps.append)
    seqs = [p.write(samples()) for _ in range(4)]
    assert seqs == [100, 101, 102, 103] and p.spool.depth == 4
    assert p.drain() is True
    assert srv.acked() == seqs  # in order, each once
    assert [r["seq"] for r in srv.received] == [100, 100, 100, 100, 101, 102, 103]  # the same seq on every retry
    rng = random.Random(7)
    expected = [b * (0.5 + 0.5 * rng.random()) for b in (1.0, 2.0, 3.0)]  # capped at backoff_max_s
    assert sleeps == pytest.approx(expected)
    assert p.spool.depth == 0 and p.failures == 0 and p.sent_batches == 4
    p.close()


def test_a_4xx_batch_is_dropped_and_counted_but_401_is_kept(tmp_path, scripted):
    srv = scripted([422, 401])
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), sleep=lambda s: None)
    p.write(samples(3))
    p.write(samples(1))
    assert p.send_pending() is False  # 422: batch 1 dropped; 401: batch 2 kept for a retry
    assert p.rejected_batches == 1 and p.rejected_samples == 3 and p.spool.seqs() == [2]
    assert p.drain() is True and srv.acked() == [2]
    p.close()


def test_spool_and_seq_survive_an_agent_restart(tmp_path, scripted):
    srv = scripted(default=503)
    spool_dir = tmp_path / "spool"
    first = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=50), Spool(spool_dir), sleep=lambda s: None)
    first.write(samples())
    first.write(samples())
    assert first.drain(max_attempts=2) is False
    first.close()  # the collector is down: nothing sent, both kept on disk
    srv.default = 200
    # a low seq_start shows the spool directory wins: after the numbers used before, never a reused one
    second = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(spool_dir), sleep=lambda s: None)
    new = second.write(samples())
    assert new > 51
    assert second.drain() is True
    assert srv.acked() == [50, 51, new]
    second.close()
    # everything delivered, the spool empty: a third start still continues after every number used
    third = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(spool_dir), sleep=lambda s: None)
    assert third.write(samples()) > new
    third.close()


def test_seq_file_reserves_blocks_and_survives_without_the_clock(tmp_path):
    from gpuledger.agent.spool import SeqFile

    f = SeqFile(tmp_path / "next-seq", block=10)
    assert f.reserved == 0
    f.reserve(0)
    assert (tmp_path / "next-seq").read_text() == "10\n"
    f.reserve(4)  # within the block, more than half of it left: no write
    assert (tmp_path / "next-seq").read_text() == "10\n"
    f.reserve(5)  # half a block left: extended ahead of need
    assert SeqFile(tmp_path / "next-seq").reserved == 15 == f.reserved  # what a restart (or a crash) continues after
    (tmp_path / "next-seq").write_text("garbage")
    with pytest.raises(ValueError, match="corrupt"):
        SeqFile(tmp_path / "next-seq")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


FUTURE = b'{"error": "series[0].ts[3]: is more than 300 s in the future", "reason": "future"}'


def test_a_batch_from_a_clock_ahead_waits_and_the_batches_after_it_go_first(tmp_path, scripted, caplog):
    # The node's clock ran ahead for one batch (seq 1), then was stepped back: that batch is refused as "future"
    # until real time reaches its times; the correct batches behind it must not wait for that.
    clock = Clock()
    srv = scripted(body=FUTURE)
    srv.default = lambda b: 400 if b["seq"] == 1 else 200
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), backoff_base_s=10.0,
                       rng=random.Random(1), sleep=lambda s: None, clock=clock)
    for _ in range(3):
        p.write(samples())
    assert p.send_pending() is True  # nothing more to send now: seq 1 waits on its own backoff
    assert srv.acked() == [2, 3] and p.spool.seqs() == [1] and p.rejected_batches == 0 and p.failures == 0
    assert [r["seq"] for r in srv.received] == [1, 2, 3]
    p.write(samples())
    assert p.send_pending() is True and srv.acked() == [2, 3, 4]  # not due: seq 1 is not tried again
    assert [r["seq"] for r in srv.received] == [1, 2, 3, 4]
    clock.t += 10.0  # past its first delay (5-10 s): tried again, still refused; the next delay doubles
    assert p.send_pending() is True and [r["seq"] for r in srv.received][-1] == 1 and p.spool.seqs() == [1]
    clock.t += 10.0
    p.send_pending()
    assert p.spool.seqs() == [1]  # 10-20 s now: not due after 10
    clock.t += 10.0
    srv.default = 200  # its times are no longer in the future: taken
    assert p.send_pending() is True and srv.acked() == [2, 3, 4, 1] and p.spool.depth == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuledger.agent.spool"]
    assert any("kept in the spool" in m and "HTTP 400" in m and "go first" in m for m in lines)
    p.close()


def test_the_background_sender_does_not_spin_on_a_batch_that_is_not_due(tmp_path, scripted):
    srv = scripted(default=400, body=FUTURE)
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), backoff_base_s=60.0).start()
    try:
        p.write(samples())
        deadline = time.monotonic() + 5
        while not srv.received and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        assert len(srv.received) == 1 and p.spool.depth == 1  # one attempt, then it waits 30-60 s
        srv.default = 200
        p.write(samples())  # a new batch wakes the sender and goes ahead of the waiting one
        deadline = time.monotonic() + 5
        while srv.acked() != [2] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.acked() == [2] and p.spool.seqs() == [1]
    finally:
        p.close(flush=False)


def test_a_bad_batch_is_dropped_and_counted(tmp_path, scripted, caplog):
    srv = scripted([400], body=b'{"error": "bad", "reason": "invalid"}')
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=2), Spool(tmp_path), sleep=lambda s: None)
    p.write(samples(3))
    assert p.send_pending() is True and p.spool.depth == 0  # refused for good: dropped and counted
    assert (p.rejected_batches, p.rejected_samples) == (1, 3)
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuledger.agent.spool"]
    assert any("refused batch 2 (3 samples) for good" in m and "dropped" in m for m in lines)
    assert all("\n" not in m for m in lines) and "unreachable" not in " ".join(lines)  # 4xx is no outage
    assert "dropped 1 refused" in p.summary()
    p.close()


@pytest.mark.parametrize("status", [301, 307, 308, 405, 415])
def test_a_redirect_or_a_wrong_endpoint_keeps_the_whole_spool(tmp_path, scripted, status):
    # A proxy redirecting, or a URL that is not the collector's samples endpoint, says nothing about the batches:
    # one pass must not throw the backlog away.
    srv = scripted(default=status)
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), sleep=lambda s: None)
    for _ in range(5):
        p.write(samples())
    assert p.send_pending() is False and len(srv.received) == 1  # the pass stops at the first answer
    assert p.spool.depth == 5 and p.rejected_batches == 0 and p.failures == 1
    srv.default = 200
    assert p.drain() is True and srv.acked() == [1, 2, 3, 4, 5]
    p.close()


def test_retry_after_is_honoured_up_to_the_longest_backoff(tmp_path, scripted):
    srv = scripted(default=507, headers={"Retry-After": "30"}, body=b'{"error": "disk full", "reason": "full"}')
    sleeps: list[float] = []
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), backoff_base_s=0.5,
                       backoff_max_s=300.0, rng=random.Random(3), sleep=sleeps.append)
    p.write(samples())
    assert p.drain(max_attempts=3) is False
    assert sleeps == [30.0, 30.0]  # the jittered backoff (0.25-2 s) is shorter: the collector's word wins
    srv.headers = {"Retry-After": "86400"}  # a day: capped at backoff_max_s
    sleeps.clear()
    p.backoff_max_s = 60.0
    assert p.drain(max_attempts=2) is False and sleeps == [60.0]
    srv.headers = {}  # none given: the backoff alone
    srv.default = 429
    p.failures = 0
    sleeps.clear()
    assert p.drain(max_attempts=2) is False and 0.25 <= sleeps[0] < 0.5
    srv.default, srv.headers = 200, {}
    assert p.drain() is True and srv.acked() == [1]
    p.close()


def test_retry_after_seconds_reads_delay_seconds_and_http_dates():
    from gpuledger.agent.push import retry_after_seconds

    assert retry_after_seconds("120") == 120.0 and retry_after_seconds(" 0 ") == 0.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0  # past: now
    for bad in (None, "", "soon", "-5", "1.5", "\u00b2", "Wed, 21 Oct 2015 07:28:00"):
        assert retry_after_seconds(bad) is None


def test_background_sender_with_the_real_collector_and_agent_metrics(tmp_path):
    from gpuledger.collector.server import CollectorServer
    from gpuledger.collector.store import Store

    now = time.time()
    store = Store(tmp_path / "c.sqlite")
    port_holder = CollectorServer(store).start()  # find a port, then stop: the collector is "down" at first
    url = port_holder.url
    port_holder.stop()
    pusher = SpoolingPusher(HttpPusher(url + "/api/v1/samples", "a", "sim", timeout=2), Spool(tmp_path / "s"),
                            backoff_base_s=0.05, backoff_max_s=0.2).start()
    agent = Agent(SimulatedSource(host="sim", gpus=2, clock=iter(now - 60 + i for i in range(100)).__next__),
                  sinks=[pusher])
    for _ in range(5):
        agent.tick()
    deadline = time.monotonic() + 5
    while pusher.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    text = generate_latest(make_registry(agent)).decode()
    assert "gpuledger_agent_spool_batches 5.0" in text and "gpuledger_agent_spool_dropped_batches_total 0.0" in text
    host, port = url.removeprefix("http://").split(":")
    srv = CollectorServer(store, host=host, port=int(port)).start()  # back, on the same address
    try:
        deadline = time.monotonic() + 15
        # the sender removes a batch from the spool, then counts it: wait for both
        while (pusher.spool.depth or pusher.sent_batches < 5) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pusher.spool.depth == 0 and pusher.sent_batches == 5
        assert store.totals()["samples"] == 10 and store.batches_seen() == 5
        agent.close()  # closes the pusher
    finally:
        srv.stop()
        store.close()


@pytest.mark.parametrize("ack,ctype", [(b"<html><body>Service under maintenance</body></html>", "text/html"),
                                       (b"{}", "application/json"), (b'{"accepted": 2}', "application/json")])
def test_a_2xx_that_is_no_collectors_acknowledgement_delivers_nothing(tmp_path, scripted, caplog, ack, ctype):
    # --collector pointing at a proxy's maintenance page (or any server answering 200 to everything)
    from gpuledger.agent.push import DirectSink

    srv = scripted(ack=ack, headers={"Content-Type": ctype})
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path), sleep=lambda s: None)
    for _ in range(3):
        p.write(samples())
    assert p.send_pending() is False and p.spool.depth == 3 and p.sent_batches == 0 and p.failures == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuledger.agent.spool"]
    assert "HTTP 200 with no collector's acknowledgement" in line and ctype in line and "kept in the spool" in line
    direct = DirectSink(HttpPusher(srv.url, "a", "n1", seq_start=10))
    direct.write(samples())
    assert direct.delivered() == 0 and direct.stats()["unsent_batches"] == 1
    srv.ack = ACK  # the collector itself
    assert p.drain() is True and p.sent_batches == 3 and srv.acked()[-3:] == [1, 2, 3]
    p.close()


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_a_batch_partly_too_late_counts_its_stored_samples_as_sent(tmp_path, kind):
    # The node's clock stepped back mid-batch: the collector stores the samples in its window, answers 422 too_late
    # with the counts; those behind are lost (refused), the batch is not (it was stored, and is not sent again).
    from gpuledger.agent.push import DirectSink
    from gpuledger.collector.server import CollectorServer
    from gpuledger.collector.store import Store

    store = Store(tmp_path / "c.sqlite", window_s=60)
    srv = CollectorServer(store).start()
    try:
        pusher = HttpPusher(srv.url, "n1", "n1", fmt="msgpack")
        sink = DirectSink(pusher) if kind == "direct" else SpoolingPusher(pusher, Spool(tmp_path / "s"),
                                                                          fmt="msgpack", sleep=lambda s: None)
        now = time.time()
        sink.write([GpuSample(ts=now - 3 + i, host="n1", gpu_uuid="GPU-1", gpu_index=0, power_watts=100.0)
                    for i in range(3)])
        sink.write([GpuSample(ts=ts, host="n1", gpu_uuid="GPU-1", gpu_index=0, power_watts=100.0)
                    for ts in (now, now - 600, now - 599)])
        sink.write([GpuSample(ts=ts, host="n1", gpu_uuid="GPU-1", gpu_index=0, power_watts=100.0)
                    for ts in (now - 700, now - 699)])  # none of it stored: the batch is refused
        if kind == "spool":
            assert sink.drain() is True and sink.spool.depth == 0
        stats = sink.stats()
        assert (stats["sent_batches"], stats["rejected_batches"], stats["rejected_samples"]) == (2, 1, 2 + 2)
        assert store.totals()["samples"] == 4
        assert "delivered 2 batch(es) (6 samples, 2 of them not stored by the collector)" in sink.summary()
        sink.close()
    finally:
        srv.stop()
        store.close()


def test_a_batch_split_at_the_spools_bound_is_not_counted_as_dropped(tmp_path, scripted):
    # the halves of a batch refused as too large take about its room: storing them must not drop it over the bound
    from gpuledger.agent.push import encode_batch

    srv = scripted([413], body=b'{"reason": "too_large"}')
    size = len(encode_batch("a", "n1", 1, samples(8)))
    p = SpoolingPusher(HttpPusher(srv.url, "a", "n1", seq_start=1), Spool(tmp_path, max_bytes=size * 3 // 2),
                       compress=None, sleep=lambda s: None)
    p.write(samples(8))
    assert p.spool.bytes == size
    assert p.drain() is True
    assert (p.spool.dropped_batches, p.spool.dropped_samples, p.sent_batches) == (0, 0, 2)
    assert srv.statuses == [413, 200, 200]
    assert [sum(len(x["ts"]) for x in r["series"]) for r in srv.received[1:]] == [4, 4]
    p.close()
