"""dcgm-exporter on MIG GPUs, DCGM 4.6 names, the SM-activity start-up check and the sticky Xid (issues #12, #18).

The MIG page is ``synthetic-a100-mig-instance-rows-only.prom``: a hand-written page (no public real one with
the energy counter repeated on instance rows exists; see its .source.txt) with no parent row, every instance
row repeating the GPU's power (78.012/78.012/78.104 W) and energy counter (258001234/258001234/258009034 mJ).
"""

from __future__ import annotations

import json
import logging
import math

import pytest
from http_page import serve
from testdata import capture
from typer.testing import CliRunner

from gpuledger.agent.cli import app
from gpuledger.agent.mig import MigEnergySplitter
from gpuledger.agent.sources.dcgm_exporter import DcgmExporterSource, missing_sm_activity, parse_dcgm_exporter

PAGE = capture("dcgm-exporter/synthetic-a100-mig-instance-rows-only.prom").read_text()
UUID = "GPU-5d3c2b1a-0f9e-4d8c-b7a6-958473625140"
POWER_W = 78.104  # the latest of the repeated readings
ENERGY_J = 258009.034
LABELS = f'gpu="0",UUID="{UUID}",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="a100-mig-01"'


def _with_parent_row(page: str, power: float = 78.05, energy_mj: int = 258005000) -> str:
    return page + (f"DCGM_FI_DEV_POWER_USAGE{{{LABELS}}} {power:.6f}\n"
                   f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{LABELS}}} {energy_mj}\n")


def _new_names(page: str) -> str:
    """The same page as an exporter configured with DCGM 4.6 field names prints it."""
    for old, new in (("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
                     ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
                     ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"),
                     ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO"),
                     ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
                     ("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO"),
                     ("UUID=", "GPU_UUID=")):
        page = page.replace(old, new)
    return page


@pytest.mark.parametrize("page", [PAGE, _with_parent_row(PAGE), _new_names(PAGE)],
                         ids=["instance-rows-only", "parent-and-instance-rows", "dcgm-4.6-names"])
def test_physical_power_and_energy_once_shared_by_instances(page: str) -> None:
    split = MigEnergySplitter()
    out = split.map(parse_dcgm_exporter(page, ts=100.0))
    assert [(s.gpu_uuid, s.mig) for s in out] == [(UUID, None), (UUID, "1"), (UUID, "5"), (UUID, "13")]
    parent, *insts = out
    assert parent.power_watts is None and parent.energy_joules is None  # carried by the instances
    # Exactly once: the instances' shares sum to the GPU's power and counter, not 0x and not 3x.
    assert math.fsum(s.power_watts for s in insts) == pytest.approx(POWER_W)
    assert math.fsum(s.energy_joules for s in insts) == pytest.approx(ENERGY_J)
    assert parent.temp_celsius == 44.0 and all(s.temp_celsius is None for s in insts)
    # Shares by the documented rule: activity (GR_ENGINE_ACTIVE stands in for the SM activity the stock
    # counters lack) x slice fraction for power; the counter's starting value by slice fraction.
    p1, p5, p13 = (s.power_watts for s in insts)
    assert p13 == 0.0 and p1 / p5 == pytest.approx((3 / 7 * 0.812345) / (2 / 7 * 0.251))
    e1, e5, e13 = (s.energy_joules for s in insts)
    assert (e1 / ENERGY_J, e5 / ENERGY_J, e13 / ENERGY_J) == pytest.approx((3 / 6, 2 / 6, 1 / 6))
    # GPU_UTIL reads 0 on busy MIG instances: their utilisation is GR_ENGINE_ACTIVE.
    assert [s.gpu_util_ratio for s in insts] == [0.812345, 0.251, 0.0]
    assert [s.mem_used_bytes for s in insts] == [10240 * 2**20, 10112 * 2**20, 128 * 2**20]


def test_deltas_are_shared_and_sum_to_the_gpus() -> None:
    split = MigEnergySplitter(idle_watts=50.0)
    first = split.map(parse_dcgm_exporter(PAGE, ts=100.0))
    later = PAGE.replace("258009034", "258789034").replace("258001234", "258781234")  # +780 J over 10 s
    second = split.map(parse_dcgm_exporter(later, ts=110.0))
    d = [b.energy_joules - a.energy_joules for a, b in zip(first[1:], second[1:])]
    assert math.fsum(d) == pytest.approx(780.0)
    # The idle 1g instance pays only its slice of the 50 W floor (slices normalised over the 6 of 7 in use).
    assert d[2] == pytest.approx(500.0 / 6)


def test_agent_once_counts_the_mig_gpu_exactly_once() -> None:
    server = serve(PAGE.encode())
    try:
        result = CliRunner().invoke(app, ["once", "--source", "dcgm-exporter", "--url",
                                          f"http://127.0.0.1:{server.server_port}/metrics", "--host", "n1"])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout[result.stdout.index("["):])
    assert math.fsum(r["power_watts"] or 0.0 for r in rows) == pytest.approx(POWER_W)
    assert math.fsum(r["energy_joules"] or 0.0 for r in rows) == pytest.approx(ENERGY_J)


def test_startup_check_names_the_sm_activity_counters(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuledger.agent.sources.dcgm_exporter")
    src = DcgmExporterSource("http://n1:9400/metrics", fetch=lambda url: PAGE)
    src.open()
    (warning,) = [r.getMessage() for r in caplog.records]
    for counter in ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_UTIL_RATIO"):
        assert counter in warning
    assert src.health.unavailable == {("sm_active_ratio", "not_exported"): 1, ("sm_occupancy_ratio", "not_exported"): 1}
    with_sm = PAGE + f'DCGM_FI_PROF_SM_UTIL_RATIO{{{LABELS},GPU_I_PROFILE="3g.40gb",GPU_I_ID="1"}} 0.5\n'
    assert missing_sm_activity(with_sm) == ()
    samples = parse_dcgm_exporter(with_sm, ts=1.0)
    assert next(s for s in samples if s.mig == "1").sm_active_ratio == 0.5  # the 4.6 name is read


def test_sticky_xid_counts_once_and_stays_on_its_instance() -> None:
    xid_page = PAGE.replace('DCGM_FI_DEV_XID_ERRORS{' + LABELS.replace(',Hostname="a100-mig-01"', '')
                            + ',GPU_I_PROFILE="2g.20gb",GPU_I_ID="5",Hostname="a100-mig-01"} 0',
                            'DCGM_FI_DEV_XID_ERRORS{' + LABELS.replace(',Hostname="a100-mig-01"', '')
                            + ',GPU_I_PROFILE="2g.20gb",GPU_I_ID="5",Hostname="a100-mig-01"} 43')
    assert xid_page != PAGE
    texts = iter([PAGE, xid_page, xid_page])
    src = DcgmExporterSource("http://n1:9400/metrics", fetch=lambda url: next(texts))
    src._fetch = src._fetch_arg  # opened without the start-up scrape
    seen = [[(s.mig, s.xid_errors) for s in src.sample() if s.xid_errors] for _ in range(3)]
    assert seen == [[], [("5", (43,))], []]  # one event, on instance 5, not +1 every scrape
