"""The names the dashboards may use: the InfluxDB schema of ``collector.sinks.influx`` and the Prometheus metrics.

The InfluxDB schema is fixed (``docs/schema.md``); the Prometheus names come from the agent's exposition and the
collector's /metrics. :func:`dashboards.lint.check` holds every panel's query against these.
"""

from __future__ import annotations

from gpuledger.agent.exposition import GPU_SERIES, JOB_INFO, JOB_SHARE, JOBS, XID_ERRORS, stored_name
from gpuledger.schema.records import RATIO_FIELDS

# measurement -> (tags, fields)
INFLUX_SCHEMA: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "gpu": (
        frozenset({"host", "gpu", "uuid", "model", "mig"}),
        frozenset({
            *RATIO_FIELDS, "mem_used_bytes", "mem_total_bytes", "power_watts", "power_limit_watts", "energy_joules",
            "temp_celsius",
            "sm_clock_hz", "mem_clock_hz", "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second",
            "throttle_reasons", "ecc_errors_total", "remapped_rows_total", "xid_errors", "jobs",
        }),
    ),
    "gpu_job": (
        frozenset({"host", "uuid", "mig", "jobid"}),
        frozenset({"share", "share_reported", "sm_active_ratio", "dram_bw_ratio", "tensor_active_ratio",
                   "power_watts", "mem_used_bytes"}),
    ),
    "job_usage": (
        frozenset({"jobid", "user", "account", "partition", "cluster"}),
        frozenset({"allocated_gpu_seconds", "sm_active_gpu_seconds", "energy_joules", "efficiency", "gpus",
                   "dram_bw_mean", "sm_active_mean"}),
    ),
    "fairshare": (
        frozenset({"account", "user"}),
        frozenset({"fairshare", "site_factor", "effective_usage", "raw_usage"}),
    ),
}

# Agent metrics as Prometheus stores them (counters gain "_total"); the GPU ones and the job series are also what the
# collector ships to VictoriaMetrics (series_url).
AGENT_GPU_METRICS: frozenset[str] = frozenset(name for name, _ in GPU_SERIES)
SHIPPED_METRICS: frozenset[str] = AGENT_GPU_METRICS | {JOBS, JOB_INFO, JOB_SHARE}
# GPU series only the agents export (their Xid counter since the agent started): the collector does not ship them.
AGENT_ONLY_GPU_METRICS: frozenset[str] = frozenset({stored_name(XID_ERRORS, counter=True)})
AGENT_METRICS: frozenset[str] = SHIPPED_METRICS | AGENT_ONLY_GPU_METRICS | {
    "gpuledger_agent_ticks_total", "gpuledger_agent_errors_total",
    "gpuledger_agent_tick_seconds", "gpuledger_agent_last_tick_timestamp_seconds", "gpuledger_agent_gpus",
}
# The collector's /metrics (collector.server); the fairshare gauges come from the priority feed file.
COLLECTOR_METRICS: frozenset[str] = frozenset({
    "gpuledger_collector_samples_accepted_total", "gpuledger_collector_samples_rejected_total",
    "gpuledger_collector_batches_rejected_total", "gpuledger_collector_batches_deduplicated_total",
    "gpuledger_collector_ingest_latency_seconds_bucket", "gpuledger_collector_ingest_latency_seconds_count",
    "gpuledger_collector_ingest_latency_seconds_sum", "gpuledger_collector_store_size_bytes",
    "gpuledger_collector_last_compaction_timestamp_seconds",
    "gpuledger_collector_batches_accepted_total", "gpuledger_collector_internal_errors_total",
    "gpuledger_collector_requests_in_flight", "gpuledger_collector_ingest_queue_depth",
    "gpuledger_collector_group_commit_batches_bucket", "gpuledger_collector_group_commit_batches_count",
    "gpuledger_collector_group_commit_batches_sum", "gpuledger_collector_group_commit_seconds_bucket",
    "gpuledger_collector_group_commit_seconds_count", "gpuledger_collector_group_commit_seconds_sum",
    "gpuledger_fairshare_ratio", "gpuledger_site_factor", "gpuledger_priority_feed_generated_timestamp_seconds",
})
# Series Prometheus itself adds to every scrape target.
PROMETHEUS_BUILTIN: frozenset[str] = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
PROMETHEUS_METRICS: frozenset[str] = AGENT_METRICS | COLLECTOR_METRICS | PROMETHEUS_BUILTIN
