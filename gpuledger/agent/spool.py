"""A bounded on-disk spool of unsent batches, and the pusher that drains it in order with backoff.

The spool is a directory of files ``<seq, 20 digits>-<samples>.<json|msgpack>[.gz|.zst]``, each the exact
request body of one batch, written atomically (temporary file, fsync, rename, fsync of the directory): a
crash leaves a whole batch or none. A batch keeps its sequence number across retries and agent restarts,
so the collector acknowledges a re-sent batch without storing it twice. When the spool is over its bound
(bytes or batches) the oldest batches are dropped and counted: recent data is worth more to a fairshare
that decays, and the newest batch always fits.

:class:`SpoolingPusher` is an Agent sink: ``write`` only spools (never blocks on the network, unless the spool
cannot store a batch); a sender thread posts the oldest batch first. A connection failure, no whole answer within
the pusher's deadline, a 5xx, a 2xx that is no collector's acknowledgement, a redirect or 401/403/404/405/415
(configuration, not the batch), 408 or 429 stops the pass, and the spool is
tried again after an exponential, jittered delay, or the answer's Retry-After when that is longer (capped at
``backoff_max_s``). A 400 for times in the collector's future (this node's clock was ahead when it sampled) is
about that batch alone: it waits in the spool on a backoff of its own, the batches after it go ahead, and it is
taken once its times are no longer in the future. A 413 too_large is about the batch's size: it is replaced in
the spool by two halves under new seqs (a collector may have stored the batch whole while its answer was lost: a
half under its seq would be refused as a conflict), sent next. A 422 too_late that stored some samples is an
acknowledgement: the batch is delivered, the samples behind their GPU's window are counted as refused. Any other
4xx (a too_late that stored none too) means the collector will never take the batch: it is dropped, counted and
logged. Before any of this, a batch refused for what it holds (``PushError.about_content``: a 400, 403, 413 or
422, not for clock skew) that carries job records is sent again at once without the one the answer names (or all),
under a new seq (``HttpPusher.resend_without_jobs``): taken, the records left out were the cause (a job user's
``SLURM_CLUSTER_NAME``, a control character), dropped and counted, and the batch's file goes; refused again for
another reason, that answer decides the batch as above. Each failed attempt is one warning line.

A batch the spool cannot store (a full disk) is posted at once if the collector was reachable; one that is then
not delivered either is dropped and counted (``unsent``), as is one whose sequence number cannot be persisted.

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

from gpuledger.agent.push import (
    Ack,
    DirectSink,
    HttpPusher,
    PushError,
    decode_batch,
    divisible,
    encode_batch,
    halve,
    write_batches,
)
from gpuledger.schema.records import GpuSample, JobRecord

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{20})-(\d+)\.(json|msgpack)(?:\.(gz|zst))?$")
_COMPRESS_SUFFIX = {None: "", "gzip": ".gz", "zstd": ".zst"}
_SUFFIX_COMPRESS = {None: None, "gz": "gzip", "zst": "zstd"}
SEQ_FILE = ".next-seq"  # hidden: the spool directory lists batches


def retryable(exc: PushError) -> bool:
    """Keep the batch and try again later? (No answer, 5xx, overload, configuration, clock skew: then it waits
    without holding up the others.)"""
    return exc.failover or exc.clock_skewed


class SeqFile:
    """Sequence numbers that survive restarts without the clock: the file holds the first number not yet
    reserved; numbers are reserved ``block`` at a time (one fsync per block), so a crash skips at most a
    block and a half and never reuses a number. ``reserved`` is what the file holds (never more): a number below
    it is one a restart will not hand out again."""

    def __init__(self, path: str | os.PathLike[str], block: int = 1024) -> None:
        self.path = Path(path)
        self.block = block
        self._extend_failed = False
        self._lock = threading.Lock()  # the sampling thread and the sender's re-split both reserve
        try:
            self.reserved = int(self.path.read_text().strip())
        except FileNotFoundError:
            self.reserved = 0
        except ValueError as exc:
            raise ValueError(f"sequence file {self.path} is corrupt ({exc}): remove it only together with "
                             "the spool, or the collector may take new batches for old ones") from None

    def reserve(self, seq: int) -> None:
        """Make sure ``seq`` is below the persisted reservation before it is used; OSError when it is not and the
        file cannot be written (a full disk): then ``seq`` must not be used. The reservation is extended once less
        than half a block is left, so a disk that fills leaves numbers that are reserved already."""
        with self._lock:
            self._reserve(seq)

    def _reserve(self, seq: int) -> None:
        if seq < self.reserved - self.block // 2:
            return
        try:
            _write_durably(self.path, f"{seq + self.block}\n".encode())
        except OSError as exc:
            if seq >= self.reserved:
                raise
            if not self._extend_failed:  # once, not once a batch while the disk stays full
                log.warning("cannot extend the reservation of sequence numbers in %s (%s): %d reserved numbers are "
                            "left", self.path, exc, self.reserved - seq)
                self._extend_failed = True
            return
        self.reserved = seq + self.block
        self._extend_failed = False


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
            self._enforce_bound(keep={max(self._index)} if self._index else set())  # the newest always fits

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
        """Store one batch durably (replacing one of the same seq), then drop the oldest while over the bound.
        OSError (a full disk) when it cannot: then nothing of it is left behind."""
        b = self._write(seq, body, samples, fmt, compress)
        with self._lock:
            self._index_locked(b)
            self._enforce_bound(keep={seq})

    def replace(self, seq: int, parts: Sequence[tuple[int, builtins.bytes, int]], fmt: str = "json",
                compress: str | None = None) -> None:
        """Replace batch ``seq`` by ``parts`` (seq, body, samples), each stored durably before it is removed (a crash
        between leaves both: the collector counts the samples sent twice as duplicates, and stores them once); it
        is neither counted as dropped nor makes room under the bound, and the bound drops none of the parts.
        Nothing is stored when ``seq`` is gone meanwhile (dropped over the bound). OSError (a full disk) when the
        parts cannot be stored: then ``seq`` is left as it is, and nothing of them behind."""
        written: list[SpooledBatch] = []
        try:
            for part_seq, body, samples in parts:
                written.append(self._write(part_seq, body, samples, fmt, compress))
        except OSError:
            for b in written:
                (self.path / b.name).unlink(missing_ok=True)
            raise
        with self._lock:
            if seq not in self._index:
                for b in written:
                    (self.path / b.name).unlink(missing_ok=True)
                return
            self._remove_locked(seq, dropped=False)
            for b in written:
                self._index_locked(b)
            self._enforce_bound(keep={b.seq for b in written})

    def _write(self, seq: int, body: builtins.bytes, samples: int, fmt: str, compress: str | None) -> SpooledBatch:
        name = f"{seq:020d}-{samples}.{fmt}{_COMPRESS_SUFFIX[compress]}"
        _write_durably(self.path / name, body)
        return SpooledBatch(seq, samples, fmt, compress, len(body), name)

    def _index_locked(self, b: SpooledBatch) -> None:
        """Index a batch whose file is written, replacing one of the same seq."""
        old = self._index.pop(b.seq, None)
        if old is not None:
            self._bytes -= old.size
            if old.name != b.name:
                (self.path / old.name).unlink(missing_ok=True)
        self._index[b.seq] = b
        self._bytes += b.size

    def oldest(self, skip: frozenset[int] | set[int] = frozenset()) -> tuple[SpooledBatch, builtins.bytes] | None:
        """The batch with the lowest seq not in ``skip`` and its body; an unreadable file is dropped (and counted)."""
        while True:
            with self._lock:
                seq = min((s for s in self._index if s not in skip), default=None)
                if seq is None:
                    return None
            if (item := self.get(seq)) is not None:
                return item

    def get(self, seq: int) -> tuple[SpooledBatch, builtins.bytes] | None:
        """The batch of ``seq`` and its body; None when there is none, or its file is unreadable (then it is
        dropped and counted)."""
        with self._lock:
            b = self._index.get(seq)
        if b is None:
            return None
        try:
            return b, (self.path / b.name).read_bytes()
        except OSError as exc:
            log.error("spool: cannot read %s, dropping it: %s", b.name, exc)
            self.remove(b.seq, dropped=True)
            return None

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

    def _enforce_bound(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Drop the oldest batches not in ``keep`` while over the bound."""
        while self._bytes > self.max_bytes or len(self._index) > self.max_batches:
            oldest = min((s for s in self._index if s not in keep), default=None)
            if oldest is None:  # what is kept is over the bound alone: kept
                return
            log.warning("spool full (%d batches, %d bytes): dropping the oldest batch, seq %d",
                        len(self._index), self._bytes, oldest)
            self._remove_locked(oldest, dropped=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: builtins.bytes) -> None:
    """``path`` holds ``data`` whole, or (OSError) is as it was: a temporary file, fsync, rename, fsync of the
    directory (the rename itself must survive a power loss). The temporary file never outlives a failure."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
        self.late_samples = 0  # of batches stored, the samples refused as too late for their GPU's window (422)
        self.sent_batches = 0
        self.last_error: str | None = None
        self.seq_file = SeqFile(spool.path / SEQ_FILE)
        # what the spool cannot store goes this way (write's thread only; the sender counts the spool's own)
        self.direct = DirectSink(pusher, unkept="the spool cannot store it", reserve=self.seq_file.reserve)
        self._cannot_spool = False  # the last batch could not be stored: said once until one can
        # after a restart: new batches go after every number used before (spooled or already delivered)
        pusher.bump_seq(max(self.seq_file.reserved, (spool.max_seq() or -1) + 1))

    # -- the sink side --------------------------------------------------------------------------
    def write(self, samples: Sequence[GpuSample]) -> int | None:
        """Spool one tick's samples (see :meth:`write_ticks`)."""
        return self.write_ticks([samples])

    def write_ticks(self, ticks: Sequence[Sequence[GpuSample]]) -> int | None:
        """Spool ticks' samples as batches of whole ticks (``agent.push.write_batches``), each under a new seq
        persisted first (:meth:`_reserve`), and wake the sender; returns the first seq (None: none could be
        reserved). A batch the spool cannot store is posted at once (:meth:`_post_unspooled`). Raises PushError for
        an unencodable batch, after the others are spooled (its job records ride with the next batch)."""
        return write_batches(self.pusher, ticks, self.fmt, self.compress, self._spool_batch, self._reserve)

    def _reserve(self, seq: int, part: list[GpuSample]) -> bool:
        """Persist ``seq`` before it is used (False: it cannot be, and the batch is dropped and counted)."""
        try:
            self.seq_file.reserve(seq)
        except OSError as exc:
            # Not persisted: a restart would hand seq out again, to other samples, which the collector would
            # refuse as stored before with other content. So the batch is neither spooled nor sent.
            self.direct.drop(seq, len(part), f"sequence number {seq} cannot be persisted in "
                                             f"{self.seq_file.path} ({exc.strerror or exc})")
            return False
        return True

    def _spool_batch(self, seq: int, body: bytes, part: list[GpuSample],
                     jobs: list[JobRecord]) -> list[list[GpuSample]]:
        """Store one encoded batch for the sender, or post it when the spool cannot store it (returns the halves
        to go instead of it, as :meth:`_post_unspooled` does)."""
        try:
            self.spool.put(seq, body, len(part), self.fmt, self.compress)
        except OSError as exc:
            return self._post_unspooled(seq, body, part, jobs, exc)
        self._cannot_spool = False
        self._wake.set()
        return []

    def _post_unspooled(self, seq: int, body: bytes, part: list[GpuSample], jobs: list[JobRecord],
                        cause: OSError) -> list[list[GpuSample]]:
        """A batch the spool could not store (a full disk), posted now (``direct``) rather than lost; returns its
        halves when the collector refused it as too large, to go the same way. Not tried while the sender's last
        attempt failed: the collector is down, and waiting on it here would hold up sampling.

        Its seq may go out without a spool file: ``SeqFile.reserve`` persisted a reservation above it before it was
        used, and a restart starts at or above that, so the number is never handed out again."""
        if not self._cannot_spool:
            log.warning("spool %s cannot store batch %d (%s): batches go to the collector directly until it can",
                        self.spool.path, seq, cause)
            self._cannot_spool = True
        if self.failures:
            self.pusher.return_jobs(jobs)
            self.direct.drop(seq, len(part), "the collector was unreachable at the last attempt")
            return []
        return self.direct.post(seq, body, part, jobs, self.fmt, self.compress)

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
            ahead: list[int] = []  # the halves of a batch refused as too large: sent next, before the later ones
            while True:
                if ahead:
                    item = self.spool.get(ahead.pop(0))
                    if item is None:  # dropped meanwhile (the spool's bound)
                        continue
                else:
                    item = self.spool.oldest(skip=waiting)
                    if item is None:
                        return True
                b, body = item
                try:
                    try:
                        ack = self.pusher.post(b.seq, body, b.fmt, b.compress, samples=b.samples)
                    except PushError as refused:
                        ack = self._without_jobs(b, body, refused)
                except PushError as exc:
                    self.last_error = str(exc)
                    if self._refused(b, body, exc, waiting, ahead):
                        continue
                    return False
                self.spool.remove(b.seq)
                self._skewed.pop(b.seq, None)
                self.sent_batches += 1
                self.late_samples += ack.too_late
                if self.failures:
                    log.info("collector reachable again after %d failed attempts", self.failures)
                self.failures = 0
                self._retry_after_s = None
                self.last_error = None

    def _without_jobs(self, b: SpooledBatch, body: bytes, refused: PushError) -> Ack:
        """A spooled batch refused for what it holds: when it carries job records, its samples sent again without
        the refused ones under a new seq (``HttpPusher.resend_without_jobs``), and that answer decides it (the
        batch's file goes once one is taken). Raises ``refused`` when it carries none (or its body is not one this
        agent made, or the new seq cannot be persisted), else the new attempt's PushError."""
        if not refused.about_content:  # not decoded for an answer that is not about it
            raise refused
        try:
            head, samples, jobs = decode_batch(body, b.fmt, b.compress)
        except ValueError:
            raise refused from None
        return self.pusher.resend_without_jobs(refused, b.seq, samples, jobs, b.fmt, b.compress,
                                               self.seq_file.reserve, head)

    def _refused(self, b: SpooledBatch, body: bytes, exc: PushError, waiting: set[int], ahead: list[int]) -> bool:
        """What a batch's failed attempt means for it: kept for later on its own (clock skew: ``waiting``), replaced
        by halves sent next (too large: ``ahead``), dropped (refused for good), or kept and the pass stopped (False:
        a retryable failure, counted in ``failures``). True: the pass goes on."""
        if exc.clock_skewed:
            attempts = self._skewed.get(b.seq, (0, 0.0))[0] + 1
            self._skewed[b.seq] = (attempts, self._clock() + self._backoff(attempts))
            waiting.add(b.seq)
            log.warning("collector %s for batch %d (%d samples): kept in the spool, retried later; "
                        "the batches after it go first", exc.describe(), b.seq, b.samples)
            return True
        if exc.too_large:
            try:
                halves = self._split_spooled(b, body)
            except OSError as err:  # the halves cannot be stored: the batch is kept as it is
                self.failures += 1
                log.warning("collector %s for batch %d (%d samples): its halves cannot be spooled (%s): "
                            "kept, retried later", exc.describe(), b.seq, b.samples, err)
                return False
            if halves:
                log.warning("collector %s for batch %d (%d samples): replaced in the spool by two "
                            "halves, sent next", exc.describe(), b.seq, b.samples)
                self._skewed.pop(b.seq, None)
                ahead[:0] = halves
                return True
        if not retryable(exc):
            log.warning("collector refused batch %d (%d samples) for good, %s: dropped",
                        b.seq, b.samples, exc.describe())
            self.rejected_batches += 1
            self.rejected_samples += b.samples
            self.spool.remove(b.seq)
            self._skewed.pop(b.seq, None)
            return True
        self.failures += 1
        self._retry_after_s = exc.retry_after_s
        log.warning("collector %s for batch %d (%d samples): kept in the spool (%d batches), retried "
                    "later", exc.describe(), b.seq, b.samples, self.spool.depth)
        return False

    def _split_spooled(self, b: SpooledBatch, body: bytes) -> list[int]:
        """A spooled batch the collector refused as too large, replaced in the spool by two halves (``halve``,
        ``Spool.replace``), each under a new seq: a collector before the one that refused it may have stored it
        whole while its answer was lost, and would refuse a half under its seq as a conflict (other content), for
        good; under new seqs the halves are taken, their samples counted as stored before. Returns their seqs, to be
        sent next, before the later batches, so that each GPU's samples arrive in order (should the agent stop
        before, they go in seq order: after the batches spooled since the refused one). [] when it cannot be split (one
        GPU's instant, or not a body this agent made). OSError when the halves cannot be stored: the batch is left as
        it is."""
        try:
            head, samples, jobs = decode_batch(body, b.fmt, b.compress)
        except ValueError as exc:
            log.warning("spooled batch %d cannot be split: %s", b.seq, exc)
            return []
        if not divisible(samples):
            return []
        seqs = [self.pusher.next_seq(), self.pusher.next_seq()]
        for seq in seqs:
            self.seq_file.reserve(seq)
        # the job records with the second half, which goes after the first (the collector keeps a record only for a
        # job it has samples of)
        parts = [(seq, encode_batch(head["agent_id"], head["host"], seq, part, recs, b.fmt, b.compress,
                                    cluster=head.get("cluster", "")), len(part))
                 for seq, part, recs in zip(seqs, halve(samples), ([], jobs))]
        self.spool.replace(b.seq, parts, b.fmt, b.compress)
        return seqs

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
        return self.sent_batches + self.direct.sent_batches

    def summary(self) -> str:
        p, d = self.pusher, self.direct
        return (f"delivered {self.delivered()} batch(es) ({p.samples_sent} samples, {p.samples_refused} of them not "
                f"stored by the collector); {self.spool.depth} batch(es) left in the spool for the next start; "
                f"dropped {self.rejected_batches + d.rejected_batches} refused and {self.spool.dropped_batches} over "
                f"the spool's bound; {d.unsent_batches} batch(es) ({d.unsent_samples} samples) neither spooled nor "
                "delivered")

    def stats(self) -> dict[str, float]:
        """For the agent's /metrics."""
        return {
            "depth": self.spool.depth,
            "bytes": self.spool.bytes,
            "dropped_batches": self.spool.dropped_batches,
            "dropped_samples": self.spool.dropped_samples,
            "rejected_batches": self.rejected_batches + self.direct.rejected_batches,
            "rejected_samples": self.rejected_samples + self.late_samples + self.direct.rejected_samples
            + self.direct.late_samples,
            "unsent_batches": self.direct.unsent_batches,
            "unsent_samples": self.direct.unsent_samples,
            "sent_batches": self.delivered(),
            "trimmed_list_items": self.pusher.rows_trimmed,
            "refused_job_records": self.pusher.job_records_refused,
            "unattributed_samples": self.pusher.samples_unattributed,
        }
