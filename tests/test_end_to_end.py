"""The walking skeleton end to end through the real HTTP path: simulated agents -> collector -> accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.collector.store import AGREED_SETTINGS, Store
from gpuledger.demo import JOB_PLAN, run_demo

runner = CliRunner()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("demo"), seed=3)


def test_demo_shape(demo):
    users = {j.user for j in demo.jobs}
    accounts = {j.account for j in demo.jobs}
    assert len(demo.jobs) == len(JOB_PLAN) >= 12 and len(users) >= 3 and len(accounts) == 2
    assert all(j.start is not None for j in demo.jobs), "every job got GPUs within the simulated hour"
    assert set(demo.usage) == {j.job_id for j in demo.jobs}


def test_usage_matches_ground_truth_within_one_percent(demo):
    for j in demo.jobs:
        u = demo.usage[j.job_id]
        assert u.gpus == j.gpus
        end = j.end if j.end is not None else u.last_ts
        assert u.allocated_gpu_seconds == pytest.approx((end - j.start) * j.gpus, rel=1e-9)
        assert u.energy_joules == pytest.approx(j.truth_energy_j, rel=0.01), j.job_id
        if j.truth_sm_active_s == 0:
            assert u.sm_active_gpu_seconds == 0.0
        else:
            assert u.sm_active_gpu_seconds == pytest.approx(j.truth_sm_active_s, rel=0.01), j.job_id


def test_idle_job_is_not_active_and_burns_idle_power(demo):
    idle = [j for j in demo.jobs if j.profile == "idle"]
    assert idle
    for j in idle:
        u = demo.usage[j.job_id]
        assert u.sm_active_gpu_seconds == 0.0 and u.efficiency == 0.0
        mean_power = u.energy_joules / u.allocated_gpu_seconds
        assert 60 < mean_power < 100  # an H200 idles around 75 W
    training = [demo.usage[j.job_id] for j in demo.jobs if j.profile == "training"]
    assert all(u.efficiency > 0.8 for u in training)


def test_cli_reads_the_demo_data(demo):
    d = str(demo.data_dir)
    r = runner.invoke(app, ["report", "usage", "--data-dir", d, "--by", "account", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    total = sum(u.allocated_gpu_seconds for u in demo.usage.values()) / 3600
    assert doc["total"]["allocated_gpu_hours"] == pytest.approx(total)
    assert {g["group"] for g in doc["rows"]} == {"proj_a", "proj_b"}

    r = runner.invoke(app, ["fairshare", "--data-dir", d, "--algorithm", "classic", "--format", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    users = {(x["account"], x["user"]): x for x in rows if x["user"]}
    assert set(users) == {("proj_a", "alice"), ("proj_a", "bob"), ("proj_b", "carol"), ("proj_b", "dave")}
    assert all(0 < x["fairshare"] < 1 for x in users.values())

    r = runner.invoke(app, ["priority", "feed", "--data-dir", d, "--format", "json"])
    assert r.exit_code == 0, r.output
    feed = json.loads(Path(d, "priority-feed.json").read_text())
    assert feed == json.loads(r.output)
    by_user = {(e["account"], e["user"]): e for e in feed["associations"]}
    assert set(by_user) == set(users)
    for e in feed["associations"]:
        assert e["site_factor"] == round(feed["priority_weight"] * e["fairshare"])

    r = runner.invoke(app, ["jobs", "list", "--data-dir", d, "--format", "json"])
    assert r.exit_code == 0, r.output
    jobs = json.loads(r.output)
    assert {j["job_id"] for j in jobs} == set(demo.usage) and all(j["seen_by"] == "both" for j in jobs)


def test_the_demo_records_the_settings_a_collector_on_its_data_dir_must_share(demo):
    """The demo's collector opens the ledger as `collector serve` does with the demo's configuration, so the ledger
    records every agreed setting (nothing left for a later process to record otherwise) and a collector configured
    otherwise afterwards is refused, one line, exit 2."""
    d = demo.data_dir
    store = Store(d / "gpuledger.sqlite")
    try:
        recorded = {k.removeprefix("setting."): json.loads(v) for k, v in store.db.execute(
            "SELECT key, value FROM meta WHERE key LIKE 'setting.%'").fetchall()}
    finally:
        store.close()
    assert set(recorded) == set(AGREED_SETTINGS)
    config = d / "other.toml"
    config.write_text("[collector]\nraw_retention_s = 86400\n")
    r = runner.invoke(app, ["collector", "compact", "--data-dir", str(d), "--config", str(config)])
    assert r.exit_code == 2 and "raw_retention_s = 86400 here, 604800 in the ledger" in r.output, r.output


def test_commands_name_a_missing_store(tmp_path):
    r = runner.invoke(app, ["report", "usage", "--data-dir", str(tmp_path / "nowhere")])
    assert r.exit_code == 2 and "no gpuledger store" in r.output


def test_demo_rerun_starts_afresh_and_never_touches_a_foreign_store(tmp_path):
    d = tmp_path / "demo"
    args = ["demo", "--data-dir", str(d), "--nodes", "1", "--gpus", "8", "--hours", "0.1"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    feed1 = json.loads((d / "priority-feed.json").read_text())
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(d), "--format", "json"])
    jobs = json.loads(r.output)
    # Job ids repeat between runs: usage must be one run's, not the sum of two.
    assert all(j["usage"] is None or j["usage"]["allocated_gpu_seconds"] <= 0.1 * 3600 * j["gpus"] + 1e-6
               for j in jobs)
    feed2 = json.loads((d / "priority-feed.json").read_text())
    # The same plan again: the same usage, not twice as much (the demo's time is anchored, so exactly the same,
    # unless the two runs straddle a full hour).
    for a, b in zip(feed1["associations"], feed2["associations"], strict=True):
        assert (a["account"], a["user"]) == (b["account"], b["user"])
        assert b["raw_usage"] == pytest.approx(a["raw_usage"], rel=0.05)
    assert runner.invoke(app, ["audit", "verify", "--data-dir", str(d)]).exit_code == 0

    foreign = tmp_path / "prod"
    foreign.mkdir()
    (foreign / "gpuledger.sqlite").write_bytes(b"not a demo's")
    r = runner.invoke(app, ["demo", "--data-dir", str(foreign)])
    assert r.exit_code == 2 and "did not write" in r.output
    assert (foreign / "gpuledger.sqlite").read_bytes() == b"not a demo's"


def _numbers(res):
    return {j: (u.allocated_gpu_seconds, u.sm_active_gpu_seconds, u.energy_joules, u.sm_active_mean, u.dram_bw_mean)
            for j, u in res.usage.items()}


def test_demo_is_deterministic_for_a_seed_whatever_the_wall_clock(tmp_path):
    """The same seed gives the same numbers to the last bit, whenever it runs: time is an offset from an anchor."""
    import time

    from gpuledger.accounting.cli import fairshare_rows

    anchor = time.time() // 3600 * 3600 - 30 * 86400 - 7 * 3600  # the collector refuses samples from the future
    kw = dict(nodes=2, gpus_per_node=4, hours=0.1, step_s=10, seed=5)
    a = run_demo(tmp_path / "a", end=anchor, **kw)
    b = run_demo(tmp_path / "b", end=anchor + 30 * 86400 + 7 * 3600, **kw)  # a month and 7 hours later
    c = run_demo(tmp_path / "c", end=anchor, **{**kw, "seed": 6})
    assert _numbers(a) == _numbers(b)
    assert _numbers(a) != _numbers(c)  # the check sees a different seed
    shift = b.end - a.end
    assert {j: u.first_ts + shift for j, u in a.usage.items()} == {j: u.first_ts for j, u in b.usage.items()}
    def fs(run_dir: Path, now: float) -> list[tuple]:
        return [(r.account, r.user, r.raw_usage, r.fairshare) for r in fairshare_rows(run_dir, None, None, now=now)[0]]

    assert fs(tmp_path / "a", a.end) == fs(tmp_path / "b", b.end)


def test_demo_prints_the_same_tables_twice_and_a_next_command_that_works(tmp_path):
    import re
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("gpuledger")  # the venv's script, as after `make demo`
    outs = []
    for name in ("one", "two"):
        p = subprocess.run([str(exe), "demo", "--data-dir", str(tmp_path / name), "--nodes", "1", "--gpus", "4",
                            "--hours", "0.1", "--seed", "2"], capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    def stable(text, name):  # paths, the collector's port and the wall time differ; nothing else may
        text = text.replace(str(tmp_path / name), "DIR")
        return re.sub(r"127\.0\.0\.1:\d+|in [0-9.]+ s wall time|\d+:\d\d:\d\d", "X", text)
    assert stable(outs[0], "one") == stable(outs[1], "two")
    # the simulated agents see every allocated GPU-second, and a job still running is allocated up to the simulated
    # end, not the wall clock (which once made the table differ from run to run and show 1% coverage)
    job_lines = [ln for ln in outs[0].splitlines() if "@demo" in ln]
    assert job_lines and all(ln.split()[7] == "100%" for ln in job_lines), job_lines
    # stdout is a pipe: plain tables (gpuledger.output), no box drawing and no progress bar (a rich table and the
    # bar's last frame used to land in the file)
    assert not re.search("[\u2500-\u259f]", outs[0]) and "agents -> collector" not in outs[0], outs[0]
    assert re.search(r"^Jobs \(measured\)\n\nJob +Seen by +User", outs[0], re.M), outs[0]
    nxt = [ln for ln in outs[1].splitlines() if ln.startswith("next: ")]
    assert len(nxt) == 1
    for cmd in nxt[0].removeprefix("next: ").split("   |   "):
        assert cmd.startswith(str(exe) + " ")  # `gpuledger` is not on this PATH: the full path is printed
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr)


def test_demo_keeps_to_its_own_ledger_under_a_site_ledger_url(tmp_path):
    """With GPULEDGER_LEDGER_URL set (a site's ledger; here one that cannot be reached) the demo still writes its
    embedded ledger, and the next commands it prints read that one, not the site's."""
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("gpuledger")
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "200",
           "GPULEDGER_LEDGER_URL": "postgresql://nobody@127.0.0.1:1/site?connect_timeout=2"}
    p = subprocess.run([str(exe), "demo", "--data-dir", str(tmp_path / "d"), "--nodes", "1", "--gpus", "2",
                        "--hours", "0.1"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    nxt = [ln for ln in p.stdout.splitlines() if ln.startswith("next: ")]
    assert len(nxt) == 1 and "--ledger-url" in nxt[0]
    for cmd in nxt[0].removeprefix("next: ").split("   |   "):
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and r.stdout.strip(), (cmd, r.stderr)
