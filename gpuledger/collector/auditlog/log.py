"""The audit log: an append-only Merkle tree (RFC 9162 hashing) in a ``collector.db`` database: its own SQLite file
(``<data dir>/audit.sqlite``) or, beside a PostgreSQL ledger, that database's schema ``audit`` (its tables never
meet the ledger's; see :func:`open_audit_log`).

Each entry is stored as the exact text that was hashed::

    body = canonical_json({"seq": n, "ts": t, "kind": k, "job_id": j, "key": key, "data": {...}})
    leaf = SHA-256(0x00 || body)                  entry n is leaf n-1 of the tree

Tables: ``entries`` (seq, kind, job_id, key, body, leaf), ``nodes`` (level >= 1, index, hash): every complete
subtree's hash, written when its last leaf is appended, so the root of any tree size, an inclusion proof or a
consistency proof reads O(log^2 n) stored hashes instead of rehashing leaves; ``meta`` keeps the tree head (size,
root) in the same transaction as each append; ``checkpoints`` keeps signed checkpoints this log was given (they
verify by signature, not by where they sit). The columns kind, job_id and key are indexes for queries; ``verify``
checks them against the hashed body. Appends hold the lock ``audit`` (``Database.lock``) for their transaction, so
several processes appending to one log (collectors and commands sharing a PostgreSQL ledger) never fork the tree.

Nothing in this file is a trust anchor: whoever can write the file can rebuild a consistent tree. What catches
that is a signed checkpoint (or a signed report manifest) kept where the log's operator cannot rewrite it, and
``verify`` naming the first entry or range that no longer matches it (see ``accounting.audit.checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuledger.collector.auditlog import merkle
from gpuledger.collector.auditlog.canonical import AuditError, dumps, plain
from gpuledger.collector.auditlog.files import private_file
from gpuledger.collector.db import Database, PostgresDatabase, SqliteDatabase, is_postgres_url, upsert

AUDIT_NAME = "audit.sqlite"
AUDIT_SCHEMA = "audit"  # the PostgreSQL schema of the log beside a PostgreSQL ledger
FORMAT = "2"  # 1: a hash chain (prev/hash columns); 2: the Merkle tree
# gap_record, hours_record, store_bound: since the log binds every input of a charge (``accounting.audit.binding``);
# a log without them still verifies (kinds are labels of hashed bodies, never part of the tree's format)
KINDS: tuple[str, ...] = ("job_record", "usage_record", "correction", "fairshare", "priority_change", "key_rotation",
                          "gap_record", "hours_record", "store_bound")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
  seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, job_id TEXT, key TEXT, body TEXT NOT NULL, leaf BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_job ON entries (job_id, seq);
CREATE INDEX IF NOT EXISTS entries_by_kind ON entries (kind, seq);
CREATE INDEX IF NOT EXISTS entries_by_key ON entries (key, seq);
CREATE TABLE IF NOT EXISTS nodes (level INTEGER NOT NULL, idx INTEGER NOT NULL, hash BLOB NOT NULL,
  PRIMARY KEY (level, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (size INTEGER NOT NULL, note TEXT NOT NULL);
"""
_SET_META = upsert("meta", ("key", "value"), ("key",))
_SET_NODE = upsert("nodes", ("level", "idx", "hash"), ("level", "idx"))
_VERIFY_PAGE = 50_000  # entries read per statement by verify: memory stays bounded on either engine
# ``entries`` reads a page per statement: the first of one row (a caller after the newest entry reads one), then
# doubling up to _ENTRIES_PAGE rows while a page stays under _ENTRIES_PAGE_BYTES (a full fairshare entry holds every
# job it charged: megabytes each), halving when one passes it
_ENTRIES_PAGE = 1_000
_ENTRIES_PAGE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    ts: float
    kind: str
    job_id: str | None
    key: str | None
    data: Any
    leaf: bytes


