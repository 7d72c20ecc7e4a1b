"""One pseudonymization key per ledger: collectors and commands sharing a PostgreSQL ledger, each from its own data
dir, pseudonymize a user alike (the key lives in the ledger's database); the embedded ledger keeps the data dir's
key file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuledger.collector.auditlog.jobs import job_data, job_key, open_log
from gpuledger.collector.pseudonym import KEY_NAME, Pseudonymizer, ledger_key, load_or_create_key
from gpuledger.schema.records import JobRecord


def test_data_dirs_sharing_a_postgresql_ledger_share_its_key(pg_url: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    key = ledger_key(pg_url, a)
    assert len(key) == 32 and ledger_key(pg_url, b) == key
    assert Pseudonymizer.for_ledger(pg_url, a)("alice") == Pseudonymizer.for_ledger(pg_url, b)("alice")
    assert not (a / KEY_NAME).exists() and not (b / KEY_NAME).exists()  # nothing secret left in a data dir


def test_the_first_user_of_a_postgresql_ledger_brings_its_key_file(pg_url: str, tmp_path: Path) -> None:
    """A site that ran one collector with a key file keeps its pseudonyms when the ledger becomes shared."""
    old = tmp_path / "old"
    file_key = load_or_create_key(old)
    assert ledger_key(pg_url, old) == file_key
    assert ledger_key(pg_url, tmp_path / "new") == file_key


def test_a_key_file_that_contradicts_the_ledger_is_refused(pg_url: str, tmp_path: Path) -> None:
    ledger_key(pg_url, tmp_path / "first")
    other = tmp_path / "other"
    load_or_create_key(other)
    with pytest.raises(ValueError, match=r"other/pseudonym.key: pseudonymization key differs from the one the "
                                         r"ledger .* keeps"):
        ledger_key(pg_url, other)


def test_the_embedded_ledger_keeps_the_data_dir_key(tmp_path: Path) -> None:
    assert ledger_key(None, tmp_path) == (tmp_path / KEY_NAME).read_bytes() == load_or_create_key(tmp_path)


def test_two_collectors_log_one_pseudonym_per_user_in_a_shared_audit_log(pg_url: str, tmp_path: Path) -> None:
    rec = JobRecord(job_id="7", user="alice", account="proj", start=1.0, end=2.0, gpus=1)
    written = []
    for name in ("c1", "c2"):  # each collector logs the job record it was posted
        with open_log(tmp_path / name, ledger_url=pg_url) as log:
            written.append(log.append("job_record", job_data(log, rec), job_id=rec.job_id, key=job_key(rec)))
    # the second record is the first one, pseudonym included: the log skips it as unchanged
    assert written[0] is not None and written[0].data["user"] != "alice" and written[1] is None


def test_commands_refuse_a_contradicting_key_file_with_exit_2(pg_url: str, tmp_path: Path) -> None:
    ledger_key(pg_url, tmp_path / "first")
    data = tmp_path / "data"
    load_or_create_key(data)
    exe = Path(sys.executable).with_name("gpuledger")
    p = subprocess.run([str(exe), "audit", "verify", "--data-dir", str(data), "--ledger-url", pg_url],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and "pseudonymization key differs" in p.stderr
