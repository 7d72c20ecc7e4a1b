"""Every store row a charge reads is bound to the audit log (accounting.audit.binding): per-GPU usage rows, energy
gaps, hour buckets, and records that move to another key or vanish. Tampered through sqlite as an operator would,
end to end through the CLI: `audit verify --store` exits 1 naming the record, `priority feed` refuses, and
`audit explain` says "proven" only for what the log holds."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuledger.accounting.audit import (
    keygen,
    load_signing_key,
    make_checkpoint,
    open_log,
    record_job_records,
    record_usage,
    sign_report,
)
from gpuledger.cli import app
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample

T0 = datetime(2026, 10, 5, tzinfo=UTC).timestamp()
runner = CliRunner()

CONFIG = """
[accounting]
algorithm = "classic"
policy = "{policy}"
priority_weight = 1000
[accounting.model_weights]
"H200" = 2.0
[accounts.a]
shares = 1
users = {{ alice = 1, bob = 1 }}
"""
SACCT = ("JobID|Cluster|User|UID|Account|Partition|AllocTRES|Submit|Start|End|State|NodeList\n"
         "1|c|alice|1001|a|gpu|gres/gpu=2|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|COMPLETED|n1\n"
         "2|c|bob|1002|a|gpu|gres/gpu=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|COMPLETED|n2\n")


def run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output  # never a traceback
    return r


def _s(ts, host, gpu, job):
    return GpuSample(ts=ts, host=host, gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200", sm_active_ratio=0.5,
                     energy_joules=360.0 * (ts - T0), job_ids=(job,))


def _data(tmp_path: Path, policy: str = "blend") -> Path:
    """Job 1 (alice) on n1's G0 and G1, job 2 (bob) on n2's G0, for an hour, long ago; one feed bound them."""
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    try:
        for n, (host, gpus, job) in enumerate((("n1", ("G0", "G1"), "1"), ("n2", ("G0",), "2"))):
            store.ingest(Batch(host, n, host, tuple(_s(T0 + 10 * k, host, g, job) for g in gpus for k in range(361))))
    finally:
        store.close()
    (d / "gpuledger.toml").write_text(CONFIG.format(policy=policy))
    (tmp_path / "sacct.txt").write_text(SACCT)
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", tmp_path / "sacct.txt").exit_code == 0
    r = run("priority", "feed", "--data-dir", d)
    assert r.exit_code == 0, r.output
    return d


def _sql(d: Path, *statements: str, db: str = "gpuledger.sqlite") -> None:
    c = sqlite3.connect(d / db)
    for s in statements:
        c.execute(s)
    c.commit()
    c.close()


def _rows(output: str) -> list[list[str]]:
    """`audit verify --store`'s tab-separated rows: job, record, field, logged, stored, entry."""
    return [line.split("\t") for line in output.splitlines() if line.count("\t") == 5 and not line.startswith("job\t")]


def _refused(d: Path, *words: str) -> str:
    r = run("priority", "feed", "--data-dir", d)
    assert r.exit_code == 1 and "refused" in r.output, r.output
    for w in words:
        assert w in r.output, r.output
    return r.output


def test_per_gpu_rows_the_charge_reads_are_bound(tmp_path):
    d = _data(tmp_path)
    with open_log(d) as log:
        g1 = log.latest("usage:1/n1/G1")
    assert g1 is not None and g1.data["final"] and g1.data["model"] == "NVIDIA H200"
    # the job total keeps its model (it takes it from one GPU); only the other GPU's row changes
    _sql(d, "UPDATE usage SET model='NVIDIA X' WHERE job_id='1' AND gpu='G1'")
    r = run("audit", "verify", "--store", "--data-dir", d)
    assert r.exit_code == 1, r.output
    assert ["1", "per-GPU usage usage:1/n1/G1", "model", '"NVIDIA H200"', '"NVIDIA X"', str(g1.seq)] in _rows(r.output)
    _refused(d, "job 1 per-GPU usage usage:1/n1/G1 model: logged 'NVIDIA H200'")


