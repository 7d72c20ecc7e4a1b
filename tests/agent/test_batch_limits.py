"""Batches fit the collector's limits (the real collector, set lower than its defaults so that the batches stay
small): pushes of many ticks go as several batches of whole ticks, a body over the size limit is halved before it
is sent, and a batch the collector refuses as too large is sent again in halves, never dropped."""

from __future__ import annotations

import time
from dataclasses import fields, replace

import pytest
from nvml_fake import MIB, FakeGpu, FakeMigInstance, FakeNvml, FakeProcess, Scenario, busy_gpm

from gpuledger.agent.mig import MigEnergySplitter
from gpuledger.agent.push import Batcher, BatchLimits, DirectSink, HttpPusher, fit_rows, halve, split_ticks
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.nvml import NvmlSource
from gpuledger.agent.sources.simulated import SimulatedSource, gpu_uuid_for
from gpuledger.agent.spool import Spool, SpoolingPusher
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.validate import DEFAULT_LIMITS, MAX_BODY_BYTES, Limits
from gpuledger.schema import limits as schema_limits
from gpuledger.schema.records import GpuProcess, GpuSample, JobRecord

GPUS = 8
NOW = time.time()


def serve(tmp_path, **limits: int) -> CollectorServer:
    return CollectorServer(Store(tmp_path / "c.sqlite"), limits=Limits(**limits)).start()


def node(sink) -> Agent:
    return Agent(SimulatedSource(host="n1", gpus=GPUS, clock=iter(NOW - 300 + i for i in range(10_000)).__next__),
                 sinks=[sink])


def sinks(url: str, tmp_path, limits: BatchLimits | None = None, fmt: str = "msgpack") -> dict:
    return {"direct": lambda: DirectSink(HttpPusher(url, "a", "n1", fmt=fmt, limits=limits)),
            "spool": lambda: SpoolingPusher(HttpPusher(url, "a", "n1", fmt=fmt, limits=limits), Spool(tmp_path / "s"),
                                            fmt=fmt, sleep=lambda s: None)}


def finish(sink) -> None:
    if isinstance(sink, SpoolingPusher):
        assert sink.drain(max_attempts=1) is True
    sink.close()


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_a_push_of_many_ticks_goes_as_batches_of_whole_ticks_within_the_limit(tmp_path, kind):
    srv = serve(tmp_path, max_samples=100)
    try:
        limits = BatchLimits(samples=100)  # the agent told the collector's limit (--max-batch-samples)
        inner = sinks(srv.url, tmp_path, limits)[kind]()
        agent = node(Batcher(inner, 25, limits))
        for _ in range(25):
            agent.tick()
        finish(inner)
        # 25 ticks of 8 samples: 12 + 12 + 1 ticks (whole ticks: not 100 + 100 samples in two batches)
        assert srv.store.totals()["samples"] == 200 and srv.store.batches_seen() == 3
        assert inner.stats()["rejected_batches"] == 0
    finally:
        srv.stop()
        srv.store.close()


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_a_batch_refused_as_too_large_is_sent_again_in_halves(tmp_path, kind, caplog):
    srv = serve(tmp_path, max_samples=50)  # set lower than the agent knows
    try:
        inner = sinks(srv.url, tmp_path)[kind]()
        agent = node(Batcher(inner, 15))
        for _ in range(15):
            agent.tick()
        finish(inner)
        assert srv.store.totals()["samples"] == 120 and inner.stats()["rejected_batches"] == 0
        assert any("HTTP 413" in r.getMessage() for r in caplog.records)
        if kind == "spool":
            assert inner.spool.depth == 0
    finally:
        srv.stop()
        srv.store.close()


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_a_body_over_the_size_limit_is_halved_before_it_is_sent(tmp_path, kind, caplog):
    srv = CollectorServer(Store(tmp_path / "c.sqlite"), max_body_bytes=4096).start()
    try:
        inner = sinks(srv.url, tmp_path, BatchLimits(body_bytes=4096), fmt="json")[kind]()
        agent = node(Batcher(inner, 10))
        for _ in range(10):
            agent.tick()
        finish(inner)
        assert srv.store.totals()["samples"] == 80 and srv.store.batches_seen() > 1
        assert not any("413" in r.getMessage() for r in caplog.records)  # none was refused: each fit
    finally:
        srv.stop()
        srv.store.close()


