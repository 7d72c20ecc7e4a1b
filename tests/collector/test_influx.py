"""The InfluxDB sink against real servers: Debian's InfluxDB 1.6 (/write, InfluxQL) and VictoriaMetrics
(v2 write API through influxdb-client, read back through its Prometheus API). Both are started here
on free loopback ports and stopped by PID."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from servers import InfluxServer, VictoriaMetricsServer, free_port  # tests/servers.py: the shared harness

from gpuledger.collector.sinks.influx import (
    GpuPrefixes,
    InfluxSink,
    escape_measurement,
    escape_tag,
    fairshare_lines,
    fields,
    sample_lines,
    string_field,
)
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

pytestmark = pytest.mark.influx
T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def influx1(tmp_path_factory):
    with InfluxServer(tmp_path_factory.mktemp("influx"), db="gl") as server:
        yield server.url


@pytest.fixture(scope="module")
def vm(tmp_path_factory):
    with VictoriaMetricsServer(tmp_path_factory.mktemp("vm")) as server:
        yield server.url


def influxql(url: str, q: str, db: str = "gl") -> list[dict]:
    r = httpx.get(f"{url}/query", params={"db": db, "q": q, "epoch": "ms"})
    r.raise_for_status()
    res = r.json()["results"][0]
    assert "error" not in res, res
    return res.get("series", [])


def sample(ts: float, host: str = "n1", uuid: str = "GPU-1", **kw) -> GpuSample:
    base = dict(gpu_index=0, model="NVIDIA H200", power_watts=350.5, energy_joules=1000.0 + ts - T0,
                sm_active_ratio=0.5, dram_bw_ratio=0.25, mem_used_bytes=123456789012, temp_celsius=41.0,
                throttle_reasons=0, job_ids=("101",))
    base.update(kw)
    return GpuSample(ts=ts, host=host, gpu_uuid=uuid, **base)


# -- pure encoding --------------------------------------------------------------------------------

def test_escaping_rules():
    assert escape_tag("a b,c=d\\e\nf") == r"a\ b\,c\=d\\e f"
    assert escape_measurement("gpu job,x=1") == r"gpu\ job\,x=1"
    assert string_field('say "hi" \\ ok') == r'"say \"hi\" \\ ok"'
    assert fields([("a", 1), ("b", 1.0), ("c", None), ("d", float("nan")), ("e", True), ("f", 2**64)]) == \
        "a=1i,b=1.0,e=true"


def test_sample_lines_schema():
    s = sample(T0 + 0.25, mig="1.0", job_ids=("7", "8"), job_shares=(0.75, 0.25), xid_errors=(79, 48),
               sm_occupancy_ratio=None)
    gpu, j7, j8 = sample_lines([s])
    assert gpu.startswith("gpu,gpu=0,host=n1,mig=1.0,model=NVIDIA\\ H200,uuid=GPU-1 ")
    assert gpu.endswith(f" {round((T0 + 0.25) * 1000)}")
    fs = dict(kv.split("=") for kv in gpu.split(" ")[2].split(","))
    assert fs["mem_used_bytes"] == "123456789012i"
    assert "power_watts" not in fs and "energy_joules" not in fs  # a MIG instance: its GPU's are on the GPU's point
    assert fs["xid_errors"] == "2i" and fs["jobs"] == "2i" and "sm_occupancy_ratio" not in fs
    assert "jobid" not in gpu  # no job ids on the per-GPU series
    assert j7.startswith("gpu_job,host=n1,jobid=7,mig=1.0,uuid=GPU-1 share=0.75,sm_active_ratio=0.5,")
    assert ",power_watts=350.5," in j7  # the GPU's power, which the share splits
    assert j8.split(" ")[1].startswith("share=0.25") and ",share_reported=true " in j8
    (_, equal) = sample_lines([sample(T0, job_ids=("9",))])  # no shares reported: the equal split, marked so
    assert " share=1.0," in equal and ",share_reported=false " in equal
    (plain,) = sample_lines([sample(T0, job_ids=())])
    assert ",mig=" not in plain and "power_watts=350.5" in plain and ",jobs=0i " in plain


def test_a_mig_gpus_own_point_is_no_device() -> None:
    """A MIG GPU's whole-GPU point has its readings and no ``jobs`` (its instances are the devices), told by its
    instances of the same instant (in either order); a whole GPU's point keeps ``jobs``, whatever instances of its
    other instants are rendered beside it or before it."""
    gpu = sample(T0, job_ids=())
    inst = sample(T0, mig="1", model="NVIDIA H200 MIG 3g.71gb")
    fs = lambda ln: dict(kv.split("=") for kv in ln.split(" ")[-2].split(","))  # noqa: E731
    own, point, _ = sample_lines([gpu, inst])
    assert "jobs" not in fs(own) and fs(own)["power_watts"] == "350.5"
    assert fs(point)["jobs"] == "1i" and "power_watts" not in fs(point)
    point, _, own = sample_lines([inst, gpu])
    assert "jobs" not in fs(own)
    (whole,) = sample_lines([gpu])  # no instance: a whole GPU, free
    assert fs(whole)["jobs"] == "0i"
    px = GpuPrefixes()
    sample_lines([inst], px)
    before = sample_lines([sample(T0 - 10), inst], px)[0]  # before its switch into MIG mode: a job held it
    assert fs(before)["jobs"] == "1i"
    (later,) = sample_lines([sample(T0 + 10, job_ids=())], px)  # out of MIG mode since (its instances are older)
    assert fs(later)["jobs"] == "0i"


def test_cluster_overview_counts_a_mig_gpu_as_its_instances(influx1, tmp_path):
    """One node as the agent sends it: a MIG GPU (two 3g instances, a job each, SM 0.5) and a whole GPU no job holds,
    400 W each; collector -> InfluxDB sink -> InfluxDB 1.x; the Cluster overview's state and power panels: 2 busy,
    1 free, 800 W."""
    import json

    from gpuledger.agent.mig import MigEnergySplitter
    from gpuledger.dashboards.influxdb_defs import STATE_QUERIES

    t0 = time.time() - 70

    def tick(t: float, e: float) -> list[GpuSample]:
        mig = sample(t, host="mig01", uuid="GPU-A", energy_joules=e, power_watts=400.0, job_ids=(),
                     sm_active_ratio=None, dram_bw_ratio=None, mem_used_bytes=None)
        insts = [sample(t, host="mig01", uuid="GPU-A", mig=m, model="NVIDIA H200 MIG 3g.71gb", power_watts=None,
                        energy_joules=None, job_ids=(j,)) for m, j in (("1", "j1"), ("2", "j2"))]
        free = sample(t, host="mig01", uuid="GPU-B", gpu_index=1, energy_joules=e, power_watts=400.0, job_ids=())
        return [mig, *insts, free]

    split = MigEnergySplitter()
    httpx.post(f"{influx1}/query", params={"q": 'CREATE DATABASE "mig"'}).raise_for_status()
    sink = InfluxSink(influx1, api="v1", database="mig", batch_lines=50)
    store = Store(tmp_path / "s.sqlite", sinks=[sink], summary_interval_s=3600)
    for i in range(7):
        store.ingest(Batch("a", i, "mig01", tuple(split.map(tick(t0 + 10 * i, 1e6 + 4000.0 * i)))))
    assert sink.flush(30)
    store.close()
    sink.close()
    doc = json.loads((Path(__file__).parents[2] / "gpuledger/dashboards/influxdb/cluster-overview.json").read_text())
    queries = {k: v for k, v in STATE_QUERIES.items() if k != "lost"}
    queries["power"] = next(p["targets"][0]["query"] for p in doc["panels"] if p["title"] == "Power now")
    got = {}
    for name, q in queries.items():
        rows = influxql(influx1, q.replace("$idle", "0.05").replace("$timeFilter", "time > now() - 10m"), "mig")
        got[name] = rows[0]["values"][0][1] if rows else 0
    assert got == {"busy": 2, "allocated-idle": 0, "free": 1, "power": 800.0}

    (acct, user) = fairshare_lines([
        {"account": "phys", "user": None, "fairshare": 0.5, "site_factor": 500, "effective_usage": 0.1, "raw_usage": 3},
        {"account": "phys", "user": "ann b", "fairshare": 0.25, "site_factor": 250.0, "effective_usage": 0.2,
         "raw_usage": 7.5}], ts=T0)
    assert acct == ("fairshare,account=phys effective_usage=0.1,fairshare=0.5,raw_usage=3.0,site_factor=500i "
                    f"{int(T0 * 1000)}")
    assert user.startswith(r"fairshare,account=phys,user=ann\ b ")


# -- real servers ---------------------------------------------------------------------------------

def mig_switch_batches(host: str) -> list[Batch]:
    """A GPU as its agent sends it: a minute out of MIG mode with job j0 on it (power, its counter), then, after the
    reset that a switch into MIG mode needs, a minute in MIG mode (two 3g instances, jobs j1 and j2); a batch each
    half minute."""
    from gpuledger.agent.mig import MigEnergySplitter

    def tick(i: int) -> list[GpuSample]:
        t, e = T0 + 10.0 * i, 1e6 + 4000.0 * i
        if i < 6:
            return [sample(t, host=host, uuid="GPU-S", energy_joules=e, power_watts=300.0, job_ids=("j0",))]
        return [sample(t, host=host, uuid="GPU-S", energy_joules=e, power_watts=400.0, job_ids=()),
                *(sample(t, host=host, uuid="GPU-S", mig=m, model="NVIDIA H200 MIG 3g.71gb", power_watts=None,
                         energy_joules=None, job_ids=(j,)) for m, j in (("1", "j1"), ("2", "j2")))]

    split = MigEnergySplitter()
    ticks = [split.map(tick(i)) for i in range(12)]
    return [Batch("a", seq, host, tuple(r for t in ticks[3 * seq:3 * seq + 3] for r in t)) for seq in range(4)]


def gpu_points(url: str, db: str) -> dict[tuple, list]:
    """{(measurement, tags): [[ms, fields...], ...]} of every point of database ``db``."""
    return {(m, tuple(sorted(s["tags"].items()))): s["values"]
            for m in ("gpu", "gpu_job") for s in influxql(url, f'SELECT * FROM "{m}" GROUP BY *', db)}


def test_a_backlog_replayed_out_of_order_across_a_switch_into_mig_gives_the_same_points(influx1, tmp_path):
    """The same batches of a GPU that went into MIG mode, ingested in order, out of order (a backlog replayed: the
    MIG minute first) and as one batch, through the InfluxDB sink and shipped by the series outbox (``series_url``,
    one shipment of the backlog): identical points everywhere, the minute before the switch with its job (``jobs``
    = 1 on the whole GPU), the MIG GPU's own points with none (its instances are the devices)."""
    from gpuledger.collector.series_outbox import RemoteSeries

    made = mig_switch_batches("sw01")
    deliveries = {"inorder": made, "outoforder": [made[k] for k in (2, 3, 0, 1)],
                  "onebatch": [Batch("a", 0, "sw01", tuple(r for b in made for r in b.rows))]}
    for db, delivered in deliveries.items():
        for name in (db, f"{db}_shipped"):
            httpx.post(f"{influx1}/query", params={"q": f'CREATE DATABASE "{name}"'}).raise_for_status()
        sink = InfluxSink(influx1, api="v1", database=db, batch_lines=10_000)
        store = Store(tmp_path / f"{db}.sqlite", sinks=[sink], summary_interval_s=3600, series_outbox=True)
        try:
            for b in delivered:
                assert store.ingest(b).accepted == len(b.rows)
            assert sink.flush(30)
            remote = RemoteSeries(store.series_store, influx1, "influxdb", f"{db}_shipped", interval_s=0.05)
            assert remote.shipper.flush(30)
            remote.close()
        finally:
            store.close()
            sink.close()
    got = gpu_points(influx1, "inorder")
    for db in deliveries:
        assert gpu_points(influx1, db) == got, db
        assert gpu_points(influx1, f"{db}_shipped") == got, db
    (whole,) = influxql(influx1, 'SELECT "jobs", "energy_joules" FROM "gpu" WHERE "mig" = \'\'', "inorder")
    assert [row[1] for row in whole["values"]] == [1] * 6 + [None] * 6
    assert [row[2] for row in whole["values"]] == [1e6 + 4000.0 * i for i in range(12)]  # the GPU's counter, once

