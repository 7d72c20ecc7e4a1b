"""Several collectors, one ledger: two stores on one PostgreSQL database (or one SQLite file) take any host's
batches, in any interleaving, from threads, with resends and races, and the ledger ends exactly (==, every bit)
as one store's run on the same batches would leave it: no batch lost, none stored twice."""

from __future__ import annotations

import random
import threading

import pytest

from gpuledger.agent.push import encode_batch
from gpuledger.collector.store import COMPACTION_LOCK, IngestResult, Store
from gpuledger.collector.validate import parse_batch
from gpuledger.schema.records import GpuSample, JobRecord

NOW = 1_700_100_000.0
WINDOW_S = 120.0  # shorter than the batches' jitter: some samples come too late, most are late but accepted
KEY_ORDER = {  # every stored row, in key order: what "the same ledger" means
    "usage": "cluster, job_id, host, gpu",
    "gpus": "host, gpu_uuid, mig",
    "gpu_hours": "host, gpu_uuid, mig, hour",
    "energy_gaps": 'host, gpu_uuid, mig, start, "end"',
    "gpu_clusters": "host, gpu_uuid",
    "jobs": "cluster, job_id, source",
    "batch_keys": "host, agent_id, seq",
}


def host_stream(host: str, n: int, seed: int) -> list[GpuSample]:
    """Two GPUs of ``host``: a job change, a job spanning every host, a counter reset, a gap, jittered power."""
    rnd = random.Random(seed)
    out = []
    for g in ("G0", "G1"):
        e = 1e6
        for i in range(n):
            ts = NOW - 20_000 + i * 10.0 + rnd.uniform(0, 3) + (900 if i > n * 0.6 else 0)
            e = 50.0 if i == n // 2 else e + rnd.uniform(1000, 7000)
            job = ("multi",) if i < n // 3 else ((f"{host}-a", f"{host}-b") if g == "G0" else (f"{host}-a",))
            out.append(GpuSample(ts=ts, host=host, gpu_uuid=f"{host}-{g}", gpu_index=int(g[1]), model="H200",
                                 energy_joules=e, power_watts=rnd.uniform(75, 700), sm_active_ratio=rnd.random(),
                                 mem_used_bytes=rnd.randrange(10**11), job_ids=job))
    return out


def host_bodies(host: str, n: int = 90, seed: int = 0) -> list[bytes]:
    """The wire bodies an agent of ``host`` sends, in order: jittered order (so late samples straddle batches),
    every third batch in the columnar layout (the fast path), job metadata on one batch."""
    rnd = random.Random(seed)
    samples = sorted(host_stream(host, n, seed), key=lambda s: s.ts + rnd.uniform(-150, 150))
    bodies = []
    for seq, i in enumerate(range(0, len(samples), 11)):
        part = samples[i:i + 11]
        series = seq % 3 == 0
        if series:
            part = sorted(part, key=lambda s: s.ts)
        jobs = (JobRecord(f"{host}-a", user="ann", account="p", hosts=(host,)),) if seq == 4 else ()
        bodies.append(encode_batch(f"agent-{host}", host, seq, part, jobs=jobs, fmt="msgpack",
                                   layout="series" if series else "samples", cluster="c1"))
    return bodies


def ingest(store: Store, body: bytes) -> IngestResult:
    return store.ingest(parse_batch(body, "application/msgpack", NOW))


def rows(store: Store) -> dict[str, list[tuple]]:
    return {t: [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                for r in store.db.execute(f"SELECT * FROM {t} ORDER BY {order}").fetchall()]
            for t, order in KEY_ORDER.items()}