class LateJob:
    """A job on GPU 0 from tick ``start`` on (as the Slurm mappers see one), described from then on."""

    def __init__(self, start: int) -> None:
        self.tick, self.start = 0, start

    def map(self, samples):
        self.tick += 1
        return [replace(x, job_ids=("77",)) if self.tick > self.start and x.gpu_index == 0 else x for x in samples]

    def job_metadata(self) -> dict[str, JobRecord]:
        return {"77": JobRecord(job_id="77", uid=1001)} if self.tick > self.start else {}


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_job_records_ride_with_the_batch_that_holds_their_jobs_samples(tmp_path, kind):
    # the collector keeps an agent's record only for a job it has samples of (in that batch, or before)
    srv = serve(tmp_path, max_samples=100)
    try:
        limits = BatchLimits(samples=100)
        inner = sinks(srv.url, tmp_path, limits)[kind]()
        agent = Agent(SimulatedSource(host="n1", gpus=GPUS, clock=iter(NOW - 300 + i for i in range(99)).__next__),
                      [LateJob(20)], sinks=[Batcher(inner, 25, limits)])
        for _ in range(25):  # batches of ticks 1-12, 13-24, 25; the job from tick 21 on
            agent.tick()
        finish(inner)
        assert srv.store.batches_seen() == 3 and [(j.job_id, j.uid) for j in srv.store.jobs()] == [("77", 1001)]
    finally:
        srv.stop()
        srv.store.close()


class CrowdedJob:
    """Job 88 on GPU 0 with 300 processes and Xid storms (257 a tick), a job of 300 nodes (its record lists them)."""

    HOSTS = ("n1", *(f"node{k:03d}" for k in range(1, 300)))

    def map(self, samples):
        procs = tuple(GpuProcess(1000 + k, k * 2**20) for k in range(300))
        return [replace(x, job_ids=("88",), processes=procs, xid_errors=(13,) * 257) if x.gpu_index == 0 else x
                for x in samples]

    def job_metadata(self) -> dict[str, JobRecord]:
        return {"88": JobRecord(job_id="88", uid=1001, hosts=self.HOSTS)}


@pytest.mark.parametrize("kind", ["direct", "spool"])
def test_a_crowded_gpu_and_a_large_jobs_record_are_measured_not_refused(tmp_path, kind, caplog):
    # before: the collector refused GPU 0's every instant (300 processes, over 256 a sample), so job 88's use went
    # unmeasured, and every batch carrying the job's record (300 hosts, over 256 a record) until it was dropped
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuledger.agent.exposition import make_registry

    srv = serve(tmp_path)
    try:
        inner = sinks(srv.url, tmp_path)[kind]()
        agent = Agent(SimulatedSource(host="n1", gpus=GPUS, clock=iter(NOW - 300 + i for i in range(99)).__next__),
                      [CrowdedJob()], sinks=[Batcher(inner, 5)])
        for _ in range(10):
            agent.tick()
        finish(inner)
        assert srv.store.totals()["samples"] == 10 * GPUS
        assert inner.stats()["rejected_batches"] == 0
        (usage,) = srv.store.job_usage("88")
        assert usage.allocated_gpu_seconds > 0 and usage.energy_joules > 0
        (job,) = srv.store.jobs()
        assert (job.job_id, job.hosts) == ("88", CrowdedJob.HOSTS)
        kept = srv.store.series("n1", gpu_uuid_for("n1", 0), NOW - 400, NOW)
        assert [len(x.processes) for x in kept] == [256] * 10 and [len(x.xid_errors) for x in kept] == [256] * 10
        # the 256 using the most memory, in the driver's order
        assert [p.pid for p in kept[0].processes] == list(range(1044, 1300))
        text = generate_latest(make_registry(agent)).decode()
        values = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
        assert values["gpuledger_agent_push_trimmed_list_items_total"] == 10 * (44 + 1)
        assert sum("over the collector's limit of 256" in r.getMessage() for r in caplog.records) == 1  # once a GPU
    finally:
        srv.stop()
        srv.store.close()


class SharedGpu:
    """GPU 0 shared by ``jobs`` jobs at once (time-slicing, shards), equal shares; GPU 1 runs job 9 alone."""

    def __init__(self, jobs: int) -> None:
        self.jobs = tuple(str(1000 + j) for j in range(jobs))

    def map(self, samples):
        return [replace(x, job_ids=self.jobs) if x.gpu_index == 0 else
                replace(x, job_ids=("9",)) if x.gpu_index == 1 else x for x in samples]


