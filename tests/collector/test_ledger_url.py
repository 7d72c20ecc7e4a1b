"""collector.ledger_url: which ledger a command uses (--ledger-url > GPULEDGER_LEDGER_URL > [ledger] url > the
embedded store), what a bad URL says, and that a query never creates a ledger (SQLite and a real PostgreSQL)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer

from gpuledger.cli import run
from gpuledger.collector.config import ConfigError, load_settings
from gpuledger.collector.db import _startup, open_database
from gpuledger.collector.ledger_url import (
    ENV_NAME,
    LedgerUrlError,
    ledger_exists,
    ledger_fingerprint,
    ledger_label,
    open_ledger,
    resolve_ledger_url,
)

PG = "postgresql://gpuledger@db.example.org:5432/ledger"


def _config(d: Path, text: str, name: str = "gpuledger.toml") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)
    return d / name


def test_precedence_flag_then_environment_then_file_then_embedded(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert resolve_ledger_url(None, data, env={}) is None  # no file at all: the embedded store
    _config(data, '[ledger]\nurl = "postgresql://file/ledger"\n')
    env = {ENV_NAME: "postgresql://env/ledger"}
    assert resolve_ledger_url("postgresql://flag/ledger", data, env=env) == "postgresql://flag/ledger"
    assert resolve_ledger_url(None, data, env=env) == "postgresql://env/ledger"
    assert resolve_ledger_url(None, data, env={}) == "postgresql://file/ledger"
    # --config replaces the data dir's file
    other = _config(tmp_path / "etc", f'[ledger]\nurl = "{PG}"\n')
    assert resolve_ledger_url(None, data, other, env={}) == PG
    # a file without the table, or the table without url: embedded
    assert resolve_ledger_url(None, data, _config(tmp_path / "a", "[collector]\nport = 1\n"), env={}) is None
    assert resolve_ledger_url(None, data, _config(tmp_path / "b", "[ledger]\n"), env={}) is None


def test_sqlite_paths(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # in the file: relative to the file; sqlite:// is the same path
    _config(data, '[ledger]\nurl = "../shared/ledger.sqlite"\n')
    assert resolve_ledger_url(None, data, env={}) == str(data / "../shared/ledger.sqlite")
    cfg = _config(tmp_path / "etc", '[ledger]\nurl = "sqlite://ledger.sqlite"\n')
    assert resolve_ledger_url(None, data, cfg, env={}) == str(tmp_path / "etc" / "ledger.sqlite")
    # from the flag or the environment: relative to the working directory, absolute kept
    assert resolve_ledger_url("rel/ledger.sqlite", data, env={}) == "rel/ledger.sqlite"
    assert resolve_ledger_url(None, data, env={ENV_NAME: "sqlite:///abs/l.sqlite"}) == "/abs/l.sqlite"
    assert resolve_ledger_url(f"{tmp_path}/x.sqlite", data, env={}) == f"{tmp_path}/x.sqlite"
    assert resolve_ledger_url("postgres://h/db", data, env={}) == "postgres://h/db"


def test_libpq_host_lists() -> None:
    """A primary and its standbys, tried in turn by libpq (``target_session_attrs`` picks the writable one)."""
    for url in ("postgresql://u:pw@db1:5432,db2:5433/gl?target_session_attrs=read-write",
                "postgresql://db1,db2/gl", "postgresql://[::1]:5432,[fe80::1]/gl"):
        assert resolve_ledger_url(url, Path("."), env={}) == url


@pytest.mark.parametrize(("flag", "env", "config", "needle"), [
    ("", None, None, "--ledger-url: empty ledger URL"),
    ("  ", None, None, "--ledger-url: empty ledger URL"),
    ("sqlite://", None, None, "--ledger-url: empty ledger URL"),
    (None, "", None, f"{ENV_NAME}: empty ledger URL"),
    (None, None, '[ledger]\nurl = ""\n', "gpuledger.toml: ledger.url: empty ledger URL"),
    ("mysql://u@h/db", None, None, "--ledger-url: unknown scheme 'mysql' in ledger URL mysql://u@h/db"),
    (None, "http://h/db", None, f"{ENV_NAME}: unknown scheme 'http'"),
    (None, None, '[ledger]\nurl = "mariadb://h/db"\n', "gpuledger.toml: ledger.url: unknown scheme 'mariadb'"),
    ("postgresql://h:port/db", None, None, "--ledger-url: bad port in ledger URL"),
    ("postgresql://h1:5432,h2:99999/db", None, None, "--ledger-url: bad port in ledger URL"),
    ("postgresql://[::1]:x/db", None, None, "--ledger-url: bad port in ledger URL"),
    (None, None, 'ledger = "postgresql://h/db"\n', "gpuledger.toml: [ledger] must be a table"),
    (None, None, '[ledger]\nurl = 5\n', "gpuledger.toml: ledger.url: must be a string"),
    (None, None, '[ledger]\nuri = "postgresql://h/db"\n', "gpuledger.toml: ledger.uri: unknown setting"),
])
def test_bad_urls_name_their_source(tmp_path: Path, flag, env, config, needle) -> None:
    if config is not None:
        _config(tmp_path, config)
    with pytest.raises(LedgerUrlError) as e:
        resolve_ledger_url(flag, tmp_path, env={} if env is None else {ENV_NAME: env})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_passwords_stay_out_of_messages(tmp_path: Path) -> None:
    with pytest.raises(LedgerUrlError) as e:
        resolve_ledger_url("mysql://gpuledger:hunter22@h/db", tmp_path, env={})
    assert "hunter22" not in str(e.value) and "gpuledger:***@h" in str(e.value)
    assert "hunter22" not in ledger_label("postgresql://gpuledger:hunter22@h/db", tmp_path)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="configuration file not found"):
        resolve_ledger_url(None, tmp_path, tmp_path / "missing.toml", env={})
    _config(tmp_path, "[ledger\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        resolve_ledger_url(None, tmp_path, env={})
    # the file is only read when neither the flag nor the environment decides
    assert resolve_ledger_url(None, tmp_path, env={ENV_NAME: PG}) == PG


def test_the_collector_config_takes_the_ledger_table(tmp_path: Path) -> None:
    cfg = _config(tmp_path, f'cluster = "c"\n[collector]\nport = 8471\n[ledger]\nurl = "{PG}"\n'
                            '[accounting]\npolicy = "active"\n')
    assert load_settings(tmp_path, cfg, env={}).port == 8471
    assert resolve_ledger_url(None, tmp_path, cfg, env={}) == PG


def test_a_query_never_creates_a_sqlite_ledger(tmp_path: Path, capsys) -> None:
    path = tmp_path / "l.sqlite"
    assert not ledger_exists(str(path), tmp_path)
    with pytest.raises(typer.Exit) as e:
        open_ledger(str(path), tmp_path)
    assert e.value.exit_code == 2 and not path.exists()
    assert f"no gpuledger store at {path}" in capsys.readouterr().err
    with pytest.raises(typer.Exit) as e:
        open_ledger(str(tmp_path / "no-dir" / "l.sqlite"), tmp_path, create=True)
    assert e.value.exit_code == 2 and f"no directory {tmp_path / 'no-dir'}" in capsys.readouterr().err
    open_ledger(str(path), tmp_path, create=True).close()
    assert ledger_exists(str(path), tmp_path) and not (tmp_path / "gpuledger.sqlite").exists()
    open_ledger(str(path), tmp_path).close()


def test_postgres_without_tables_is_not_a_ledger_and_stays_empty(pg_url: str, tmp_path: Path, capsys) -> None:
    assert not ledger_exists(pg_url, tmp_path)
    with pytest.raises(typer.Exit) as e:
        open_ledger(pg_url, tmp_path)
    err = capsys.readouterr().err
    assert e.value.exit_code == 2 and err.count("\n") == 1
    assert "not a gpuledger ledger (run `gpuledger ledger migrate` or a collector first)" in err
    db = open_database(pg_url)
    try:
        assert db.execute("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = current_schema()"
                          ).fetchone()[0] == 0
        db.script("CREATE TABLE jobs (job_id TEXT)")
    finally:
        db.close()
    assert ledger_exists(pg_url, tmp_path)


def test_an_unreachable_postgres_is_one_line_exit_1(tmp_path: Path, capsys) -> None:
    with pytest.raises(typer.Exit) as e:
        open_ledger("postgresql://gpuledger:secret@127.0.0.1:1/ledger", tmp_path)
    err = capsys.readouterr().err
    assert e.value.exit_code == 1 and err.count("\n") == 1 and err.startswith("error: ")
    assert "127.0.0.1:1" in err and "secret" not in err


def test_the_fingerprint_changes_when_jobs_or_batches_are_written(tmp_path: Path, pg_url: str) -> None:
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample, JobRecord

    # SQLite: the file and its WAL
    store = open_ledger(None, tmp_path, create=True)
    try:
        before = ledger_fingerprint(None, tmp_path)
        assert ledger_fingerprint(None, tmp_path) == before
        store.put_jobs([JobRecord(job_id="1", user="u", account="a", start=1.0, end=2.0)])
        after_job = ledger_fingerprint(None, tmp_path)
        store.ingest(Batch("a", 0, "n1", (GpuSample(ts=10.0, host="n1", gpu_uuid="G0", gpu_index=0, job_ids=("1",)),)))
        assert len({before, after_job, ledger_fingerprint(None, tmp_path)}) == 3
    finally:
        store.close()
    # PostgreSQL: the newest batch key and the number of job records (the ledger's own tables, made here by hand)
    db = open_database(pg_url)
    try:
        db.script("CREATE TABLE jobs (cluster TEXT, job_id TEXT, source TEXT, data TEXT);"
                  "CREATE TABLE batch_keys (host TEXT, agent_id TEXT, seq INTEGER, digest BLOB, received REAL, "
                  "samples INTEGER)")
        states = [ledger_fingerprint(pg_url, tmp_path)]
        db.execute("INSERT INTO jobs VALUES ('c', '1', 'slurm', '{}')")
        states.append(ledger_fingerprint(pg_url, tmp_path))
        db.execute("INSERT INTO batch_keys VALUES ('n1', 'a', 0, NULL, 100.5, 1)")
        states.append(ledger_fingerprint(pg_url, tmp_path))
        assert states == [(None, 0), (None, 1), (100.5, 1)]
    finally:
        db.close()


@pytest.fixture(scope="module")
def german_postgres(tmp_path_factory):
    """A PostgreSQL cluster whose messages are German, as one with lc_messages = 'de_DE.UTF-8' (gettext takes the
    language from LANGUAGE under any lc_messages but C, so no de_DE locale need be installed), with a role gl_pw that
    logs in by password; skipped where PostgreSQL's translations are not installed."""
    from servers import PostgresServer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("LANGUAGE", "de")  # the server's environment: pg_ctl passes it on
        with PostgresServer(tmp_path_factory.mktemp("pg_de")) as server:
            env.delenv("LANGUAGE")
            server.psql("ALTER SYSTEM SET lc_messages = 'C.UTF-8'")
            hba = server.workdir / "pg" / "pg_hba.conf"
            hba.write_text("host all gl_pw 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
            server.psql("CREATE ROLE gl_pw LOGIN PASSWORD 'right-one'")
            server.psql("SELECT pg_reload_conf()")
            refused = _startup(server.url_for("nosuchdb"), {}, 10.0)
            if refused is None or "existiert nicht" not in refused[1]:
                pytest.skip(f"PostgreSQL speaks no German here (no translations installed?): {refused}")
            yield server


def test_a_refusal_in_the_servers_language_is_a_configuration_error_by_its_sqlstate(german_postgres, tmp_path,
                                                                                  capsys) -> None:
    """No such database, no such role, a wrong password, from a server whose messages are German: decided by the
    SQLSTATE of the server's refusal, not its words, so exit 2 as from an English one; a server down stays exit 1."""
    pg = german_postgres
    cases = [(pg.url_for("nosuchdb"), "3D000", "no such database", "existiert nicht"),
             (pg.url.replace("//gl@", "//nobody@"), "28000", "no such role", "existiert nicht"),
             (pg.url.replace("//gl@", "//gl_pw:wrong-one@"), "28P01", "refused the credentials", "fehlgeschlagen")]
    for url, sqlstate, problem, german in cases:
        refused = _startup(url, {}, 10.0)
        assert refused is not None and refused[0] == sqlstate and german in refused[1], refused
        for argv in (("ledger", "status"), ("collector", "usage", "--data-dir", tmp_path)):
            code = run([*map(str, argv), "--ledger-url", url])
            out, err = capsys.readouterr()
            assert (code, out, err.count("\n")) == (2, "", 1), (argv, url, err)
            assert problem in err and german in err and "wrong-one" not in err, err
    assert _startup(pg.url, {}, 10.0) is None  # a URL it accepts connects
    pg.stop()
    code = run(["ledger", "status", "--ledger-url", pg.url])
    assert code == 1 and "cannot connect" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
