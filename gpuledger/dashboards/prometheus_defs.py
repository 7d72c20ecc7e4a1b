"""Prometheus dashboards over the agents' /metrics and the collector's /metrics.

Job ids live only on ``gpuledger_gpu_job_info`` (joined on host, uuid, mig); accounts and users are not in the
agents' metrics at all, so per-account usage is the InfluxDB flavour's (``job_usage``) and only the fairshare
gauges (collector) are shown per account here.

A MIG GPU (``agent.mig.as_series``) has its power and energy counter on its whole-GPU series (``mig=""``) only,
and its jobs on its instances' series, whose ``gpuledger_gpu_job_share_ratio`` is of the physical GPU: a job's
share of a GPU's power is therefore joined on (host, uuid), its share of GPU-time read per device.
"""

from __future__ import annotations

from typing import Any

from gpuledger.dashboards.grafana import (
    Dashboard,
    Panel,
    bar,
    custom_var,
    dashboard,
    query_var,
    row,
    stat,
    table,
    target,
    timeseries,
)

ON = "on(host, uuid, mig)"
INFO = "gpuledger_gpu_job_info"
SHARE = "gpuledger_gpu_job_share_ratio"
POWER = "gpuledger_gpu_power_watts"
TOTAL = "gpuledger_gpu_memory_total_bytes"  # every device reports its memory size: the "device present" series
# SM activity where the device reports it (profiling), else the coarse "a kernel was running".
ACTIVE = "(gpuledger_gpu_sm_active_ratio or gpuledger_gpu_utilization_ratio)"


def _devices(series: str) -> str:
    """One series per schedulable device of ``series`` (a selector's tail is appended to ``{mig...}``): MIG
    instances, and whole GPUs that are not split into instances (a MIG GPU's own series is no device a job holds)."""
    inst, whole = series.replace("{}", '{mig!=""}'), series.replace("{}", '{mig=""}')
    return f"({inst} or ({whole} unless on(host, uuid) {inst}))"


DEVICES = _devices(f"{TOTAL}{{}}")
IDLE_VAR = custom_var("idle", "0.05,0.01,0.1,0.2", "Idle below (SM active)",
                      "An allocated GPU whose SM activity is below this counts as allocated-idle (waste).")
GPU_LEGEND = "{{host}} gpu{{gpu}} {{mig}}"


def _count(expr: str) -> str:
    # A zero rather than "No data" when no device is in that state.
    return f"count({expr}) or vector(0)"


BUSY = _count(f"({ACTIVE} >= $idle) and {ON} {INFO}")
ALLOC_IDLE = _count(f"({ACTIVE} < $idle) and {ON} {INFO}")
FREE = _count(f"{DEVICES} unless {ON} {INFO}")
LOST = _count(f"{_devices(f'max_over_time({TOTAL}{{}}[$__range])')} unless {ON} {TOTAL}")


