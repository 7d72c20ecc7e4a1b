"""Compaction in a process of its own, beside the collector's ingest process.

In the collector's process compaction competed with the request threads for the GIL: planning a pass (reading every
GPU's totals, decoding and merging chunks) held ingest answers for hundreds of milliseconds at the 99th percentile,
and its buffers sat in the collector's memory. Compaction needs nothing of the collector but its database, and is
already safe beside other writers (a ledger shared by several collectors; ``Store.compact``: one compactor at a time
by the ledger's compaction lock, plans checked when written, each step one transaction), so a child process runs it:
another core, its own memory, and the collector's process keeps only ingest and queries.

The child (``python -m gpuledger.collector.compactor``) reads its settings as one JSON line on standard input, so a
PostgreSQL password never shows in a process list, then keeps standard input open: end of file is its parent gone,
however it went (a SIGKILLed collector included), and the child stops. :class:`CompactorProcess` starts it, starts it
again if it dies (a compactor that crashes is logged and retried, never the end of ingest), and stops it. A child
whose settings the ledger refuses (``store.SettingsMismatch``: another process changed the ledger's with ``collector
set-settings``; ``store.InvalidSetting``) says so in one line and exits 2, as a command would; it is not started
again: only a restart with settings the ledger agrees with can help.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from gpuledger.collector.db import DatabaseConfigError
from gpuledger.collector.series_store import Retention
from gpuledger.collector.store import Store

log = logging.getLogger(__name__)

NICENESS = 10
STOP_GRACE_S = 5.0
REFUSED = 2  # the child's exit status when the ledger refuses its settings (a DatabaseConfigError)


class CompactorProcess:
    """Run ``Store.compact`` every ``interval_s`` seconds in a child process on the database ``target`` (a SQLite
    path or a PostgreSQL URL), opened with the ingest store's ``window_s``, ``max_gap_s``, ``retention`` and
    ``dedupe_horizon_s`` (what compaction reads of its settings, checked against the ledger's; the power caps, which
    only ingest counts by, are the ledger's: ``Store`` given None); the child is this Python running this module.
    ``refused``: whether the child exited with REFUSED (then it is not started again)."""

    def __init__(self, target: str, *, interval_s: float, window_s: float, max_gap_s: float, retention: Retention,
                 dedupe_horizon_s: float, restart_after_s: float | None = None) -> None:
        self.settings: dict[str, Any] = {
            "target": str(target), "interval_s": interval_s, "window_s": window_s, "max_gap_s": max_gap_s,
            "retention": dataclasses.asdict(retention), "dedupe_horizon_s": dedupe_horizon_s,
        }
        self.command = [sys.executable, "-m", __name__]
        # a child that died is started again after this long (not in a tight loop if it cannot even open the store)
        self.restart_after_s = min(interval_s, 30.0) if restart_after_s is None else restart_after_s
        self.restarts = 0
        self.refused = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None

    @classmethod
    def beside(cls, store: Store, target: str | os.PathLike[str], interval_s: float, **kwargs: Any) -> CompactorProcess:
        """The compactor of ``store``, with its settings; ``target`` is what the store was opened on (its ``url``
        lacks a PostgreSQL password)."""
        return cls(str(target), interval_s=interval_s, window_s=store.agg.window_s, max_gap_s=store.agg.max_gap_s,
                   retention=store.retention, dedupe_horizon_s=store.dedupe_horizon_s, **kwargs)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        if self._supervisor is not None:
            return
        self._stop.clear()
        self._spawn()
        self._supervisor = threading.Thread(target=self._supervise, name="compactor-supervisor", daemon=True)
        self._supervisor.start()

    def _spawn(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(self.settings).encode() + b"\n")
            proc.stdin.flush()  # and kept open: its end of file tells the child this process is gone
            self._proc = proc

    def _supervise(self) -> None:
        while not self._stop.is_set():
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            if self._stop.is_set():
                return
            if code == REFUSED:
                self.refused = True
                log.error("compactor process %d exited with status %d: the ledger refuses its settings (its line above "
                          "says why); compaction stops until the collector is started again with the ledger's settings",
                          proc.pid, code)
                return
            log.warning("compactor process %d exited with status %s; starting another in %.0f s",
                        proc.pid, code, self.restart_after_s)
            if self._stop.wait(self.restart_after_s):
                return
            try:
                self._spawn()
                self.restarts += 1
            except OSError as exc:
                log.error("cannot start the compactor process: %s", exc)

    def stop(self) -> None:
        """Stop the child: its standard input closed (it exits at once), killed if it has not after
        ``STOP_GRACE_S``."""
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None:
            _close(proc.stdin)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None


def _close(stream: IO[bytes] | None) -> None:
    try:
        if stream is not None:
            stream.close()
    except OSError:  # the child is gone already
        pass


def run(settings: Mapping[str, Any], stdin: IO[bytes]) -> None:
    """The child: compact every ``interval_s`` seconds until ``stdin`` ends (the parent is gone, or asks). It ends
    then and there, as a crash would: a step cut short is one transaction rolled back, planned again next pass."""
    def watch() -> None:
        while stdin.read(4096):  # the parent writes nothing more; a read returns only at its end
            pass
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    store = Store(settings["target"], window_s=settings["window_s"], max_gap_s=settings["max_gap_s"],
                  retention=Retention(**settings["retention"]), dedupe_horizon_s=settings["dedupe_horizon_s"])
    while True:
        time.sleep(settings["interval_s"])
        started = time.monotonic()
        try:
            st = store.compact()
        except Exception:  # keep compacting later; every step left the store consistent
            log.exception("compaction failed")
            continue
        log.info("compaction pass in %.1f s: %s", time.monotonic() - started, st)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format=f"gpuledger compactor[{os.getpid()}]: %(levelname)s %(message)s")
    # below ingest: on a busy machine the collector's answers come first, compaction takes the CPU left over
    try:
        os.nice(NICENESS)
    except OSError as exc:  # a sandbox that refuses it: compaction still runs, at the collector's priority
        log.warning("cannot lower the compactor's priority: %s", exc)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    try:
        run(json.loads(line), sys.stdin.buffer)
    except DatabaseConfigError as exc:  # the ledger refuses these settings: trying again cannot help
        log.error("%s", " ".join(str(exc).split()))
        sys.stderr.flush()
        os._exit(REFUSED)  # as the parent watch does: its thread blocked on stdin would abort an interpreter shutdown


if __name__ == "__main__":
    main()
