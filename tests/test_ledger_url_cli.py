"""--ledger-url through the `gpuledger` entry point: every command that touches the ledger takes it (and the
environment variable, and the [ledger] table), refuses a bad one in one line before anything is written, and really
works on the ledger it names: a SQLite file elsewhere gives what the data dir's embedded store gives."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from test_cli_errors import COMMANDS, call, one_error_line
from testdata import DATA_ROOT, measure_jobs_3_and_999

from gpuledger.collector.ledger_url import ENV_NAME, ledger_fingerprint
from gpuledger.collector.store import open_store

# Commands that never touch the ledger: the node agent, the dashboards, and the demo (its own embedded store).
NO_LEDGER = {("agent", "once"), ("agent", "run"), ("agent", "sources"), ("dashboards", "export"), ("demo",)}
LEDGER_COMMANDS = [c for c in COMMANDS if c not in NO_LEDGER]
# what a command needs besides options to get as far as its ledger
ARGS = {("collector", "series"): ("h", "u", "--start", "-60"), ("report", "job"): ("1",), ("audit", "explain"): ("1",)}


def test_the_commands_without_a_ledger_exist() -> None:
    assert NO_LEDGER <= set(COMMANDS) and len(LEDGER_COMMANDS) >= 22


@pytest.mark.parametrize("path", LEDGER_COMMANDS, ids=" ".join)
def test_every_ledger_command_takes_the_url_and_refuses_a_bad_one(capsys, monkeypatch, tmp_path: Path,
                                                                   path: tuple[str, ...]) -> None:
    code, out, _ = call(capsys, *path, "--help")
    assert code == 0 and "--ledger-url URL" in out and ENV_NAME in out
    data = tmp_path / "data"
    argv = (*path, *ARGS.get(path, ()), "--data-dir", data)
    code, out, err = call(capsys, *argv, "--ledger-url", "mysql://gpuledger:pw@db/ledger")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert "--ledger-url: unknown scheme 'mysql'" in line and ":pw@" not in line
    monkeypatch.setenv(ENV_NAME, "")
    code, out, err = call(capsys, *argv)
    assert code == 2 and f"{ENV_NAME}: empty ledger URL" in one_error_line(err)
    monkeypatch.delenv(ENV_NAME)
    cfg = tmp_path / "etc" / "gpuledger.toml"
    cfg.parent.mkdir()
    cfg.write_text('[ledger]\nurl = "oracle://db"\n')
    code, out, err = call(capsys, *argv, "--config", cfg)
    assert code == 2 and f"{cfg}: ledger.url: unknown scheme 'oracle'" in one_error_line(err)
    assert not data.exists()  # refused before anything was written


# -- the same pipeline on two ledgers ----------------------------------------------------------------------------
REAL = DATA_ROOT / "slurm" / "real-22.05"
CONFIG = """\
[accounting]
half_life_s = 0                # no decay: the fairshare does not depend on when it runs
[accounts.proj_a]
shares = 60
[accounts.proj_a.users]
alice = 1
bob = 1
[accounts.proj_a_ml]
shares = 10
[accounts.proj_a_ml.users]
dave = 1
[accounts.proj_b]
shares = 30
[accounts.proj_b.users]
alice = 1
carol = 1
erin = 1
"""


def ended_jobs(tmp_path: Path) -> Path:
    """The real sacct capture without its running jobs (their allocation grows with the clock)."""
    lines = (REAL / "sacct-a-P-S-today.txt").read_text().splitlines()
    end = lines[0].split("|").index("End")
    out = tmp_path / "sacct-ended.txt"
    out.write_text("\n".join([lines[0]] + [ln for ln in lines[1:] if ln.split("|")[end] != "Unknown"]) + "\n")
    return out


def measure(ledger_url: str | None, data_dir: Path) -> None:
    """Samples of job 3 (Slurm's) and job 999 (an agent's only) into the ledger, as a collector stores them."""
    store = open_store(ledger_url, data_dir)
    try:
        measure_jobs_3_and_999(store)
    finally:
        store.close()


def pipeline(capsys, tmp_path: Path, data_dir: Path, ledger: tuple[str | Path, ...]) -> dict[str, object]:
    """jobs import -> measurements -> fairshare -> priority feed -> report usage -> audit verify --store, through
    the CLI with ``ledger`` (``--ledger-url URL`` or nothing); what each printed that does not depend on time."""
    data_dir.mkdir()
    (data_dir / "gpuledger.toml").write_text(CONFIG)
    d = ("--data-dir", data_dir, *ledger)
    code, out, err = call(capsys, "jobs", "import", *d, "--sacct-parsable", ended_jobs(tmp_path))
    assert code == 0, err
    imported = out
    measure(str(ledger[1]) if ledger else None, data_dir)
    results: dict[str, object] = {"import": imported}
    for name, argv in [("jobs", ("jobs", "list", "--format", "json")),
                       ("fairshare", ("fairshare", "--format", "json", "--record")),
                       ("feed", ("priority", "feed", "--format", "json")),
                       ("usage", ("report", "usage", "--period", "2026-11", "--format", "json")),
                       ("reconcile", ("report", "reconcile", "--period", "2026-11", "--format", "json")),
                       ("job", ("report", "job", "3", "--format", "json"))]:
        code, out, err = call(capsys, *argv, *d)
        assert code == 0, (argv, err)
        results[name] = json.loads(out)
    results["feed"] = results["feed"]["associations"]  # without its generated_at
    code, out, err = call(capsys, "audit", "verify", "--store", *d)
    assert code == 0, out + err
    assert "Merkle tree intact" in out and "store: every job and usage record matches its logged record" in out
    results["audit entries"] = out.split(": ")[1].split(",")[0]  # "N entries"
    return results


def test_a_sqlite_ledger_url_is_the_ledger_the_commands_use(capsys, tmp_path: Path) -> None:
    embedded = pipeline(capsys, tmp_path, tmp_path / "embedded", ())
    ledger = tmp_path / "shared" / "ledger.sqlite"
    ledger.parent.mkdir()
    elsewhere = pipeline(capsys, tmp_path, tmp_path / "data", ("--ledger-url", ledger))
    assert elsewhere == embedded
    assert embedded["feed"] and embedded["usage"]["total"]["jobs"] > 0
    assert {j["job_id"]: j["seen_by"] for j in embedded["jobs"]}["3"] == "both"
    # the ledger is the named file; the data dir keeps the audit log, the feed and the pseudonym key
    assert ledger.exists() and not (tmp_path / "data" / "gpuledger.sqlite").exists()
    assert (tmp_path / "data" / "audit.sqlite").exists() and (tmp_path / "data" / "priority-feed.json").exists()
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] > 0

    # the environment variable and the [ledger] table (relative to its file) name the same ledger
    d = tmp_path / "data"
    code, out, err = call(capsys, "collector", "usage", "--data-dir", d, "--format", "json")
    assert code == 2 and f"no gpuledger store at {d / 'gpuledger.sqlite'}" in one_error_line(err)
    code, by_flag, _ = call(capsys, "collector", "usage", "--data-dir", d, "--format", "json", "--ledger-url", ledger)
    assert code == 0 and {u["job_id"] for u in json.loads(by_flag)} == {"3", "999"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_NAME, f"sqlite://{ledger}")
        code, by_env, _ = call(capsys, "collector", "usage", "--data-dir", d, "--format", "json")
    assert code == 0 and by_env == by_flag
    (d / "gpuledger.toml").write_text(CONFIG + '[ledger]\nurl = "../shared/ledger.sqlite"\n')
    code, by_file, _ = call(capsys, "collector", "usage", "--data-dir", d, "--format", "json")
    assert code == 0 and by_file == by_flag
    code, out, err = call(capsys, "collector", "totals", "--data-dir", d)
    assert code == 0 and json.loads(out)["samples"] == 5
    # retention rewrites the named ledger's records
    code, out, err = call(capsys, "audit", "retention", "--data-dir", d, "--days", "0", "--force")
    assert code == 0 and "pseudonymized" in out and not out.startswith("pseudonymized 0 "), out + err
    with sqlite3.connect(ledger) as db:
        users = {json.loads(r[0]).get("user") for r in db.execute("SELECT data FROM jobs")}
    assert "carol" not in users and "alice" not in users


def test_a_postgresql_ledger_gives_what_the_embedded_store_gives(capsys, tmp_path: Path, pg_url: str) -> None:
    embedded = pipeline(capsys, tmp_path, tmp_path / "embedded", ())
    on_postgres = pipeline(capsys, tmp_path, tmp_path / "data", ("--ledger-url", pg_url))
    assert on_postgres == embedded
    d = ("--data-dir", tmp_path / "data", "--ledger-url", pg_url)
    for argv in [("collector", "usage", "--format", "json"), ("collector", "totals"), ("collector", "compact"),
                 ("collector", "series", "vm", "GPU-0", "--start", "1795969300", "--end", "1795969500")]:
        code, pg_out, err = call(capsys, *argv, *d)
        code_e, sqlite_out, err_e = call(capsys, *argv, "--data-dir", tmp_path / "embedded")
        assert code == code_e == 0, err + err_e
        if argv[1] in ("totals", "compact"):  # sizes are the SQLite file's; compactions ran at their own times
            pg_out, sqlite_out = (json.loads(o) | {"size_bytes": None, "last_compaction": None}
                                  for o in (pg_out, sqlite_out))
        assert pg_out == sqlite_out, argv
    newest_batch, jobs = ledger_fingerprint(pg_url, tmp_path)  # what priority watch polls on this ledger
    assert newest_batch is not None and jobs == len(embedded["jobs"]) - 1  # 999: no record
    code, out, err = call(capsys, "audit", "retention", "--days", "0", "--force", *d)
    assert code == 0 and not out.startswith("pseudonymized 0 "), out + err
    code, out, _ = call(capsys, "jobs", "list", "--format", "json", *d)
    assert not {j["user"] for j in json.loads(out)} & {"alice", "bob", "carol"}
    assert not (tmp_path / "data" / "gpuledger.sqlite").exists()
