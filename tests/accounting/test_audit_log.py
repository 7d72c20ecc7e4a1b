"""The Merkle audit log: canonical entries, RFC 9162 hashing checked by an independent implementation, proofs,
and tampering with its tables named by its first bad entry or range; on both engines: its own SQLite file and the
schema ``audit`` of a PostgreSQL ledger."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from gpuledger.collector.auditlog import AUDIT_NAME, AuditError, AuditLog, canonical_json, merkle, open_audit_log
from gpuledger.collector.db import Database, open_database


class Place:
    """Where a log lives: its own SQLite file (``url`` None), or the schema ``audit`` of the PostgreSQL ledger
    at ``url``. ``raw()`` opens its tables as whoever can write them would."""

    def __init__(self, url: str | None, data_dir: Path) -> None:
        self.url, self.data_dir = url, data_dir

    def log(self, **kw) -> AuditLog:
        return open_audit_log(self.url, self.data_dir, **kw)

    def raw(self) -> Database:
        return open_database(self.url, schema="audit") if self.url else open_database(self.data_dir / AUDIT_NAME)


@pytest.fixture(params=["sqlite", "postgresql"])
def place(request, tmp_path) -> Place:
    return Place(request.getfixturevalue("pg_url") if request.param == "postgresql" else None, tmp_path / "d")


def test_canonical_json_is_sorted_compact_and_float_exact():
    assert (canonical_json({"b": 0.1 + 0.2, "a": [1, (2, 3)], "c": None})
            == '{"a":[1,[2,3]],"b":0.30000000000000004,"c":null}')
    assert json.loads(canonical_json({"x": 1e-300 / 3}))["x"] == 1e-300 / 3
    with pytest.raises(AuditError, match=r"\$\.usage\.power: nan"):
        canonical_json({"usage": {"power": float("nan")}})
    with pytest.raises(AuditError, match=r"\$\.k\[1\]: <object object.*cannot be written"):
        canonical_json({"k": [1, object()]})


# -- an independent RFC 9162 implementation, written from the RFC's text, sharing nothing with the product --------
def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def ref_mth(data: list[bytes]) -> bytes:
    """RFC 9162 2.1.1: MTH({}) = SHA-256(); MTH({d0}) = SHA-256(0x00 || d0); else split at the largest 2^i < n."""
    n = len(data)
    if n == 0:
        return _h(b"")
    if n == 1:
        return _h(b"\x00" + data[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return _h(b"\x01" + ref_mth(data[:k]) + ref_mth(data[k:]))


def ref_verify_inclusion(leaf_index: int, tree_size: int, leaf: bytes, path: list[bytes], root: bytes) -> bool:
    """RFC 9162 2.1.3.2, step by step."""
    if leaf_index >= tree_size:
        return False
    fn, sn, r = leaf_index, tree_size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn % 2 == 1 or fn == sn:
            r = _h(b"\x01" + p + r)
            if fn % 2 == 0:
                while not (fn % 2 == 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            r = _h(b"\x01" + r + p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def ref_verify_consistency(first: int, second: int, first_hash: bytes, second_hash: bytes, path: list[bytes]) -> bool:
    """RFC 9162 2.1.4.2, step by step."""
    if not path:
        return False
    path = list(path)
    if first & (first - 1) == 0:  # an exact power of 2
        path.insert(0, first_hash)
    fn, sn = first - 1, second - 1
    while fn % 2 == 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn % 2 == 1 or fn == sn:
            fr = _h(b"\x01" + c + fr)
            sr = _h(b"\x01" + c + sr)
            if fn % 2 == 0:
                while not (fn % 2 == 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            sr = _h(b"\x01" + sr + c)
        fn >>= 1
        sn >>= 1
    return fr == first_hash and sr == second_hash and sn == 0


def _fill(log: AuditLog, n: int) -> None:
    log.append_many(("usage_record", {"i": i, "gpu_s": i * 0.5}, str(1000 + i), None) for i in range(1, n + 1))


def test_proofs_verify_with_an_independent_rfc9162_implementation(place):
    with place.log() as log:
        bodies: list[bytes] = []
        for n in range(1, 34):
            _fill(log, 1) if n > 1 else _fill(log, 1)
            bodies = [r[0].encode() for r in log._db.execute("SELECT body FROM entries ORDER BY seq")]
            assert log.root() == ref_mth(bodies), n  # leaf = SHA-256(0x00 || entry body)
            for m in range(1, n + 1):
                root_m = ref_mth(bodies[:m])
                assert log.root(m) == root_m
                assert ref_verify_inclusion(m - 1, n, _h(b"\x00" + bodies[m - 1]), log.inclusion_proof(m, n),
                                            log.root())
                if m < n:
                    proof = log.consistency_proof(m, n)
                    assert ref_verify_consistency(m, n, root_m, log.root(), proof), (m, n)
                    # and a proof against a different old root fails
                    assert not ref_verify_consistency(m, n, _h(b"x"), log.root(), proof)
        assert not ref_verify_inclusion(3, 33, _h(b"\x00" + bodies[4]), log.inclusion_proof(4, 33), log.root())
    # the product's own verifiers agree with the reference on the same proofs
    assert merkle.verify_consistency(5, 33, ref_mth(bodies[:5]), ref_mth(bodies), merkle.consistency_proof(
        5, 33, lambda a, b: ref_mth(bodies[a:b])))


def test_append_builds_the_tree_and_files_are_private(place, tmp_path):
    old = os.umask(0)
    try:
        with place.log(clock=lambda: 1234.5) as log:
            _fill(log, 5)
            res = log.verify()
            assert res.ok and res.entries == 5
            e = log.get(3)
            body = canonical_json({"seq": 3, "ts": 1234.5, "kind": "usage_record", "job_id": "1003", "key": None,
                                   "data": {"i": 3, "gpu_s": 1.5}})
            assert e.leaf == _h(b"\x00" + body.encode())
            assert log.head() == (5, log.root().hex())
            with pytest.raises(AuditError, match="kind 'bogus'"):
                log.append("bogus", {})
            assert log.size() == 5  # a rejected item writes nothing
    finally:
        os.umask(old)
    if place.url:
        assert not (tmp_path / "d").exists()  # nothing on disk: the log is in the ledger's database
        return
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
    for name in ("audit.sqlite", "audit.sqlite-wal"):
        p = tmp_path / "d" / name
        if p.exists():
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, name


def test_keyed_entries_skip_unchanged_data(place):
    with place.log() as log:
        assert log.append("job_record", {"end": None}, "7", "job:c/7") is not None
        assert log.append("job_record", {"end": None}, "7", "job:c/7") is None
        assert log.append("job_record", {"end": 99.0}, "7", "job:c/7") is not None
        assert [e.data["end"] for e in log.entries(job_id="7")] == [None, 99.0]
        assert log.latest("job:c/7").data == {"end": 99.0}


def test_latest_by_prefix_reads_the_newest_entry_of_every_key_at_once(place, monkeypatch):
    from gpuledger.collector.auditlog import log as log_module

    monkeypatch.setattr(log_module, "_ENTRIES_PAGE", 2)  # entries() pages: every page joins the next
    with place.log() as log:
        log.append_many([("usage_record", {"v": 1}, "7", "usage:7"), ("usage_record", {"v": 2}, "7", "usage:7"),
                         ("usage_record", {"v": 3}, "8", "usage:8/n1/G0"), ("job_record", {"v": 4}, "7", "job:c/7"),
                         ("usage_record", {"v": 5}, "9", "usage;"), ("fairshare", {"v": 6}, None, None)])
        got = log.latest_by_prefix("usage:")
        assert {k: e.data["v"] for k, e in got.items()} == {"usage:7": 2, "usage:8/n1/G0": 3}
        assert list(log.latest_by_prefix("job:")) == ["job:c/7"] and log.latest_by_prefix("gap:") == {}
        assert [e.seq for e in log.entries(kind="usage_record", newest_first=True)] == [5, 3, 2, 1]
        assert [e.seq for e in log.entries()] == [1, 2, 3, 4, 5, 6]


# Each tampering is done the way an attacker with write access to the log's tables would do it (plain SQL).
def _rows(db):
    return db.execute("SELECT seq, kind, job_id, key, body, leaf FROM entries ORDER BY seq").fetchall()


def _modify(db):
    seq, *_, body, leaf = _rows(db)[4]
    db.execute("UPDATE entries SET body=? WHERE seq=?", (body.replace('"gpu_s":2.5', '"gpu_s":0.5'), seq))


def _modify_and_rehash_leaf(db):
    seq, *_, body, leaf = _rows(db)[4]
    body = body.replace('"gpu_s":2.5', '"gpu_s":0.5')
    db.execute("UPDATE entries SET body=?, leaf=? WHERE seq=?", (body, _h(b"\x00" + body.encode()), seq))


def _delete(db):
    db.execute("DELETE FROM entries WHERE seq=5")


def _delete_and_renumber(db):
    db.execute("DELETE FROM entries WHERE seq=5")
    db.execute("UPDATE entries SET seq=seq-1 WHERE seq>5")


def _truncate_tail(db):
    db.execute("DELETE FROM entries WHERE seq>=9")


def _insert_and_renumber(db):
    db.execute("UPDATE entries SET seq=seq+100 WHERE seq>=5")
    db.execute("UPDATE entries SET seq=seq-99 WHERE seq>=105")
    body = canonical_json({"seq": 5, "ts": 1.0, "kind": "usage_record", "job_id": "666", "key": None,
                           "data": {"i": 666}})
    db.execute("INSERT INTO entries VALUES (5,'usage_record','666',NULL,?,?)", (body, _h(b"\x00" + body.encode())))


def _forge_seq0(db):
    body = canonical_json({"seq": 0, "ts": 1.0, "kind": "usage_record", "job_id": "666", "key": None, "data": {}})
    db.execute("INSERT INTO entries VALUES (0,'usage_record','666',NULL,?,?)", (body, _h(b"\x00" + body.encode())))


def _reorder(db):
    db.execute("UPDATE entries SET seq=-1 WHERE seq=5")
    db.execute("UPDATE entries SET seq=5 WHERE seq=6")
    db.execute("UPDATE entries SET seq=6 WHERE seq=-1")


def _retarget_job(db):
    db.execute("UPDATE entries SET job_id='9999' WHERE seq=5")  # hides the entry from explain


def _delete_node(db):
    db.execute("DELETE FROM nodes WHERE level=2 AND idx=1")


def _not_json(db):
    db.execute("UPDATE entries SET body='{not json' WHERE seq=10")


def _nested_too_deeply(db):
    """Entry 5's data replaced by valid JSON nested deeper than the decoder goes (labels intact)."""
    seq, *_, body, leaf = _rows(db)[4]
    pre, post = body[:body.index('"data":') + 7], body[body.index(',"job_id"'):]
    db.execute("UPDATE entries SET body=? WHERE seq=?", (pre + "[" * 200_000 + "]" * 200_000 + post, seq))