def assert_same_ledger(got: Store, want: Store, hosts: list[str]) -> None:
    """Stored rows (every GPU's totals and hour buckets, usage, gaps, jobs, batch keys), usage per GPU and per job
    and raw series: equal to the last bit. Sums the engine computes over rows (cluster totals, per-GPU energy over
    hours) are as exact on SQLite, whose row order is the key's; PostgreSQL adds in its own row order (and SQLite in
    extended precision), so across engines those may differ in the last bits of a sum of many rows."""
    assert rows(got) == rows(want)
    assert got.job_usage(per_gpu=True) == want.job_usage(per_gpu=True)
    assert got.job_usage() == want.job_usage()
    assert got.energy_gaps() == want.energy_gaps()
    same_engine = got.db.dialect == want.db.dialect
    for ours, theirs in ((got.gpu_energy(), want.gpu_energy()), ([got.totals()], [want.totals()])):
        if same_engine:
            assert ours == theirs
            continue
        assert [d.keys() for d in ours] == [d.keys() for d in theirs]
        for d, e in zip(ours, theirs):
            for k, v in d.items():
                assert v == (pytest.approx(e[k], rel=1e-12, abs=1e-9) if isinstance(v, float) else e[k]), k
    for host in hosts:
        for g in ("G0", "G1"):
            assert got.series(host, f"{host}-{g}", 0, 2e9) == want.series(host, f"{host}-{g}", 0, 2e9)


@pytest.fixture
def reference(tmp_path):
    """One store alone on its own SQLite ledger: what the shared ledger must equal."""
    stores = []

    def run(bodies_by_host: dict[str, list[bytes]]) -> tuple[Store, dict]:
        store = Store(tmp_path / f"ref{len(stores)}.sqlite", clock=lambda: NOW, window_s=WINDOW_S)
        stores.append(store)
        results = {(h, seq): ingest(store, b) for h, bodies in bodies_by_host.items() for seq, b in enumerate(bodies)}
        return store, results

    yield run
    for s in stores:
        s.close()


def test_one_hosts_batches_alternating_between_two_collectors_equal_one_collector(ledger, reference):
    bodies = host_bodies("n1")
    want, want_results = reference({"n1": bodies})
    a = Store(ledger, clock=lambda: NOW, window_s=WINDOW_S)
    b = Store(ledger, clock=lambda: NOW, window_s=WINDOW_S)
    try:
        # A, A, B, A, B, B, ...: every switch restores the host from what the other one committed
        order = [a, a, b, a, b, b, a, b, a, a, a, b] * 10
        got = {("n1", seq): ingest(order[seq], body) for seq, body in enumerate(bodies)}
        assert got == want_results  # accepted, duplicate and too-late samples alike
        assert sum(r.too_late for r in got.values()) > 0 and sum(r.accepted for r in got.values()) > 0
        assert_same_ledger(a, want, ["n1"])
        assert_same_ledger(b, want, ["n1"])
        # an agent that fails over resends what the other collector stored: a duplicate, whichever takes it
        assert ingest(a, bodies[2]).duplicate_batch and ingest(b, bodies[0]).duplicate_batch
        assert_same_ledger(a, want, ["n1"])
    finally:
        a.close()
        b.close()