def test_v1_write_path_against_influxdb_1_6(influx1, tmp_path):
    sink = InfluxSink(influx1, api="v1", database="gl", batch_lines=50)
    store = Store(tmp_path / "s.sqlite", sinks=[sink], summary_interval_s=3600)
    store.put_jobs([JobRecord("101", cluster="c1", user="ann", account="phys", partition="gpu")])
    odd_host = "rack 1,node=2"  # every character a tag must escape
    samples = [sample(T0 + i, host=odd_host) for i in range(120)]
    samples += [sample(T0 + i, host=odd_host, uuid="GPU-2", job_ids=("101", "102"), job_shares=(0.5, 0.5))
                for i in range(120)]
    for i in range(0, 240, 60):
        store.ingest(Batch("a", i, odd_host, tuple(samples[i:i + 60])))
    store.compact()  # also writes the job summaries
    sink.write_lines(fairshare_lines([{"account": "phys", "user": "ann", "fairshare": 0.5, "site_factor": 5,
                                       "effective_usage": 0.1, "raw_usage": 2.0}], ts=T0))
    assert sink.flush(30)
    store.close()
    sink.close()
    # job summaries: 2 jobs when first seen (then rate-limited), 2 more at compaction
    assert sink.stats.written_lines == 240 + 360 + 2 + 2 + 1 and sink.stats.dropped_lines == 0
    (s,) = influxql(influx1, "SELECT count(power_watts) FROM gpu GROUP BY host")
    assert s["tags"]["host"] == odd_host and s["values"][0][1] == 240
    (s,) = influxql(influx1, "SELECT power_watts, mem_used_bytes, jobs FROM gpu WHERE uuid='GPU-2' LIMIT 1")
    assert s["values"][0] == [int(T0 * 1000), 350.5, 123456789012, 2]
    rows = influxql(influx1, "SELECT sum(share) FROM gpu_job GROUP BY jobid")
    assert {r["tags"]["jobid"]: r["values"][0][1] for r in rows} == {"101": 180.0, "102": 60.0}
    (u,) = influxql(influx1, "SELECT last(allocated_gpu_seconds), last(gpus) FROM job_usage "
                             "WHERE jobid='101' GROUP BY account, \"user\", partition, cluster")
    assert u["tags"] == {"account": "phys", "user": "ann", "partition": "gpu", "cluster": "c1"}
    assert u["values"][0][1] == pytest.approx(119 + 119 * 0.5) and u["values"][0][2] == 2
    (f,) = influxql(influx1, "SELECT fairshare, site_factor FROM fairshare")
    assert f["values"][0][1:] == [0.5, 5]