def _append_outside(db):
    body = canonical_json({"seq": 11, "ts": 1.0, "kind": "usage_record", "job_id": "1", "key": None, "data": {}})
    db.execute("INSERT INTO entries VALUES (11,'usage_record','1',NULL,?,?)", (body, _h(b"\x00" + body.encode())))


@pytest.mark.parametrize(
    "tamper, first, last, words",
    [
        (_modify, 5, 5, "modified"),
        (_modify_and_rehash_leaf, 5, 6, "re-hashed"),
        (_delete, 5, 5, "missing"),
        (_delete_and_renumber, 5, 5, "missing"),
        (_truncate_tail, 9, 10, "missing"),
        (_insert_and_renumber, 5, 5, "inserted"),
        (_forge_seq0, 0, 0, "inserted"),
        (_reorder, 5, 5, "out of order"),
        (_retarget_job, 5, 5, "job_id"),
        (_delete_node, 5, 8, "missing"),
        (_not_json, 10, 10, "not a canonical audit entry"),
        (_nested_too_deeply, 5, 5, "not a canonical audit entry"),
        (_append_outside, 11, 11, "appended outside"),
    ],
)
def test_tampering_is_detected_and_the_first_bad_entry_named(place, tamper, first, last, words):
    with place.log() as log:
        _fill(log, 10)
        assert log.verify().ok
    db = place.raw()
    tamper(db)
    db.close()
    with place.log() as log:
        res = log.verify()
    assert not res.ok
    assert (res.problem.first, res.problem.last or res.problem.first) == (first, last), str(res.problem)
    assert words in res.problem.reason
    assert res.proven == max(first - 1, 0)  # everything before the first bad entry is proven


