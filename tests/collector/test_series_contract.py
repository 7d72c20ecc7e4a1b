"""ChunkSeriesStore on both engines of collector.db: SQLite (a file) and PostgreSQL (a real server, ``pg_url``).

Every operation the collector's store drives (write_samples, write_series, window, roll_up, mergeable_groups,
merge, expire, series at each tier, pick_tier, tiers) behaves as specified on each engine, and a whole life
cycle gives bit-for-bit the same results on both (floats compared by their bits).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from gpuledger.collector.aggregate import WindowSegment
from gpuledger.collector.db import Database, open_database
from gpuledger.collector.rollup import RollupPoint
from gpuledger.collector.series import series_from_samples
from gpuledger.collector.series_store import (
    HOUR,
    MERGE_MAX_ROWS,
    MERGE_OPEN_AT,
    MINUTE,
    RAW,
    ChunkSeriesStore,
    Retention,
    StaleCompaction,
)
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000  # an hour and day boundary
DAY = 86400.0
RET = Retention(raw_s=6 * 3600, minute_s=DAY, raw_chunk_s=3600, minute_chunk_s=6 * 3600, hour_chunk_s=DAY)
GPUS = (("n1", "G0", None), ("n1", "G1", None), ("n2", "G2", "1g.10gb"))


def gen(host: str, uuid: str, mig: str | None, n: int, step: float, t0: float = H, seed: int = 0) -> list[GpuSample]:
    rnd = random.Random(f"{seed}{uuid}")
    out, e = [], 0.0
    for i in range(n):
        e += rnd.uniform(100, 900)
        job = ("7",) if i < n // 2 else ("8", "9")
        out.append(GpuSample(ts=t0 + i * step + rnd.uniform(0, step / 2), host=host, gpu_uuid=uuid, gpu_index=0,
                             model="H200", mig=mig, power_watts=rnd.uniform(80, 700), energy_joules=e,
                             sm_active_ratio=rnd.choice([None, rnd.random()]), mem_used_bytes=rnd.randrange(10**11),
                             job_ids=job, job_shares=(0.25, 0.75) if len(job) == 2 else (),
                             xid_errors=(79,) if rnd.random() < 0.01 else ()))
    return out


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """A fresh database of each engine."""
    url = tmp_path / "s.sqlite" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    database = open_database(url)
    yield database
    database.close()


def write(store: ChunkSeriesStore, db: Database, samples: list[GpuSample], batch_s: float) -> None:
    """In batches of ``batch_s`` seconds (on its grid), as the collector does: GPU G1 as series, the others as rows."""
    t, end = min(s.ts for s in samples) // batch_s * batch_s, max(s.ts for s in samples)
    while t <= end:
        part = [s for s in samples if t <= s.ts < t + batch_s]
        with db.transaction():
            store.write_samples([s for s in part if s.gpu_uuid != "G1"])
            g1 = sorted((s for s in part if s.gpu_uuid == "G1"), key=lambda s: s.ts)
            runs = [[s for s in g1 if s.job_ids == j] for j in dict.fromkeys(s.job_ids for s in g1)]
            store.write_series([series_from_samples(r) for r in runs if r])
        t += batch_s


def chunks(db: Database, tier: int) -> list[tuple]:
    rows = db.execute("SELECT host, gpu_uuid, mig, bucket, t_min, t_max, n FROM chunks WHERE tier=?", (tier,))
    return sorted(tuple(r) for r in rows.fetchall())


def test_raw_samples_and_series_read_back_exactly(db):
    store = ChunkSeriesStore(db, RET)
    data = {g: gen(*g, n=500, step=10.0) for g in GPUS}  # 5,000 s: two raw hours
    write(store, db, [s for ss in data.values() for s in ss], batch_s=600)
    for (host, uuid, mig), ss in data.items():
        assert store.series(host, uuid, 0, 2e9, mig=mig) == ss
        assert store.series(host, uuid, ss[10].ts, ss[20].ts, mig=mig) == ss[10:21]
    assert store.series("n1", "G9", 0, 2e9) == []
    blobs = db.execute("SELECT data FROM chunks").fetchall()
    assert blobs and all(type(b) is bytes for (b,) in blobs)  # bytea and BLOB alike


def test_window_is_the_anchor_and_later_samples_in_job_runs(db):
    store = ChunkSeriesStore(db, RET)
    ss = gen("n1", "G1", None, 300, step=10.0)
    write(store, db, ss, batch_s=400)
    floor = ss[100].ts + 0.001  # just after sample 100: it is the anchor
    segments = store.window(("n1", "G1", ""), floor)
    assert all(isinstance(s, WindowSegment) for s in segments)
    assert [(len(s), s.job_ids, s.job_shares) for s in segments] == [(50, ("7",), ()), (150, ("8", "9"), (0.25, 0.75))]
    ts = np.concatenate([s.ts for s in segments])
    assert ts.tolist() == [s.ts for s in ss[100:]]
    power = np.concatenate([s.cols["power_watts"] for s in segments])
    assert power.tolist() == [s.power_watts for s in ss[100:]]
    assert store.window(("n1", "G1", ""), ss[-1].ts + 1)[0].ts.tolist() == [ss[-1].ts]  # only the anchor
    assert store.window(("n1", "G9", ""), H) == []


def test_roll_up_matches_the_raw_samples_and_is_idempotent(db):
    store = ChunkSeriesStore(db, RET)
    ss = gen("n1", "G0", None, 1200, step=10.0)  # 3 h 20 min
    write(store, db, ss, batch_s=900)
    gk = ("n1", "G0", "")
    final_before = H + 3 * 3600 + 1000
    horizon = final_before // 60 * 60
    minutes, hours = store.roll_up(gk, final_before)
    assert (minutes, hours) == ((horizon - H) / 60, 3)
    assert store.rolled_up_until(gk, MINUTE) == horizon and store.rolled_up_until(gk, HOUR) == H + 3 * 3600
    assert store.roll_up(gk, final_before) == (0, 0)  # nothing new is final
    for p in store.series("n1", "G0", H, horizon - 1, step=60, tier=MINUTE):
        inside = [s.power_watts for s in ss if p.ts <= s.ts < p.ts + 60]
        assert p.samples == len(inside) and p.tier == "1m"
        n, total, lo, hi = p.values["power_watts"]
        assert (n, lo, hi) == (len(inside), min(inside), max(inside)) and total == pytest.approx(sum(inside))
    hour_points = store.series("n1", "G0", H, H + 3 * 3600 - 1, tier=HOUR)
    assert [(p.ts, p.samples, p.tier) for p in hour_points] == [(H + i * 3600, 360, "1h") for i in range(3)]
    # past the rolled-up horizon a rollup query is filled from the finer tier: nothing is missing
    assert sum(p.samples for p in store.series("n1", "G0", H, 2e9, step=3600, tier=HOUR)) == 1200


def test_merge_joins_small_chunks_of_closed_intervals_and_crowded_open_ones(db):
    store = ChunkSeriesStore(db, RET)
    ss = gen("n1", "G0", None, 720, step=10.0)  # two raw hours, in 50 s batches: 72 chunks per hour
    write(store, db, ss, batch_s=50)
    assert len(chunks(db, RAW)) == 144
    # at H + 1 h 30: the first hour is closed, the second is open but has more than MERGE_OPEN_AT chunks
    groups = store.mergeable_groups(RAW, H + 5400)
    assert [(g.gpu_key, g.bucket) for g in groups] == [(("n1", "G0", ""), H), (("n1", "G0", ""), H + 3600)]
    assert MERGE_OPEN_AT <= 72
    assert [store.merge(g) for g in groups] == [71, 71]
    assert [(r[3], r[4], r[5], r[6]) for r in chunks(db, RAW)] == [
        (H, ss[0].ts, ss[359].ts, 360), (H + 3600, ss[360].ts, ss[-1].ts, 360)]
    assert store.series("n1", "G0", 0, 2e9) == ss
    assert store.mergeable_groups(RAW, H + 5400) == []
    assert store.merge(groups[0]) == 0  # merging again changes nothing
    # an open interval with fewer chunks waits
    write(store, db, gen("n1", "G0", None, 3, step=10.0, t0=H + 7200, seed=1), batch_s=10)
    assert store.mergeable_groups(RAW, H + 7300) == []
    assert [g.bucket for g in store.mergeable_groups(RAW, H + 3 * 3600)] == [H + 7200]


def test_an_interval_a_gpu_still_sends_samples_of_is_not_closed_by_the_clock_alone(db):
    """Samples three days old (a backlog, an agent's clock behind): the clock closed their interval long ago, but
    the GPU's newest sample - the late window (``final_before``) has not: it is merged once crowded, not at every
    pass; once final, or with no ``final_before`` (a GPU gone quiet), it is closed."""
    store = ChunkSeriesStore(db, RET)
    gk = ("n1", "G0", "")
    write(store, db, gen("n1", "G0", None, 100, step=10.0), batch_s=100)  # 10 chunks in hour H
    now = H + 3 * DAY
    assert store.mergeable_groups(RAW, now, {gk: H + 1000 - 600}) == []
    assert [g.bucket for g in store.mergeable_groups(RAW, now, {gk: H + 3600})] == [H]
    assert [g.bucket for g in store.mergeable_groups(RAW, now, {})] == [H]
    assert [g.bucket for g in store.mergeable_groups(RAW, now)] == [H]
    more = MERGE_OPEN_AT - 10  # crowded now
    write(store, db, gen("n1", "G0", None, 10 * more, step=10.0, t0=H + 1000, seed=1), batch_s=100)
    assert [g.bucket for g in store.mergeable_groups(RAW, now, {gk: H + 1000 + 100 * more - 600})] == [H]


def test_an_open_interval_merges_batches_as_they_came_and_its_merged_chunks_once_it_closes(db):
    store = ChunkSeriesStore(db, RET)
    k = MERGE_OPEN_AT
    ss = gen("n1", "G0", None, 10 * (2 * k + 1), step=2.5)  # 2k + 1 chunks of 10 rows in hour H (25 s each)
    write(store, db, ss[:10 * k], batch_s=25)
    now = H + 3500  # the hour is open
    assert [store.merge(g) for g in store.mergeable_groups(RAW, now)] == [k - 1]
    write(store, db, ss[10 * k:10 * (2 * k - 1)], batch_s=25)  # fewer than MERGE_OPEN_AT small ones
    assert store.mergeable_groups(RAW, now) == []
    write(store, db, ss[10 * (2 * k - 1):], batch_s=25)
    assert [store.merge(g) for g in store.mergeable_groups(RAW, now)] == [k]  # the k + 1 small ones only
    assert [r[6] for r in chunks(db, RAW)] == [10 * k, 10 * (k + 1)]
    assert 10 * k >= MERGE_MAX_ROWS  # so once closed, neither is re-packed: each row was encoded once
    assert store.mergeable_groups(RAW, H + 3600) == []
    write(store, db, gen("n1", "G0", None, 20, step=1.0, t0=H + 3300, seed=4), batch_s=10)  # two late batches
    assert [store.merge(g) for g in store.mergeable_groups(RAW, H + 3600)] == [1]  # closed: the small ones
    assert sorted(r[6] for r in chunks(db, RAW)) == [20, 10 * k, 10 * (k + 1)]
    assert store.series("n1", "G0", 0, 2e9) == sorted(ss + gen("n1", "G0", None, 20, step=1.0, t0=H + 3300, seed=4),
                                                      key=lambda s: s.ts)


def test_plans_made_through_another_connection_apply_while_ingest_adds_chunks(db):
    """Compaction plans from reads on a connection of its own (``Database.reader``) while ingest writes on the
    store's; chunks ingest adds between a plan and its transaction are neither merged away nor lost."""
    store = ChunkSeriesStore(db, RET)
    gk = ("n1", "G0", "")
    ss = gen("n1", "G0", None, 720, step=10.0)
    write(store, db, ss[:600], batch_s=30)  # hour H closed at H + 1 h 30; hour H + 1 h open with 80 chunks
    with db.reader() as other:
        reader = store.on(other)
        plans = [reader.plan_merge(g) for g in reader.mergeable_groups(RAW, H + 5400)]
        roll = reader.plan_roll_up(gk, H + 5000)
    write(store, db, ss[600:], batch_s=30)  # ingest goes on: 40 more chunks in the open hour
    with db.transaction():
        assert [store.apply_merge(p) for p in plans if p is not None] == [119, 79]
        assert store.apply_roll_up(roll) == (83, 1)
    assert store.series("n1", "G0", 0, 2e9) == ss
    assert len(chunks(db, RAW)) == 2 + 40
    minutes = store.series("n1", "G0", H, H + 4979, step=60, tier=MINUTE)
    assert [(p.ts, p.samples) for p in minutes] == [
        (H + 60 * i, sum(1 for s in ss if H + 60 * i <= s.ts < H + 60 * (i + 1))) for i in range(83)]


def test_a_stale_plan_is_refused_and_its_transaction_rolled_back(db):
    store = ChunkSeriesStore(db, RET)
    gk = ("n1", "G0", "")
    write(store, db, gen("n1", "G0", None, 720, step=10.0), batch_s=60)
    group = store.mergeable_groups(RAW, H + 3 * 3600)[0]
    merge, roll = store.plan_merge(group), store.plan_roll_up(gk, H + 3000)
    assert merge is not None
    assert store.merge(group) == 59 and store.roll_up(gk, H + 3000) == (50, 0)  # another pass did them first
    before = (chunks(db, RAW), chunks(db, MINUTE), store.rolled_up_until(gk, MINUTE))
    for stale in (lambda: store.apply_merge(merge), lambda: store.apply_roll_up(roll)):
        with pytest.raises(StaleCompaction), db.transaction():
            stale()
        assert (chunks(db, RAW), chunks(db, MINUTE), store.rolled_up_until(gk, MINUTE)) == before


def test_hours_from_minutes_of_the_same_plan_equal_hours_from_stored_minutes(db):
    """A roll-up plan combines the minutes it rolls up itself (not stored yet) with stored ones: its hours are
    bit for bit those rolled up again from the stored minutes alone."""
    store = ChunkSeriesStore(db, RET)
    gk = ("n1", "G0", "")
    write(store, db, gen("n1", "G0", None, 1200, step=10.0), batch_s=900)
    store.roll_up(gk, H + 1000)  # some minutes stored first, then the rest and three hours in one plan
    assert store.roll_up(gk, H + 3 * 3600 + 100)[1] == 3
    hour_rows = "SELECT bucket, t_min, t_max, n, data FROM chunks WHERE tier=? ORDER BY t_min"
    fresh = db.execute(hour_rows, (HOUR,)).fetchall()
    db.execute("DELETE FROM chunks WHERE tier=?", (HOUR,))
    db.execute("DELETE FROM rollup_state WHERE tier=?", (HOUR,))
    assert store.roll_up(gk, H + 3 * 3600 + 100) == (0, 3)
    assert db.execute(hour_rows, (HOUR,)).fetchall() == fresh


def test_expire_drops_only_rolled_up_data_and_never_moves_its_mark_back(db):
    store = ChunkSeriesStore(db, RET)
    gk = ("n1", "G0", "")
    ss = gen("n1", "G0", None, 1440, step=10.0)  # H .. H + 4 h
    write(store, db, ss, batch_s=3600)
    assert store.expire(H + 12 * 3600) == 0  # nothing rolled up: raw stays past its retention
    store.roll_up(gk, H + 2 * 3600)
    assert store.expire(H + 9 * 3600) == 2  # raw of hours H and H+1: rolled up and older than 6 h
    assert [r[3] for r in chunks(db, RAW)] == [H + 2 * 3600, H + 3 * 3600]
    assert store.pick_tier(gk, H) == MINUTE and store.pick_tier(gk, H + 2 * 3600) == RAW
    pts = store.series("n1", "G0", H, 2e9)
    assert isinstance(pts[0], RollupPoint) and pts[0].tier == "1m" and sum(p.samples for p in pts) == 1440
    # a late sample in an expired raw hour, rolled-up already: expired again, the mark stays at H + 2 h
    late = gen("n1", "G0", None, 1, step=10.0, t0=H + 60, seed=2)
    write(store, db, late, batch_s=10)
    assert store.expire(H + 9 * 3600) == 1
    assert db.execute("SELECT until FROM expired WHERE tier=0").fetchall() == [(H + 2 * 3600,)]
    # raw goes once minutes hold it; a minute chunk (6 h span) only once hours hold all of its span
    store.roll_up(gk, H + 4 * 3600)
    assert store.expire(H + 3 * DAY) == 2  # raw hours 2 and 3
    assert chunks(db, RAW) == [] and [r[3] for r in chunks(db, MINUTE)] == [H, H]
    assert store.pick_tier(gk, H) == MINUTE
    write(store, db, gen("n1", "G0", None, 1, step=10.0, t0=H + 7 * 3600, seed=3), batch_s=10)
    store.roll_up(gk, H + 7 * 3600 + 60)
    assert store.expire(H + 3 * DAY) == 2  # both minute chunks of bucket H (raw hour H + 7 h: not rolled up)
    assert store.pick_tier(gk, H) == HOUR
    hours = store.series("n1", "G0", H, H + 4 * 3600)
    assert [(p.tier, p.samples) for p in hours] == [("1h", 360)] * 4


def test_tiers_count_chunks_rows_and_bytes(db):
    store = ChunkSeriesStore(db, RET)
    assert [(t["tier"], t["chunks"], t["rows"], t["bytes"], t["oldest"]) for t in store.tiers()] == [
        ("raw", 0, 0, 0, None), ("1m", 0, 0, 0, None), ("1h", 0, 0, 0, None)]
    ss = gen("n1", "G0", None, 720, step=10.0)
    write(store, db, ss, batch_s=1200)
    store.roll_up(("n1", "G0", ""), H + 7200)
    raw, minute, hour = store.tiers()
    sizes = {t: sum(len(d) for (d,) in db.execute("SELECT data FROM chunks WHERE tier=?", (t,)).fetchall())
             for t in (RAW, MINUTE, HOUR)}
    assert (raw["chunks"], raw["rows"], raw["bytes"]) == (6, 720, sizes[RAW])
    assert (raw["oldest"], raw["newest"], raw["retention_s"]) == (ss[0].ts, ss[-1].ts, RET.raw_s)
    assert (minute["rows"], minute["bytes"], minute["oldest"]) == (120, sizes[MINUTE], H)
    assert (hour["chunks"], hour["rows"], hour["newest"], hour["retention_s"]) == (1, 2, H + 3600, None)
    assert all(type(t[k]) is int for t in (raw, minute, hour) for k in ("chunks", "rows", "bytes"))


def canon(x: Any) -> Any:
    """Results as plain values, floats by their bits (NaN equals NaN)."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, np.ndarray):
        return (str(x.dtype), x.tobytes())
    if isinstance(x, WindowSegment):
        return canon((x.ts, x.cols, x.job_ids, x.job_shares))
    if hasattr(x, "to_dict"):
        return canon(x.to_dict())
    if isinstance(x, dict):
        return [(k, canon(v)) for k, v in x.items()]
    if isinstance(x, (list, tuple)):
        return [canon(v) for v in x]
    return x


def life_cycle(db: Database) -> list:
    """Ingest, restore windows, compaction steps and queries, as the collector runs them; every result."""
    store = ChunkSeriesStore(db, RET)
    data = [s for g in GPUS for s in gen(*g, n=2600, step=37.0, seed=5)]  # ~27 h per GPU
    out: list = []
    for day_part in range(4):
        lo, hi = H + day_part * 7 * 3600, H + (day_part + 1) * 7 * 3600
        write(store, db, [s for s in data if lo <= s.ts < hi], batch_s=500)
        now = hi + 600
        for host, uuid, mig in GPUS:
            gk = (host, uuid, mig or "")
            out.append(store.window(gk, hi - 900))
            out.append(store.roll_up(gk, hi - 600))
        for tier in (RAW, MINUTE, HOUR):
            groups = store.mergeable_groups(tier, now)
            out.append([(g.tier, g.gpu_key, g.bucket, g.max_rows) for g in groups])
            out.append([store.merge(g) for g in groups])
        out.append(store.expire(now))
        out.append(store.tiers())
    for host, uuid, mig in GPUS:
        gk = (host, uuid, mig or "")
        out.append([store.pick_tier(gk, H + k * 3600, step) for k in (0, 10, 24) for step in (None, 60, 3600)])
        out.append(store.series(host, uuid, 0, 2e9, mig=mig))
        for tier in (RAW, MINUTE, HOUR):
            out.append(store.series(host, uuid, H, 2e9, mig=mig, tier=tier))
            out.append(store.series(host, uuid, H + 5000, H + 20 * 3600, step=900, mig=mig, tier=tier))
        out.append(store.series(host, uuid, H + 3 * 3600, 2e9, step=3600, mig=mig))
    rows = db.execute("SELECT tier, host, gpu_uuid, mig, bucket, t_min, t_max, n, data FROM chunks").fetchall()
    out.append(sorted(tuple(r) for r in rows))
    for table in ("rollup_state", "expired"):
        out.append(sorted(tuple(r) for r in db.execute(f"SELECT host, gpu_uuid, mig, tier, until FROM {table}")))
    return canon(out)


def test_life_cycle_is_bit_for_bit_the_same_on_sqlite_and_postgresql(tmp_path, pg_url):
    sqlite_db, postgres_db = open_database(tmp_path / "s.sqlite"), open_database(pg_url)
    try:
        on_sqlite, on_postgres = life_cycle(sqlite_db), life_cycle(postgres_db)
    finally:
        sqlite_db.close()
        postgres_db.close()
    assert len(on_sqlite) == len(on_postgres)
    for i, (a, b) in enumerate(zip(on_sqlite, on_postgres)):
        assert a == b, f"result {i} differs"
    assert on_sqlite[-3], "the life cycle left chunks to compare"
