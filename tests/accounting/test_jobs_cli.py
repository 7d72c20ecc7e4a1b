"""`gpuledger jobs import` and `jobs list` on real sacct captures: idempotent import, one-sided jobs reported."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testdata import DATA_ROOT, capture, measure_jobs_3_and_999  # noqa: F401
from typer.testing import CliRunner

from gpuledger.accounting.audit import open_log
from gpuledger.cli import app
from gpuledger.collector.store import Store
from gpuledger.schema.records import JobRecord

REAL = DATA_ROOT / "slurm" / "real-22.05"
runner = CliRunner()


def test_import_is_idempotent_and_list_joins_measurements(tmp_path: Path) -> None:
    d = str(tmp_path)
    args = ["jobs", "import", "--data-dir", d, "--sacct-json", str(REAL / "sacct-json-a-S-today.json"),
            "--sacct-parsable", str(REAL / "sacct-a-P-S-today.txt")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    first = int(r.output.split("imported ")[1].split()[0])
    assert first >= 10 and f"; {first} new or changed" in r.output
    r = runner.invoke(app, args)  # the same jobs again: nothing changes, nothing is audited twice
    assert r.exit_code == 0 and "; 0 new or changed" in r.output

    # Measurements for job 3 (a real job) and for job 999 (which Slurm never reported).
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        measure_jobs_3_and_999(store)
    finally:
        store.close()
    r = runner.invoke(app, ["jobs", "list", "--data-dir", d, "--format", "json"])
    assert r.exit_code == 0, r.output
    jobs = {j["job_id"]: j for j in json.loads(r.output)}
    for key in ("job_id", "user", "account", "partition", "gpus", "start", "end", "state", "usage"):
        assert key in jobs["3"]
    assert (jobs["3"]["user"], jobs["3"]["account"], jobs["3"]["state"], jobs["3"]["gpus"]) == ("carol", "proj_b",
                                                                                                "FAILED", 1)
    assert jobs["3"]["seen_by"] == "both" and jobs["3"]["usage"]["allocated_gpu_seconds"] == 20.0
    assert jobs["999"]["seen_by"] == "agent" and jobs["999"]["user"] is None  # reported, not dropped
    assert jobs["999"]["slurm_gpu_seconds"] is None and jobs["999"]["coverage"] is None
    assert jobs["1"]["seen_by"] == "slurm" and jobs["1"]["usage"] is None
    # job 1 ran with no agent: Slurm's allocation (end - start) x GPUs, none of it observed
    j1 = jobs["1"]
    assert j1["slurm_gpu_seconds"] == (j1["end"] - j1["start"]) * j1["gpus"] > 0
    assert j1["unmeasured_gpu_seconds"] == j1["slurm_gpu_seconds"] and j1["coverage"] == 0.0
    j3 = jobs["3"]  # 20 s observed of its allocation
    assert j3["coverage"] == 20.0 / j3["slurm_gpu_seconds"]


def test_reimport_in_another_format_keeps_what_the_richer_one_gave(tmp_path: Path) -> None:
    d = str(tmp_path)
    r = runner.invoke(app, ["jobs", "import", "--data-dir", d, "--sacct-json", str(REAL / "sacct-json-a-S-today.json")])
    assert r.exit_code == 0, r.output
    store = Store(tmp_path / "gpuledger.sqlite")
    before = {j.job_id: j for j in store.jobs()}
    store.close()
    with open_log(tmp_path) as log:
        logged_before = len(list(log.entries(kind="job_record")))
    # sacct -P of the same jobs has no GPU UUIDs and prints times in the machine's zone; nothing Slurm said changed
    r = runner.invoke(app, ["jobs", "import", "--data-dir", d, "--sacct-parsable", str(REAL / "sacct-a-P-S-today.txt")])
    assert r.exit_code == 0, r.output
    store = Store(tmp_path / "gpuledger.sqlite")
    after = {j.job_id: j for j in store.jobs()}
    store.close()
    assert set(after) >= set(before)
    for job_id, old in before.items():
        assert after[job_id].hosts == old.hosts and after[job_id].account == old.account, job_id
        assert after[job_id].tres == old.tres or not old.tres, job_id
    changed = int(r.output.split("; ")[1].split()[0])
    with open_log(tmp_path) as log:
        logged = list(log.entries(kind="job_record"))
    assert len(logged) - logged_before == changed  # an audit entry only for a record that changed
    # and what the log holds is what the store holds (a feed binds the two)
    latest = {e.key: e.data for e in logged}
    for job in after.values():
        assert latest[f"job:{job.cluster}/{job.job_id}"]["hosts"] == list(job.hosts)


def test_list_as_csv_keeps_slurms_gpu_count_and_the_cluster(tmp_path: Path) -> None:
    import csv
    import io

    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    t0 = 1_790_000_000.0
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        for cluster, seq in (("alpha", 1), ("beta", 2)):
            rows = tuple(GpuSample(ts=t0 + 10 * k, host=f"n-{cluster}", gpu_uuid=f"GPU-{cluster}", gpu_index=0,
                                   energy_joules=100.0 * k, job_ids=("8",)) for k in range(7))
            store.ingest(Batch(f"a-{cluster}", seq, f"n-{cluster}", rows, cluster=cluster))
        store.put_jobs([JobRecord(job_id="8", cluster=c, user=u, account="p", hosts=(f"n-{c}",), gpus=2, start=t0,
                                  end=t0 + 60, state="COMPLETED") for c, u in (("alpha", "ann"), ("beta", "ben"))])
    finally:
        store.close()
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(tmp_path), "--format", "csv"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.output)))
    assert [(x["job_id"], x["cluster"], x["user"], x["gpus"]) for x in rows] == [("8", "alpha", "ann", "2"),
                                                                                ("8", "beta", "ben", "2")]
    assert all(float(x["energy_joules"]) == 600.0 and float(x["allocated_gpu_seconds"]) == 60.0 for x in rows)
    # Slurm's allocation against what was observed, as the table and JSON have it
    assert all((float(x["slurm_gpu_seconds"]), float(x["observed_gpu_seconds"]), float(x["coverage"]),
                float(x["unmeasured_gpu_seconds"])) == (120.0, 60.0, 0.5, 60.0) for x in rows)
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(tmp_path), "--format", "json"])
    listed = json.loads(r.output)
    assert [(j["cluster"], j["gpus"], j["energy_joules"], j["gap_energy_joules"]) for j in listed] == [
        ("alpha", 2, 600.0, 0.0), ("beta", 2, 600.0, 0.0)]


def test_import_refuses_slurm_together_with_files(tmp_path: Path) -> None:
    r = runner.invoke(app, ["jobs", "import", "--data-dir", str(tmp_path), "--slurm", "--sacct-json",
                            str(REAL / "sacct-json-a-S-today.json")])
    assert r.exit_code == 2 and "--slurm runs sacct itself" in r.output


def test_an_import_file_that_is_not_utf8_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "sacct.json"
    bad.write_bytes(b'{"jobs": [{"name": "\xff"}]}')
    r = CliRunner().invoke(app, ["jobs", "import", "--data-dir", str(tmp_path), "--sacct-json", str(bad)])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: {bad}: not UTF-8 text (invalid start byte at byte 20)", r.output


def test_a_job_id_of_other_scripts_digits_stops_no_listing(tmp_path: Path) -> None:
    # an agent may name any printable job id: '²' passed isdigit() and then made int() raise in the ledger's sort,
    # so every listing, report and fairshare of the ledger failed
    from gpuledger.collector.validate import Batch
    from gpuledger.schema.records import GpuSample

    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.ingest(Batch("a", 1, "n1", tuple(GpuSample(ts=1.7e9 + 10 * k, host="n1", gpu_uuid=f"G{i}", gpu_index=i,
                                                         job_ids=(job,))
                                               for k in range(3) for i, job in enumerate(("\u00b2", "10")))))
    finally:
        store.close()
    r = CliRunner().invoke(app, ["jobs", "list", "--data-dir", str(tmp_path), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert [j["job_id"] for j in json.loads(r.output)] == ["10", "\u00b2"]
    r = CliRunner().invoke(app, ["report", "usage", "--data-dir", str(tmp_path), "--format", "json"])
    assert r.exit_code == 0, r.output


def test_jobs_are_listed_in_slurms_numeric_order_array_tasks_by_their_number(tmp_path: Path) -> None:
    # The order the agent's mappers give a GPU's jobs (schema.records.job_sort_key); the ledger listed
    # "12_10" before "12_2" (its own rule: the head's number, then the text).
    ids = ["12_10", "x1", "10", "12_2", "9", "12", "100_1"]
    store = Store(tmp_path / "gpuledger.sqlite")
    try:
        store.put_jobs([JobRecord(job_id=j, user="ann", account="p", hosts=("n1",), gpus=1, start=1_790_000_000.0,
                                  end=1_790_000_060.0, state="COMPLETED") for j in ids])
    finally:
        store.close()
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(tmp_path), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert [j["job_id"] for j in json.loads(r.output)] == ["9", "10", "12", "12_2", "12_10", "100_1", "x1"]


def test_an_import_with_one_impossible_record_stores_nothing_and_says_where(tmp_path: Path) -> None:
    # gres/gpu=1e308 was stored (Infinity in `jobs list`, a feed refused for the whole cluster); gres/gpu=nan and
    # node[a-b] ended the import with "unexpected ValueError", exit 1
    import sqlite3

    d = str(tmp_path)
    head = "JobID|Cluster|User|Account|Start|End|State|AllocTRES|NodeList\n"
    good = "8|c|dave|proj_b|2026-12-01T19:10:00|2026-12-01T19:40:00|COMPLETED|gres/gpu=1|n1\n"
    first = tmp_path / "first.sacct"
    first.write_text(head + good)
    assert runner.invoke(app, ["jobs", "import", "--data-dir", d, "--sacct-parsable", str(first)]).exit_code == 0

    def audit_entries() -> int:
        db = sqlite3.connect(tmp_path / "audit.sqlite")
        try:
            return db.execute("SELECT count(*) FROM entries").fetchone()[0]
        finally:
            db.close()

    def stored() -> list[dict]:
        return json.loads(runner.invoke(app, ["jobs", "list", "--data-dir", d, "--format", "json"]).stdout)

    before, logged = stored(), audit_entries()
    for tres, nodes, start, end in (
            ("gres/gpu=1e308", "n1", "19:10", "19:40"), ("gres/gpu=nan", "n1", "19:10", "19:40"),
            ("gres/gpu=-2", "n1", "19:10", "19:40"), ("gres/gpu=2", "node[a-b]", "19:10", "19:40"),
            ("gres/gpu=2", "node[1-3000000]", "19:10", "19:40"), ("gres/gpu=2", "n1", "19:40", "19:10")):
        bad = tmp_path / "bad.sacct"
        bad.write_text(head + good.replace("8|", "10|") + f"9001|c|dave|proj_b|2026-12-01T{start}:00|"
                       f"2026-12-01T{end}:00|COMPLETED|{tres}|{nodes}\n")
        r = runner.invoke(app, ["jobs", "import", "--data-dir", d, "--sacct-parsable", str(bad)])
        assert r.exit_code == 2, (tres, nodes, r.output)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {bad}: sacct -P line 3 (job 9001)"), r.stderr
        assert stored() == before and audit_entries() == logged, (tres, nodes)  # job 10 was not stored either


@pytest.fixture()
def new_york_clock() -> Iterator[None]:
    """This process in America/New_York local time (what sacct -P prints there, and what the import reads it as)."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


