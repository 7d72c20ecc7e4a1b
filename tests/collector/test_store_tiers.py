"""Chunked raw storage, rollup tiers, retention, compaction idempotence, tier picking, migration."""

from __future__ import annotations

import random
import sqlite3

import msgpack
import numpy as np
import pytest

from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import Series
from gpuledger.collector.series_store import HOUR, MINUTE, RAW, Retention
from gpuledger.collector.store import SettingsMismatch, Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import SAMPLE_FIELDS, GpuSample

H = 3600.0 * 480_000  # an hour (and day) boundary
DAY = 86400.0


def gen(n: int, step: float = 10.0, gpus=("G0", "G1"), t0: float = H, seed: int = 0) -> list[GpuSample]:
    rnd = random.Random(seed)
    out = []
    for g in gpus:
        e = 0.0
        for i in range(n):
            e += rnd.uniform(100, 900)
            out.append(GpuSample(ts=t0 + i * step, host="n1", gpu_uuid=g, gpu_index=0, model="H200",
                                 power_watts=round(rnd.uniform(80, 700), 1), energy_joules=e,
                                 sm_active_ratio=rnd.choice([None, round(rnd.random(), 3)]),
                                 mem_used_bytes=rnd.randrange(10**11), job_ids=("7",)))
    return out


def ingest_all(store: Store, samples: list[GpuSample], size: int = 500, agent: str = "a") -> None:
    for i, j in enumerate(range(0, len(samples), size)):
        store.ingest(Batch(agent, i, "n1", tuple(samples[j:j + size])))


def chunk_rows(store: Store, tier: int) -> list[tuple]:
    return store._db.execute(
        "SELECT host, gpu_uuid, mig, bucket, t_min, t_max, n FROM chunks WHERE tier=? ORDER BY 1,2,3,4,5", (tier,)
    ).fetchall()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_raw_samples_live_in_chunks_not_rows(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    ss = gen(300)  # 3,000 s per GPU: within one raw hour
    store.ingest(Batch("a", 0, "n1", tuple(ss)))
    rows = chunk_rows(store, RAW)
    assert [(r[1], r[6]) for r in rows] == [("G0", 300), ("G1", 300)]
    assert store.series("n1", "G0", H, H + 1e6) == [s for s in ss if s.gpu_uuid == "G0"]
    total = store._db.execute("SELECT SUM(LENGTH(data)) FROM chunks").fetchone()[0]
    assert total / len(ss) < 40  # bytes per sample (random data: incompressible mem_used and sm ratios)
    store.close()


def test_compaction_rolls_up_closed_minutes_exactly_and_is_idempotent(ledger):
    clock = Clock(H + 4 * 3600)
    store = Store(ledger, window_s=600, clock=clock)
    ss = gen(1200, step=10.0)  # 3 h 20 min per GPU, in 500-sample batches: many small chunks
    ingest_all(store, ss)
    assert len(chunk_rows(store, RAW)) > 8
    st = store.compact()
    watermark = H + 1199 * 10
    horizon = (watermark - 600) // 60 * 60
    # minute rows exist exactly for [first minute, horizon): 20 samples' worth of minutes per 200 s
    minutes = store._db.execute("SELECT SUM(n) FROM chunks WHERE tier=1 AND gpu_uuid='G0'").fetchone()[0]
    assert minutes == (horizon - H) / 60 and st.rolled_minutes == 2 * minutes
    assert st.rolled_hours == 2 * 3  # three whole hours closed
    # a minute's rollup equals the raw samples' statistics
    pts = store.series("n1", "G0", H + 120, H + 179, step=60, tier=MINUTE)
    assert [p.ts for p in pts] == [H + 120]
    raw = [s for s in ss if s.gpu_uuid == "G0" and H + 120 <= s.ts < H + 180]
    (p,) = pts
    assert p.samples == len(raw) == 6
    pw = [s.power_watts for s in raw]
    assert p.values["power_watts"] == (6, pytest.approx(sum(pw)), min(pw), max(pw))
    sm = [s.sm_active_ratio for s in raw if s.sm_active_ratio is not None]
    assert p.values.get("sm_active_ratio", (0,))[0] == len(sm)
    # an hour rollup equals the sum of its minutes
    (hp,) = store.series("n1", "G0", H, H + 3599, step=3600, tier=HOUR)
    mins = store.series("n1", "G0", H, H + 3599, step=60, tier=MINUTE)
    assert hp.samples == sum(m.samples for m in mins) == 360
    assert hp.values["energy_joules"][3] == max(m.values["energy_joules"][3] for m in mins)
    # the open raw hour was merged once closed, and chunks of closed hours are single
    per = {}
    for r in chunk_rows(store, RAW):
        per[(r[1], r[3])] = per.get((r[1], r[3]), 0) + 1
    assert all(c == 1 for (g, b), c in per.items() if b + 3600 <= clock.t)
    before = (chunk_rows(store, RAW), chunk_rows(store, MINUTE), chunk_rows(store, HOUR))
    again = store.compact()
    assert (again.rolled_minutes, again.rolled_hours, again.merged_chunks, again.deleted_chunks) == (0, 0, 0, 0)
    assert (chunk_rows(store, RAW), chunk_rows(store, MINUTE), chunk_rows(store, HOUR)) == before
    assert store.series("n1", "G0", H, H + 1e6) == [s for s in ss if s.gpu_uuid == "G0"]
    store.close()


def test_minute_at_the_horizon_waits_for_late_samples(tmp_path):
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=Clock(H + DAY))
    mk = lambda ts, p: GpuSample(ts=ts, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=p)  # noqa: E731
    store.ingest(Batch("a", 0, "n1", (mk(H, 1.0), mk(H + 59, 2.0), mk(H + 660, 3.0))))
    store.compact()  # horizon = H + 60: only minute H is closed
    assert [(p.ts, p.samples) for p in store.series("n1", "G0", H, H + 59, step=60, tier=MINUTE)] == [(H, 2)]
    store.ingest(Batch("a", 1, "n1", (mk(H + 61, 4.0),)))  # late but within the window
    store.compact()
    assert store.series_store.rolled_up_until(("n1", "G0", ""), MINUTE) == H + 60
    store.ingest(Batch("a", 2, "n1", (mk(H + 721, 5.0),)))
    store.compact()  # horizon H + 120: minute H+60 now closed with the late sample
    pts = store.series("n1", "G0", H, H + 119, step=60, tier=MINUTE)
    assert [(p.ts, p.samples, p.mean("power_watts")) for p in pts] == [(H, 2, 1.5), (H + 60, 1, 4.0)]
    store.close()


