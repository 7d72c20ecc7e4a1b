"""Compaction in a process of its own (``collector.compactor``, issue 13): what the child leaves is what compaction in
the collector's process leaves, on both ledger engines, while ingest goes on; `collector serve` starts it, starts it
again when it dies, and it never outlives its collector, however the collector ends."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
from collector_proc import CollectorProc, free_port, metric_value, wait_until
from test_compaction import HOSTS, RET, body, snapshot

from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.series_store import MINUTE, RAW
from gpuledger.collector.store import COMPACTION_LOCK, Store
from gpuledger.collector.validate import parse_batch

BATCHES = 150  # 25 minutes of each host: minutes become final and raw intervals close


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited child nobody has reaped yet, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """The running children of ``pid``, whichever of its threads started them."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split() if alive(int(c))]
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def first_difference(got: str, want: str) -> str:
    """Where two snapshots (JSON lists) first differ: the item's index and both versions, shortened."""
    a, b = json.loads(got), json.loads(want)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x, y = (json.dumps(v[i] if i < len(v) else None)[:2000] for v in (a, b))
    return f"item {i}: {x} != {y}"


def tier_rows(store: Store) -> list[int]:
    """Rows per tier (not chunks: how many there are depends on the passes, e.g. a raw interval merged while open
    into chunks of 512 rows or more keeps them)."""
    return [t["rows"] for t in store.tiers()]


def ingest(store: Store, start: float) -> None:
    for seq in range(BATCHES):
        for host in HOSTS:
            assert store.ingest(parse_batch(body(host, seq, start), "application/msgpack", time.time())).accepted == 30


def test_a_compactor_process_leaves_what_compaction_in_the_collectors_process_leaves(new_ledger):
    # the child runs on the real clock: samples of three hours ago (closed intervals, within raw retention)
    start = time.time() - 3 * 3600.0
    target, reference_target = new_ledger(), new_ledger()
    store = Store(target, window_s=60.0, retention=RET)
    compactor = CompactorProcess.beside(store, target, interval_s=0.2)
    compactor.start()
    try:
        ingest(store, start)  # while the child compacts the same database
        reference = Store(reference_target, window_s=60.0, retention=RET)
        ingest(reference, start)
        reference.compact()
        expected = tier_rows(reference)
        assert expected[MINUTE] > 0  # rolled up
        # this process never compacts: the rollups and merges are the child's, and they come out the same
        # (totals sum rollups and raw samples not rolled up yet: bit for bit equal once both stores are compacted
        # alike, not while a pass is half-way)
        deadline, want = time.monotonic() + 60, snapshot(reference)
        while (got := tier_rows(store)) != expected or snapshot(store) != want:
            assert time.monotonic() < deadline, (f"the compactor process left {got}, compaction here {expected}; "
                                                 f"first difference: {first_difference(snapshot(store), want)}")
            time.sleep(0.2)
        assert store.tiers()[RAW]["chunks"] < len(HOSTS) * 3 * BATCHES  # the batches' chunks were merged
        assert compactor.restarts == 0 and compactor.pid is not None
    finally:
        compactor.stop()
        store.close()
    assert compactor.pid is None
    reference.close()


def serve(tmp_path: Path, settings: str) -> CollectorProc:
    """`collector serve` on a new data dir, ``settings`` in its [collector] table."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "gpuledger.toml").write_text("[collector]\n" + settings)
    return CollectorProc(data, free_port()).start()


def last_compaction(url: str) -> float | None:
    """gpuledger_collector_last_compaction_timestamp_seconds on the collector's /metrics (None: not there)."""
    text, name = httpx.get(f"{url}/metrics", timeout=10).text, "gpuledger_collector_last_compaction_timestamp_seconds"
    return metric_value(text, name) if f"\n{name} " in text else None


def test_collector_serve_runs_compaction_in_a_child_that_never_outlives_it(tmp_path: Path):
    started = time.time()
    proc = serve(tmp_path, "compact_interval_s = 0.5\nwindow_s = 60\n")
    data = proc.data_dir
    try:
        [child] = children(proc.proc.pid)
        with open(f"/proc/{child}/cmdline", "rb") as f:
            assert b"gpuledger.collector.compactor" in f.read()
        start = time.time() - 3 * 3600.0
        for seq in range(60):  # 10 minutes of one host
            r = httpx.post(f"{proc.url}/api/v1/samples", content=body(HOSTS[0], seq, start),
                           headers={"Content-Type": "application/msgpack"}, timeout=30)
            assert r.status_code == 200, r.text

        def rolled_up() -> bool:
            store = Store(data / "gpuledger.sqlite")
            try:
                return store.tiers()[MINUTE]["rows"] > 0
            finally:
                store.close()

        wait_until(rolled_up, "the child to roll up minutes", timeout=60)
        # the serving process's /metrics says when the child last compacted the ledger, and it goes on doing so
        first = wait_until(lambda: last_compaction(proc.url), "the last compaction on /metrics", timeout=30)
        assert started <= first <= time.time()
        wait_until(lambda: (last_compaction(proc.url) or 0.0) > first, "a later compaction on /metrics", timeout=30)
        os.kill(child, signal.SIGKILL)  # a compactor that dies is started again; ingest never notices
        again = wait_until(lambda: [c for c in children(proc.proc.pid) if c != child], "a new compactor process",
                           timeout=60)
        assert httpx.get(f"{proc.url}/healthz", timeout=5).status_code == 200
        proc.kill()  # SIGKILL: the collector cannot stop its child; the child sees its standard input end
        wait_until(lambda: not alive(again[0]), "the orphaned compactor to exit", timeout=10)
        proc.start()  # SIGTERM: stopped with the collector
        [child] = children(proc.proc.pid)
        proc.stop()
        assert proc.proc.returncode == 0
        wait_until(lambda: not alive(child), "the compactor to exit with its collector", timeout=10)
    finally:
        proc.kill()


def test_compaction_in_the_collectors_own_process_starts_no_child(tmp_path: Path):
    proc = serve(tmp_path, 'compaction = "thread"\n')
    try:
        assert children(proc.proc.pid) == []
    finally:
        proc.stop()


def test_a_compactor_that_cannot_open_its_store_is_retried_not_fatal(tmp_path: Path):
    store = Store(tmp_path / "ledger.sqlite", window_s=60.0)
    # a target the child cannot open (its directory is a file): it exits at once, is logged and started again
    (tmp_path / "file").write_text("")
    compactor = CompactorProcess.beside(store, tmp_path / "file" / "ledger.sqlite", interval_s=0.2,
                                        restart_after_s=0.1)
    compactor.start()
    try:
        wait_until(lambda: compactor.restarts >= 2, "the compactor to be started again", timeout=60)
    finally:
        compactor.stop()
        store.close()


def test_a_compaction_records_when_it_completed_and_one_skipped_records_nothing(new_ledger):
    url = new_ledger()
    clock = [2e9]
    store = Store(url, clock=lambda: clock[0])
    other = Store(url, clock=lambda: clock[0] + 50.0)
    try:
        assert store.last_compaction() is None  # a ledger never compacted
        store.compact()
        assert store.last_compaction() == other.last_compaction() == 2e9  # the ledger's, whoever reads it
        clock[0] += 300.0
        with store.db.try_lock(COMPACTION_LOCK) as mine:  # this collector compacts: the other skips its pass
            assert mine
            assert other.compact().skipped
        assert other.last_compaction() == 2e9
        other.compact()
        assert store.last_compaction() == 2e9 + 350.0  # by the clock of the store that ran it
    finally:
        other.close()
        store.close()
