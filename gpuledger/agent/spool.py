"""A bounded on-disk spool of unsent batches, and the pusher that drains it in order with backoff.

The spool is a directory of files ``<seq, 20 digits>-<samples>.<json|msgpack>[.gz|.zst]``, each the exact
request body of one batch, written atomically (temporary file, fsync, rename, fsync of the directory): a
crash leaves a whole batch or none. A batch keeps its sequence number across retries and agent restarts,
so the collector acknowledges a re-sent batch without storing it twice. When the spool is over its bound
(bytes or batches) the oldest batches are dropped and counted: recent data is worth more to a fairshare
that decays, and the newest batch always fits.

:class:`SpoolingPusher` is an Agent sink: ``write`` only spools (never blocks on the network); a sender
thread posts the oldest batch first. A connection failure, no whole answer within the pusher's deadline, a 5xx,
a redirect or 401/403/404/405/415 (configuration, not the batch), 408 or 429 stops the pass, and the spool is
tried again after an exponential, jittered delay, or the answer's Retry-After when that is longer (capped at
``backoff_max_s``). A 400 for times in the collector's future (this node's clock was ahead when it sampled) is
about that batch alone: it waits in the spool on a backoff of its own, the batches after it go ahead, and it is
taken once its times are no longer in the future. Any other 4xx means the collector will never take the batch:
it is dropped, counted and logged. Each failed attempt is one warning line.

Sequence numbers persist in the spool directory (``SeqFile``), so a restarted agent continues after the
numbers it used, whatever its clock says.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuledger.agent.push import HttpPusher, PushError
from gpuledger.schema.records import GpuSample, JobRecord

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{20})-(\d+)\.(json|msgpack)(?:\.(gz|zst))?$")
_COMPRESS_SUFFIX = {None: "", "gzip": ".gz", "zstd": ".zst"}
_SUFFIX_COMPRESS = {None: None, "gz": "gzip", "zst": "zstd"}
CLOCK_SKEW_REASONS = frozenset({"future"})  # a 400 with this reason: this node's clock, not the batch
SEQ_FILE = ".next-seq"  # hidden: the spool directory lists batches


def clock_skewed(exc: PushError) -> bool:
    """Refused for times in the collector's future: the batch is kept, and waits without holding up the others."""
    return exc.status == 400 and exc.reason in CLOCK_SKEW_REASONS


def retryable(exc: PushError) -> bool:
    """Keep the batch and try again later? (No answer, 5xx, overload, configuration, clock skew.)"""
    return exc.failover or clock_skewed(exc)


class SeqFile:
    """Sequence numbers that survive restarts without the clock: the file holds the first number not yet
    reserved; numbers are reserved ``block`` at a time (one fsync per block), so a crash skips at most a
    block and never reuses a number."""

    def __init__(self, path: str | os.PathLike[str], block: int = 1024) -> None:
        self.path = Path(path)
        self.block = block
        try:
            self.reserved = int(self.path.read_text().strip())
        except FileNotFoundError:
            self.reserved = 0
        except ValueError as exc:
            raise ValueError(f"sequence file {self.path} is corrupt ({exc}): remove it only together with "
                             "the spool, or the collector may take new batches for old ones") from None

    def reserve(self, seq: int) -> None:
        """Make sure ``seq`` is below the persisted reservation before it is used."""
        if seq < self.reserved:
            return
        self.reserved = seq + self.block
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{self.reserved}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    seq: int
    samples: int
    fmt: str  # json | msgpack
    compress: str | None  # None | gzip | zstd
    size: int
    name: str