@pytest.mark.parametrize("kind", ["direct", "spool"])
@pytest.mark.parametrize("told", [None, 8], ids=["default limits", "a collector set lower, the agent told so"])
def test_a_gpu_shared_by_more_jobs_than_a_sample_may_carry_is_measured_and_charged_to_none(tmp_path, kind, told,
                                                                                        caplog):
    # before: the collector refused GPU 0's every instant (65 job ids, over 64 a sample), each batch halved down to
    # one instant and that dropped: 4 requests a batch, GPU 0's energy unmeasured, the other GPUs' too by the halves
    from prometheus_client import generate_latest

    from gpuledger.agent.exposition import make_registry

    limit = told or DEFAULT_LIMITS.max_job_ids
    srv = serve(tmp_path, max_job_ids=limit)
    try:
        pusher = HttpPusher(srv.url, "a", "n1", fmt="msgpack", limits=BatchLimits(gpu_jobs=told) if told else None)
        inner = (DirectSink(pusher) if kind == "direct" else
                 SpoolingPusher(pusher, Spool(tmp_path / "s"), fmt="msgpack", sleep=lambda s: None))
        agent = Agent(SimulatedSource(host="n1", gpus=GPUS, clock=iter(NOW - 300 + i for i in range(99)).__next__),
                      [SharedGpu(limit + 1)], sinks=[Batcher(inner, 10)])
        for _ in range(10):  # one push (Batcher: 10 ticks)
            agent.tick()
        if kind == "spool":
            assert inner.drain(max_attempts=1) is True
        assert srv.store.totals()["samples"] == 10 * GPUS and srv.store.batches_seen() == 1
        assert inner.stats()["rejected_batches"] == 0 and inner.stats()["unattributed_samples"] == 10
        kept = srv.store.series("n1", gpu_uuid_for("n1", 0), NOW - 400, NOW)
        assert len(kept) == 10 and all(x.job_ids == () for x in kept)  # measured, no job charged the others' use
        assert srv.store.totals()["unattributed_energy_joules"] > 0
        assert [u.job_id for u in srv.store.job_usage()] == ["9"]  # GPU 1's job, as measured
        assert "gpuledger_agent_push_unattributed_samples_total 10.0" in generate_latest(make_registry(agent)).decode()
        said = [m for r in caplog.records if "more than the collector takes in one sample" in (m := r.getMessage())]
        assert len(said) == 1 and f"shared by {limit + 1} jobs" in said[0] and f"({limit})" in said[0]
        # at the limit: charged as measured
        agent.mappers = (SharedGpu(limit),)
        for _ in range(10):
            agent.tick()
        finish(inner)
        assert inner.stats()["unattributed_samples"] == 10 and len(srv.store.job_usage()) == 1 + limit
    finally:
        srv.stop()
        srv.store.close()


def test_a_record_of_more_hosts_than_one_may_list_goes_with_the_nodes_own(tmp_path, caplog):
    srv = serve(tmp_path, max_job_hosts=100)  # a collector set below its default, the agent told so
    try:
        sink = DirectSink(HttpPusher(srv.url, "a", "n1", fmt="msgpack", limits=BatchLimits(job_hosts=100)))
        agent = Agent(SimulatedSource(host="n1", gpus=GPUS, clock=iter(NOW - 300 + i for i in range(99)).__next__),
                      [CrowdedJob()], sinks=[sink])
        agent.tick()
        sink.close()
        assert sink.stats()["rejected_batches"] == 0 and srv.store.totals()["samples"] == GPUS
        assert [(j.job_id, j.hosts) for j in srv.store.jobs()] == [("88", ("n1",))]
        assert any("lists 300 hosts, more than the collector takes in one record (100)" in r.getMessage()
                   for r in caplog.records)
    finally:
        srv.stop()
        srv.store.close()