def test_a_late_sample_in_minutes_rolled_up_is_too_late_whatever_window_either_store_has(new_ledger):
    """Compaction seals a GPU's minutes before it rolls them up, and ingest refuses a later arrival there as too late
    whatever late window the compacting and the ingesting store have: after a restart with a longer window (the
    ledger's setting changed deliberately, ``adopt_settings``: ``collector set-settings``), and while another store
    with a shorter one compacts beside one holding the host in memory (refused unless forced, SettingsMismatch: the
    seal still holds when it is). The 1m tier, the raw samples and the ledger then count the same samples."""
    url, clock = new_ledger(), Clock(H + DAY)
    mk = lambda t, p=100.0: GpuSample(ts=H + t, host="n1", gpu_uuid="G0", gpu_index=0,  # noqa: E731
                                      power_watts=p, energy_joules=1e6 + 100.0 * t, job_ids=("7",))
    short = Store(url, window_s=60.0, clock=clock)
    short.ingest(Batch("a", 0, "n1", tuple(mk(t) for t in range(0, 3600, 2))))
    short.compact()  # newest H + 3598: minutes before H + 3480 rolled up (a 60 s window)
    short.close()
    long = Store(url, window_s=600.0, clock=clock, adopt_settings=True)  # restarted with a longer window
    late = long.ingest(Batch("a", 1, "n1", (mk(3301, 900.0),)))  # 297 s behind: inside 600 s, in a rolled-up minute
    assert (late.accepted, late.too_late) == (0, 1)
    assert long.ingest(Batch("a", 2, "n1", (mk(3481, 900.0),))).accepted == 1  # past the rolled-up minutes: taken
    long.ingest(Batch("a", 3, "n1", tuple(mk(t) for t in range(3600, 5400, 2))))  # the host stays in its memory
    with pytest.raises(SettingsMismatch, match="window_s = 60 here, 600 in the ledger"):
        Store(url, window_s=60.0, clock=clock)
    beside = Store(url, window_s=60.0, clock=clock, adopt_settings=True)
    beside.compact()  # newest H + 5398: minutes before H + 5280 rolled up
    beside.close()
    late = long.ingest(Batch("a", 4, "n1", (mk(5001, 900.0),)))  # 397 s behind, in a minute rolled up beside it
    assert (late.accepted, late.too_late) == (0, 1)
    long.compact()
    samples = long.totals()["samples"]
    assert samples == 1800 + 1 + 900 and len(long.series("n1", "G0", 0, 2e9, tier=RAW)) == samples
    assert long.series_store.rolled_up_until(("n1", "G0", ""), MINUTE) == H + 5280
    minutes = long.series("n1", "G0", 0, 2e9, tier=MINUTE)  # rolled up, and the newest summarised from raw
    from_raw = long.series("n1", "G0", 0, 2e9, tier=RAW, step=60)
    assert [p.to_dict() | {"tier": None} for p in minutes] == [p.to_dict() | {"tier": None} for p in from_raw]
    assert sum(p.samples for p in minutes) == samples
    long.close()


