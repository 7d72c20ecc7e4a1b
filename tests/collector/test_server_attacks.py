"""The collector under attack, through real HTTP: each attack gets its status, honest pushes keep succeeding,
and nothing acknowledged is lost."""

from __future__ import annotations

import errno
import gzip
import json
import re
import socket
import threading
import time

import httpx
import msgpack
import pytest
import zstandard
from tiny_disk import fill, mount_tmpfs, unmount

from gpuledger.agent.push import encode_batch
from gpuledger.collector import server as server_module
from gpuledger.collector import validate
from gpuledger.collector.auditlog import open_log
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample

NOW = 1_700_000_000.0
N1, N2 = "node-one-token-0123456789", "node-two-token-0123456789"
ADMIN, READ = "admin-token-0123456789", "read-token-0123456789"
MSGPACK = {"Content-Type": "application/msgpack"}


def honest(seq: int, host: str = "n1", start: float = NOW - 600, fmt: str = "msgpack") -> bytes:
    """An agent's batch: 8 GPUs x 10 s, msgpack columns (the agent's own encoder)."""
    s = [GpuSample(ts=start + 10 * seq + k, host=host, gpu_uuid=f"GPU-{host}-{g}", gpu_index=g, sm_active_ratio=0.5,
                   energy_joules=1e6 + 100.0 * (10 * seq + k), job_ids=("7",)) for g in range(8) for k in range(10)]
    return encode_batch(f"agent-{host}", host, seq, s, fmt=fmt)


@pytest.fixture
def srv(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, request_timeout_s=1.5, max_inflight=2, max_per_host=2,
                        max_series_points=100, max_page=2,
                        auth=Authenticator({"n1": N1, "n2": N2}, read_tokens=["read-token-0123456789"])).start()
    yield s
    s.stop()
    store.close()


def push(s: CollectorServer, body: bytes, token: str = N1, **headers: str) -> httpx.Response:
    return httpx.post(s.url + "/api/v1/samples", content=body, timeout=10,
                      headers={**MSGPACK, "Authorization": f"Bearer {token}", **headers})


def stored(s: CollectorServer) -> int:
    return s.store.totals()["samples"]


def test_bomb_bodies_are_refused_with_bounded_memory_and_honest_pushes_go_on(srv):
    assert push(srv, honest(0)).status_code == 200
    # 2 KB of zstd inflating to 64 MB: refused while decompressing (the limit is 16 MiB decoded)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x80" * 64_000_000)
    assert len(bomb) < 4096
    r = push(srv, bomb, **{"Content-Encoding": "zstd"})
    assert r.status_code == 413 and "decompressed body exceeds" in r.json()["error"]
    # within the size limit, a list of 15 million empty maps: refused at the list's header, nothing built
    n = 15_000_000
    envelope = msgpack.packb({"agent_id": "a", "seq": 1, "host": "n1"})  # a 3-key map: made a 4-key one
    maps = b"\x84" + envelope[1:] + b"\xa7samples\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    r = push(srv, zstandard.ZstdCompressor(level=19).compress(maps), **{"Content-Encoding": "zstd"})
    assert r.status_code == 413 and "samples" in r.json()["error"]
    # one series carrying 200,000 job ids
    doc = msgpack.unpackb(honest(1))
    doc["series"][0]["job_ids"] = [str(i) for i in range(200_000)]
    r = push(srv, msgpack.packb(doc))
    assert r.status_code == 413 and "job_ids" in r.json()["error"]
    assert push(srv, honest(2)).status_code == 200
    assert stored(srv) == 160  # both honest batches, nothing of the others


def _slow(s: CollectorServer, token: str, head_only: bool = False) -> socket.socket:
    host, port = s.url.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)))
    head = (f"POST /api/v1/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: 5000\r\n")
    c.sendall(head.encode() if head_only else (head + "\r\n").encode() + b"\x80")
    return c


def _drip(c: socket.socket, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        try:
            c.sendall(b"X")
        except OSError:
            return


def test_slow_bodies_hold_no_ingest_slot_and_are_cut_at_the_request_deadline(srv):
    # more slow clients than ingest slots (2), from another node: honest n1 pushes still go through
    stop = threading.Event()
    slow = [_slow(srv, N2) for _ in range(2)] + [_slow(srv, N2, head_only=True)]
    for c in slow:
        threading.Thread(target=_drip, args=(c, stop), daemon=True).start()
    try:
        t0 = time.monotonic()
        for seq in range(3):
            r = push(srv, honest(seq))
            assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 1.0
        # a third request of n2 while two of its requests trickle: per-host limit
        r = push(srv, honest(0, "n2"), token=N2)
        assert r.status_code == 429 and r.headers["Retry-After"]
        # the deadline (1.5 s from each request's first byte) ends the slow ones, however they drip
        for c in slow:
            c.settimeout(5)
            data = b""
            try:
                while chunk := c.recv(4096):
                    data += chunk
            except OSError:
                pass
            assert time.monotonic() - t0 < 4.0
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:100]
    finally:
        stop.set()
        for c in slow:
            c.close()
    assert push(srv, honest(0, "n2"), token=N2).status_code == 200  # the slots came back
    assert stored(srv) == 4 * 80