def test_fit_rows_and_the_hosts_a_batch_carries():
    x = GpuSample(ts=NOW, host="n1", gpu_uuid="G", gpu_index=0, xid_errors=(1, 2, 3),
                  processes=(GpuProcess(1, 5), GpuProcess(2, None), GpuProcess(3, 9), GpuProcess(4, 5)))
    assert fit_rows(x, 4) is x
    fitted = fit_rows(x, 2)
    assert fitted.processes == (GpuProcess(1, 5), GpuProcess(3, 9)) and fitted.xid_errors == (1, 2)
    assert fit_rows(x, 3).processes == (GpuProcess(1, 5), GpuProcess(3, 9), GpuProcess(4, 5))  # a tie: the first
    # records wait for the next batch once the hosts in them would pass what one batch may hold
    pusher = HttpPusher("http://127.0.0.1:9", "a", "n1", limits=BatchLimits(row_lists=700))
    pusher.write_jobs([JobRecord(job_id=str(j), hosts=tuple(f"h{k}" for k in range(300))) for j in range(3)])
    assert [[r.job_id for r in pusher.take_jobs()] for _ in range(3)] == [["0", "1"], ["2"], []]
    pusher.close()


def s(ts: float, g: int, jobs: tuple[str, ...] = ()) -> GpuSample:
    return GpuSample(ts=ts, host="n1", gpu_uuid=f"GPU-{g}", gpu_index=g, job_ids=jobs)


def test_split_ticks_counts_what_the_collector_counts():
    ticks = [[s(t, g, (f"j{t}",)) for g in range(4)] for t in range(6)]
    assert [len(b) for b in split_ticks(ticks, BatchLimits(samples=10))] == [8, 8, 8]
    assert [len(b) for b in split_ticks(ticks, BatchLimits(job_ids=3))] == [12, 12]  # a job a tick
    # each job set is a series of its own: 4 GPUs x 2 job sets fit 8 series
    assert [len(b) for b in split_ticks(ticks, BatchLimits(series=8))] == [8, 8, 8]
    # one tick over the limit alone is split between its GPUs
    assert [len(b) for b in split_ticks([ticks[0]], BatchLimits(samples=3))] == [3, 1]
    first, second = halve([x for t in ticks for x in t])
    assert (len(first), len(second)) == (12, 12) and max(x.ts for x in first) < min(x.ts for x in second)


def test_the_agent_knows_the_collectors_default_limits():
    # schema.limits holds them for the agent (which cannot import the collector): the collector's defaults agree
    assert BatchLimits() == BatchLimits(DEFAULT_LIMITS.max_samples, DEFAULT_LIMITS.max_series,
                                        DEFAULT_LIMITS.max_batch_job_ids, DEFAULT_LIMITS.max_batch_list,
                                        DEFAULT_LIMITS.max_jobs, DEFAULT_LIMITS.max_body_bytes,
                                        DEFAULT_LIMITS.max_list, DEFAULT_LIMITS.max_job_hosts,
                                        DEFAULT_LIMITS.max_job_ids)
    assert schema_limits.MAX_BODY_BYTES == MAX_BODY_BYTES
    for f in fields(BatchLimits):
        with pytest.raises(ValueError, match=f.name):
            BatchLimits(**{f.name: 0})


def mig_tick(ts: float) -> list[GpuSample]:
    """GPU 0 in MIG mode (its whole-GPU row and three instance rows), and GPU 1 whole."""
    gpu0 = [GpuSample(ts=ts, host="n1", gpu_uuid="GPU-0", gpu_index=0, energy_joules=1000.0)]
    gpu0 += [GpuSample(ts=ts, host="n1", gpu_uuid="GPU-0", gpu_index=0, mig=m, energy_joules=300.0) for m in "123"]
    return gpu0 + [s(ts, 1)]


def test_no_split_parts_one_mig_gpus_instant():
    # the collector normalizes a MIG GPU's rows per batch (normalize_mig): instance rows without their whole-GPU row
    # would take the largest instance's counter for the GPU's and undercount its energy
    tick = mig_tick(NOW)
    assert [len(b) for b in halve(tick)] == [4, 1]  # not 2 + 3 (the middle), inside GPU 0's rows
    assert [len(b) for b in split_ticks([tick], BatchLimits(samples=3))] == [4, 1]  # GPU 0's 4 rows go whole
    first, second = halve(mig_tick(NOW) + mig_tick(NOW + 10))
    assert [x.ts for x in first] == [NOW] * 5 and [x.ts for x in second] == [NOW + 10] * 5
    with pytest.raises(ValueError, match="instant"):
        halve(tick[:4])


