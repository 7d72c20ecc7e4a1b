"""The tamper-evident audit trail: an append-only, hash-chained log, and Ed25519-signed report manifests.

Storage: ``<data-dir>/audit.sqlite`` (SQLite rather than JSONL because appends from several processes need a
transaction, ``audit explain`` needs an index by job id, and the ledger's move to PostgreSQL keeps the same
table). Each entry is stored as the exact text that was hashed::

    body = canonical_json({"seq": n, "ts": t, "kind": k, "job_id": j, "data": {...}})
    hash = sha256(prev_hash + "\\n" + body)          (prev_hash of entry 1: 64 zeros)

``canonical_json`` sorts keys, drops whitespace, writes floats as Python's shortest round-trip ``repr`` and
refuses NaN/inf, so one entry has exactly one text. ``seq`` inside the hashed body makes deletion, insertion and
reordering visible even where an attacker rewrites the ``seq`` column; the ``prev`` column is the link that
``verify`` checks first. The ``meta`` table keeps the head (seq, hash) in the same transaction as each append, so
truncating the tail without also rewriting ``meta`` is detected; a signed report manifest anchors the head
independently (``verify_report``). A hash chain has no secret: whoever can rewrite the whole file from some entry
on can forge a consistent chain; the signed manifests (and copies of them kept elsewhere) are what catch that.

Entry kinds: ``job_record``, ``usage_record``, ``fairshare`` (inputs + outputs), ``priority_change``.
User names never enter the log in clear when the log is opened with a pseudonymizer (``open_log`` does): an
append-only log cannot honour a retention period for personal data, keyed hashes can (see ``accounting.privacy``).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from gpuledger.schema.records import JobRecord, JobUsage

AUDIT_NAME = "audit.sqlite"
PRIVATE_KEY_NAME = "audit-signing.key"
PUBLIC_KEY_NAME = "audit-signing.pub"
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "gpuledger-report-manifest/1"
GENESIS = "0" * 64
KINDS: tuple[str, ...] = ("job_record", "usage_record", "fairshare", "priority_change")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
  seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, job_id TEXT, body TEXT NOT NULL, prev TEXT NOT NULL,
  hash TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_job ON entries (job_id, seq);
CREATE INDEX IF NOT EXISTS entries_by_kind ON entries (kind, seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS latest (kind TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,
  PRIMARY KEY (kind, key)) WITHOUT ROWID;
"""


class AuditError(ValueError):
    """Bad input to the audit log (an unserialisable value, an unknown kind); the message says what and where."""


# -- canonical JSON ---------------------------------------------------------------------------------------------
class _Bad(Exception):
    """Raised inside _plain; the path to the bad value is built while unwinding (no path strings on success)."""

    def __init__(self, value: Any, why: str) -> None:
        self.value, self.why, self.path = value, why, ""