@pytest.mark.parametrize("params,needle", [
    ({"host": "n1", "uuid": "G", "start": NOW - 10, "end": NOW, "step": "1e-300"}, None),  # clamped, not 500
    ({"host": "n1", "uuid": "G", "start": NOW - 10, "end": NOW, "step": "-1"}, "'step'"),
    ({"host": "n1", "uuid": "G", "start": NOW - 10, "end": NOW, "step": "1e308"}, "'step'"),
    ({"host": "n1", "uuid": "G", "start": "inf", "end": NOW}, "'start'"),
    ({"host": "n1", "uuid": "G", "start": "-1", "end": NOW}, "'start'"),
    ({"host": "n1", "uuid": "G", "start": NOW, "end": NOW - 10}, "before"),
    ({"host": "n1", "uuid": "G", "start": NOW - 10, "end": NOW, "stepp": "1"}, "unknown query parameter"),
    ({"host": "n1", "uuid": "G", "start": NOW - 10, "end": "1e300"}, "'end'"),
])
def test_absurd_series_queries_are_400_never_500_and_always_json(srv, params, needle):
    r = httpx.get(srv.url + "/api/v1/series", params=params, headers={"Authorization": "Bearer read-token-0123456789"})
    body = r.json()  # JSON in every case (never Infinity or NaN: the standard parser would still take those)
    assert "Infinity" not in r.text and "NaN" not in r.text
    if needle is None:
        assert r.status_code == 200 and isinstance(body, list)
    else:
        assert r.status_code == 400 and needle in body["error"], body


def test_series_answer_never_exceeds_the_point_limit_and_pages(srv):
    for seq in range(6):  # 6 x 10 s x 8 GPUs
        assert push(srv, honest(seq)).status_code == 200
    read = {"Authorization": "Bearer read-token-0123456789"}
    q = {"host": "n1", "uuid": "GPU-n1-0", "start": NOW - 600, "end": NOW - 540}
    assert len(httpx.get(srv.url + "/api/v1/series", params=q, headers=read).json()) == 60  # raw: 60 samples
    wide = {**q, "start": NOW - 600 - 86400 * 365}  # a year without step: buckets, at most 100 points
    pts = httpx.get(srv.url + "/api/v1/series", params=wide, headers=read).json()
    assert 0 < len(pts) <= 100 and sum(p["samples"] for p in pts) == 60
    fine = {**q, "step": "0.001"}  # a step too fine for the range: coarsened to (end - start) / 100
    pts = httpx.get(srv.url + "/api/v1/series", params=fine, headers=read).json()
    assert len(pts) <= 100 and all(p["step"] >= 0.6 for p in pts) and sum(p["samples"] for p in pts) == 60
    # usage pages: max_page 2
    r = httpx.get(srv.url + "/api/v1/usage", params={"per_gpu": "1"}, headers=read)
    assert len(r.json()) == 2 and r.headers["X-Total-Count"] == "8" and r.headers["X-Next-Offset"] == "2"
    rest = httpx.get(srv.url + "/api/v1/usage", params={"per_gpu": "1", "offset": "6"}, headers=read)
    assert len(rest.json()) == 2 and "X-Next-Offset" not in rest.headers
    for bad in ({"limit": "3"}, {"limit": "0"}, {"offset": "-1"}, {"per_gpu": "maybe"}, {"job": "7", "job2": "8"}):
        r = httpx.get(srv.url + "/api/v1/usage", params=bad, headers=read)
        assert r.status_code == 400 and "error" in r.json(), (bad, r.text)