def test_halves_of_a_batch_a_lost_answer_stored_are_taken(tmp_path, caplog):
    # Collector a stored the batch whole but its answer was lost; b, set lower, refuses it as too large. Its halves
    # must not go under its seq: b would refuse one as a conflict (other content under a stored key), for good.
    store = Store(tmp_path / "c.sqlite")
    a = CollectorServer(store).start()
    b = CollectorServer(store, limits=Limits(max_samples=50)).start()
    try:
        inner = SpoolingPusher(HttpPusher(b.url, "a", "n1", fmt="msgpack"), Spool(tmp_path / "s"), fmt="msgpack",
                               sleep=lambda s: None)
        agent = node(Batcher(inner, 15))
        for _ in range(15):  # one batch of 120 samples
            agent.tick()
        (seq,) = inner.spool.seqs()
        batch, body = inner.spool.get(seq)
        HttpPusher(a.url, "a", "n1").post(seq, body, batch.fmt, batch.compress, samples=batch.samples)
        assert store.totals()["samples"] == 120
        finish(inner)
        assert inner.stats()["rejected_batches"] == 0 and not any("HTTP 409" in r.getMessage() for r in caplog.records)
        assert any("HTTP 413" in r.getMessage() for r in caplog.records)
        assert inner.spool.depth == 0 and store.totals()["samples"] == 120  # each sample stored once
    finally:
        for srv in (a, b):
            srv.stop()
        store.close()


class CrowdedMigInstance:
    """MIG instance 1 shared by ``jobs`` jobs at once, instance 2 running job 9 alone."""

    def __init__(self, jobs: int) -> None:
        self.jobs = tuple(str(1000 + j) for j in range(jobs))

    def map(self, samples):
        return [replace(x, job_ids=self.jobs) if x.mig == "1" else
                replace(x, job_ids=("9",)) if x.mig == "2" else x for x in samples]


def test_a_mig_instance_shared_by_more_jobs_than_a_sample_may_carry_is_measured_and_charged_to_none(tmp_path):
    """The same rule on a MIG instance's row: its share of the GPU's energy is kept, unattributed; the other
    instance's job is charged as measured; nothing is refused."""
    t = [NOW - 300]
    gpu = FakeGpu("GPU-mig", name="NVIDIA A100-SXM4-80GB", power_w=300.0, gpm=busy_gpm(sm=45),
                  mig=[FakeMigInstance(1, "3g.40gb", gpm=busy_gpm(sm=50)),
                       FakeMigInstance(2, "3g.40gb", gpm=busy_gpm(sm=50))],
                  processes=[FakeProcess(100, 10 * MIB, gpu_instance=1, compute_instance=0),
                             FakeProcess(200, 10 * MIB, gpu_instance=2, compute_instance=0)])
    src = NvmlSource(lib=FakeNvml(Scenario([gpu]), clock=lambda: t[0]), host="n1", clock=lambda: t[0])
    src.open()
    srv = serve(tmp_path)
    try:
        sink = DirectSink(HttpPusher(srv.url, "a", "n1", fmt="msgpack"))
        agent = Agent(src, [MigEnergySplitter(), CrowdedMigInstance(DEFAULT_LIMITS.max_job_ids + 1)],
                      clock=lambda: t[0], sinks=[Batcher(sink, 10)])
        for _ in range(10):
            agent.tick()
            t[0] += 1.0
        sink.close()
        assert sink.stats()["rejected_batches"] == 0 and sink.stats()["unattributed_samples"] == 10
        assert srv.store.totals()["samples"] == 30 and srv.store.batches_seen() == 1  # the GPU's row and two instances'
        crowded = srv.store.series("n1", "GPU-mig", NOW - 400, NOW, mig="1")
        assert len(crowded) == 10 and all(x.job_ids == () for x in crowded)
        (usage,) = srv.store.job_usage()
        assert usage.job_id == "9" and usage.energy_joules > 0
        # the GPU's energy (300 W over 9 s) stays whole: instance 2's job has its part, instance 1's is unattributed
        totals = srv.store.totals()
        assert usage.energy_joules == pytest.approx(2700.0 * 3 / 7, rel=1e-9)  # its 3g slice of the GPU's 7
        assert usage.energy_joules + totals["unattributed_energy_joules"] == pytest.approx(2700.0, rel=1e-9)
    finally:
        srv.stop()
        srv.store.close()
