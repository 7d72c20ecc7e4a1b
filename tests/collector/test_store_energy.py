"""The store's side of the energy rules: gap records, per-GPU unattributed energy and counter anomalies, kept
across restarts, exposed as a Prometheus counter, configured from ``[collector]``."""

from __future__ import annotations

import itertools
import sqlite3
from dataclasses import replace

import httpx
import pytest

from gpuledger.collector.config import load_settings
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

T0 = 1_699_999_200.0  # on an hour boundary


def S(dt: float, e: float | None, jobs: tuple[str, ...] = ("j",), **kw) -> GpuSample:
    return GpuSample(
        ts=T0 + dt, host="n1", gpu_uuid="G0", gpu_index=0, model="H200", energy_joules=e, job_ids=jobs, **kw
    )


def test_gap_records_anomalies_and_unattributed_energy_survive_a_restart(ledger):
    path = ledger  # a SQLite file or a PostgreSQL database (tests/collector/conftest.py)
    store = Store(path, window_s=8000.0)  # a late window that reaches back into the gap
    # (0,10] 1000 J; (10,7210] gap, jobs differ: 720000 J unattributed; (7210,7220] counter back: anomaly, 0 J
    store.ingest(Batch("a", 0, "n1", (S(0, 0.0), S(10, 1000.0))))
    store.ingest(Batch("a", 1, "n1", (S(7210, 721000.0, ("k",)), S(7220, 5.0, ("k",)))))
    store.close()
    store = Store(path, window_s=8000.0)  # a late window that reaches back into the gap
    assert store.energy_gaps() == [
        {
            "host": "n1",
            "gpu_uuid": "G0",
            "mig": None,
            "start": T0 + 10,
            "end": T0 + 7210,
            "energy_joules": 720000.0,
            "job_ids": [],
        }
    ]
    (gpu,) = store.gpu_energy()
    assert gpu["energy_joules"] == 721000.0 and gpu["job_energy_joules"] == 1000.0
    assert gpu["unattributed_energy_joules"] == 720000.0 and gpu["counter_anomalies"] == 1
    # the gap's energy spread over the hours it covers: 3590 s, 3600 s and 10 s of 7200 s
    first_hour = store.gpu_energy(T0, T0 + 3600)[0]
    assert abs(first_hour["unattributed_energy_joules"] - 720000.0 * 3590 / 7200) < 1e-6
    assert store.counter_anomalies() == 1
    # a late sample inside the gap splits it: the old record goes, two new ones come (restart-exact window)
    store.ingest(Batch("a", 2, "n1", (S(600, 60000.0, ("k",)),)))
    gaps = store.energy_gaps()
    assert [(g["start"] - T0, g["end"] - T0, g["energy_joules"], g["job_ids"]) for g in gaps] == [
        (10.0, 600.0, 59000.0, []),
        (600.0, 7210.0, 661000.0, ["k"]),
    ]
    assert store.energy_gaps(start=T0 + 7000) == gaps[1:]
    store.close()


def test_a_store_from_before_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    Store(path).close()
    db = sqlite3.connect(path)
    for table, col in (
        ("usage", "gap_s"),
        ("gpus", "anomalies"),
        ("gpu_hours", "job_energy_j"),
        ("gpu_hours", "anomalies"),
    ):
        db.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    db.commit()
    db.close()
    store = Store(path)
    store.ingest(Batch("a", 0, "n1", (S(0, 0.0), S(10, 1000.0))))
    (u,) = store.job_usage()
    assert u.energy_joules == 1000.0 and u.gap_gpu_seconds == 0.0
    assert store.totals()["unattributed_energy_joules"] == 0.0
    store.close()


def test_anomaly_counter_metric_on_the_real_server(tmp_path):
    store = Store(tmp_path / "m.sqlite")
    server = CollectorServer(store, clock=lambda: T0 + 100).start()
    try:
        with httpx.Client(base_url=server.url) as c:
            body = {
                "agent_id": "a",
                "seq": 0,
                "host": "n1",
                "samples": [S(0, 5e6).to_wire(), S(10, 1e6).to_wire(), S(20, 9e9).to_wire()],
            }
            assert c.post("/api/v1/samples", json=body).status_code == 200
            metrics = c.get("/metrics").text
    finally:
        server.stop()
        store.close()
    assert "gpuledger_collector_energy_counter_anomalies_total 2.0" in metrics


