"""The collector's GC policy (``collector.gcfreeze``): long-lived objects leave the full passes, in a process of its
own (freezing would change the test process's collector); the count is a metric."""

from __future__ import annotations

import subprocess
import sys

import httpx

from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import Store

FREEZE_AND_REPORT = """
import gc, time, weakref
from gpuledger.collector.gcfreeze import GcFreezer
class Record:
    pass
state = [Record() for _ in range(50_000)]  # long-lived records, as the aggregation holds per GPU
ids = {id(r) for r in state}
walked = lambda: sum(1 for o in gc.get_objects() if id(o) in ids)  # what a full pass walks of them
before = walked()
freezer = GcFreezer(every_s=0.05).start()
time.sleep(0.3)
a, b = Record(), Record()
a.other, b.other = b, a  # a cycle that becomes garbage while young: collected, not frozen
gone = weakref.ref(a)
del a, b
time.sleep(0.3)
freezer.stop()
print(before, walked(), gc.get_freeze_count(), gone() is None)
"""


def test_the_freezer_moves_long_lived_objects_out_of_full_collections():
    out = subprocess.run([sys.executable, "-c", FREEZE_AND_REPORT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after, frozen, collected = out.stdout.split()
    assert (int(before), int(after)) == (50_000, 0) and int(frozen) >= 50_000
    assert collected == "True"


def test_the_frozen_count_is_a_metric(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    server = CollectorServer(store, port=0)
    server.start()
    try:
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        assert "\ngpuledger_collector_gc_frozen_objects " in metrics
    finally:
        server.stop()
        store.close()