def test_hosts_from_threads_across_two_collectors_with_resends_and_races(ledger, reference):
    hosts = [f"n{k}" for k in range(6)]
    bodies = {h: host_bodies(h, n=60, seed=k) for k, h in enumerate(hosts)}
    want, want_results = reference(bodies)
    stores = [Store(ledger, clock=lambda: NOW, window_s=WINDOW_S) for _ in range(2)]
    results: dict[tuple[str, int], list[IngestResult]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(hosts))

    def agent(k: int, host: str) -> None:
        rnd = random.Random(k)
        try:
            start.wait()
            for seq, body in enumerate(bodies[host]):
                first = rnd.randrange(2)
                out = [ingest(stores[first], body)]
                if rnd.random() < 0.3:  # failover: the reply was lost, the agent resends to the other collector
                    out.append(ingest(stores[1 - first], body))
                elif rnd.random() < 0.2:  # both at once: one stores it, the other answers duplicate
                    racer = threading.Thread(target=lambda o=out, s=stores[first], b=body: o.append(ingest(s, b)))
                    racer.start()
                    out.append(ingest(stores[1 - first], body))
                    racer.join()
                results[(host, seq)] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(k, h)) for k, h in enumerate(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        for key, out in results.items():
            stored = [r for r in out if not r.duplicate_batch]
            assert len(stored) == 1, (key, out)  # stored exactly once, every other answer a duplicate
            assert stored[0] == want_results[key], key
        assert len(results) == len(want_results)
        for store in stores:
            assert_same_ledger(store, want, hosts)
    finally:
        for store in stores:
            store.close()


def test_a_key_stored_between_the_dedupe_check_and_the_commit_makes_the_batch_a_duplicate(pg_url):
    """A writer that does not claim the host (an older collector) stores a batch's key while this store is half-way
    through the same batch: its insert of the key finds it, the transaction is rolled back and committed again,
    and the batch is answered as the duplicate it now is. Never a unique-key error, never stored twice."""
    import psycopg

    bodies = host_bodies("n1", n=30)
    store = Store(pg_url, clock=lambda: NOW, window_s=WINDOW_S)
    gate = psycopg.connect(pg_url, autocommit=True)
    try:
        first = ingest(store, bodies[0])
        # batch 1's transaction waits, after its samples are written and before its key is, while the gate is held
        gate.execute("CREATE FUNCTION gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                     "PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$")
        gate.execute("CREATE TRIGGER gate BEFORE INSERT ON chunks FOR EACH ROW EXECUTE FUNCTION gate()")
        gate.execute("SELECT pg_advisory_lock(4242)")
        batch = parse_batch(bodies[1], "application/msgpack", NOW)
        out: list[object] = []
        writer = threading.Thread(target=lambda: out.append(store.ingest(batch)))
        writer.start()
        while not gate.execute("SELECT count(*) FROM pg_locks WHERE locktype='advisory' AND NOT granted"
                               ).fetchone()[0]:
            threading.Event().wait(0.01)
        gate.execute("INSERT INTO batch_keys (host, agent_id, seq, digest, received, samples) VALUES "
                     "(%s, %s, %s, %s, %s, %s)", ("n1", batch.agent_id, batch.seq, batch.digest, NOW, 11))
        gate.execute("SELECT pg_advisory_unlock(4242)")
        writer.join()
        assert out == [IngestResult(0, duplicate_batch=True)]
        assert store.batches_seen() == 2
        assert store.totals()["samples"] == first.accepted  # nothing of batch 1 was stored
    finally:
        gate.close()
        store.close()


def test_a_collector_stalled_in_a_transaction_holds_up_only_its_own_hosts(pg_url):
    """Another collector frozen inside a transaction (a VM stall) holds host n1's row: this one refuses n1's batch
    once the lock wait passes LOCK_TIMEOUT (the agent retries, 503) and goes on storing n2's, never waiting for ever;
    n1's batch goes in once the stall ends."""
    import time

    import psycopg

    from gpuledger.collector.store import StoreUnavailable

    n1, n2 = host_bodies("n1"), host_bodies("n2", seed=1)
    store = Store(pg_url, clock=lambda: NOW, window_s=WINDOW_S)
    stalled = psycopg.connect(pg_url)  # not autocommit: its transaction stays open, holding what it locked
    try:
        ingest(store, n1[0])
        ingest(store, n2[0])
        stalled.execute("SELECT host FROM hosts WHERE host = 'n1' FOR UPDATE")
        t0 = time.monotonic()
        blocked = store.submit(parse_batch(n1[1], "application/msgpack", NOW))
        time.sleep(0.2)
        other = store.submit(parse_batch(n2[1], "application/msgpack", NOW))
        assert other.result(timeout=30).accepted > 0  # after the one lock wait, not after the stall
        with pytest.raises(StoreUnavailable, match="lock"):
            blocked.result(timeout=30)
        assert time.monotonic() - t0 < 20
        stalled.rollback()  # the stall ends: the agent's retry of n1's batch goes in
        assert ingest(store, n1[1]).accepted > 0
    finally:
        stalled.close()
        store.close()


def test_one_collector_compacts_a_shared_ledger_at_a_time_and_compaction_is_idempotent(ledger):
    a = Store(ledger, clock=lambda: NOW, window_s=WINDOW_S)
    b = Store(ledger, clock=lambda: NOW, window_s=WINDOW_S)
    try:
        for body in host_bodies("n1"):
            ingest(a, body)
        tiers = a.tiers()
        with a.db.try_lock(COMPACTION_LOCK) as mine:  # A is compacting
            assert mine
            with b.db.try_lock(COMPACTION_LOCK) as theirs:
                assert not theirs  # the lock is the ledger's, not the process's
            skipped = b.compact(now=NOW)
            assert skipped.skipped and (skipped.rolled_minutes, skipped.merged_chunks) == (0, 0)
            assert b.tiers() == tiers
        done = b.compact(now=NOW)
        assert not done.skipped and done.rolled_minutes > 0 and done.merged_chunks > 0
        after = a.tiers()
        again = a.compact(now=NOW)  # the other collector's turn: nothing left to do
        assert (again.rolled_minutes, again.rolled_hours, again.merged_chunks, again.deleted_chunks) == (0, 0, 0, 0)
        assert a.tiers() == after
    finally:
        a.close()
        b.close()


def test_a_stalled_ledger_is_answered_503_within_the_deadline_and_the_resend_is_a_duplicate(postgres_server,
                                                                                             reference):
    """docs/scale.md's HA advice, synchronous_standby_names, with the standby gone: every COMMIT waits for it. The
    collector answers each host's batch 503 (Retry-After) within ledger_timeout_s, refuses the next at once, a read
    waiting on the store 503 too, /healthz 503; once the standby setting is cleared the stuck commit goes in,
    /healthz is 200 again, the agents' resends are duplicates, and the ledger is exactly one run's."""
    import time

    import httpx

    from gpuledger.collector.server import CollectorServer

    timeout_s = 1.0
    url = postgres_server.new_database()
    n1, n2 = host_bodies("n1"), host_bodies("n2", seed=1)
    want, _ = reference({"n1": n1[:2], "n2": n2[:1]})
    store = Store(url, clock=lambda: NOW, window_s=WINDOW_S)
    server = CollectorServer(store, clock=lambda: NOW, ledger_timeout_s=timeout_s).start()
    client = httpx.Client(base_url=server.url, timeout=30)

    def post(body: bytes) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = client.post("/api/v1/samples", content=body, headers={"Content-Type": "application/msgpack"})
        return r, time.monotonic() - t0

    def standby(names: str) -> None:
        postgres_server.psql(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        postgres_server.psql("SELECT pg_reload_conf()")

    try:
        assert post(n1[0])[0].status_code == 200
        standby("gpuledger_test_standby")  # nowhere: every commit now waits for it
        try:
            answers: dict[str, tuple[httpx.Response, float]] = {}
            first = threading.Thread(target=lambda: answers.__setitem__("n1", post(n1[1])))
            first.start()
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            while postgres_server.psql(waiting) != "1":  # n1's COMMIT waits for the standby
                assert first.is_alive(), answers
                time.sleep(0.02)
            answers["n2"] = post(n2[0])  # another host's batch, behind the stuck commit
            first.join()
            for host, (r, took) in answers.items():
                assert r.status_code == 503 and r.json()["reason"] == "ledger_timeout", (host, r.text)
                assert int(r.headers["Retry-After"]) > 0 and timeout_s <= took < timeout_s + 2, (host, took)
            r, took = post(n1[1])  # the agent's resend, while the commit is still stuck: refused at once
            assert (r.status_code, r.json()["reason"]) == (503, "ledger_stalled") and took < 0.5
            health = client.get("/healthz")
            assert health.status_code == 503 and health.json()["reason"] == "ledger_stalled", health.text
            t0 = time.monotonic()
            read = client.get("/api/v1/totals")  # the store is held by the stuck commit: bounded, never a hang
            assert (read.status_code, read.json()["reason"]) == (503, "ledger_stalled")
            assert time.monotonic() - t0 < 2 * timeout_s + 1
        finally:
            standby("")
        deadline = time.monotonic() + 30
        while client.get("/healthz").status_code != 200:  # the stuck commit goes in
            assert time.monotonic() < deadline, "the stuck commit never finished"
            time.sleep(0.05)
        for body in (n1[1], n2[0]):  # committed after their 503: the resends are duplicates, counted once
            r, _ = post(body)
            assert r.status_code == 200 and r.json()["duplicate"], r.text
        assert_same_ledger(store, want, ["n1", "n2"])
        metrics = client.get("/metrics").text
        assert 'gpuledger_collector_batches_rejected_total{reason="ledger_timeout",status="503"} 2.0' in metrics
    finally:
        client.close()
        server.stop()
        store.close()
