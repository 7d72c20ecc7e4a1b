"""The OpenAPI document against the routes the server answers, the priority feed, and bad-input fuzzing."""

from __future__ import annotations

import copy
import gzip
import json

import httpx
import jsonschema
import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate as validate_spec

from gpuledger.collector.openapi import openapi_document
from gpuledger.collector.server import ROUTES, CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample, JobRecord

NOW = 1_700_000_000.0


def batch(seq: int, n: int = 3, agent: str = "a1") -> dict:
    return {"agent_id": agent, "seq": seq, "host": "n1", "samples": [
        GpuSample(ts=NOW - 100 + 10 * i, host="n1", gpu_uuid="GPU-a", gpu_index=0, sm_active_ratio=0.5,
                  power_watts=300.0, energy_joules=1000.0 * i, job_ids=("7",)).to_dict() for i in range(n)]}


@pytest.fixture
def srv(tmp_path):
    store = Store(tmp_path / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, priority_feed=tmp_path / "priority-feed.json").start()
    with httpx.Client(base_url=s.url, timeout=10) as client:
        yield s, client, tmp_path / "priority-feed.json"
    s.stop()
    store.close()


def _validator(doc: dict, schema: dict) -> jsonschema.Draft202012Validator:
    # Resolve "#/components/..." against the whole document.
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_openapi_document_is_valid_and_describes_exactly_the_served_routes(srv):
    s, c, _ = srv
    doc = c.get("/api/v1/openapi.json").json()
    validate_spec(doc)  # OpenAPI 3.1 structure
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == set(ROUTES)
    for method, path in described:  # and the server answers each (not with its 404 / 405)
        r = c.request(method, path, content=b"{}" if method == "POST" else None,
                      headers={"Content-Type": "application/json"})
        assert r.status_code not in (404, 405) or "priority" in path, (method, path, r.text)
    assert c.get("/api/v1/undescribed").status_code == 404
    r = c.get("/api/v1/samples")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert c.put("/api/v1/jobs", content=b"[]").status_code == 405
    assert c.head("/healthz").status_code == 405