def test_v1_refused_batch_is_counted_not_retried(influx1):
    sink = InfluxSink(influx1, api="v1", database="nosuchdb", sleep=lambda s: None)
    sink.write_lines(["m f=1.0 1"])
    sink.flush()
    sink.close()
    assert sink.stats.rejected_lines == 1 and sink.stats.failed_writes == 0
    assert "database not found" in sink.stats.last_error


def test_v2_write_path_against_victoria_metrics(vm):
    sink = InfluxSink(vm, api="v2", bucket="b", org="o", token="t", batch_lines=100)
    ss = [sample(T0 + i, uuid=f"GPU-{g}", gpu_index=g, job_ids=(f"{g}00",)) for g in range(3) for i in range(50)]
    sink.write(ss)
    assert sink.flush(30)
    sink.close()
    assert sink.stats.written_lines == 300
    httpx.get(f"{vm}/internal/force_flush").raise_for_status()
    r = httpx.get(f"{vm}/api/v1/export", params={"match[]": '{__name__="gpu_power_watts"}'})
    import json
    series = [json.loads(x) for x in r.text.splitlines()]
    assert sorted(s["metric"]["uuid"] for s in series) == ["GPU-0", "GPU-1", "GPU-2"]
    assert all(len(s["values"]) == 50 and set(s["values"]) == {350.5} for s in series)
    assert series[0]["metric"]["model"] == "NVIDIA H200" and "jobid" not in series[0]["metric"]
    assert sorted(series[0]["timestamps"])[:2] == [int(T0 * 1000), int(T0 * 1000) + 1000]
    q = httpx.get(f"{vm}/api/v1/query", params={"query": "count(gpu_job_share) by (jobid)", "time": T0 + 49}).json()
    assert sorted(x["metric"]["jobid"] for x in q["data"]["result"]) == ["000", "100", "200"]


