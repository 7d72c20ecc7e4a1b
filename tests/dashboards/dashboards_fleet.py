"""A small live fleet for the dashboard tests: simulated agents ticking in real time, serving /metrics and pushing
to a collector (and to any extra sink), with a known state per GPU.

States (``EXPECTED_STATES``, per device: a MIG instance is one, its GPU is none): live01 GPU 0-1 job 3001 training
(busy), GPU 2 job 3002 idle (allocated-idle), GPU 3 free; live02 GPU 0 job 3003 and GPU 1 shared by 3003 and 3004
with shares 0.75 and 0.25 (the agent reports them), inference (busy), GPU 2 a MIG GPU (``MIG_GPU``: two 3g
instances, "1" held by job 3005, training, busy, "2" free), GPU 3 free; live03 two free GPUs whose agent stops after
the first scrapes (lost). live03's clock runs ten minutes behind, so in InfluxDB its GPUs look silent since then
as well. The agents run the MIG stage (``agent.mig.MigEnergySplitter``) as ``gpuledger agent run`` does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gpuledger.agent.exposition import MetricsServer, serve_metrics
from gpuledger.agent.mappers.static import StaticMapper
from gpuledger.agent.mig import MigEnergySplitter
from gpuledger.agent.push import HttpPusher
from gpuledger.agent.sampler import Agent
from gpuledger.agent.sources.simulated import SimulatedSource
from gpuledger.schema.records import GpuSample

EXPECTED_STATES = {"busy": 5, "allocated-idle": 1, "free": 3, "lost": 2}
DEVICES = 11  # sum(EXPECTED_STATES.values())
LOST_HOST = "live03"
LOST_LAG_S = 600.0
SHARED_JOB = "3003"
SHARES = {"3003": 0.75, "3004": 0.25}  # of live02 GPU 1
MIG_HOST, MIG_INDEX = "live02", 2
MIG_JOB = "3005"  # on instance "1" of MIG_GPU: a 3g.71gb slice, 3/7 of it
MIG_PROFILE = "3g.71gb"
_PLAN: dict[str, dict[int, tuple[tuple[str, ...], str]]] = {
    "live01": {0: (("3001",), "training"), 1: (("3001",), "training"), 2: (("3002",), "idle")},
    "live02": {0: (("3003",), "inference"), 1: (("3003", "3004"), "inference"), MIG_INDEX: ((), "training")},
    LOST_HOST: {},
}
_GPUS = {"live01": 4, "live02": 4, LOST_HOST: 2}
FLEET_JOBS = {j for plan in _PLAN.values() for jobs, _ in plan.values() for j in jobs} | {MIG_JOB}


def enrich(s: GpuSample) -> GpuSample:
    """Fill in what an NVML/GPM source reports and the simulator does not (pipes, clocks, PCIe, health, the power
    limit), derived from the simulated activity so the values stay plausible; GPU 3 of every node is a flaky one
    with Xid 13."""
    sm = s.sm_active_ratio or 0.0
    tensor = s.tensor_active_ratio or 0.0
    power = s.power_watts or 0.0
    return replace(
        s,
        fp64_active_ratio=round(sm * 0.05, 4),
        fp32_active_ratio=round(sm * 0.3, 4),
        fp16_active_ratio=round(min(sm, tensor * 0.5), 4),
        mem_copy_util_ratio=round((s.dram_bw_ratio or 0.0) * 0.8, 4),
        mem_clock_hz=2.619e9,
        pcie_tx_bytes_per_second=round(sm * 8e9, 1),
        pcie_rx_bytes_per_second=round(sm * 12e9, 1),
        throttle_reasons=0x4 if power > 600 else 0,  # SW power cap near TDP
        power_limit_watts=700.0,
        ecc_errors_total=0,
        remapped_rows_total=1 if s.gpu_index == 3 else 0,
        xid_errors=(13,) if s.gpu_index == 3 else (),
    )


class EnrichingSource:
    """A SimulatedSource whose samples carry the extra fields of :func:`enrich`."""

    def __init__(self, inner: SimulatedSource) -> None:
        self.inner = inner
        self.name = inner.name

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def sample(self) -> list[GpuSample]:
        return [enrich(s) for s in self.inner.sample()]


class MigSource:
    """``inner`` with GPU ``MIG_INDEX`` of ``MIG_HOST`` in MIG mode, as the NVML source reads one: the GPU's own
    sample (power, energy counter, limit, temperature, the GPU-wide activity) and one per GPU instance with its
    activity and memory and no power or energy; instance "1" runs the GPU's simulated load, "2" is idle."""

    def __init__(self, inner: Any, host: str) -> None:
        self.inner, self.name, self.host = inner, inner.name, host

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def sample(self) -> list[GpuSample]:
        out: list[GpuSample] = []
        for s in self.inner.sample():
            if self.host != MIG_HOST or s.gpu_index != MIG_INDEX:
                out.append(s)
                continue
            half = (s.mem_total_bytes or 0) // 2
            out.append(replace(s, mem_used_bytes=None))  # in MIG mode its memory in use is the instances'
            instance = dict(model=f"{s.model} MIG {MIG_PROFILE}", power_watts=None, energy_joules=None,
                            power_limit_watts=None, temp_celsius=None, mem_total_bytes=half)
            out.append(replace(s, mig="1", mem_used_bytes=min(s.mem_used_bytes or 0, half), **instance))
            out.append(replace(s, mig="2", mem_used_bytes=0, sm_active_ratio=0.0, sm_occupancy_ratio=0.0,
                               dram_bw_ratio=0.0, tensor_active_ratio=0.0, gpu_util_ratio=0.0, **instance))
        return out