def test_power_caps_come_from_the_collector_table(tmp_path):
    (tmp_path / "gpuledger.toml").write_text('[collector]\npower_cap_w = 900\n[collector.power_caps]\n"H200" = 700\n')
    st = load_settings(tmp_path)
    assert st.power_cap_w == 900.0 and st.power_caps == {"H200": 700.0} and st.max_gap_s == 60.0
    store = Store(tmp_path / "c.sqlite", power_cap_w=st.power_cap_w, power_caps=st.power_caps)
    # +7500 J in 10 s: more than 700 W x 10 s -> untrusted; power 800 W clipped to 700 W
    store.ingest(Batch("a", 0, "n1", (S(0, 0.0), S(10, 7500.0, power_watts=800.0))))
    (u,) = store.job_usage()
    assert u.energy_joules == 7000.0
    store.close()
    (tmp_path / "gpuledger.toml").write_text('[collector.power_caps]\n"H200" = -1\n')
    try:
        load_settings(tmp_path)
        raise AssertionError("a negative cap was accepted")
    except ValueError as e:
        assert "power_caps" in str(e)


# -- a missed reading (an NVML call that timed out for a tick: neither power nor the counter) --------------------


def R(dt: float, e: float | None, p: float | None = 500.0) -> GpuSample:
    """A reading of job j's 500 W GPU; ``R(dt, None, None)`` the missed one."""
    return S(dt, e, power_watts=p)


def energies(store: Store, host: str = "n1") -> tuple:
    """(the job's energy, the GPU's, each hour's (energy, job energy)) of ``host``'s GPU."""
    ((job_j,),) = [(u.energy_joules,) for u in store.job_usage(per_gpu=True) if u.host == host]
    (gpu,) = [g for g in store.gpu_energy() if g["host"] == host]
    hours = [(g["energy_joules"], g["job_energy_joules"]) for h in (T0 - 3600, T0)
             for g in store.gpu_energy(h, h + 3600) if g["host"] == host]
    return job_j, gpu["energy_joules"], hours


def test_a_missed_reading_mid_job_costs_the_job_none_of_the_counters_growth(ledger):
    store = Store(ledger)
    # 5000 J every 10 s; the readings at 30 s (the last of a batch: the next batch's first row reads back from the
    # store) and at 70 s (inside a batch) are missed. Before: (30,40] and (70,80] took the power integral, 5000 J,
    # of 10000 J grown since the reading before: 10000 J lost.
    store.ingest(Batch("a", 0, "n1", (R(0, 0.0), R(10, 5000.0), R(20, 10000.0), R(30, None, None))))
    store.ingest(Batch("a", 1, "n1", (R(40, 20000.0), R(50, 25000.0), R(60, 30000.0), R(70, None, None),
                                      R(80, 40000.0), R(90, 45000.0))))
    job_j, gpu_j, _ = energies(store)
    assert job_j == gpu_j == 45000.0  # the counter's growth over the job
    assert store.counter_anomalies() == 0
    store.close()


def test_power_given_during_the_missed_readings_is_not_counted_twice(ledger):
    store = Store(ledger)
    # at 20 s power only (300 W: 3000 J given), at 30 s nothing: (30,40] gets 20000 - 10000 - 3000 J
    store.ingest(Batch("a", 0, "n1", (R(0, 0.0), R(10, 10000.0), R(20, None, 300.0), R(30, None, None),
                                      R(40, 20000.0))))
    assert energies(store)[:2] == (20000.0, 20000.0)
    store.close()


def test_an_untrusted_growth_across_a_missed_reading_falls_back_to_power(ledger):
    store = Store(ledger)
    # the counter went back across the missed reading (a driver reload): (30,40] takes its power integral, 5000 J,
    # as before, and is no counter anomaly (the counters of no interval's ends disagree); likewise a growth beyond
    # the cap (1500 W x 20 s) and one whose reading before is more than max_gap_s back
    store.ingest(Batch("a", 0, "n1", (R(0, 0.0), R(10, 5000.0), R(20, 10000.0), R(30, None, None), R(40, 3000.0),
                                      R(50, 8000.0), R(60, None, None), R(70, 8000.0 + 1500 * 20 + 1),
                                      R(80, 1e6), R(90, None, None), R(100, None, None), R(110, None, None),
                                      R(120, None, None), R(130, None, None), R(141, 1e6 + 61 * 500))))
    job_j, gpu_j, _ = energies(store)
    # 5000 + 5000 + 0 + 5000 (power) | 5000 + 0 + 5000 (power) | 5000 (80: a jump of 961999 J, an anomaly) | 0 x 5
    # + 5500 (power: 141 s is 61 s after the reading at 80 s)
    assert job_j == gpu_j == 15000.0 + 10000.0 + 5000.0 + 5500.0
    assert store.counter_anomalies() == 1
    store.close()


