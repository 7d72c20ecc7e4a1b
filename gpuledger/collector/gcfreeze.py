"""Keep the cyclic garbage collector's full passes short in the collector's process.

The collector holds long-lived state for every GPU of the fleet (aggregation accumulators, newest samples) and every
agent connection. CPython's full (generation 2) collection walks all of it, with the GIL held: at 2,000 nodes
(16,000 GPUs) a pass took a large part of the 100 ms latency budget, and every request waiting then missed it.
Objects that have survived a while are moved out of the collector's sight (``gc.freeze``) every ``every_s``
seconds, after a young-generation pass, so a full pass walks only what was allocated since.

The cost, and why it is small here: a cycle among frozen objects that becomes garbage later is never collected
(what drops to no references is freed as always, by reference counting, frozen or not). Request objects live for one
request and are collected young; the long-lived state is plain records without cycles, and a fleet run found next to
no cyclic garbage at all. ``gpuledger_collector_gc_frozen_objects`` shows the frozen count, which stays flat when
nothing leaks.
"""

from __future__ import annotations

import gc
import threading

FREEZE_EVERY_S = 15.0  # often enough that the state a fleet builds in its first minute is frozen as it grows


class GcFreezer:
    """Every ``every_s`` seconds, in a daemon thread: a young-generation collection, then ``gc.freeze()``."""

    def __init__(self, every_s: float = FREEZE_EVERY_S) -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GcFreezer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gc-freeze", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            gc.collect(1)  # the young generations' garbage goes first, so only survivors are frozen
            gc.freeze()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
