"""The agent loop: order of steps, snapshot, sinks, and survival of failing parts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.dcgm_exporter import DcgmExporterSource
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.schema.records import GpuSample


class ListSink:
    def __init__(self) -> None:
        self.batches: list[list[GpuSample]] = []
        self.closed = False

    def write(self, samples: Sequence[GpuSample]) -> None:
        self.batches.append(list(samples))

    def close(self) -> None:
        self.closed = True


class BrokenSink:
    def write(self, samples: Sequence[GpuSample]) -> None:
        raise ConnectionError("collector down")


class FlakySource:
    """Fails every other read (a driver hiccup), otherwise delegates to a simulated node."""

    name = "flaky"

    def __init__(self) -> None:
        self.inner = SimulatedSource(gpus=2, clock=lambda: 1_700_000_000.0)
        self.calls = 0

    def open(self) -> None: ...

    def close(self) -> None: ...

    def sample(self) -> list[GpuSample]:
        self.calls += 1
        if self.calls % 2 == 0:
            raise SourceUnavailable("NVML_ERROR_GPU_IS_LOST")
        return self.inner.sample()


class BrokenMapper:
    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        raise OSError("/proc unreadable")


def test_tick_samples_maps_in_order_and_writes() -> None:
    sink = ListSink()
    first = StaticMapper({0: "1", 1: "2"})
    second = StaticMapper({1: "3"})  # later mappers override earlier ones
    agent = Agent(SimulatedSource(gpus=3, profiles={0: "training"}), mappers=[first, second], sinks=[sink])
    out = agent.tick()
    assert [s.job_ids for s in out] == [("1",), ("3",), ()]
    assert agent.snapshot == out and sink.batches == [out]
    assert agent.ticks_total == 1 and agent.last_tick_seconds is not None and agent.last_tick_seconds >= 0
    assert agent.errors_total == {"source": 0, "mapper": 0, "sink": 0, "internal": 0}


def test_failing_mapper_is_skipped_and_sinks_still_get_data() -> None:
    good, after = ListSink(), ListSink()
    agent = Agent(
        SimulatedSource(gpus=2),
        mappers=[BrokenMapper(), StaticMapper({0: "9"})],
        sinks=[BrokenSink(), good, after],
    )
    out = agent.tick()
    assert [s.job_ids for s in out] == [("9",), ()]
    assert good.batches == [out] and after.batches == [out]
    assert agent.errors_total["mapper"] == 1 and agent.errors_total["sink"] == 1


def test_failing_source_empties_snapshot_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    sink = ListSink()
    agent = Agent(FlakySource(), sinks=[sink])
    caplog.set_level(logging.DEBUG, logger="gpuledger.agent.sampler")
    results = [agent.tick() for _ in range(6)]
    assert [len(r) for r in results] == [2, 0, 2, 0, 2, 0]
    assert agent.snapshot == [] and len(sink.batches) == 3  # empty batches are not written
    assert agent.errors_total["source"] == 3 and agent.ticks_total == 6
    # Logged at error level once; repeats go to debug.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "NVML_ERROR_GPU_IS_LOST" in errors[0].getMessage()


def test_operational_errors_are_one_line_and_bugs_keep_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A backend down (the source's SourceUnavailable, the sink's ConnectionError, the mapper's OSError) is one
    line; an exception no part raises on purpose (a TypeError, a RecursionError or NotImplementedError: both
    RuntimeErrors) is a bug, logged with its traceback."""
    class BuggyMapper:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
            raise self.exc

    caplog.set_level(logging.ERROR, logger="gpuledger.agent.sampler")
    bugs = [BuggyMapper(TypeError("'NoneType' object is not subscriptable")),
            BuggyMapper(RecursionError("maximum recursion depth exceeded")), BuggyMapper(NotImplementedError("v3"))]
    agent = Agent(FlakySource(), mappers=[BrokenMapper(), *bugs], sinks=[BrokenSink()])
    agent.tick()
    agent.tick()  # the source fails
    logged = {r.getMessage().split(": ")[1]: r.exc_info is not None for r in caplog.records}
    assert logged == {"OSError": False, "TypeError": True, "RecursionError": True, "NotImplementedError": True,
                      "ConnectionError": False, "SourceUnavailable": False}