def test_a_charge_explain_shows_as_differs_fails_verify(tmp_path):
    d = _data(tmp_path)
    r = run("audit", "explain", "1", "--data-dir", d)
    assert r.exit_code == 0 and "the charges of 2 per-GPU records" in r.output and "DIFFER" not in r.output, r.output
    assert run("audit", "verify", "--data-dir", d).exit_code == 0
    # a fairshare entry whose charge its records do not recompute to (a bug, or the log's writer lying)
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        data = json.loads(json.dumps(fs.data))
        data["inputs"]["jobs"]["1"]["measured_charge"] /= 2
        forged = log.append("fairshare", data)
    r = run("audit", "explain", "1", "--data-dir", d)
    assert "DIFFERS" in r.output, r.output
    r = run("audit", "verify", "--data-dir", d)
    assert r.exit_code == 1, r.output
    assert f"audit entry {forged.seq}: job 1's measured charge" in r.output and "DIFFERS" in r.output, r.output


def test_forged_energy_gaps_are_refused_and_explain_proves_only_logged_ones(tmp_path):
    d = _data(tmp_path, policy="energy")
    keygen()
    cp = tmp_path / "cp"
    assert run("audit", "checkpoint", "--data-dir", d, "-o", cp).exit_code == 0
    # an unattributed gap on n1's G0 inside job 1's run, 800 s of 500 kJ: reassigned to job 1 from Slurm's record
    _sql(d, "INSERT INTO energy_gaps (host, gpu_uuid, mig, start, \"end\", energy_j, jobs) "
            f"VALUES ('n1', 'G0', '', {T0 + 1000}, {T0 + 1800}, 500000.0, '[]')")
    key = f"gap:n1/G0@{T0 + 1000!r}-{T0 + 1800!r}"
    r = run("audit", "verify", "--store", "--data-dir", d, "--checkpoint", cp)
    assert r.exit_code == 1, r.output
    (row,) = [x for x in _rows(r.output) if x[1] == "gap"]
    assert row[:5] == ["-", "gap", "(row added late)", "null", json.dumps(key)]
    _refused(d, f"gap (row added late): logged None (entry {row[5]}), stored {key!r}")
    # explain says "proven" for reassigned gap energy only where gap records prove it
    r = run("priority", "feed", "--data-dir", d, "--accept-store-changes", "gap found in a node's spool (ticket 7)")
    assert r.exit_code == 0, r.output
    assert run("audit", "verify", "--store", "--data-dir", d).exit_code == 0
    r = run("audit", "explain", "1", "--data-dir", d)
    assert r.exit_code == 0 and "gap energy: 500000.0 J" in r.output, r.output
    assert "accepted a final row the log had not seen before" in r.output and "ticket 7" in r.output
    with open_log(d) as log:
        fs = next(log.entries(kind="fairshare", newest_first=True))
        data = json.loads(json.dumps(fs.data))
        del data["inputs"]["jobs"]["1"]["gap_entries"]  # as every feed before gaps were bound wrote it
        log.append("fairshare", data)
    r = run("audit", "explain", "1", "--data-dir", d)
    assert not re.search(r"\d\. gap energy", r.output), r.output
    assert "not proven: gap energy: 500000.0 J reassigned from sampling gaps that no logged gap record proves" \
        in r.output, r.output
    assert "charges gap energy that is not proven" in r.output