class FleetJobs:
    """The jobs of the fleet's devices that a static table cannot give: the MIG instance's (a table names GPUs) and
    the shares of live02 GPU 1 (the agent's mapper reports them, as the memory split does)."""

    def __init__(self, host: str) -> None:
        self.host = host

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        out = []
        for s in samples:
            if self.host == MIG_HOST and s.gpu_index == MIG_INDEX:
                s = replace(s, job_ids=(MIG_JOB,) if s.mig == "1" else (), job_shares=())
            elif self.host == MIG_HOST and s.job_ids == tuple(SHARES):
                s = replace(s, job_shares=tuple(SHARES.values()))
            out.append(s)
        return out


class EnrichingSink:
    """Passes :func:`enrich`-ed samples to ``inner``; never closes it (several agents share one sink)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, samples: Sequence[GpuSample]) -> None:
        self.inner.write([enrich(s) for s in samples])


class _NoClose:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, samples: Sequence[GpuSample]) -> None:
        self.inner.write(samples)


class LiveFleet:
    """Three agents ticking every ``period_s`` in one thread; ``stop_host`` makes one disappear."""

    def __init__(self, collector_url: str, extra_sinks: Sequence[Any] = (), period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.agents: dict[str, Agent] = {}
        self.servers: dict[str, MetricsServer] = {}
        self._stopped: set[str] = set()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        for seed, (host, plan) in enumerate(_PLAN.items()):
            lag = LOST_LAG_S if host == LOST_HOST else 0.0
            src = SimulatedSource(host=host, gpus=_GPUS[host], seed=100 + seed, clock=lambda lag=lag: time.time() - lag,
                                  profiles={g: profile for g, (_, profile) in plan.items()})
            mapper = StaticMapper({g: jobs for g, (jobs, _) in plan.items() if jobs})
            sinks = [HttpPusher(f"{collector_url}/api/v1/samples", agent_id=f"dash-{host}", host=host),
                     *(_NoClose(s) for s in extra_sinks)]
            stages = [mapper, FleetJobs(host), MigEnergySplitter()]  # the MIG stage last, as the agent CLI has it
            agent = Agent(MigSource(EnrichingSource(src), host), stages, clock=lambda lag=lag: time.time() - lag,
                          sinks=sinks)
            agent.open()
            self.agents[host] = agent
        self._thread = threading.Thread(target=self._run, name="dashboards-fleet", daemon=True)

    def start(self) -> LiveFleet:
        self.tick_all()  # a first snapshot before anything scrapes
        for host, agent in self.agents.items():
            self.servers[host] = serve_metrics(agent, 0)
        self._thread.start()
        return self

    def tick_all(self) -> None:
        with self._lock:
            for host, agent in self.agents.items():
                if host not in self._stopped:
                    agent.tick()

    def _run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.tick_all()

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers.values()]

    def errors(self) -> dict[str, dict[str, int]]:
        return {h: dict(a.errors_total) for h, a in self.agents.items() if any(a.errors_total.values())}

    def stop_host(self, host: str) -> None:
        with self._lock:
            self._stopped.add(host)
        self.servers.pop(host).shutdown()

    def close(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for server in self.servers.values():
            server.shutdown()
        self.servers.clear()
        for agent in self.agents.values():
            agent.close()