def _cluster() -> Dashboard:
    return dashboard(
        "gpuledger-prom-cluster", "gpuledger / Cluster overview (Prometheus)", "prometheus", "cluster-overview",
        row(
            "GPUs by state",
            stat("Busy", target(BUSY), description="Held by a job, SM activity at or above $idle.",
                 thresholds=(("green", None),)),
            stat("Allocated, idle", target(ALLOC_IDLE), description="Held by a job, SM activity below $idle: waste.",
                 thresholds=(("green", None), ("orange", 1))),
            stat("Free", target(FREE), description="Reporting, held by no job.", thresholds=(("blue", None),)),
            stat("Lost", target(LOST, instant=True),
                 description="Reported in the time range but not now (agent or GPU gone).",
                 thresholds=(("green", None), ("red", 1))),
            stat("Power now", target("sum(gpuledger_gpu_power_watts)"), unit="watt"),
            stat("Energy today",
                 target("sum(increase(gpuledger_gpu_energy_joules_total[$__range])) / 3.6e6", instant=True),
                 unit="kwatth", time_from="now/d", decimals=1, description="Energy counters' increase since midnight."),
            timeseries("GPUs by state", target(BUSY, "busy"), target(ALLOC_IDLE, "allocated idle"),
                       target(FREE, "free"), stack=True, width=24),
        ),
        row(
            "Fleet activity",
            timeseries("SM activity", target("avg(gpuledger_gpu_sm_active_ratio)", "all GPUs"),
                       target(f"avg(gpuledger_gpu_sm_active_ratio and {ON} {INFO})", "allocated GPUs"),
                       unit="percentunit", min=0, max=1),
            timeseries("HBM bandwidth", target("avg(gpuledger_gpu_dram_bandwidth_ratio)", "all GPUs"),
                       target(f"avg(gpuledger_gpu_dram_bandwidth_ratio and {ON} {INFO})", "allocated GPUs"),
                       unit="percentunit", min=0, max=1),
            timeseries("SM activity by node", target("avg by (host) (gpuledger_gpu_sm_active_ratio)", "{{host}}"),
                       unit="percentunit", min=0, max=1),
            timeseries("Power by node", target("sum by (host) (gpuledger_gpu_power_watts)", "{{host}}"),
                       unit="watt", stack=True),
        ),
        row(
            "Top jobs now (accounts: see the InfluxDB flavour)",
            bar("Top jobs by GPUs held", target(f"topk(10, count by (jobid) ({INFO}))", "{{jobid}}", instant=True)),
            bar("Top jobs by idle GPUs (waste)",
                target(f"topk(10, count by (jobid) ({INFO} and {ON} ({ACTIVE} < $idle)))", "{{jobid}}", instant=True),
                thresholds=(("orange", None),)),
        ),
        row(
            "Collector",
            timeseries("Samples ingested",
                       target("sum(rate(gpuledger_collector_samples_accepted_total[$__rate_interval]))", "accepted"),
                       target("sum by (reason) (rate(gpuledger_collector_samples_rejected_total[$__rate_interval]))",
                              "rejected: {{reason}}"),
                       unit="short", width=6),
            timeseries("Ingest latency p99", target(
                "histogram_quantile(0.99, sum by (le) "
                "(rate(gpuledger_collector_ingest_latency_seconds_bucket[$__rate_interval])))",
                "p99"), unit="s", width=6),
            timeseries("Store size", target("gpuledger_collector_store_size_bytes", "{{instance}}"), unit="bytes",
                       width=6),
            timeseries("Since the last compaction", target(
                "time() - max(gpuledger_collector_last_compaction_timestamp_seconds)", "ledger"), unit="s", width=6,
                description="How long ago a compaction of the ledger last completed, whichever process ran it: "
                            "growing past a few compact_interval_s, the compactor is refused or gone."),
        ),
        row(
            "Collector group commits",
            timeseries("Batches per group commit (mean)", target(
                "sum(rate(gpuledger_collector_group_commit_batches_sum[$__rate_interval])) / "
                "sum(rate(gpuledger_collector_group_commit_batches_count[$__rate_interval]))", "batches"),
                unit="short", width=12),
            timeseries("Group commit time p99", target(
                "histogram_quantile(0.99, sum by (le) "
                "(rate(gpuledger_collector_group_commit_seconds_bucket[$__rate_interval])))", "p99"),
                unit="s", width=12),
        ),
        variables=(IDLE_VAR,),
        description="Fleet state, activity, power and energy from the agents' /metrics; collector health.",
    )


def _per_gpu(title: str, metric: str, unit: str, sel: str = '{host=~"$host", gpu=~"$gpu"}', **kw: Any) -> Panel:
    return timeseries(title, target(f"{metric}{sel}", GPU_LEGEND), unit=unit, **kw)


