"""A batch refused for one of its job records says which (``"job"``: its index), whichever decoder refused it, so an
agent sends the same samples again without that record and keeps the others (real collector, real HTTP)."""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest

from gpuledger.collector.auth import Authenticator
from gpuledger.collector.config import load_settings
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample, JobRecord
from gpuledger.schema.wire import to_series

TOKEN = "tok-n1-aaaaaaaaaaaaaaaa"


@pytest.fixture
def srv(tmp_path):
    (tmp_path / "gpuledger.toml").write_text(f'[collector.tokens]\nn1 = {{ token = "{TOKEN}", cluster = "west" }}\n')
    store = Store(tmp_path / "c.sqlite")
    s = CollectorServer(store, auth=Authenticator(load_settings(tmp_path, env={}).tokens)).start()
    yield s
    s.stop()
    store.close()


def post(srv, form: str, jobs: list, samples: int = 2) -> httpx.Response:
    rows = [GpuSample(ts=time.time() - 100 + i * 0.01, host="n1", gpu_uuid="GPU-a", gpu_index=0, job_ids=("7",))
            for i in range(samples)]
    doc: dict = {"agent_id": "a1", "seq": 1, "host": "n1", "jobs": jobs}
    if form == "json rows":
        doc["samples"] = [r.to_dict() for r in rows]
    else:
        doc["series"] = to_series(rows, "n1", binary=form.startswith("msgpack"))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if form.startswith("msgpack"):
        return httpx.post(f"{srv.url}/api/v1/samples", content=msgpack.packb(doc),
                          headers={**headers, "Content-Type": "application/msgpack"})
    return httpx.post(f"{srv.url}/api/v1/samples", json=doc, headers=headers)


GOOD = JobRecord("7", user="ann", hosts=("n1",)).to_dict()
BAD = {
    "a control character": (400, {"job_id": "8", "account": "p\x01", "hosts": ["n1"]}),
    "a string over 256 characters": (413, {"job_id": "8", "account": "p" * 300, "hosts": ["n1"]}),
    "300 TRES": (413, {"job_id": "8", "tres": [[f"t{i}", 1.0] for i in range(300)], "hosts": ["n1"]}),
    "another cluster": (403, {"job_id": "8", "cluster": "east", "hosts": ["n1"]}),
    "another host": (403, {"job_id": "8", "hosts": ["n2"]}),
    "an unknown field": (400, {"job_id": "8", "colour": "red", "hosts": ["n1"]}),
    "no job id": (400, {"hosts": ["n1"]}),
}


@pytest.mark.parametrize("samples", [2, 3000], ids=["small body", "large body"])  # large: the typed decode words it
@pytest.mark.parametrize("form", ["json rows", "json series", "msgpack series"])
@pytest.mark.parametrize("bad", list(BAD))
def test_the_answer_names_the_refused_record_and_without_it_the_batch_is_taken(srv, form, bad, samples):
    status, record = BAD[bad]
    r = post(srv, form, [GOOD, record], samples)
    assert r.status_code == status, r.text
    assert r.json()["job"] == 1 and "job" in r.json()["error"]
    assert srv.store.totals()["samples"] == 0
    r = post(srv, form, [GOOD], samples)
    assert r.status_code == 200 and srv.store.totals()["samples"] == samples
    assert [j.user for j in srv.store.jobs()] == ["ann"]


@pytest.mark.parametrize("jobs", [{"job_id": "7"}, [GOOD] * 1025], ids=["not a list", "more records than one may"])
def test_a_refusal_of_the_records_list_names_no_record(srv, jobs):
    r = post(srv, "json rows", jobs)
    assert r.status_code in (400, 413) and "job" not in r.json()