def test_forged_dedupe_keys_cannot_drop_another_nodes_batch_and_a_reused_key_is_409(srv):
    # n2 sends first under n1's agent id and seq (its own host: the token allows nothing else)
    forged = msgpack.unpackb(honest(5, "n2"))
    forged["agent_id"] = "agent-n1"
    assert push(srv, msgpack.packb(forged), token=N2).status_code == 200
    r = push(srv, honest(5))  # n1's real batch with that agent id and seq: stored, not "duplicate"
    assert r.status_code == 200 and r.json()["duplicate"] is False and r.json()["accepted"] == 80
    again = push(srv, honest(5))  # a resend (same content): acknowledged as a duplicate
    assert again.status_code == 200 and again.json()["duplicate"] is True
    other = msgpack.unpackb(honest(5))
    other["series"][0]["gpu_index"] = 7  # same key, other content: refused, the first one stands
    r = push(srv, msgpack.packb(other))
    assert r.status_code == 409 and r.json()["reason"] == "conflict"
    assert stored(srv) == 160
    assert push(srv, honest(6)).status_code == 200 and stored(srv) == 240


def test_late_samples_are_refused_with_a_non_2xx_the_agent_records(srv, caplog):
    from gpuledger.agent.push import HttpPusher
    from gpuledger.agent.spool import Spool, SpoolingPusher

    assert push(srv, honest(0, start=NOW - 60)).status_code == 200
    # the node's clock stepped back 15 minutes: behind every GPU's 10-minute window
    r = push(srv, honest(1, start=NOW - 60 - 900))
    assert r.status_code == 422 and r.json()["reason"] == "too_late" and r.json()["too_late"] == 80
    # through the agent's own spool: recorded as refused (counted, one line), not as sent
    late = [GpuSample(ts=NOW - 2000 + k, host="n1", gpu_uuid="GPU-n1-0", gpu_index=0, sm_active_ratio=0.5)
            for k in range(5)]
    p = SpoolingPusher(HttpPusher(srv.url, "agent-n1", "n1", token=N1, seq_start=100), Spool(srv.store.path.parent /
                       "spool"), sleep=lambda s: None)
    p.write(late)
    assert p.send_pending() is True
    assert (p.rejected_batches, p.rejected_samples, p.sent_batches) == (1, 5, 0)
    assert any("refused batch 100 (5 samples) for good" in m.getMessage() for m in caplog.records)
    p.close()
    assert push(srv, honest(2, start=NOW - 40)).status_code == 200  # honest pushes go on
    assert stored(srv) == 160


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MB tmpfs (we are root in CI and here); elsewhere SQLite's own page limit gives the same SQLITE_FULL."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = mount_tmpfs(mnt, "3m")
    yield mnt, mounted
    if mounted:
        unmount(mnt)


def fill_disk(mnt, mounted: bool, store: Store):
    """Take every byte left on the tiny disk (or, where it could not be mounted, every page the ledger may add);
    returns the file that holds them (remove it to make room)."""
    if mounted:
        return fill(mnt)
    store._db.execute(f"PRAGMA max_page_count={store._db.execute('PRAGMA page_count').fetchone()[0]}")
    return mnt / "filler"


def test_disk_full_is_507_reads_go_on_and_ingest_recovers_without_restart(tiny_disk, caplog):
    mnt, mounted = tiny_disk
    store = Store(mnt / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW).start()
    try:
        assert push(s, honest(0)).status_code == 200
        filler = fill_disk(mnt, mounted, store)
        codes = [push(s, honest(seq)) for seq in range(1, 40)]
        full = [r for r in codes if r.status_code != 200]
        assert full, "the disk never filled"
        r = full[0]
        assert r.status_code == 507 and r.json()["reason"] == "disk_full" and int(r.headers["Retry-After"]) > 0
        assert any("disk full" in m.getMessage() for m in caplog.records)
        acked = 80 * (1 + sum(r.status_code == 200 for r in codes))
        # reads keep working, and everything acknowledged is there
        assert httpx.get(s.url + "/api/v1/totals").json()["samples"] == acked
        assert httpx.get(s.url + "/api/v1/usage").status_code == 200
        # room again: the same server takes the refused batches, nothing acknowledged was lost
        if mounted:
            filler.unlink()
        else:
            store._db.execute("PRAGMA max_page_count=1073741823")
        for seq, r in zip(range(1, 40), codes):
            if r.status_code != 200:
                assert push(s, honest(seq)).status_code == 200
        assert httpx.get(s.url + "/api/v1/totals").json()["samples"] == 80 * 40
    finally:
        s.stop()
        store.close()


