"""parse_dcgm_exporter against every capture in tests/data/dcgm-exporter, and the scrape source."""

from __future__ import annotations

from pathlib import Path

import pytest
from http_page import serve
from hypothesis import given
from hypothesis import strategies as st
from testdata import DATA_ROOT, capture  # noqa: F401

from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.dcgm_exporter import DcgmExporterSource, parse_dcgm_exporter
from gpuledger.schema.records import RATIO_FIELDS, GpuSample

CAPTURES = DATA_ROOT / "dcgm-exporter"
MIB = 1024 * 1024


def parse(name: str, **kw) -> list[GpuSample]:
    return parse_dcgm_exporter((CAPTURES / name).read_text(), ts=1700000000.0, **kw)


def by_key(samples: list[GpuSample]) -> dict[tuple[str, str | None], GpuSample]:
    out = {(s.gpu_uuid, s.mig): s for s in samples}
    assert len(out) == len(samples), "one sample per GPU / MIG instance"
    return out


def test_every_capture_is_covered() -> None:
    names = sorted(p.name for p in CAPTURES.glob("*.prom"))
    assert names == sorted(TESTED), "a new capture needs a test with values read from it"


def test_l4_full_scrape() -> None:
    (s,) = parse("l4-1gpu-k8s-full.prom")
    assert (s.host, s.gpu_uuid, s.gpu_index, s.model, s.mig) == (
        "i-030791dc5a37cd257", "GPU-c2f76b33-7953-256e-8f33-1343419b1a1c", 0, "NVIDIA L4", None)
    assert s.ts == 1700000000.0 and s.source == "dcgm-exporter"
    assert s.sm_clock_hz == 210e6 and s.mem_clock_hz == 405e6  # MHz -> Hz
    assert s.temp_celsius == 31.0
    assert s.power_watts == pytest.approx(16.365)
    assert s.energy_joules == pytest.approx(4742.776)  # 4742776 mJ
    assert s.gpu_util_ratio == 0.0 and s.mem_copy_util_ratio == 0.0
    assert s.mem_used_bytes == 0
    assert s.mem_total_bytes == (22563 + 0 + 470) * MIB  # free + used + reserved
    assert (s.dram_bw_ratio, s.tensor_active_ratio) == (0.0, 0.0)
    assert s.sm_active_ratio is None  # SM_ACTIVE is not a default counter
    assert (s.pcie_tx_bytes_per_second, s.pcie_rx_bytes_per_second) == (112603.0, 17544.0)
    assert s.remapped_rows_total == 0
    assert s.job_ids == ()


def test_h100_eight_gpus() -> None:
    samples = parse("h100-8gpu-k8s-sampled.prom")
    assert [s.gpu_index for s in samples] == list(range(8))
    assert {s.host for s in samples} == {"gpu-node-1"}
    s0, s2 = samples[0], samples[2]
    assert s0.gpu_uuid == "GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005" and s0.model == "NVIDIA H100 80GB HBM3"
    assert (s0.temp_celsius, s0.power_watts, s0.gpu_util_ratio) == (30.0, pytest.approx(113.611), 0.0)
    assert (s2.temp_celsius, s2.power_watts) == (26.0, pytest.approx(65.709))
    assert samples[5].mem_copy_util_ratio == 0.0
    assert samples[6].mem_copy_util_ratio is None  # MEM_COPY_UTIL sampled for GPUs 0-5 only
    assert all(s.energy_joules is None for s in samples)
    assert sum(s.power_watts for s in samples) == pytest.approx(
        113.611 + 68.347 + 65.709 + 67.316 + 68.717 + 65.742 + 67.328 + 66.997)


def test_t4_profiling_ratios() -> None:
    samples = parse("t4-2gpu-gke-prof-pods.prom")
    assert [(s.gpu_index, s.model) for s in samples] == [(0, "Tesla T4"), (1, "Tesla T4")]
    assert samples[1].gpu_uuid == "GPU-4812b59b-1f1a-430f-d8a4-69d2ee8c18bb"
    for s in samples:
        assert (s.sm_active_ratio, s.sm_occupancy_ratio, s.tensor_active_ratio) == (0.0, 0.0, 0.0)
        assert s.host == "gke-test-dcgm-default-pool-fed1e979-tt7p"


