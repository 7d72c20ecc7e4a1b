"""Personal data: a retention period for the ledger; the keyed pseudonyms it uses are ``collector.pseudonym``.

Retention: :func:`apply_retention` replaces user name and uid in the ledger's job records that ended more than N
days ago by the pseudonym. The audit log never holds user names in clear (``collector.auditlog.open_log``), so it
needs no rewriting, and its hash chain stays intact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from gpuledger.accounting.ledger import LedgerEntry
from gpuledger.collector.pseudonym import KEY_NAME, PREFIX, Pseudonymizer, is_pseudonym, load_or_create_key  # noqa: F401
from gpuledger.schema.records import JobRecord

HORIZON_HALF_LIVES = 10  # usage older than this many half-lives weighs < 0.1% in fairshare


def decay_horizon_start(now: float, half_life_s: float, reset: str = "NONE", tz: str | None = None) -> float:
    """The earliest end time whose job still weighs in fairshare at ``now``: the last usage reset boundary, or
    ``HORIZON_HALF_LIVES`` half-lives back, whichever is later; -inf when nothing decays or resets."""
    from gpuledger.accounting.decay import last_reset_boundary

    boundary = last_reset_boundary(reset, now, tz)
    decayed = now - HORIZON_HALF_LIVES * half_life_s if half_life_s > 0 else -float("inf")
    return max(decayed, boundary) if boundary is not None else decayed


class InsideDecayHorizon(ValueError):
    """Retention would pseudonymize job records that fairshare still weighs."""


def apply_retention(
    ledger_url: str | None, data_dir: Path, pseudonymize: Pseudonymizer, days: float, now: float | None = None,
    horizon_start: float | None = None,
) -> int:
    """Pseudonymize user name (and drop the uid) in job records that ended more than ``days`` ago.

    Works on the ledger at ``ledger_url`` (``collector.ledger_url``: PostgreSQL, a SQLite file, or None for the data
    dir's embedded store) through ``collector.db``: its ``jobs`` table (``cluster, job_id, source, data`` with
    ``data`` the JobRecord's JSON), one transaction. Jobs without an end are still running and kept. Returns the
    number of records changed; running it again changes none. A record rewritten meanwhile (a collector merging a
    newer one) is left for the next run: each update applies only to the text that was read.

    With ``horizon_start`` (:func:`decay_horizon_start`), a record that would change and ended at or after it
    (still weighs in fairshare) makes it raise :class:`InsideDecayHorizon` and change nothing; pass None to
    go ahead (``--force``: fairshare still charges a pseudonymized user's association, through the key).
    """
    from gpuledger.collector.db import open_database
    from gpuledger.collector.ledger_url import ledger_label, sqlite_path
    from gpuledger.collector.store import open_store

    if not days >= 0:
        raise ValueError(f"retention days must be >= 0, got {days!r}")
    cutoff = (time.time() if now is None else now) - days * 86400.0
    path = sqlite_path(ledger_url, data_dir)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"{path}: no gpuledger store")
    label = ledger_label(ledger_url, data_dir)
    open_store(ledger_url, data_dir).close()  # an older store is migrated to today's tables first
    db = open_database(str(ledger_url) if path is None else path)
    try:
        with db.transaction():
            changed = 0
            rows = db.execute("SELECT job_id, cluster, source, data FROM jobs").fetchall()
            for job_id, cluster, source, data in rows:
                try:
                    d = json.loads(data)
                except ValueError as e:
                    raise ValueError(f"{label}: job {job_id}@{cluster}: record is not JSON: {e}") from None
                end, user = d.get("end"), d.get("user")
                if end is None or end >= cutoff or ((user is None or is_pseudonym(user)) and d.get("uid") is None):
                    continue
                if horizon_start is not None and end >= horizon_start:
                    raise InsideDecayHorizon(
                        f"job {job_id}@{cluster} ended inside the decay horizon (after {horizon_start:.0f}): its "
                        f"usage still weighs in fairshare; retention refuses such records without --force")
                d["user"] = None if user is None else pseudonymize(user)
                d["uid"] = None
                changed += db.execute("UPDATE jobs SET data=? WHERE job_id=? AND cluster=? AND source=? AND data=?",
                                      (json.dumps(d, sort_keys=True), job_id, cluster, source, data)).rowcount
        return changed
    finally:
        db.close()


def pseudonymize_entries(entries: Iterable[LedgerEntry], alias: Callable[[str], str]) -> list[LedgerEntry]:
    """The same entries with user names replaced by ``alias(user)`` and uids dropped (for every export)."""
    def hide(r: JobRecord | None) -> JobRecord | None:
        if r is not None and (r.user is not None or r.uid is not None):
            r = replace(r, user=None if r.user is None else alias(r.user), uid=None)
        return r

    return [replace(e, record=hide(e.record), agent_record=hide(e.agent_record)) for e in entries]