def test_responses_and_requests_match_the_document(srv):
    s, c, _ = srv
    doc = openapi_document()
    body = batch(1)
    req_schema = doc["paths"]["/api/v1/samples"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    _validator(doc, req_schema).validate(body)
    assert set(doc["components"]["schemas"]["GpuSample"]["properties"]) == set(SAMPLE_FIELDS)
    bad = copy.deepcopy(body)
    bad["samples"][0]["sm_active_ratio"] = 1.5
    assert not _validator(doc, req_schema).is_valid(bad)  # the document's bounds are the validator's
    r = c.post("/api/v1/samples", json=body)
    _validator(doc, doc["paths"]["/api/v1/samples"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
               ).validate(r.json())
    c.post("/api/v1/jobs", json=[JobRecord("7", cluster="c", user="ann", tres=(("gres/gpu", 1.0),)).to_dict()])
    for path in ("/api/v1/usage", "/api/v1/jobs", "/api/v1/totals", "/healthz"):
        schema = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        payload = c.get(path).json()
        _validator(doc, schema).validate(payload)
        assert payload not in ([], {}), path
    r = c.post("/api/v1/samples", content=b"nope", headers={"Content-Type": "application/json"})
    _validator(doc, {"$ref": "#/components/schemas/Error"}).validate(r.json())


def test_priority_feed_endpoint_and_gauges_follow_the_file(srv):
    s, c, feed = srv
    r = c.get("/api/v1/priority")
    assert r.status_code == 404 and "gpuledger priority feed" in r.json()["error"]
    assert "gpuledger_fairshare_ratio" not in c.get("/metrics").text
    doc = {"generated_at": NOW, "priority_weight": 10000, "associations": [
        {"account": "physics", "user": "ann", "fairshare": 0.75, "site_factor": 7500, "raw_usage": 1.0},
        {"account": "bio", "user": "bob", "fairshare": 0.25, "site_factor": 2500, "raw_usage": 3.0},
        {"account": "bio", "user": None, "fairshare": 0.3, "site_factor": 3000, "raw_usage": 3.0}]}
    feed.write_text(json.dumps(doc))
    assert c.get("/api/v1/priority").json() == doc
    m = c.get("/metrics").text
    # /metrics is open: by default no user names, only the accounts' own rows
    assert "ann" not in m and "bob" not in m and 'gpuledger_fairshare_ratio{account="bio"} 0.3' in m
    assert 'gpuledger_site_factor{account="bio"} 3000.0' in m
    assert "gpuledger_priority_feed_generated_timestamp_seconds 1.7e+09" in m
    doc["associations"][2]["fairshare"] = 0.5  # a new feed: the next scrape follows it
    feed.write_text(json.dumps(doc))
    assert 'gpuledger_fairshare_ratio{account="bio"} 0.5' in c.get("/metrics").text
    feed.write_text("{half")
    r = c.get("/api/v1/priority")
    assert r.status_code == 503 and "unreadable" in r.json()["error"]
    assert "gpuledger_fairshare_ratio{" not in c.get("/metrics").text


def test_metrics_user_labels_option_publishes_user_names(tmp_path):
    feed = tmp_path / "feed.json"
    feed.write_text(json.dumps({"generated_at": NOW, "associations": [
        {"account": "physics", "user": "ann", "fairshare": 0.75, "site_factor": 7500}]}))
    store = Store(tmp_path / "s.db", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, priority_feed=feed, metrics_user_labels=True).start()
    try:
        assert 'gpuledger_fairshare_ratio{account="physics",user="ann"} 0.75' in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
        store.close()


def test_the_metrics_port_answers_while_the_event_loop_is_saturated(tmp_path):
    """``metrics_port``: /metrics on a listener of its own threads, answered while the loop is busy (here: held for
    3 s, as a burst of new hosts' group commits holds it), where the main port's /metrics waits for the loop."""
    import socket
    import threading
    import time

    from gpuledger.collector.server import MAX_SCRAPES

    store = Store(tmp_path / "s.db", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, metrics_port=0).start()
    try:
        assert s.metrics_url is not None and s.metrics_url.startswith("http://127.0.0.1:")
        for url in (s.url + "/metrics", s.metrics_url):  # the loop is free: both answer
            assert "gpuledger_collector_batches_accepted_total" in httpx.get(url).text
        held = threading.Event()
        s._loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(3.0)))  # the loop busy for 3 s
        assert held.wait(5)
        t0 = time.monotonic()
        r = httpx.get(s.metrics_url, timeout=10)
        assert r.status_code == 200 and "gpuledger_collector_batches_accepted_total" in r.text
        assert r.headers["Content-Type"].startswith("text/plain")
        assert time.monotonic() - t0 < 2.0  # answered while the loop is held (it is for 3 s)
        main = httpx.get(s.url + "/metrics", timeout=10)  # the main port's waits for the loop
        assert main.status_code == 200 and time.monotonic() - t0 >= 2.5
        other = httpx.get(s.metrics_url.removesuffix("/metrics") + "/api/v1/usage")
        assert other.status_code == 404 and "only GET /metrics" in other.json()["error"]
        # connections that send nothing hold at most MAX_SCRAPES threads; a scrape after them is still answered
        # once they are closed, and the listener never grows past its bound meanwhile
        host, port = s.metrics_url.removeprefix("http://").removesuffix("/metrics").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(MAX_SCRAPES + 4)]
        time.sleep(0.5)
        assert sum(t.name.startswith("Thread-") and "process_request_thread" in repr(t._target)
                   for t in threading.enumerate()) <= MAX_SCRAPES
        for c in idle:
            c.close()
        time.sleep(0.5)
        assert httpx.get(s.metrics_url, timeout=10).status_code == 200
    finally:
        s.stop()
        store.close()


@pytest.mark.parametrize("mutate,status,needle", [
    (lambda b: b.update(seq=2**64 - 1), 400, "'seq'"),
    (lambda b: b["samples"][1].update(mem_used_bytes=2**64 - 1), 400, "sample[1].mem_used_bytes"),
    (lambda b: b["samples"][2].update(power_watts=1e300), 400, "sample[2].power_watts"),
    (lambda b: b["samples"][0].update(energy_joules=-1.0), 400, "sample[0].energy_joules"),
    (lambda b: b["samples"][0].update(ts=NOW + 3600), 400, "sample[0].ts"),
    (lambda b: b["samples"][1].update(gpu_index="0"), 400, "sample[1].gpu_index"),
    (lambda b: b["samples"][1].update(sm_active_ratio=float("nan")), 400, "sample[1].sm_active_ratio"),
])
def test_bad_values_are_4xx_naming_batch_sample_field_and_store_nothing(srv, mutate, status, needle):
    s, c, _ = srv
    b = batch(5)
    mutate(b)
    for body, ctype in ((json.dumps(b).encode(), "application/json"), (msgpack.packb(b), "application/msgpack")):
        r = c.post("/api/v1/samples", content=body, headers={"Content-Type": ctype})
        assert r.status_code == status and needle in r.json()["error"], r.text
        assert "agent_id='a1'" in r.json()["error"]
    assert c.get("/api/v1/totals").json()["samples"] == 0