def test_gap_rows_and_hour_buckets_the_charge_reads_are_bound(tmp_path):
    d = _data(tmp_path, policy="energy")
    _sql(d, "INSERT INTO energy_gaps (host, gpu_uuid, mig, start, \"end\", energy_j, jobs) "
            f"VALUES ('n1', 'G0', '', {T0 + 1000}, {T0 + 1800}, 500000.0, '[]')")
    assert run("priority", "feed", "--data-dir", d, "--accept-store-changes", "test").exit_code == 0
    with open_log(d) as log:
        gap = log.latest(f"gap:n1/G0@{T0 + 1000!r}-{T0 + 1800!r}")
        hour = log.latest("hours:n1@2026-10-05T00:00:00Z")
    assert gap.data["record"]["host_gpus"] == 2  # what its reassignment reads beside it
    assert hour.kind == "hours_record" and set(hour.data["busy"]) == {"G0", "G1"}  # both GPUs of the host-hour
    busy = hour.data["busy"]["G1"]
    _sql(d, "UPDATE energy_gaps SET energy_j = 900000.0",
         f"UPDATE gpu_hours SET alloc_s = 600.0 WHERE host='n1' AND gpu_uuid='G1' AND hour={T0}")
    r = run("audit", "verify", "--store", "--data-dir", d)
    assert r.exit_code == 1, r.output
    rows = _rows(r.output)
    assert ["-", f"gap {gap.key}", "energy_joules", "500000.0", "900000.0", str(gap.seq)] in rows
    assert ["-", f"hour buckets {hour.key}", "busy.G1", str(busy), "600.0", str(hour.seq)] in rows
    _refused(d, f"hour buckets {hour.key} busy.G1: logged {busy!r}")
    _sql(d, "DELETE FROM energy_gaps", f"DELETE FROM gpu_hours WHERE host='n1' AND hour={T0}")
    rows = _rows(run("audit", "verify", "--store", "--data-dir", d).output)
    assert ["-", "gap", "(row deleted)", json.dumps(gap.key), "null", str(gap.seq)] in rows
    assert ["-", "hour buckets", "(row deleted)", json.dumps(hour.key), "null", str(hour.seq)] in rows


def test_a_final_usage_record_moved_to_another_key_or_deleted_is_refused(tmp_path):
    d = _data(tmp_path)
    with open_log(d) as log:
        total, g0 = log.latest("usage:1"), log.latest("usage:1/n1/G0")
        job2 = log.latest("usage:2")
    # job 1's usage cut by 90% and moved from cluster '' to 'c': the ledger join still maps it to job 1
    _sql(d, "UPDATE usage SET sm_s = sm_s * 0.1, cluster = 'c' WHERE job_id='1'")
    r = run("audit", "verify", "--store", "--data-dir", d)
    assert r.exit_code == 1, r.output
    rows = _rows(r.output)
    assert ["1", "usage", "cluster", '""', '"c"', str(total.seq)] in rows
    assert ["1", "per-GPU usage usage:1/n1/G0", "cluster", '""', '"c"', str(g0.seq)] in rows
    assert any(x[:3] == ["1", "usage", "sm_active_gpu_seconds"] for x in rows)
    _refused(d, f"job 1 usage cluster: logged '' (entry {total.seq}), stored 'c'")
    # rows of a final record deleted
    _sql(d, "DELETE FROM usage WHERE job_id='2'")
    rows = _rows(run("audit", "verify", "--store", "--data-dir", d).output)
    assert ["2", "usage", "(row deleted)", '"usage:2"', "null", str(job2.seq)] in rows
    assert any(x[:3] == ["2", "per-GPU usage", "(row deleted)"] and x[3] == '"usage:2/n2/G0"' for x in rows)
    # accepted: corrections say the rows are gone (and where job 1's went); nothing is refused any more
    r = run("priority", "feed", "--data-dir", d, "--accept-store-changes", "agents name their cluster now")
    assert r.exit_code == 0, r.output
    with open_log(d) as log:
        c = log.latest("usage:1")
        assert c.kind == "correction" and c.data["record"] is None and c.data["moved_to"] == "usage:c/1"
        assert c.data["corrects"] == total.seq and log.latest("usage:c/1").data["final"] is True
        assert log.latest("usage:2").data["moved_to"] is None
    assert run("audit", "verify", "--store", "--data-dir", d).exit_code == 0
    assert run("priority", "feed", "--data-dir", d).exit_code == 0
    r = run("audit", "explain", "1", "--data-dir", d)
    assert f"accepted that the row of entry {total.seq} is gone (moved to usage:c/1)" in r.output, r.output


