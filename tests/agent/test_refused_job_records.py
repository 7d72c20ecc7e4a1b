"""A job record the collector will not take costs that record, never the node's samples (real collector, real HTTP).

With ``trust_environ`` a record comes from the job's own environment, which its user writes: ``env
SLURM_CLUSTER_NAME=east ./train`` made every batch of the node a 403 under a cluster-bound token (kept in the spool
as configuration: the node's spool stopped for good, its GPUs unaccounted), and a control character or an
over-long account a 400 or 413 (the batch's samples dropped). Such a batch is now sent again without its records
and taken; the records are counted (``gpuledger_agent_push_refused_job_records_total``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from test_slurm_cgroup import V1_BATCH, env_bytes, make_proc

from gpuledger.agent.exposition import make_registry
from gpuledger.agent.mappers.slurm_cgroup import SlurmCgroupMapper
from gpuledger.agent.push import Batcher, DirectSink, HttpPusher, PushError
from gpuledger.agent.sampler import Agent
from gpuledger.agent.spool import Spool, SpoolingPusher
from gpuledger.collector.auth import Authenticator
from gpuledger.collector.config import load_settings
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuProcess, GpuSample, JobRecord

TOKEN = "tok-vm-aaaaaaaaaaaaaaaa"
PID = 30914  # the captured batch step's pid (job 16 on host "vm", cluster testcluster)


class OneGpu:
    """A GPU source at the machine boundary: one GPU of host ``vm`` running the captured job's process, one sample
    a tick (``clock``'s time)."""

    name = "one-gpu"

    def __init__(self, clock) -> None:
        self.clock = clock

    def open(self) -> None:
        pass

    def sample(self) -> list[GpuSample]:
        return [GpuSample(ts=self.clock(), host="vm", gpu_uuid="GPU-0", gpu_index=0, power_watts=300.0,
                          processes=(GpuProcess(PID, 2**30),))]

    def close(self) -> None:
        pass


def collector(tmp_path: Path, tokens: str | None):
    """The real collector, with ``tokens`` (a [collector.tokens] table's lines) as gpuledger.toml gives them."""
    auth = None
    if tokens is not None:
        (tmp_path / "gpuledger.toml").write_text(f"[collector.tokens]\n{tokens}\n")
        auth = Authenticator(load_settings(tmp_path, env={}).tokens)
    store = Store(tmp_path / "c.sqlite")
    return store, CollectorServer(store, auth=auth).start()


@pytest.mark.parametrize("agent_cluster", ["", "testcluster"], ids=["agent names no cluster", "agent names its own"])
def test_a_job_naming_another_cluster_never_holds_up_the_nodes_spool(tmp_path, caplog, agent_cluster):
    """The user's job says SLURM_CLUSTER_NAME=east; the node's token is bound to cluster testcluster."""
    store, srv = collector(tmp_path, f'vm = {{ token = "{TOKEN}", cluster = "testcluster" }}')
    make_proc(tmp_path / "proc", PID, V1_BATCH, env_bytes("inside-job-cgroupv1-env.txt", SLURM_CLUSTER_NAME="east"))
    t = [time.time() - 60]
    pusher = SpoolingPusher(HttpPusher(srv.url, agent_id="a-vm", host="vm", token=TOKEN, cluster=agent_cluster),
                            Spool(tmp_path / "spool"), backoff_base_s=0.01)
    agent = Agent(OneGpu(lambda: t[0]), [SlurmCgroupMapper(tmp_path / "proc", resolver=None, trust_environ=True)],
                  clock=lambda: t[0], sinks=[pusher])
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                agent.tick()
                t[0] += 1
            assert pusher.send_pending() is True
        assert pusher.spool.depth == 0 and pusher.stats()["rejected_batches"] == 0
        assert store.totals()["samples"] == 5 and [u.job_id for u in store.job_usage()] == ["16"]
        if agent_cluster:  # the record is this host's cluster's: taken whole, the job user's metadata kept
            (rec,) = store.jobs()
            assert (rec.cluster, rec.user, rec.account) == ("testcluster", "bob", "proj_a")
            assert pusher.stats()["refused_job_records"] == 0
            assert "job 16 names cluster 'east', but this host is in cluster 'testcluster'" in caplog.text
        else:  # the collector refused it (403): the batch went again without it, and was taken
            assert store.jobs() == []  # the samples' usage is job 16's; the scheduler's import will describe it
            text = generate_latest(make_registry(agent)).decode()
            assert "gpuledger_agent_push_refused_job_records_total 1.0" in text
            assert ("answered HTTP 403" in caplog.text and "job[0].cluster: 'east' is not the batch's cluster "
                    "'testcluster'" in caplog.text and "without 1 of its 1 job records, dropped" in caplog.text)
    finally:
        agent.close()
        srv.stop()
        store.close()


BAD_RECORDS = {
    "a control character (400)": {"account": "proj\x01a"},
    "an account over 256 characters (413)": {"account": "p" * 300},
    "300 TRES (413)": {"tres": tuple((f"gres/t{i}", 1.0) for i in range(300))},
}


def make_sink(kind: str, pusher: HttpPusher, tmp_path: Path):
    if kind == "spool":
        return SpoolingPusher(pusher, Spool(tmp_path / "spool"), fmt="msgpack")
    if kind == "direct":
        return DirectSink(pusher)
    return Batcher(pusher, 1)  # the pusher itself as the sink (HttpPusher.write)


@pytest.mark.parametrize("bad", list(BAD_RECORDS))
@pytest.mark.parametrize("kind", ["spool", "direct", "pusher"])
def test_a_record_the_collector_refuses_costs_the_record_not_the_samples(tmp_path, bad, kind):
    store, srv = collector(tmp_path, None)
    pusher = HttpPusher(srv.url, agent_id="a1", host="n1", fmt="msgpack")
    sink = make_sink(kind, pusher, tmp_path)
    now = time.time()
    tick = [[GpuSample(ts=now - 60 + i, host="n1", gpu_uuid=f"GPU-{g}", gpu_index=g, job_ids=("567"[g % 3],),
                       power_watts=100.0) for g in range(8)] for i in range(10)]  # the default agent's batch: 80
    try:
        # the bad record between two good ones: the collector names it, and only it is left out
        sink.write_jobs([JobRecord("6", user="cy", hosts=("n1",)), JobRecord("7", user="ann", hosts=("n1",),
                                                                            **BAD_RECORDS[bad]),
                         JobRecord("5", user="di", hosts=("n1",))])
        if kind == "pusher":
            pusher.write([s for t in tick for s in t])
        else:
            sink.write_ticks(tick)
        if kind == "spool":
            assert sink.send_pending() is True and sink.spool.depth == 0
        assert store.totals()["samples"] == 80
        assert pusher.job_records_refused == 1 and {r.job_id: r.user for r in store.jobs()} == {"5": "di", "6": "cy"}
        if kind != "pusher":
            assert sink.stats()["refused_job_records"] == 1 and sink.stats()["rejected_batches"] == 0
        # the records after it still go: job 8's is stored whole
        sink.write_jobs([JobRecord("8", user="bea", hosts=("n1",))])
        later = [GpuSample(ts=now - 30, host="n1", gpu_uuid="GPU-0", gpu_index=0, job_ids=("8",), power_watts=1.0)]
        pusher.write(later) if kind == "pusher" else sink.write_ticks([later])
        if kind == "spool":
            assert sink.send_pending() is True
        assert {r.job_id: r.user for r in store.jobs()} == {"5": "di", "6": "cy", "8": "bea"}
        assert pusher.job_records_refused == 1
    finally:
        sink.close()
        srv.stop()
        store.close()


@pytest.mark.parametrize("kind", ["spool", "direct"])
def test_a_batch_refused_without_its_records_too_is_dealt_with_as_before(tmp_path, kind):
    """The records were not the cause: the second answer decides the batch, and the records are not counted."""
    store, srv = collector(tmp_path, f'n1 = "{TOKEN}"')
    now = time.time()
    try:
        # 403: this agent says it is n2 under n1's token (configuration): kept in the spool, records not lost
        pusher = HttpPusher(srv.url, agent_id="a2", host="n2", token=TOKEN)
        sink = make_sink(kind, pusher, tmp_path / "a")
        sink.write_jobs([JobRecord("7", hosts=("n2",))])
        sink.write_ticks([[GpuSample(ts=now - 60, host="n2", gpu_uuid="GPU-0", gpu_index=0, job_ids=("7",))]])
        if kind == "spool":
            assert sink.send_pending() is False and sink.spool.depth == 1  # kept whole, with its record
            assert sink.stats()["rejected_batches"] == 0
        else:
            assert sink.stats()["unsent_batches"] == 1 and [r.job_id for r in pusher.take_jobs()] == ["7"]
        assert pusher.job_records_refused == 0 and store.totals()["samples"] == 0
        sink.close()

        # 400 for a sample (a control character in its GPU's uuid): dropped for good, as before
        pusher = HttpPusher(srv.url, agent_id="a1", host="n1", token=TOKEN)
        sink = make_sink(kind, pusher, tmp_path / "b")
        sink.write_jobs([JobRecord("7", hosts=("n1",))])
        sink.write_ticks([[GpuSample(ts=now - 60, host="n1", gpu_uuid="GPU-\x01", gpu_index=0, job_ids=("7",))]])
        if kind == "spool":
            assert sink.send_pending() is True and sink.spool.depth == 0
        assert sink.stats()["rejected_batches"] == 1 and sink.stats()["refused_job_records"] == 0
        assert store.totals()["samples"] == 0 and store.jobs() == []
        sink.close()
    finally:
        srv.stop()
        store.close()


def test_only_a_verdict_on_what_the_batch_holds_sends_it_again_without_its_records():
    # not a wrong URL or token (404, 401: configuration, the same answer twice), overload, clock skew, a conflict
    # of its key (409: stored before with other content), the server's trouble or no answer
    statuses = (400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 500, 503)
    assert [s for s in statuses if PushError("refused", status=s).about_content] == [400, 403, 413, 422]
    assert not PushError("refused", status=400, reason="future").about_content
    assert not PushError("unreachable", status=None).about_content


def test_a_collector_that_names_no_record_costs_the_batch_all_its_records_not_its_samples(tmp_path):
    """A collector from before the answers named the record (no "job" in its 400): every record is left out."""
    from test_spool import Scripted

    server = Scripted([400, 200])
    try:
        pusher = HttpPusher(server.url, agent_id="a1", host="n1")
        sink = DirectSink(pusher)
        sink.write_jobs([JobRecord("6", hosts=("n1",)), JobRecord("7", account="proj\x01a", hosts=("n1",))])
        sink.write_ticks([[GpuSample(ts=time.time(), host="n1", gpu_uuid="GPU-0", gpu_index=0, job_ids=("7",))]])
        assert [[r["job_id"] for r in b.get("jobs", [])] for b in server.received] == [["6", "7"], []]
        assert sink.stats()["refused_job_records"] == 2 and sink.stats()["rejected_batches"] == 0
        assert server.received[0]["seq"] != server.received[1]["seq"]
    finally:
        server.stop()


def test_each_record_named_in_turn_is_left_out_and_a_bounded_number_one_by_one(tmp_path):
    store, srv = collector(tmp_path, None)
    try:
        pusher = HttpPusher(srv.url, agent_id="a1", host="n1")
        sink = DirectSink(pusher)
        bad = [JobRecord(str(100 + j), account=f"x\x01{j}", hosts=("n1",)) for j in range(12)]
        sink.write_jobs([JobRecord("5", user="di", hosts=("n1",)), *bad[:2], JobRecord("6", user="cy", hosts=("n1",))])
        tick = [GpuSample(ts=time.time() - 30, host="n1", gpu_uuid=f"GPU-{g}", gpu_index=g, job_ids=(j,))
                for g, j in enumerate("56")]
        sink.write_ticks([tick])
        assert pusher.job_records_refused == 2 and {r.job_id for r in store.jobs()} == {"5", "6"}
        assert pusher.batches_sent == 1 and store.totals()["samples"] == 2
        # more bad records than are left out one by one: the rest go all at once (each costs a request)
        sink.write_jobs(bad[2:])
        sink.write_ticks([[replace(x, ts=x.ts + 10) for x in tick]])
        assert pusher.job_records_refused == 12 and store.totals()["samples"] == 4
        # refused: 2 in the first push; in the second, the batch and 8 attempts each without one more record (the
        # 9th without the last two at once is taken)
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'gpuledger_collector_batches_rejected_total{reason="invalid",status="400"} 11.0' in metrics
    finally:
        srv.stop()
        store.close()


def test_a_resend_whose_sequence_number_cannot_be_persisted_is_not_sent_and_the_refusal_stands(tmp_path, caplog):
    store, srv = collector(tmp_path, None)

    def full_disk(seq: int) -> None:
        raise OSError(28, "No space left on device")

    try:
        pusher = HttpPusher(srv.url, agent_id="a1", host="n1")
        sink = DirectSink(pusher, reserve=full_disk)
        sink.write_jobs([JobRecord("7", account="p\x01", hosts=("n1",))])
        with caplog.at_level(logging.WARNING):
            sink.write_ticks([[GpuSample(ts=time.time() - 30, host="n1", gpu_uuid="GPU-0", gpu_index=0,
                                         job_ids=("7",))]])
        assert sink.stats()["rejected_batches"] == 1 and sink.stats()["refused_job_records"] == 0
        assert store.totals()["samples"] == 0 and pusher.batches_sent == 0
        assert "sequence number not persisted (No space left on device)" in caplog.text
    finally:
        srv.stop()
        store.close()