@dataclass(frozen=True, slots=True)
class Problem:
    """The first entry (or range of entries, ``first..last``) that is not what the log committed to."""

    first: int
    reason: str
    last: int | None = None

    @property
    def seq(self) -> int:
        return self.first

    def where(self) -> str:
        if self.last in (None, self.first):
            return f"audit entry {self.first}"
        return f"audit entries {self.first}..{self.last}"

    def __str__(self) -> str:
        return f"{self.where()}: {self.reason}"


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """``entries`` in the stored tree; ``proven`` of them verify from the first on (all of them when ok)."""

    entries: int
    proven: int
    root: bytes
    problem: Problem | None = None
    levels: tuple[list[bytes], ...] = ()  # the tree recomputed from the bodies: level 0 = leaf hashes

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def head_seq(self) -> int:
        return self.proven

    def root_at(self, size: int) -> bytes:
        """MTH of the first ``size`` entries as recomputed from their bodies (``size`` <= entries)."""
        return root_from_levels(self.levels, size)


def root_from_levels(levels: tuple[list[bytes], ...] | list[list[bytes]], size: int) -> bytes:
    """MTH(D[0:size]) from complete-subtree hashes ``levels[l][i]`` (subtree i of 2**l leaves)."""
    if size == 0:
        return merkle.EMPTY_ROOT
    parts = []
    start = 0
    for level in range(size.bit_length() - 1, -1, -1):
        if size >> level & 1:
            parts.append(levels[level][start >> level])
            start += 1 << level
    root = parts[-1]
    for h in reversed(parts[:-1]):
        root = merkle.node_hash(h, root)
    return root


class EntryDamaged(AuditError):
    """A stored entry's body is not an entry (the log was edited); the message names the entry."""


def _open_error(exc: sqlite3.Error, location: str | os.PathLike[str]) -> AuditError:
    """Why the log's SQLite file could not be opened: a file this user may not write is not "not an audit log" (an
    operator told so might delete a good log)."""
    # ledger_url reads the configuration, which imports the store and, through it, this package: imported here
    from gpuledger.collector.ledger_url import sqlite_problem

    return AuditError(sqlite_problem(exc, location, "an audit log")[0])


class LogDamaged(Exception):
    """A stored hash a proof needs is missing (rows deleted); ``verify`` says which entries."""


