"""Ledger integrity golden cases through the real HTTP path (a real collector server on loopback, as
tests/collector/test_golden.py does): jobs seen only by Slurm, only by agents, two clusters with one job id,
forged agent metadata. Each case's numbers are derived by hand in the comments.

Scheduler records go in through ``POST /api/v1/jobs`` (admin token), samples through ``POST /api/v1/samples``
(node tokens bound to their hosts); then the accounting side reads the store.
"""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.charge import ChargePolicy, allocation
from gpuledger.accounting.config import AccountingSettings
from gpuledger.accounting.engine import association_usage
from gpuledger.accounting.jobreport import load_job_report, to_text
from gpuledger.accounting.ledger import load
from gpuledger.cli import app
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.ledger_url import STORE_NAME
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store

ADMIN = "admin-token"
NODES = {"a1": "tok-a1", "a2": "tok-a2", "b1": "tok-b1"}
T0 = 1_795_000_000.0  # a whole hour (1795000000 / 3600 is not whole; only differences matter below)


def sample(ts: float, uuid: str, job: str | None, sm: float = 0.5) -> dict:
    return {"ts": ts, "gpu_uuid": uuid, "gpu_index": 0, "model": "NVIDIA H200", "sm_active_ratio": sm,
            **({"job_ids": [job]} if job else {})}


def batch(host: str, seq: int, samples: list[dict], cluster: str | None = None, jobs: list[dict] = ()) -> bytes:
    doc: dict = {"agent_id": f"agent-{host}", "seq": seq, "host": host,
                 "samples": [{**s, "host": host} for s in samples]}
    if cluster is not None:
        doc["cluster"] = cluster
    if jobs:
        doc["jobs"] = list(jobs)
    return json.dumps(doc).encode()