def test_a_node_inventing_gpus_is_capped_and_its_real_gpus_go_on(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW, max_gpus_per_host=16)
    s = CollectorServer(store, clock=lambda: NOW, auth=Authenticator({"n1": N1})).start()
    try:
        assert push(s, honest(0)).status_code == 200  # its 8 real GPUs

        def invented(seq: int) -> bytes:
            doc = msgpack.unpackb(honest(seq))
            for i, series in enumerate(doc["series"]):
                series["gpu_uuid"] = f"GPU-fake-{seq}-{i}"
            return msgpack.packb(doc)

        assert push(s, invented(1)).status_code == 200  # 16: at the limit
        r = push(s, invented(2))
        assert r.status_code == 422 and r.json()["reason"] == "gpu_limit" and "limit of 16" in r.json()["error"]
        assert len(store.agg.gpus) == 16
        assert push(s, honest(3)).status_code == 200  # the GPUs it has go on
        assert stored(s) == 3 * 80
    finally:
        s.stop()
        store.close()


@pytest.mark.parametrize("query", ["/api/v1/jobs?limit=%C2%B2", "/api/v1/jobs?offset=%C2%B2",
                                   "/api/v1/usage?offset=%E2%91%A0", "/api/v1/usage?limit=%D9%A3"])
def test_paging_parameters_are_ascii_digits_and_any_other_digit_is_a_400_naming_it(srv, query):
    path, param = query.split("?")
    name = param.split("=")[0]
    read = {"Authorization": f"Bearer {READ}"}
    r = httpx.get(srv.url + query, headers=read)
    assert r.status_code == 400 and f"query parameter {name!r} must be a non-negative integer" in r.json()["error"]
    assert httpx.get(srv.url + path + "?limit=1&offset=0", headers=read).status_code == 200


def test_job_records_on_a_full_disk_are_507_like_samples_and_go_in_once_there_is_room(tiny_disk, monkeypatch):
    mnt, mounted = tiny_disk
    store = Store(mnt / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, auth=Authenticator({"n1": N1}, admin_tokens=[ADMIN])).start()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    jobs = [{"job_id": str(i), "user": "u" * 100} for i in range(200)]

    def post(records: list) -> httpx.Response:
        return httpx.post(s.url + "/api/v1/jobs", json=records, headers=admin, timeout=10)

    try:
        assert post([{"job_id": "x"}]).status_code == 200
        # the audit log's disk full first (it is written before the ledger), then the ledger's
        real = server_module.record_job_records

        def no_room(*_):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(server_module, "record_job_records", no_room)
        r = post(jobs)
        assert r.status_code == 507 and r.json()["reason"] == "disk_full" and int(r.headers["Retry-After"]) > 0
        monkeypatch.setattr(server_module, "record_job_records", real)
        filler = fill_disk(mnt, mounted, store)
        r = post(jobs)
        assert r.status_code == 507, r.text
        assert r.json()["reason"] == "disk_full" and "disk is full" in r.json()["error"]
        assert int(r.headers["Retry-After"]) > 0
        if mounted:
            filler.unlink()
        else:
            store._db.execute("PRAGMA max_page_count=1073741823")
        r = post(jobs)
        assert r.status_code == 200 and r.json()["received"] == 200
        assert httpx.get(s.url + "/api/v1/jobs?limit=1", headers=admin).headers["X-Total-Count"] == "201"
    finally:
        s.stop()
        store.close()


def _nul_cases() -> list:
    def series(key, value):
        return lambda d: d["series"][0].__setitem__(key, value)

    def top(key, value):
        return lambda d: d.__setitem__(key, value)

    def rows(d):
        d.pop("series")
        d["samples"] = [{"ts": NOW - 5, "host": "n1", "gpu_uuid": "GPU-n1\x00", "gpu_index": 0}]

    return [("agent_id", top("agent_id", "a\x00b"), "field 'agent_id'"),
            ("host", top("host", "n1\x00"), "field 'host'"),
            ("cluster", top("cluster", "c\x00"), "field 'cluster'"),
            ("gpu_uuid", series("gpu_uuid", "G\x00"), "series[0].gpu_uuid"),
            ("job_ids", series("job_ids", ["7\x00"]), "series[0].job_ids"),
            ("model", series("model", "H100\x00"), "series[0].model"),
            ("mig", series("mig", "\x00"), "series[0].mig"),
            ("job-record", top("jobs", [{"job_id": "7", "hosts": ["n1"], "user": "u\x00"}]), "job[0].user"),
            ("rows", rows, "sample[0].gpu_uuid")]


def _ledger_server(ledger, tmp_path, **kw) -> CollectorServer:
    store = Store(ledger, clock=lambda: NOW)
    audit = open_log(tmp_path, pseudonymize=False, ledger_url=ledger if isinstance(ledger, str) else None)
    return CollectorServer(store, clock=lambda: NOW, audit_log=audit, **kw,
                           auth=Authenticator({"n1": N1}, admin_tokens=[ADMIN], read_tokens=[READ])).start()


