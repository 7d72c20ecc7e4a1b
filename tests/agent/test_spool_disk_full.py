"""The node's disk full under the spool (a real tmpfs of 1 MB, we are root in CI and here), with the real collector:
no sequence number is used that a restart could hand out again, a batch the spool cannot store is posted directly,
and what is lost is counted and said."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny_disk import fill, mount_tmpfs, unmount

from gpuledger.agent.exposition import make_registry
from gpuledger.agent.push import HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.agent.spool import SEQ_FILE, SeqFile, Spool, SpoolingPusher
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.schema.records import GpuSample

NOW = time.time()


@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if not mount_tmpfs(mnt, "1m"):
        pytest.skip("needs root to mount a tmpfs")
    yield mnt
    unmount(mnt)


@pytest.fixture
def collector(tmp_path):
    store = Store(tmp_path / "c.sqlite")
    s = CollectorServer(store).start()
    yield s
    s.stop()
    store.close()


def samples(k: int, gpus: int = 2) -> list[GpuSample]:
    return [GpuSample(ts=NOW - 100 + k, host="n1", gpu_uuid=f"GPU-{g}", gpu_index=g, power_watts=100.0)
            for g in range(gpus)]


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp"))


def test_a_reservation_the_full_disk_refuses_is_not_taken(tiny_disk):
    f = SeqFile(tiny_disk / SEQ_FILE, block=4)
    f.reserve(0)
    filler = fill(tiny_disk)
    f.reserve(2)  # half a block left: extending it fails, the number is reserved already
    with pytest.raises(OSError):
        f.reserve(4)
    assert f.reserved == 4 and SeqFile(tiny_disk / SEQ_FILE).reserved == 4
    with pytest.raises(OSError):  # still not persisted: still refused, never taken as reserved
        f.reserve(5)
    assert leftovers(tiny_disk) == []
    filler.unlink()
    f.reserve(5)
    assert f.reserved == 9 == SeqFile(tiny_disk / SEQ_FILE).reserved


def test_a_full_disk_at_a_reservation_never_makes_a_restart_reuse_numbers(tiny_disk, collector, caplog):
    spool_dir = tiny_disk / "spool"
    spool_dir.mkdir()
    (spool_dir / SEQ_FILE).write_text("1000\n")  # this node used every number below 1000 before
    url = collector.url + "/api/v1/samples"
    filler = fill(tiny_disk)
    sp = SpoolingPusher(HttpPusher(url, "a", "n1"), Spool(spool_dir), sleep=lambda s: None)
    for k in range(3):  # each needs a new reservation, which the disk refuses: dropped, said and counted
        sp.write(samples(k))
    assert (sp.stats()["unsent_batches"], sp.stats()["unsent_samples"]) == (3, 6)
    assert collector.store.batches_seen() == 0
    assert "3 batch(es) (6 samples) neither spooled nor delivered" in sp.summary()
    assert any("cannot be persisted" in r.getMessage() for r in caplog.records)
    filler.unlink()
    for k in range(3, 6):
        sp.write(samples(k))
    assert sp.drain() is True and sp.sent_batches == 3
    sp.close()
    again = SpoolingPusher(HttpPusher(url, "a", "n1"), Spool(spool_dir), sleep=lambda s: None)
    for k in range(6, 9):  # a restart continues after every number used: the collector stores each batch
        again.write(samples(k))
    assert again.drain() is True and again.rejected_batches == 0 and again.sent_batches == 3
    again.close()
    assert collector.store.totals()["samples"] == 12 and collector.store.batches_seen() == 6


def test_a_batch_the_full_disk_cannot_spool_goes_directly_and_no_temporary_file_is_left(tiny_disk, collector,
                                                                                       caplog):
    spool_dir = tiny_disk / "spool"
    url = collector.url + "/api/v1/samples"
    sp = SpoolingPusher(HttpPusher(url, "a", "n1", seq_start=1), Spool(spool_dir), fmt="json", compress=None,
                        sleep=lambda s: None)
    agent = Agent(SimulatedSource(host="n1", gpus=64, clock=iter(NOW - 300 + i for i in range(100)).__next__),
                  sinks=[sp])
    agent.tick()  # reserves a block of numbers, while there is room
    filler = fill(tiny_disk)
    for _ in range(5):
        agent.tick()
    assert leftovers(spool_dir) == [] and agent.errors_total["sink"] == 0
    assert collector.store.totals()["samples"] == 5 * 64 and sp.stats()["unsent_batches"] == 0
    assert sp.drain() is True and collector.store.totals()["samples"] == 6 * 64
    fill(tiny_disk)  # what the delivered batch freed
    collector.stop()  # and now the collector is gone too: counted as lost, on /metrics and in the summary
    agent.tick()
    values = {s.name: s.value for f in text_string_to_metric_families(generate_latest(make_registry(agent)).decode())
              for s in f.samples}
    assert values["gpuledger_agent_push_unsent_batches_total"] == 1
    assert values["gpuledger_agent_push_unsent_samples_total"] == 64
    assert "1 batch(es) (64 samples) neither spooled nor delivered" in sp.summary()
    assert leftovers(spool_dir) == []
    filler.unlink()
    agent.tick()  # room again: spooled; the sender finds the collector down
    assert sp.drain(max_attempts=1) is False and sp.spool.depth == 1
    fill(tiny_disk)
    agent.tick()  # not posted (it would wait on a collector known down): dropped at once, said
    assert sp.stats()["unsent_batches"] == 2
    assert any("unreachable at the last attempt" in r.getMessage() for r in caplog.records)
    filler.unlink()
    agent.close()
