"""``compact``/``series``/``totals`` on a real store file."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from gpuledger.collector.store import Store
from gpuledger.collector.store_cli import DB_NAME, app
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000


def test_compact_series_totals(tmp_path):
    store = Store(tmp_path / DB_NAME)
    ss = tuple(GpuSample(ts=H + i * 10, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0 + i,
                         job_ids=("5",)) for i in range(400))
    store.ingest(Batch("a", 0, "n1", ss))
    store.close()
    run = CliRunner().invoke
    assert json.loads(run(app, ["totals", "--data-dir", str(tmp_path)]).output)["last_compaction"] is None
    before = time.time()
    r = run(app, ["compact", "--data-dir", str(tmp_path), "--now", str(H + 86400)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["rolled_minutes"] == 56 and out["tiers"][1]["rows"] == 56  # (3990 - 600) // 60 closed minutes
    r = run(app, ["series", "n1", "G0", "--start", str(H), "--end", str(H + 119), "--data-dir", str(tmp_path)])
    assert [json.loads(x)["ts"] for x in r.output.splitlines()] == [H + i * 10 for i in range(12)]
    r = run(app, ["series", "n1", "G0", "--start", str(H), "--end", str(H + 3599), "--step", "3600",
                  "--tier", "1m", "--data-dir", str(tmp_path)])
    (p,) = [json.loads(x) for x in r.output.splitlines()]
    assert p["samples"] == 360 and p["mean"]["power_watts"] == sum(100.0 + i for i in range(360)) / 360
    r = run(app, ["totals", "--data-dir", str(tmp_path)])
    t = json.loads(r.output)
    assert t["samples"] == 400 and t["allocated_gpu_seconds"] == 3990.0
    assert before <= t["last_compaction"] <= time.time()  # when it ran (the wall clock), not its --now
    assert run(app, ["totals", "--data-dir", str(tmp_path / "nope")]).exit_code == 2


def test_series_endpoint_picks_the_tier(tmp_path) -> None:
    import httpx

    from gpuledger.collector.server import CollectorServer
    from gpuledger.collector.store import Store
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    t0 = 1_800_000_000.0
    store = Store(tmp_path / "s.sqlite", clock=lambda: t0 + 7200)
    store.ingest(Batch("a", 1, "h", tuple(GpuSample(ts=t0 + 10 * i, host="h", gpu_uuid="G", gpu_index=0,
                                                    power_watts=100.0 + i) for i in range(360))))
    server = CollectorServer(store, clock=lambda: t0 + 7200).start()
    try:
        with httpx.Client(base_url=server.url) as c:
            raw = c.get("/api/v1/series", params={"host": "h", "uuid": "G", "start": t0, "end": t0 + 100}).json()
            assert [p["power_watts"] for p in raw] == [100.0 + i for i in range(11)]
            buckets = c.get("/api/v1/series", params={"host": "h", "uuid": "G", "start": t0, "end": t0 + 3599,
                                                      "step": 600}).json()
            assert len(buckets) == 6 and all(b["samples"] == 60 and b["step"] == 600 for b in buckets)
            assert buckets[0]["mean"]["power_watts"] == sum(100.0 + i for i in range(60)) / 60
            assert (buckets[0]["min"]["power_watts"], buckets[0]["max"]["power_watts"]) == (100.0, 159.0)
            r = c.get("/api/v1/series", params={"host": "h", "uuid": "G", "start": "x", "end": 1})
            assert r.status_code == 400 and "start" in r.json()["error"]
            assert c.get("/api/v1/series", params={"host": "h"}).status_code == 400
    finally:
        server.stop()
        store.close()


def test_bad_ranges_steps_and_times_exit_2_naming_the_option(tmp_path):
    """``collector series|totals`` take the ranges the API takes (``store.query_range``, one rule for both), and
    ``compact --now`` no time past a day ahead of the clock (retention deletes by it): anything else is exit 2 with
    one line naming the option, and nothing is read or compacted."""
    import time

    store = Store(tmp_path / DB_NAME)
    now = time.time()
    t0 = now - 600
    store.ingest(Batch("a", 0, "n1", tuple(GpuSample(ts=t0 + i * 10, host="n1", gpu_uuid="G0", gpu_index=0,
                                                     power_watts=100.0) for i in range(30))))
    store.close()
    run = CliRunner().invoke
    gpu = ["series", "n1", "G0", "--start", str(t0), "--end", str(t0 + 300)]
    for args, option in [
        ([*gpu, "--step", "-5"], "--step"), ([*gpu, "--step", "0"], "--step"), ([*gpu, "--step", "nan"], "--step"),
        ([*gpu, "--step", "inf"], "--step"), ([*gpu, "--step", "1e12"], "--step"),
        (["series", "n1", "G0", "--start", str(t0), "--end", str(t0 - 1)], "--end"),
        (["series", "n1", "G0", "--start", "nan"], "--start"), (["series", "n1", "G0", "--start", "inf"], "--start"),
        (["series", "n1", "G0", "--start", str(t0), "--end", "1e12"], "--end"),
        (["totals", "--start", "10", "--end", "5"], "--end"), (["totals", "--start", "nan"], "--start"),
        (["totals", "--end", "inf"], "--end"), (["totals", "--start", "-1"], "--start"),
        (["compact", "--now", str(now * 1000)], "--now"), (["compact", "--now", str(now + 2 * 86400)], "--now"),
        (["compact", "--now", "nan"], "--now"),
    ]:
        r = run(app, [*args, "--data-dir", str(tmp_path)])
        assert r.exit_code == 2 and len(r.output.splitlines()) == 1 and option in r.output, (args, r.output)
    raw = run(app, [*gpu, "--data-dir", str(tmp_path)])
    assert raw.exit_code == 0 and len(raw.output.splitlines()) == 30  # --now in ms expired nothing
    tiny = run(app, [*gpu, "--step", "1e-300", "--tier", "raw", "--data-dir", str(tmp_path)])  # the finest bucket
    assert tiny.exit_code == 0 and {json.loads(x)["step"] for x in tiny.output.splitlines()} == {0.001}
    assert run(app, ["compact", "--now", str(now + 3600), "--data-dir", str(tmp_path)]).exit_code == 0