def plain(obj: Any, where: str = "$") -> Any:
    """JSON-ready copy of ``obj``: dataclasses, NamedTuples and mappings become dicts (string keys), tuples lists.

    Raises AuditError naming the path of a value JSON cannot carry exactly (NaN, inf, an arbitrary object).
    """
    try:
        return _plain(obj)
    except _Bad as b:
        raise AuditError(f"{where}{b.path}: {b.value!r} {b.why}") from None


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if obj - obj != 0.0:  # NaN or inf
            raise _Bad(obj, "has no exact JSON form")
        return obj
    if isinstance(obj, Enum):
        return _plain(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):  # a NamedTuple keeps its field names
        return _plain(obj._asdict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise _Bad(k, "is not a string key")
            try:
                out[k] = _plain(v)
            except _Bad as b:
                b.path = f".{k}{b.path}"
                raise
        return out
    if isinstance(obj, (list, tuple)):
        out_l = []
        for i, v in enumerate(obj):
            try:
                out_l.append(_plain(v))
            except _Bad as b:
                b.path = f"[{i}]{b.path}"
                raise
        return out_l
    raise _Bad(obj, f"({type(obj).__name__}) cannot be written to the audit log")


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII, floats as their shortest round-trip repr; one text per value."""
    return _dumps(plain(obj))


def _dumps(plain_obj: Any) -> str:
    return json.dumps(plain_obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def entry_hash(prev: str, body: str) -> str:
    return hashlib.sha256(f"{prev}\n{body}".encode()).hexdigest()


# -- the log ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    ts: float
    kind: str
    job_id: str | None
    data: Any
    prev: str
    hash: str


@dataclass(frozen=True, slots=True)
class Problem:
    seq: int  # the first bad entry (for a truncated tail: the first missing one)
    reason: str

    def __str__(self) -> str:
        return f"audit entry {self.seq}: {self.reason}"


@dataclass(frozen=True, slots=True)
class VerifyResult:
    entries: int
    head_seq: int
    head_hash: str
    problem: Problem | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


class AuditLog:
    """An append-only hash chain in SQLite. ``user_alias`` maps user names before they are written."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        user_alias: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.user_alias = user_alias
        self._clock = clock
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def alias(self, user: str | None) -> str | None:
        return user if user is None or self.user_alias is None else self.user_alias(user)

    # -- writes ---------------------------------------------------------------------------------------------
    def append(self, kind: str, data: Any, job_id: str | None = None, dedupe_key: str | None = None) -> Entry | None:
        """Append one entry; see :meth:`append_many`."""
        out = self.append_many([(kind, data, job_id, dedupe_key)])
        return out[0] if out else None

    def append_many(self, items: Iterable[tuple[str, Any, str | None, str | None]]) -> list[Entry]:
        """Append ``(kind, data, job_id, dedupe_key)`` items in one transaction; returns the entries written.

        With a ``dedupe_key``, an item whose data equals the last one appended under (kind, key) is skipped, so
        re-importing unchanged job records or usage does not grow the log.
        """
        prepared = []
        for i, (kind, data, job_id, key) in enumerate(items):
            if kind not in KINDS:
                raise AuditError(f"audit item {i}: kind {kind!r} is not one of {', '.join(KINDS)}")
            if job_id is not None and not isinstance(job_id, str):
                raise AuditError(f"audit item {i}: job_id {job_id!r} must be text")
            prepared.append((kind, plain(data, f"item {i} ({kind}).data"), job_id, key))
        now = float(self._clock())
        written: list[Entry] = []
        db = self._db
        db.execute("BEGIN IMMEDIATE")  # serialises appenders: the head cannot move under us
        try:
            seq, head = self._head()
            for kind, data, job_id, key in prepared:
                if key is not None:
                    digest = hashlib.sha256(_dumps(data).encode()).hexdigest()
                    row = db.execute("SELECT digest FROM latest WHERE kind=? AND key=?", (kind, key)).fetchone()
                    if row is not None and row[0] == digest:
                        continue
                    db.execute("INSERT OR REPLACE INTO latest VALUES (?,?,?)", (kind, key, digest))
                seq += 1
                body = _dumps({"seq": seq, "ts": now, "kind": kind, "job_id": job_id, "data": data})  # data is plain
                h = entry_hash(head, body)
                db.execute("INSERT INTO entries VALUES (?,?,?,?,?,?)", (seq, kind, job_id, body, head, h))
                written.append(Entry(seq, now, kind, job_id, data, head, h))
                head = h
            if written:
                db.executemany("INSERT OR REPLACE INTO meta VALUES (?,?)", [("head_seq", str(seq)), ("head_hash", head)])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return written

    # -- reads ----------------------------------------------------------------------------------------------
    def _head(self) -> tuple[int, str]:
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if "head_seq" in meta:
            return int(meta["head_seq"]), meta["head_hash"]
        return 0, GENESIS

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last entry; (0, 64 zeros) for an empty log."""
        return self._head()

    def get(self, seq: int) -> Entry | None:
        row = self._db.execute("SELECT body, prev, hash FROM entries WHERE seq=?", (seq,)).fetchone()
        return _entry(*row) if row else None

    def entries(self, job_id: str | None = None, kind: str | None = None, newest_first: bool = False) -> Iterable[Entry]:
        where, args = [], []
        if job_id is not None:
            where.append("job_id=?")
            args.append(job_id)
        if kind is not None:
            where.append("kind=?")
            args.append(kind)
        sql = "SELECT body, prev, hash FROM entries" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY seq" + (" DESC" if newest_first else "")
        for row in self._db.execute(sql, args):
            yield _entry(*row)

    def verify(self) -> VerifyResult:
        """Walk the chain from the start; the first entry that is not what the chain says is reported.

        Per stored row, in order: its seq follows the one before (else that entry is missing); its hash matches
        ``prev`` + body (else it was modified); the seq, kind and job id in the hashed body match the row (else
        rows were renumbered: the body's seq says which entry is really missing or inserted); its ``prev`` equals
        the hash of the row before (else the row before was replaced by a self-consistent forgery). Finally the
        last row must be the head recorded in ``meta`` (else the tail was cut or extended).
        """
        head, expected, n = GENESIS, 1, 0
        sha = hashlib.sha256
        for seq, kind, job_id, body, prev, h in self._db.execute(
            "SELECT seq, kind, job_id, body, prev, hash FROM entries ORDER BY seq"
        ):
            bad: Problem | None = None
            if seq != expected:
                bad = Problem(expected, f"missing (deleted): the next stored entry is {seq}")
            elif sha(f"{prev}\n{body}".encode()).hexdigest() != h:
                bad = Problem(seq, "content does not match its hash (modified)")
            elif not _body_matches(body, seq, kind, job_id):
                bad = _renumbered(body, seq)
            elif prev != head:
                bad = Problem(seq - 1, f"is not the entry that entry {seq} was chained to (replaced or inserted)")
            if bad is not None:
                return self._failed(bad)
            head, expected, n = h, expected + 1, n + 1
        last = expected - 1
        meta_seq, meta_hash = self._head()
        if meta_seq > last:
            return self._failed(Problem(last + 1, f"missing (deleted): the log head records {meta_seq} entries"))
        if meta_seq < last:
            return self._failed(Problem(meta_seq + 1, f"not recorded by the log head ({meta_seq}): appended outside the log"))
        if meta_hash != head:
            return self._failed(Problem(last, "the log head records a different hash for it (replaced)"))
        return VerifyResult(n, last, head)

    def _failed(self, bad: Problem) -> VerifyResult:
        """The result for a first bad entry: the proven prefix is every entry before it."""
        good = bad.seq - 1
        row = self._db.execute("SELECT hash FROM entries WHERE seq=?", (good,)).fetchone() if good > 0 else None
        return VerifyResult(good, good, row[0] if row else GENESIS, bad)


_KIND_JSON = {k: f'"{k}"' for k in KINDS}
_PLAIN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:+-")


def _body_matches(body: str, seq: int, kind: str, job_id: str | None) -> bool:
    """Fast check that the canonical body's top-level job_id, kind and seq equal the row's columns.

    Canonical key order is data, job_id, kind, seq, ts, so the body ends with this text and then ts; the text
    cannot occur inside ``data`` followed only by a number and the closing brace. Job ids are short ASCII words
    that JSON writes as they are, so json.dumps (slow, once per row) is needed only for other text.
    """
    if job_id is None:
        jid = "null"
    elif _PLAIN_CHARS.issuperset(job_id):
        jid = f'"{job_id}"'
    else:
        jid = json.dumps(job_id)
    mid = f',"job_id":{jid},"kind":{_KIND_JSON.get(kind) or json.dumps(kind)},"seq":{seq},"ts":'
    pos = body.rfind(mid)
    if pos < 0 or body[-1:] != "}":
        return False
    rest = body[pos + len(mid):-1]
    return bool(rest) and rest.strip("0123456789.e+-") == ""


def _renumbered(body: str, seq: int) -> Problem:
    try:
        real = json.loads(body)["seq"]
    except (ValueError, KeyError, TypeError):
        return Problem(seq, "body is not a canonical audit entry (modified)")
    if isinstance(real, int) and real > seq:
        return Problem(seq, f"missing or out of order (deleted or reordered): row {seq} holds entry {real}")
    if isinstance(real, int) and real < seq:
        return Problem(real, f"inserted: rows {real}..{seq - 1} were added before entry {real}, which now sits at row {seq}")
    return Problem(seq, "stored kind/job_id disagree with its hashed content (modified)")


def _entry(body: str, prev: str, h: str) -> Entry:
    d = json.loads(body)
    return Entry(d["seq"], d["ts"], d["kind"], d["job_id"], d["data"], prev, h)


def open_log(data_dir: str | os.PathLike[str], pseudonymize: bool = True) -> AuditLog:
    """The data dir's audit log; user names written as keyed pseudonyms (the key lives in the data dir)."""
    alias = None
    if pseudonymize:
        from gpuledger.accounting.privacy import Pseudonymizer

        alias = Pseudonymizer.for_data_dir(data_dir)
    return AuditLog(Path(data_dir) / AUDIT_NAME, user_alias=alias)


# -- what the rest of accounting appends ------------------------------------------------------------------------
def _job_data(log: AuditLog, r: JobRecord) -> dict[str, Any]:
    d = r.to_dict()
    d["user"] = log.alias(r.user)
    d["uid"] = None  # personal data; the pseudonymous user name identifies the association
    return d


def record_job_records(log: AuditLog, records: Iterable[JobRecord]) -> int:
    """Append a ``job_record`` entry per record that is new or changed (call after each Slurm import)."""
    return len(log.append_many(
        ("job_record", _job_data(log, r), r.job_id, f"{r.cluster}/{r.job_id}") for r in records
    ))


def record_usage(log: AuditLog, usages: Iterable[JobUsage]) -> int:
    """Append a ``usage_record`` entry per job usage (job-level or per GPU) that is new or changed."""
    return len(log.append_many(
        ("usage_record", u.to_dict(), u.job_id, f"{u.job_id}/{u.host}/{u.gpu_uuid}") for u in usages
    ))


@dataclass(frozen=True, slots=True)
class JobCharge:
    """One job's way into fairshare: charged under the policy, then decayed to ``now``."""

    job_id: str
    account: str
    user: str
    policy: str
    charged: float
    decayed: float
    first_ts: float
    last_ts: float


def job_charges(
    entries: Iterable[Any], settings: Any, now: float, decay: Callable[..., Mapping[Any, float]] | None = None
) -> list[JobCharge]:
    """Per job: the charge under ``settings``' policy and its decayed value at ``now``.

    ``entries`` are ledger entries; ``settings`` an AccountingSettings. Decay is linear, so the per-job decayed
    values of an association sum to the association's decayed usage that fairshare uses.
    """
    if decay is None:
        from gpuledger.accounting.decay import decayed_usage as decay
    policy = settings.charge_policy()
    rows = []
    for e in entries:
        if e.usage is None or e.record is None or not e.record.account or not e.record.user:
            continue
        rows.append((e.job_id, e.record.account, e.record.user, e.usage.first_ts, e.usage.last_ts, policy.charge(e.usage)))
    period = settings.calc_period_s
    # decay wants an integer period (Slurm's PriorityCalcPeriod is whole seconds); settings may carry 300.0
    period = int(period) if float(period).is_integer() else period
    decayed = decay(
        [(j, first, last, amount) for j, _, _, first, last, amount in rows],
        now=now, half_life_s=settings.half_life_s, calc_period_s=period, reset=settings.usage_reset,
    )
    return [JobCharge(j, a, u, policy.kind, amount, float(decayed.get(j, 0.0)), first, last)
            for j, a, u, first, last, amount in rows]


def record_fairshare(
    log: AuditLog,
    *,
    now: float,
    settings: Any,
    charges: Iterable[JobCharge],
    usage: Mapping[tuple[str, str], float],
    rows: Iterable[Any],
    feed: Iterable[Any] = (),
) -> Entry:
    """Append one ``fairshare`` entry: inputs (settings, per-job charges, decayed usage per association) and
    outputs (the fairshare rows and the site factors of the priority feed)."""
    cfg = settings.model_dump() if hasattr(settings, "model_dump") else plain(settings)
    jobs = {c.job_id: {**plain(c), "user": log.alias(c.user)} for c in charges}
    assoc = [{"account": a, "user": log.alias(u), "decayed_usage": v} for (a, u), v in sorted(usage.items())]
    out_rows = []
    for r in rows:
        if isinstance(r, Mapping) or dataclasses.is_dataclass(r) or hasattr(r, "_asdict"):
            d = dict(r._asdict()) if hasattr(r, "_asdict") else dict(r) if isinstance(r, Mapping) else dataclasses.asdict(r)
        else:
            d = {k: getattr(r, k) for k in _ROW_FIELDS if hasattr(r, k)}
        # Fair Tree's LevelFS is inf where usage is 0; JSON has no inf, so non-finite floats are written as text.
        d = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
        d["user"] = log.alias(d.get("user"))
        out_rows.append(plain(d))
    out_feed = []
    for f in feed:
        d = plain(f) if not isinstance(f, Mapping) else plain(dict(f))
        d["user"] = log.alias(d.get("user"))
        out_feed.append(d)
    data = {"now": now, "settings": cfg, "inputs": {"jobs": jobs, "associations": assoc},
            "outputs": {"rows": out_rows, "feed": out_feed}}
    entry = log.append("fairshare", data)
    assert entry is not None  # no dedupe key: always written
    return entry


_ROW_FIELDS = ("account", "user", "raw_shares", "norm_shares", "raw_usage", "norm_usage", "effective_usage",
               "fairshare", "level_fs")


def record_priority_change(log: AuditLog) -> Callable[[Any], Entry | None]:
    """The ``record=`` callable for ``accounting.apply.apply_changes``: one ``priority_change`` entry per change.

    A change is a dataclass or mapping; its ``job_id`` (or ``jobid``) field names the job and any ``user`` field
    is pseudonymized like the rest of the log.
    """
    def record(change: Any) -> Entry | None:
        d = plain(change)
        if not isinstance(d, dict):
            raise AuditError(f"priority change {change!r} is not a record with fields")
        job = d.get("job_id", d.get("jobid"))
        if job is None:
            raise AuditError(f"priority change {d!r} names no job_id")
        if "user" in d:
            d["user"] = log.alias(d["user"])
        return log.append("priority_change", d, str(job))

    return record


# -- explain ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Step:
    name: str  # measurements | charged usage | decayed usage | fairshare | site factor | applied
    summary: str
    entries: tuple[tuple[int, str], ...]  # (seq, hash) of the audit entries that prove it


@dataclass(frozen=True, slots=True)
class Explanation:
    job_id: str
    steps: list[Step] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # steps the log cannot prove (and why)
    chain: VerifyResult | None = None


def explain(log: AuditLog, job_id: str) -> Explanation:
    """How ``job_id``'s site factor was derived, step by step, citing the entries that prove each step."""
    chain = log.verify()
    ex = Explanation(job_id, chain=chain)
    job = _last(log.entries(job_id=job_id, kind="job_record", newest_first=True))
    usage = [e for e in log.entries(job_id=job_id, kind="usage_record")]
    latest_usage: dict[str, Entry] = {}
    for e in usage:
        latest_usage[f"{e.data.get('host')}/{e.data.get('gpu_uuid')}"] = e
    if job is not None:
        d = job.data
        ex.steps.append(Step("job record", f"account {d.get('account')}, user {d.get('user')}, {d.get('gpus')} GPU(s), "
                             f"start {d.get('start')}, end {d.get('end')}, state {d.get('state')}", ((job.seq, job.hash),)))
    else:
        ex.missing.append("no job_record entry: the scheduler record was never logged")
    if latest_usage:
        es = sorted(latest_usage.values(), key=lambda e: e.seq)
        total = [e for e in es if e.data.get("gpu_uuid") == "*"] or es
        alloc = math.fsum(e.data["allocated_gpu_seconds"] for e in total)
        active = math.fsum(e.data["sm_active_gpu_seconds"] for e in total)
        energy = math.fsum(e.data["energy_joules"] for e in total)
        ex.steps.append(Step("measurements", f"{alloc:.6g} allocated GPU-s, {active:.6g} SM-active GPU-s, "
                             f"{energy:.6g} J", tuple((e.seq, e.hash) for e in es)))
    else:
        ex.missing.append("no usage_record entry: no measurement was logged")
    fs = None
    for e in log.entries(kind="fairshare", newest_first=True):
        if job_id in e.data["inputs"]["jobs"]:
            fs = e
            break
    if fs is None:
        ex.missing.append("no fairshare entry charges this job")
    else:
        c = fs.data["inputs"]["jobs"][job_id]
        ref = ((fs.seq, fs.hash),)
        s = fs.data["settings"]
        ex.steps.append(Step("charged usage", f"policy {c['policy']} (floor {s.get('floor')}): {c['charged']!r}", ref))
        acct, user = c["account"], c["user"]
        a_total = next((a["decayed_usage"] for a in fs.data["inputs"]["associations"]
                        if a["account"] == acct and a["user"] == user), None)
        ex.steps.append(Step("decayed usage", f"half-life {s.get('half_life_s')} s to {fs.data['now']!r}: "
                             f"{c['decayed']!r} of association {user}@{acct}'s {a_total!r}", ref))
        row = next((r for r in fs.data["outputs"]["rows"] if r.get("account") == acct and r.get("user") == user), None)
        if row is not None:
            ex.steps.append(Step("fairshare", f"{s.get('algorithm')}: norm shares {row.get('norm_shares')!r}, "
                                 f"effective usage {row.get('effective_usage')!r} -> fairshare {row.get('fairshare')!r}", ref))
        else:
            ex.missing.append(f"the fairshare entry {fs.seq} has no row for {user}@{acct}")
        feed = next((f for f in fs.data["outputs"]["feed"] if f.get("account") == acct and f.get("user") == user), None)
        if feed is not None:
            ex.steps.append(Step("site factor", f"round({s.get('priority_weight')} x {feed.get('fairshare')!r}) = "
                                 f"{feed.get('site_factor')}", ref))
    changes = list(log.entries(job_id=job_id, kind="priority_change"))
    if changes:
        last = changes[-1].data
        ex.steps.append(Step("applied", f"site factor {last.get('old_factor')} -> {last.get('new_factor')} "
                             f"(fairshare {last.get('fairshare')!r})", tuple((e.seq, e.hash) for e in changes)))
    else:
        ex.missing.append("no priority_change entry: the factor was not applied to this job (yet)")
    return ex


def _last(it: Iterable[Entry]) -> Entry | None:
    return next(iter(it), None)


# -- keys and signed manifests ----------------------------------------------------------------------------------
def keygen(data_dir: str | os.PathLike[str], force: bool = False) -> tuple[Path, Path]:
    """Create an Ed25519 key pair: private key (PEM, mode 0600, created that way: never readable by others)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / PRIVATE_KEY_NAME, d / PUBLIC_KEY_NAME
    if priv.exists() and not force:
        raise FileExistsError(f"{priv} exists; keep it (reports signed with it verify against it) or pass force")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    if force:
        priv.unlink(missing_ok=True)
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def _private_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise AuditError(f"{path}: no signing key (run `gpuledger audit keygen`)") from None
    except ValueError as e:
        raise AuditError(f"{path}: not a PEM private key: {e}") from None


def _public_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    try:
        return serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        raise AuditError(f"{path}: no public key (run `gpuledger audit keygen`)") from None
    except ValueError as e:
        raise AuditError(f"{path}: not a PEM public key: {e}") from None


def code_version() -> dict[str, str]:
    """The installed package version and a digest of the accounting, collector and agent sources."""
    from importlib import metadata

    try:
        version = metadata.version("gpuledger")
    except metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pkg in ("agent", "collector", "accounting"):
        for p in sorted((root / pkg).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return {"package": version, "sources_sha256": h.hexdigest()}


def sign_report(
    report_path: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    *,
    inputs: Mapping[str, Any],
    period: Mapping[str, Any],
    log: AuditLog | None = None,
    now: float | None = None,
) -> Path:
    """Write ``<report>.manifest.json``: the manifest (report digest, inputs, period, code version, audit head)
    and its Ed25519 signature over the manifest's canonical JSON."""
    report_path = Path(report_path)
    key = _private_key(Path(data_dir) / PRIVATE_KEY_NAME)
    own = log is None
    log = log or AuditLog(Path(data_dir) / AUDIT_NAME)
    try:
        seq, head = log.head()
    finally:
        if own:
            log.close()
    manifest = {
        "format": MANIFEST_FORMAT,
        "report": {"name": report_path.name, "sha256": hashlib.sha256(report_path.read_bytes()).hexdigest()},
        "inputs": dict(inputs),
        "period": dict(period),
        "code_version": code_version(),
        "audit_head": {"seq": seq, "hash": head},
        "created_at": time.time() if now is None else now,
    }
    sig = key.sign(canonical_json(manifest).encode())
    out = report_path.with_name(report_path.name + MANIFEST_SUFFIX)
    out.write_text(json.dumps({"manifest": plain(manifest), "signature": base64.b64encode(sig).decode()}, indent=2) + "\n")
    return out


def verify_report(report_path: str | os.PathLike[str], data_dir: str | os.PathLike[str], log: AuditLog) -> list[str]:
    """Problems with a signed report (empty: good): signature, report digest, and the audit head it names."""
    from cryptography.exceptions import InvalidSignature

    report_path = Path(report_path)
    mpath = report_path.with_name(report_path.name + MANIFEST_SUFFIX)
    try:
        doc = json.loads(mpath.read_text())
        manifest, sig = doc["manifest"], base64.b64decode(doc["signature"], validate=True)
    except FileNotFoundError:
        return [f"{mpath}: no manifest beside the report"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable manifest: {e}"]
    problems = []
    try:
        _public_key(Path(data_dir) / PUBLIC_KEY_NAME).verify(sig, canonical_json(manifest).encode())
    except InvalidSignature:
        problems.append(f"{mpath}: the signature does not match the manifest (manifest altered or another key)")
    except AuditError as e:
        problems.append(str(e))
    try:
        digest = hashlib.sha256(report_path.read_bytes()).hexdigest()
        if digest != manifest["report"]["sha256"]:
            problems.append(f"{report_path}: content differs from the signed digest (report altered)")
        seq, want = int(manifest["audit_head"]["seq"]), manifest["audit_head"]["hash"]
    except FileNotFoundError:
        return problems + [f"{report_path}: report file not found"]
    except (KeyError, TypeError, ValueError) as e:
        return problems + [f"{mpath}: manifest lacks a field: {e}"]
    if seq > 0:
        e = log.get(seq)
        if e is None:
            problems.append(f"audit entry {seq}, the head when the report was signed, is missing from the log")
        elif e.hash != want:
            problems.append(f"audit entry {seq}: hash differs from the one the signed report recorded (log rewritten)")
    return problems
