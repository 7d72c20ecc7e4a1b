"""Prometheus exposition of the agent's current snapshot.

Metric families are built anew on every scrape from ``agent.snapshot``, so a GPU or job that has gone
away leaves no series behind. GPU series carry only GPU labels; which job holds a GPU is a separate
``gpuledger_gpu_job_info{jobid=...} 1`` series to join on in PromQL, which keeps job ids (unbounded
over time) off every GPU metric. A value the device did not report is omitted, never exported as 0.

The snapshot is exported as series show a GPU (``agent.mig.as_series``): a MIG GPU's power, power limit and energy
counter once, on its whole-GPU series (never one counter per instance: after an agent restart an instance's share
of the counter steps, which Prometheus would take for a reset), and its jobs, with their shares of the physical
GPU, on its instances' series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from gpuledger.agent.mig import as_series
from gpuledger.agent.sampler import ERROR_KINDS
from gpuledger.schema.records import GpuSample

GPU_LABELS: tuple[str, ...] = ("host", "gpu", "uuid", "model", "mig")
JOB_LABELS: tuple[str, ...] = ("host", "gpu", "uuid", "mig", "jobid")

# (metric name without the counter's _total, GpuSample field, help, is_counter)
GPU_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("gpuledger_gpu_sm_active_ratio", "sm_active_ratio",
     "Fraction of time at least one warp was resident on an SM, averaged over SMs.", False),
    ("gpuledger_gpu_sm_occupancy_ratio", "sm_occupancy_ratio",
     "Resident warps over the maximum, averaged over SMs.", False),
    ("gpuledger_gpu_dram_bandwidth_ratio", "dram_bw_ratio", "Device memory (HBM) bandwidth utilisation.", False),
    ("gpuledger_gpu_tensor_active_ratio", "tensor_active_ratio",
     "Fraction of cycles the tensor pipes were active.", False),
    ("gpuledger_gpu_fp64_active_ratio", "fp64_active_ratio", "Fraction of cycles the FP64 pipes were active.", False),
    ("gpuledger_gpu_fp32_active_ratio", "fp32_active_ratio", "Fraction of cycles the FP32 pipes were active.", False),
    ("gpuledger_gpu_fp16_active_ratio", "fp16_active_ratio", "Fraction of cycles the FP16 pipes were active.", False),
    ("gpuledger_gpu_utilization_ratio", "gpu_util_ratio",
     "Fraction of time a kernel was running (what nvidia-smi shows).", False),
    ("gpuledger_gpu_memory_copy_utilization_ratio", "mem_copy_util_ratio",
     "Fraction of time device memory was read or written.", False),
    ("gpuledger_gpu_memory_used_bytes", "mem_used_bytes", "Device memory in use.", False),
    ("gpuledger_gpu_memory_total_bytes", "mem_total_bytes", "Device memory in total.", False),
    ("gpuledger_gpu_power_watts", "power_watts", "Power draw.", False),
    ("gpuledger_gpu_power_limit_watts", "power_limit_watts", "Enforced power limit.", False),
    ("gpuledger_gpu_energy_joules", "energy_joules", "Energy consumed since the driver loaded.", True),
    ("gpuledger_gpu_temperature_celsius", "temp_celsius", "GPU temperature.", False),
    ("gpuledger_gpu_sm_clock_hertz", "sm_clock_hz", "SM clock.", False),
    ("gpuledger_gpu_memory_clock_hertz", "mem_clock_hz", "Memory clock.", False),
    ("gpuledger_gpu_pcie_tx_bytes_per_second", "pcie_tx_bytes_per_second", "PCIe transmit throughput.", False),
    ("gpuledger_gpu_pcie_rx_bytes_per_second", "pcie_rx_bytes_per_second", "PCIe receive throughput.", False),
    ("gpuledger_gpu_throttle_reasons", "throttle_reasons", "NVML clock-event reason bit mask.", False),
    ("gpuledger_gpu_ecc_errors", "ecc_errors_total", "Uncorrected ECC errors.", True),
    ("gpuledger_gpu_remapped_rows", "remapped_rows_total", "Remapped memory rows.", True),
)


# What each GPU sample is stored as in a Prometheus-style database: GPU_METRICS under their stored names (a counter
# gains "_total"), the jobs holding the GPU (JOBS, one series per GPU and JOB_INFO, one per GPU and job: always 1)
# and, where the sample says how the GPU is split, each job's share of the physical GPU (JOB_SHARE), a MIG GPU as
# agent.mig.as_series shows it. The agent exports them on /metrics and the collector ships the same series to
# VictoriaMetrics (collector.victoriametrics), so dashboards read either.
JOBS = "gpuledger_gpu_jobs"
JOB_INFO = "gpuledger_gpu_job_info"
JOB_SHARE = "gpuledger_gpu_job_share_ratio"
XID_ERRORS = "gpuledger_gpu_xid_errors"  # a counter (stored with "_total"), /metrics only: the agent's since it started


def stored_name(name: str, counter: bool) -> str:
    """The name a metric family's samples are stored under: counters gain ``_total``."""
    return name + "_total" if counter else name