def test_a_completed_job_record_moved_to_another_cluster_is_refused(tmp_path):
    d = _data(tmp_path)
    with open_log(d) as log:
        rec = log.latest("job:c/1")
    _sql(d, "UPDATE jobs SET cluster='c2', data=json_set(data, '$.cluster', 'c2', '$.user', 'bob') WHERE job_id='1'")
    r = run("audit", "verify", "--store", "--data-dir", d)
    assert r.exit_code == 1, r.output
    rows = _rows(r.output)
    assert ["1", "job record", "cluster", '"c"', '"c2"', str(rec.seq)] in rows
    assert any(x[:3] == ["1", "job record", "user"] and x[5] == str(rec.seq) for x in rows)
    _refused(d, f"job 1 job record cluster: logged 'c' (entry {rec.seq}), stored 'c2'")
    # and a completed job's record deleted
    _sql(d, "DELETE FROM jobs WHERE job_id='1'")
    rows = _rows(run("audit", "verify", "--store", "--data-dir", d).output)
    assert ["1", "job record", "(row deleted)", '"job:c/1"', "null", str(rec.seq)] in rows


def test_a_log_of_the_previous_version_verifies_and_binds_the_rest(tmp_path):
    """A log written before per-GPU rows, gaps and hours were bound (job records and final job totals, no
    store_bound entry): it verifies, and the first feed logs what it had never bound instead of refusing it."""
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    try:
        store.ingest(Batch("n1", 0, "n1", tuple(_s(T0 + 10 * k, "n1", g, "1") for g in ("G0", "G1")
                                                for k in range(361))))
        jobs, usages = store.jobs(), store.job_usage()
    finally:
        store.close()
    (d / "gpuledger.toml").write_text(CONFIG.format(policy="blend"))
    (tmp_path / "sacct.txt").write_text(SACCT)
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", tmp_path / "sacct.txt").exit_code == 0
    with open_log(d) as log:
        record_usage(log, usages, final=True)
        record_job_records(log, jobs)
        size = log.size()
    assert run("audit", "verify", "--store", "--data-dir", d).exit_code == 0
    r = run("priority", "feed", "--data-dir", d)
    assert r.exit_code == 0, r.output
    with open_log(d) as log:
        kinds = [e.kind for e in log.entries() if e.seq > size]
    assert kinds.count("usage_record") == 2 and "hours_record" in kinds and kinds[-1] == "fairshare"
    assert run("audit", "verify", "--store", "--data-dir", d).exit_code == 0


def test_a_retired_key_signs_nothing_after_its_retirement(tmp_path):
    d = _data(tmp_path)
    first = keygen()
    retired = tmp_path / "A.key"
    retired.write_bytes(first.private.read_bytes())
    retired.chmod(0o600)
    a = load_signing_key(retired)
    before = tmp_path / "before"
    assert run("audit", "checkpoint", "--data-dir", d, "-o", before).exit_code == 0
    assert run("audit", "keygen", "--data-dir", d, "--force").exit_code == 0  # rotate A -> B, logged and in the ring
    with open_log(d) as log:
        (rot,) = list(log.entries(kind="key_rotation"))
        at = rot.data["retired_at"]
        after, backdated = tmp_path / "after", tmp_path / "backdated"
        after.write_text(make_checkpoint(log, a, now=at + 60))
        backdated.write_text(make_checkpoint(log, a, now=at - 60))  # over the tree that records the retirement
        report = tmp_path / "r.txt"
        report.write_text("x\n")
        sign_report(report, a, log, inputs={}, period={}, used=[], now=at + 60)
    r = run("audit", "verify", "--data-dir", d, "--checkpoint", before)
    assert r.exit_code == 0, r.output  # what A signed in its term still verifies through the keyring
    r = run("audit", "verify", "--data-dir", d, "--checkpoint", after)
    assert r.exit_code == 1, r.output
    assert f"{after}: signed by key {a.key_id}, retired at" in r.output and "after its retirement" in r.output
    r = run("audit", "verify", "--data-dir", d, "--checkpoint", backdated)
    assert r.exit_code == 1 and f"audit entry {rot.seq} records that retirement" in r.output, r.output
    r = run("audit", "verify", report, "--data-dir", d)
    assert r.exit_code == 1 and f"signed by key {a.key_id}, retired at" in r.output, r.output
    # the successor B signed nothing before it was made
    with open_log(d) as log:
        early = tmp_path / "early"
        early.write_text(make_checkpoint(log, load_signing_key(first.private), now=at - 3600))
    r = run("audit", "verify", "--data-dir", d, "--checkpoint", early)
    assert r.exit_code == 1 and "before the key existed" in r.output, r.output


