"""The tiers' retention (raw_retention_s, minute_retention_s, hour_retention_s: ``store.RETENTION_SETTINGS``) is one
of the settings a ledger's processes share: a compaction with a shorter one would delete series the others keep and
serve. Recorded by the first store given it (a ledger of an earlier version too), refused when another is given (one
line; exit 2 from ``collector serve|compact`` and the compactor process), the ledger's in a query, changed by
``collector set-settings``; a tier kept for good (None) is a value like any other."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from collector_proc import wait_until
from test_store_agreed_settings import call

from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.series_outbox import local_retention
from gpuledger.collector.series_store import MINUTE, RAW, Retention
from gpuledger.collector.store import AGREED_SETTINGS, UNRECORDED, SettingsMismatch, Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

H = 3600.0 * 480_000
DAY = 86400.0
LONG = Retention(raw_s=30 * DAY, minute_s=90 * DAY, hour_s=None)
SHORT = local_retention(600.0)  # raw 4200 s, rollups an hour: what a collector with series_url keeps
LATER = H + 10 * DAY  # every raw chunk past SHORT's raw retention, none past LONG's


def two_hours(store: Store) -> None:
    store.ingest(Batch("a", 0, "n1", tuple(GpuSample(ts=H + i * 10, host="n1", gpu_uuid="G0", gpu_index=0,
                                                     power_watts=100.0, job_ids=("5",)) for i in range(720))))


def rows(store: Store) -> list[int]:
    return [t["rows"] for t in store.tiers()]


def test_a_store_given_another_retention_refuses_to_open_and_deletes_nothing(new_ledger):
    url = new_ledger()
    first = Store(url, window_s=600.0, retention=LONG)
    try:
        two_hours(first)
        first.compact(LATER)
        kept = rows(first)
        assert kept[RAW] == 720 and kept[MINUTE] > 0
        with pytest.raises(SettingsMismatch) as refused:  # a compactor or collector keeping less
            short = Store(url, window_s=600.0, retention=SHORT)
            short.compact(LATER)  # (what it would delete, had it opened)
        assert str(refused.value).splitlines() == [
            f"ledger {first.url}: raw_retention_s = 4200 here, 2592000 in the ledger; minute_retention_s = 3600 here, "
            "7776000 in the ledger; hour_retention_s = 3600 here, forever in the ledger: every collector and compactor "
            "on a ledger must share it (to change it, stop them all and run `gpuledger collector set-settings`)"]
        Store(url, window_s=600.0, retention=LONG).close()  # the same retention opens beside it
        assert first.compact(LATER).deleted_chunks == 0 and rows(first) == kept
    finally:
        first.close()
    reader = Store(url)  # a query: the ledger's retention, not the built-in one
    try:
        assert (reader.retention.raw_s, reader.retention.minute_s, reader.retention.hour_s) == (30 * DAY, 90 * DAY,
                                                                                               None)
        assert [t["retention_s"] for t in reader.tiers()] == [30 * DAY, 90 * DAY, None]
        assert len(reader.series("n1", "G0", H, H + 7200, tier=RAW)) == 720
    finally:
        reader.close()


def test_a_ledger_without_a_recorded_retention_adopts_the_first_one_given(new_ledger):
    url = new_ledger()
    # what an earlier version leaves: the other settings recorded, no retention
    Store(url, window_s=600.0, max_gap_s=60.0, dedupe_horizon_s=DAY).close()
    reader = Store(url)
    try:  # none recorded: the built-in tiers
        assert reader.retention == Retention()
    finally:
        reader.close()
    kept_for_good = Retention(raw_s=2 * DAY, minute_s=None, hour_s=None)
    store = Store(url, window_s=600.0, max_gap_s=60.0, dedupe_horizon_s=DAY, retention=kept_for_good)
    try:
        assert store.recorded_settings == {"raw_retention_s": (UNRECORDED, 2 * DAY),
                                           "minute_retention_s": (UNRECORDED, None),
                                           "hour_retention_s": (UNRECORDED, None)}
    finally:
        store.close()
    with pytest.raises(SettingsMismatch, match="raw_retention_s = 604800 here, 172800 in the ledger; "
                                               "minute_retention_s = 7776000 here, forever in the ledger: "):
        Store(url, retention=Retention())
    reader = Store(url)
    try:  # the recorded None, not the built-in 90 days
        assert (reader.retention.raw_s, reader.retention.minute_s, reader.retention.hour_s) == (2 * DAY, None, None)
    finally:
        reader.close()


def test_tiers_kept_for_good_are_recorded_and_compared_as_such(new_ledger):
    year = 365 * DAY
    url = new_ledger()
    Store(url, retention=Retention(minute_s=None, hour_s=None)).close()
    Store(url, retention=Retention(minute_s=None, hour_s=None)).close()  # the same: opens
    with pytest.raises(SettingsMismatch,
                       match="^ledger [^ ]+: minute_retention_s = 7776000 here, forever in the ledger: "):
        Store(url, retention=Retention())  # only the minutes differ: the hours are kept for good in both
    with pytest.raises(SettingsMismatch,
                       match="^ledger [^ ]+: hour_retention_s = 31536000 here, forever in the ledger: "):
        Store(url, retention=Retention(minute_s=None, hour_s=year))
    other = new_ledger()
    Store(other, retention=Retention(hour_s=year)).close()
    with pytest.raises(SettingsMismatch,
                       match="^ledger [^ ]+: hour_retention_s = forever here, 31536000 in the ledger: "):
        Store(other, retention=Retention())
    store = Store(other, retention=Retention(hour_s=None), adopt_settings=True)  # `collector set-settings`
    try:
        assert store.recorded_settings == {"hour_retention_s": (year, None)}
    finally:
        store.close()
    Store(other, retention=Retention()).close()


def test_a_compactor_process_given_another_retention_exits_2_and_is_not_started_again(tmp_path: Path, capfd):
    ledger = tmp_path / "gpuledger.sqlite"
    store = Store(ledger, window_s=600.0, retention=LONG)
    # as `collector serve` starts it, with a retention the ledger does not have (another collector ran set-settings)
    compactor = CompactorProcess(str(ledger), interval_s=0.2, window_s=600.0,
                                 max_gap_s=float(AGREED_SETTINGS["max_gap_s"]), retention=SHORT,
                                 dedupe_horizon_s=float(AGREED_SETTINGS["dedupe_horizon_s"]), restart_after_s=0.1)
    compactor.start()
    try:
        wait_until(lambda: compactor.refused, "the compactor to exit refusing its settings", timeout=60)
        time.sleep(0.5)  # longer than restart_after_s: a restart would have begun
        assert compactor.restarts == 0 and compactor.pid is None
    finally:
        compactor.stop()
        store.close()
    refusals = [line for line in capfd.readouterr().err.splitlines() if "raw_retention_s = 4200 here" in line]
    assert len(refusals) == 1 and refusals[0].endswith(
        f"ERROR ledger {ledger}: raw_retention_s = 4200 here, 2592000 in the ledger; minute_retention_s = 3600 here, "
        "7776000 in the ledger; hour_retention_s = 3600 here, forever in the ledger: every collector and compactor on "
        "a ledger must share it (to change it, stop them all and run `gpuledger collector set-settings`)"), refusals


def test_set_settings_changes_the_retention_and_a_later_compaction_applies_it(capsys, tmp_path: Path) -> None:
    ledger = tmp_path / "gpuledger.sqlite"
    store = Store(ledger)  # records nothing
    two_hours(store)
    store.close()
    toml = tmp_path / "gpuledger.toml"
    toml.write_text("[collector]\nraw_retention_s = 2592000\nminute_retention_s = 0\n")  # raw 30 d, minutes for good
    code, out, err = call(capsys, "collector", "compact", "--data-dir", tmp_path, "--now", LATER)
    assert code == 0 and json.loads(out)["deleted_chunks"] == 0, err
    toml.write_text("[collector]\nraw_retention_s = 432000\nminute_retention_s = 0\n")  # raw 5 d
    for argv in (("compact", "--now", LATER), ("serve", "--port", "0")):
        code, out, err = call(capsys, "collector", *argv, "--data-dir", tmp_path)
        assert (code, out) == (2, "") and err.splitlines() == [
            f"error: ledger {ledger}: raw_retention_s = 432000 here, 2592000 in the ledger: every collector and "
            "compactor on a ledger must share it (to change it, stop them all and run `gpuledger collector "
            "set-settings`)"], (argv, err)
    code, out, err = call(capsys, "collector", "totals", "--data-dir", tmp_path)  # a query: the ledger's, unchanged
    assert code == 0 and [t["retention_s"] for t in json.loads(out)["tiers"]] == [30 * DAY, None, None], err
    assert json.loads(out)["tiers"][RAW]["rows"] == 720
    code, out, err = call(capsys, "collector", "set-settings", "--data-dir", tmp_path)
    assert code == 0 and "raw_retention_s: 2592000 -> 432000" in err, err
    assert json.loads(out) == {**AGREED_SETTINGS, "raw_retention_s": 432000.0, "minute_retention_s": None}
    code, out, err = call(capsys, "collector", "compact", "--data-dir", tmp_path, "--now", LATER)
    assert code == 0, err
    tiers = json.loads(out)["tiers"]
    assert json.loads(out)["deleted_chunks"] > 0 and tiers[RAW]["retention_s"] == 5 * DAY
    assert 0 < tiers[RAW]["rows"] < 720  # what is rolled up and behind the late window goes


def test_with_series_url_the_agreed_retention_is_the_one_the_local_store_derives(capsys, tmp_path: Path) -> None:
    """With series_url the local store keeps raw samples for the window plus an hour (``local_retention``): that is
    what the ledger records, so a process without series_url (which keeps a week) is refused, and set-settings with
    another window records the raw retention it derives."""
    ledger = tmp_path / "gpuledger.sqlite"
    toml = tmp_path / "gpuledger.toml"
    vm = 'series_url = "http://127.0.0.1:9"\n'  # never contacted here
    Store(ledger).close()  # a ledger that records nothing yet (set-settings never creates one)
    toml.write_text("[collector]\n" + vm)
    code, out, err = call(capsys, "collector", "set-settings", "--data-dir", tmp_path)
    assert code == 0 and "raw_retention_s: unset -> 4200" in err, err
    assert {k: v for k, v in json.loads(out).items() if k.endswith("_retention_s")} == {
        "raw_retention_s": 4200.0, "minute_retention_s": 3600.0, "hour_retention_s": 3600.0}
    toml.write_text("[collector]\nwindow_s = 1200\n" + vm)
    code, out, err = call(capsys, "collector", "compact", "--data-dir", tmp_path)
    assert code == 2 and err.startswith(f"error: ledger {ledger}: window_s = 1200 here, 600 in the ledger; "
                                        "raw_retention_s = 4800 here, 4200 in the ledger: "), err
    code, out, err = call(capsys, "collector", "set-settings", "--data-dir", tmp_path)
    assert code == 0 and "window_s: 600 -> 1200" in err and "raw_retention_s: 4200 -> 4800" in err, err
    toml.write_text("[collector]\nwindow_s = 1200\n")  # no series_url: the local store would keep a week
    code, out, err = call(capsys, "collector", "compact", "--data-dir", tmp_path)
    assert code == 2 and err.startswith(
        f"error: ledger {ledger}: raw_retention_s = 604800 here, 4800 in the ledger; minute_retention_s = 7776000 "
        "here, 3600 in the ledger; hour_retention_s = forever here, 3600 in the ledger: "), err
