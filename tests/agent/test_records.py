"""The shared records: wire forms round-trip exactly; the compact form omits only what is unreported."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuledger.schema.records import GpuProcess, GpuSample, JobRecord

ratio = st.one_of(st.none(), st.floats(0, 1))
samples = st.builds(
    GpuSample,
    ts=st.floats(1e9, 2e9), host=st.sampled_from(["n1", "n2"]), gpu_uuid=st.text(min_size=1, max_size=8),
    gpu_index=st.integers(0, 7), mig=st.one_of(st.none(), st.just("1.0")), sm_active_ratio=ratio,
    dram_bw_ratio=ratio, power_watts=st.one_of(st.none(), st.floats(0, 1000)),
    energy_joules=st.one_of(st.none(), st.floats(0, 1e12)), mem_used_bytes=st.one_of(st.none(), st.integers(0, 2**40)),
    xid_errors=st.lists(st.integers(0, 200), max_size=2).map(tuple),
    processes=st.lists(st.builds(GpuProcess, st.integers(1, 2**22), st.one_of(st.none(), st.integers(0, 2**40))),
                       max_size=2).map(tuple),
    job_ids=st.lists(st.sampled_from(["1", "2_3"]), max_size=2, unique=True).map(tuple),
)


@given(samples)
def test_sample_dict_and_wire_forms_round_trip(s: GpuSample) -> None:
    assert GpuSample.from_dict(s.to_dict()) == s
    wire = s.to_wire()
    assert GpuSample.from_dict(wire) == s
    assert all(v is not None and v != [] for v in wire.values())
    assert {"ts", "host", "gpu_uuid", "gpu_index"} <= wire.keys()


def test_job_record_round_trip() -> None:
    r = JobRecord(job_id="12_3", cluster="c", user="alice", hosts=("n1",), gpus=2, gpu_indexes=(1, 2),
                  tres=(("gres/gpu", 2.0),))
    assert JobRecord.from_dict(r.to_dict()) == r
