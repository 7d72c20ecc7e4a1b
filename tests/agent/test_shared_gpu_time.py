"""A GPU shared by two jobs is charged by the time each job's kernels ran on it, end to end: the fake NVML driver
(per-process utilization as ``nvmlDeviceGetProcessUtilization`` gives it), the real NVML source, the Slurm cgroup
mapper on a fake /proc holding real cgroup paths, the real pusher and the real collector over HTTP.

Before, the split followed GPU memory: a job computing 60% of the time in 1 GiB beside one computing 20% of it in
30 GB paid about 3% of the GPU's energy."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from nvml_fake import MIB, FakeGpu, FakeNvml, FakeProcess, Scenario
from test_slurm_cgroup import V1_PLAIN, V2, make_proc

from gpuledger.agent.mappers.slurm_cgroup import SlurmCgroupMapper
from gpuledger.agent.push import DirectSink, HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.nvml import NvmlSource
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store


def run_shared_gpu(tmp_path: Path, processes: list[FakeProcess], ticks: int = 11) -> tuple[Store, dict[str, float]]:
    """Sample one 300 W GPU running ``processes`` (pid 100: job 77, pids 200 and 201: job 4242) once a second
    and push each tick; returns the store and each job's energy."""
    make_proc(tmp_path / "proc", 100, V1_PLAIN)
    make_proc(tmp_path / "proc", 200, V2)
    make_proc(tmp_path / "proc", 201, V2)
    t = [time.time() - 60]
    lib = FakeNvml(Scenario([FakeGpu("GPU-shared", power_w=300.0, processes=processes)]), clock=lambda: t[0])
    store = Store(tmp_path / "c.sqlite")
    srv = CollectorServer(store).start()
    src = NvmlSource(lib=lib, host="n1", clock=lambda: t[0])
    src.open()
    agent = Agent(src, [SlurmCgroupMapper(tmp_path / "proc", resolver=None)], clock=lambda: t[0],
                  sinks=[DirectSink(HttpPusher(srv.url, agent_id="a-n1", host="n1"))])
    try:
        for _ in range(ticks):
            agent.tick()
            t[0] += 1.0
    finally:
        agent.close()
        srv.stop()
    return store, {u.job_id: u.energy_joules for u in store.job_usage()}


def test_the_job_that_computes_pays_for_the_gpu_whatever_memory_it_holds(tmp_path):
    store, energy = run_shared_gpu(tmp_path, [FakeProcess(100, 1024 * MIB, sm_util=60),
                                              FakeProcess(200, 20_000 * MIB, sm_util=15),
                                              FakeProcess(201, 10_000 * MIB, sm_util=5)])
    try:
        # the first sample starts no interval: 10 intervals of 1 s at 300 W
        assert math.fsum(energy.values()) == pytest.approx(3000.0, rel=1e-9)
        assert energy["77"] == pytest.approx(0.75 * 3000.0, rel=1e-9)
        assert energy["4242"] == pytest.approx(0.25 * 3000.0, rel=1e-9)
        # the evidence is stored with the samples: each process's time beside its memory
        (gpu,) = store.gpus()
        last = store.series(*gpu[:2], 0, time.time(), mig=gpu[2])[-1]
        assert {p.pid: p.gpu_util_ratio for p in last.processes} == pytest.approx({100: 0.6, 200: 0.15, 201: 0.05})
        assert last.job_shares == (0.75, 0.25)
    finally:
        store.close()


def test_without_the_time_of_every_job_the_memory_rule_still_applies(tmp_path):
    """The driver had no sample of any process (nobody ran, or an older driver): no job's time is guessed."""
    store, energy = run_shared_gpu(tmp_path, [FakeProcess(100, 1024 * MIB), FakeProcess(200, 20_000 * MIB),
                                              FakeProcess(201, 10_000 * MIB)])
    try:
        assert math.fsum(energy.values()) == pytest.approx(3000.0, rel=1e-9)
        assert energy["77"] == pytest.approx(3000.0 * 1024 / 31_024, rel=1e-9)  # by memory: 1,024 of 31,024 MiB
        assert energy["4242"] == pytest.approx(3000.0 * 30_000 / 31_024, rel=1e-9)
    finally:
        store.close()
