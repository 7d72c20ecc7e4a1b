"""The report and audit commands end to end on a real store: signed reports, verify, explain, privacy."""

from __future__ import annotations

import base64
import csv
import io
import json
import math
import sqlite3
import time
from datetime import UTC, datetime

import pytest
import typer
from typer.testing import CliRunner

from gpuledger.accounting.privacy import Pseudonymizer, apply_retention, is_pseudonym, load_or_create_key
from gpuledger.accounting.report_cli import audit_app, report_app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord

T0 = datetime(2026, 10, 5, tzinfo=UTC).timestamp()
app = typer.Typer()
app.add_typer(report_app, name="report")
app.add_typer(audit_app, name="audit")
runner = CliRunner()

CONFIG = """
[report]
currency = "EUR"
price_per_kwh = 0.5
co2e_kg_per_kwh = 0.4
retention_days = 30
[report.price_per_gpu_hour]
default = 2.0
"""


def _s(ts, gpu, job, sm):
    return GpuSample(ts=ts, host="n1", gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200", sm_active_ratio=sm,
                     energy_joules=360.0 * (ts - T0), job_ids=(job,))


@pytest.fixture()
def data_dir(tmp_path):
    (tmp_path / "gpuledger.toml").write_text(CONFIG)
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    try:
        samples = [_s(T0 + 10 * k, g, j, sm) for g, j, sm in (("G0", "1", 0.8), ("G1", "2", 0.0), ("G2", "2", 0.01))
                   for k in range(361)]
        store.ingest(Batch("a", 0, "n1", tuple(samples)))
        store.put_jobs([
            JobRecord("1", cluster="c", user="alice", uid=1001, account="a", gpus=1, submit=T0 - 60, start=T0,
                      end=T0 + 3600),
            JobRecord("2", cluster="c", user="bob", uid=1002, account="b", gpus=2, submit=T0, start=T0, end=T0 + 3600),
        ])
    finally:
        store.close()
    return tmp_path


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_usage_csv_reconciles_and_is_signed_and_verified(data_dir):
    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    assert run("audit", "record", "--data-dir", data_dir).exit_code == 0
    out = data_dir / "oct.csv"
    r = run("report", "usage", "--data-dir", data_dir, "--period", "2026-10", "--format", "csv", "-o", out)
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    by = {row["account"]: row for row in rows}
    assert set(by) == {"a", "b", "TOTAL"}
    assert float(by["TOTAL"]["allocated_gpu_hours"]) == 3.0  # 1 GPU + 2 GPUs for one hour
    assert float(by["a"]["energy_kwh"]) == pytest.approx(0.36)  # 360 W for one hour
    assert float(by["b"]["cost"]) == pytest.approx(2 * 2.0 + 0.72 * 0.5)
    assert float(by["a"]["queue_wait_mean_h"]) == pytest.approx(60 / 3600)
    assert math.fsum(float(by[k]["allocated_gpu_hours"]) for k in "ab") == float(by["TOTAL"]["allocated_gpu_hours"])
    r = run("audit", "verify", out, "--data-dir", data_dir)
    assert r.exit_code == 0, r.output
    assert "signature, content, input records and audit head verify" in r.output
    out.write_text(out.read_text().replace("a,1,", "a,2,"))
    r = run("audit", "verify", out, "--data-dir", data_dir)
    assert r.exit_code == 1 and "report altered" in r.output


def test_verify_names_the_first_tampered_entry(data_dir):
    assert run("audit", "record", "--data-dir", data_dir).exit_code == 0
    db = sqlite3.connect(data_dir / "audit.sqlite")
    db.execute("DELETE FROM entries WHERE seq=2")
    db.commit()
    db.close()
    r = run("audit", "verify", "--data-dir", data_dir)
    assert r.exit_code == 1
    assert "audit entry 2: missing" in r.output
    (data_dir / "audit.sqlite").unlink()  # a deleted log beside its store is tampering too
    r = run("audit", "verify", "--data-dir", data_dir)
    assert r.exit_code == 1 and "missing (deleted)" in r.output


