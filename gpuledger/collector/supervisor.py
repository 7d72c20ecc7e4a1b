"""``collector serve`` with ``workers`` > 1: a supervisor process, that many ingest workers, one compactor.

One process serves on one core (the GIL). To use a machine's cores the collector runs several workers
(``collector.worker``), each a whole collector: its own Store on the one ledger and its own listening socket on the
one port (SO_REUSEPORT: the kernel spreads new connections over the workers). Any worker may take any host's batch:
each group commit claims its hosts in the ledger, and a host another worker wrote since is restored from there
(``collector.store``), so the sums are the ones a single process would store.

The supervisor serves nothing. It starts the first worker alone (it creates or migrates the ledger, and with port 0
picks the port the others then bind), the compaction child once for all of them (``collector.compactor``), then the
other workers, each given its settings as one JSON line on standard input. Then it watches them: a worker that dies
is logged, its live gauges are dropped from the shared metrics (``multiprocess.mark_process_dead``; its counter
files stay, so the collector's counters never go back) and it is started again after a backoff (BACKOFF_S, doubling
up to BACKOFF_MAX_S, back to BACKOFF_S once a worker ran HEALTHY_S). A worker that exits before it listens cannot
start (bad settings, an unreachable ledger): the collector stops with its status rather than start it again in a
loop, and the worker's one-line error is on standard error. :meth:`Supervisor.stop` passes the stop signal on to the
workers, waits for them, and stops the compactor.

Metrics: the workers write theirs to files in a private directory (``<data-dir>/metrics.d``, emptied at start), and
each worker's /metrics reads them all (``server._Metrics``).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from prometheus_client import multiprocess

from gpuledger.collector.auditlog.files import private_dir
from gpuledger.collector.compactor import CompactorProcess
from gpuledger.collector.limits import LEDGER_TIMEOUT_S

log = logging.getLogger(__name__)

METRICS_DIR = "metrics.d"  # in the data directory: the workers' metric files
WORKER_COMMAND = (sys.executable, "-m", "gpuledger.collector.worker")
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_S = 60.0  # a worker that ran this long before it died is started again after BACKOFF_S
STOP_GRACE_S = 30.0  # a worker's clean stop (requests finishing, the series shipper, the store) before SIGKILL,
# beyond the ledger_timeout_s it gives a commit in progress (collector.worker.Collector.close)
POLL_S = 0.1  # how often the supervisor looks for a stop request and at its workers


class WorkerFailed(Exception):
    """A worker exited before it listened. ``status``: the collector's exit status (the worker's, or 1);
    ``message``: what to say, None when the worker said it (on standard error) itself."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(message or f"a collector worker exited with status {status} while starting")
        self.status, self.message = status, message


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready_at: float = 0.0
    backoff_s: float = BACKOFF_S
    restart_at: float | None = None  # it died: when to start it again


