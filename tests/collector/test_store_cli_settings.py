"""``collector compact|series|totals`` open the ledger with the ``[collector]`` settings ``collector serve`` runs
with (retention, window_s, ...), not the store's built-in defaults."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gpuledger.collector.cli import app
from gpuledger.collector.series_store import RAW
from gpuledger.collector.store import Store
from gpuledger.collector.store_cli import DB_NAME
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000
DAY = 86400.0


def _two_hours(tmp_path) -> None:
    store = Store(tmp_path / DB_NAME)
    store.ingest(Batch("a", 0, "n1", tuple(GpuSample(ts=H + i * 10, host="n1", gpu_uuid="G0", gpu_index=0,
                                                     power_watts=100.0, job_ids=("5",)) for i in range(720))))
    store.close()


def test_compact_applies_the_configured_retention_and_window(tmp_path) -> None:
    _two_hours(tmp_path)
    (tmp_path / "gpuledger.toml").write_text(
        "[collector]\nwindow_s = 3600\nraw_retention_s = 2592000\nminute_retention_s = 0\n")  # raw 30 d
    # ten days later: past the built-in raw retention (7 d), well inside the configured one
    r = CliRunner().invoke(app, ["compact", "--data-dir", str(tmp_path), "--now", str(H + 10 * DAY)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    # minutes close a window (3600 s, not the default 600) behind the newest sample, H + 7190
    assert out["rolled_minutes"] == (7190 - 3600) // 60
    assert out["deleted_chunks"] == 0 and out["tiers"][0]["retention_s"] == 30 * DAY
    store = Store(tmp_path / DB_NAME, window_s=3600)
    try:
        assert len(store.series("n1", "G0", H, H + 7200, tier=RAW)) == 720
    finally:
        store.close()


def test_store_commands_read_the_collector_settings(tmp_path) -> None:
    _two_hours(tmp_path)
    config = tmp_path / "other.toml"
    config.write_text("[collector]\nraw_retention_s = 60\n")  # less than the late window: refused, as serve does
    for args in (["compact"], ["totals"], ["series", "n1", "G0", "--start", str(H)], ["usage"]):
        r = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path), "--config", str(config)])
        assert r.exit_code == 2 and "retention" in r.output, (args, r.output)