@pytest.mark.parametrize(("window_s", "head", "tail", "want"), [
    # the stretch crosses an hour (T0; an interval is its end's): (T0, T0+10] gets 15000 - 5000 - 2000 J (power
    # only at T0), half of it the hour before's (for (-20, -10], which no reading gave any), and (T0+20, T0+30] 6000 J
    (600.0, [R(-30, 0.0), R(-20, 5000.0)],
     [R(-10, None, None), R(0, None, 200.0), R(10, 15000.0), R(20, None, None), R(30, 21000.0)],
     (21000.0, 21000.0, [(9000.0, 9000.0), (12000.0, 12000.0)])),
    # a 10 s late window: the reading at -20 s, which (5,10] reads back, is out of it (and not its anchor): a late
    # sample's window is read back from where the rule reads (Aggregator.read_floor); its 8000 J caught up are
    # for (-20, -10] (the hour before's) and (0, 10], 10 s each
    (10.0, [R(-30, 0.0), R(-20, 5000.0), R(-10, None, None)], [R(0, None, 200.0), R(5, None, None), R(10, 15000.0)],
     (15000.0, 15000.0, [(9000.0, 9000.0), (6000.0, 6000.0)])),
], ids=["window-600s", "window-10s"])
def test_every_arrival_order_of_a_missed_reading_stretch_gives_the_same_totals(ledger, window_s, head, tail, want):
    """The store holds a GPU's newest sample only and reads its window back for a late sample (and for a reading
    after a missed one): each order on its own host, one sample a batch, against the in-order host. Exact: every
    value here is an integer number of joules, so no sum depends on the order of its terms (in general the last
    ulp may: a late sample's undo and redo add the same terms in another order)."""
    store = Store(ledger, window_s=window_s)
    orders = list(itertools.permutations(tail))
    for n, order in enumerate(orders):
        for k, s in enumerate((*head, *order)):
            assert store.ingest(Batch("a", k, f"p{n}", (replace(s, host=f"p{n}"),))).accepted == 1
    assert energies(store, "p0") == want  # the in-order one (permutations start with the identity)
    assert all(energies(store, f"p{n}") == want for n in range(len(orders)))
    store.close()


def test_a_restart_in_a_missed_reading_stretch_changes_nothing(new_ledger):
    """A collector restarted after the missed reading (its newest stored sample) reads the reading before it back
    from the series store, as one that kept running does; a late sample into the stretch after the restart too."""
    batches = [(R(0, 0.0), R(10, 5000.0), R(20, 10000.0), R(30, None, None)),
               (R(40, 20000.0), R(50, 25000.0)), (R(35, None, 100.0),)]
    kept, restarted = new_ledger(), new_ledger()
    store = Store(kept)
    for k, b in enumerate(batches):
        store.ingest(Batch("a", k, "n1", b))
    want = energies(store)
    store.close()
    for k, b in enumerate(batches):
        store = Store(restarted)
        store.ingest(Batch("a", k, "n1", b))
        store.close()
    store = Store(restarted)
    assert energies(store) == want
    # (30,35] got 500 J of power, (35,40] the rest of the 10000 J grown since 20 s
    assert want[:2] == (25000.0, 25000.0)
    store.close()


def test_a_missed_reading_stretch_across_a_month_is_billed_in_both_across_a_restart(new_ledger):
    """The energy caught up after missed readings goes to the hours, so the months, of the intervals it is for, with
    a collector restarted in the stretch (it reads the hour before back from the store) as with one kept running."""
    new_year = 1_767_225_600.0  # 2026-01-01T00:00Z
    month = new_year - T0
    batches = [(R(month - 35, 0.0), R(month - 25, 5000.0), R(month - 15, 10000.0), R(month - 5, None, None)),
               (R(month + 5, 20000.0), R(month + 15, 25000.0)), (R(month, None, 200.0),)]
    kept, restarted = new_ledger(), new_ledger()
    store = Store(kept)
    for k, b in enumerate(batches):
        store.ingest(Batch("a", k, "n1", b))
    stores = [store]
    for k, b in enumerate(batches):
        store = Store(restarted)
        store.ingest(Batch("a", k, "n1", b))
        store.close()
    stores.append(Store(restarted))
    for store in stores:
        months = [[(g["energy_joules"], g["job_energy_joules"]) for g in store.gpu_energy(start, end)]
                  for start, end in ((new_year - 31 * 86400, new_year), (new_year, new_year + 31 * 86400))]
        # (month+0, month+5] catches up 20000 - 10000 - 1000 J (200 W over (month-5, month]) for the 10 s of
        # (month-15, month-5] (December's) and its own 5 s (January's)
        assert months == [[(10000.0 + 6000.0,) * 2], [(1000.0 + 3000.0 + 5000.0,) * 2]]
        assert store.job_usage()[0].energy_joules == 25000.0
        store.close()
