"""Job metadata from a mapper rides with the agent's batches to the collector (real HTTP), so a job can be
accounted without a later join; a scheduler import then replaces it, and a node cannot describe other hosts' jobs."""

from __future__ import annotations

from pathlib import Path

import httpx

from gpuledger.agent.mappers.mapping_dir import MappingDirMapper
from gpuledger.agent.push import Batcher, HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import JobRecord


def test_mapper_metadata_reaches_the_ledger_once_and_yields_to_slurm(tmp_path: Path) -> None:
    # A jobstats-style mapping dir, as the Slurm prolog writes it: "<jobid> <uid>" per GPU index.
    mapdir = tmp_path / "map"
    mapdir.mkdir()
    (mapdir / "0").write_text("4242 1001\n")
    (mapdir / "1").write_text("4242 1001\n")
    t = [1_800_000_000.0]
    store = Store(tmp_path / "s.sqlite", clock=lambda: t[0])
    server = CollectorServer(store, clock=lambda: t[0]).start()
    try:
        pusher = HttpPusher(f"{server.url}/api/v1/samples", agent_id="a1", host="n1")
        agent = Agent(SimulatedSource(host="n1", gpus=2, clock=lambda: t[0], profiles={0: "training", 1: "training"}),
                      [MappingDirMapper(mapdir, format="jobstats")], clock=lambda: t[0], sinks=[Batcher(pusher, 1)])
        for _ in range(3):
            agent.tick()
            t[0] += 10
        jobs = {r.job_id: r for r in store.jobs()}
        assert set(jobs) == {"4242"} and jobs["4242"].uid == 1001
        assert [u.job_id for u in store.job_usage()] == ["4242"]
        # Sent once, not with every batch: nothing changed, so the later batches carried no "jobs".
        assert pusher._jobs == {}
        # The scheduler's record (with user and account) replaces the agent's.
        store.put_jobs([JobRecord(job_id="4242", cluster="c1", user="alice", account="proj_a", gpus=2)])
        (rec,) = store.jobs()
        assert (rec.cluster, rec.user, rec.account) == ("c1", "alice", "proj_a")
        agent.tick()  # the agent never overwrites it
        assert store.jobs() == [rec]

        # A batch describing a job on another host is refused whole.
        bad = {"agent_id": "a1", "seq": 99, "host": "n1", "samples": [],
               "jobs": [{"job_id": "7", "hosts": ["n2"]}]}
        r = httpx.post(f"{server.url}/api/v1/samples", json=bad)
        assert r.status_code == 400 and "job[0].hosts" in r.json()["error"]
        assert "7" not in {x.job_id for x in store.jobs()}
    finally:
        server.stop()
        store.close()
