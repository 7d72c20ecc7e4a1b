"""A ledger or audit log that exists but cannot be opened, through the `gpuledger` entry point: a file that is not a
database, a ledger of a newer gpuledger, a file this user may not write (which ``ledger status``, a query that never
writes, reads: tests/collector/test_ledger_cli.py). Each is one line naming the file and why,
exit 2 (what systemd's RestartPreventExitStatus=2 keeps from restarting for ever), never "unexpected ...", and the
file is left as it was.

"Read-only" runs as root too (where chmod changes nothing): SQLite's own read-only mode (``mode=ro``) opens the
file, which is what SQLite does by itself with a file its user may not write.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpuledger.cli import run
from gpuledger.collector.migrations import LATEST
from gpuledger.collector.store import Store

SACCT = Path(__file__).resolve().parents[1] / "data" / "slurm" / "sacct-json-23.02.6.json"
# Commands that open the ledger: queries, the schema's status, and the collector (port 0: never a fixed one).
OPENERS = [("report", "usage"), ("jobs", "list"), ("collector", "usage"), ("ledger", "status"),
           ("collector", "serve", "--port", "0")]


def call(capsys, *argv) -> tuple[int, str, str]:
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "unexpected" not in err, out + err
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def read_only(monkeypatch):
    """read_only(path): SQLite opens that file read-only from now on (``mode=ro``), as it does a file whose user
    may not write it (or its directory: the WAL's -shm file cannot be made)."""
    real = sqlite3.connect
    paths: set[str] = set()

    def connect(database, *args, **kwargs):
        if str(database) in paths:
            return real(f"file:{database}?mode=ro", *args, uri=True, **kwargs)
        return real(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    return lambda path: paths.add(str(path))


def imported(capsys, data_dir: Path) -> Path:
    """A data dir as an operator makes one: Slurm's records imported (the ledger and its audit log)."""
    code, _, err = call(capsys, "jobs", "import", "--data-dir", data_dir, "--sacct-json", SACCT)
    assert code == 0, err
    return data_dir


@pytest.mark.parametrize("argv", OPENERS, ids=" ".join)
def test_a_file_that_is_not_a_database(capsys, tmp_path: Path, argv) -> None:
    store = tmp_path / "gpuledger.sqlite"
    store.write_bytes(b"not a database " * 300)
    code, out, err = call(capsys, *argv, "--data-dir", tmp_path)
    assert (code, out) == (2, "")
    assert f"{store}: not a gpuledger ledger (file is not a database)" in one_error_line(err)
    assert store.read_bytes() == b"not a database " * 300


@pytest.mark.parametrize("argv", [a for a in OPENERS if a != ("ledger", "status")], ids=" ".join)
def test_a_ledger_of_a_newer_gpuledger(capsys, tmp_path: Path, argv) -> None:
    # (`ledger status` shows such a ledger: tests/collector/test_ledger_cli.py)
    store = Store(tmp_path / "gpuledger.sqlite")
    store.db.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, 'later', 0)", (LATEST + 1,))
    store.close()
    code, out, err = call(capsys, *argv, "--data-dir", tmp_path)
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert str(tmp_path / "gpuledger.sqlite") in line and f"has migration {LATEST + 1}" in line
    assert "upgrade gpuledger" in line


def _read_only_journal(path: Path, read_only) -> bytes:
    """``path`` as a rollback-journal file, then read-only to this user; its bytes. Switching it to WAL, as every
    command does first, is a write, refused where the user may not write (a WAL file fails the same way when its
    -shm file cannot be created beside it)."""
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA journal_mode=DELETE")
    before = path.read_bytes()
    read_only(path)
    return before


@pytest.mark.parametrize("argv", [a for a in OPENERS if a != ("ledger", "status")], ids=" ".join)
def test_a_ledger_this_user_may_not_write(capsys, tmp_path: Path, read_only, argv) -> None:
    data = imported(capsys, tmp_path / "data")
    store = data / "gpuledger.sqlite"
    before = _read_only_journal(store, read_only)
    code, out, err = call(capsys, *argv, "--data-dir", data)
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert f"cannot write {store}: permission denied" in line and "read-only" in line
    assert store.read_bytes() == before


def test_ledger_status_reads_a_ledger_this_user_may_not_write(capsys, tmp_path: Path, read_only) -> None:
    data = imported(capsys, tmp_path / "data")
    store = data / "gpuledger.sqlite"
    before = _read_only_journal(store, read_only)
    code, out, err = call(capsys, "ledger", "status", "--data-dir", data)
    assert (code, err) == (0, "") and "backend  sqlite" in out
    assert store.read_bytes() == before


def test_an_audit_log_this_user_may_not_write_is_not_called_damaged(capsys, tmp_path: Path, read_only) -> None:
    data = imported(capsys, tmp_path / "data")
    audit = data / "audit.sqlite"
    before = _read_only_journal(audit, read_only)
    for argv in (("jobs", "import", "--sacct-json", SACCT), ("audit", "verify"), ("collector", "serve", "--port", "0")):
        code, out, err = call(capsys, *argv, "--data-dir", data)
        assert (code, out) == (2, ""), argv
        line = one_error_line(err)
        assert f"cannot write {audit}: permission denied" in line and "not an audit log" not in line, argv
    assert audit.read_bytes() == before


def test_an_audit_log_that_is_not_a_database_is_said_so(capsys, tmp_path: Path) -> None:
    (tmp_path / "audit.sqlite").write_bytes(b"not a database " * 300)
    code, out, err = call(capsys, "jobs", "import", "--data-dir", tmp_path, "--sacct-json", SACCT)
    assert (code, out) == (2, "")
    assert f"{tmp_path / 'audit.sqlite'}: not an audit log (file is not a database)" in one_error_line(err)
