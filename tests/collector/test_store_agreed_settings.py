"""The settings every collector and compactor on one ledger must share (``store.AGREED_SETTINGS``: window_s,
max_gap_s, dedupe_horizon_s, power_cap_w, power_caps) are the ledger's: the first store given them records them, a
store given others refuses to open (one line naming the setting, both values and the ledger; exit 2 from a command),
a store given none (a query) runs with the ledger's, and ``collector set-settings`` changes them deliberately."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpuledger.cli import run
from gpuledger.collector.series_store import Retention
from gpuledger.collector.store import AGREED_SETTINGS, InvalidSetting, SettingsMismatch, Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000


def test_a_store_given_other_agreed_settings_than_the_ledgers_refuses_to_open(new_ledger):
    url = new_ledger()
    first = Store(url, window_s=300.0, max_gap_s=30.0)
    try:  # while the first one runs (two collectors on one ledger): same settings open, others are refused
        Store(url, window_s=300.0, max_gap_s=30.0).close()
        with pytest.raises(SettingsMismatch) as refused:
            Store(url, window_s=600.0, max_gap_s=30.0)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"ledger {first.url}: window_s = 600 here, 300 in the ledger")
        assert "collector set-settings" in line
        with pytest.raises(SettingsMismatch, match="window_s = 60 here, 300 in the ledger; max_gap_s = 60 here, 30 "):
            Store(url, window_s=60.0, max_gap_s=60.0)  # a compactor with a shorter window: every one named
        # the dedupe horizon was recorded by none: the first given one records it (in a store that opens) ...
        with pytest.raises(SettingsMismatch):
            Store(url, window_s=60.0, dedupe_horizon_s=3600.0)
        Store(url, dedupe_horizon_s=7200.0).close()
        with pytest.raises(SettingsMismatch, match="dedupe_horizon_s = 3600 here, 7200 in the ledger"):
            Store(url, dedupe_horizon_s=3600.0)
    finally:
        first.close()
    reader = Store(url)  # given none (a report, a query): the ledger's
    try:
        assert (reader.agg.window_s, reader.agg.max_gap_s, reader.dedupe_horizon_s) == (300.0, 30.0, 7200.0)
    finally:
        reader.close()


def test_a_ledger_without_recorded_settings_runs_with_the_defaults_until_a_store_is_given_them(new_ledger):
    url = new_ledger()
    Store(url).close()  # records nothing: a query never decides them for the collectors
    Store(url, window_s=120.0).close()
    store = Store(url)
    try:
        assert store.agg.window_s == 120.0
        assert (store.agg.max_gap_s, store.dedupe_horizon_s) == (AGREED_SETTINGS["max_gap_s"],
                                                                  AGREED_SETTINGS["dedupe_horizon_s"])
    finally:
        store.close()


def test_adopt_settings_changes_the_ledgers_and_keeps_what_was_counted(new_ledger):
    url = new_ledger()
    store = Store(url, window_s=600.0)
    store.ingest(Batch("a", 0, "n1", tuple(GpuSample(ts=H + 10 * i, host="n1", gpu_uuid="G0", gpu_index=0,
                                                     power_watts=100.0, job_ids=("5",)) for i in range(60))))
    before = store.totals()
    store.close()
    changed = Store(url, window_s=300.0, adopt_settings=True)  # `collector set-settings`, every process stopped
    try:
        assert changed.recorded_settings == {"window_s": (600.0, 300.0)} and changed.totals() == before
    finally:
        changed.close()
    with pytest.raises(SettingsMismatch, match="window_s = 600 here, 300 in the ledger"):
        Store(url, window_s=600.0)


CAPS = {"A100": 400.0, "H200": 700.0}


def test_a_store_given_other_power_caps_than_the_ledgers_refuses_to_open(new_ledger):
    url = new_ledger()
    first = Store(url, power_cap_w=900.0, power_caps=CAPS)
    try:  # another collector: the same caps open (in any key order), others are refused
        Store(url, power_cap_w=900, power_caps={"H200": 700, "A100": 400.0}).close()
        with pytest.raises(SettingsMismatch, match="power_cap_w = 1000 here, 900 in the ledger") as refused:
            Store(url, power_cap_w=1000.0, power_caps=CAPS)
        assert "\n" not in str(refused.value)
        with pytest.raises(SettingsMismatch, match='power_caps = {"H200": 700} here, {"A100": 400, "H200": 700} in the '
                                                   'ledger'):
            Store(url, power_cap_w=900.0, power_caps={"H200": 700.0})
        with pytest.raises(SettingsMismatch, match='power_caps = {} here'):
            Store(url, power_cap_w=900.0, power_caps={})  # no per-model caps is a mapping too
        # a compactor (``CompactorProcess``: caps not given) opens beside them
        Store(url, window_s=600.0, max_gap_s=AGREED_SETTINGS["max_gap_s"]).close()
    finally:
        first.close()
    reader = Store(url)  # a query: counts with the ledger's caps
    try:
        assert (reader.agg.power_cap_w, reader.agg.power_caps) == (900.0, CAPS)
        assert reader.agg.cap_w("NVIDIA H200") == 700.0 and reader.agg.cap_w("NVIDIA B200") == 900.0
    finally:
        reader.close()


def test_a_store_whose_settings_the_retention_refuses_records_none_of_them(new_ledger):
    url = new_ledger()
    with pytest.raises(ValueError, match="raw retention 1800.0 s must cover the late window"):
        Store(url, window_s=120.0, power_cap_w=900.0, retention=Retention(raw_s=1800.0))
    store = Store(url, window_s=300.0, power_cap_w=800.0)  # nothing was recorded: these open and are recorded
    store.close()
    store = Store(url)
    try:
        assert (store.agg.window_s, store.agg.power_cap_w, store.agg.power_caps) == (300.0, 800.0, {})
    finally:
        store.close()


@pytest.mark.parametrize(("options", "line"), [
    ({"power_caps": {"H200": -1.0}}, "power_caps = {\"H200\": -1} is invalid: it must be a mapping of GPU model to "
                                     "finite watts above 0"),
    ({"power_cap_w": math.inf}, "power_cap_w = inf is invalid: it must be finite watts above 0"),
    ({"window_s": -5.0}, "window_s = -5 is invalid: it must be finite seconds at least 0"),
    ({"max_gap_s": "soon"}, "max_gap_s = 'soon' is invalid: it must be finite seconds above 0"),
    ({"retention": Retention(minute_s=0.0)}, "minute_retention_s = 0 is invalid: it must be finite seconds above 0, "
                                             "or None (kept for good)"),
    ({"retention": Retention(raw_s=None)}, "raw_retention_s = forever is invalid: it must be finite seconds above 0"),
])
def test_a_store_given_a_setting_no_process_may_run_with_says_which_and_records_nothing(new_ledger, options, line):
    """Refused before it is compared with the ledger's: a mismatch message would ask the operator to share a value
    that is wrong anywhere."""
    url = new_ledger()
    Store(url, window_s=300.0, power_cap_w=800.0).close()
    with pytest.raises(InvalidSetting) as refused:
        Store(url, **{"window_s": 300.0, "power_cap_w": 800.0, **options})
    assert str(refused.value).splitlines() == [line]
    store = Store(url)
    try:  # the ledger's, unchanged
        assert (store.agg.window_s, store.agg.power_cap_w, store.agg.power_caps) == (300.0, 800.0, {})
        assert store.retention == Retention()
    finally:
        store.close()


def test_adopt_settings_changes_the_ledgers_power_caps(new_ledger):
    url = new_ledger()
    Store(url, power_cap_w=900.0, power_caps=CAPS).close()
    changed = Store(url, power_cap_w=900.0, power_caps={"H200": 800.0}, adopt_settings=True)
    try:
        assert changed.recorded_settings == {"power_caps": (CAPS, {"H200": 800.0})}
    finally:
        changed.close()
    Store(url, power_caps={"H200": 800.0}).close()
    with pytest.raises(SettingsMismatch, match='power_caps = {"A100": 400, "H200": 700} here, {"H200": 800} in'):
        Store(url, power_caps=CAPS)


def call(capsys, *argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "unexpected" not in err, out + err
    return code, out, err


def test_commands_check_the_configured_settings_against_the_ledgers(capsys, tmp_path: Path) -> None:
    """``collector serve`` and ``collector compact`` refuse a configuration the ledger disagrees with (exit 2, one
    line); queries read with the ledger's settings; ``collector set-settings`` records the configuration's."""
    ledger = tmp_path / "gpuledger.sqlite"
    Store(ledger, window_s=300.0).close()  # what the ledger's collectors run with
    (tmp_path / "gpuledger.toml").write_text("[collector]\nwindow_s = 600\n")
    for argv in (("collector", "compact"), ("collector", "serve", "--port", "0")):
        code, out, err = call(capsys, *argv, "--data-dir", tmp_path)
        assert (code, out) == (2, ""), argv
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: ledger {ledger}: window_s = 600 here, 300 in the "
                                                       "ledger"), (argv, err)
    code, out, err = call(capsys, "collector", "totals", "--data-dir", tmp_path)
    assert code == 0 and json.loads(out)["samples"] == 0, err
    code, out, err = call(capsys, "collector", "set-settings", "--data-dir", tmp_path)
    assert code == 0 and json.loads(out)["window_s"] == 600.0 and "window_s: 300 -> 600" in err, err
    code, out, err = call(capsys, "collector", "compact", "--data-dir", tmp_path)
    assert code == 0, err


def test_commands_check_the_configured_power_caps_against_the_ledgers(capsys, tmp_path: Path) -> None:
    """``collector serve`` refuses other power caps than the ledger's; ``collector compact`` (compaction counts no
    energy) and queries open it whatever caps are configured, and record none; ``collector set-settings`` records
    the configuration's."""
    ledger = tmp_path / "gpuledger.sqlite"
    Store(ledger, power_cap_w=900.0, power_caps={"H200": 700.0}).close()
    (tmp_path / "gpuledger.toml").write_text('[collector]\npower_cap_w = 900\n[collector.power_caps]\n"H200" = 800\n')
    code, out, err = call(capsys, "collector", "serve", "--port", "0", "--data-dir", tmp_path)
    assert (code, out) == (2, "") and err.splitlines() == [
        f'error: ledger {ledger}: power_caps = {{"H200": 800}} here, {{"H200": 700}} in the ledger: every collector '
        "and compactor on a ledger must share it (to change it, stop them all and run `gpuledger collector "
        "set-settings`)"], err
    for argv in (("collector", "compact"), ("collector", "totals")):
        code, out, err = call(capsys, *argv, "--data-dir", tmp_path)
        assert code == 0 and json.loads(out)["tiers"] is not None, (argv, err)
    with pytest.raises(SettingsMismatch, match='power_caps = {"H200": 800} here, {"H200": 700} in the ledger'):
        Store(ledger, power_caps={"H200": 800.0})  # neither recorded the configured caps
    code, out, err = call(capsys, "collector", "set-settings", "--data-dir", tmp_path)
    assert code == 0 and 'power_caps: {"H200": 700} -> {"H200": 800}' in err, err
    assert json.loads(out) == {**AGREED_SETTINGS, "power_cap_w": 900.0, "power_caps": {"H200": 800.0}}
    Store(ledger, power_cap_w=900.0, power_caps={"H200": 800.0}).close()
