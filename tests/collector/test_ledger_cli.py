"""``gpuledger ledger status|migrate`` on both engines, through the `gpuledger` entry point: where a ledger stands,
bringing it up to date (an old SQLite store without losing data), and the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port

from gpuledger.cli import run
from gpuledger.collector.migrations import LATEST, MIGRATIONS
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

T0 = 1_700_000_000.0
ALL = list(range(1, LATEST + 1))


def call(capsys, *argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def cli(*argv) -> subprocess.CompletedProcess[str]:
    """The real command line in a process of its own (it opens and closes the ledger as a user's command does)."""
    return subprocess.run([sys.executable, "-m", "gpuledger.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=120)


def status(capsys, *where) -> dict:
    code, out, err = call(capsys, "ledger", "status", *where, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def old_store(path: Path) -> list:
    """A store as the release before versioned migrations left it (no schema_migrations, no hosts); its usage."""
    store = Store(path)
    store.ingest(Batch("a", 1, "n1", tuple(GpuSample(ts=T0 + 10 * k, host="n1", gpu_uuid="G0", gpu_index=0,
                                                     energy_joules=100.0 * k, job_ids=("1",)) for k in range(6))))
    store.put_jobs([JobRecord("1", cluster="c", user="ann")])
    usage = store.job_usage(per_gpu=True)
    store.db.execute("DROP TABLE schema_migrations")
    store.db.execute("DROP TABLE hosts")
    store.db.execute("UPDATE meta SET value='3' WHERE key='schema'")
    store.close()
    return usage


def test_status_and_migrate_on_a_fresh_postgresql_database(capsys, postgres_server):
    url = postgres_server.new_database()
    with_password = url.replace("gl@", "gl:s3cret@")  # trust auth: the password is ignored, and never shown
    st = status(capsys, "--ledger-url", with_password)
    assert (st["backend"], st["applied"], st["pending"], st["newer"]) == ("postgresql", [], ALL, [])
    assert "s3cret" not in json.dumps(st) and st["url"] == with_password.replace("s3cret", "***")
    code, out, err = call(capsys, "ledger", "migrate", "--ledger-url", with_password)
    assert code == 0 and "s3cret" not in out + err
    assert [line for line in out.splitlines() if line.startswith("applied")] == [
        f"applied {m.version}: {m.name}" for m in MIGRATIONS]
    code, out, err = call(capsys, "ledger", "migrate", "--ledger-url", url)
    assert code == 0 and out.strip().endswith(f"up to date (migration {LATEST})")
    st = status(capsys, "--ledger-url", url)
    assert (st["applied"], st["pending"]) == (ALL, [])
    Store(url).close()  # a collector opens it as it is
    code, out, err = call(capsys, "ledger", "status", "--ledger-url", url)
    assert code == 0 and "backend  postgresql" in out and out.count("applied") >= LATEST


def test_migrate_brings_an_old_sqlite_store_under_migrations_without_losing_data(capsys, tmp_path):
    usage = old_store(tmp_path / "gpuledger.sqlite")
    st = status(capsys, "--data-dir", tmp_path)
    assert (st["backend"], st["applied"], st["pending"], st["meta_format"]) == ("sqlite", [], ALL, 3)
    code, out, err = call(capsys, "ledger", "migrate", "--data-dir", tmp_path, "--format", "json")
    assert code == 0 and [m["version"] for m in json.loads(out)["applied"]] == ALL
    st = status(capsys, "--ledger-url", tmp_path / "gpuledger.sqlite")
    # format 4: the releases before versioned migrations read 1-3 only, so a rollback to one refuses this ledger
    # rather than write to tables whose migrations it does not know
    assert (st["applied"], st["meta_format"]) == (ALL, 4)
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        assert store.job_usage(per_gpu=True) == usage and [j.user for j in store.jobs()] == ["ann"]
    finally:
        store.close()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_a_ledger_of_a_newer_gpuledger_is_shown_and_refused(capsys, tmp_path, engine, request):
    url = str(tmp_path / "s.sqlite") if engine == "sqlite" else request.getfixturevalue("pg_url")
    store = Store(url)
    store.db.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, 'later', ?)",
                     (LATEST + 1, T0))
    store.close()
    st = status(capsys, "--ledger-url", url)
    assert st["newer"] == [LATEST + 1] and st["pending"] == []
    code, out, err = call(capsys, "ledger", "status", "--ledger-url", url)
    assert code == 0 and "written by a newer gpuledger" in out
    code, out, err = call(capsys, "ledger", "migrate", "--ledger-url", url)
    assert code == 2 and out == "" and f"has migration {LATEST + 1}" in one_error_line(err)


def test_errors_are_one_line_exit_2_for_bad_input_and_1_for_an_unreachable_server(capsys, tmp_path):
    for argv, want, needle in [
        (("--data-dir", tmp_path / "nowhere"), 2, "no gpuledger store at"),
        (("--ledger-url", "mysql://db/ledger"), 2, "unknown scheme"),
        (("--ledger-url", f"postgresql://gl@127.0.0.1:{free_port()}/ledger"), 1, "cannot connect"),
    ]:
        for command in ("status", "migrate"):
            code, out, err = call(capsys, "ledger", command, *argv)
            assert (code, out) == (want, ""), (argv, err)
            assert needle in one_error_line(err), err
    assert not (tmp_path / "nowhere").exists()  # neither command makes a store


@pytest.fixture
def password_role(postgres_server):
    """A role the session's PostgreSQL authenticates by password (SCRAM; the cluster trusts every other role):
    its URL with the wrong password. pg_hba.conf gets one line for it, removed again."""
    hba = postgres_server.workdir / "pg" / "pg_hba.conf"
    before = hba.read_text()
    hba.write_text("host all gl_pw 127.0.0.1/32 scram-sha-256\n" + before)
    postgres_server.psql("CREATE ROLE gl_pw LOGIN PASSWORD 'right-one'")
    postgres_server.psql("SELECT pg_reload_conf()")
    try:
        yield postgres_server.url_for("postgres").replace("//gl@", "//gl_pw:wrong-one@")
    finally:
        hba.write_text(before)
        postgres_server.psql("SELECT pg_reload_conf()")
        postgres_server.psql("DROP ROLE gl_pw")


def test_a_server_that_refuses_the_url_is_a_configuration_error_exit_2_for_every_command(capsys, tmp_path,
                                                                                         postgres_server,
                                                                                         password_role):
    """No such database, no such role, a wrong password: one line naming the ledger (never its password) and the
    problem, exit 2, whichever command opens the ledger; a restart cannot fix it, and the collector's systemd unit
    does not restart on 2 (RestartPreventExitStatus=2). A server that is down stays exit 1."""
    unit = Path(__file__).parents[2] / "contrib" / "systemd" / "gpuledger-collector.service"
    assert "RestartPreventExitStatus=2" in unit.read_text().split()
    cases = [(postgres_server.url_for("nosuchdb"), "no such database"),
             (postgres_server.url_for("postgres").replace("//gl@", "//nobody@"), "no such role"),
             (password_role, "refused the credentials")]
    commands = [("ledger", "status"), ("ledger", "migrate"), ("collector", "usage", "--data-dir", tmp_path),
                ("collector", "serve", "--data-dir", tmp_path, "--port", "0")]
    for url, problem in cases:
        for command in commands:
            code, out, err = call(capsys, *command, "--ledger-url", url)
            line = one_error_line(err)
            assert (code, out) == (2, ""), (command, url, err)
            assert problem in line and url.replace(":wrong-one@", ":***@") in line, line
            assert "wrong-one" not in line
    code, out, err = call(capsys, "collector", "serve", "--data-dir", tmp_path, "--port", "0",
                          "--ledger-url", f"postgresql://gl@127.0.0.1:{free_port()}/ledger")
    assert code == 1 and "cannot connect" in one_error_line(err)


def _files(where: Path) -> dict[str, tuple[bytes, int]]:
    """Every file in ``where``: its bytes and mtime (ns)."""
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(where.iterdir())}


def _collector_ledger(path: Path) -> Store:
    """A WAL ledger as a collector writes it (a batch and a job record), left open: a collector still running."""
    store = Store(path)
    store.ingest(Batch("a", 1, "n1", (GpuSample(ts=T0, host="n1", gpu_uuid="G0", gpu_index=0, energy_joules=1.0,
                                                job_ids=("1",)),)))
    store.put_jobs([JobRecord("1", cluster="c", user="ann")])
    return store


@pytest.fixture
def read_only_mount(tmp_path):
    """(a directory, a read-only bind mount of it): what a user sees who may only read the ledger (root included,
    whom chmod does not stop). Needs root (mount), as in CI."""
    src, view = tmp_path / "rw", tmp_path / "ro"
    src.mkdir()
    view.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True).returncode:
        pytest.skip("a bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        yield src, view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=True)


def test_status_never_writes_a_sqlite_ledger_it_may_only_read(tmp_path, read_only_mount):
    """An auditor's copy (file 0444 in a 0555 directory) and a read-only mount, of a ledger the collector closed and
    of one it still has open (its -wal and -shm beside it): status reads it, and changes and creates nothing there
    (as root chmod stops nothing: the files' bytes and mtimes are compared, and a read-only mount refuses root)."""
    src, view = read_only_mount
    store = _collector_ledger(src / "gpuledger.sqlite")
    store.close()  # the collector stopped: no -wal, no -shm
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "gpuledger.sqlite").write_bytes((src / "gpuledger.sqlite").read_bytes())
    (audit / "gpuledger.sqlite").chmod(0o444)
    audit.chmod(0o555)
    try:
        for where in (audit, view):
            before = _files(where)
            r = cli("ledger", "status", "--data-dir", where, "--format", "json")
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["applied"] == ALL and _files(where) == before, where
    finally:
        audit.chmod(0o755)
    store = _collector_ledger(src / "gpuledger.sqlite")  # a collector running: it keeps -wal and -shm
    try:
        assert {"gpuledger.sqlite-wal", "gpuledger.sqlite-shm"} <= set(_files(src))
        before = _files(src)
        r = cli("ledger", "status", "--ledger-url", view / "gpuledger.sqlite", "--format", "json")
        assert r.returncode == 0 and json.loads(r.stdout)["applied"] == ALL, r.stderr
        assert _files(src) == before
        with store.db.transaction():  # the collector's next write does not wait for the status query
            store.db.execute("INSERT INTO meta (key, value) VALUES ('probe', '1')")
    finally:
        store.close()


def test_status_of_no_ledger_names_the_path_and_creates_nothing(tmp_path):
    for argv, where in [(("--data-dir", tmp_path), tmp_path / "gpuledger.sqlite"),
                        (("--ledger-url", tmp_path / "x.sqlite"), tmp_path / "x.sqlite")]:
        r = cli("ledger", "status", *argv)
        assert (r.returncode, r.stdout) == (2, "") and r.stderr.count("\n") == 1, r.stderr
        assert f"no gpuledger store at {where}" in r.stderr
    assert list(tmp_path.iterdir()) == []