class Spool:
    """Batches on disk in sequence order, bounded by ``max_bytes`` and ``max_batches``. Thread-safe."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 256 * 2**20, max_batches: int = 100_000) -> None:
        if max_bytes <= 0 or max_batches <= 0:
            raise ValueError("spool: max_bytes and max_batches must be positive")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self._lock = threading.Lock()
        self._index: dict[int, SpooledBatch] = {}
        self._bytes = 0
        self.dropped_batches = 0
        self.dropped_samples = 0
        for entry in self.path.iterdir():
            if entry.name.endswith(".tmp"):  # a write cut short by a crash: never renamed, never acknowledged
                entry.unlink(missing_ok=True)
                continue
            m = _NAME.match(entry.name)
            if m is None:
                continue
            b = SpooledBatch(int(m[1]), int(m[2]), m[3], _SUFFIX_COMPRESS[m[4]], entry.stat().st_size, entry.name)
            self._index[b.seq] = b
            self._bytes += b.size
        with self._lock:
            self._enforce_bound()

    # -- state --------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, seq: object) -> bool:
        return seq in self._index

    def max_seq(self) -> int | None:
        with self._lock:
            return max(self._index, default=None)

    def seqs(self) -> list[int]:
        with self._lock:
            return sorted(self._index)

    # -- operations ---------------------------------------------------------------------------
    def put(self, seq: int, body: builtins.bytes, samples: int, fmt: str = "json", compress: str | None = None) -> None:
        """Store one batch durably (replacing one of the same seq), then drop the oldest while over the bound."""
        name = f"{seq:020d}-{samples}.{fmt}{_COMPRESS_SUFFIX[compress]}"
        tmp = self.path / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
        _fsync_dir(self.path)  # the rename itself must survive a power loss
        with self._lock:
            old = self._index.pop(seq, None)
            if old is not None:
                self._bytes -= old.size
                if old.name != name:
                    (self.path / old.name).unlink(missing_ok=True)
            self._index[seq] = SpooledBatch(seq, samples, fmt, compress, len(body), name)
            self._bytes += len(body)
            self._enforce_bound(keep=seq)

    def oldest(self, skip: frozenset[int] | set[int] = frozenset()) -> tuple[SpooledBatch, builtins.bytes] | None:
        """The batch with the lowest seq not in ``skip`` and its body; an unreadable file is dropped (and counted)."""
        while True:
            with self._lock:
                seq = min((s for s in self._index if s not in skip), default=None)
                if seq is None:
                    return None
                b = self._index[seq]
            try:
                return b, (self.path / b.name).read_bytes()
            except OSError as exc:
                log.error("spool: cannot read %s, dropping it: %s", b.name, exc)
                self.remove(b.seq, dropped=True)

    def remove(self, seq: int, dropped: bool = False) -> None:
        with self._lock:
            self._remove_locked(seq, dropped)

    def _remove_locked(self, seq: int, dropped: bool) -> None:
        b = self._index.pop(seq, None)
        if b is None:
            return
        self._bytes -= b.size
        (self.path / b.name).unlink(missing_ok=True)
        if dropped:
            self.dropped_batches += 1
            self.dropped_samples += b.samples

    def _enforce_bound(self, keep: int | None = None) -> None:
        while (self._bytes > self.max_bytes or len(self._index) > self.max_batches) and len(self._index) > 1:
            oldest = min(s for s in self._index if s != keep)
            log.warning("spool full (%d batches, %d bytes): dropping the oldest batch, seq %d",
                        len(self._index), self._bytes, oldest)
            self._remove_locked(oldest, dropped=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolingPusher:
    """An Agent sink: spool each batch, deliver the spool oldest first in a background thread.

    ``rng``, ``sleep`` and ``clock`` (monotonic seconds) are the seams for tests: the delay before retry n
    (1-based) is ``min(backoff_max_s, backoff_base_s * 2**(n-1))`` scaled by a random factor in [0.5, 1) ("equal
    jitter": agents that lost the collector together do not return in lockstep, and no delay collapses to zero),
    or the collector's Retry-After when that is longer, up to ``backoff_max_s``.
    """

    def __init__(
        self,
        pusher: HttpPusher,
        spool: Spool,
        fmt: str = "json",
        compress: str | None = "zstd",
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 300.0,
        rng: random.Random | None = None,
        sleep: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pusher = pusher
        self.spool = spool
        self.fmt = fmt
        self.compress = compress
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sleep = sleep or self._stop.wait  # the thread's waits end at once on close()
        self._clock = clock
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failures = 0  # consecutive failed attempts (0: the last attempt succeeded)
        self._retry_after_s: float | None = None  # what the last failed answer asked for
        # batches refused for clock skew: seq -> (attempts, when the next one may start, on ``clock``)
        self._skewed: dict[int, tuple[int, float]] = {}
        self.rejected_batches = 0  # 4xx: dropped, the collector will never take them
        self.rejected_samples = 0
        self.sent_batches = 0
        self.last_error: str | None = None
        self.seq_file = SeqFile(spool.path / SEQ_FILE)
        # after a restart: new batches go after every number used before (spooled or already delivered)
        pusher.bump_seq(max(self.seq_file.reserved, (spool.max_seq() or -1) + 1))

    # -- the sink side --------------------------------------------------------------------------
    def write(self, samples: Sequence[GpuSample]) -> int:
        """Spool one batch under a new seq and wake the sender; returns the seq. Raises PushError if unencodable."""
        seq = self.pusher.next_seq()
        self.seq_file.reserve(seq)
        jobs = self.pusher.take_jobs()
        try:
            body = self.pusher.encode(seq, samples, self.fmt, self.compress, jobs=jobs)
            self.spool.put(seq, body, len(samples), self.fmt, self.compress)
        except BaseException:  # not spooled (a full disk, an unencodable batch): the next batch carries the jobs
            self.pusher.return_jobs(jobs)
            raise
        self._wake.set()
        return seq

    def write_jobs(self, records: Sequence[JobRecord]) -> None:
        """Job metadata rides with the next spooled batch (the pusher puts it in the body it encodes)."""
        self.pusher.write_jobs(records)

    # -- delivery -------------------------------------------------------------------------------
    def send_pending(self) -> bool:
        """Send spooled batches oldest first until none is left to send now (True: the spool is empty, or holds
        only batches refused for clock skew whose next attempt is not due) or a retryable failure (False)."""
        with self._send_lock:
            now = self._clock()
            self._skewed = {seq: v for seq, v in self._skewed.items() if seq in self.spool}  # not dropped meanwhile
            waiting = {seq for seq, (_, due) in self._skewed.items() if due > now}
            while True:
                item = self.spool.oldest(skip=waiting)
                if item is None:
                    return True
                b, body = item
                try:
                    self.pusher.post(b.seq, body, b.fmt, b.compress, samples=b.samples)
                except PushError as exc:
                    self.last_error = str(exc)
                    if clock_skewed(exc):
                        attempts = self._skewed.get(b.seq, (0, 0.0))[0] + 1
                        self._skewed[b.seq] = (attempts, self._clock() + self._backoff(attempts))
                        waiting.add(b.seq)
                        log.warning("collector %s for batch %d (%d samples): kept in the spool, retried later; "
                                    "the batches after it go first", exc.describe(), b.seq, b.samples)
                        continue
                    if not retryable(exc):
                        log.warning("collector refused batch %d (%d samples) for good, %s: dropped",
                                    b.seq, b.samples, exc.describe())
                        self.rejected_batches += 1
                        self.rejected_samples += b.samples
                        self.spool.remove(b.seq)
                        self._skewed.pop(b.seq, None)
                        continue
                    self.failures += 1
                    self._retry_after_s = exc.retry_after_s
                    log.warning("collector %s for batch %d (%d samples): kept in the spool (%d batches), retried "
                                "later", exc.describe(), b.seq, b.samples, self.spool.depth)
                    return False
                self.spool.remove(b.seq)
                self._skewed.pop(b.seq, None)
                self.sent_batches += 1
                if self.failures:
                    log.info("collector reachable again after %d failed attempts", self.failures)
                self.failures = 0
                self._retry_after_s = None
                self.last_error = None

    def _backoff(self, n: int) -> float:
        """The jittered delay before attempt n + 1 after n failed ones."""
        base = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** min(max(n, 1) - 1, 60))
        return base * (0.5 + 0.5 * self._rng.random())

    def retry_delay(self) -> float:
        """The delay before the next attempt after ``self.failures`` consecutive failures: the jittered backoff,
        or the last answer's Retry-After if longer (never past ``backoff_max_s``: a collector cannot park an agent
        for longer than its operator allows)."""
        delay = self._backoff(self.failures)
        if self._retry_after_s is not None:
            delay = max(delay, min(self._retry_after_s, self.backoff_max_s))
        return delay

    def drain(self, max_attempts: int | None = None) -> bool:
        """Send until nothing is left to send now (see :meth:`send_pending`), sleeping the backoff delay between
        failed attempts.

        Returns True then, False when stopped or ``max_attempts`` attempts failed.
        """
        attempts = 0
        while not self._stop.is_set():
            if self.send_pending():
                return True
            attempts += 1
            if max_attempts is not None and attempts >= max_attempts:
                return False
            self._sleep(self.retry_delay())
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            if self.spool.depth == 0:
                self._wake.wait(1.0)
                continue
            try:
                if self.drain() and self.spool.depth:  # only batches refused for clock skew left: not due yet
                    self._wake.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - a disk error must not end delivery for good
                log.exception("spool sender: %s", exc)
                self._stop.wait(self.backoff_base_s)

    def start(self) -> SpoolingPusher:
        self._thread = threading.Thread(target=self._run, name="spool-sender", daemon=True)
        self._thread.start()
        return self

    def close(self, flush: bool = True) -> None:
        """Stop the sender; with ``flush``, one last attempt (only if the collector was reachable) to send."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # still in an attempt: a flush would wait on it; the spool keeps the rest
                log.warning("spool sender still busy after 30 s: %d batch(es) left in the spool", self.spool.depth)
                flush = False
        if flush and self.failures == 0 and self.spool.depth:
            try:
                self.send_pending()  # whatever is left stays spooled for the next start
            except Exception as exc:  # noqa: BLE001 - shutting down: report and go on
                log.warning("final spool flush failed: %s", exc)
        self.pusher.close()

    def delivered(self) -> int:
        return self.sent_batches

    def summary(self) -> str:
        p = self.pusher
        return (f"delivered {self.sent_batches} batch(es) ({p.samples_sent} samples, {p.samples_refused} of them not "
                f"stored by the collector); {self.spool.depth} batch(es) left in the spool for the next start; "
                f"dropped {self.rejected_batches} refused and {self.spool.dropped_batches} over the spool's bound")

    def stats(self) -> dict[str, float]:
        """For the agent's /metrics."""
        return {
            "depth": self.spool.depth,
            "bytes": self.spool.bytes,
            "dropped_batches": self.spool.dropped_batches,
            "dropped_samples": self.spool.dropped_samples,
            "rejected_batches": self.rejected_batches,
            "rejected_samples": self.rejected_samples,
            "sent_batches": self.sent_batches,
        }
