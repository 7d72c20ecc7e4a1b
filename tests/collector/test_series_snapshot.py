"""A series query reads one state of the store: a compaction committed by another connection (the compactor
process's) between the query's reads changes nothing in its answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpuledger.agent.push import encode_batch
from gpuledger.collector.db import Database, open_database
from gpuledger.collector.store import Store
from gpuledger.collector.validate import parse_batch
from gpuledger.schema.records import GpuSample

T0 = 3600.0 * 480_000


class BeforeHostChunks:
    """The store's database, running ``hook`` once, just before the next read of the host chunks (a query reads
    the GPU's own chunks first)."""

    def __init__(self, inner: Database) -> None:
        self.inner = inner
        self.hook: Callable[[], object] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, sql: str, args: Any = ()) -> Any:
        if self.hook is not None and "FROM host_chunks" in sql:
            hook, self.hook = self.hook, None
            hook()
        return self.inner.execute(sql, args)


QUERIES: dict[str, Callable[[Store], object]] = {
    "raw": lambda s: s.series("n1", "G0", T0, T0 + 1000),
    "1m, from raw": lambda s: [(p.ts, p.samples) for p in s.series("n1", "G0", T0, T0 + 1000, step=60)],
    "tiers": lambda s: [(t["tier"], t["rows"]) for t in s.tiers()],
}


@pytest.mark.parametrize("query", sorted(QUERIES))
def test_a_split_committed_during_a_query_is_not_seen(ledger, query) -> None:
    db = BeforeHostChunks(open_database(str(ledger)))
    store = Store(db, clock=lambda: T0 + 700)  # type: ignore[arg-type]
    samples = [GpuSample(ts=T0 + 10 * i, host="n1", gpu_uuid="G0", gpu_index=0, power_watts=100.0 + i,
                         energy_joules=1e6 + 1e3 * i, job_ids=("7",)) for i in range(60)]
    for seq in range(6):  # the agent's batches: stored as host chunks, until compaction splits them
        body = encode_batch("a", "n1", seq, samples[10 * seq:10 * seq + 10], fmt="msgpack", layout="series")
        store.ingest(parse_batch(body, "application/msgpack", T0 + 700))
    compactor = Store(ledger, clock=lambda: T0 + 700)  # the compactor process's: a connection of its own
    try:
        before = QUERIES[query](store)
        assert before and before == QUERIES[query](store)
        db.hook = lambda: compactor.compact(all_host_chunks=True)
        during = QUERIES[query](store)
        assert db.hook is None  # it ran: the host chunks are split by now
        assert compactor.db.execute("SELECT COUNT(*) FROM host_chunks").fetchone()[0] == 0
        assert during == before == QUERIES[query](store)
    finally:
        compactor.close()
        store.close()
