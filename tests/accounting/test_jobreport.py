"""Per-job efficiency reports from a real store: per-GPU numbers, events and the notes with their numbers."""

from __future__ import annotations

import json

import pytest

from gpuledger.accounting.jobreport import Rules, load_job_report, to_json, to_text
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

GIB = 1 << 30
T0 = 1_790_000_000.0
H200_MEM = 141 * GIB


def _samples(host, gpu, job, n=31, sm=0.5, mem=10 * GIB, dram=0.3, tensor=0.4, xid_at=(), throttle_every=0):
    out = []
    for k in range(n):
        out.append(GpuSample(
            ts=T0 + 10 * k, host=host, gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200",
            sm_active_ratio=sm, sm_occupancy_ratio=sm / 2, dram_bw_ratio=dram, tensor_active_ratio=tensor,
            mem_used_bytes=mem, mem_total_bytes=H200_MEM, power_watts=100 + 500 * sm, energy_joules=1000.0 * k,
            xid_errors=(79,) if k in xid_at else (),
            throttle_reasons=(0x40 if throttle_every and k % throttle_every == 0 else 0),
            job_ids=(job,),
        ))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("jr") / "gpuledger.sqlite", clock=lambda: T0 + 1000)
    batch = []
    batch += _samples("n1", "G0", "21", sm=0.1, mem=10 * GIB)  # one GPU, lightly used: a MIG slice
    batch += _samples("n1", "G1", "22", sm=0.9, mem=20 * GIB, xid_at=(5,), throttle_every=2)
    for g in ("G2", "G3", "G4"):
        batch += _samples("n1", g, "22", sm=0.02, mem=20 * GIB, tensor=0.0)  # three idle GPUs
    batch += _samples("n1", "G5", "23", sm=0.6, dram=0.8, tensor=0.05, mem=100 * GIB)  # memory-bound
    s.ingest(Batch("a", 0, "n1", tuple(batch)))
    s.put_jobs([JobRecord("21", user="alice", account="a", gpus=1, submit=T0 - 600, start=T0, end=T0 + 300,
                          state="COMPLETED"),
                JobRecord("22", user="bob", account="a", gpus=4, start=T0, end=T0 + 300)])
    yield s
    s.close()


def _rules(rep):
    return {n.rule: n for n in rep.notes}


def test_single_gpu_light_job_fits_a_mig_slice(store):
    rep = load_job_report(store, "21")
    assert len(rep.gpus) == 1 and rep.gpus[0].events.samples == 31
    mig = _rules(rep)["mig_slice"]
    assert mig.numbers["slice"] == "1g" and mig.numbers["sm_active_mean"] == pytest.approx(0.1)
    assert mig.numbers["mem_peak_bytes"] == 10 * GIB and mig.numbers["mem_total_bytes"] == H200_MEM
    assert "low_efficiency" in _rules(rep) and "idle_gpu" not in _rules(rep)
    text = to_text(rep)
    assert "Job 21" in text and "queued 0.17 h" in text and "[mig_slice]" in text


def test_idle_gpus_fewer_gpus_xid_and_throttling(store):
    rep = load_job_report(store, "22")
    assert len(rep.gpus) == 4
    idle = [n for n in rep.notes if n.rule == "idle_gpu"]
    assert sorted(n.numbers["gpu"] for n in idle) == ["n1/G2", "n1/G3", "n1/G4"]
    fewer = _rules(rep)["fewer_gpus"]
    # summed SM activity 0.9 + 3 x 0.02 = 0.96 -> ceil(0.96 / 0.8) = 2 GPUs; memory 80 GiB fits one
    assert fewer.numbers["fits_on"] == 2 and fewer.numbers["sum_sm_active"] == pytest.approx(0.96)
    xid = _rules(rep)["xid"]
    assert xid.numbers == {"gpu": "n1/G1", "xid": 79, "samples": 1} and "fallen off the bus" in xid.message
    thr = _rules(rep)["throttling"]
    assert thr.numbers["reasons"] == {"hw_thermal": 16} and thr.numbers["samples"] == 31
    doc = json.loads(to_json(rep))
    assert doc["gpus"][0]["events"]["xid"] == {"79": 1} and doc["record"]["user"] == "bob"


def test_memory_bound_job_without_scheduler_record(store):
    rep = load_job_report(store, "23")
    mb = _rules(rep)["memory_bound"]
    assert mb.numbers["dram_bw_mean"] == pytest.approx(0.8) and mb.numbers["tensor_active_mean"] == pytest.approx(0.05)
    assert rep.record is None and "measured only" in to_text(rep)
    # with a stricter rule the note goes away: the thresholds are configuration, not constants
    assert "memory_bound" not in _rules(load_job_report(store, "23", Rules(memory_bound_dram=0.9)))


def test_unknown_job_and_bad_rules(store):
    with pytest.raises(LookupError, match="job 999"):
        load_job_report(store, "999")
    with pytest.raises(ValueError, match="report.rules.idle_sm: expected a ratio"):
        Rules.from_mapping({"idle_sm": 5})
    with pytest.raises(ValueError, match="report.rules.bogus: unknown"):
        Rules.from_mapping({"bogus": 0.1})


def test_job_on_a_mig_instance_reads_that_instance_samples(tmp_path):
    """A job on a MIG instance: the report reads the instance's raw samples (its Xid is counted)."""
    s = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T0 + 1000)
    samples = [GpuSample(**{**smp.to_dict(), "mig": "1g.18gb"}) for smp in _samples("n1", "G0", "31", xid_at=(3,))]
    s.ingest(Batch("a", 0, "n1", tuple(samples)))
    try:
        rep = load_job_report(s, "31")
    finally:
        s.close()
    (gpu,) = rep.gpus
    assert gpu.usage.gpu_uuid == "G0/1g.18gb"
    assert gpu.events.samples == 31 and gpu.events.xid == {79: 1}