# (stored name, GpuSample field) of every numeric sample field
GPU_SERIES: tuple[tuple[str, str], ...] = tuple((stored_name(n, c), attr) for n, attr, _, c in GPU_METRICS)


def _gpu_labels(s: GpuSample) -> list[str]:
    return [s.host, str(s.gpu_index), s.gpu_uuid, s.model, s.mig or ""]


class SnapshotCollector:
    """A prometheus_client collector over an :class:`agent.sampler.Agent` (anything with ``snapshot``)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        # One read of the attribute: the agent replaces the list wholesale, so this batch is consistent.
        agent = self.agent
        snapshot: list[GpuSample] = as_series(agent.snapshot, getattr(agent, "sampled", ()))
        yield from self._gpu_metrics(snapshot)
        yield from self._self_metrics()

    def _gpu_metrics(self, snapshot: Iterable[GpuSample]) -> Iterator[Metric]:
        snapshot = list(snapshot)
        for name, attr, doc, is_counter in GPU_METRICS:
            family: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(name, doc, labels=GPU_LABELS)
                if is_counter
                else GaugeMetricFamily(name, doc, labels=GPU_LABELS)
            )
            for s in snapshot:
                v = getattr(s, attr)
                if v is not None:
                    family.add_metric(_gpu_labels(s), float(v))
            if family.samples:
                yield family
        xids = CounterMetricFamily(XID_ERRORS,
                                   "Xid errors the driver reported since the agent started.", labels=GPU_LABELS)
        # the counts first, then their models (the agent sets a key's model before its count: agent.sampler)
        counts = getattr(self.agent, "xid_errors_total", {})
        models = getattr(self.agent, "xid_models", {})  # kept with the counter: a GPU lost keeps its series' labels
        for (host, index, uuid, mig), n in sorted(counts.items()):
            xids.add_metric([host, str(index), uuid, models.get((host, index, uuid, mig), ""), mig], float(n))
        yield xids
        jobs = GaugeMetricFamily(JOBS, "Jobs holding the GPU.", labels=GPU_LABELS)
        info = GaugeMetricFamily(JOB_INFO, "Job holding the GPU (1 per GPU and job).", labels=JOB_LABELS)
        share = GaugeMetricFamily(JOB_SHARE, "The job's share of the physical GPU, where the sample says how it is "
                                  "split (on a MIG instance always: its slice fraction times the job's share of it).",
                                  labels=JOB_LABELS)
        for s in snapshot:
            jobs.add_metric(_gpu_labels(s), float(len(s.job_ids)))
            for job in s.job_ids:
                info.add_metric([s.host, str(s.gpu_index), s.gpu_uuid, s.mig or "", job], 1.0)
            for job, fraction in zip(s.job_ids, s.job_shares):
                share.add_metric([s.host, str(s.gpu_index), s.gpu_uuid, s.mig or "", job], float(fraction))
        yield jobs
        yield info
        if share.samples:
            yield share

    def _self_metrics(self) -> Iterator[Metric]:
        a = self.agent
        yield CounterMetricFamily("gpuledger_agent_ticks", "Sampling ticks run.",
                                  value=float(getattr(a, "ticks_total", 0)))
        errors = CounterMetricFamily("gpuledger_agent_errors", "Errors by kind (source, mapper, sink, internal).",
                                     labels=("kind",))
        counts = dict.fromkeys(ERROR_KINDS, 0)
        counts.update(getattr(a, "errors_total", {}))
        for kind, n in sorted(counts.items()):
            errors.add_metric([kind], float(n))
        yield errors
        last = getattr(a, "last_tick_seconds", None)
        if last is not None:
            yield GaugeMetricFamily("gpuledger_agent_tick_seconds", "Duration of the last sampling tick.",
                                    value=float(last))
        ts = getattr(a, "last_tick_ts", None)
        if ts is not None:
            yield GaugeMetricFamily("gpuledger_agent_last_tick_timestamp_seconds",
                                    "When the last sampling tick started (unix time).", value=float(ts))
        yield GaugeMetricFamily("gpuledger_agent_gpus", "GPUs (and MIG instances) in the latest snapshot.",
                                value=float(len(a.snapshot)))
        yield from self._source_metrics(getattr(a, "source", None))
        for sink in getattr(a, "sinks", ()):  # the pushing sink (agent.push, agent.spool) reports its figures
            stats = getattr(sink, "stats", None)
            st = stats() if callable(stats) else None
            if st:
                for key, (name, doc, counter) in _SINK_METRICS.items():
                    if key in st:  # a spool's figures, or a direct sink's
                        family = CounterMetricFamily if counter else GaugeMetricFamily
                        yield family(name, doc, value=float(st[key]))
                break

    @staticmethod
    def _source_metrics(src: Any) -> Iterator[Metric]:
        """What the GPU source could not read (per field, with the reason), its connection, its lost GPUs."""
        if src is None:
            return
        name = str(getattr(src, "name", type(src).__name__))
        health = getattr(src, "health", None)
        if health is not None:
            fields = CounterMetricFamily(
                "gpuledger_agent_unavailable_fields",
                "Fields a GPU (or MIG instance) cannot give, counted once per GPU and field (again after a re-open "
                "or MIG mode change; once for all GPUs when the cause is DCGM-wide), by reason (function_not_found, "
                "library_mismatch, not_supported, no_permission, unknown_field, watch_failed, not_exported); that "
                "field is None, the rest of the sample is sent.",
                labels=("source", "field", "reason"))
            for (field, reason), n in sorted(health.unavailable.items()):
                fields.add_metric([name, field, reason], float(n))
            yield fields
        call_errors = getattr(src, "call_errors_total", None)
        if call_errors is not None:
            failed = CounterMetricFamily(
                "gpuledger_agent_source_call_errors",
                "Reads of a field that failed for a passing cause (a transient driver error, a binding bug), per GPU "
                "(or MIG instance) and tick: that field was None there then. A read failing for good is counted "
                "once in gpuledger_agent_unavailable_fields instead; field is empty for a call that fills none (a "
                "name, the MIG layout, the event wait).", labels=("source", "field"))
            for field, n in sorted(dict(call_errors).items()):
                failed.add_metric([name, field], float(n))
            yield failed
        unexpected = getattr(src, "errors_total", None)
        if isinstance(unexpected, int):
            yield _one("gpuledger_agent_source_unexpected_errors", "Exceptions the source did not expect (a binding "
                       "bug): of one call (that field None that tick, also counted in "
                       "gpuledger_agent_source_call_errors) or of one GPU's sampling (no sample of it that tick).",
                       name, float(unexpected), counter=True)
        connected = getattr(src, "connected", None)
        if connected is not None:
            yield _one("gpuledger_agent_source_connected", "1 while the source is connected to its backend "
                       "(DCGM: nv-hostengine).", name, float(bool(connected)), counter=False)
        disconnects = getattr(src, "hostengine_disconnects_total", None)
        if disconnects is not None:
            yield _one("gpuledger_agent_source_disconnects", "Times the source lost its backend (then reconnects).",
                       name, float(disconnects), counter=True)
        lost = getattr(src, "gpu_lost_total", None)
        if lost is not None:
            yield _one("gpuledger_agent_gpu_lost", "Times a GPU was marked lost (fell off the bus, reset required).",
                       name, float(lost), counter=True)


# sink.stats() key -> (metric, help, counter?): the keys a sink gives decide what is exported
_SINK_METRICS: dict[str, tuple[str, str, bool]] = {
    "depth": ("gpuledger_agent_spool_batches", "Batches waiting in the spool.", False),
    "bytes": ("gpuledger_agent_spool_bytes", "Bytes the spool holds on disk.", False),
    "dropped_batches": ("gpuledger_agent_spool_dropped_batches", "Oldest batches dropped from a full spool.", True),
    "dropped_samples": ("gpuledger_agent_spool_dropped_samples", "Samples in batches dropped from a full spool.",
                        True),
    "sent_batches": ("gpuledger_agent_push_sent_batches", "Batches a collector acknowledged.", True),
    "rejected_batches": ("gpuledger_agent_push_rejected_batches",
                         "Batches the collector refused (4xx) and the agent dropped.", True),
    "rejected_samples": ("gpuledger_agent_push_rejected_samples",
                         "Samples the collector refused (4xx) and the agent dropped: whole batches, and the "
                         "samples behind their GPU's window (too late) of batches it stored.", True),
    "refused_job_records": ("gpuledger_agent_push_refused_job_records",
                            "Job records a collector refused (a job naming another cluster, a field it does not "
                            "take): their batches were sent again without them and taken; their samples count.",
                            True),
    "unattributed_samples": ("gpuledger_agent_push_unattributed_samples",
                             "Samples sent without their job ids: their GPU was shared by more jobs than the "
                             "collector takes in one sample (their use is measured, charged to no job).", True),
    "trimmed_list_items": ("gpuledger_agent_push_trimmed_list_items",
                           "Processes and Xid errors left out of samples that listed more than the collector takes "
                           "in one (the rest of the sample was sent; the agent's own Xid counter counts them all).",
                           True),
    "unsent_batches": ("gpuledger_agent_push_unsent_batches",
                       "Batches no collector took and no spool kept (no --spool-dir, or its disk full), dropped.",
                       True),
    "unsent_samples": ("gpuledger_agent_push_unsent_samples",
                       "Samples in batches no collector took and no spool kept (no --spool-dir, or its disk full).",
                       True),
}


def _one(metric: str, doc: str, source: str, value: float, *, counter: bool) -> Metric:
    family: Any = (CounterMetricFamily if counter else GaugeMetricFamily)(metric, doc, labels=("source",))
    family.add_metric([source], value)
    return family


def make_registry(agent: Any) -> CollectorRegistry:
    """A fresh registry holding only the agent's collector (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(agent))
    return registry


class MetricsServer:
    """A running /metrics HTTP server; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port
        self.addr: str = server.server_address[0]

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def serve_metrics(agent: Any, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the agent's metrics over HTTP in a background thread."""
    server, thread = start_http_server(port, addr=addr, registry=make_registry(agent))
    return MetricsServer(server, thread)