def test_a_failing_held_xids_is_a_source_error_and_the_samples_still_reach_the_sinks() -> None:
    """The source's held Xids (``held_xids``) raise on the second tick: counted as a source error, the tick's
    samples are written all the same, and the Xid count neither steps back nor grows by a guess."""
    class HoldingSource(SimulatedSource):
        fail = False

        def held_xids(self) -> list[tuple[tuple[str, int, str, str], str, int]]:
            if self.fail:
                raise ValueError("garbled")
            return [(("n1", 0, "GPU-0", ""), "H100", 2)]

    source = HoldingSource(gpus=2, clock=lambda: 1_700_000_000.0)
    sink = ListSink()
    agent = Agent(source, sinks=[sink])
    agent.tick()
    assert agent.xid_errors_total == {("n1", 0, "GPU-0", ""): 2}
    source.fail = True
    assert len(agent.tick()) == 2
    assert len(sink.batches) == 2 and agent.errors_total["source"] == 1
    assert agent.xid_errors_total == {("n1", 0, "GPU-0", ""): 2}


def test_run_survives_failures_and_stops_promptly() -> None:
    sink = ListSink()
    agent = Agent(FlakySource(), mappers=[BrokenMapper()], sinks=[sink, BrokenSink()])
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(0.01, stop))
    t.start()
    deadline = time.monotonic() + 10
    while agent.ticks_total < 10 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert t.is_alive()
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive()
    assert agent.ticks_total >= 10
    assert agent.errors_total["source"] >= 4 and agent.errors_total["mapper"] >= 4 and agent.errors_total["sink"] >= 4
    assert sink.batches


def test_run_stop_interrupts_a_long_wait() -> None:
    agent = Agent(SimulatedSource(gpus=1))
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(3600.0, stop))
    t.start()
    while agent.ticks_total < 1:
        time.sleep(0.005)
    t0 = time.monotonic()
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive() and time.monotonic() - t0 < 1.0


def test_run_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Agent(SimulatedSource(gpus=1)).run(0, threading.Event())


def test_close_closes_sinks_even_if_one_fails() -> None:
    class BadClose(ListSink):
        def close(self) -> None:
            raise OSError("disk gone")

    ok = ListSink()
    Agent(SimulatedSource(gpus=1), sinks=[BadClose(), ok]).close()
    assert ok.closed


def test_jobs_that_ended_are_forgotten_and_one_back_is_described_again() -> None:
    # A node runs job after job (the mapper knows the jobs of its last map() call, as slurm-cgroup and mapping-dir
    # do): the agent holds the jobs running now, not every job the node ever ran, and each tick looks at those only.
    from gpuledger.schema.records import JobRecord

    class OneJobATick:
        def __init__(self) -> None:
            self.job = 0
            self.hold = False  # the same job goes on

        def map(self, samples: Sequence[GpuSample]) -> Sequence[GpuSample]:
            self.job += 0 if self.hold else 1
            return samples

        def job_metadata(self) -> dict[str, JobRecord]:
            return {str(self.job): JobRecord(job_id=str(self.job), uid=1000)}

    class JobSink(ListSink):
        def __init__(self) -> None:
            super().__init__()
            self.described: list[str] = []

        def write_jobs(self, records: Sequence[JobRecord]) -> None:
            self.described += [r.job_id for r in records]

    mapper, sink = OneJobATick(), JobSink()
    agent = Agent(SimulatedSource(gpus=1), [mapper], sinks=[sink])
    for _ in range(500):
        agent.tick()
    assert list(agent.jobs) == ["500"] and list(agent._jobs_sent) == ["500"]
    assert sink.described == [str(j) for j in range(1, 501)]  # each described once, when it came
    mapper.hold = True
    agent.tick()  # job 500 goes on: not described again
    mapper.hold, mapper.job = False, 6  # job 7, seen long ago, back (a requeue): described again
    agent.tick()
    assert sink.described[-2:] == ["500", "7"] and len(sink.described) == 501


def test_an_unreachable_dcgm_exporter_is_one_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """The exporter answers at open, then refuses connections: the source says so as SourceUnavailable, which the
    agent logs in one line (a bare RuntimeError would now be taken for a bug)."""
    up = [True]

    def fetch(url: str) -> str:
        if not up[0]:
            raise ConnectionRefusedError(111, "Connection refused")
        return 'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-0"} 100\n'

    source = DcgmExporterSource("http://node1:9400/metrics", fetch=fetch, host="node1")
    agent = Agent(source)
    agent.open()
    up[0] = False
    caplog.set_level(logging.ERROR, logger="gpuledger.agent.sampler")
    assert agent.tick() == [] and agent.errors_total["source"] == 1
    (record,) = [r for r in caplog.records if r.name == "gpuledger.agent.sampler"]
    assert "SourceUnavailable" in record.getMessage() and record.exc_info is None