def test_other_formats_and_groupings(data_dir):
    r = run("report", "usage", "--data-dir", data_dir, "--from", "2026-10-01", "--to", "2026-10-06", "--by", "node",
            "--format", "json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["rows"][0]["group"] == "n1" and doc["total"]["jobs"] == 2
    assert doc["total"]["co2e_kg"] == pytest.approx(0.4 * 1.08)
    r = run("report", "usage", "--data-dir", data_dir, "--by", "user", "--format", "html", "-o", data_dir / "r.html")
    html = (data_dir / "r.html").read_text()
    assert r.exit_code == 0 and "unsigned" in r.output and "<svg" in html
    assert "user names: shown as recorded" in html and "pseudonymized: False" not in html
    r = run("report", "usage", "--data-dir", data_dir, "--format", "html", "--pseudonymize", "-o", data_dir / "p.html")
    assert r.exit_code == 0 and "user names: pseudonymized" in (data_dir / "p.html").read_text()
    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    r = run("report", "usage", "--data-dir", data_dir, "--format", "html", "-o", data_dir / "all.html")  # no period
    assert r.exit_code == 0 and "signed manifest" in r.output, r.output
    manifest = json.loads((data_dir / "all.html.manifest.json").read_text())["manifest"]
    assert manifest["period"]["start"] is None and manifest["inputs"]["format"] == "html"
    assert run("audit", "verify", data_dir / "all.html", "--data-dir", data_dir).exit_code == 0
    r = run("report", "usage", "--data-dir", data_dir, "--period", "2026-13")
    assert r.exit_code == 2 and "period '2026-13'" in r.output
    r = run("report", "usage", "--data-dir", data_dir / "nope")
    assert r.exit_code == 2 and "no gpuledger store" in r.output


def test_pseudonymize_hides_users_in_every_export(data_dir):
    outputs = [
        run("report", "usage", "--data-dir", data_dir, "--by", "user", "--format", "csv", "--pseudonymize").output,
        run("report", "jobs", "--data-dir", data_dir, "--format", "json", "--pseudonymize").output,
        run("report", "job", "1", "--data-dir", data_dir, "--format", "json", "--pseudonymize").output,
        run("report", "idle", "--data-dir", data_dir, "--format", "json", "--pseudonymize").output,
    ]
    alias = Pseudonymizer(load_or_create_key(data_dir))
    for out in outputs:
        assert "alice" not in out and "bob" not in out
    assert alias("alice") in outputs[0] and alias("alice") in outputs[1] and alias("bob") in outputs[3]
    again = run("report", "usage", "--data-dir", data_dir, "--by", "user", "--format", "csv", "--pseudonymize").output
    assert again == outputs[0]  # stable across runs


def test_idle_and_job_reports(data_dir):
    r = run("report", "idle", "--data-dir", data_dir, "--format", "json")
    rows = json.loads(r.output)
    assert [(x["job_id"], x["idle_gpus"]) for x in rows] == [("2", 2)]
    assert rows[0]["idle_gpu_hours"] == pytest.approx(2.0)
    r = run("report", "job", "2", "--data-dir", data_dir)
    assert r.exit_code == 0 and "[idle_gpu]" in r.output and "n1/G1" in r.output
    assert run("report", "job", "77", "--data-dir", data_dir).exit_code == 2


def test_explain_says_what_the_log_cannot_prove_yet(data_dir):
    assert run("audit", "record", "--data-dir", data_dir).exit_code == 0
    r = run("audit", "explain", "1", "--data-dir", data_dir)
    assert r.exit_code == 0, r.output
    assert "audit log intact" in r.output and "1. job record" in r.output and "2. measurements" in r.output
    assert "not proven: charged usage: no fairshare entry" in r.output


def test_retention_pseudonymizes_old_job_records_only(data_dir):
    key = load_or_create_key(data_dir)
    assert load_or_create_key(data_dir) == key and (data_dir / "pseudonym.key").stat().st_mode & 0o777 == 0o600
    alias = Pseudonymizer(key)
    # 10 days after the jobs ended: 30-day retention keeps the names, 5-day retention removes them
    now = T0 + 3600 + 10 * 86400
    assert apply_retention(None, data_dir, alias, 30, now=now) == 0
    assert apply_retention(None, data_dir, alias, 5, now=now) == 2
    assert apply_retention(None, data_dir, alias, 5, now=now) == 0  # idempotent
    store = Store(data_dir / "gpuledger.sqlite")
    try:
        jobs = {j.job_id: j for j in store.jobs()}
    finally:
        store.close()
    assert jobs["1"].user == alias("alice") and is_pseudonym(jobs["1"].user) and jobs["1"].uid is None
    assert jobs["1"].account == "a"  # accounts are projects, not people
    with pytest.raises(ValueError, match="retention days"):
        apply_retention(None, data_dir, alias, -1)


@pytest.mark.parametrize("args", [("--from", "1e15", "--format", "csv"), ("--from", "-1e15", "--format", "json"),
                                  ("--to", "1e15"), ("--from", "nan")])
def test_times_out_of_range_are_bad_input_before_anything_is_printed(data_dir, args):
    r = run("report", "usage", "--data-dir", data_dir, *args)
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith(f"error: {args[0]} {args[1]!r}: ") and r.stderr.count("\n") == 1, r.stderr
    assert "unexpected" not in r.stderr


def test_csv_of_no_rows_still_has_its_header(data_dir, tmp_path):
    from dataclasses import fields

    from gpuledger.accounting.report.idle import IdleRow
    from gpuledger.accounting.report.jobs import JobRow

    empty = tmp_path / "empty"
    empty.mkdir()
    Store(empty / "gpuledger.sqlite").close()
    jobs_header = ",".join(f.name for f in fields(JobRow))
    idle_header = ",".join(f.name for f in fields(IdleRow))
    for d, extra, header in ((empty, (), jobs_header),):
        r = run("report", "jobs", "--data-dir", d, "--format", "csv", *extra)
        assert r.exit_code == 0 and r.stdout.splitlines() == [header], r.output
    for d, extra in ((empty, ()), (data_dir, ("--threshold", "0"))):  # no jobs; every job filtered out
        r = run("report", "idle", "--data-dir", d, "--format", "csv", *extra)
        assert r.exit_code == 0 and r.stdout.splitlines() == [idle_header], r.output
    # the same columns as when there are rows
    r = run("report", "jobs", "--data-dir", data_dir, "--format", "csv")
    assert r.stdout.splitlines()[0] == jobs_header
    r = run("report", "idle", "--data-dir", data_dir, "--format", "csv")
    assert r.stdout.splitlines()[0] == idle_header and len(r.stdout.splitlines()) == 2


def test_tables_in_a_pipe_escape_line_breaks_and_align_wide_characters(tmp_path):
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    users = ["line\nbreak", "zoë-用户", "bob"]
    try:
        samples = [_s(T0 + 10 * k, f"G{i}", str(i), 0.5) for i in range(3) for k in range(361)]
        store.ingest(Batch("a", 0, "n1", tuple(samples)))
        store.put_jobs([JobRecord(str(i), cluster="c", user=u, account="a", gpus=1, start=T0, end=T0 + 3600)
                        for i, u in enumerate(users)])
    finally:
        store.close()
    for args, first in ((("report", "usage", "--by", "user"), "User"), (("report", "jobs"), "Job")):
        r = run(*args, "--data-dir", tmp_path)
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        table = lines[lines.index(next(x for x in lines if x.startswith(first + "  "))):]
        assert len(table) == len(users) + 1 + (args[1] == "usage"), table  # header, a row per job (and TOTAL)
        assert any("line\\nbreak" in x for x in table)
        # the last column is numbers, right-aligned: every line ends at one terminal column ("用户" takes four)
        assert len({_columns(x) for x in table}) == 1, table
    r = run("report", "usage", "--by", "user", "--data-dir", tmp_path, "--format", "csv")
    assert {row["user"] for row in csv.DictReader(io.StringIO(r.stdout))} >= set(users)  # CSV keeps the names


def _columns(text: str) -> int:
    """Terminal columns of a line, computed here rather than by the code under test: CJK takes two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def test_reconcile_notes_an_empty_period_as_the_other_reports_do(data_dir):
    r = run("report", "reconcile", "--data-dir", data_dir, "--period", "2001-01", "--format", "csv")
    assert r.exit_code == 0, r.output
    assert "note: no job ended in period 2001-01" in r.stderr
    full = run("report", "reconcile", "--data-dir", data_dir, "--format", "csv")  # all time
    assert full.exit_code == 0 and "no job ended" not in full.stderr


def test_a_report_that_cannot_be_written_is_one_line_exit_2_and_an_old_one_is_kept(data_dir):
    (data_dir / "afile").write_text("")
    r = run("report", "usage", "--data-dir", data_dir, "--period", "2026-10", "--format", "csv",
            "-o", data_dir / "afile" / "oct.csv")
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: {data_dir / 'afile'}: File exists", r.output
    # a report written again replaces the old one whole, through a rename: no temp file is left beside it
    out = data_dir / "oct.csv"
    out.write_text("an older report\n")
    assert run("report", "usage", "--data-dir", data_dir, "--period", "2026-10", "--format", "csv",
               "-o", out).exit_code == 0
    assert out.read_text().startswith("account,")
    assert sorted(p.name for p in data_dir.iterdir() if p.name.startswith("oct.csv")) == ["oct.csv"]


def _signed_report(data_dir, name="oct.csv"):
    out = data_dir / name
    r = run("report", "usage", "--data-dir", data_dir, "--period", "2026-10", "--format", "csv", "-o", out)
    assert r.exit_code == 0 and "signed manifest" in r.output, r.output
    return out


def test_a_signed_report_binds_its_co2_series_and_prices_and_verify_compares_them(data_dir, tmp_path):
    # two reports of one period, the grid intensity series edited between them: 10x the CO2e, same records
    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    config = data_dir / "gpuledger.toml"
    config.write_text(CONFIG.replace("[report]\n", '[report]\ngrid_intensity_csv = "grid.csv"\n'))
    (data_dir / "grid.csv").write_text("time,g_co2e_per_kwh\n2026-10-01T00:00:00Z,300\n2026-11-01T00:00:00Z,300\n")
    r1 = _signed_report(data_dir, "r1.csv")
    (data_dir / "grid.csv").write_text("time,g_co2e_per_kwh\n2026-10-01T00:00:00Z,30\n2026-11-01T00:00:00Z,30\n")
    r2 = _signed_report(data_dir, "r2.csv")
    co2 = [next(row for row in csv.DictReader(io.StringIO(p.read_text())) if row["account"] == "TOTAL")["co2e_kg"]
           for p in (r1, r2)]
    assert float(co2[0]) == pytest.approx(10 * float(co2[1]))
    bound = [json.loads((data_dir / f"{p.name}.manifest.json").read_text())["manifest"]["inputs"]["settings"]
             for p in (r1, r2)]
    assert {k: v for k, v in bound[0].items() if k != "grid_intensity"} == {
        "currency": "EUR", "price_per_kwh": 0.5, "price_per_gpu_hour": {"default": 2.0}, "co2e_kg_per_kwh": 0.4,
        "idle_threshold": 0.05}
    assert bound[0]["grid_intensity"]["points"] == 2 and bound[0]["grid_intensity"] != bound[1]["grid_intensity"]
    r = run("audit", "verify", r1, r2, "--data-dir", data_dir)  # both signed, and each says what it was made with
    assert r.exit_code == 0, r.output
    sha = [b["grid_intensity"]["sha256"][:16] for b in bound]
    assert f"report {r1}: " in r.output and f"grid intensity series 2 point(s), sha256 {sha[0]}" in r.output
    assert f"sha256 {sha[1]}" in r.output
    # against the settings the auditor was given: the series of now is r2's, not r1's
    r = run("audit", "verify", r2, "--data-dir", data_dir, "--config", config)
    assert r.exit_code == 0 and "DIFFERS" not in r.output, r.output
    r = run("audit", "verify", r1, "--data-dir", data_dir, "--config", config)
    assert r.exit_code == 1, r.output
    (line,) = [ln for ln in r.stderr.splitlines() if "DIFFERS" in ln]
    assert line.startswith(f"DIFFERS: report {r1} was computed with grid_intensity ") and f"{config} gives" in line
    priced = tmp_path / "auditor.toml"  # a price the auditor was told, not the one used
    priced.write_text(config.read_text().replace("price_per_kwh = 0.5", "price_per_kwh = 0.25"))
    (tmp_path / "grid.csv").write_text((data_dir / "grid.csv").read_text())
    r = run("audit", "verify", r2, "--data-dir", data_dir, "--config", priced)
    assert r.exit_code == 1 and f"DIFFERS: report {r2} was computed with price_per_kwh 0.5, {priced} gives 0.25" \
        in r.stderr, r.output


def _manifest(report):
    path = report.with_name(report.name + ".manifest.json")
    return path, json.loads(path.read_text())


def test_an_altered_manifest_costs_no_memory_for_the_ranges_it_names(data_dir):
    # "1-9999999," x 50 names half a billion entries: refused by its signature before any range is read
    import os
    import resource
    import subprocess
    import sys

    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    out = _signed_report(data_dir)
    path, doc = _manifest(out)
    doc["manifest"]["input_records"]["entries"] = "1-9999999," * 50
    path.write_text(json.dumps(doc))

    def one_gib() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    p = subprocess.run([sys.executable, "-c", "from gpuledger.cli import main; main()", "audit", "verify", str(out),
                        "--data-dir", str(data_dir)], capture_output=True, text=True, env=dict(os.environ),
                       preexec_fn=one_gib, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines() == [f"TAMPERED: {path}: the signature does not match the manifest (manifest altered)"]


def test_a_manifest_that_is_not_one_is_bad_input_in_one_line(data_dir):
    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    out = _signed_report(data_dir)
    path, doc = _manifest(out)
    for text, why in (("{", "JSONDecodeError"), (json.dumps({**doc, "signature": "!!"}), "Error"),
                      (json.dumps({"manifest": [1]}), "KeyError"), ("[" * 100_000 + "]" * 100_000, "nested")):
        path.write_text(text)
        r = run("audit", "verify", out, "--data-dir", data_dir)
        assert r.exit_code == 2, (text[:40], r.output)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {path}: not a report manifest ("), r.stderr
        assert why in r.stderr and "unexpected" not in r.stderr


def test_a_signed_manifest_naming_entries_past_its_head_is_refused(data_dir):
    # a signer that names entries its signed head does not hold (an older release's bug, a stolen key): refused,
    # one line, whatever the log holds
    from gpuledger.accounting.audit import canonical_json, default_private_key_path, load_signing_key

    assert run("audit", "keygen", "--data-dir", data_dir).exit_code == 0
    out = _signed_report(data_dir)
    path, doc = _manifest(out)
    m = doc["manifest"]
    size = m["audit_head"]["size"]
    m["input_records"]["entries"] = f"1-{size + 9_000_000}"
    key = load_signing_key(default_private_key_path())
    doc["signature"] = base64.b64encode(key.private.sign(canonical_json(m).encode())).decode()
    path.write_text(json.dumps(doc))
    r = run("audit", "verify", out, "--data-dir", data_dir)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == (f"error: {path}: the signed manifest's input records: entry range "
                                f"'1-{size + 9_000_000}' is not ascending within the signed head's 1..{size}")


def _utc(*a: int) -> float:
    return datetime(*a, tzinfo=UTC).timestamp()


def _samples(host: str, job: str | None, t0: float, t1: float) -> tuple[GpuSample, ...]:
    """A GPU's samples every 10 s over [t0, t1], carrying ``job`` (None: no job)."""
    return tuple(GpuSample(ts=t0 + 10 * k, host=host, gpu_uuid=f"GPU-{host}", gpu_index=0, model="NVIDIA H200",
                           sm_active_ratio=0.5, energy_joules=300.0 * 10 * k, job_ids=(job,) if job else ())
                 for k in range(int((t1 - t0) / 10) + 1))


def test_a_job_slurm_shows_running_is_billed_in_no_closed_month_and_once_when_it_ended(tmp_path):
    # job 500 started 2020-01-20; its node's agent died after an hour, so its last measurement lies in January
    (tmp_path / "gpuledger.toml").write_text(CONFIG)
    t0 = _utc(2020, 1, 20)
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: t0 + 7200)
    try:
        store.ingest(Batch("a", 0, "n1", _samples("n1", "500", t0, t0 + 3600), cluster="c"))
        store.put_jobs([JobRecord("500", cluster="c", user="alice", account="a", hosts=("n1",), gpus=1, start=t0,
                                  state="RUNNING")])
    finally:
        store.close()

    def jobs(period: str) -> tuple[int, str]:
        r = run("report", "usage", "--data-dir", tmp_path, "--period", period, "--format", "json")
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["total"]["jobs"], r.stderr

    n, err = jobs("2020-01")
    assert n == 0 and "1 job(s) that started before the period's end have no end in Slurm's records" in err
    everything = run("report", "usage", "--data-dir", tmp_path, "--format", "csv")  # all time: not over yet
    assert "counted with their allocation up to now" in everything.stderr
    assert next(row for row in csv.DictReader(io.StringIO(everything.stdout)) if row["account"] == "TOTAL")[
        "jobs"] == "1"
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: t0 + 7200)
    try:
        store.put_jobs([JobRecord("500", cluster="c", user="alice", account="a", hosts=("n1",), gpus=1, start=t0,
                                  end=_utc(2020, 2, 1, 12), state="COMPLETED")])
    finally:
        store.close()
    assert [jobs(p)[0] for p in ("2020-01", "2020-02")] == [0, 1]


