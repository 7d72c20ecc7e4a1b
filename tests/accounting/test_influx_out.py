"""Accounting results into InfluxDB through the product's commands: `fairshare --influx`, `priority feed` (when
influx_url is set) and `report usage --influx`, against a real InfluxDB 1.x; and the one-line errors without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from servers import InfluxServer, free_port
from typer.testing import CliRunner

from gpuledger.cli import app
from gpuledger.demo import CONFIG_NAME, run_demo

pytestmark = pytest.mark.influx
runner = CliRunner()


def _configure(data: Path, url: str, db: str = "gl") -> None:
    text = (data / CONFIG_NAME).read_text().split("\n[collector]")[0]
    (data / CONFIG_NAME).write_text(text + f'\n[collector]\ninflux_url = "{url}"\ninflux_api = "v1"\n'
                                    f'influx_database = "{db}"\n')


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("acct-influx") / "data"
    run_demo(data, nodes=1, gpus_per_node=8, hours=0.1, step_s=10, seed=1)
    return data


def _rows(influx: InfluxServer, q: str) -> list[list]:
    return [row for r in influx.query(q) for s in r.get("series", []) for row in s.get("values", [])]


def test_fairshare_feed_and_report_reach_influxdb(demo_dir: Path, tmp_path: Path) -> None:
    with InfluxServer(tmp_path / "influx", db="gl") as influx:
        _configure(demo_dir, influx.url)
        r = runner.invoke(app, ["fairshare", "--data-dir", str(demo_dir), "--influx", "--format", "json"])
        assert r.exit_code == 0 and "fairshare written to InfluxDB" in r.stderr, r.output
        users = _rows(influx, 'SELECT "fairshare", "site_factor", "raw_usage" FROM "fairshare" WHERE "user" != \'\' '
                              'GROUP BY "account", "user"')
        assert len(users) == 4 and all(0 < fs < 1 and isinstance(sf, int) for _, fs, sf, _ in users)
        # per-account usage: the accounts' own rows (no user tag) carry their raw usage
        accounts = {s["tags"]["account"]: s["values"][0][1] for res in influx.query(
            'SELECT "raw_usage" FROM "fairshare" WHERE "user" = \'\' GROUP BY "account"') for s in res["series"]}
        assert set(accounts) >= {"proj_a", "proj_b"} and accounts["proj_a"] > 0

        r = runner.invoke(app, ["priority", "feed", "--data-dir", str(demo_dir)])  # configured: writes by itself
        assert r.exit_code == 0 and "fairshare written to InfluxDB" in r.stderr, r.output
        r = runner.invoke(app, ["priority", "feed", "--data-dir", str(demo_dir), "--no-influx"])
        assert r.exit_code == 0 and "InfluxDB" not in r.stderr

        r = runner.invoke(app, ["report", "usage", "--data-dir", str(demo_dir), "--influx", "--format", "json"])
        assert r.exit_code == 0 and "job usage written to InfluxDB" in r.stderr, r.output
        jobs = influx.query('SELECT last("allocated_gpu_seconds") FROM "job_usage" GROUP BY "jobid", "account"')
        got = {s["tags"]["jobid"]: s["tags"]["account"] for res in jobs for s in res["series"]}
        listed = json.loads(
            runner.invoke(app, ["jobs", "list", "--data-dir", str(demo_dir), "--format", "json"]).stdout)
        assert got == {j["job_id"]: j["account"] for j in listed if j["usage"]} and len(got) >= 5


def test_influx_errors_are_one_line(demo_dir: Path) -> None:
    _configure(demo_dir, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    r = runner.invoke(app, ["fairshare", "--data-dir", str(demo_dir), "--influx"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "took 0 of" in r.stderr, r.output
    r = runner.invoke(app, ["report", "usage", "--data-dir", str(demo_dir), "--influx", "--format", "csv"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "took 0 of" in r.stderr, r.output
    (demo_dir / CONFIG_NAME).write_text((demo_dir / CONFIG_NAME).read_text().split("\n[collector]")[0])
    r = runner.invoke(app, ["fairshare", "--data-dir", str(demo_dir), "--influx"])
    assert r.exit_code == 2 and "no InfluxDB configured: set influx_url" in r.stderr and r.stderr.count("\n") == 1
    # not configured: no write
    assert runner.invoke(app, ["priority", "feed", "--data-dir", str(demo_dir)]).exit_code == 0