def test_an_unsorted_series_brings_no_sample_into_a_sealed_minute(new_ledger):
    """A series whose first time is newer than its GPU's newest sample but whose others are behind it goes sample by
    sample: the seal refuses those in rolled-up minutes, as it does a late row (the raw tier and the 1m tier then
    count the same samples)."""
    url, clock = new_ledger(), Clock(H + DAY)
    mk = lambda t: GpuSample(ts=H + t, host="n1", gpu_uuid="G0", gpu_index=0,  # noqa: E731
                             power_watts=100.0, energy_joules=1e6 + 100.0 * t, job_ids=("7",))
    long = Store(url, window_s=600.0, clock=clock)
    long.ingest(Batch("a", 0, "n1", tuple(mk(t) for t in range(0, 3600, 2))))  # the host stays in its memory
    with pytest.raises(SettingsMismatch, match="window_s = 60 here, 600 in the ledger"):
        Store(url, window_s=60.0, clock=clock)
    beside = Store(url, window_s=60.0, clock=clock, adopt_settings=True)
    beside.compact()  # newest H + 3598: minutes before H + 3480 rolled up
    beside.close()
    ts = np.array([H + 3700.0, H + 3003.0])
    unsorted = Series("n1", "G0", 0, ts, floats={"power_watts": np.full(2, 100.0),
                                                  "energy_joules": 1e6 + 100.0 * (ts - H)}, job_ids=("7",))
    out = long.ingest(Batch("a", 1, "n1", series=(unsorted,)))
    assert (out.accepted, out.too_late) == (1, 1)
    long.compact()
    raw = long.series("n1", "G0", 0, 2e9, tier=RAW)
    minutes = long.series("n1", "G0", 0, 2e9, tier=MINUTE)
    assert len(raw) == sum(p.samples for p in minutes) == long.totals()["samples"] == 1801
    long.close()


def test_rollup_query_fills_the_recent_tail_from_raw(tmp_path):
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=Clock(H + DAY))
    ss = gen(400, gpus=("G0",))
    ingest_all(store, ss)
    before = store.series("n1", "G0", H, H + 4000, step=60, tier=MINUTE)  # nothing rolled up: all from raw
    store.compact()
    after = store.series("n1", "G0", H, H + 4000, step=60, tier=MINUTE)  # stored minutes + raw tail
    assert [p.to_dict() for p in before] == [p.to_dict() for p in after]
    assert len(after) == 67 and sum(p.samples for p in after) == 400
    # a coarser step re-buckets; the result starts at the step boundary
    five = store.series("n1", "G0", H + 10, H + 4000, step=300, tier=MINUTE)
    assert five[0].ts == H and sum(p.samples for p in five) == 400
    store.close()


