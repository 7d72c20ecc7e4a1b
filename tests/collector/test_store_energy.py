"""The store's side of the energy rules: gap records, per-GPU unattributed energy and counter anomalies, kept
across restarts, exposed as a Prometheus counter, configured from ``[collector]``."""

from __future__ import annotations

import sqlite3

import httpx

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