def test_self_metrics_count_by_reason(srv):
    s, c, _ = srv
    b = batch(1)
    b["samples"][0]["ts"] = NOW + 3600
    c.post("/api/v1/samples", json=b)
    c.post("/api/v1/samples", content=b"{", headers={"Content-Type": "application/json"})
    c.post("/api/v1/samples", json=batch(2))
    c.post("/api/v1/samples", json=batch(2))
    m = c.get("/metrics").text
    assert 'gpuledger_collector_samples_rejected_total{reason="future"} 3.0' in m
    assert 'gpuledger_collector_batches_rejected_total{reason="malformed",status="400"} 1.0' in m
    assert "gpuledger_collector_batches_accepted_total 1.0" in m
    assert "gpuledger_collector_batches_deduplicated_total 1.0" in m
    assert "gpuledger_collector_requests_in_flight 1.0" in m  # this scrape itself
    assert "gpuledger_collector_ingest_queue_depth 0.0" in m


# -- fuzzing: bodies near a valid batch, in every encoding; never a 5xx, nothing of a rejected batch stored --
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                    st.lists(st.integers(), max_size=3), st.just([[1, None]]), st.just({}))


@st.composite
def mutated_bodies(draw):
    b = batch(draw(st.integers(min_value=0, max_value=10**6)), n=draw(st.integers(min_value=1, max_value=3)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        where = draw(st.sampled_from(["top", "sample", "drop", "extra"]))
        if where == "top":
            b[draw(st.sampled_from(["agent_id", "seq", "host", "samples"]))] = draw(_VALUES)
        elif where == "sample" and isinstance(b.get("samples"), list) and b["samples"]:
            s = b["samples"][draw(st.integers(0, len(b["samples"]) - 1))]
            if isinstance(s, dict):
                s[draw(st.sampled_from(SAMPLE_FIELDS))] = draw(_VALUES)
        elif where == "drop" and isinstance(b.get("samples"), list) and b["samples"]:
            s = b["samples"][0]
            if isinstance(s, dict):
                s.pop(draw(st.sampled_from(["ts", "host", "gpu_uuid", "gpu_index"])), None)
        else:
            b[draw(st.text(min_size=1, max_size=4))] = 1
    fmt = draw(st.sampled_from(["json", "msgpack"]))
    try:
        raw = json.dumps(b).encode() if fmt == "json" else msgpack.packb(b)
    except OverflowError:  # msgpack has no integers beyond 64 bits; JSON does
        fmt, raw = "json", json.dumps(b).encode()
    if draw(st.booleans()):  # truncate or corrupt
        cut = draw(st.integers(0, len(raw)))
        raw = raw[:cut] + draw(st.binary(max_size=8))
    enc = draw(st.sampled_from(["", "gzip", "zstd", "br"]))
    if enc == "gzip":
        raw = gzip.compress(raw)
    elif enc == "zstd":
        raw = zstandard.ZstdCompressor().compress(raw)
    ctype = {"json": "application/json", "msgpack": "application/msgpack"}[fmt]
    return raw, ctype, enc


@pytest.fixture(scope="module")
def fuzz_srv(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("fuzz") / "c.sqlite", clock=lambda: NOW)
    s = CollectorServer(store, clock=lambda: NOW, max_body_bytes=64 * 1024).start()
    with httpx.Client(base_url=s.url, timeout=10) as client:
        yield s, client
    s.stop()
    store.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutated_bodies())
def test_fuzzed_batches_never_5xx_and_rejected_ones_store_nothing(fuzz_srv, case):
    s, c = fuzz_srv
    raw, ctype, enc = case
    before = c.get("/api/v1/totals").json()["samples"]
    r = c.post("/api/v1/samples", content=raw, headers={"Content-Type": ctype, "Content-Encoding": enc})
    assert r.status_code < 500, r.text
    after = c.get("/api/v1/totals").json()["samples"]
    if r.status_code == 200:
        assert after - before == r.json()["accepted"]
    else:
        assert 400 <= r.status_code < 500 and r.json()["error"]
        assert after == before