def test_nul_and_control_characters_are_400_naming_the_field_on_both_engines(ledger, tmp_path):
    s = _ledger_server(ledger, tmp_path)
    read, admin = {"Authorization": f"Bearer {READ}"}, {"Authorization": f"Bearer {ADMIN}"}
    try:
        seq = 0
        for name, mutate, needle in _nul_cases():
            for fmt in ("msgpack", "json"):
                seq += 1
                doc = msgpack.unpackb(honest(seq)) if fmt == "msgpack" else json.loads(honest(seq, fmt="json"))
                mutate(doc)
                body = msgpack.packb(doc) if fmt == "msgpack" else json.dumps(doc).encode()
                r = push(s, body, **{"Content-Type": f"application/{fmt}"})
                assert r.status_code == 400 and needle in r.json()["error"], (name, fmt, r.text)
                assert r.json()["reason"] == "invalid"
        assert push(s, honest(seq + 1)).status_code == 200  # the node's next batch goes in
        assert stored(s) == 80
        start, end = NOW - 700, NOW
        for query, name in (("/api/v1/usage?job=7%00", "job"),
                            (f"/api/v1/series?host=n1%00&uuid=GPU-n1-0&start={start}&end={end}", "host"),
                            (f"/api/v1/series?host=n1&uuid=GPU-n1-0%0A&start={start}&end={end}", "uuid"),
                            (f"/api/v1/series?host=n1&uuid=GPU-n1-0&start={start}&end={end}&mig=%00", "mig")):
            r = httpx.get(s.url + query, headers=read)
            assert r.status_code == 400 and f"query parameter {name!r} must not contain control characters" in (
                r.json()["error"]), (query, r.text)
        assert httpx.get(s.url + "/api/v1/usage?job=7", headers=read).json()[0]["samples"] == 80
        r = httpx.post(s.url + "/api/v1/jobs", json=[{"job_id": "9", "user": "u\x00"}], headers=admin)
        assert r.status_code == 400 and "job[0].user" in r.json()["error"]
        assert httpx.post(s.url + "/api/v1/jobs", json=[{"job_id": "9", "user": "u"}], headers=admin).status_code == 200
    finally:
        s.stop()
        s.store.close()


def test_a_value_the_ledger_cannot_hold_is_a_final_422_never_a_500_the_agent_resends(pg_url, tmp_path, monkeypatch):
    s = _ledger_server(pg_url, tmp_path)
    try:
        for rule in ("_BAD_TEXT", "_BAD_NAME"):  # a hole in validation: NUL gets through
            monkeypatch.setattr(validate, rule, re.compile("(?!)"))
        doc = msgpack.unpackb(honest(1))
        doc["series"][0]["model"] = "H100\x00"
        r = push(s, msgpack.packb(doc))
        assert r.status_code == 422 and r.json()["reason"] == "unstorable" and "NUL" in r.json()["error"], r.text
        r = httpx.post(s.url + "/api/v1/jobs", json=[{"job_id": "9\x00"}],
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 422 and r.json()["reason"] == "unstorable", r.text
        assert push(s, honest(2)).status_code == 200
        assert stored(s) == 80
    finally:
        s.stop()
        s.store.close()


def test_gzip_members_are_one_body_and_trailing_garbage_is_a_400(srv):
    body = honest(0)
    r = push(srv, gzip.compress(body[:100]) + gzip.compress(body[100:]), **{"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["accepted"] == 80, r.text
    r = push(srv, gzip.compress(honest(1)) + b"GARBAGE", **{"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "body is not valid gzip (Content-Encoding: gzip)" in r.json()["error"]
    r = push(srv, gzip.compress(honest(1))[:-8], **{"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "ends inside member 1" in r.json()["error"]
    assert push(srv, honest(1)).status_code == 200
    assert stored(srv) == 160


def test_a_batch_of_millions_of_processes_is_413_before_they_are_built_and_honest_pushes_go_on(srv):
    doc = {"agent_id": "a", "seq": 1, "host": "n1", "samples": [
        {"ts": NOW - 20_000 + i, "host": "n1", "gpu_uuid": "G", "gpu_index": 0, "processes": [[0, None]] * 250}
        for i in range(20_000)]}
    r = push(srv, msgpack.packb(doc))
    assert r.status_code == 413 and r.json()["reason"] == "too_large"
    assert "5000000 processes in one batch, more than the limit of 256000" in r.json()["error"]
    assert push(srv, honest(0)).status_code == 200
    assert stored(srv) == 80