def test_a_report_made_just_after_its_period_says_which_jobs_only_agents_measured_may_still_run(tmp_path):
    # job 600 has no Slurm record; its agent's last sample lies 200 s before the end of a period that ended 800 s
    # ago: it counts there, and the report says it may still be running (its later samples not in yet); a period
    # that ended 940 s ago, more than the settle time (15 min), is settled: no such note
    (tmp_path / "gpuledger.toml").write_text(CONFIG)
    now = time.time()
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a", 0, "n1", _samples("n1", "600", now - 2800, now - 1000), cluster="c"))
    finally:
        store.close()
    for ended_ago, noted in ((800, True), (940, False)):
        r = run("report", "usage", "--data-dir", tmp_path, "--from", str(int(now - 86400)), "--to",
                str(int(now - ended_ago)), "--format", "json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["total"]["jobs"] == 1
        assert ("1 job(s) Slurm has no record of were last measured within 15 min of the period's end, which is "
                "less than that ago: they count here at their last measurement, but may still be running" in r.stderr
                ) is noted, r.stderr


def test_reconcile_balances_with_the_collectors_totals_in_every_period(tmp_path):
    # job 100 (account a) ran 09-30 23:00 .. 10-01 01:00 on n1: counted in October, with an hour in September;
    # job 200 (b) 10-31 23:00 .. 11-01 01:00 on n2: counted in November, with an hour in October; job 300 (c)
    # started 10-31 23:30 on n3 and Slurm shows it running; n1 idled without a job on 10-10 for an hour
    (tmp_path / "gpuledger.toml").write_text(CONFIG)
    store = Store(tmp_path / "gpuledger.sqlite", clock=lambda: _utc(2026, 11, 2))
    try:
        for i, (host, job, t0, t1) in enumerate((
                ("n1", "100", _utc(2026, 9, 30, 23), _utc(2026, 10, 1, 1)),
                ("n1", None, _utc(2026, 10, 10), _utc(2026, 10, 10, 1)),
                ("n2", "200", _utc(2026, 10, 31, 23), _utc(2026, 11, 1, 1)),
                ("n3", "300", _utc(2026, 10, 31, 23, 30), _utc(2026, 11, 1, 23)))):
            store.ingest(Batch("a-" + host, i, host, _samples(host, job, t0, t1), cluster="c"))
        store.put_jobs([
            JobRecord("100", cluster="c", user="u", account="a", hosts=("n1",), gpus=1, start=_utc(2026, 9, 30, 23),
                      end=_utc(2026, 10, 1, 1), state="COMPLETED"),
            JobRecord("200", cluster="c", user="u", account="b", hosts=("n2",), gpus=1,
                      start=_utc(2026, 10, 31, 23), end=_utc(2026, 11, 1, 1), state="COMPLETED"),
            JobRecord("300", cluster="c", user="u", account="c", hosts=("n3",), gpus=1,
                      start=_utc(2026, 10, 31, 23, 30), state="RUNNING")])
        months = {p: (_utc(2026, m, 1), _utc(2026, m + 1, 1)) for p, m in (("2026-09", 9), ("2026-10", 10),
                                                                             ("2026-11", 11))}
        collector = {p: store.totals(a, b)["observed_gpu_seconds"] / 3600 for p, (a, b) in months.items()}
    finally:
        store.close()
    totals = {}
    for p in months:
        r = run("report", "reconcile", "--data-dir", tmp_path, "--period", p, "--format", "json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        totals[p] = t = doc["total"]
        balance = (t["observed_gpu_hours"] + t["out_of_scope_gpu_hours"] - t["outside_period_gpu_hours"]
                   + t["other_periods_gpu_hours"] + t["unattributed_gpu_hours"])
        assert balance == pytest.approx(collector[p], rel=1e-12), p
        assert not any("disagree" in n for n in doc["notes"]), doc["notes"]
    # each job's hours where they lie: job 100's September hour (its first sample opens no interval) is outside
    # October and other periods' in September; job 200's October hour is other periods' in October
    assert totals["2026-09"]["other_periods_gpu_hours"] == pytest.approx(3590 / 3600)
    assert totals["2026-10"]["outside_period_gpu_hours"] == pytest.approx(3590 / 3600)
    assert totals["2026-10"]["unattributed_gpu_hours"] == pytest.approx(1.0)
    assert totals["2026-11"]["outside_period_gpu_hours"] == pytest.approx(3590 / 3600)  # job 200's October hour