def _ended(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class Supervisor:
    """Runs ``workers`` worker processes on ``port`` and the ``compactor`` (None: none), each worker given
    ``settings`` (its JSON document, less its port and the metrics directory) and ``metrics_dir``.

    :meth:`start` starts them all, :meth:`run` watches them until :meth:`request_stop` (what the signal handlers
    call), and :meth:`stop` stops them."""

    def __init__(self, workers: int, settings: Mapping[str, Any], port: int, compactor: CompactorProcess | None,
                 metrics_dir: Path) -> None:
        self.settings, self.port, self.compactor, self.metrics_dir = dict(settings), port, compactor, metrics_dir
        self.workers = [_Worker(i) for i in range(workers)]
        self.stop_signal: int | None = None  # set by request_stop; a plain attribute, safe in a signal handler

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def start(self) -> str | None:
        """Starts the workers and the compactor; the URL they listen on, or None when a stop was requested meanwhile.
        Raises WorkerFailed."""
        _fresh_private_dir(self.metrics_dir)
        first, *others = self.workers
        self._spawn(first)
        ready = self._await_ready(first)
        if ready is None:
            return None
        self.port = ready["port"]  # port 0: the others bind the one the first was given
        if self.compactor is not None:  # once the ledger exists: the first worker created it
            self.compactor.start()
        for w in others:  # at once: each opens the store, which takes a while
            self._spawn(w)
        for w in others:
            if self._await_ready(w) is None:
                return None
        return str(ready["url"])

    def run(self) -> None:
        """Until :meth:`request_stop`: starts again every worker that dies. Raises WorkerFailed when one cannot."""
        while self.stop_signal is None:
            now = time.monotonic()
            for w in self.workers:
                if self.stop_signal is not None:
                    break
                if w.restart_at is None:
                    assert w.proc is not None
                    if w.proc.poll() is not None:
                        self._died(w, now)
                elif now >= w.restart_at:
                    w.restart_at = None
                    self._spawn(w)
                    self._await_ready(w)
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Passes the stop signal (SIGTERM unless another was requested) to every worker and closes their standard
        input, waits for them (ledger_timeout_s + STOP_GRACE_S, then SIGKILL), stops the compactor, and removes the
        metric files. Raises typer.Exit with a worker's status when one stopped with a failure (it said why on
        standard error: the ledger stalled at shutdown), after all that."""
        signum = self.stop_signal or signal.SIGTERM
        running = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for proc in running:
            proc.send_signal(signum)
            _close(proc)
        grace_s = STOP_GRACE_S + float(self.settings.get("settings", {}).get("ledger_timeout_s", LEDGER_TIMEOUT_S))
        deadline = time.monotonic() + grace_s
        failed = 0
        for proc in running:
            try:
                status = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("collector worker (pid %d) did not stop within %.0f s: killed", proc.pid, grace_s)
                proc.kill()
                status = proc.wait()
            if status > 0:
                failed = failed or status
        if self.compactor is not None:
            self.compactor.stop()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if failed:
            raise typer.Exit(failed)

    # -- one worker ---------------------------------------------------------------------------------------------
    def _spawn(self, w: _Worker) -> None:
        doc = {**self.settings, "port": self.port, "metrics_dir": str(self.metrics_dir)}
        proc = subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        w.proc = proc
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(doc).encode() + b"\n")
            proc.stdin.flush()  # and kept open: its end tells the worker that the supervisor is gone
        except BrokenPipeError:  # it died at once; _await_ready says how
            pass

    def _await_ready(self, w: _Worker) -> dict[str, Any] | None:
        """What worker ``w`` reports once it listens (``url``, ``port``); None when a stop is requested first.
        WorkerFailed when it exits first."""
        proc = w.proc
        assert proc is not None and proc.stdout is not None
        fd, line = proc.stdout.fileno(), b""
        while not line.endswith(b"\n"):
            if self.stop_signal is not None:
                return None
            if not select.select([fd], [], [], POLL_S)[0]:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:  # it exited without a word
                status = proc.wait()
                if self.stop_signal is not None:  # a Ctrl-C reaches the workers too
                    return None
                _close(proc)
                if status > 0:  # output.fail in the worker said why
                    raise WorkerFailed(status, None)
                raise WorkerFailed(1, f"collector worker {w.index} (pid {proc.pid}) {_ended(status)} while starting")
            line += chunk
        w.ready_at = time.monotonic()
        report: dict[str, Any] = json.loads(line)
        return report

    def _died(self, w: _Worker, now: float) -> None:
        proc = w.proc
        assert proc is not None and proc.returncode is not None
        multiprocess.mark_process_dead(proc.pid, str(self.metrics_dir))
        _close(proc)
        if now - w.ready_at >= HEALTHY_S:
            w.backoff_s = BACKOFF_S
        w.restart_at = now + w.backoff_s
        log.warning("collector worker %d (pid %d) %s; starting another in %.0f s", w.index, proc.pid,
                    _ended(proc.returncode), w.backoff_s)
        w.backoff_s = min(2 * w.backoff_s, BACKOFF_MAX_S)


def _close(proc: subprocess.Popen[bytes]) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:  # the worker is gone already
            pass


def _fresh_private_dir(path: Path) -> None:
    """``path`` as an empty directory only its owner may read (the files of a previous run removed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    private_dir(path)