def test_a_proof_of_an_entry_whose_body_no_longer_states_its_leaf_is_refused(tmp_path):
    d = _data(tmp_path)
    c = sqlite3.connect(d / "audit.sqlite")
    seq, body = c.execute("SELECT seq, body FROM entries WHERE kind='job_record' ORDER BY seq LIMIT 1").fetchone()
    assert '"account":"a"' in body
    c.execute("UPDATE entries SET body=? WHERE seq=?", (body.replace('"account":"a"', '"account":"b"'), seq))
    c.commit()
    c.close()
    for args in (("--entry", seq), ("--since", 1)):
        r = run("audit", "proof", "--data-dir", d, *args)
        assert r.exit_code == 1, r.output
        assert f"TAMPERED: audit entry {seq}: content does not match its leaf hash" in r.output, r.output
    assert run("audit", "proof", "--data-dir", d, "--entry", seq + 1).exit_code == 0  # another entry's proof stands


def test_a_store_value_the_log_cannot_hold_is_tampering_named(tmp_path):
    d = _data(tmp_path)
    _sql(d, "UPDATE usage SET energy_j = 9e999 WHERE job_id='2'")
    r = run("audit", "verify", "--store", "--data-dir", d)
    assert r.exit_code == 1, r.output
    assert "TAMPERED: store row usage:2 (job 2 usage): energy_joules: inf" in r.output, r.output
    r = run("priority", "feed", "--data-dir", d)
    assert r.exit_code == 1 and "TAMPERED: store row usage:2 (job 2 usage)" in r.output, r.output


@pytest.mark.parametrize("tamper, words", [
    ("UPDATE entries SET body = CAST(body AS BLOB) WHERE seq = 4", "audit entry 4: body is stored as bytes"),
    ("UPDATE entries SET leaf = hex(leaf) WHERE seq = 4", "audit entry 4: leaf hash is stored as str"),
    ("UPDATE meta SET value = 'many' WHERE key = 'tree_size'", "tree size 'many' is not a count of entries"),
])
def test_log_columns_of_another_type_are_named(tmp_path, tamper, words):
    d = _data(tmp_path)
    _sql(d, tamper, db="audit.sqlite")
    for cmd in (("audit", "verify"), ("audit", "explain", "1"), ("priority", "feed")):
        r = run(*cmd, "--data-dir", d)
        assert r.exit_code == 1, r.output
        assert "unexpected" not in r.output and "Error" not in r.output, r.output
    r = run("audit", "verify", "--data-dir", d)
    assert f"TAMPERED: {words}" in r.output or words in r.output, r.output


def test_usage_logged_after_a_feed_is_no_discrepancy(tmp_path):
    """A feed charged running job 3 before anything measured it; its usage, logged since, is not what that feed
    used: no DIFFERS (and, the job running and its hour not over, no row that appeared late)."""
    d = _data(tmp_path)
    now = time.time()
    start = datetime.fromtimestamp(now - 3600, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    (tmp_path / "sacct3.txt").write_text(SACCT.splitlines()[0] + f"\n3|c|alice|1001|a|gpu|gres/gpu=1|{start}|{start}"
                                         "|Unknown|RUNNING|n3\n")
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", tmp_path / "sacct3.txt").exit_code == 0
    assert run("priority", "feed", "--data-dir", d).exit_code == 0
    store = Store(d / "gpuledger.sqlite")
    try:  # the last five minutes: an hour that is not over by the late window
        store.ingest(Batch("n3", 0, "n3", tuple(_s(now - 300 + 10 * k, "n3", "G0", "3") for k in range(29))))
    finally:
        store.close()
    r = run("audit", "record", "--data-dir", d)
    assert r.exit_code == 0, r.output
    r = run("audit", "verify", "--data-dir", d)
    assert r.exit_code == 0, r.output
    r = run("audit", "explain", "3", "--data-dir", d)
    assert r.exit_code == 0 and "DIFFER" not in r.output and "2. measurements: job total" in r.output, r.output