def test_retention_drops_only_rolled_up_data_and_queries_pick_the_complete_tier(tmp_path):
    clock = Clock(H + 4 * 3600)
    ret = Retention(raw_s=2 * 3600, minute_s=5 * 3600, raw_chunk_s=600, minute_chunk_s=3600, hour_chunk_s=3600)
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=clock, retention=ret)
    ss = gen(1080, step=10.0, gpus=("G0",))  # H .. H + 3 h
    ingest_all(store, ss)
    gk = ("n1", "G0", "")
    assert store.series_store.pick_tier(gk, H) == RAW and store.series_store.pick_tier(gk, H, step=60) == MINUTE
    assert store.series_store.pick_tier(gk, H, step=3600) == HOUR
    assert store.series_store.pick_tier(gk, H, step=30) == RAW
    st = store.compact()  # now = H + 4 h: raw before H + 2 h may go, it is rolled up (horizon H+2h50)
    raw = chunk_rows(store, RAW)
    assert st.deleted_chunks == 12 and min(r[3] for r in raw) == H + 2 * 3600
    assert store.series_store.pick_tier(gk, H) == MINUTE and store.series_store.pick_tier(gk, H + 2 * 3600) == RAW
    pts = store.series("n1", "G0", H, H + 3 * 3600)
    assert isinstance(pts[0], RollupPoint) and pts[0].tier == "1m" and sum(p.samples for p in pts) == 1080
    assert len(store.series("n1", "G0", H + 2 * 3600, H + 3 * 3600)) == 360  # raw samples
    # minute rows before H + 3 h expire (only up to the hour tier's H + 2 h); hours stay for good
    clock.t = H + 8 * 3600
    store.compact()
    assert store.series_store.pick_tier(gk, H) == HOUR
    hours = store.series("n1", "G0", H, H + 3 * 3600)
    assert [p.tier for p in hours] == ["1h"] * 3 and sum(p.samples for p in hours) == 1080
    assert store.tiers()[HOUR]["rows"] == 2  # third hour not closed when minutes were cut at H+2h50
    store.close()


def test_retention_never_drops_raw_that_is_not_rolled_up(tmp_path):
    ret = Retention(raw_s=3600, raw_chunk_s=600)
    clock = Clock(H + 30 * DAY)
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=clock, retention=ret)
    ss = gen(30, step=10.0, gpus=("G0",))  # 300 s: the GPU then went silent; its window never closes
    ingest_all(store, ss)
    store.compact()
    assert store.series("n1", "G0", H, H + 1e6) == ss
    with pytest.raises(ValueError, match="late window"):
        Store(tmp_path / "t.sqlite", window_s=3600, retention=ret)
    store.close()


def test_restart_after_compaction_keeps_aggregation_exact(new_ledger):
    clock = Clock(H + 10 * 3600)
    ret = Retention(raw_s=2 * 3600, raw_chunk_s=600)
    ss = gen(1500, step=10.0, seed=3)
    rnd = random.Random(1)
    ss.sort(key=lambda s: s.ts + rnd.uniform(-200, 200))  # late samples straddle batches and restarts
    first, second = new_ledger(), new_ledger()
    one = Store(first, clock=clock, retention=ret)
    two = Store(second, clock=clock, retention=ret)
    for i, j in enumerate(range(0, len(ss), 250)):
        b = Batch("a", i, "n1", tuple(ss[j:j + 250]))
        one.ingest(b)
        two.ingest(b)
        clock.t += 600
        two.compact()
        two.close()
        two = Store(second, clock=clock, retention=ret)
    ua = {(u.job_id, u.gpu_uuid): u.to_dict() for u in one.job_usage(per_gpu=True)}
    ub = {(u.job_id, u.gpu_uuid): u.to_dict() for u in two.job_usage(per_gpu=True)}
    assert ua.keys() == ub.keys()
    for k in ua:
        for f, v in ua[k].items():
            assert v == (pytest.approx(ub[k][f], rel=1e-9) if isinstance(v, float) else ub[k][f]), (k, f)
    assert one.totals() == pytest.approx(two.totals())
    one.close()
    two.close()


