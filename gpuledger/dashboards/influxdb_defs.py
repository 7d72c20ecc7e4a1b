"""InfluxDB (InfluxQL) dashboards over the collector's schema (``docs/schema.md``): measurements ``gpu``,
``gpu_job``, ``job_usage`` and ``fairshare``.

InfluxQL is answered by InfluxDB 1.x, 2.x (v1 compatibility API) and 3.x. Every identifier is double-quoted
(:mod:`dashboards.lint` relies on it). ``job_usage`` holds a job's running totals, so queries take the latest
point per job (``last(...) GROUP BY "jobid"``) before summing: re-written totals are never counted twice; over
time, each job's total is one point, at its latest one in the range.

A device is a point series with ``jobs``: a MIG instance, or a whole GPU not in MIG mode. A MIG GPU's own points
(tag ``mig`` absent) carry its power and energy counter, once, and no ``jobs`` (docs/schema.md), so the device
counts skip them, as the Prometheus flavour's ``DEVICES`` does.
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

IDLE_VAR = custom_var("idle", "0.05,0.01,0.1,0.2", "Idle below (SM active)",
                      "An allocated GPU whose SM activity is below this counts as allocated-idle (waste).")
RATIO: dict[str, Any] = {"unit": "percentunit", "min": 0, "max": 1}
GPU_ALIAS = "$tag_host gpu$tag_gpu $tag_mig"
TF = "$timeFilter"
NOW = "time > now() - 2m"  # "now": the latest sample of every device within two minutes
EVERY = "GROUP BY time($__interval)"

# The latest reading of every device (a MIG instance is its own device).
_LATEST = (f'SELECT last("sm_active_ratio") AS "sm", last("jobs") AS "jobs" FROM "gpu" WHERE {NOW} '
           'GROUP BY "host", "uuid", "mig"')
BUSY_NOW = f'SELECT count("sm") FROM ({_LATEST}) WHERE "jobs" > 0 AND "sm" >= $idle'
IDLE_NOW = f'SELECT count("sm") FROM ({_LATEST}) WHERE "jobs" > 0 AND "sm" < $idle'
FREE_NOW = f'SELECT count("jobs") FROM ({_LATEST}) WHERE "jobs" = 0'
# Lost: a device reported in the time range, but no sample in the last ~3 minutes (a moving count of samples per
# minute; InfluxQL pushes an outer time condition into subqueries, so "not recently" cannot be a plain time filter).
LOST_NOW = (
    'SELECT count("n") FROM (SELECT last("n") AS "n" FROM (SELECT moving_average("n", 3) AS "n" FROM '
    f'(SELECT count("jobs") AS "n" FROM "gpu" WHERE {TF} GROUP BY time(1m), "host", "uuid", "mig" fill(0)) '
    'GROUP BY "host", "uuid", "mig") GROUP BY "host", "uuid", "mig") WHERE "n" = 0'
)
_PER_INTERVAL = (f'SELECT mean("sm_active_ratio") AS "sm", max("jobs") AS "jobs" FROM "gpu" WHERE {TF} '
                 f'GROUP BY time($__interval), "host", "uuid", "mig"')
BUSY = f'SELECT count("sm") FROM ({_PER_INTERVAL}) WHERE "jobs" > 0 AND "sm" >= $idle AND {TF} {EVERY}'
IDLE = f'SELECT count("sm") FROM ({_PER_INTERVAL}) WHERE "jobs" > 0 AND "sm" < $idle AND {TF} {EVERY}'
FREE = f'SELECT count("jobs") FROM ({_PER_INTERVAL}) WHERE "jobs" = 0 AND {TF} {EVERY}'


def _job_totals(fields: dict[str, str], where: str, by: str) -> str:
    """Per job, the latest total of each ``job_usage`` field (alias -> field) in the range, grouped by ``by`` tags."""
    sel = ", ".join(f'last("{f}") AS "{a}"' for a, f in fields.items())
    return f'SELECT {sel} FROM "job_usage" WHERE {where}{TF} GROUP BY "jobid", {by}'


def _by_account(expr: str, fields: dict[str, str], by: str = '"account"', where: str = "") -> str:
    return f"SELECT {expr} FROM ({_job_totals(fields, where, by)}) GROUP BY {by}"


def _by_account_over_time(expr: str, alias: str, field: str, by: str = '"account"', where: str = "") -> str:
    """``expr`` of each job's latest total of ``field`` (as ``alias``) in the range, at the time of that point: each
    job once, so the bars add up to the usage table's totals. (Summed per interval, InfluxQL would hand the
    subquery the interval, and a job's running total would count in every interval it reported; one selector only:
    InfluxQL stamps a selector's row with its point's time only when it is the sole one.)"""
    return f"SELECT {expr} FROM ({_job_totals({alias: field}, where, by)}) WHERE {TF} GROUP BY {by}"


def _cluster() -> Dashboard:
    alloc_waste = {"a": "allocated_gpu_seconds", "s": "sm_active_gpu_seconds"}
    return dashboard(
        "gpuledger-influx-cluster", "gpuledger / Cluster overview (InfluxDB)", "influxdb", "cluster-overview",
        row(
            "GPUs by state",
            stat("Busy", target(BUSY_NOW), no_value="0", description="Held by a job, SM activity at or above $idle."),
            stat("Allocated, idle", target(IDLE_NOW), no_value="0", thresholds=(("green", None), ("orange", 1)),
                 description="Held by a job, SM activity below $idle: waste."),
            stat("Free", target(FREE_NOW), no_value="0", thresholds=(("blue", None),),
                 description="Reporting, held by no job."),
            stat("Lost", target(LOST_NOW), no_value="0", thresholds=(("green", None), ("red", 1)),
                 description="Reported in the time range, silent for the last ~3 minutes."),
            stat("Power now", target(f'SELECT sum("p") FROM (SELECT last("power_watts") AS "p" FROM "gpu" '
                                     f'WHERE {NOW} GROUP BY "host", "uuid", "mig")'), unit="watt"),
            stat("Energy today", target(
                'SELECT sum("e") / 3600000 FROM (SELECT non_negative_difference(max("energy_joules")) AS "e" '
                f'FROM "gpu" WHERE {TF} GROUP BY time(1m), "host", "uuid", "mig")'), unit="kwatth", decimals=1,
                 time_from="now/d",
                 description="Sum of the energy counters' increase since midnight (a counter reset loses one minute)."),
            timeseries("GPUs by state", target(BUSY, "busy"), target(IDLE, "allocated idle"), target(FREE, "free"),
                       stack=True, width=24),
        ),
        row(
            "Fleet activity",
            timeseries("SM activity",
                       target(f'SELECT mean("sm_active_ratio") FROM "gpu" WHERE {TF} {EVERY} fill(none)', "all GPUs"),
                       target(f'SELECT mean("sm_active_ratio") FROM "gpu" WHERE "jobs" > 0 AND {TF} {EVERY} fill(none)',
                              "allocated GPUs"), **RATIO),
            timeseries("HBM bandwidth",
                       target(f'SELECT mean("dram_bw_ratio") FROM "gpu" WHERE {TF} {EVERY} fill(none)', "all GPUs"),
                       target(f'SELECT mean("dram_bw_ratio") FROM "gpu" WHERE "jobs" > 0 AND {TF} {EVERY} fill(none)',
                              "allocated GPUs"), **RATIO),
            timeseries("SM activity by node", target(
                f'SELECT mean("sm_active_ratio") FROM "gpu" WHERE {TF} {EVERY}, "host" fill(none)', "$tag_host"),
                **RATIO),
            timeseries("Power by node", target(
                f'SELECT sum("p") FROM (SELECT mean("power_watts") AS "p" FROM "gpu" WHERE {TF} {EVERY}, "host", '
                f'"uuid", "mig") WHERE {TF} {EVERY}, "host" fill(none)', "$tag_host"), unit="watt", stack=True),
        ),
        row(
            "Accounts (jobs that reported usage in the time range)",
            bar("Top accounts by GPU-hours", target(_by_account('sum("a") / 3600', alloc_waste), "$tag_account"),
                unit="h", decimals=1),
            bar("Top accounts by waste (allocated, not SM-active GPU-hours)",
                target(_by_account('(sum("a") - sum("s")) / 3600', alloc_waste), "$tag_account"),
                unit="h", decimals=1, thresholds=(("orange", None),)),
        ),
        variables=(IDLE_VAR,),
        description="Fleet state, activity, power, energy and per-account usage from the collector's InfluxDB.",
    )


def _node() -> Dashboard:
    where = f'"host" =~ /^$host$/ AND "gpu" =~ /^$gpu$/ AND {TF}'
    by_gpu = f'{EVERY}, "host", "gpu", "mig" fill(none)'

    def per_gpu(title: str, field: str, unit: str = "none", fn: str = "mean", **kw: Any) -> Panel:
        return timeseries(title, target(f'SELECT {fn}("{field}") FROM "gpu" WHERE {where} {by_gpu}', GPU_ALIAS),
                          unit=unit, **kw)

    def pair(title: str, a: tuple[str, str], b: tuple[str, str], unit: str, **kw: Any) -> Panel:
        return timeseries(title, *(target(f'SELECT mean("{f}") FROM "gpu" WHERE {where} {by_gpu}',
                                          f"{name} {GPU_ALIAS}") for name, f in (a, b)), unit=unit, **kw)

    return dashboard(
        "gpuledger-influx-node", "gpuledger / Node and GPU (InfluxDB)", "influxdb", "node-gpu",
        row(
            "Activity",
            per_gpu("SM activity", "sm_active_ratio", **RATIO),
            per_gpu("SM occupancy", "sm_occupancy_ratio", **RATIO),
            per_gpu("HBM bandwidth", "dram_bw_ratio", **RATIO),
            per_gpu("Tensor pipes", "tensor_active_ratio", **RATIO),
            timeseries("FP pipes", *(target(f'SELECT mean("{f}_active_ratio") FROM "gpu" WHERE {where} {by_gpu}',
                                            f"{f} {GPU_ALIAS}") for f in ("fp64", "fp32", "fp16")), **RATIO),
            pair("Utilisation (nvidia-smi) and memory copy", ("util", "gpu_util_ratio"),
                 ("copy", "mem_copy_util_ratio"), **RATIO),
        ),
        row(
            "Power, thermals, clocks",
            per_gpu("Power", "power_watts", "watt"),
            timeseries("Power from the energy counter", target(
                f'SELECT non_negative_derivative(max("energy_joules"), 1s) FROM "gpu" WHERE {where} {by_gpu}',
                GPU_ALIAS),
                unit="watt", description="The counter's rate; should track sampled power."),
            per_gpu("Temperature", "temp_celsius", "celsius"),
            pair("Clocks", ("SM", "sm_clock_hz"), ("mem", "mem_clock_hz"), "hertz"),
        ),
        row(
            "Memory and PCIe",
            per_gpu("Memory used", "mem_used_bytes", "bytes"),
            timeseries("Memory used (share)", target(
                f'SELECT mean("mem_used_bytes") / mean("mem_total_bytes") FROM "gpu" WHERE {where} {by_gpu}',
                GPU_ALIAS),
                **RATIO),
            pair("PCIe", ("tx", "pcie_tx_bytes_per_second"), ("rx", "pcie_rx_bytes_per_second"), "Bps"),
        ),
        row(
            "Health",
            per_gpu("Xid errors", "xid_errors", "short", fn="sum", bars=True,
                    description="Xid events reported per interval."),
            per_gpu("Throttle reasons (NVML bit mask)", "throttle_reasons", fn="max",
                    description="0 = not throttled; see nvmlClocksEventReasons for the bits."),
            timeseries("ECC errors and remapped rows (increase)", *(target(
                f'SELECT non_negative_difference(max("{f}")) FROM "gpu" WHERE {where} {by_gpu}', f"{name} {GPU_ALIAS}")
                for name, f in (("ECC", "ecc_errors_total"), ("remapped", "remapped_rows_total"))), unit="short"),
            table("Jobs on these GPUs now", target(
                f'SELECT last("share") AS "share", last("sm_active_ratio") AS "sm_active_ratio" FROM "gpu_job" '
                f'WHERE "host" =~ /^$host$/ AND {NOW} GROUP BY "host", "uuid", "mig", "jobid"', fmt="table"),
                width=12),
        ),
        variables=(
            query_var("host", 'SHOW TAG VALUES FROM "gpu" WITH KEY = "host"', "Host", multi=True, include_all=True),
            query_var("gpu", 'SHOW TAG VALUES FROM "gpu" WITH KEY = "gpu" WHERE "host" =~ /^$host$/', "GPU",
                      multi=True, include_all=True),
        ),
        description="Per-GPU telemetry of the selected nodes from the collector's InfluxDB.",
    )


def _job() -> Dashboard:
    job = "\"jobid\" = '$jobid'"
    by_gpu = f'{EVERY}, "host", "uuid", "mig" fill(none)'
    alias = "$tag_host $tag_uuid $tag_mig"

    def per_gpu(title: str, field: str, unit: str = "none", **kw: Any) -> Panel:
        return timeseries(title, target(f'SELECT mean("{field}") FROM "gpu_job" WHERE {job} AND {TF} {by_gpu}', alias),
                          unit=unit, **kw)

    def usage(title: str, expr: str, unit: str = "none", **kw: Any) -> Panel:
        return stat(title, target(f'SELECT {expr} FROM "job_usage" WHERE {job}'), unit=unit, **kw)

    return dashboard(
        "gpuledger-influx-job", "gpuledger / Job (InfluxDB)", "influxdb", "job",
        row(
            "Usage summary (the collector's measured totals)",
            usage("GPUs", 'last("gpus")'),
            usage("GPU-hours allocated", 'last("allocated_gpu_seconds") / 3600', "h", decimals=2),
            usage("SM-active GPU-hours", 'last("sm_active_gpu_seconds") / 3600', "h", decimals=2),
            usage("Efficiency", 'last("efficiency")', "percentunit", decimals=1,
                  thresholds=(("red", None), ("orange", 0.3), ("green", 0.6)),
                  description="SM-active over allocated GPU-seconds. Below 30 %: the GPUs mostly waited (input "
                              "pipeline, CPU, I/O) or sat idle; high HBM with low SM means a memory-bound job."),
            usage("Energy", 'last("energy_joules") / 3600000', "kwatth", decimals=2),
            usage("Mean HBM bandwidth", 'last("dram_bw_mean")', "percentunit", decimals=1),
            table("Job", target(
                'SELECT last("gpus") AS "gpus", last("allocated_gpu_seconds") / 3600 AS "gpu_hours", '
                'last("sm_active_gpu_seconds") / 3600 AS "sm_active_gpu_hours", last("efficiency") AS "efficiency", '
                'last("sm_active_mean") AS "sm_active_mean", last("dram_bw_mean") AS "dram_bw_mean", '
                f'last("energy_joules") / 3600000 AS "energy_kwh" FROM "job_usage" WHERE {job} '
                'GROUP BY "cluster", "partition", "account", "user"', fmt="table"), height=5),
        ),
        row(
            "The job's GPUs over the time range (set it to the job's lifetime)",
            per_gpu("SM activity", "sm_active_ratio", **RATIO),
            per_gpu("HBM bandwidth", "dram_bw_ratio", **RATIO),
            per_gpu("Tensor pipes", "tensor_active_ratio", **RATIO),
            per_gpu("Share of the GPU", "share", **RATIO,
                    description="Below 1 when the GPU is shared with other jobs."),
            timeseries("Power (the job's share)", target(
                f'SELECT mean("power_watts") * mean("share") FROM "gpu_job" WHERE {job} AND {TF} {by_gpu}', alias),
                unit="watt", description="The GPU's power times the job's share of it."),
            per_gpu("Memory used on the GPU", "mem_used_bytes", "bytes",
                    description="The whole GPU's memory in use (all jobs on it)."),
        ),
        variables=(query_var("jobid", 'SHOW TAG VALUES FROM "job_usage" WITH KEY = "jobid"', "Job id"),),
        description="One job: its measured usage and efficiency, and its GPUs' metrics over its lifetime.",
    )


_OVER_TIME = ("One bar per job: its total, at its latest usage record in the range (the bars add up to the usage "
              "table's totals).")
_BY_TIME = ({"id": "sortBy", "options": {"sort": [{"field": "Time"}]}},)  # a job's point per job, in job order


def _accounting() -> Dashboard:
    acct = "\"account\" =~ /^$account$/ AND \"user\" =~ /^$user$/ AND "
    totals = {"a": "allocated_gpu_seconds", "s": "sm_active_gpu_seconds", "e": "energy_joules"}
    fs = "\"account\" =~ /^$account$/ AND \"user\" =~ /^$user$/"
    return dashboard(
        "gpuledger-influx-accounting", "gpuledger / Accounting (InfluxDB)", "influxdb", "accounting",
        row(
            "Usage over time (each job at its latest usage record)",
            timeseries("GPU-hours by account", target(
                _by_account_over_time('"a" / 3600', "a", totals["a"], where=acct), "$tag_account"), unit="h",
                bars=True, stack=True, description=_OVER_TIME, transformations=_BY_TIME),
            timeseries("Energy by account", target(
                _by_account_over_time('"e" / 3600000', "e", totals["e"], where=acct), "$tag_account"),
                unit="kwatth", bars=True, stack=True, description=_OVER_TIME, transformations=_BY_TIME),
            timeseries("GPU-hours by user", target(
                _by_account_over_time('"a" / 3600', "a", totals["a"], by='"user"', where=acct), "$tag_user"),
                unit="h", bars=True, stack=True, description=_OVER_TIME, transformations=_BY_TIME),
            bar("Efficiency by account", target(
                _by_account('sum("s") / sum("a")', totals, where=acct), "$tag_account"), **RATIO,
                thresholds=(("red", None), ("orange", 0.3), ("green", 0.6))),
            table("Usage by account and user", target(_by_account(
                'sum("a") / 3600 AS "gpu_hours", sum("s") / 3600 AS "sm_active_gpu_hours", '
                'sum("s") / sum("a") AS "efficiency", sum("e") / 3600000 AS "energy_kwh", count("a") AS "jobs"',
                totals, by='"account", "user"', where=acct), fmt="table")),
        ),
        row(
            "Fairshare and site factor",
            timeseries("Fairshare", target(
                f'SELECT last("fairshare") FROM "fairshare" WHERE {fs} AND {TF} {EVERY}, "account", "user" '
                'fill(previous)', "$tag_account / $tag_user"), min=0, max=1),
            timeseries("Site factor", target(
                f'SELECT last("site_factor") FROM "fairshare" WHERE {fs} AND {TF} {EVERY}, "account", "user" '
                'fill(previous)', "$tag_account / $tag_user")),
            table("Associations (latest)", target(
                'SELECT last("fairshare") AS "fairshare", last("site_factor") AS "site_factor", '
                'last("effective_usage") AS "effective_usage", last("raw_usage") AS "raw_usage" FROM "fairshare" '
                f'WHERE {fs} AND {TF} GROUP BY "account", "user"', fmt="table")),
        ),
        variables=(
            query_var("account", 'SHOW TAG VALUES FROM "job_usage" WITH KEY = "account"', "Account",
                      multi=True, include_all=True),
            query_var("user", 'SHOW TAG VALUES FROM "job_usage" WITH KEY = "user" WHERE "account" =~ /^$account$/',
                      "User", multi=True, include_all=True),
        ),
        description="GPU-hours, energy and efficiency by account and user; measured fairshare and site factors.",
    )


DASHBOARDS: list[Dashboard] = [_cluster(), _node(), _job(), _accounting()]
STATE_QUERIES: dict[str, str] = {"busy": BUSY_NOW, "allocated-idle": IDLE_NOW, "free": FREE_NOW, "lost": LOST_NOW}
