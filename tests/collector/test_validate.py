"""Batch parsing: every rejection names the batch, the sample index and the field."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from dataclasses import replace

import msgpack
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.collector import validate
from gpuledger.collector.validate import DEFAULT_LIMITS, BatchError, parse_batch, parse_jobs
from gpuledger.schema.records import GpuProcess, GpuSample

NOW = 1_700_000_000.0


def sample(**kw) -> dict:
    s = GpuSample(ts=NOW - 10, host="n1", gpu_uuid="GPU-1", gpu_index=0, sm_active_ratio=0.5, power_watts=300.0,
                  energy_joules=1e6, job_ids=("42",), processes=(GpuProcess(7, 100),)).to_dict()
    s.update(kw)
    return s


def body(samples=None, **top) -> bytes:
    doc = {"agent_id": "a1", "seq": 3, "host": "n1", "samples": [sample()] if samples is None else samples}
    doc.update(top)
    return json.dumps(doc).encode()


def reject(b: bytes, *needles: str, status: int = 400, ctype: str = "application/json", **kw) -> BatchError:
    with pytest.raises(BatchError) as ei:
        parse_batch(b, ctype, NOW, **kw)
    assert ei.value.status == status
    for n in needles:
        assert n in ei.value.message, ei.value.message
    return ei.value


def test_valid_batch_round_trips():
    s = GpuSample.from_dict(sample())
    b = parse_batch(body(), "application/json; charset=utf-8", NOW)
    assert (b.agent_id, b.seq, b.host) == ("a1", 3, "n1")
    assert b.samples == (s,)


def test_msgpack_gzip_and_zstd_bodies():
    doc = json.loads(body())
    packed = msgpack.packb(doc)
    assert parse_batch(packed, "application/msgpack", NOW).samples[0].gpu_uuid == "GPU-1"
    assert parse_batch(gzip.compress(body()), "application/json", NOW, content_encoding="gzip").seq == 3
    z = zstandard.ZstdCompressor().compress(body())
    assert parse_batch(z, "application/json", NOW, content_encoding="zstd").seq == 3


@pytest.mark.parametrize("field,value,needle", [
    ("sm_active_ratio", 1.5, "sm_active_ratio"),
    ("dram_bw_ratio", -0.1, "dram_bw_ratio"),
    ("power_watts", -1.0, "power_watts"),
    ("energy_joules", -5.0, "energy_joules"),
    ("sm_active_ratio", "0.5", "sm_active_ratio"),
    ("gpu_index", 1.5, "gpu_index"),
    ("gpu_index", True, "gpu_index"),
    ("mem_used_bytes", -1, "mem_used_bytes"),
    ("ts", NOW + 301, "ts"),
    ("ts", "yesterday", "ts"),
    ("host", "n2", "host"),
    ("gpu_uuid", "", "gpu_uuid"),
    ("job_ids", ["1", 2], "job_ids"),
    ("job_ids", None, "job_ids"),
    ("job_shares", [0.5, 0.5], "job_shares"),  # one job, two shares
    ("processes", [[1]], "processes"),
    ("processes", [[1, 5, 1.5]], "processes"),  # the share of the interval a process ran: 0..1
    ("processes", [[1, 5, -0.5]], "processes"),
    ("processes", [[1, 5, 0.5, 0]], "processes"),
    ("processes", [[2**63, 5]], "processes"),  # a pid over the largest integer a record holds
    ("temp_celsius", "hot", "temp_celsius"),
    ("mig", 3, "mig"),
])
def test_bad_field_is_named_with_batch_and_index(field, value, needle):
    b = body([sample(), sample(**{field: value})])
    reject(b, "agent_id='a1'", "seq=3", f"sample[1].{needle}")


@pytest.mark.parametrize("ctype", ["application/json", "application/msgpack"])
def test_a_process_row_takes_the_time_it_ran_third(ctype):
    rows = [sample(processes=[[7, 100, 0.25], [8, None], [9, 3, None], [10, 0, 1]])]
    raw = body(rows) if ctype == "application/json" else msgpack.packb(json.loads(body(rows)))
    (s,) = parse_batch(raw, ctype, NOW).samples
    assert s.processes == (GpuProcess(7, 100, 0.25), GpuProcess(8, None), GpuProcess(9, 3), GpuProcess(10, 0, 1.0))
    assert type(s.processes[0]) is GpuProcess and type(s.processes[3].gpu_util_ratio) is float


def test_shares_must_sum_to_one():
    reject(body([sample(job_ids=["1", "2"], job_shares=[0.5, 0.6])]), "sample[0].job_shares", "sum")


def test_nan_and_infinity_are_rejected():
    raw = body().replace(b'"sm_active_ratio": 0.5', b'"sm_active_ratio": NaN')
    reject(raw, "sample[0].sm_active_ratio")
    raw = body().replace(b'"power_watts": 300.0', b'"power_watts": Infinity')
    reject(raw, "sample[0].power_watts")
    packed = msgpack.packb({**json.loads(body()), "samples": [sample(power_watts=float("nan"))]})
    reject(packed, "sample[0].power_watts", ctype="application/msgpack")


def test_unknown_and_missing_fields():
    reject(body([sample(gpu_temperature=50)]), "sample[0]", "gpu_temperature")
    s = sample()
    del s["gpu_uuid"]
    reject(body([s]), "sample[0].gpu_uuid", "missing")
    reject(body(extra=1), "unknown field", "extra")


def test_batch_envelope_errors():
    reject(b"{not json", "malformed JSON")
    reject(b"[]", "batch must be an object")
    reject(body(seq=-1), "'seq'")
    reject(body(seq="3"), "'seq'")
    reject(body(agent_id=""), "'agent_id'")
    reject(body(samples={}), "'samples'")
    reject(body([5]), "sample[0]", "must be an object")


def test_size_encoding_and_type_limits():
    reject(body(), "exceeds", status=413, max_bytes=10)
    bomb = gzip.compress(b"[" + b" " * 10_000_000 + b"]")
    reject(bomb, "exceeds", status=413, max_bytes=1_000_000, content_encoding="gzip")
    reject(zstandard.ZstdCompressor().compress(b" " * 2_000_000), "exceeds", status=413, max_bytes=1_000_000,
           content_encoding="zstd")
    reject(b"garbage", "gzip", content_encoding="gzip")
    reject(body(), "Content-Encoding", status=415, content_encoding="br")
    reject(body(), "Content-Type", status=415, ctype="text/plain")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_never_escapes_as_another_exception(b):
    for ctype in ("application/json", "application/msgpack"):
        try:
            parse_batch(b, ctype, NOW)
        except BatchError as e:
            assert 400 <= e.status < 500


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=4), max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(sample().keys()) + ["bogus"]), _json, max_size=8))
def test_mutated_samples_are_accepted_or_rejected_cleanly(overrides):
    try:
        b = parse_batch(body([sample(**overrides)]), "application/json", NOW)
    except BatchError as e:
        assert e.status == 400 and "sample[0]" in e.message
    else:
        s = b.samples[0]
        assert s.host == "n1" and (s.sm_active_ratio is None or 0 <= s.sm_active_ratio <= 1)


def test_parse_jobs():
    recs = parse_jobs(json.dumps([{"job_id": "1", "user": "ann", "hosts": ["n1"], "tres": [["gres/gpu", 2]]}]).encode(),
                      "application/json")
    assert recs[0].job_id == "1" and recs[0].tres == (("gres/gpu", 2.0),)
    for bad, needle in [([{"user": "x"}], "job[0].job_id"), ([{"job_id": "1", "uid": "x"}], "job[0].uid"),
                        ([{"job_id": "1", "nope": 1}], "nope"), ({"job_id": "1"}, "list")]:
        with pytest.raises(BatchError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_jobs(json.dumps(bad).encode(), "application/json")


def test_every_record_field_has_a_validation_rule():
    # A field added to the records later must be checked, never waved through.
    from dataclasses import fields

    from gpuledger.collector.validate import _HANDLED, _SAMPLE_TYPES, _check_annotation
    from gpuledger.schema.records import JobRecord

    for name, ann in _SAMPLE_TYPES.items():
        if name not in _HANDLED:
            _check_annotation(ann, None)  # raises TypeError for an unknown shape
    for f in fields(JobRecord):
        _check_annotation(str(f.type), None)
    with pytest.raises(TypeError):
        _check_annotation("dict[str, int]", {})


# -- the msgpack fast path decides exactly as the per-sample path ---------------------------------

_ODD = st.sampled_from([None, True, False, 0, 1, -1, 2, 0.0, -0.0, 0.5, 1.5, -0.5, 1e18, 2e18,
                        2**63 - 1, 2**63, 2**64 - 1, -2**63, float("nan"), float("inf"), "", "x", [], ["1"],
                        ["1", "1"], [""], [1, None], [[1, None]], [[1]], [[-1, 2]], [0.5, 0.5], [1.0], [2**63],
                        "\x00", "n1\x00", "a\tb", "\x7f", ["4\x002"], ["4\n"]])


@st.composite
def wire_batches(draw) -> dict:
    samples = []
    for i in range(draw(st.integers(0, 4))):
        s = sample(ts=NOW - 10 - i, gpu_uuid=draw(st.sampled_from(["GPU-1", "GPU-2"])), processes=[[7, 100]])
        s["job_ids"], s["job_shares"] = draw(st.sampled_from([
            (["42"], []), (["42"], [1.0]), (["1", "2"], []), (["1", "2"], [0.25, 0.75]), ([], []), (["1"], [0.5])]))
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # a few odd values, drawn anywhere
            key = draw(st.sampled_from(list(s) + ["bogus"]))
            s[key] = draw(_ODD)
        if draw(st.integers(0, 8)) == 0:
            s.pop(draw(st.sampled_from(["ts", "host", "gpu_uuid", "gpu_index"])))
        samples.append(s)
    doc = {"agent_id": "a1", "seq": 3, "host": "n1", "samples": samples}
    if draw(st.integers(0, 6)) == 0:
        doc[draw(st.sampled_from(["agent_id", "seq", "host"]))] = draw(_ODD)
    return doc


def _outcome(body: bytes, **kw):
    try:
        return parse_batch(body, "application/msgpack", NOW, **kw).samples
    except BatchError as e:
        return (e.status, e.reason, e.message, e.samples)


@pytest.mark.skipif(validate._FAST is None, reason="msgspec not installed")
@settings(max_examples=400, deadline=None)
@given(wire_batches(), st.sampled_from([None, "n1", "n2"]))
def test_fast_path_decides_as_the_per_sample_path(doc, allowed):
    body = msgpack.packb(doc)
    fast = _outcome(body, allowed_host=allowed)
    saved, validate._FAST = validate._FAST, None
    try:
        slow = _outcome(body, allowed_host=allowed)
    finally:
        validate._FAST = saved
    assert fast == slow


# -- review fixes: strings, gzip members, row lists over the batch, a foreign host's batch ----------------

def _both_paths(b: bytes, ctype: str = "application/msgpack", **kw) -> tuple:
    """What the fast and the forced per-sample path decide (as _outcome), asserted alike."""
    def outcome():
        try:
            return parse_batch(b, ctype, NOW, **kw).samples
        except BatchError as e:
            return (e.status, e.reason, e.message)
    fast = outcome()
    saved, validate._FAST = validate._FAST, None
    try:
        slow = outcome()
    finally:
        validate._FAST = saved
    assert fast == slow
    return fast


@pytest.mark.parametrize("key,value,needle", [
    ("agent_id", "a1\x00", "field 'agent_id' must be a non-empty string without control characters"),
    ("host", "n1\x00", "field 'host' must be a non-empty string without control characters"),
    ("cluster", "c\n", "field 'cluster' must be a string of at most 256 characters without control characters"),
    ("gpu_uuid", "GPU-1\x00", "sample[0].gpu_uuid: must be a non-empty string without control characters"),
    ("mig", "1g\x1b[0m", "sample[0].mig: must be a non-empty string without control characters"),
    ("job_ids", ["4\x002"], "sample[0].job_ids: must be a list of distinct non-empty strings without control"),
    ("model", "H100\x00", "sample[0].model: must be a string without NUL characters"),
    ("source", "\x00", "sample[0].source: must be a string without NUL characters"),
    ("jobs", [{"job_id": "42\x00", "hosts": ["n1"]}], "job[0].job_id: expected str without control characters"),
])
def test_nul_and_control_characters_are_refused_naming_the_field_on_both_paths(key, value, needle):
    doc = json.loads(body())
    if key in ("agent_id", "host", "cluster", "jobs"):
        doc[key] = value
    else:
        doc["samples"][0][key] = value
    for b, ctype in ((msgpack.packb(doc), "application/msgpack"), (json.dumps(doc).encode(), "application/json")):
        status, reason, message = _both_paths(b, ctype)
        assert (status, reason) == (400, "invalid") and needle in message, message
    # free text keeps a tab (only NUL is refused there), a name any printable character
    doc = json.loads(body([sample(model="NVIDIA\tH100 \u00e9", job_ids=["t\u00e2che-1"], job_shares=[1.0])]))
    assert _both_paths(msgpack.packb(doc))[0].model == "NVIDIA\tH100 \u00e9"


@pytest.mark.parametrize("record,needle", [
    ({"job_id": "9", "user": "u\ud800"}, "job[0].user: expected str | None without control characters or unpaired"),
    ({"job_id": "9\udc00"}, "job[0].job_id: expected str without control characters or unpaired surrogates"),
    ({"job_id": "9", "account": "a\x00"}, "job[0].account"),
    ({"job_id": "9", "hosts": ["n1", "n2\r\n"]}, "job[0].hosts"),
    ({"job_id": "9", "tres": [["gres/gpu\x00", 1]]}, "job[0].tres"),
    ({"job_id": "9", "state": "DONE\x00"}, "job[0].state: expected str | None without NUL characters or unpaired"),
    ({"job_id": "9", "gpu_model": "H\ud800"}, "job[0].gpu_model"),
])
def test_job_records_with_a_lone_surrogate_or_a_control_character_are_refused_naming_the_field(record, needle):
    doc = json.dumps([{"job_id": "8"}, record]).encode()  # ensure_ascii: a surrogate travels as its \ud800 escape
    with pytest.raises(BatchError) as e:
        parse_jobs(doc, "application/json")
    assert e.value.status == 400 and needle.replace("job[0]", "job[1]") in e.value.message, e.value.message
    assert parse_jobs(json.dumps([{"job_id": "8", "state": "CANCELLED\tby 0", "user": "\u00e9ve"}]).encode(),
                      "application/json")[0].user == "\u00e9ve"


def test_every_member_of_a_gzip_body_is_read_and_anything_else_after_them_is_refused():
    b = body()
    two = gzip.compress(b[:40]) + gzip.compress(b[40:])
    assert gzip.decompress(two) == b
    assert parse_batch(two, "application/json", NOW, content_encoding="gzip").samples == parse_batch(
        b, "application/json", NOW).samples
    enc = {"content_encoding": "gzip"}
    reject(gzip.compress(b) + b"GARBAGE", "body is not valid gzip (Content-Encoding: gzip)",
           "7 bytes after member 1 are not another member", **enc)
    reject(gzip.compress(b)[:-4], "body is not valid gzip (Content-Encoding: gzip): it ends inside member 1", **enc)
    reject(two[:-1], "it ends inside member 2", **enc)
    reject(b"", "it ends inside member 1", **enc)
    # the inflated limit holds over all members together, checked while inflating
    half = gzip.compress(b" " * 600_000)
    reject(gzip.compress(b"[") + half + half + gzip.compress(b"]"), "exceeds the limit of 1000000", status=413,
           max_bytes=1_000_000, **enc)
    # zstd's frames likewise (RFC 8878 3.1)
    z = zstandard.ZstdCompressor()
    two = z.compress(b[:40]) + z.compress(b[40:])
    assert parse_batch(two, "application/json", NOW, content_encoding="zstd").seq == 3
    # a frame cut short is named as such (the stream reader alone ends quietly, and the JSON was called malformed)
    zenc = {"content_encoding": "zstd"}
    reject(z.compress(b)[:-3], "body is not valid zstd (Content-Encoding: zstd): it ends inside frame 1", **zenc)
    reject(two[:-2], "it ends inside frame 2", **zenc)
    reject(b"", "it ends inside frame 1", **zenc)
    reject(z.compress(b) + b"GARBAGE", "body is not valid zstd", **zenc)


def _many(n: int, fmt: str = "msgpack", **fields) -> bytes:
    doc = {"agent_id": "a1", "seq": 3, "host": "n1", "samples": [
        {"ts": NOW - 20_000 + i, "host": "n1", "gpu_uuid": "G", "gpu_index": 0, **fields} for i in range(n)]}
    return msgpack.packb(doc) if fmt == "msgpack" else json.dumps(doc).encode()


def test_processes_over_the_batch_limit_are_refused_before_they_are_built():
    # 20,000 samples of 250 processes: 15 MiB of msgpack, within every other limit, ~500 MiB once built
    big = _many(20_000, processes=[[0, None]] * 250)
    assert len(big) < validate.MAX_BODY_BYTES
    tracemalloc.start()
    try:
        e = reject(big, "batch agent_id='a1' seq=3: 5000000 processes in one batch, more than the limit of 256000",
                   status=413, ctype="application/msgpack")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (e.reason, e.samples) == ("too_large", 20_000) and peak < 32 * 2**20, peak
    # Xid errors (a 1-byte integer becomes an object of 28), JSON bodies and the columnar layout alike
    reject(_many(1001, xid_errors=[-10] * 256), "256256 Xid errors in one batch, more than the limit of 256000",
           status=413, ctype="application/msgpack")
    reject(_many(1001, "json", processes=[[1, 2]] * 256), "256256 processes in one batch", status=413)
    series = {"agent_id": "a1", "seq": 3, "host": "n1", "series": [
        {"gpu_uuid": "G", "gpu_index": 0, "ts": [NOW - 2000 + i for i in range(1001)],
         "processes": [[[i, None] for i in range(256)]] * 1001}]}
    reject(msgpack.packb(series), "256256 processes in one batch", status=413, ctype="application/msgpack")
    # at the limit: accepted, exactly as decoded in one pass (a body too short to exceed the limit is)
    at = _many(1000, processes=[[7, 2**40]] * 255 + [[8, None]], xid_errors=[79] * 256)
    one_pass = replace(DEFAULT_LIMITS, max_batch_list=len(at))
    got = parse_batch(at, "application/msgpack", NOW).samples
    assert got == parse_batch(at, "application/msgpack", NOW, limits=one_pass).samples
    assert sum(len(s.processes) for s in got) == 256_000 and got[0].processes[-1] == GpuProcess(8, None)
    series["series"][0]["processes"] = series["series"][0]["processes"][:1000]
    series["series"][0]["ts"] = series["series"][0]["ts"][:1000]
    assert parse_batch(msgpack.packb(series), "application/msgpack", NOW).n_samples == 1000


def _jobs_body(records: list[dict], fmt: str) -> bytes:
    doc = {"agent_id": "a1", "seq": 3, "host": "n1", "samples": [sample(job_ids=["42"])], "jobs": records}
    return msgpack.packb(doc) if fmt == "msgpack" else json.dumps(doc).encode()


def _job(job_id: str, hosts: int) -> dict:
    return {"job_id": job_id, "user": "u", "account": "a", "hosts": ["n1", *(f"node{k:05d}" for k in range(1, hosts))]}


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_a_large_jobs_record_is_taken_whole(fmt):
    # a job of 300 nodes: every agent's batch carrying its record was refused (413, its hosts over the 256 each list of
    # a record may hold), and each resend halved it to one GPU's instant refused for good
    ctype = f"application/{fmt}"
    b = _jobs_body([_job("42", 300)], fmt)
    guarded = replace(DEFAULT_LIMITS, max_batch_list=300)  # the body is longer: its hosts are counted first
    for limits in (DEFAULT_LIMITS, guarded):
        (rec,) = parse_batch(b, ctype, NOW, limits=limits).jobs
        assert rec.hosts[0] == "n1" and len(rec.hosts) == 300 and rec.hosts[-1] == "node00299"
    # one record past its own bound; records whose hosts together pass the batch's, counted before they are built
    over = replace(DEFAULT_LIMITS, max_job_hosts=299)
    for limits in (over, replace(over, max_batch_list=300)):
        e = reject(b, "jobs[0].hosts", "299", status=413, ctype=ctype, limits=limits)
        assert e.reason == "too_large"
    big = _jobs_body([_job(str(j), 300) for j in range(1000)], fmt)  # 300,000 hosts, ~15 MiB once built
    tracemalloc.start()
    try:
        e = reject(big, "batch agent_id='a1' seq=3: 300000 job hosts in one batch, more than the limit of 256000",
                   status=413, ctype=ctype)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.reason == "too_large" and peak < 12 * 2**20, peak
    # a bad host inside a counted list is worded as in one pass
    bad = _job("42", 300)
    bad["hosts"][7] = 5
    b = _jobs_body([bad], fmt)
    assert reject(b, "job[0].hosts", ctype=ctype, limits=guarded).message == reject(b, ctype=ctype).message


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_row_lists_decoded_after_their_count_are_worded_as_in_one_pass(fmt):
    ctype = "application/msgpack" if fmt == "msgpack" else "application/json"
    small = replace(DEFAULT_LIMITS, max_batch_list=100)  # every body here is longer: counted first
    for procs in ([[7, 100]], [[-1, 5]], [[7]], "x", None):
        b = body([sample(), sample(processes=procs)])
        b = msgpack.packb(json.loads(b)) if fmt == "msgpack" else b
        assert _both_paths(b, ctype) == _both_paths(b, ctype, limits=small)
    # a body too large to be worded by the per-sample path: the typed decode's words, at the same place
    big = json.loads(_many(3000, "json"))
    big["samples"][2500]["processes"] = [[1, 2], [3, "x"]]
    b = msgpack.packb(big) if fmt == "msgpack" else json.dumps(big).encode()
    one = reject(b, "sample[2500].processes[1][1]", ctype=ctype)
    assert reject(b, ctype=ctype, limits=small).message == one.message


def test_a_batch_of_another_host_is_refused_without_decoding_it_twice(monkeypatch):
    big = _many(20_000, processes=[[1, None]] * 12)

    def never(*_):
        raise AssertionError("decoded a second time")

    monkeypatch.setattr(validate, "_parse_doc", never)
    e = reject(big, "field 'host' is 'n1' but the token is bound to host 'n2'", status=403,
               ctype="application/msgpack", allowed_host="n2")
    assert (e.reason, e.samples) == ("forbidden", 20_000)