def test_retries_with_backoff_until_the_server_appears(tmp_path):
    port = free_port()
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        time.sleep(0.2)

    sink = InfluxSink(f"http://127.0.0.1:{port}", api="v2", sleep=sleep, backoff_s=0.1, max_retries=200,
                      flush_interval_s=0.05,
                      timeout_s=5)
    sink.write([sample(T0)])
    time.sleep(0.5)
    try:
        with VictoriaMetricsServer(tmp_path / "vm", port=port):
            assert sink.flush(60)
            assert sink.stats.written_lines == 2 and sink.stats.failed_writes >= 1
            assert waits[:3] == [0.1, 0.2, 0.4]
    finally:
        sink.close()


def test_overflow_and_giving_up_are_counted():
    sink = InfluxSink(f"http://127.0.0.1:{free_port()}", api="v1", max_buffer_lines=10, max_retries=2,
                      sleep=lambda s: None, timeout_s=1)
    sink.write_lines([f"m f={i}.0 {i}" for i in range(8)])
    sink.write_lines([f"m f={i}.0 {i}" for i in range(8)])  # would exceed the buffer if still queued
    sink.flush(30)
    sink.close()
    st = sink.stats
    assert st.written_lines == 0 and st.dropped_lines == 16 and st.failed_writes >= 3
