"""The database seam (collector.db) on both engines: the portable dialect reads and writes the same on each."""

from gpuledger.collector.db import Upserts, open_database, upsert


def test_portable_dialect_on_sqlite_and_postgresql(pg_url, tmp_path):
    for db in (open_database(pg_url), open_database(tmp_path / "x.sqlite")):
        db.script('CREATE TABLE IF NOT EXISTS t (a TEXT NOT NULL, "end" REAL NOT NULL, b BLOB, PRIMARY KEY (a)) '
                  "WITHOUT ROWID")
        with db.transaction():
            db.lock("x")
            db.executemany(upsert("t", ["a", "end", "b"], ["a"]), [("k", 0.1 + 0.2, b"\x00\x01"), ("j", 1e-300, None)])
            db.execute(upsert("t", ["a", "end", "b"], ["a"]), ("k", 1 / 3, b"z"))
        rows = db.execute("SELECT a, \"end\", b FROM t WHERE a LIKE 'k%' AND \"end\" > ?", (0,)).fetchall()
        assert rows[0][1] == 1 / 3 and bytes(rows[0][2]) == b"z", rows
        assert db.columns("t") == ["a", "end", "b"] and db.has_table("t")
        r = db.execute('INSERT INTO t VALUES (?, ?, ?) ON CONFLICT (a) DO UPDATE SET "end"=t."end"+1 RETURNING "end"',
                       ("k", 0, None)).fetchone()
        assert r[0] == 1 / 3 + 1
        db.close()


def test_upserts_store_every_row_in_a_few_statements_on_both_engines(pg_url, tmp_path):
    """Upserts: rows inserted, then updated, in statements of 2^j rows (the group commit's accumulator rows); every
    count (none, one, a remainder of each size) stores each row once, with its last values."""
    upserts = Upserts("u", ["a", "n", "x"], ["a"])
    assert upserts.sizes == [128, 64, 32, 16, 8, 4, 2, 1]  # 500 values a statement at most, 3 a row
    for db in (open_database(pg_url), open_database(tmp_path / "u.sqlite")):
        db.script("CREATE TABLE IF NOT EXISTS u (a TEXT NOT NULL, n INTEGER NOT NULL, x REAL, PRIMARY KEY (a)) "
                  "WITHOUT ROWID")
        statements: list[str] = []
        if db.dialect == "sqlite":
            db.conn.set_trace_callback(lambda sql, seen=statements: seen.append(sql) if sql.startswith("INSERT")
                                       else None)
        for count, expected in ((0, 0), (1, 1), (37, 3), (300, 5)):  # 37 = 32 + 4 + 1, 300 = 2 x 128 + 32 + 8 + 4
            with db.transaction():
                db.execute("DELETE FROM u")
                upserts.write(db, [(f"k{i}", i, None) for i in range(count)])  # inserted
                statements.clear()
                upserts.write(db, [(f"k{i}", -i, i / 3) for i in reversed(range(count))])  # each updated
            assert len(statements) == (expected if db.dialect == "sqlite" else 0), count  # (traced on SQLite)
            rows = db.execute("SELECT a, n, x FROM u").fetchall()
            assert sorted(tuple(r) for r in rows) == sorted((f"k{i}", -i, i / 3) for i in range(count)), count
        db.close()


def test_a_libpq_host_list_reaches_the_host_that_answers(pg_url):
    """A site names its primary and standbys in one URL; libpq tries them in turn. Here the first host is a
    port nothing listens on, the second the real server."""
    from urllib.parse import urlsplit

    from gpuledger.collector.store import Store

    parts = urlsplit(pg_url)
    url = pg_url.replace(f"@{parts.hostname}:{parts.port}", f"@{parts.hostname}:1,{parts.hostname}:{parts.port}", 1)
    assert url != pg_url and "?" not in url
    store = Store(url + "?connect_timeout=5")
    try:
        assert store.batches_seen() == 0
    finally:
        store.close()
