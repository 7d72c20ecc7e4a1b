"""`audit verify` as a library call: the log recomputed from its entries, checked against every signed head
(checkpoints given by the admin, checkpoints kept beside the log, the audit heads of signed reports), every logged
fairshare computation recomputed from its inputs and the logged records it names (``explain.fairshare_problems``),
every priority change's status (:func:`change_problems`), and the priority feed files compared with the fairshare
entry they name (:func:`feed_problems`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.accounting.audit.checkpoint import (
    CheckpointRejected,
    HeadCheck,
    SignedHead,
    check_heads,
    open_checkpoint,
)
from gpuledger.accounting.audit.explain import (
    CHANGE_STATUSES,
    change_status,
    fairshare_problems,
    latest_changes,
    unsettled,
)
from gpuledger.accounting.audit.keys import TrustedKeys
from gpuledger.accounting.audit.manifest import verify_report
from gpuledger.accounting.priority import FEED_NAME, FeedFormatError, flat_path, parse_flat_feed
from gpuledger.collector.auditlog import AuditError, AuditLog, Entry, Problem, VerifyResult
from gpuledger.schema.text import ascii_int


@dataclass
class Verdict:
    result: VerifyResult
    heads: list[HeadCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the first bad entry or range first, then the rest
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_all(
    log: AuditLog,
    trusted: TrustedKeys | None,
    checkpoints: Iterable[tuple[str, str]] = (),
    reports: Iterable[str | os.PathLike[str]] = (),
    feeds: Iterable[str | os.PathLike[str]] | None = None,
) -> Verdict:
    """``checkpoints``: (source, text) pairs; a malformed one raises AuditError (bad input), one whose signature
    does not verify is a problem (tampered). Needs ``trusted`` keys when there is anything signed to check.
    ``feeds``: the JSON priority feeds (each with its flat feed beside it) to compare with the fairshare entry they
    name; None: the one in the log's directory (the data dir's ``priority-feed.json``), where there is one."""
    result = log.verify()
    v = Verdict(result)
    ranked: list[tuple[int, str]] = []
    if result.problem is not None:
        ranked.append((result.problem.first, str(result.problem)))
    else:  # an intact log whose fairshare computations do not follow from their inputs, or feeds that differ
        ranked += fairshare_problems(log)
        problems, notes = change_problems(log)
        ranked += problems
        v.notes += notes
        for path in _default_feeds(log) if feeds is None else [Path(f) for f in feeds]:
            problems, notes = feed_problems(log, path)
            ranked += problems
            v.notes += notes
    heads: list[SignedHead] = []
    given = list(checkpoints)
    for source, text in given:
        if trusted is None:
            raise ValueError("checkpoints need a public key to verify them")
        try:
            heads.append(open_checkpoint(text, source, trusted))
        except CheckpointRejected as e:
            ranked.append((0, str(e)))
    kept = log.saved_checkpoints()
    if trusted is None and kept:
        v.notes.append(f"{len(kept)} checkpoint(s) kept in the log not checked: no public key (pass --public-key)")
    if trusted is not None:
        for i, text in enumerate(kept, 1):
            try:
                heads.append(open_checkpoint(text, f"checkpoint kept in the log #{i}", trusted))
            except Exception as e:  # noqa: BLE001 - a kept checkpoint is a hint, never the verdict's input
                v.notes.append(f"ignored: {e}")
    for rp in reports:
        if trusted is None:
            raise ValueError("reports need a public key to verify them")
        rc = verify_report(rp, trusted, result)
        ranked += [(0, p) for p in rc.problems]
        if rc.head is not None:
            heads.append(rc.head)
    v.heads = check_heads(log, result, heads)
    ranked += [(h.problem.first, str(h.problem)) for h in v.heads if h.problem is not None]
    v.problems = [msg for _, msg in sorted(ranked, key=lambda x: x[0])]
    return v


def change_problems(log: AuditLog) -> tuple[list[tuple[int, str]], list[str]]:
    """The ``priority_change`` entries, in one pass: (entry, problem) for a status that is none `priority apply`
    writes, and notes for the jobs whose newest entry is a change sent to Slurm with no outcome logged (the run
    stopped: Slurm may hold the old factor or the new one; not proven, not tampering)."""
    problems: list[tuple[int, str]] = []

    def checked(entries: Iterable[Entry]) -> Iterator[Entry]:
        for e in entries:
            status = change_status(e)
            if status not in CHANGE_STATUSES:
                problems.append((e.seq, f"audit entry {e.seq}: the priority change of job {e.job_id} has status "
                                        f"{status!r}, not one of {', '.join(CHANGE_STATUSES)}"))
            yield e

    latest = latest_changes(checked(log.entries(kind="priority_change")))
    if len(problems) > _LISTED:
        problems[_LISTED:] = [(problems[_LISTED][0], f"and {len(problems) - _LISTED} more priority change(s) with a "
                                                     "status that is not one of those")]
    sent = [(job, newest) for job, (_, newest) in latest.items() if change_status(newest) == "intended"]
    notes = [f"not proven: job {job}'s priority change: {unsettled(e)}" for job, e in sent[:_LISTED]]
    if len(sent) > _LISTED:
        notes.append(f"and {len(sent) - _LISTED} more job(s) whose priority change was sent to Slurm with no outcome "
                     "recorded")
    return problems, notes


def _default_feeds(log: AuditLog) -> list[Path]:
    if log.path is None:
        return []
    path = log.path.parent / FEED_NAME
    return [path] if path.exists() or flat_path(path).exists() else []


_LISTED = 10  # differences named per feed file; the rest are counted


def _named_entry(log: AuditLog, name: str, seq: Any, leaf: Any, computed_at: Any, flat: bool
                 ) -> tuple[Entry | None, str | None, str | None]:
    """The fairshare entry a feed file names (its seq and leaf hash); a file that names none (written before feeds
    named theirs) is matched by its generation time. (entry, problem, note)."""
    if seq is not None or leaf is not None:
        e = log.get(seq) if type(seq) is int else None  # (not a JSON true, which is an int to isinstance)
        if e is None or e.kind != "fairshare" or e.leaf.hex() != leaf:
            return None, (f"{name}: names audit entry {seq} with leaf hash {str(leaf)[:12]}, which is not a fairshare "
                          "entry of this log"), None
        return e, None, None
    for e in log.entries(kind="fairshare", newest_first=True):
        now = e.data.get("now") if isinstance(e.data, dict) else None
        if isinstance(now, int | float) and (f"{now:.3f}" == computed_at if flat else now == computed_at):
            return e, None, (f"{name} names no fairshare entry (no audit_entry in it); compared with "
                             f"entry {e.seq}, computed at its generated_at")
    return None, f"{name}: names no fairshare entry, and none was computed at its generated_at {computed_at!r}", None


def _compare(log: AuditLog, name: str, e: Entry, rows: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[str]:
    """The feed file's (account, user, values) against entry ``e``'s feed: every association and value the same."""
    feed = e.data.get("outputs", {}).get("feed") or []
    logged = {(f.get("account"), f.get("user")): f for f in feed if isinstance(f, dict)}
    out, seen = [], set()
    for account, user, values in rows:
        key = (account, log.alias(user))
        seen.add(key)
        f = logged.get(key)
        if f is None:
            out.append(f"{name}: {user}@{account} is not in the feed of audit entry {e.seq}")
            continue
        out += [f"{name}: {user}@{account}'s {k.replace('_', ' ')} {v!r} is not audit entry {e.seq}'s {f.get(k)!r}"
                for k, v in values.items() if v != f.get(k)]
    out += [f"{name}: audit entry {e.seq}'s feed has {key[1]}@{key[0]} (site factor {f.get('site_factor')!r}), the "
            "file does not" for key, f in logged.items() if key not in seen]
    if len(out) > _LISTED:
        out = [*out[:_LISTED], f"{name}: and {len(out) - _LISTED} more difference(s) from audit entry {e.seq}"]
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise AuditError(f"{path}: cannot read the priority feed: {err}") from None


def feed_problems(log: AuditLog, json_path: str | os.PathLike[str]) -> tuple[list[tuple[int, str]], list[str]]:
    """The JSON priority feed at ``json_path`` and the flat one beside it (what job_submit.lua applies), each
    compared with the fairshare entry it names: (entry, problem) for every association or value that is not that
    entry's, and notes. A file that is not a feed is a problem; one that cannot be read, AuditError (bad input)."""
    problems: list[tuple[int, str]] = []
    notes: list[str] = []
    named: list[Entry] = []
    path = Path(json_path)
    if path.exists():
        try:
            doc = json.loads(_read(path))
            assocs = doc["associations"]
            rows = [(a["account"], a["user"], {k: v for k, v in a.items() if k not in ("account", "user")})
                    for a in assocs]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            problems.append((0, f"{path}: not a priority feed (modified)"))
        else:
            e, problem, note = _named_entry(log, str(path), doc.get("audit_entry"), doc.get("audit_leaf"),
                                            doc.get("generated_at"), flat=False)
            problems += [(0, problem)] if problem else []
            notes += [note] if note else []
            if e is not None:
                named.append(e)
                settings = e.data.get("settings", {})
                meta = [f"{path}: {k} {doc[k]!r} is not audit entry {e.seq}'s {settings.get(k)!r}"
                        for k in ("algorithm", "policy", "unmeasured", "priority_weight", "half_life_s")
                        if k in doc and doc[k] != settings.get(k)]
                if doc.get("generated_at") != e.data.get("now"):
                    meta.append(f"{path}: generated_at {doc.get('generated_at')!r} is not audit entry {e.seq}'s time "
                                f"{e.data.get('now')!r}")
                problems += [(e.seq, p) for p in meta + _compare(log, str(path), e, rows)]
    flat = flat_path(path)
    if flat.exists():
        try:
            parsed = parse_flat_feed(_read(flat))
        except FeedFormatError as err:
            problems.append((0, f"{flat}: not a priority feed (modified): {err}"))
        else:
            h = parsed.header
            seq = (ascii_int(h["audit_entry"]) or -1) if "audit_entry" in h else None  # -1: names no entry there is
            e, problem, note = _named_entry(log, str(flat), seq, h.get("audit_leaf"), h.get("generated_at"), flat=True)
            problems += [(0, problem)] if problem else []
            notes += [note] if note else []
            if e is not None:
                named.append(e)
                rows = [(a, u, {"site_factor": f}) for _, a, u, f in parsed.lines]
                problems += [(e.seq, p) for p in _compare(log, str(flat), e, rows)]
    if named:
        newest = next((f for f in log.entries(kind="fairshare", newest_first=True)
                       if isinstance(f.data, dict) and f.data.get("outputs", {}).get("feed")), None)
        oldest = min(named, key=lambda x: x.seq)
        if newest is not None and newest.seq > oldest.seq:
            notes.append(f"{path}: made from audit entry {oldest.seq}; entry {newest.seq} computed a newer feed")
    return problems, notes


def first_problem(v: Verdict) -> Problem | None:
    """The earliest entry or range any check names (for callers that want the numbers, not the text)."""
    found = [h.problem for h in v.heads if h.problem is not None]
    if v.result.problem is not None:
        found.append(v.result.problem)
    return min(found, key=lambda p: (p.first, p.last or p.first), default=None)


def read_checkpoints(paths: Iterable[Path]) -> list[tuple[str, str]]:
    out = []
    for p in paths:
        try:
            out.append((str(p), p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise FileNotFoundError(f"{p}: cannot read the checkpoint: {e}") from None
    return out