def _node() -> Dashboard:
    sel = '{host=~"$host", gpu=~"$gpu"}'
    ratio: dict[str, Any] = {"unit": "percentunit", "min": 0, "max": 1}
    return dashboard(
        "gpuledger-prom-node", "gpuledger / Node and GPU (Prometheus)", "prometheus", "node-gpu",
        row(
            "Activity",
            _per_gpu("SM activity", "gpuledger_gpu_sm_active_ratio", **ratio),
            _per_gpu("SM occupancy", "gpuledger_gpu_sm_occupancy_ratio", **ratio),
            _per_gpu("HBM bandwidth", "gpuledger_gpu_dram_bandwidth_ratio", **ratio),
            _per_gpu("Tensor pipes", "gpuledger_gpu_tensor_active_ratio", **ratio),
            timeseries("FP pipes", target(f"gpuledger_gpu_fp64_active_ratio{sel}", "fp64 " + GPU_LEGEND),
                       target(f"gpuledger_gpu_fp32_active_ratio{sel}", "fp32 " + GPU_LEGEND),
                       target(f"gpuledger_gpu_fp16_active_ratio{sel}", "fp16 " + GPU_LEGEND), **ratio),
            timeseries("Utilisation (nvidia-smi) and memory copy",
                       target(f"gpuledger_gpu_utilization_ratio{sel}", "util " + GPU_LEGEND),
                       target(f"gpuledger_gpu_memory_copy_utilization_ratio{sel}", "copy " + GPU_LEGEND),
                       **ratio),
        ),
        row(
            "Power, thermals, clocks",
            _per_gpu("Power", "gpuledger_gpu_power_watts", "watt"),
            timeseries("Power from the energy counter",
                       target(f"rate(gpuledger_gpu_energy_joules_total{sel}[$__rate_interval])", GPU_LEGEND),
                       unit="watt", description="The counter's rate; should track sampled power."),
            _per_gpu("Temperature", "gpuledger_gpu_temperature_celsius", "celsius"),
            timeseries("Clocks", target(f"gpuledger_gpu_sm_clock_hertz{sel}", "SM " + GPU_LEGEND),
                       target(f"gpuledger_gpu_memory_clock_hertz{sel}", "mem " + GPU_LEGEND), unit="hertz"),
        ),
        row(
            "Memory and PCIe",
            _per_gpu("Memory used", "gpuledger_gpu_memory_used_bytes", "bytes"),
            timeseries("Memory used (share)", target(
                f"gpuledger_gpu_memory_used_bytes{sel} / gpuledger_gpu_memory_total_bytes{sel}", GPU_LEGEND), **ratio),
            timeseries("PCIe", target(f"gpuledger_gpu_pcie_tx_bytes_per_second{sel}", "tx " + GPU_LEGEND),
                       target(f"gpuledger_gpu_pcie_rx_bytes_per_second{sel}", "rx " + GPU_LEGEND), unit="Bps"),
        ),
        row(
            "Health",
            _per_gpu("Throttle reasons (NVML bit mask)", "gpuledger_gpu_throttle_reasons", "none",
                     description="0 = not throttled; see nvmlClocksEventReasons for the bits."),
            timeseries("Xid errors (increase)",
                       target(f"increase(gpuledger_gpu_xid_errors_total{sel}[$__rate_interval])", GPU_LEGEND),
                       unit="short", bars=True,
                       description="Xid events the driver reported (the agents' counter; the collector does not "
                                   "ship it)."),
            timeseries("ECC errors and remapped rows (increase)",
                       target(f"increase(gpuledger_gpu_ecc_errors_total{sel}[$__rate_interval])", "ECC " + GPU_LEGEND),
                       target(f"increase(gpuledger_gpu_remapped_rows_total{sel}[$__rate_interval])",
                              "remapped " + GPU_LEGEND), unit="short"),
            table("Jobs on these GPUs now", target(f'{INFO}{{host=~"$host", gpu=~"$gpu"}}', fmt="table", instant=True),
                  transformations=({"id": "organize", "options": {
                      "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True}}},), width=12),
            timeseries("Agent tick duration", target("gpuledger_agent_tick_seconds", "{{instance}}"), unit="s",
                       description="Agent self-metrics carry no host label: the scrape target is the instance."),
        ),
        variables=(
            query_var("host", f"label_values({TOTAL}, host)", "Host", multi=True, include_all=True),
            query_var("gpu", f'label_values({TOTAL}{{host=~"$host"}}, gpu)', "GPU", multi=True, include_all=True),
        ),
        description="Per-GPU telemetry of the selected nodes from the agents' /metrics.",
    )


def _job() -> Dashboard:
    j = f'{INFO}{{jobid="$jobid"}}'
    held = f"and {ON} {j}"
    window = "[$__range:$__interval]"
    step_h = "$__interval_ms / 1000 / 3600"
    ratio: dict[str, Any] = {"unit": "percentunit", "min": 0, "max": 1}

    def per_gpu(title: str, metric: str, unit: str, **kw: Any) -> Panel:
        return timeseries(title, target(f"{metric} {held}", "{{host}} gpu{{gpu}} {{mig}}"), unit=unit, **kw)

    def summary(title: str, expr: str, **kw: Any) -> Panel:
        # One value for the whole range: an instant query at its end over [$__range].
        return stat(title, target(expr, instant=True), **kw)

    # The job's share of each device it holds, as the collector charges it: the reported share (of the physical
    # GPU: on a MIG instance it includes the slice fraction), else the equal split among the device's jobs.
    share = f'({SHARE}{{jobid="$jobid"}} or ({j} / {ON} group_left count by (host, uuid, mig) ({INFO})))'
    sm_share = f"({share} * {ON} group_left gpuledger_gpu_sm_active_ratio)"
    # a GPU's power: on its whole-GPU series (a MIG instance's series carry none), so joined on (host, uuid)
    power_share = f"({share} * on(host, uuid) group_left max by (host, uuid) ({POWER}))"
    return dashboard(
        "gpuledger-prom-job", "gpuledger / Job (Prometheus)", "prometheus", "job",
        row(
            "Summary over the time range (estimates; the ledger's figures are in `gpuledger report`)",
            summary("GPUs", f"max_over_time(count({j}){window})", description="Most GPUs held at once."),
            summary("GPU-hours allocated", f"sum(sum_over_time({share}{window})) * {step_h}", decimals=2,
                    description="A shared GPU counts with the job's share of it (a MIG instance with its slice)."),
            summary("SM-active GPU-hours", f"sum(sum_over_time({sm_share}{window})) * {step_h}", decimals=2),
            summary("Efficiency", f"sum(sum_over_time({sm_share}{window})) / sum(sum_over_time({share}{window}))",
                    unit="percentunit", decimals=1, thresholds=(("red", None), ("orange", 0.3), ("green", 0.6)),
                    description="SM-active GPU-seconds over allocated GPU-seconds."),
            summary("Energy", f"sum(sum_over_time({power_share}{window})) * {step_h} / 1000", unit="kwatth",
                    decimals=2, description="The GPUs' power times the job's share of them."),
            summary("Mean HBM bandwidth", f"avg(avg_over_time((gpuledger_gpu_dram_bandwidth_ratio {held}){window}))",
                    unit="percentunit", decimals=1),
        ),
        row(
            "The job's GPUs",
            per_gpu("SM activity", "gpuledger_gpu_sm_active_ratio", **ratio),
            per_gpu("HBM bandwidth", "gpuledger_gpu_dram_bandwidth_ratio", **ratio),
            per_gpu("Tensor pipes", "gpuledger_gpu_tensor_active_ratio", **ratio),
            per_gpu("SM occupancy", "gpuledger_gpu_sm_occupancy_ratio", **ratio),
            timeseries("Power (the job's share)", target(power_share, "{{host}} gpu{{gpu}} {{mig}}"), unit="watt",
                       description="The GPU's power times the job's share of it."),
            timeseries("Share of the GPU", target(share, "{{host}} gpu{{gpu}} {{mig}}"), **ratio,
                       description="Below 1 when the GPU is shared with other jobs or is a MIG instance."),
            per_gpu("Memory used", "gpuledger_gpu_memory_used_bytes", "bytes"),
            table("GPUs the job held in the range", target(f"max_over_time({j}[$__range])", fmt="table", instant=True),
                  transformations=({"id": "organize", "options": {
                      "excludeByName": {"Time": True, "Value": True, "job": True}}},)),
        ),
        variables=(query_var("jobid", f"label_values({INFO}, jobid)", "Job id",
                             description="Jobs that held a GPU in the time range; set the range to the job's life."),),
        description="One job's GPUs over its lifetime (set the time range to the job's), from the agents' /metrics.",
    )


def _accounting() -> Dashboard:
    sel = '{account=~"$account"}'
    return dashboard(
        "gpuledger-prom-accounting", "gpuledger / Fairshare (Prometheus)", "prometheus", "accounting",
        row(
            "Fairshare and site factor (collector, from the priority feed)",
            timeseries("Fairshare by association", target(f"gpuledger_fairshare_ratio{sel}", "{{account}} / {{user}}"),
                       min=0, max=1),
            timeseries("Site factor by association", target(f"gpuledger_site_factor{sel}", "{{account}} / {{user}}")),
            bar("Lowest fairshare (most deprived first)",
                target(f"bottomk(10, gpuledger_fairshare_ratio{sel})", "{{account}} / {{user}}", instant=True),
                min=0, max=1, thresholds=(("red", None), ("orange", 0.3), ("green", 0.6))),
            table("Associations now",
                  target(f"gpuledger_fairshare_ratio{sel}", fmt="table", instant=True),
                  target(f"gpuledger_site_factor{sel}", fmt="table", instant=True),
                  transformations=(
                      {"id": "merge", "options": {}},
                      {"id": "organize", "options": {
                          "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True},
                          "renameByName": {"Value #A": "fairshare", "Value #B": "site factor"}}},
                  ), width=12),
        ),
        variables=(query_var("account", "label_values(gpuledger_fairshare_ratio, account)", "Account",
                             multi=True, include_all=True),),
        description="Measured fairshare and the Slurm site factor per association. "
                    "Usage per account: InfluxDB flavour.",
    )


DASHBOARDS: list[Dashboard] = [_cluster(), _node(), _job(), _accounting()]
# Exported for tests that check the state panels' semantics.
STATE_QUERIES: dict[str, str] = {"busy": BUSY, "allocated-idle": ALLOC_IDLE, "free": FREE, "lost": LOST}
