"""The database seam (collector.db) on both engines: the portable dialect reads and writes the same on each."""

from gpuledger.collector.db import open_database, upsert


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