class AuditLog:
    """The append-only Merkle log in ``db``: a ``collector.db`` Database (which it then owns and closes), or the
    path of its SQLite file (created readable by its owner only). ``user_alias`` maps user names before recorders
    write them (see open_log).

    Safe to share between threads (one lock); several processes append safely (the lock ``audit``).
    """

    def __init__(
        self,
        db: Database | str | os.PathLike[str],
        user_alias: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path: Path | None = None  # the SQLite file; None on PostgreSQL
        if isinstance(db, (str, os.PathLike)):
            if is_postgres_url(str(db)):
                raise ValueError("AuditLog takes a file path or a Database; open_audit_log opens a PostgreSQL URL")
            self.path = Path(db)
            private_file(self.path)  # SQLite gives its -wal and -shm files the same mode
            try:
                db = SqliteDatabase(self.path)
            except sqlite3.DatabaseError as e:
                raise _open_error(e, self.path) from None
        elif isinstance(db, SqliteDatabase):
            self.path = db.path
        self.location = str(self.path) if self.path is not None else f"{db.url} (schema {AUDIT_SCHEMA})"
        self.user_alias = user_alias
        self._clock = clock
        self._lock = threading.RLock()
        self._db: Database = db
        try:
            with db.transaction():
                db.lock("audit")  # two processes opening a new log create its tables once
                cols = db.columns("entries")
                if "prev" in cols:
                    raise AuditError(f"{self.location}: audit log format 1 (a hash chain); this version keeps a Merkle "
                                     "tree (format 2): verify it with the previous version, then start a new log")
                db.script(_SCHEMA)
                db.execute("INSERT INTO meta (key, value) VALUES ('format', ?) ON CONFLICT (key) DO NOTHING",
                           (FORMAT,))
        except sqlite3.DatabaseError as e:
            db.close()
            raise _open_error(e, self.location) from None
        except BaseException:
            db.close()
            raise

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def alias(self, user: str | None) -> str | None:
        return user if user is None or self.user_alias is None else self.user_alias(user)

    # -- writes ---------------------------------------------------------------------------------------------
    def append(self, kind: str, data: Any, job_id: str | None = None, key: str | None = None,
               newest: tuple[str, int] | None = None) -> Entry | None:
        """Append one entry; see :meth:`append_many`."""
        out = self.append_many([(kind, data, job_id, key)], newest)
        return out[0] if out else None

    def append_many(self, items: Iterable[tuple[str, Any, str | None, str | None]],
                    newest: tuple[str, int] | None = None) -> list[Entry]:
        """Append ``(kind, data, job_id, key)`` items in one transaction; returns the entries written.

        With a ``key``, an item whose data equals the latest entry's under that key is skipped, so re-importing
        unchanged job records or usage does not grow the log. The comparison reads the hashed body, never a cache.
        With ``newest`` = (kind, seq), nothing is written (and [] returned) unless the newest entry of that kind is
        still entry seq, checked in the same transaction: an entry written as a delta on it (``chain``).
        """
        prepared = []
        for i, (kind, data, job_id, key) in enumerate(items):
            if kind not in KINDS:
                raise AuditError(f"audit item {i}: kind {kind!r} is not one of {', '.join(KINDS)}")
            for name, v in (("job_id", job_id), ("key", key)):
                if v is not None and not isinstance(v, str):
                    raise AuditError(f"audit item {i}: {name} {v!r} must be text")
            d = plain(data, f"item {i} ({kind}).data")
            prepared.append((kind, d, dumps(d), job_id, key))
        now = float(self._clock())
        written: list[Entry] = []
        with self._lock, self._db.transaction() as db:
            db.lock("audit")  # serialises appenders of every process: the tree cannot move under us
            if newest is not None:
                row = db.execute("SELECT max(seq) FROM entries WHERE kind=?", (newest[0],)).fetchone()
                if row is None or row[0] != newest[1]:
                    return []
            size = self._size()
            frontier = self._frontier(size)
            seen: dict[str, str] = {}
            for kind, data, text, job_id, key in prepared:
                if key is not None:
                    last = seen.get(key)
                    if last is None:
                        row = db.execute("SELECT body, leaf, seq FROM entries WHERE key=? ORDER BY seq DESC LIMIT 1",
                                         (key,)).fetchone()
                        last = dumps(_entry(*row).data) if row else ""
                    if last == text:
                        continue
                    seen[key] = text
                size += 1
                body = dumps({"seq": size, "ts": now, "kind": kind, "job_id": job_id, "key": key, "data": data})
                leaf = merkle.leaf_hash(body.encode())
                db.execute("INSERT INTO entries (seq, kind, job_id, key, body, leaf) VALUES (?,?,?,?,?,?)",
                           (size, kind, job_id, key, body, leaf))
                self._push(frontier, size - 1, leaf)
                written.append(Entry(size, now, kind, job_id, key, data, leaf))
            if written:
                root = _fold(frontier)
                db.executemany(_SET_META, [("tree_size", str(size)), ("root", root.hex())])
        return written

    def _push(self, frontier: list[tuple[int, bytes]], index: int, leaf: bytes) -> None:
        """Add leaf ``index`` to the right spine, storing every subtree it completes."""
        frontier.append((0, leaf))
        while len(frontier) > 1 and frontier[-1][0] == frontier[-2][0]:
            (level, right), (_, left) = frontier.pop(), frontier.pop()
            h = merkle.node_hash(left, right)
            self._db.execute(_SET_NODE, (level + 1, index >> (level + 1), h))
            frontier.append((level + 1, h))

    def _frontier(self, size: int) -> list[tuple[int, bytes]]:
        out, start = [], 0
        for level in range(size.bit_length() - 1, -1, -1):
            if size >> level & 1:
                out.append((level, self._node(level, start >> level)))
                start += 1 << level
        return out

    def save_checkpoint(self, size: int, note: str) -> None:
        """Keep a signed checkpoint beside the log: ``verify`` narrows with it (its signature, not this table,
        is what makes it evidence)."""
        with self._lock:
            self._db.execute("INSERT INTO checkpoints (size, note) VALUES (?,?)", (size, note))

    def saved_checkpoints(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT note FROM checkpoints ORDER BY size")]

    # -- reads ----------------------------------------------------------------------------------------------
    def _size(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key='tree_size'").fetchone()
        return _tree_size(row[0]) if row else 0

    def size(self) -> int:
        with self._lock:
            return self._size()

    def head(self) -> tuple[int, str]:
        """(tree size, root hash as hex) as stored; the empty tree's root is SHA-256 of nothing."""
        with self._lock:
            rows = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        return _tree_size(rows.get("tree_size", 0)), rows.get("root", merkle.EMPTY_ROOT.hex())

    def _node(self, level: int, idx: int) -> bytes:
        if level == 0:
            row = self._db.execute("SELECT leaf FROM entries WHERE seq=?", (idx + 1,)).fetchone()
        else:
            row = self._db.execute("SELECT hash FROM nodes WHERE level=? AND idx=?", (level, idx)).fetchone()
        first = (idx << level) + 1
        if row is None:
            raise LogDamaged(f"the stored hash of entries {first}..{first + (1 << level) - 1} is missing")
        if not isinstance(row[0], (bytes, bytearray, memoryview)):  # a hash column rewritten as text
            raise LogDamaged(f"the stored hash of entries {first}..{first + (1 << level) - 1} is not a hash (modified)")
        return bytes(row[0])

    def subtree(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) from stored complete subtrees (ranges as RFC 9162's recursion asks for them)."""
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            with self._lock:
                return self._node(n.bit_length() - 1, start // n)
        k = merkle.split(n)
        return merkle.node_hash(self.subtree(start, start + k), self.subtree(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        size = self.size() if size is None else size
        return merkle.EMPTY_ROOT if size == 0 else self.subtree(0, size)

    def inclusion_proof(self, seq: int, size: int | None = None) -> list[bytes]:
        """The audit path of entry ``seq`` (leaf seq-1) in the tree of ``size`` entries (default: now)."""
        size = self.size() if size is None else size
        return merkle.inclusion_proof(seq - 1, size, self.subtree)

    def consistency_proof(self, first: int, second: int | None = None) -> list[bytes]:
        """Proof that the tree of ``second`` entries (default: now) extends the tree of ``first`` entries."""
        second = self.size() if second is None else second
        if second > self.size():
            raise AuditError(f"the log has {self.size()} entries, not {second}")
        return merkle.consistency_proof(first, second, self.subtree)

    def get(self, seq: int) -> Entry | None:
        with self._lock:
            row = self._db.execute("SELECT body, leaf, seq FROM entries WHERE seq=?", (seq,)).fetchone()
        return _entry(*row) if row else None

    def checked(self, seq: int) -> Entry | None:
        """Entry ``seq`` after recomputing its leaf from its body and checking its labels: EntryDamaged naming it
        when the stored leaf (what proofs are built from) no longer states the body."""
        with self._lock:
            row = self._db.execute("SELECT seq, kind, job_id, key, body, leaf FROM entries WHERE seq=?",
                                   (seq,)).fetchone()
        if row is None:
            return None
        bad, _ = _row_problem(*row)
        if bad is not None:
            raise EntryDamaged(str(bad))
        return _entry(row[4], row[5], row[0])

    def latest_by_prefix(self, prefix: str) -> dict[str, Entry]:
        """The newest entry under each key that starts with ``prefix``: one statement instead of one per key
        (binding compares every record of a store, and looks for the logged ones the store no longer has)."""
        where, args = "substr(key, 1, ?) = ?", [len(prefix), prefix]
        if prefix and isinstance(self._db, SqliteDatabase):  # BINARY collation: the key index holds them in a range
            where += " AND key >= ? AND key < ?"
            args += [prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)]
        sql = (f"SELECT body, leaf, seq FROM entries WHERE seq IN (SELECT max(seq) FROM entries WHERE {where} "
               "GROUP BY key) ORDER BY seq")
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        out: dict[str, Entry] = {}
        for row in rows:
            e = _entry(*row)
            if e.key is not None:
                out[e.key] = e
        return out

    def latest(self, key: str) -> Entry | None:
        """The newest entry written under ``key`` (read from its hashed body)."""
        with self._lock:
            row = self._db.execute("SELECT body, leaf, seq FROM entries WHERE key=? ORDER BY seq DESC LIMIT 1",
                                   (key,)).fetchone()
        return _entry(*row) if row else None

    def previous(self, kind: str, seq: int) -> Entry | None:
        """The newest entry of ``kind`` before entry ``seq`` (read from its hashed body)."""
        with self._lock:
            row = self._db.execute("SELECT body, leaf, seq FROM entries WHERE kind=? AND seq < ? ORDER BY seq DESC "
                                   "LIMIT 1", (kind, seq)).fetchone()
        return _entry(*row) if row else None

    def entries(self, job_id: str | None = None, kind: str | None = None, newest_first: bool = False,
                key_prefix: str | None = None) -> Iterator[Entry]:
        where: list[str] = []
        args: list[Any] = []
        for col, v in (("job_id", job_id), ("kind", kind)):
            if v is not None:
                where.append(f"{col}=?")
                args.append(v)
        if key_prefix is not None:  # not a range on key: text collations differ between engines
            where.append("substr(key, 1, ?) = ?")
            args += [len(key_prefix), key_prefix]
        after: int | None = None
        page = 1
        while True:  # a page per statement: memory stays bounded however many entries match, however large
            w = [*where, "seq < ?" if newest_first else "seq > ?"] if after is not None else where
            sql = "SELECT body, leaf, seq FROM entries" + (" WHERE " + " AND ".join(w) if w else "")
            sql += " ORDER BY seq" + (" DESC" if newest_first else "") + " LIMIT ?"
            with self._lock:
                rows = self._db.execute(sql, [*args, *([after] if after is not None else []), page]).fetchall()
            size = sum(len(row[0]) for row in rows)
            for row in rows:
                yield _entry(*row)
            if len(rows) < page:
                return
            after = rows[-1][2]
            page = max(1, page // 2) if size > _ENTRIES_PAGE_BYTES else min(2 * page, _ENTRIES_PAGE)

    # -- verification ---------------------------------------------------------------------------------------
    def verify(self) -> VerifyResult:
        """Recompute the tree from the entries' bodies and compare it with everything stored.

        Per row, in order: its seq is the next one (else an entry is missing, or a row before entry 1 was
        inserted); the seq, kind, job id and key in the hashed body match the row (else rows were renumbered or
        re-labelled: the body's seq tells which entry is really missing or inserted); its leaf hash matches the
        body (else it was modified). Then every stored subtree hash must match the recomputed one (else an entry
        under it was modified and re-hashed: the lowest, left-most mismatch names the range), and the stored
        head (size, root) must match (else the tail was cut or extended). What is reported is the first problem
        by entry number; ``proven`` entries before it verify.
        """
        with self._lock, self._db.snapshot():  # one state of the log, while appenders go on
            return self._verify()

    def _rows(self) -> Iterator[Sequence[Any]]:
        """(seq, kind, job_id, key, body, leaf) of every stored entry in order, a page per statement."""
        sql = "SELECT seq, kind, job_id, key, body, leaf FROM entries"
        rows = self._db.execute(sql + " ORDER BY seq LIMIT ?", (_VERIFY_PAGE,)).fetchall()
        while rows:
            yield from rows
            if len(rows) < _VERIFY_PAGE:
                return
            rows = self._db.execute(sql + " WHERE seq > ? ORDER BY seq LIMIT ?", (rows[-1][0], _VERIFY_PAGE)).fetchall()

    def _verify(self) -> VerifyResult:
        sha = hashlib.sha256
        leaves: list[bytes] = []
        problems: list[Problem] = []
        expected = 1
        for seq, kind, job_id, key, body, leaf in self._rows():
            bad: Problem | None = None
            if seq < 1:
                bad = Problem(seq, "inserted: the log starts at entry 1 (a forged row before it)")
            elif seq != expected:
                bad = Problem(expected, f"missing (deleted): the next stored entry is {seq}")
            else:
                bad, h = _row_problem(seq, kind, job_id, key, body, leaf)
                if bad is None:
                    leaves.append(h)
            if bad is not None:
                problems.append(bad)
                break
            expected += 1
        n = len(leaves)
        levels: list[list[bytes]] = [leaves]
        one = b"\x01"
        while len(levels[-1]) > 1:
            below = iter(levels[-1])
            levels.append([sha(one + a + b).digest() for a, b in zip(below, below)])
        if not problems:
            problems += self._check_nodes(levels)
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        root_hex = meta.get("root")
        try:
            size = _tree_size(meta.get("tree_size", 0))
        except EntryDamaged as e:  # the head no longer says what it committed to: nothing is proven against it
            size = n
            problems.append(Problem(1, str(e), n))
        root = root_from_levels(levels, n)
        if not problems:
            if size > n:
                problems.append(Problem(n + 1, f"missing (deleted): the log head records {size} entries", size))
            elif size < n:
                problems.append(Problem(size + 1, f"not recorded by the log head ({size} entries): appended outside "
                                        "the log", n))
            elif root_hex != root.hex() and n:
                problems.append(Problem(1, "the log head records a different root (tree rewritten)", n))
        if not problems:
            return VerifyResult(n, n, root, None, tuple(levels))
        bad = _first(problems)
        return VerifyResult(n, max(bad.first - 1, 0), root, bad, tuple(levels))

    def _check_nodes(self, levels: list[list[bytes]]) -> list[Problem]:
        """The lowest, left-most stored subtree hash that differs from the recomputed one, per level."""
        out = []
        for level in range(1, len(levels)):
            want = levels[level]
            got = [h for (h,) in self._db.execute(
                "SELECT hash FROM nodes WHERE level=? AND idx < ? ORDER BY idx", (level, len(want)))]
            if got == want:
                continue
            have = dict(self._db.execute("SELECT idx, hash FROM nodes WHERE level=? AND idx < ?", (level, len(want))))
            for i, h in enumerate(want):
                if have.get(i) != h:
                    first = (i << level) + 1
                    why = ("its stored subtree hash is missing (deleted)" if i not in have else
                           "do not match their stored subtree hash (one of them modified and re-hashed)")
                    out.append(Problem(first, why, first + (1 << level) - 1))
                    break
        return out


def _first(problems: list[Problem]) -> Problem:
    """The left-most problem; a narrower range inside it names the changed entries more precisely (a re-hashed
    entry's subtree hashes mismatch from the lowest level the attacker did not rewrite up to the root)."""
    ordered = sorted(problems, key=lambda p: (p.first, p.last or p.first))
    bad = ordered[0]
    for p in ordered[1:]:
        if bad.first <= p.first and (p.last or p.first) <= (bad.last or bad.first):
            bad = p
    return bad


def _fold(frontier: list[tuple[int, bytes]]) -> bytes:
    if not frontier:
        return merkle.EMPTY_ROOT
    root = frontier[-1][1]
    for _, h in reversed(frontier[:-1]):
        root = merkle.node_hash(h, root)
    return root


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decode = json.JSONDecoder(parse_constant=_no_constant).decode  # built once: verify decodes every body


def _tree_size(value: Any) -> int:
    """The head's tree size as stored (text in ``meta``); EntryDamaged naming it when it is not a count."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise EntryDamaged(f"the audit log head: tree size {value!r} is not a count of entries (modified)")
    return n


def _row_problem(seq: int, kind: Any, job_id: Any, key: Any, body: Any, leaf: Any) -> tuple[Problem | None, bytes]:
    """What is wrong with one stored row on its own (a body that is not text, a leaf that is not a hash, labels
    that are not the body's, a leaf hash that does not state the body), and the leaf hash of its body."""
    if not isinstance(body, str):  # e.g. rewritten as a BLOB: the hashed text is gone
        return Problem(seq, f"body is stored as {type(body).__name__}, not the hashed text (modified)"), b""
    if not isinstance(leaf, (bytes, bytearray, memoryview)):
        return Problem(seq, f"leaf hash is stored as {type(leaf).__name__}, not a hash (modified)"), b""
    if not _labels_match(body, seq, kind, job_id, key):
        return _relabelled(body, seq), b""
    h = hashlib.sha256(b"\x00" + body.encode()).digest()
    if h != bytes(leaf):
        return Problem(seq, "content does not match its leaf hash (modified)"), h
    return None, h


def _labels_match(body: str, seq: int, kind: Any, job_id: Any, key: Any) -> bool:
    """The hashed body is a JSON object whose integer seq, kind, job_id and key are the row's (a key it lacks
    matches NULL)."""
    try:
        d = _decode(body)
    except (ValueError, RecursionError):  # RecursionError: valid JSON nested deeper than the decoder goes
        return False
    if type(d) is not dict:
        return False
    s, k, j, y = d.get("seq"), d.get("kind"), d.get("job_id"), d.get("key")
    return (type(s) is int and s == seq and type(k) is type(kind) and k == kind and type(j) is type(job_id)
            and j == job_id and type(y) is type(key) and y == key)


def _relabelled(body: str, seq: int) -> Problem:
    try:
        real = json.loads(body)["seq"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return Problem(seq, "body is not a canonical audit entry (modified)")
    if isinstance(real, int) and not isinstance(real, bool) and real > seq:
        return Problem(seq, f"missing or out of order (deleted or reordered): row {seq} holds entry {real}")
    if isinstance(real, int) and not isinstance(real, bool) and real < seq:
        return Problem(real, f"inserted: rows {real}..{seq - 1} were added before entry {real}, "
                             f"which now sits at row {seq}")
    return Problem(seq, "stored kind/job_id/key disagree with its hashed content (modified)")


def _entry(body: str, leaf: bytes, seq: int) -> Entry:
    """An Entry from a stored row; a body that is not an entry raises EntryDamaged naming it (never a traceback)."""
    bad = (f"body is stored as {type(body).__name__}, not the hashed text" if not isinstance(body, str) else
           f"leaf hash is stored as {type(leaf).__name__}, not a hash"
           if not isinstance(leaf, (bytes, bytearray, memoryview)) else None)
    if bad is not None:
        raise EntryDamaged(f"audit entry {seq}: {bad} (modified)")
    try:
        d = json.loads(body)
        return Entry(d["seq"], d["ts"], d["kind"], d["job_id"], d.get("key"), d["data"], bytes(leaf))
    except RecursionError:  # valid JSON nested deeper than the decoder goes: no entry gpuledger writes
        raise EntryDamaged(f"audit entry {seq}: body is not a canonical audit entry (modified): nested too deeply"
                           ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise EntryDamaged(f"audit entry {seq}: body is not a canonical audit entry (modified): "
                           f"{type(e).__name__}: {e}") from None


def open_audit_log(ledger_url: str | None, data_dir: str | os.PathLike[str],
                   user_alias: Callable[[str], str] | None = None, clock: Callable[[], float] = time.time) -> AuditLog:
    """The audit log that goes with the ledger at ``ledger_url``: beside a PostgreSQL ledger (``postgresql://``)
    the schema ``audit`` of that database, shared by every collector and command using it; otherwise (no URL, or
    a SQLite ledger) the data dir's own file ``<data_dir>/audit.sqlite``."""
    if ledger_url is not None and is_postgres_url(ledger_url):
        return AuditLog(PostgresDatabase(ledger_url, schema=AUDIT_SCHEMA), user_alias=user_alias, clock=clock)
    return AuditLog(Path(data_dir) / AUDIT_NAME, user_alias=user_alias, clock=clock)
