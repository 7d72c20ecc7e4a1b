"""Prometheus exposition of the snapshot: names, no invented zeros, no leftover job series."""

from __future__ import annotations

import dataclasses
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuledger.agent.exposition import make_registry, serve_metrics
from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.mig import MigEnergySplitter
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.schema.records import GpuSample


def scrape(agent: Agent) -> str:
    return generate_latest(make_registry(agent)).decode()


def families(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


class FixedSource:
    """Returns the samples given to it (a GPU that reports only some fields)."""

    name = "fixed"

    def __init__(self, samples: list[GpuSample]) -> None:
        self.samples = samples

    def open(self) -> None: ...

    def close(self) -> None: ...

    def sample(self) -> list[GpuSample]:
        return list(self.samples)


def test_names_labels_and_values() -> None:
    src = SimulatedSource(host="n1", gpus=2, clock=lambda: 1_700_000_000.0, profiles={0: "training"})
    agent = Agent(src, mappers=[StaticMapper({0: "1234"})])
    snap = agent.tick()
    text = scrape(agent)
    for name in (
        "gpuledger_gpu_sm_active_ratio",
        "gpuledger_gpu_sm_occupancy_ratio",
        "gpuledger_gpu_dram_bandwidth_ratio",
        "gpuledger_gpu_tensor_active_ratio",
        "gpuledger_gpu_utilization_ratio",
        "gpuledger_gpu_memory_used_bytes",
        "gpuledger_gpu_memory_total_bytes",
        "gpuledger_gpu_power_watts",
        "gpuledger_gpu_energy_joules_total",
        "gpuledger_gpu_temperature_celsius",
        "gpuledger_gpu_sm_clock_hertz",
        "gpuledger_gpu_job_info",
        "gpuledger_agent_ticks_total",
        "gpuledger_agent_errors_total",
        "gpuledger_agent_tick_seconds",
    ):
        assert f"\n{name}" in text or text.startswith(name), name
    type_lines = [ln for ln in text.splitlines() if ln.startswith("# TYPE gpuledger_gpu_energy_joules")]
    assert len(type_lines) == 1 and type_lines[0].endswith(" counter")
    fams = families(text)
    power = {s.labels["gpu"]: s for s in fams["gpuledger_gpu_power_watts"]}
    assert power["0"].labels == {"host": "n1", "gpu": "0", "uuid": snap[0].gpu_uuid, "model": "NVIDIA H200", "mig": ""}
    assert power["0"].value == snap[0].power_watts
    energy = [s for s in fams["gpuledger_gpu_energy_joules"] if s.name.endswith("_total")]
    assert sorted(s.value for s in energy) == sorted(s.energy_joules for s in snap)
    # Job ids live only on the info metric (and the share metric of a GPU split unequally).
    info = fams["gpuledger_gpu_job_info"]
    assert [(s.labels["gpu"], s.labels["jobid"], s.value) for s in info] == [("0", "1234", 1.0)]
    for name, samples in fams.items():
        if name not in ("gpuledger_gpu_job_info", "gpuledger_gpu_job_share_ratio"):
            assert all("jobid" not in s.labels and "job" not in s.labels for s in samples), name
    assert fams["gpuledger_agent_ticks"][0].value == 1.0
    assert {s.labels["kind"]: s.value for s in fams["gpuledger_agent_errors"]} == {
        "source": 0.0, "mapper": 0.0, "sink": 0.0, "internal": 0.0,
    }


def test_none_is_omitted_not_zero() -> None:
    partial = GpuSample(ts=1.0, host="h", gpu_uuid="GPU-a", gpu_index=0, model="Tesla V100", power_watts=55.5,
                        mig="1.0")
    full = GpuSample(ts=1.0, host="h", gpu_uuid="GPU-b", gpu_index=1, power_watts=0.0, sm_active_ratio=0.0)
    agent = Agent(FixedSource([partial, full]))
    agent.tick()
    fams = families(scrape(agent))
    assert "gpuledger_gpu_energy_joules" not in fams
    assert "gpuledger_gpu_temperature_celsius" not in fams
    # A reported zero is exported; a missing value is not.
    assert [(s.labels["uuid"], s.value) for s in fams["gpuledger_gpu_sm_active_ratio"]] == [("GPU-b", 0.0)]
    assert {s.labels["uuid"]: s.value for s in fams["gpuledger_gpu_power_watts"]} == {"GPU-a": 55.5, "GPU-b": 0.0}
    assert {s.labels["uuid"]: s.labels["mig"] for s in fams["gpuledger_gpu_power_watts"]} == {"GPU-a": "1.0",
                                                                                              "GPU-b": ""}


def test_jobs_shares_and_power_limit() -> None:
    # What the collector also ships to VictoriaMetrics (collector.victoriametrics): one vocabulary for both.
    split = GpuSample(ts=1.0, host="h", gpu_uuid="GPU-a", gpu_index=0, power_limit_watts=700.0,
                      job_ids=("1", "2"), job_shares=(0.25, 0.75))
    free = GpuSample(ts=1.0, host="h", gpu_uuid="GPU-b", gpu_index=1)
    agent = Agent(FixedSource([split, free]))
    agent.tick()
    fams = families(scrape(agent))
    assert {s.labels["uuid"]: s.value for s in fams["gpuledger_gpu_jobs"]} == {"GPU-a": 2.0, "GPU-b": 0.0}
    assert {s.labels["jobid"]: s.value for s in fams["gpuledger_gpu_job_share_ratio"]} == {"1": 0.25, "2": 0.75}
    assert [s.value for s in fams["gpuledger_gpu_power_limit_watts"]] == [700.0]
    equal = Agent(FixedSource([GpuSample(ts=1.0, host="h", gpu_uuid="GPU-a", gpu_index=0, job_ids=("1", "2"))]))
    equal.tick()
    assert "gpuledger_gpu_job_share_ratio" not in families(scrape(equal))  # split equally: no share series


def test_finished_job_leaves_no_series() -> None:
    mapper = StaticMapper({0: "77", 1: ["88", "89"]})
    agent = Agent(SimulatedSource(gpus=2, profiles={0: "training", 1: "inference"}), mappers=[mapper])
    registry = make_registry(agent)
    agent.tick()
    before = generate_latest(registry).decode()
    assert 'jobid="77"' in before and 'jobid="88"' in before and 'jobid="89"' in before
    mapper.clear(0)
    mapper.clear(1)
    agent.tick()
    after = generate_latest(registry).decode()
    assert "jobid=" not in after
    assert 'gpuledger_gpu_power_watts{' in after  # the GPUs themselves are still there


def test_self_metrics_count_errors() -> None:
    class Broken(FixedSource):
        def sample(self) -> list[GpuSample]:
            raise RuntimeError("driver gone")

    agent = Agent(Broken([]))
    agent.tick()
    agent.tick()
    fams = families(scrape(agent))
    assert {s.labels["kind"]: s.value for s in fams["gpuledger_agent_errors"]}["source"] == 2.0
    assert "gpuledger_gpu_power_watts" not in fams
    assert fams["gpuledger_agent_gpus"][0].value == 0.0


def test_serve_metrics_on_port_zero() -> None:
    agent = Agent(SimulatedSource(gpus=1, profiles={0: "training"}))
    agent.tick()
    server = serve_metrics(agent, 0)
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert "gpuledger_gpu_power_watts{" in body
        # A fresh registry: none of the process-global default collectors.
        assert "python_gc_objects_collected_total" not in body
    finally:
        server.shutdown()


def test_xid_errors_exported_as_a_counter_per_gpu() -> None:
    from nvml_fake import FakeNvml, Scenario

    from gpuledger.agent.sources.nvml import NvmlSource

    t = [1000.0]
    lib = FakeNvml(Scenario.node(2), clock=lambda: t[0])
    agent = Agent(NvmlSource(lib=lib, host="n1", clock=lambda: t[0]))
    agent.open()
    agent.tick()
    lib.inject_xid(1, 48)
    lib.inject_xid(1, 63)
    t[0] += 1
    agent.tick()
    t[0] += 1
    agent.tick()  # no new Xid: the counter keeps its value
    values = {s.labels["gpu"]: s.value for f in text_string_to_metric_families(scrape(agent))
              if f.name == "gpuledger_gpu_xid_errors" for s in f.samples if s.name.endswith("_total")}
    assert values == {"1": 2.0}


def test_the_xid_counter_moves_when_its_gpu_is_lost_and_keeps_its_labels() -> None:
    """Xid 13 on GPU 1, which is then lost; Xid 48 and 79 (fell off the bus) on GPU 0 in one poll. The counter
    counts every Xid at once, lost GPU or not, keeps each series' labels (model too) and, when the GPUs are back
    and their samples carry the held Xids, counts none again."""
    from nvml_fake import FakeNvml, Scenario

    from gpuledger.agent.sources.nvml import NvmlSource

    t = [1000.0]
    lib = FakeNvml(Scenario.node(2), clock=lambda: t[0])
    agent = Agent(NvmlSource(lib=lib, host="n1", clock=lambda: t[0], reopen_backoff_s=(30.0, 30.0)))
    agent.open()

    def xids() -> dict[str, tuple[str, float]]:
        fam = families(scrape(agent))["gpuledger_gpu_xid_errors"]
        return {s.labels["gpu"]: (s.labels["model"], s.value) for s in fam if s.name.endswith("_total")}

    lib.inject_xid(1, 13)
    agent.tick()
    h100 = "NVIDIA H100 80GB HBM3"
    assert xids() == {"1": (h100, 1.0)}
    lib.lose(1)
    t[0] += 1
    assert [s.gpu_index for s in agent.tick()] == [0]
    assert xids() == {"1": (h100, 1.0)}  # the same series, though GPU 1 has left the snapshot
    lib.inject_xid(0, 48)
    lib.inject_xid(0, 79)
    t[0] += 1
    assert agent.tick() == []  # both GPUs lost
    assert xids() == {"0": (h100, 2.0), "1": (h100, 1.0)}
    lib.revive(0)
    lib.revive(1)
    t[0] += 30
    assert [s.xid_errors for s in agent.tick()] == [(48, 79), ()]  # the held Xids go out after the re-open
    assert xids() == {"0": (h100, 2.0), "1": (h100, 1.0)}


def test_failed_reads_are_exported_by_field() -> None:
    from nvml_fake import FakeNvml, Scenario

    from gpuledger.agent.sources.nvml import NvmlSource

    class PowerBug(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):  # a binding bug on GPU 1 only (e.g. a ctypes TypeError)
            if handle.gpu == 1:
                raise TypeError("bad ctypes argument")
            return super().nvmlDeviceGetPowerUsage(handle)

    t = [1000.0]
    lib = PowerBug(Scenario.node(2), clock=lambda: t[0])
    agent = Agent(NvmlSource(lib=lib, host="n1", clock=lambda: t[0]))
    agent.open()
    for _ in range(3):
        lib.fail_next("nvmlDeviceGetTotalEnergyConsumption")  # NVML_ERROR_UNKNOWN, one GPU a tick
        t[0] += 1
        agent.tick()
    fam = families(scrape(agent))
    got = {(s.labels["source"], s.labels["field"]): s.value for s in fam["gpuledger_agent_source_call_errors"]}
    assert got == {("nvml", "energy_joules"): 3.0, ("nvml", "power_watts"): 3.0}
    assert [(s.labels["source"], s.value) for s in fam["gpuledger_agent_source_unexpected_errors"]] == [("nvml", 3.0)]
    assert not fam.get("gpuledger_agent_unavailable_fields")  # a passing failure is not a field unavailable


def test_source_health_connection_and_lost_gpus_are_exported() -> None:
    """Degrade per field is visible: each unavailable field once, with its reason; a lost host engine too."""
    from nvml_fake import FakeNvml, Scenario

    from gpuledger.agent.sources.nvml import NvmlSource

    scenario = Scenario.node(2, unsupported=frozenset({"nvmlDeviceGetRemappedRows"}))
    scenario.missing_functions = frozenset({"nvmlDeviceGetTotalEnergyConsumption"})
    src = NvmlSource(lib=FakeNvml(scenario, clock=lambda: 5.0), host="n1", clock=lambda: 5.0)
    agent = Agent(src)
    agent.open()
    for _ in range(3):
        agent.tick()
    fam = families(scrape(agent))
    got = {(s.labels["field"], s.labels["reason"]): s.value for s in fam["gpuledger_agent_unavailable_fields"]}
    assert got == {("energy_joules", "function_not_found"): 2.0, ("remapped_rows_total", "not_supported"): 2.0}
    assert [s.value for s in fam["gpuledger_agent_gpu_lost"]] == [0.0]
    assert len(agent.snapshot) == 2 and all(s.power_watts == 450.0 for s in agent.snapshot)

    class Disconnected(FixedSource):
        name = "dcgm"
        connected = False
        hostengine_disconnects_total = 1

    fam = families(scrape(Agent(Disconnected([]))))
    assert [(s.labels["source"], s.value) for s in fam["gpuledger_agent_source_connected"]] == [("dcgm", 0.0)]
    assert [s.value for s in fam["gpuledger_agent_source_disconnects"]] == [1.0]


# -- a MIG GPU on /metrics: its power and energy counter once, on the whole GPU ------------------------------------
M = "NVIDIA H200"


def _mig_tick(t: float, counter_j: float, instances: tuple[str, ...] = ("1", "2")) -> list[GpuSample]:
    """A MIG GPU as a source reads it: 400 W, the driver's counter; instance "1" busy (job j1), the others idle."""
    gpu = GpuSample(ts=t, host="n1", gpu_uuid="GPU-A", gpu_index=0, model=M, power_watts=400.0,
                    energy_joules=counter_j, power_limit_watts=700.0, mem_total_bytes=141 << 30)
    return [gpu] + [GpuSample(ts=t, host="n1", gpu_uuid="GPU-A", gpu_index=0, model=f"{M} MIG 3g.71gb", mig=m,
                              sm_active_ratio=0.95 if m == "1" else 0.05, mem_total_bytes=70 << 30,
                              job_ids=("j1",) if m == "1" else (f"j{m}",)) for m in instances]


def _prometheus_increase(values: list[float]) -> float:
    """What Prometheus' increase() makes of a counter's samples: a value below the one before is a reset (from 0)."""
    return sum(b - a if b >= a else b for a, b in zip(values, values[1:]))


def _exported(registry: object, name: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):  # type: ignore[arg-type]
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_an_agent_restart_on_a_mig_gpu_is_no_counter_reset() -> None:
    """400 W for 20 minutes on a GPU whose driver counter read 1 GJ; the agent restarts at minute 10 (its MIG stage
    and its /metrics anew). Per exported series, Prometheus counts the GPU's 476 kJ over the samples, not its
    lifetime energy again (an instance's share of the counter steps back or forward at a restart)."""
    class Snapshot:
        snapshot: list[GpuSample] = []

    series: dict[tuple, list[float]] = {}
    power: list[float] = []
    split, registry = MigEnergySplitter(), make_registry(Snapshot)
    for i in range(120):  # 10 s ticks
        if i == 60:
            split, registry = MigEnergySplitter(), make_registry(Snapshot)
        Snapshot.snapshot = split.map(_mig_tick(1e9 + 10.0 * i, 1e9 + 4000.0 * i))
        for labels, v in _exported(registry, "gpuledger_gpu_energy_joules_total").items():
            series.setdefault(labels, []).append(v)
        power.append(sum(_exported(registry, "gpuledger_gpu_power_watts").values()))
    assert sum(_prometheus_increase(v) for v in series.values()) == pytest.approx(119 * 4000.0, rel=1e-9)
    assert [dict(labels)["mig"] for labels in series] == [""]  # the whole GPU's counter, once
    assert power == [400.0] * 120  # power once too
    shares = _exported(registry, "gpuledger_gpu_job_share_ratio")
    assert {dict(k)["mig"]: v for k, v in shares.items()} == {"1": 3 / 7, "2": 3 / 7}  # of the GPU: the slices


def test_a_mig_reconfiguration_never_steps_the_exported_counter_back() -> None:
    """Instance "2" is destroyed and "3" made at minute 5 (no job on them, as a reconfiguration needs): the whole
    GPU's counter on /metrics keeps counting the GPU's energy."""
    class Snapshot:
        snapshot: list[GpuSample] = []

    split, registry = MigEnergySplitter(), make_registry(Snapshot)
    values = []
    for i in range(60):
        layout = ("1", "2") if i < 30 else ("1", "3")
        Snapshot.snapshot = split.map(_mig_tick(1e9 + 10.0 * i, 1e9 + 4000.0 * i, layout))
        (v,) = _exported(registry, "gpuledger_gpu_energy_joules_total").values()
        values.append(v)
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert _prometheus_increase(values) == pytest.approx(59 * 4000.0, rel=1e-9)


def test_a_mig_gpus_exported_counter_is_the_devices_own_across_restarts() -> None:
    """The agent hands /metrics the source's readings too (``Agent.sampled``): the whole GPU's counter is the
    driver's, exactly, whatever the instances' virtual counters sum to. Their sum restarts from the driver's at an
    agent restart: after a driver reload (counter from 0 again, while the virtual ones count on) it would step back
    there by the GPU's lifetime, which Prometheus counts again (as it would a rounding step of 1e-6 J)."""
    class Snapshot:
        snapshot: list[GpuSample] = []
        sampled: list[GpuSample] = []

    split, registry = MigEnergySplitter(), make_registry(Snapshot)
    exported, device = [], []
    for i in range(200):
        if i % 20 == 0:  # an agent restart every 20 ticks
            split, registry = MigEnergySplitter(), make_registry(Snapshot)
        # the driver reloaded at tick 110: its counter starts again from 0
        raw = _mig_tick(1e9 + 10.0 * i, 3.6e9 + 4000.123456789 * i if i < 110 else 4000.0 * (i - 110))
        Snapshot.sampled, Snapshot.snapshot = raw, split.map(raw)
        (v,) = _exported(registry, "gpuledger_gpu_energy_joules_total").values()
        exported.append(v)
        device.append(next(s.energy_joules for s in raw if not s.mig))
    assert exported == device
    assert _prometheus_increase(exported) == pytest.approx(_prometheus_increase(device), rel=1e-12)


def test_a_tick_without_the_devices_counter_exports_no_energy_and_no_step_back() -> None:
    """The driver's counter is unread at tick 3 (power still read, momentarily 1000 W): /metrics leaves the energy
    counter off that tick rather than show the instances' virtual sum, which the next tick's driver counter would
    undercut, a reset to Prometheus."""
    class Snapshot:
        snapshot: list[GpuSample] = []
        sampled: list[GpuSample] = []

    split, registry = MigEnergySplitter(), make_registry(Snapshot)
    exported: list[float] = []
    for i in range(6):
        raw = _mig_tick(1e9 + 10.0 * i, 1e9 + 4000.0 * i)
        if i == 3:
            raw[0] = dataclasses.replace(raw[0], energy_joules=None, power_watts=1000.0)
        Snapshot.sampled, Snapshot.snapshot = raw, split.map(raw)
        values = list(_exported(registry, "gpuledger_gpu_energy_joules_total").values())
        assert len(values) == (0 if i == 3 else 1), i
        exported.extend(values)
    assert exported == [1e9 + 4000.0 * i for i in (0, 1, 2, 4, 5)]


def test_every_agent_metric_the_docs_name_is_one_the_agent_exports(tmp_path) -> None:
    # an operator alerts on what README.md and docs/deploy.md name, and the dashboards draw it: a renamed or
    # misspelt metric never fires, and its panel stays empty
    import re
    from pathlib import Path

    from gpuledger.agent.push import HttpPusher
    from gpuledger.agent.spool import Spool, SpoolingPusher

    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", root / "docs" / "deploy.md", *(root / "gpuledger" / "dashboards").rglob("*.json")]
    named = {m for doc in docs for m in re.findall(r"\bgpuledger_agent_[a-z_]+[a-z]", doc.read_text())}
    spool = SpoolingPusher(HttpPusher("http://127.0.0.1:9", "a", "n1"), Spool(tmp_path / "s"))
    agent = Agent(SimulatedSource(host="n1", gpus=1), sinks=[spool])
    agent.tick()
    exported = {s.name for fam in text_string_to_metric_families(scrape(agent)) for s in fam.samples}
    spool.close(flush=False)
    assert {"gpuledger_agent_push_refused_job_records_total", "gpuledger_agent_push_unattributed_samples_total",
            "gpuledger_agent_spool_batches", "gpuledger_agent_tick_seconds"} <= named
    assert named - exported == set()