def test_h100_mig_instances() -> None:
    samples = parse("h100-mig-k8s-fragment.prom")
    assert [s.mig for s in samples] == ["7", "8", "9"]  # no device-level values: no parent sample
    for s in samples:
        assert s.gpu_uuid == "GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77" and s.gpu_index == 0
        assert s.model == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        assert s.gpu_util_ratio == 0.0  # PROF_GR_ENGINE_ACTIVE stands in for GPU_UTIL on MIG
        assert s.host == "gsrh100-074"


def test_a30_mig_power_counted_once() -> None:
    samples = by_key(parse("a30-mig-fragment.prom"))
    gpu0, gpu1 = "GPU-265c9814-6156-355b-e589-ff2064894f16", "GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49"
    assert [k for k in samples if k[0] == gpu0] == [(gpu0, None), (gpu0, "3"), (gpu0, "4"), (gpu0, "5"), (gpu0, "6")]
    # The exporter repeats device power on each of the 4 instances (52.636, 52.636, 52.746, 52.746):
    # the GPU's own sample carries it once (the latest reading), the instances carry none.
    assert samples[(gpu0, None)].power_watts == pytest.approx(52.746)
    assert samples[(gpu1, None)].power_watts == pytest.approx(56.127)
    assert samples[(gpu0, None)].sm_clock_hz == 1440e6
    assert all(s.power_watts is None and s.sm_clock_hz is None for k, s in samples.items() if k[1])
    total = sum(s.power_watts or 0.0 for s in samples.values())
    assert total == pytest.approx(52.746 + 56.127)  # not 4x + 2x
    assert samples[(gpu1, "4")].model == "NVIDIA A30 MIG 1g.6gb"


def test_mixed_node_lowercase_hostname() -> None:
    samples = by_key(parse("mixed-ada-a30mig-k8s-fragment.prom"))
    ada = samples[("GPU-fc60126e-514d-3522-2828-c5daa8e99d85", None)]
    mig = samples[("GPU-63bc0b91-2265-1b94-831c-15c41fe92675", "3")]
    assert ada.host == mig.host == "dcgm-exporter-wwwjh"
    assert (ada.gpu_index, ada.model) == (1, "NVIDIA RTX 2000 Ada Generation")
    assert (mig.gpu_index, mig.model) == (2, "NVIDIA A30 MIG 1g.6gb")
    assert ada.mem_used_bytes is None and ada.mem_total_bytes is None  # FB_FREE alone gives neither
    assert len(samples) == 2


def test_host_argument_overrides_label() -> None:
    (s,) = parse("l4-1gpu-k8s-full.prom", host="gpu-node-17")
    assert s.host == "gpu-node-17"


TESTED = {
    "l4-1gpu-k8s-full.prom", "h100-8gpu-k8s-sampled.prom", "t4-2gpu-gke-prof-pods.prom",
    "h100-mig-k8s-fragment.prom", "a30-mig-fragment.prom", "mixed-ada-a30mig-k8s-fragment.prom",
    # hand-written (see its .source.txt); tests in test_mig_dcgm_exporter.py
    "synthetic-a100-mig-instance-rows-only.prom",
}


def _with_jobs(line: str, jobs: list[str]) -> str:
    head, value = line.rsplit(" ", 1)
    return "\n".join(f'{head[:-1]},hpc_job="{j}"}} {value}' for j in jobs)


def test_hpc_job_copies_make_one_sample_with_all_jobs() -> None:
    # The L4 capture's lines, as the exporter emits them with a mapping file holding two job ids.
    lines = [ln for ln in (CAPTURES / "l4-1gpu-k8s-full.prom").read_text().splitlines()
             if ln.startswith(("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"))]
    text = "\n".join(_with_jobs(ln, ["4242", "4243_7", ""]) for ln in lines) + "\n"
    (s,) = parse_dcgm_exporter(text, ts=1.0)
    assert s.job_ids == ("4242", "4243_7")  # empty hpc_job ignored
    assert s.power_watts == pytest.approx(16.365) and s.energy_joules == pytest.approx(4742.776)