def test_old_hash_chain_logs_are_named_not_misread(place):
    place.data_dir.mkdir()
    db = place.raw()
    db.script("CREATE TABLE entries (seq INTEGER PRIMARY KEY, kind TEXT, job_id TEXT, body TEXT, prev TEXT, "
              "hash TEXT)")
    db.close()
    with pytest.raises(AuditError, match="format 1"):
        place.log()


def test_a_file_that_is_not_a_database_is_named(tmp_path):
    (tmp_path / AUDIT_NAME).write_bytes(b"not sqlite" * 100)
    with pytest.raises(AuditError, match="not an audit log"):
        AuditLog(tmp_path / AUDIT_NAME)


def test_concurrent_appenders_never_fork_the_tree(place):
    """Two logs (two processes' worth of connections) on one store append from threads; each batch lands whole,
    in some order, the tree stays one tree, and a verify running meanwhile sees a consistent log every time."""
    place.data_dir.mkdir()
    logs = [place.log(), place.log()]
    errors: list[BaseException] = []

    def appender(log: AuditLog, name: str) -> None:
        try:
            for b in range(15):
                log.append_many(("usage_record", {"by": name, "b": b, "i": i}, f"{name}{b}", None) for i in range(4))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=appender, args=(log, name)) for log, name in zip(logs, "ab")]
    for t in threads:
        t.start()
    checks = 0
    while any(t.is_alive() for t in threads) or not checks:
        res = logs[checks % 2].verify()
        assert res.ok, res.problem
        checks += 1
    for t in threads:
        t.join()
    assert not errors, errors
    with place.log() as log:
        res = log.verify()
        assert res.ok and res.entries == log.size() == 2 * 15 * 4
        assert log.head() == (120, res.root.hex()) and log.root() == res.root
        entries = list(log.entries())
        assert [e.seq for e in entries] == list(range(1, 121))
        for k in range(0, 120, 4):  # one batch: four consecutive entries of one appender
            assert len({(e.data["by"], e.data["b"]) for e in entries[k:k + 4]}) == 1
        assert log.consistency_proof(40) and merkle.verify_consistency(
            40, 120, log.root(40), res.root, log.consistency_proof(40))
    for log in logs:
        log.close()


