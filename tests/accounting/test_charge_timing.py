"""What fairshare charges and when, where Slurm's decay thread decides it: a job across a usage reset, a running
job between two ticks; and inputs no computation should silently take (a usage sum past a double, a configuration
the feed cannot use)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpuledger.accounting.associations import AssocTree
from gpuledger.accounting.charge import ChargePolicy
from gpuledger.accounting.cli import fairshare_rows
from gpuledger.accounting.config import AccountingSettings, ConfigError, accounting_settings
from gpuledger.accounting.engine import association_usage
from gpuledger.accounting.fairshare import UsageError, classic
from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.cli import run
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

H = 3600.0
MIDNIGHT = 1_796_083_200.0  # 2026-12-01 00:00 UTC
CONFIG = ('[accounting]\npolicy = "active"\nhalf_life_s = 0\nusage_reset = "DAILY"\ntimezone = "UTC"\n'
          'algorithm = "classic"\n[accounts.a]\nshares = 1\n[accounts.a.users]\nu = 1\n'
          '[accounts.b]\nshares = 1\n[accounts.b.users]\nv = 1\n')


def test_a_job_across_a_usage_reset_keeps_only_what_accrued_after_it(tmp_path: Path) -> None:
    # Measured 22:00-02:00 UTC, fully SM-active, across a DAILY reset at 00:00: Slurm zeroes usage at the 00:00
    # tick, so 2 h survive (7200 GPU-s) plus the 23:55-00:00 piece that tick adds after zeroing (300 s).
    # Placed over only the hours after the reset, the whole 4 h (14400) would survive.
    start, end = MIDNIGHT - 2 * H, MIDNIGHT + 2 * H
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        seq, ts = 0, start
        while ts <= end:
            rows = []
            while ts <= end and len(rows) < 60:
                rows.append(GpuSample(ts=ts, host="n1", gpu_uuid="GPU-1", gpu_index=0, sm_active_ratio=1.0,
                                      energy_joules=700.0 * (ts - start), job_ids=("1",)))
                ts += 60.0
            seq += 1
            store.ingest(Batch("agent1", seq, "n1", tuple(rows)))
        store.put_jobs([JobRecord(job_id="1", account="a", user="u", gpus=1, start=start, end=end,
                                  state="COMPLETED")])
    finally:
        store.close()
    (tmp_path / "gpuledger.toml").write_text(CONFIG)
    rows, _ = fairshare_rows(tmp_path, None, None, now=MIDNIGHT + 3 * H)
    (user,) = [r for r in rows if (r.account, r.user) == ("a", "u")]
    assert user.raw_usage == pytest.approx(7200 + 300, abs=1.0)


def test_a_running_job_counts_up_to_the_last_tick_not_now() -> None:
    # slurmctld adds a running job's usage at its decay ticks: 150 s after the third tick, three periods count
    period = 300
    t0 = 1_800_000_000 // period * period
    tree = AssocTree.from_csv("account,parent,user,shares\na,,,1\na,,u,1\n")
    running = JobRecord(job_id="1", account="a", user="u", gpus=1, start=float(t0), end=None, state="RUNNING")
    settings = AccountingSettings(policy="allocated", half_life_s=0, calc_period_s=period)
    result = association_usage([LedgerEntry("1", running, None)], settings, tree, t0 + 3 * period + 150)
    assert result.usage[("a", "u")] == pytest.approx(3 * period)
    ended = JobRecord(job_id="1", account="a", user="u", gpus=1, start=float(t0), end=t0 + 3 * period + 100.0,
                      state="COMPLETED")  # an end between ticks is added at the end (then decays at the next)
    result = association_usage([LedgerEntry("1", ended, None)], settings, tree, t0 + 3 * period + 150)
    assert result.usage[("a", "u")] == pytest.approx(3 * period + 100)


def test_usages_whose_sum_overflows_a_double_are_refused() -> None:
    tree = AssocTree.from_csv("account,parent,user,shares\na,,,1\na,,heavy,1\na,,light,1\nb,,,1\nb,,other,1\n")
    with pytest.raises(UsageError, match="more than a double holds"):
        classic(tree, {("a", "heavy"): 1e308, ("a", "light"): 1.0, ("b", "other"): 1e308})
    rows = classic(tree, {("a", "heavy"): 1.0, ("a", "light"): 1e-308, ("b", "other"): 1.0})  # ratios: fine
    assert {r.user: round(r.fairshare, 6) for r in rows if r.user} == {"heavy": 0.25, "light": 0.5, "other": 0.5}


def test_a_priority_weight_scontrol_cannot_take_is_refused() -> None:
    assert accounting_settings({"accounting": {"priority_weight": 2_147_483_645}}).priority_weight == 2_147_483_645
    with pytest.raises(ConfigError, match="priority_weight"):
        accounting_settings({"accounting": {"priority_weight": 2_147_483_646}})


@pytest.mark.parametrize(("setting", "value"), [
    ("half_life_s", math.inf), ("floor", math.nan), ("full_power_watts", math.inf), ("dampening", math.inf),
    ("model_weights", {"H200": math.inf}), ("model_weights", {"H200": -1.0})])
def test_settings_that_are_no_number_are_refused_naming_them(setting: str, value) -> None:
    # an infinite weight reached the charges and was refused there, naming a charge instead of the setting; an
    # infinite half-life got as far as the audit log (which has no JSON form for it) before it was refused
    with pytest.raises(ConfigError, match=rf"accounting\.{setting}(\.H200)?: Input should be"):
        accounting_settings({"accounting": {setting: value}})
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        ChargePolicy(model_weights={"H200": math.inf})


@pytest.mark.parametrize("command", [("priority", "feed"), ("priority", "watch", "--feed-only", "--no-import-jobs",
                                                              "--metrics-port", "0")])
def test_the_feed_commands_exit_2_naming_the_file_on_a_bad_setting(tmp_path: Path, capsys, command) -> None:
    (tmp_path / "gpuledger.toml").write_text(CONFIG.replace('half_life_s = 0', 'priority_weight = -5'))
    code = run([*command, "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {tmp_path / 'gpuledger.toml'}: accounting.priority_weight")