def test_mig_hpc_job_stays_on_its_instance() -> None:
    text = (
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",Hostname="h",'
        'hpc_job="77"} 52.5\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a",GPU_I_PROFILE="1g.6gb",GPU_I_ID="4",Hostname="h"} 52.6\n'
        'DCGM_FI_PROF_SM_ACTIVE{gpu="0",UUID="GPU-a",GPU_I_PROFILE="1g.6gb",GPU_I_ID="3",Hostname="h",'
        'hpc_job="77"} 0.25\n'
    )
    s = by_key(parse_dcgm_exporter(text, ts=1.0))
    assert s[("GPU-a", "3")].job_ids == ("77",) and s[("GPU-a", "3")].sm_active_ratio == 0.25
    assert s[("GPU-a", "4")].job_ids == () and s[("GPU-a", None)].job_ids == ()
    assert s[("GPU-a", None)].power_watts == 52.6


def test_blank_sentinels_are_none() -> None:
    text = (
        'DCGM_FI_DEV_MEMORY_TEMP{gpu="0",UUID="GPU-a",Hostname="h"} 9223372036854775794\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",Hostname="h"} 9223372036854775794\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a",Hostname="h"} 140737488355328.0\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",Hostname="h"} NaN\n'
        'DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a",Hostname="h"} 1410\n'
    )
    (s,) = parse_dcgm_exporter(text, ts=1.0)
    assert (s.temp_celsius, s.power_watts, s.gpu_util_ratio, s.sm_clock_hz) == (None, None, None, 1410e6)


@given(pct=st.integers(0, 100), mib=st.integers(0, 200_000), mj=st.integers(0, 2**53), mhz=st.integers(0, 3000))
def test_unit_conversions(pct: int, mib: int, mj: int, mhz: int) -> None:
    lab = '{gpu="3",UUID="GPU-p",Hostname="h"}'
    text = (f"DCGM_FI_DEV_GPU_UTIL{lab} {pct}\nDCGM_FI_DEV_FB_USED{lab} {mib}\n"
            f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{lab} {mj}\nDCGM_FI_DEV_MEM_CLOCK{lab} {mhz}\n")
    (s,) = parse_dcgm_exporter(text, ts=1.0)
    assert s.gpu_util_ratio == pytest.approx(pct / 100)
    assert s.mem_used_bytes == mib * MIB
    assert s.energy_joules == pytest.approx(mj / 1000)
    assert s.mem_clock_hz == mhz * 1e6
    for f in RATIO_FIELDS:
        v = getattr(s, f)
        assert v is None or 0.0 <= v <= 1.0


def test_source_fetches_and_parses() -> None:
    text = (CAPTURES / "l4-1gpu-k8s-full.prom").read_text()
    urls: list[str] = []

    def fetch(url: str) -> str:
        urls.append(url)
        return text

    src = DcgmExporterSource("http://node1:9400/metrics", fetch=fetch, host="node1", clock=lambda: 5.0)
    src.open()
    (s,) = src.sample()
    src.close()
    assert (s.host, s.ts, s.energy_joules) == ("node1", 5.0, pytest.approx(4742.776))
    assert urls == ["http://node1:9400/metrics"] * 2


def test_source_unavailable_names_url() -> None:
    def refuse(url: str) -> str:
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(SourceUnavailable, match="http://node1:9400/metrics.*refused"):
        DcgmExporterSource("http://node1:9400/metrics", fetch=refuse).open()
    with pytest.raises(SourceUnavailable, match="no DCGM_FI_"):
        DcgmExporterSource("http://node1:9400/metrics", fetch=lambda u: "up 1\n").open()


def test_source_real_http_fetch(tmp_path: Path) -> None:
    # The default fetch (httpx) against a real local HTTP server serving a capture.
    server = serve((CAPTURES / "t4-2gpu-gke-prof-pods.prom").read_bytes())
    try:
        src = DcgmExporterSource(f"http://127.0.0.1:{server.server_port}/metrics")
        src.open()
        samples = src.sample()
        src.close()
    finally:
        server.shutdown()
        server.server_close()
    assert [s.gpu_index for s in samples] == [0, 1]