def test_a_job_across_the_dst_fall_back_imports_in_the_machines_zone(tmp_path: Path, new_york_clock) -> None:
    # 300 started in the first 01:50 and ended in the second 01:10 (refused before: "End before Start", and the whole
    # import with it); 301 ended at 01:30, first or second: kept as the first (1 h), with a warning saying so
    sacct = tmp_path / "sacct.txt"
    sacct.write_text(
        "JobID|Cluster|User|Account|Partition|NodeList|AllocTRES|Submit|Start|End|State|ExitCode\n"
        "300|c|alice|a|gpu|n1|gres/gpu=1|2026-11-01T01:40:00|2026-11-01T01:50:00|2026-11-01T01:10:00|COMPLETED|0:0\n"
        "301|c|bob|a|gpu|n1|gres/gpu=1|2026-10-31T23:00:00|2026-11-01T00:30:00|2026-11-01T01:30:00|COMPLETED|0:0\n")
    r = runner.invoke(app, ["jobs", "import", "--data-dir", str(tmp_path), "--sacct-parsable", str(sacct)])
    assert r.exit_code == 0, r.output
    (warning,) = [line for line in r.output.splitlines() if line.startswith("warning:")]
    assert warning.startswith("warning: sacct -P line 3 (job 301) End 2026-11-01T01:30:00: "), warning
    r = runner.invoke(app, ["jobs", "list", "--data-dir", str(tmp_path), "--format", "json"])
    assert [(j["job_id"], j["end"] - j["start"], j["slurm_gpu_seconds"]) for j in json.loads(r.stdout)] == [
        ("300", 1200.0, 1200.0), ("301", 3600.0, 3600.0)]

