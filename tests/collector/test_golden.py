"""Golden cases: input batches (one JSON batch a line) through real HTTP -> expected job usage.

Each ``golden/<case>/expected.json`` was computed by hand (its ``_why`` shows the arithmetic); a record
listed there must exist with the listed fields, and no other (job, host, GPU) may appear.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected.json").exists())


def _check(actual: dict, expected: dict, where: str) -> None:
    for f, v in expected.items():
        if isinstance(v, float):
            assert actual[f] == pytest.approx(v, rel=1e-9, abs=1e-9), f"{where}.{f}"
        else:
            assert actual[f] == v, f"{where}.{f}"


def _match(actual: list[dict], expected: list[dict], what: str) -> None:
    key = lambda d: (d["job_id"], d.get("host"), d.get("gpu_uuid"))  # noqa: E731
    assert sorted(d["job_id"] for d in actual) == sorted(d["job_id"] for d in expected), what
    by_job = {}
    for d in actual:
        by_job.setdefault(d["job_id"], []).append(d)
    for e in expected:
        cands = [a for a in by_job[e["job_id"]] if all(a[k] == e[k] for k in ("host", "gpu_uuid") if k in e)]
        assert len(cands) == 1, f"{what}: no unique record for {key(e)}"
        _check(cands[0], e, f"{what}[{key(e)}]")


@pytest.mark.parametrize("case", CASES)
def test_golden_case(tmp_path, case):
    assert len(CASES) >= 3
    folder = GOLDEN / case
    expected = json.loads((folder / "expected.json").read_text())
    store = Store(tmp_path / "g.sqlite")
    clock = float(expected.get("clock", 2000.0))  # "now" for the server: samples after it are refused
    server = CollectorServer(store, clock=lambda: clock).start()
    try:
        with httpx.Client(base_url=server.url) as c:
            responses = []
            for line in (folder / "input.jsonl").read_text().splitlines():
                r = c.post("/api/v1/samples", content=line.encode(), headers={"Content-Type": "application/json"})
                # samples behind their GPU's window are refused with a 422 naming them (never a silent 200)
                assert r.status_code == (422 if r.json()["too_late"] else 200), r.text
                responses.append({k: v for k, v in r.json().items() if k not in ("reason", "error")})
            assert responses == expected["responses"]
            _match(c.get("/api/v1/usage", params={"per_gpu": "1"}).json(), expected["usage_per_gpu"], "per_gpu")
            _match(c.get("/api/v1/usage").json(), expected["usage"], "usage")
            _check(c.get("/api/v1/totals").json(), expected["totals"], "totals")
    finally:
        server.stop()
        store.close()