@pytest.fixture()
def collector(tmp_path):
    store = Store(tmp_path / STORE_NAME)  # the data dir's embedded ledger: the CLI reads it too
    server = CollectorServer(store, clock=lambda: T0 + 86400.0,
                             auth=Authenticator(node_tokens={h: t for h, t in NODES.items()},
                                                admin_tokens=[ADMIN])).start()
    client = httpx.Client(base_url=server.url)

    def post(host: str, body: bytes) -> httpx.Response:
        return client.post("/api/v1/samples", content=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {NODES[host]}"})

    def jobs(records: list[dict]) -> httpx.Response:
        return client.post("/api/v1/jobs", json=records, headers={"Authorization": f"Bearer {ADMIN}"})

    try:
        yield store, post, jobs
    finally:
        client.close()
        server.stop()
        store.close()


TREE = AssocTree.from_toml({"accounts": {"proj_a": {"shares": 1, "users": {"alice": 1}},
                                         "proj_b": {"shares": 1, "users": {"bob": 1}}}})
NOW = T0 + 86400.0
NO_DECAY = dict(half_life_s=0, calc_period_s=1)  # half_life_s 0: no decay (Slurm allows it), usage = charges


def test_job_seen_only_by_slurm_is_charged_its_allocation(collector):
    store, post, jobs = collector
    # Job 10 ran 1 h on 2 H200s of a1 and no agent saw it: allocated = 3600 s x 2 = 7200 GPU-s.
    r = jobs([{"job_id": "10", "cluster": "alpha", "user": "alice", "account": "proj_a", "hosts": ["a1"],
               "gpus": 2, "start": T0, "end": T0 + 3600, "state": "COMPLETED",
               "tres": [["gres/gpu", 2], ["gres/gpu:h200", 2]]}])
    assert r.status_code == 200, r.text
    (e,) = load(store)
    assert (e.cluster, e.job_id, e.seen_by, e.usage) == ("alpha", "10", "slurm", None)
    assert allocation(e.record, NOW) == {"h200": 7200.0}
    # allocated policy: 7200; blend with unmeasured "allocated" (as fully used): 7200 x 1 = 7200;
    # "floor": 7200 x 0.25 = 1800; "mean" with nothing observed falls back to "allocated": 7200. Never 0.
    for kind, rule, want in [("allocated", "allocated", 7200.0), ("blend", "allocated", 7200.0),
                             ("blend", "floor", 1800.0), ("active", "mean", 7200.0)]:
        c = ChargePolicy(kind=kind, unmeasured=rule).charge_job(allocation(e.record, NOW), e.measured)
        assert (c.total, c.coverage, c.unmeasured_gpu_seconds) == (want, 0.0, 7200.0), (kind, rule)
    res = association_usage([e], AccountingSettings(policy="allocated", **NO_DECAY), TREE, NOW)
    assert res.usage[("proj_a", "alice")] == pytest.approx(7200.0)
    assert res.jobs[0].seen_by == "slurm" and res.jobs[0].coverage == 0.0
    rep = load_job_report(store, "10", now=NOW)
    assert (rep.allocation.seen_by, rep.allocation.coverage, rep.allocation.unmeasured_gpu_seconds) == \
        ("slurm", 0.0, 7200.0)
    assert "coverage 0.0%, unmeasured 2.00 GPU-h" in to_text(rep)


def test_job_seen_only_by_agents_is_charged_from_measurements_and_flagged_only_where_the_site_says_so(collector):
    store, post, jobs = collector
    # Job 20 on a1: samples at T0, T0+10, T0+20 -> two 10 s intervals = 20 GPU-s observed, SM 0.5 -> 10 SM-s.
    # The agent says it is bob's in proj_b; no Slurm record exists.
    meta = [{"job_id": "20", "user": "bob", "account": "proj_b", "hosts": ["a1"]}]
    r = post("a1", batch("a1", 1, [sample(T0 + 10 * k, "GPU-A1", "20") for k in range(3)], "alpha", meta))
    assert r.status_code == 200, r.text
    (e,) = load(store)
    assert (e.cluster, e.job_id, e.seen_by, e.record) == ("alpha", "20", "agent", None)
    assert (e.account, e.user) == ("proj_b", "bob") and e.usage.allocated_gpu_seconds == 20.0
    # blend: 0.25 x 20 + 0.75 x 10 = 12.5; no allocation, so nothing unmeasured and coverage unknown
    c = ChargePolicy().charge_job(allocation(e.record, NOW), e.measured)
    assert (c.total, c.coverage, c.allocated_gpu_seconds) == (12.5, None, None)
    # by default an agent's word alone charges nobody (a node with a stolen token could invent the job for bob):
    # listed, not charged
    res = association_usage([e], AccountingSettings(**NO_DECAY), TREE, NOW)
    assert (res.usage, res.jobs, res.unrecorded_jobs, res.unmatched_jobs) == ({}, (), ("20@alpha",), ())
    res = association_usage([e], AccountingSettings(**NO_DECAY, charge_unrecorded_jobs=True), TREE, NOW)
    assert res.usage[("proj_b", "bob")] == pytest.approx(12.5) and res.jobs[0].seen_by == "agent"
    assert res.unrecorded_jobs == ()


def test_a_job_a_node_invented_charges_nobody_s_fairshare_unless_the_site_takes_agents_at_their_word(
        collector, tmp_path):
    store, post, jobs = collector
    # a1's token, stolen, invents job 20 on a1's own GPU for bob; Slurm ran job 21 of alice there
    assert jobs([{"job_id": "21", "cluster": "alpha", "user": "alice", "account": "proj_a", "hosts": ["a1"],
                  "gpus": 1, "start": T0, "end": T0 + 20, "state": "COMPLETED", "tres": [["gres/gpu", 1]]}
                 ]).status_code == 200
    meta = [{"job_id": "20", "user": "bob", "account": "proj_b", "hosts": ["a1"]}]
    assert post("a1", batch("a1", 1, [sample(T0 + 10 * k, "GPU-A1", "21") for k in range(3)], "alpha")
                ).status_code == 200
    assert post("a1", batch("a1", 2, [sample(T0 + 100 + 10 * k, "GPU-A1", "20") for k in range(3)], "alpha", meta)
                ).status_code == 200
    accounts = ('[accounts.proj_a]\nshares = 1\nusers = { alice = 1 }\n'
                '[accounts.proj_b]\nshares = 1\nusers = { bob = 1 }\n')

    def usage(extra: str = "") -> tuple[dict, str]:
        cfg = tmp_path / "gpuledger.toml"
        cfg.write_text(f"[accounting]\nhalf_life_s = 0\ncalc_period_s = 1\n{extra}\n{accounts}")
        r = CliRunner().invoke(app, ["fairshare", "--data-dir", str(tmp_path), "--config", str(cfg),
                                     "--format", "json"])
        assert r.exit_code == 0, r.output
        return {(x["account"], x["user"]): x["raw_usage"] for x in json.loads(r.stdout) if x["user"]}, r.stderr

    # blend of 20 GPU-s at SM 0.5: 12.5 each, bob's only by the node's word
    by, err = usage()
    assert by == {("proj_a", "alice"): pytest.approx(12.5), ("proj_b", "bob"): 0}
    assert "1 measured job(s) Slurm has no record of are not charged" in err and "20@alpha" in err, err
    by, err = usage("charge_unrecorded_jobs = true")
    assert by == {("proj_a", "alice"): pytest.approx(12.5), ("proj_b", "bob"): pytest.approx(12.5)}
    assert "no record of" not in err


def test_two_clusters_with_the_same_job_id_stay_apart(collector):
    store, post, jobs = collector
    # Job 7 in alpha (a1, alice, 3 samples 10 s apart = 20 GPU-s) and job 7 in beta (b1, bob, 5 samples = 40 GPU-s).
    assert jobs([{"job_id": "7", "cluster": "alpha", "user": "alice", "account": "proj_a", "hosts": ["a1"], "gpus": 1,
                  "start": T0, "end": T0 + 20, "state": "COMPLETED", "tres": [["gres/gpu", 1]]},
                 {"job_id": "7", "cluster": "beta", "user": "bob", "account": "proj_b", "hosts": ["b1"], "gpus": 1,
                  "start": T0, "end": T0 + 40, "state": "COMPLETED", "tres": [["gres/gpu", 1]]}]).status_code == 200
    a1 = batch("a1", 1, [sample(T0 + 10 * k, "GPU-A1", "7") for k in range(3)], "alpha")
    b1 = batch("b1", 1, [sample(T0 + 10 * k, "GPU-B1", "7") for k in range(5)], "beta")
    assert post("a1", a1).status_code == 200
    assert post("b1", b1).status_code == 200
    usage = {(u.cluster, u.job_id): u.allocated_gpu_seconds for u in store.job_usage()}
    assert usage == {("alpha", "7"): 20.0, ("beta", "7"): 40.0}
    entries = {e.key: e for e in load(store)}
    assert set(entries) == {("alpha", "7"), ("beta", "7")}
    a, b = entries[("alpha", "7")], entries[("beta", "7")]
    assert (a.account, a.usage.allocated_gpu_seconds, b.account, b.usage.allocated_gpu_seconds) == \
        ("proj_a", 20.0, "proj_b", 40.0)
    # allocated policy: alpha 20 s x 1 GPU = 20, beta 40 x 1 = 40; coverage 1 each
    res = association_usage(list(entries.values()), AccountingSettings(policy="allocated", **NO_DECAY), TREE, NOW)
    assert res.usage == pytest.approx({("proj_a", "alice"): 20.0, ("proj_b", "bob"): 40.0})
    assert sorted(j.coverage for j in res.jobs) == [1.0, 1.0]
    # `report job 7` must say which: the id is in two clusters
    with pytest.raises(LookupError, match="clusters 'alpha', 'beta'"):
        load_job_report(store, "7")
    rep = load_job_report(store, "7", cluster="beta", now=NOW)
    assert (rep.record.account, rep.allocation.slurm_gpu_seconds, rep.allocation.coverage) == ("proj_b", 40.0, 1.0)


def test_forged_agent_metadata_is_refused_or_outvoted(collector):
    store, post, jobs = collector
    # Slurm: job 32 is alice's in proj_a on a1 (1 GPU, 20 s).
    assert jobs([{"job_id": "32", "cluster": "alpha", "user": "alice", "account": "proj_a", "hosts": ["a1"],
                  "gpus": 1, "start": T0, "end": T0 + 20, "state": "COMPLETED",
                  "tres": [["gres/gpu", 1]]}]).status_code == 200
    # a1's token describing a job on host a2 only: 403, nothing of the batch stored.
    r = post("a1", batch("a1", 1, [sample(T0, "GPU-A1", "30")], "alpha",
                         [{"job_id": "30", "account": "proj_b", "hosts": ["a2"]}]))
    assert r.status_code == 403 and "hosts" in r.text
    # ... or naming another cluster than its batch: 403.
    r = post("a1", batch("a1", 2, [sample(T0, "GPU-A1", "30")], "alpha",
                         [{"job_id": "30", "cluster": "beta", "account": "proj_b", "hosts": ["a1"]}]))
    assert r.status_code == 403 and "cluster" in r.text
    # a1 describing job 31, of which no sample came from a1: the description is refused (not stored).
    # a1 setting job 32's account to proj_b: stored as the agent's, but Slurm's record wins.
    # A description with no hosts at all: refused.
    r = post("a1", batch("a1", 3, [sample(T0 + 10 * k, "GPU-A1", "32") for k in range(3)], "alpha",
                         [{"job_id": "31", "user": "bob", "account": "proj_b", "hosts": ["a1"]},
                          {"job_id": "32", "user": "bob", "account": "proj_b", "hosts": ["a1"]},
                          {"job_id": "33", "user": "bob", "account": "proj_b", "hosts": []}]))
    assert r.status_code == 200, r.text
    sources = {(rec.job_id, src) for rec, src in store.job_records()}
    assert sources == {("32", "slurm"), ("32", "agent")}
    (e,) = load(store)
    # job 32: 3 samples 10 s apart = 20 GPU-s observed of 20 allocated; charged to proj_a/alice, not proj_b/bob
    assert (e.key, e.seen_by, e.account, e.user) == (("alpha", "32"), "both", "proj_a", "alice")
    assert {r.account for r in store.jobs()} == {"proj_a"}
    res = association_usage([e], AccountingSettings(policy="allocated", **NO_DECAY), TREE, NOW)
    assert res.usage == pytest.approx({("proj_a", "alice"): 20.0})  # nothing reaches proj_b/bob