def test_open_audit_log_puts_the_log_beside_its_ledger(tmp_path, pg_url):
    data_dir = tmp_path / "d"
    with open_audit_log(None, data_dir) as log:
        log.append("usage_record", {"x": 1}, "1")
    assert (data_dir / AUDIT_NAME).exists() and log.path == data_dir / AUDIT_NAME
    with open_audit_log(str(tmp_path / "ledger.sqlite"), data_dir) as log:  # a SQLite ledger: the data dir's file
        assert log.size() == 1
    ledger = open_database(pg_url)  # the ledger's own tables, one of them named like the log's
    ledger.script("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    ledger.execute("INSERT INTO meta VALUES ('schema', '3')")
    other_dir = tmp_path / "other"
    with open_audit_log(pg_url, other_dir) as log:
        assert log.path is None and "schema audit" in log.location
        log.append("usage_record", {"x": 2}, "2")
    with open_audit_log(pg_url, tmp_path / "third") as log:  # any data dir: the log is the database's
        assert [e.data for e in log.entries()] == [{"x": 2}] and log.verify().ok
    assert ledger.execute("SELECT key, value FROM meta").fetchall() == [("schema", "3")]
    tables = ledger.execute("SELECT table_schema, table_name FROM information_schema.tables WHERE table_schema "
                            "IN ('public', 'audit') ORDER BY 1, 2").fetchall()
    assert tables == [("audit", "checkpoints"), ("audit", "entries"), ("audit", "meta"), ("audit", "nodes"),
                      ("public", "meta")]
    ledger.close()
    assert not other_dir.exists()


def test_a_rewritten_log_fails_against_earlier_checkpoints(place, tmp_path):
    """The attacker's full rewrite (entry 15 edited, every hash and the head recomputed) is consistent in itself;
    signed checkpoints of sizes 10 and 20 name what changed, and what still verifies."""
    from gpuledger.accounting.audit import keygen, load_signing_key, make_checkpoint, trusted_keys, verify_all

    pair = keygen(tmp_path / "keys" / "k.key")
    key = load_signing_key(pair.private)
    cps = []
    with place.log(clock=lambda: 1000.0) as log:
        for name in ("cp10", "cp20"):
            _fill(log, 10)
            cps.append((name, make_checkpoint(log, key, now=2000.0)))
            log.save_checkpoint(log.size(), cps[-1][1])
        assert log.saved_checkpoints() == [text for _, text in cps]
        assert verify_all(log, trusted_keys([pair.public]), cps).ok
        entries = list(log.entries())
    db = place.raw()
    db.script("DROP TABLE entries; DROP TABLE nodes; DROP TABLE meta; DROP TABLE checkpoints")
    db.close()
    with place.log(clock=lambda: 1000.0) as log:
        for e in entries:
            log.append(e.kind, {**e.data, "gpu_s": -1.0} if e.seq == 15 else e.data, e.job_id, e.key)
        assert log.verify().ok  # internally consistent: only something signed elsewhere can tell
        v = verify_all(log, trusted_keys([pair.public]), cps)
    assert not v.ok
    assert v.problems[0].startswith("audit entries 11..20: changed: the log no longer extends cp20"), v.problems
    assert [h.ok for h in v.heads] == [True, False]  # entries 1..10 still verify against cp10


def test_a_body_nested_too_deeply_is_named_as_tampering_by_every_command(tmp_path):
    from typer.testing import CliRunner

    from gpuledger.cli import app
    from gpuledger.collector.auditlog import EntryDamaged

    d = tmp_path / "d"
    with open_audit_log(None, d) as log:
        _fill(log, 10)
    db = open_database(d / AUDIT_NAME)
    _nested_too_deeply(db)
    db.close()
    with open_audit_log(None, d) as log:
        for read in (lambda: log.get(5), lambda: log.checked(5), lambda: list(log.entries(job_id="1005"))):
            with pytest.raises(EntryDamaged, match="^audit entry 5: body is not a canonical audit entry"):
                read()
    for args in (("verify",), ("explain", "1005"), ("proof", "--entry", "5")):
        r = CliRunner().invoke(app, ["audit", *args, "--data-dir", str(d)])
        assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
        assert "TAMPERED: audit entry 5: body is not a canonical audit entry (modified)" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
