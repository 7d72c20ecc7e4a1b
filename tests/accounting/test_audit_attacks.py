"""Attacks by whoever can write the data directory, tried end to end through the CLI: each must fail against an
earlier checkpoint or a pinned public key, naming the first changed entry or range (exit 1); bad input exits 2."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import stat
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from audit_cli import CONFIG, run

from gpuledger.accounting.audit import AuditLog, keygen, load_signing_key, open_log, record_usage, sign_report
from gpuledger.accounting.audit.explain import explain
from gpuledger.collector.auditlog import canonical_json
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store
from gpuledger.collector.validate import Batch
from gpuledger.schema.records import GpuSample, JobRecord, JobUsage

T0 = datetime(2026, 10, 5, tzinfo=UTC).timestamp()



def _s(ts, gpu, job):
    return GpuSample(ts=ts, host="n1", gpu_uuid=gpu, gpu_index=int(gpu[-1]), model="NVIDIA H200", sm_active_ratio=0.5,
                     energy_joules=360.0 * (ts - T0), job_ids=(job,))


@pytest.fixture()
def data_dir(tmp_path):
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    try:
        store.ingest(Batch("a", 0, "n1", tuple(_s(T0 + 10 * k, g, j) for g, j in (("G0", "1"), ("G1", "2"))
                                                 for k in range(361))))
    finally:
        store.close()
    (d / "gpuledger.toml").write_text(CONFIG)
    jobs = tmp_path / "sacct.txt"
    jobs.write_text("JobID|Cluster|User|UID|Account|Partition|AllocTRES|Submit|Start|End|State\n"
                    "1|c|alice|1001|a|gpu|gres/gpu=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|COMPLETED\n"
                    "2|c|bob|1002|a|gpu|gres/gpu=1|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00|COMPLETED\n")
    r = run("jobs", "import", "--data-dir", d, "--sacct-parsable", jobs)
    assert r.exit_code == 0, r.output
    return d


def _fill(log: AuditLog, lo: int, hi: int) -> None:
    log.append_many(("usage_record", {"i": i, "gpu_s": i * 0.5}, str(1000 + i), None) for i in range(lo, hi + 1))


def _rebuild(path: Path, edit) -> None:
    """The attacker's full rewrite: every entry re-hashed, every subtree hash and the head recomputed, so the file
    is a consistent log of its (edited) entries. ``edit(seq, data) -> data``."""
    db = sqlite3.connect(path)
    rows = [json.loads(b) for (b,) in db.execute("SELECT body FROM entries ORDER BY seq")]
    db.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    times = iter([r["ts"] for r in rows])
    with AuditLog(path, clock=lambda: next(times)) as log:
        for r in rows:
            log.append(r["kind"], edit(r["seq"], r["data"]), r["job_id"], r["key"])


def _checkpoint(d: Path, out: Path) -> Path:
    r = run("audit", "checkpoint", "--data-dir", d, "--output", out)
    assert r.exit_code == 0, r.output
    return out


def test_rechain_and_resign_fails_against_checkpoints_and_the_pinned_key(data_dir, tmp_path):
    real = keygen()
    with open_log(data_dir) as log:
        n0 = log.size()
        _fill(log, n0 + 1, 10)
    cp1 = _checkpoint(data_dir, tmp_path / "cp1")
    with open_log(data_dir) as log:
        _fill(log, 11, 20)
    cp2 = _checkpoint(data_dir, tmp_path / "cp2")
    report = tmp_path / "r.csv"
    r = run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", report)
    assert r.exit_code == 0 and "signed manifest" in r.output, r.output
    r = run("audit", "verify", report, "--data-dir", data_dir, "--checkpoint", cp1, "--checkpoint", cp2)
    assert r.exit_code == 0, r.output
    assert "extends " + str(cp1) in r.output and "extends " + str(cp2) in r.output

    # The attacker rewrites entry 15 and re-hashes everything, then re-signs with a key of their own in the data dir.
    _rebuild(data_dir / "audit.sqlite", lambda seq, d: {**d, "gpu_s": 0.0} if seq == 15 else d)
    fake = keygen(data_dir / "audit-signing.key")
    with open_log(data_dir) as log:
        assert log.verify().ok  # internally consistent: only something signed elsewhere can tell
        sign_report(report, load_signing_key(fake.private), log, inputs={}, period={}, used=[])
    pin = ("--public-key", real.public)
    r = run("audit", "verify", "--data-dir", data_dir, "--checkpoint", cp1, "--checkpoint", cp2, *pin)
    assert r.exit_code == 1, r.output
    assert f"audit entries 11..20: changed: the log no longer extends {cp2}" in r.output
    assert f"entries 1..10 still verify against {cp1}" in r.output
    r = run("audit", "verify", report, "--data-dir", data_dir, *pin)
    assert r.exit_code == 1 and "neither the pinned key nor linked to it" in r.output
    # pinning the attacker's key makes the report verify, but not the checkpoints the real key signed
    r = run("audit", "verify", report, "--data-dir", data_dir, "--checkpoint", cp2, "--public-key", fake.public)
    assert r.exit_code == 1 and "signature does not verify" in r.output


def test_replaced_key_pair_fails_against_the_pinned_key(data_dir, tmp_path):
    real = keygen()
    pinned = tmp_path / "auditor-copy.pub"
    pinned.write_bytes(real.public.read_bytes())
    report = tmp_path / "r.csv"
    assert run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", report).exit_code == 0
    cp = _checkpoint(data_dir, tmp_path / "cp")
    # The attacker also owns the config dir: replaces the pair there and re-signs.
    for p in (real.private, real.public):
        p.unlink()
    keygen()
    assert run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", report).exit_code == 0
    assert run("audit", "verify", report, "--data-dir", data_dir).exit_code == 0  # the replaced default key agrees
    r = run("audit", "verify", report, "--data-dir", data_dir, "--public-key", pinned)
    assert r.exit_code == 1 and "neither the pinned key" in r.output
    forged = _checkpoint(data_dir, tmp_path / "forged")
    r = run("audit", "verify", "--data-dir", data_dir, "--checkpoint", forged, "--checkpoint", cp,
            "--public-key", pinned)
    assert r.exit_code == 1 and f"{forged}: the signature does not verify" in r.output


def test_several_checkpoints_narrow_to_the_first_rewritten_entry(tmp_path):
    keygen()
    d = tmp_path / "d"
    cps = []
    with open_log(d) as log:
        for k in range(4):
            _fill(log, 5 * k + 1, 5 * k + 5)
            cps.append(_checkpoint(d, tmp_path / f"cp{k}"))
    _rebuild(d / "audit.sqlite", lambda seq, data: {**data, "i": -1} if seq == 12 else data)
    r = run("audit", "verify", "--data-dir", d, *[x for c in cps for x in ("--checkpoint", c)])
    assert r.exit_code == 1
    first = r.output.index("TAMPERED")
    assert r.output[first:].startswith(f"TAMPERED: audit entries 11..15: changed: the log no longer extends {cps[2]}")
    assert f"extends {cps[1]}" in r.output  # 1..10 proven
    # truncation after a checkpoint: the deleted range is named
    _rebuild(d / "audit.sqlite", lambda seq, data: data)
    db = sqlite3.connect(d / "audit.sqlite")
    rows = db.execute("SELECT body FROM entries WHERE seq <= 17 ORDER BY seq").fetchall()
    db.close()
    _rebuild_rows(d / "audit.sqlite", [json.loads(b) for (b,) in rows])
    r = run("audit", "verify", "--data-dir", d, "--checkpoint", cps[3])
    assert r.exit_code == 1 and "audit entries 18..20: missing (deleted)" in r.output


def _rebuild_rows(path: Path, rows: list[dict]) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    times = iter([r["ts"] for r in rows])
    with AuditLog(path, clock=lambda: next(times)) as log:
        for r in rows:
            log.append(r["kind"], r["data"], r["job_id"], r["key"])


def test_checkpoint_is_a_signed_note_a_go_verifier_accepts(tmp_path):
    k = keygen()
    with open_log(tmp_path / "d") as log:
        _fill(log, 1, 3)
        root = log.root()
    text = _checkpoint(tmp_path / "d", tmp_path / "cp").read_text()
    body, sig_line = text.split("\n\n")
    lines = body.split("\n")
    assert lines[:3] == ["gpuledger-audit", "3", base64.b64encode(root).decode()]
    assert lines[3].startswith("time 20") and lines[4] == f"key {k.key_id}"
    assert sig_line.startswith("\u2014 gpuledger-audit ")
    blob = base64.b64decode(sig_line.split(" ")[2])
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

    pub = load_pem_public_key(k.public.read_bytes())
    raw = pub.public_bytes(Encoding.Raw, PublicFormat.Raw)
    # golang.org/x/mod/sumdb/note: key hash = SHA-256(name || "\n" || 0x01 || key)[:4], signature over the text
    assert blob[:4] == hashlib.sha256(b"gpuledger-audit\n\x01" + raw).digest()[:4]
    pub.verify(blob[4:], (body + "\n").encode())
    r = run("audit", "verify", "--data-dir", tmp_path / "d", "--checkpoint", tmp_path / "cp")
    assert r.exit_code == 0, r.output
    (tmp_path / "bad").write_text("not a checkpoint\n")
    r = run("audit", "verify", "--data-dir", tmp_path / "d", "--checkpoint", tmp_path / "bad")
    assert r.exit_code == 2 and "not a signed note" in r.output


def test_store_edits_are_refused_not_laundered(data_dir):
    keygen()
    now_args = ("--data-dir", data_dir)
    r = run("priority", "feed", *now_args)
    assert r.exit_code == 0, r.output
    with open_log(data_dir) as log:
        logged = log.latest("usage:1")
        assert logged.data["final"] is True and logged.data["energy_joules"] == pytest.approx(360.0 * 3600)
        size = log.size()
    db = sqlite3.connect(data_dir / "gpuledger.sqlite")
    db.execute("UPDATE usage SET energy_j = energy_j / 2 WHERE job_id='1'")
    db.commit()
    db.close()
    r = run("priority", "feed", *now_args)
    assert r.exit_code == 1 and "refused" in r.output and "job 1 usage energy_joules" in r.output
    with open_log(data_dir) as log:
        assert log.size() == size  # nothing appended
    r = run("audit", "verify", "--store", *now_args)
    assert r.exit_code == 1
    row = next(line for line in r.output.splitlines() if line.startswith("1\tusage\tenergy_joules"))
    assert row.split("\t")[3:] == [json.dumps(360.0 * 3600), json.dumps(180.0 * 3600), str(logged.seq)]
    r = run("report", "usage", *now_args, "--format", "csv", "-o", data_dir.parent / "r.csv")
    assert r.exit_code == 1 and "NOT signed" in r.output
    r = run("priority", "feed", *now_args, "--accept-store-changes", "meter recalibrated (ticket 42)")
    assert r.exit_code == 0, r.output
    with open_log(data_dir) as log:
        c = log.latest("usage:1")
        assert c.kind == "correction" and c.data["corrects"] == logged.seq
        assert c.data["reason"] == "meter recalibrated (ticket 42)"
        assert c.data["changes"] == [{"field": "energy_joules", "logged": 360.0 * 3600, "stored": 180.0 * 3600}]
        g = log.latest("usage:1/n1/G0")  # the per-GPU row the charge reads is corrected alike
        assert g.kind == "correction" and g.data["changes"] == c.data["changes"]
        ex = explain(log, "1")
    meas = next(s for s in ex.steps if s.name == "measurements")
    assert f"corrected by entry {g.seq}, which corrects entry {g.data['corrects']}" in meas.summary
    assert run("audit", "verify", "--store", *now_args).exit_code == 0


def test_store_job_record_edit_is_listed(data_dir):
    db = sqlite3.connect(data_dir / "gpuledger.sqlite")
    (data,) = db.execute("SELECT data FROM jobs WHERE job_id='2'").fetchone()
    d = json.loads(data)
    d["account"] = "other"
    db.execute("UPDATE jobs SET data=? WHERE job_id='2'", (json.dumps(d, sort_keys=True),))
    db.commit()
    db.close()
    r = run("audit", "verify", "--store", "--data-dir", data_dir)
    assert r.exit_code == 1 and '2\tjob record\taccount\t"a"\t"other"' in r.output


def test_queries_append_nothing_and_explain_keeps_the_site_factor(data_dir):
    assert run("priority", "feed", "--data-dir", data_dir).exit_code == 0
    with open_log(data_dir) as log:
        size = log.size()
    r = run("fairshare", "--data-dir", data_dir)
    assert r.exit_code == 0, r.output
    assert run("fairshare", "--data-dir", data_dir, "--format", "json").exit_code == 0
    with open_log(data_dir) as log:
        assert log.size() == size
    assert run("fairshare", "--data-dir", data_dir, "--record").exit_code == 0  # a fairshare entry without a feed
    r = run("audit", "explain", "1", "--data-dir", data_dir)
    assert r.exit_code == 0, r.output
    for step in ("1. job record", "2. measurements", "3. charged usage", "4. decayed usage", "5. fairshare",
                 "6. site factor: round(1000 x"):
        assert step in r.output, r.output
    assert "first sample 2026-10-05T00:00:00Z, last sample 2026-10-05T01:00:00Z" in r.output
    assert "calc period 300 s" in r.output
    assert "3600.0 allocated GPU-s = 3600.0 (recomputed from the logged record: same)" in r.output
    assert "not proven: applied" in r.output


def test_explain_never_counts_a_job_twice(tmp_path):
    def u(host, gpu, alloc):
        return JobUsage("9", host, gpu, T0, T0 + 600, 60, alloc, alloc / 2, alloc * 100)

    with open_log(tmp_path) as log:
        record_usage(log, [u("n1", "G0", 300.0), u("n1", "G1", 300.0), u("n2", "G0", 600.0)])  # per GPU
        assert "3 per-GPU record(s)" in explain(log, "9").steps[0].summary
        record_usage(log, [u("n1", "*", 600.0)])  # a job total while only n1 had reported
        record_usage(log, [u("*", "*", 1200.0)])  # and the total over both hosts
        ex = explain(log, "9")
    (meas,) = [s for s in ex.steps if s.name == "measurements"]
    assert meas.summary.startswith("job total") and "1200 allocated GPU-s" in meas.summary
    assert len(meas.entries) == 1
    assert any(m.startswith("job record: ") for m in ex.missing)


def test_head_entry_not_json_and_forged_seq0_are_named_without_traceback(data_dir, tmp_path):
    keygen()
    report = tmp_path / "r.csv"
    assert run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", report).exit_code == 0
    db = sqlite3.connect(data_dir / "audit.sqlite")
    (head,) = db.execute("SELECT max(seq) FROM entries").fetchone()
    db.execute("UPDATE entries SET body='not json' WHERE seq=?", (head,))
    db.commit()
    r = run("audit", "verify", report, "--data-dir", data_dir)
    assert r.exit_code == 1 and f"audit entry {head}: body is not a canonical audit entry" in r.output
    for job in ("1", "2"):
        r = run("audit", "explain", job, "--data-dir", data_dir)
        assert r.exit_code == 1 and f"audit entry {head}: body is not a canonical audit entry" in r.output
    r = run("priority", "feed", "--data-dir", data_dir)
    assert r.exit_code == 1 and f"audit entry {head}" in r.output
    db.execute("UPDATE entries SET body=? WHERE seq=?", ("x", head))
    body = canonical_json({"seq": 0, "ts": 1.0, "kind": "job_record", "job_id": "1", "key": None, "data": {}})
    db.execute("DELETE FROM entries WHERE seq=?", (head,))
    db.execute("INSERT INTO entries VALUES (0,'job_record','1',NULL,?,?)",
               (body, hashlib.sha256(b"\0" + body.encode()).digest()))
    db.commit()
    db.close()
    r = run("audit", "verify", "--data-dir", data_dir)
    assert r.exit_code == 1 and "audit entry 0: inserted" in r.output


def test_key_files_and_data_dir_permissions(tmp_path, monkeypatch):
    old = os.umask(0)
    try:
        k = keygen(tmp_path / "keys" / "k.key")
        assert stat.S_IMODE(os.stat(k.private).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(k.public).st_mode) == 0o644  # never world-writable
        store = Store(tmp_path / "data" / "gpuledger.sqlite")
        store.close()
        assert stat.S_IMODE(os.stat(tmp_path / "data").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "data" / "gpuledger.sqlite").st_mode) == 0o600
    finally:
        os.umask(old)
    os.chmod(k.private, 0o644)
    monkeypatch.setenv("GPULEDGER_AUDIT_KEY", str(k.private))
    with open_log(tmp_path / "data") as log:
        _fill(log, 1, 2)
    r = run("audit", "checkpoint", "--data-dir", tmp_path / "data")
    assert r.exit_code == 2 and "readable by group or others (mode 0644)" in r.output
    r = run("audit", "keygen", "--data-dir", tmp_path / "data", "--private-key", tmp_path / "data" / "k.key")
    assert r.exit_code == 2 and "inside the data directory" in r.output
    r = run("audit", "keygen", "--data-dir", tmp_path / "data", "--private-key", k.private)
    assert r.exit_code == 2 and "exists" in r.output


def test_rotation_keeps_old_reports_verifiable_and_is_logged(data_dir, tmp_path):
    first = keygen()
    old_pub = tmp_path / "old.pub"
    old_pub.write_bytes(first.public.read_bytes())
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", a).exit_code == 0
    r = run("audit", "keygen", "--data-dir", data_dir, "--force")
    assert r.exit_code == 0 and "rotation recorded in audit entry" in r.output, r.output
    assert run("report", "usage", "--data-dir", data_dir, "--format", "csv", "-o", b).exit_code == 0
    ids = {json.loads(Path(str(p) + ".manifest.json").read_text())["manifest"]["key_id"] for p in (a, b)}
    assert len(ids) == 2
    r = run("audit", "verify", a, b, "--data-dir", data_dir)  # pinned: the new default key; keyring links the old
    assert r.exit_code == 0, r.output
    ring = first.private.with_name("audit-keyring.json")
    ring.unlink()  # the rotation entry in the log links them as well (it is signed by both keys)
    assert run("audit", "verify", a, b, "--data-dir", data_dir).exit_code == 0
    assert run("audit", "verify", a, b, "--data-dir", data_dir, "--public-key", old_pub).exit_code == 0
    with open_log(data_dir) as log:
        (rot,) = list(log.entries(kind="key_rotation"))
    assert rot.data["retired"]["key_id"] != rot.data["successor"]["key_id"]
    # a rotation record forged by an attacker's key links nothing
    other = keygen(tmp_path / "attacker.key")
    c = tmp_path / "c.csv"
    c.write_text("x\n")
    with open_log(data_dir) as log:
        from gpuledger.accounting.audit.keys import rotation_record

        evil = load_signing_key(other.private)
        log.append("key_rotation", rotation_record(evil, evil, 0.0))
        sign_report(c, evil, log, inputs={}, period={}, used=[])
    r = run("audit", "verify", c, "--data-dir", data_dir)
    assert r.exit_code == 1 and "neither the pinned key" in r.output


def test_posted_job_records_are_logged_before_they_are_stored(tmp_path):
    store = Store(tmp_path / "d" / "gpuledger.sqlite")
    s = CollectorServer(store).start()
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:
            rec = JobRecord("7", cluster="c", user="ann", uid=5, account="a", gpus=1, start=T0, end=T0 + 60)
            assert c.post("/api/v1/jobs", json=[rec.to_dict()]).json() == {"received": 1, "changed": 1}
            with open_log(tmp_path / "d") as log:
                (e,) = list(log.entries(job_id="7"))
            assert e.kind == "job_record" and e.data["account"] == "a" and e.data["uid"] is None
            assert e.data["user"].startswith("u-")  # pseudonymized
    finally:
        s.stop()
        store.close()
    # When the log cannot be written, the record is not stored either.
    store = Store(tmp_path / "e" / "gpuledger.sqlite")
    (tmp_path / "e" / "audit.sqlite").mkdir()
    s = CollectorServer(store).start()
    try:
        r = httpx.post(s.url + "/api/v1/jobs", json=[JobRecord("8", cluster="c").to_dict()], timeout=10)
        assert r.status_code == 500 and store.jobs() == []
    finally:
        s.stop()
        store.close()


@pytest.mark.parametrize("policy", ["allocated", "blend"])
def test_explain_proves_a_partly_measured_job(tmp_path, policy):
    # Slurm allocated job 1 two GPUs for an hour (7200 GPU-s); an agent measured one of them (G0: 3600 GPU-s at SM
    # activity 0.5). The charge splits into the measured part, which the logged usage record recomputes to
    # (allocated: 3600 GPU-s; blend 0.25 x 3600 + 0.75 x 1800 = 2250), and the 3600 GPU-s nobody measured,
    # charged as fully used by the default rule (3600): neither part may read as DIFFERS.
    d = tmp_path / "data"
    store = Store(d / "gpuledger.sqlite", clock=lambda: T0 + 10_000)
    try:
        store.ingest(Batch("a", 0, "n1", tuple(_s(T0 + 10 * k, "G0", "1") for k in range(361))))
    finally:
        store.close()
    (d / "gpuledger.toml").write_text(CONFIG.replace('policy = "allocated"', f'policy = "{policy}"'))
    jobs = tmp_path / "sacct.txt"
    jobs.write_text("JobID|Cluster|User|UID|Account|Partition|AllocTRES|Submit|Start|End|State\n"
                    "1|c|alice|1001|a|gpu|gres/gpu=2|2026-10-05T00:00:00|2026-10-05T00:00:00|2026-10-05T01:00:00"
                    "|COMPLETED\n")
    assert run("jobs", "import", "--data-dir", d, "--sacct-parsable", jobs).exit_code == 0
    assert run("priority", "feed", "--data-dir", d).exit_code == 0
    r = run("audit", "explain", "1", "--data-dir", d)
    assert r.exit_code == 0, r.output
    measured = {"allocated": "3600.0", "blend": "2250.0"}[policy]
    assert f"= {measured} (recomputed from the logged record: same)" in r.output, r.output
    assert "+ 3600.0 allocated GPU-s nobody measured, charged by rule 'allocated': 3600.0" in r.output, r.output
    assert f"charged {float(measured) + 3600.0!r}" in r.output and "DIFFER" not in r.output, r.output