def test_schema_1_rows_are_migrated_into_chunks(tmp_path):
    path = tmp_path / "old.sqlite"
    ss = gen(20, gpus=("G0",))
    db = sqlite3.connect(path)
    db.executescript("""
      CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
      CREATE TABLE samples (host TEXT NOT NULL, gpu_uuid TEXT NOT NULL, mig TEXT NOT NULL, ts REAL NOT NULL,
        data BLOB NOT NULL, PRIMARY KEY (host, gpu_uuid, mig, ts)) WITHOUT ROWID;
    """)
    db.execute("INSERT INTO meta VALUES ('schema', '1')")
    import json
    db.execute("INSERT INTO meta VALUES ('sample_fields', ?)", (json.dumps(SAMPLE_FIELDS),))
    for s in ss:
        row = [getattr(s, f) for f in SAMPLE_FIELDS]
        db.execute("INSERT INTO samples VALUES (?,?,?,?,?)",
                   (s.host, s.gpu_uuid, "", s.ts, msgpack.packb(row, use_bin_type=True)))
    db.commit()
    db.close()
    store = Store(path)
    assert store.series("n1", "G0", 0, 2e9) == ss
    assert store._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "4"  # META_FORMAT
    assert not store._db.execute("SELECT 1 FROM sqlite_master WHERE name='samples'").fetchone()
    store.close()


def test_rollup_means_match_numpy_over_random_data(tmp_path):
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=Clock(H + DAY))
    ss = gen(2000, step=3.7, gpus=("G0",), seed=9)
    ingest_all(store, ss, size=333)
    store.compact()
    pts = store.series("n1", "G0", H, H + 1e5, step=3600, tier=HOUR)
    for p in pts:
        inside = [s for s in ss if p.ts <= s.ts < p.ts + 3600]
        assert p.samples == len(inside)
        assert p.mean("power_watts") == pytest.approx(np.mean([s.power_watts for s in inside]), rel=1e-12)


def test_a_bucket_says_the_same_whichever_tier_answers_and_an_answer_holds_its_newest_bucket(tmp_path):
    # A query's last bucket used to stop at `end` when summarised from raw samples but be whole when a stored
    # rollup answered it: the same request gave other numbers after compaction. Buckets are whole now, first and
    # last; and an unaligned range at the point cap no longer drops its newest bucket.
    import httpx

    from gpuledger.collector.server import CollectorServer

    samples = [GpuSample(ts=H + 10 * i, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=float(100 + i),
                         energy_joules=1000.0 * i) for i in range(3 * 360)]  # 3 h, 10 s apart
    now = [H + 3 * 3600 + 5]
    store = Store(tmp_path / "s.sqlite", window_s=600, clock=lambda: now[0])
    ingest_all(store, samples, size=30)
    srv = CollectorServer(store, clock=lambda: now[0], max_series_points=50).start()
    try:
        def ask(**q):
            r = httpx.get(srv.url + "/api/v1/series", params={"host": "n1", "uuid": "G0", **q})
            assert r.status_code == 200, r.text
            return [(p["ts"], p["samples"], p["mean"]["power_watts"], p["max"]["energy_joules"]) for p in r.json()]

        queries = [dict(start=H, end=H + 25, step=60), dict(start=H, end=H + 600, step=3600),
                   dict(start=H + 7, end=H + 4000, step=7200)]
        before = [ask(**q) for q in queries]
        store.compact(now=now[0])
        assert [ask(**q) for q in queries] == before
        assert before[0] == [(H, 6, 102.5, 5000.0)]  # the whole minute: samples 0..5
        assert before[1] == [(H, 360, 100 + 359 / 2, 359000.0)]  # the whole hour
        # 50 points at most: an unaligned start over 2 h 30 min, the bucket of the newest sample included
        start, end = H + 30, H + 30 + 9000
        points = ask(start=start, end=end)
        newest = max(s.ts for s in samples if start <= s.ts <= end)
        step = points[1][0] - points[0][0]
        assert len(points) <= 50 and points[-1][0] <= newest < points[-1][0] + step
    finally:
        srv.stop()
        store.close()
