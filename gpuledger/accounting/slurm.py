"""Slurm's job records and pending jobs: pure parsers, and a client that runs the commands.

Parsing is kept apart from fetching: every ``parse_*`` takes the text a command printed (tested on real
captures in ``tests/data/slurm/``), and :class:`SlurmClient` only runs commands through its ``run=`` seam.

Formats read here:

- ``sacct --json``: 22.05 (``openapi/dbv0.0.38``: plain numbers, ``state.current`` a string) through 24.11
  (``data_parser/v0.0.42``: numbers wrapped as ``{"set", "infinite", "number"}``, ``state.current`` a list).
  22.05's JSON reports a failed job's exit code as ``SUCCESS``/0, so there it is left unknown (None) unless the
  job COMPLETED or was signalled; :func:`merge_sacct` takes the exit codes from ``sacct -P``.
- ``sacct -P`` with a header line (any subset of columns, named by the header): step lines are skipped.
- ``squeue --json``: 22.05 ignores ``-t``/``-u`` with ``--json`` and lists finished jobs too, so the parser
  filters on state itself.
- ``squeue -h -r -t PD -o '%A|%i|...'``: the pending job records (what ``priority apply`` reads).
- ``sprio -h -o '%i|%u|%Y|%S'``: the site factor of each pending job record (%i is the record's own id); neither
  squeue nor ``scontrol show job`` prints it.

A requeued job (node failure, preemption, ``scontrol requeue``) keeps its job id and runs again; ``sacct -D``
lists every run (the earlier ones REQUEUED), ``-X`` without ``-D`` only the latest. Both parsers make one record of a
job's runs (:func:`_runs_folded`): the latest run's fields, the earlier runs' (start, end, hosts) in
``JobRecord.earlier_runs``, so that usage measured during an earlier run is charged to the job
(``accounting.scope``). With a state filter (``-s``) sacct -D lists a run only in a state named, and an earlier
run's is REQUEUED (``RQ``): ``ENDED_STATES`` names it, and ``SlurmClient.sacct_running`` asks for it apart.

A heterogeneous job's components (``12+0``, ``12+1`` to sacct -P and squeue) are named by their own job ids
(``het`` in the JSON aside, JobIDRaw in -P, %A in squeue), as their cgroups, scontrol and the agents name them.

Conventions of the records: times are unix seconds; ``exit_code`` is the job's return code, or minus the signal
number when a signal ended it (Python's ``returncode`` convention), None when unknown or the job has not ended;
TRES memory is in bytes (Slurm's M = MiB), like the agent's records.

A record no job can have is refused (SlurmParseError naming the line or record and the job), so that an import is
whole or nothing: a TRES value that is not a finite number, a GPU count that is not a whole number in
0..``MAX_JOB_GPUS``, a node list that is no hostlist (``agent.slurm.expand_hostlist``: at most
``MAX_HOSTLIST_HOSTS`` hosts), a time outside the calendar, an end before the start.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, tzinfo
from typing import Any

from gpuledger.accounting.associations import SACCTMGR_FORMAT
from gpuledger.agent.slurm import (
    MAX_HOSTLIST_HOSTS,
    SlurmParseError,
    expand_hostlist,
    first_flag,
    load_jobs_json,
    parse_tres,
    slurm_epoch,
    slurm_number,
    state_word,
)
from gpuledger.agent.slurm import parse_squeue_json as parse_squeue_meta
from gpuledger.output import int_ranges
from gpuledger.schema.records import JobRecord

log = logging.getLogger(__name__)

__all__ = [
    "MAX_HOSTLIST_HOSTS",
    "MAX_JOB_GPUS",
    "PendingJob",
    "SlurmClient",
    "SlurmCommandError",
    "SlurmParseError",
    "SACCT_PARSABLE_FORMAT",
    "exit_code_from_text",
    "gpu_tres",
    "gpus_from_tres",
    "merge_sacct",
    "parse_sacct_json",
    "parse_sacct_parsable",
    "parse_sprio",
    "parse_squeue_json",
    "parse_squeue_pending",
    "parse_tres_text",
]


TIMED_OUT = 124  # SlurmCommandError.returncode of a command that did not finish in time (as timeout(1) exits)


class SlurmCommandError(RuntimeError):
    """A Slurm command exited with an error (the message holds the command line and its stderr)."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"`{' '.join(argv)}` exited with {returncode}: {stderr.strip() or '(no stderr)'}")


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A pending job record as squeue shows it.

    ``job_id`` is the id scontrol accepts: "1234", "1234_7" (an array task with a record of its own), or
    "1234_[3-9,12]" for an array's pending tasks that still share one record (one update sets them all).
    ``record_id`` is that record's own job id, which sprio prints (None: the same as ``job_id``); ``tasks`` is how
    many jobs the record stands for.
    """

    job_id: str
    user: str | None
    account: str | None
    partition: str | None
    state: str
    priority: int | None = None
    site_factor: int | None = None  # squeue does not print it; SlurmClient.site_factors() reads it from sprio
    reason: str | None = None
    submit: float | None = None
    record_id: str | None = None
    tasks: int = 1

    @property
    def sprio_id(self) -> str:
        return self.record_id or self.job_id


# ------------------------------------------------------------------------------------------------ small pieces

_UNKNOWN_TIMES = frozenset({"", "Unknown", "None", "N/A", "(null)"})
MAX_JOB_GPUS = 1 << 20  # far above any cluster's GPUs: a count beyond is no job's, and would bill without bound
_CALENDAR_END = 253402300800.0  # 10000-01-01T00:00:00Z: a time beyond is no job's (and no datetime's)


def parse_tres_text(text: str, where: str = "TRES") -> tuple[tuple[str, float], ...]:
    """``billing=11,cpu=1,gres/gpu:h200=1,gres/gpu=1,mem=1000M,node=1`` -> ((name, value), ...), strictly: an item
    that is not ``name=number``, or a value a job cannot have (:func:`checked_tres`), raises SlurmParseError naming
    ``where`` (``agent.slurm.parse_tres`` is the one parser; memory suffixes are Slurm's binary units and become
    bytes; empty text -> ())."""
    return checked_tres(parse_tres(text, where=where), where)


def checked_tres(tres: tuple[tuple[str, float], ...], where: str) -> tuple[tuple[str, float], ...]:
    """``tres`` as they are, or SlurmParseError naming ``where`` for a value that is not a finite number or a GPU
    count (``gres/gpu``, ``gres/gpu:<type>``, as :func:`gpu_tres` reads them) that is not a whole number in
    0..MAX_JOB_GPUS."""
    for name, value in tres:
        if not math.isfinite(value):
            raise SlurmParseError(f"{where}: {name}={value!r} is not a finite number")
        if (name == "gres/gpu" or name.startswith("gres/gpu:")) and not (
                0 <= value <= MAX_JOB_GPUS and value == int(value)):
            raise SlurmParseError(f"{where}: {name}={value:g} is not a whole number of GPUs in 0..{MAX_JOB_GPUS}")
    return tres


def _hosts(nodes: str, where: str) -> tuple[str, ...]:
    """A record's node list, expanded; SlurmParseError naming ``where`` when it is no hostlist."""
    if nodes in ("", "None assigned"):
        return ()
    try:
        return expand_hostlist(nodes)
    except SlurmParseError as e:
        raise SlurmParseError(f"{where} NodeList: {e}") from None


def _checked_times(record: JobRecord, where: str) -> JobRecord:
    """``record``, or SlurmParseError naming ``where`` for a time outside the calendar or an end before the start."""
    for name in ("submit", "start", "end"):
        t = getattr(record, name)
        if t is not None and not 0.0 <= t < _CALENDAR_END:
            raise SlurmParseError(f"{where}: {name.capitalize()} {t!r} is not a time (unix seconds, years 1970-9999)")
    if record.start is not None and record.end is not None and record.end < record.start:
        raise SlurmParseError(f"{where}: End {_iso(record.end)} is before Start {_iso(record.start)}")
    return record


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextmanager
def _one_record(job_id: str, skip: list[tuple[str, str]] | None) -> Iterator[None]:
    """Around the making of one job's record: a SlurmParseError goes on (the import is refused), or with ``skip``
    the record is left out, its job id and the message appended there (sacct run live: one bad record of Slurm's
    must not stop the import of every other job, run after run)."""
    try:
        yield
    except SlurmParseError as e:
        if skip is None:
            raise
        skip.append((job_id, str(e)))


def gpu_tres(tres: Iterable[tuple[str, float]]) -> tuple[float | None, dict[str, float]]:
    """The untyped ``gres/gpu`` count (None when absent) and the typed ``gres/gpu:<type>`` counts of TRES pairs.

    sacct lists both: the untyped entry is the total, the typed ones repeat the same GPUs by model.
    ``gres/gpumem``/``gres/gpuutil`` are usage, not GPUs."""
    total: float | None = None
    typed: dict[str, float] = {}
    for name, value in tres:
        if name == "gres/gpu":
            total = value
        elif name.startswith("gres/gpu:"):
            typed[name[len("gres/gpu:"):]] = typed.get(name[len("gres/gpu:"):], 0.0) + value
    return total, typed


def gpus_from_tres(tres: Iterable[tuple[str, float]]) -> tuple[int, str | None]:
    """Allocated GPU count and model(s) from TRES pairs (:func:`gpu_tres`): typed entries count only when the
    untyped one is absent. No GPU entry -> 0 (what Slurm's accounting recorded)."""
    total, typed = gpu_tres(tres)
    count = total if total is not None else sum(typed.values())
    model = ",".join(sorted(typed)) or None
    return int(count), model


def exit_code_from_text(text: str, where: str = "ExitCode") -> int | None:
    """sacct's ``ExitCode`` "3:0" -> 3, "0:15" (signal 15) -> -15, "" -> None."""
    text = text.strip()
    if not text:
        return None
    code, sep, sig = text.partition(":")
    try:
        rc, signal = int(code), int(sig) if sep else 0
    except ValueError:
        raise SlurmParseError(f"{where}: {text!r} is not CODE:SIGNAL") from None
    return -signal if signal else rc


def _not_ended(state: str | None) -> bool:
    return state in ("PENDING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "CONFIGURING", "COMPLETING")


def _runs_folded(records: list[JobRecord]) -> list[JobRecord]:
    """One record per job (cluster, job id) of records that list a job once per run (``sacct -D``): the latest
    run's (the last to start; one not started yet is the latest), with every earlier run that started and ended in
    ``earlier_runs``. Order: each job where its first run was. Records of jobs listed once are returned as they are."""
    runs: dict[tuple[str, str], list[JobRecord]] = {}
    for r in records:
        runs.setdefault((r.cluster, r.job_id), []).append(r)
    if all(len(rs) == 1 for rs in runs.values()):
        return records
    out: list[JobRecord] = []
    for rs in runs.values():
        rs = sorted(rs, key=lambda r: (r.start is None, r.start or 0.0))  # stable: sacct's order among equals
        latest = rs[-1]
        out.append(latest.with_earlier_runs((r.start, r.end, r.hosts) for r in rs[:-1]
                                            if r.start is not None and r.end is not None))
    return out


def _with_requeued_runs(records: list[JobRecord], requeued: Iterable[JobRecord]) -> list[JobRecord]:
    """``records`` each with the runs of its job (cluster, job id) among ``requeued`` (records of REQUEUED runs,
    folded per job: :func:`_runs_folded`) that ended before it started, as earlier runs."""
    runs: dict[tuple[str, str], list[tuple[float, float, tuple[str, ...]]]] = {}
    for q in requeued:
        if q.start is not None and q.end is not None:
            runs.setdefault((q.cluster, q.job_id), []).extend((*q.earlier_runs, (q.start, q.end, q.hosts)))
    return [r.with_earlier_runs(run for run in runs.get((r.cluster, r.job_id), ())
                                if r.start is not None and run[1] <= r.start) for r in records]


# ------------------------------------------------------------------------------------------------ sacct JSON

def _task_ranges(mask: Any) -> str:
    """sacct --json's ``array.task`` of a record that stands for several tasks, a hex bit mask ("0xBE": tasks
    1-5 and 7), as the ranges sacct -P prints ("1-5,7"); "" for anything else."""
    if not isinstance(mask, str) or not re.fullmatch(r"0x[0-9A-Fa-f]+", mask):
        return ""
    bits = int(mask, 16)
    return int_ranges(i for i in range(bits.bit_length()) if bits >> i & 1)


def _json_job_id(job: Mapping[str, Any], where: str) -> str:
    raw = slurm_number(job.get("job_id"))
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise SlurmParseError(f"{where}: job_id {job.get('job_id')!r} is not an integer")
    array = job.get("array") or {}
    array_job, task = slurm_number(array.get("job_id")), slurm_number(array.get("task_id"))
    if array_job and task is not None:
        return f"{array_job}_{task}"
    tasks = _task_ranges(array.get("task"))
    if array_job and tasks:  # an array's record of tasks never split off (pending, or cancelled while pending)
        return f"{array_job}_[{tasks}]"  # as sacct -P names it
    # A heterogeneous job's component ("12+1" to sacct -P and squeue, ``het`` here) goes by its own job id, as its
    # cgroup (job_13), scontrol and so the agents name it: one identity, so that its measured usage joins its record.
    return str(raw)


def _json_tres(items: Any, where: str) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    for i, t in enumerate(items or []):
        if not isinstance(t, dict) or "type" not in t:
            raise SlurmParseError(f"{where}: tres.allocated[{i}] is not a TRES object")
        count = slurm_number(t.get("count"))
        if not isinstance(count, (int, float)) or count < 0:  # -2 etc.: Slurm's "not set" sentinels
            continue
        name = f"{t['type']}/{t['name']}" if t.get("name") else str(t["type"])
        out.append((name, float(count) * (2**20 if name == "mem" else 1)))  # JSON mem counts are MiB
    return tuple(out)


def _json_exit_code(ec: Any, state: str | None, trusted: bool) -> int | None:
    if not isinstance(ec, dict) or _not_ended(state):
        return None
    status = first_flag(ec.get("status"))
    signal = ec.get("signal") or {}
    sig = slurm_number(signal.get("id", signal.get("signal_id")))
    if status == "SIGNALED" and isinstance(sig, int) and sig > 0:
        return -sig
    rc = slurm_number(ec.get("return_code"))
    if not isinstance(rc, int):
        return None
    if not trusted and rc == 0 and state != "COMPLETED":
        return None  # 22.05: a failed job's JSON says SUCCESS/0; only sacct -P knows the code
    return rc


# What every job of `sacct --json` (22.05 to 24.11) and slurmrestd carries, whatever its state.
_JSON_JOB_KEYS = ("user", "state", "time")


def parse_sacct_json(text: str, skip: list[tuple[str, str]] | None = None) -> list[JobRecord]:
    """``sacct --json`` (or slurmrestd ``/slurmdb/v0.0.4x/jobs``) of Slurm 22.05 to 24.11 -> one record per job
    (several runs of a requeued job folded: :func:`_runs_folded`).

    A record no job can have (its counts, node list or times) raises SlurmParseError naming it, or with ``skip``
    is left out (:func:`_one_record`)."""
    doc = load_jobs_json(text, "sacct JSON")
    plugin = (doc.get("meta") or {}).get("plugin") or {}
    # openapi/dbv0.0.38 (22.05) and older have the exit-code bug; data_parser >= v0.0.39 report codes right.
    trusted = not str(plugin.get("type", "")).startswith("openapi/dbv0.0.3")
    out: list[JobRecord] = []
    for i, job in enumerate(doc["jobs"]):
        where = f"sacct JSON jobs[{i}]"
        if not isinstance(job, dict):
            raise SlurmParseError(f"{where}: not an object")
        job_id = _json_job_id(job, where)
        where = f"sacct JSON job {job_id}"
        missing = [k for k in _JSON_JOB_KEYS if k not in job]
        if missing:  # e.g. {"job_id": 1}: a record with no owner and no times would be a blank job in the ledger
            raise SlurmParseError(f"{where} (jobs[{i}]): no {', '.join(repr(k) for k in missing)}; "
                                  "expected `sacct --json` output")
        with _one_record(job_id, skip):
            state = state_word(first_flag((job.get("state") or {}).get("current")))
            tres = checked_tres(_json_tres((job.get("tres") or {}).get("allocated"), where), where)
            gpus, model = gpus_from_tres(tres)
            times = job.get("time") or {}
            out.append(_checked_times(JobRecord(
                job_id=job_id,
                cluster=job.get("cluster") or "",
                user=job.get("user") or None,
                account=job.get("account") or (job.get("association") or {}).get("account") or None,
                partition=job.get("partition") or None,
                hosts=_hosts(str(job.get("nodes") or ""), where),
                gpus=gpus,
                gpu_model=model,
                submit=slurm_epoch(times.get("submission")),
                start=slurm_epoch(times.get("start")),
                end=slurm_epoch(times.get("end")),
                state=state,
                exit_code=_json_exit_code(job.get("exit_code"), state, trusted),
                tres=tres,
            ), where))
    return _runs_folded(out)


# ------------------------------------------------------------------------------------------------ sacct -P

# What SlurmClient asks sacct -P for; the parser reads any subset of these by header name.
SACCT_PARSABLE_FORMAT = ("JobID,JobIDRaw,Cluster,Partition,Account,User,UID,Submit,Start,End,State,ExitCode,AllocTRES,"
                         "NodeList")
PARSABLE_TZ_ADVICE = "run both `sacct -P` and the import with TZ=UTC for times that say which"


def _parsable_job_id(job_id: str, raw: str, where: str) -> str:
    """The id a -P line's job goes by: a heterogeneous job's component "12+1" by its own job id (JobIDRaw), as in
    the JSON and as agents measure it; anything else as JobID prints it ("1234", "1234_7")."""
    leader, plus, offset = job_id.partition("+")
    if not plus:
        return job_id
    if raw:
        if not (raw.isascii() and raw.isdigit()):
            raise SlurmParseError(f"{where}: JobIDRaw {raw!r} is not a job id")
        return raw
    if offset == "0":
        return leader  # the leader's own job id is the heterogeneous job's
    raise SlurmParseError(f"{where}: heterogeneous job component {job_id} without a JobIDRaw column: its own job id, "
                          "which agents measure it by, is not in JobID (add JobIDRaw to sacct's --format)")


def _local_readings(text: str, tz: tzinfo | None, where: str) -> tuple[float, ...]:
    """The instants a zone-less local time of sacct -P can be: () when unknown, one, or two (its first and second
    occurrence) in the hour the clocks repeat when daylight saving time ends. ``tz`` None: this machine's zone."""
    text = text.strip()
    if text in _UNKNOWN_TIMES:
        return ()
    try:
        dt = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise SlurmParseError(f"{where}: {text!r} is not a time like 2026-11-29T16:22:40") from None
    readings: list[float] = []
    for fold in (0, 1):
        t = (dt.replace(fold=fold) if tz is None else dt.replace(tzinfo=tz, fold=fold)).timestamp()
        try:  # a reading that gives back the same wall time is one (a time the clocks skip has none)
            back = datetime.fromtimestamp(t, tz).replace(tzinfo=None)
        except (OverflowError, OSError, ValueError):  # beyond the platform's calendar: _checked_times refuses it
            back = None
        if back == dt and t not in readings:
            readings.append(t)
    return tuple(readings) or ((dt if tz is None else dt.replace(tzinfo=tz)).timestamp(),)


def _before(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a < b


def _parsable_times(texts: Sequence[str], tz: tzinfo | None, where: str,
                    warnings: list[str] | None = None) -> tuple[float | None, ...]:
    """(submit, start, end) from sacct -P's zone-less local texts. In the repeated hour of a DST fall-back a time
    reads two ways: an end before its start is no job's, so that reading is not the one (01:50 -> 01:10 ends in the
    second 01:xx), nor, where another fits, a start before its submission; what that leaves undecided is read as
    the first occurrence, with a warning naming the job and both readings (logged, or appended to ``warnings``)."""
    names = ("Submit", "Start", "End")
    readings = [_local_readings(text, tz, f"{where} {name}") or (None,) for text, name in zip(texts, names)]
    combos = list(itertools.product(*readings))  # every field's first occurrence first
    fits = [c for c in combos if not _before(c[2], c[1])] or combos[:1]  # none: _checked_times says why
    fits = [c for c in fits if not _before(c[1], c[0])] or fits
    chosen = min(fits, key=lambda c: sum(r.index(t) for r, t in zip(readings, c)))  # the most first occurrences
    for i, name in enumerate(names):
        read = chosen[i]
        other = sorted(t for t in {c[i] for c in fits} - {read} if t is not None)
        if read is None or not other:
            continue
        runs = sorted({c[2] - c[1] for c in fits if c[1] is not None and c[2] is not None})
        run = f"; the job ran {' or '.join(f'{r:g} s' for r in runs)}" if len(runs) > 1 else ""
        message = (f"{where} {name} {texts[i].strip()}: a local time the clocks repeat at the end of daylight saving "
                   f"time; read as {_iso(read)}, it may be {' or '.join(map(_iso, other))}{run} "
                   f"({PARSABLE_TZ_ADVICE})")
        if warnings is None:
            log.warning("%s", message)
        else:
            warnings.append(message)
    return chosen


def parse_sacct_parsable(text: str, tz: tzinfo | None = None, header: Sequence[str] | None = None,
                         skip: list[tuple[str, str]] | None = None,
                         ambiguous: list[tuple[str, str]] | None = None) -> list[JobRecord]:
    """``sacct -P`` (``--parsable2``) output with its header line -> one record per job (several runs of a requeued
    job folded: :func:`_runs_folded`); step lines skipped; a bad
    record as :func:`parse_sacct_json` (``skip``). A heterogeneous job's component ("12+1") is named by its JobIDRaw.

    ``tz`` is the zone sacct printed times in (its TZ); None = this machine's local zone. Times are printed without
    an offset, so in the hour a DST fall-back repeats they are read as :func:`_parsable_times` says (TZ=UTC has no
    such hour); a time that stays undecided is logged as a warning, or with ``ambiguous`` appended there as (job id,
    message), for a caller whose other source of the job (the JSON's epochs) decides it. ``header`` names the
    columns of output printed without a header line (``sacct -n``); then every line is data.
    """
    numbered = [(n, ln) for n, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    if not numbered:
        return []
    if header is None:
        names, first = numbered[0][1].split("|"), numbered[0][1]
        numbered = numbered[1:]
    else:
        names, first = list(header), "|".join(header)
    names = [h.strip().lower() for h in names]
    if "jobid" not in names:
        raise SlurmParseError(f"sacct -P header: no JobID column in {first!r} (run sacct -P without -n)")
    header = names
    col = {name: i for i, name in enumerate(header)}
    out: list[JobRecord] = []
    for n, line in numbered:
        fields = line.split("|")
        if len(fields) != len(header):
            raise SlurmParseError(f"sacct -P line {n}: {len(fields)} fields, header has {len(header)}: {line!r}")

        def get(name: str, fields: list[str] = fields) -> str:
            i = col.get(name)
            return fields[i].strip() if i is not None else ""

        job_id = get("jobid")
        if not job_id:
            raise SlurmParseError(f"sacct -P line {n}: empty JobID")
        if "." in job_id:  # "1234.batch", "1234_7.0", "1234+0.extern": steps of a job already listed
            continue
        job_id = _parsable_job_id(job_id, get("jobidraw"), f"sacct -P line {n}")
        where = f"sacct -P line {n} (job {job_id})"
        with _one_record(job_id, skip):
            state = state_word(get("state"))
            tres = parse_tres_text(get("alloctres"), f"{where} AllocTRES")
            gpus, model = gpus_from_tres(tres)
            undecided: list[str] = []
            times = _parsable_times((get("submit"), get("start"), get("end")), tz, where,
                                    None if ambiguous is None else undecided)
            uid_text = get("uid")
            try:
                uid = int(uid_text) if uid_text else None
            except ValueError:
                raise SlurmParseError(f"{where}: UID {uid_text!r} is not a number") from None
            out.append(_checked_times(JobRecord(
                job_id=job_id,
                cluster=get("cluster"),
                user=get("user") or None,
                uid=uid,
                account=get("account") or None,
                partition=get("partition") or None,
                hosts=_hosts(get("nodelist"), where),
                gpus=gpus,
                gpu_model=model,
                submit=times[0],
                start=times[1],
                end=times[2],
                state=state,
                exit_code=None if _not_ended(state) else exit_code_from_text(get("exitcode"), f"{where} ExitCode"),
                tres=tres,
            ), where))
            if ambiguous is not None:
                ambiguous.extend((job_id, message) for message in undecided)
    return _runs_folded(out)


def merge_sacct(json_records: Iterable[JobRecord], parsable_records: Iterable[JobRecord],
                skip: list[tuple[str, str]] | None = None) -> list[JobRecord]:
    """Combine the two sacct forms of the same jobs: the JSON record, with the exit code from ``sacct -P``
    (22.05's JSON reports it wrong) and any field the JSON left empty filled from ``-P`` (uid, hosts, ...).
    Jobs present in only one form are kept. Order: the JSON's, then the -P-only jobs. A job whose combined times no
    job can have raises SlurmParseError naming it, or with ``skip`` is left out of both forms (:func:`_one_record`)."""
    by_id = {r.job_id: r for r in parsable_records}
    out: list[JobRecord] = []
    seen: set[str] = set()
    for r in json_records:
        seen.add(r.job_id)
        p = by_id.get(r.job_id)
        if p is None:
            out.append(r)
            continue
        fill = {f: getattr(p, f) for f in ("cluster", "user", "uid", "account", "partition", "hosts", "gpu_model",
                                           "submit", "start", "end", "state") if not getattr(r, f)}
        # each form's times were checked; together they must still be a job's (a start from one, an end from the other)
        with _one_record(r.job_id, skip):
            out.append(_checked_times(replace(r, exit_code=p.exit_code if p.exit_code is not None else r.exit_code,
                                              **fill), f"job {r.job_id} (sacct JSON and -P together)")
                       .with_earlier_runs(p.earlier_runs))
    out.extend(p for job_id, p in by_id.items() if job_id not in seen)
    return out


# ------------------------------------------------------------------------------------------------ squeue, sprio

def parse_squeue_json(text: str, states: Iterable[str] | None = ("PENDING",)) -> list[PendingJob]:
    """``squeue --json`` -> jobs in ``states`` (None: all), read by the one squeue parser
    (``agent.slurm.parse_squeue_json``)."""
    wanted = None if states is None else set(states)
    return [PendingJob(job_id=m["job_id"], user=m["user"], account=m["account"], partition=m["partition"],
                       state=m["state"], priority=m["priority"], reason=m["reason"], submit=m["submit"])
            for m in parse_squeue_meta(text) if wanted is None or m["state"] in wanted]


# squeue -r (one line per array task) -t PD: %A the record's own job id, %i the job id scontrol accepts for the
# line ("12", "13_4"), then user, account, partition, state.
SQUEUE_PENDING_FORMAT = "%A|%i|%u|%a|%P|%T"




def parse_squeue_pending(text: str) -> list[PendingJob]:
    """``squeue -h -r -t PD -o '%A|%i|%u|%a|%P|%T'`` -> one PendingJob per job record, in squeue's order.

    With ``-r`` an array's pending tasks that still share one record print one line each with the record's id
    in %A; they are folded back into that record, addressed as "ARRAY_[tasks]" (scontrol updates them with one
    RPC; the bare array id would also address its running and finished tasks, and fail on the finished ones).
    """
    rows: dict[str, list[tuple[str, ...]]] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = tuple(f.strip() for f in line.split("|"))
        if len(fields) != 6 or not fields[0].isdigit():
            raise SlurmParseError(f"squeue line {n}: expected %A|%i|%u|%a|%P|%T with a numeric %A, got {line!r}")
        rows.setdefault(fields[0], []).append(fields)
    out: list[PendingJob] = []
    for record_id, lines in rows.items():
        _, first, user, account, partition, state = lines[0]
        job_id = record_id if "+" in first else first  # a heterogeneous job's component "12+1": its own record
        if len(lines) > 1:
            tasks: list[int] = []
            array = None
            for ln in lines:
                a, sep, t = ln[1].partition("_")
                if not sep or not t.isdigit() or (array is not None and a != array):
                    raise SlurmParseError(f"squeue: record {record_id} has several lines but {ln[1]!r} is not an "
                                          "array task of the same array")
                array = a
                tasks.append(int(t))
            job_id = f"{array}_[{int_ranges(tasks)}]"
        out.append(PendingJob(job_id=job_id, user=user or None, account=account or None,
                              partition=partition or None, state=state_word(state) or state,
                              record_id=record_id, tasks=len(lines)))
    return out


SPRIO_FORMAT = "%i|%u|%Y|%S"


def parse_sprio(text: str) -> dict[str, int]:
    """``sprio -h -o '%i|%u|%Y|%S[|more]'`` -> {job id: site factor}. (A job in several partitions has one line each,
    with the same site factor.)"""
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 4:
            raise SlurmParseError(f"sprio line {n}: expected fields %i|%u|%Y|%S[|...], got {line!r}")
        try:
            out[fields[0]] = int(fields[3])
        except ValueError:
            raise SlurmParseError(f"sprio line {n}: site factor {fields[3]!r} is not an integer") from None
    return out


# ------------------------------------------------------------------------------------------------ the client

Run = Callable[..., "subprocess.CompletedProcess[str]"]
# sacct -s states of a job that has ended (what `priority watch` imports), and of one that holds its allocation.
# With -D, sacct lists a run only in a state named: RQ brings a requeued job's earlier runs, which would otherwise
# never come (22.05: tests/data/slurm/requeue-22.05).
ENDED_STATES = ("BF", "CA", "CD", "DL", "F", "NF", "OOM", "PR", "RQ", "TO")
RUNNING_STATES = ("R", "S")
# A requeued job's run ends as the job is requeued, which is the next run's Submit (a second apart on 22.05): the
# runs before a running one ended after its submission, less this margin (a slow requeue, a node failure's)
REQUEUE_MARGIN_S = 3600.0
_SCONTROL_JOB_ID = re.compile(r"\d+(_(\d+|\[\d+(-\d+)?(,\d+(-\d+)?)*\]))?")


def _warn_left_out(skipped: Sequence[tuple[str, str]]) -> None:
    """Log the records sacct run live left out (:func:`_one_record`), the first ten by name."""
    for _, why in skipped[:10]:
        log.warning("sacct record left out: %s", why)
    if len(skipped) > 10:
        log.warning("and %d more sacct records left out", len(skipped) - 10)


def _slurm_time(t: float | datetime) -> str:
    # Passed to sacct with TZ=UTC, so give the instant in UTC.
    dt = t if isinstance(t, datetime) else datetime.fromtimestamp(float(t), UTC)
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S")


class SlurmClient:
    """Runs Slurm's commands and parses what they print.

    ``run`` is ``subprocess.run`` or anything with its signature (tests pass one that replays captures);
    ``env`` holds variables laid over this process's environment for every command (e.g. ``SLURM_CONF``).
    """

    def __init__(self, run: Run = subprocess.run, env: Mapping[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        self._run = run
        self._env = dict(env or {})
        self._timeout_s = timeout_s

    def _call(self, argv: Sequence[str], extra_env: Mapping[str, str] | None = None) -> str:
        env = {**os.environ, **self._env, **(extra_env or {})}
        try:
            proc = self._run(list(argv), capture_output=True, text=True, env=env, timeout=self._timeout_s)
        except FileNotFoundError:
            raise SlurmCommandError(argv, 127, f"{argv[0]}: command not found (is Slurm's client installed?)") \
                from None
        except subprocess.TimeoutExpired:  # slurmctld stalled or restarting; it may still carry the command out
            raise SlurmCommandError(argv, TIMED_OUT, f"{argv[0]}: no answer within {self._timeout_s:g} s "
                                                     "(slurmctld stalled or restarting?)") from None
        if proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, proc.stderr or "")
        return proc.stdout

    def sacct_jobs(self, start: float | datetime, end: float | datetime,
                   states: Sequence[str] = ()) -> list[JobRecord]:
        """Jobs of all users that ran (or waited) between ``start`` and ``end``: ``sacct --json`` merged with
        ``sacct -P`` for the exit codes. Both run with TZ=UTC so that -P's zone-less times are unambiguous, and with
        -D, so that a requeued job's earlier runs come too.
        ``states`` (sacct -s, e.g. ENDED_STATES) keeps only jobs that were in one of them within the window."""
        window = ["-a", "-D", "-S", _slurm_time(start), "-E", _slurm_time(end)]
        if states:
            window.append(f"--state={','.join(states)}")
        utc = {"TZ": "UTC"}
        skipped: list[tuple[str, str]] = []
        as_json = parse_sacct_json(self._call(["sacct", "--json", *window], utc), skip=skipped)
        parsable = parse_sacct_parsable(
            self._call(["sacct", "-P", "-X", *window, f"--format={SACCT_PARSABLE_FORMAT}"], utc), tz=UTC,
            skip=skipped)
        bad = {job_id for job_id, _ in skipped}  # left out of both forms: the other alone would stand for the job
        records = merge_sacct([r for r in as_json if r.job_id not in bad],
                              [r for r in parsable if r.job_id not in bad], skip=skipped)
        _warn_left_out(skipped)
        return records

    def sacct_running(self, at: float | datetime) -> list[JobRecord]:
        """The jobs of all users running (or suspended) at ``at``, from ONE ``sacct -P -X`` call for them all (a
        cluster runs ~20k at once; -X prints no steps, and a running job has no exit code for ``sacct --json`` to
        add). A job that ended since (slurmdbd is that fast) comes with its end. A requeued job's earlier runs
        (``JobRecord.earlier_runs``), which sacct lists in the state REQUEUED only (-D with ``--state=R,S`` at an
        instant gives the latest run alone), come from one more call where jobs run: the runs requeued since the
        earliest of the running jobs' submissions (:data:`REQUEUE_MARGIN_S` before; a running job's previous run
        ended when it was submitted again), folded into the running records of their jobs; runs before those (a
        job requeued several times) come with ``sacct_jobs``' ``ENDED_STATES`` and join in the ledger."""
        utc = {"TZ": "UTC"}
        skipped: list[tuple[str, str]] = []
        records = parse_sacct_parsable(self._call(
            ["sacct", "-P", "-X", "-D", "-a", "-S", _slurm_time(at), "-E", _slurm_time(at),
             f"--state={','.join(RUNNING_STATES)}", f"--format={SACCT_PARSABLE_FORMAT}"], utc), tz=UTC, skip=skipped)
        submitted = [t for r in records if (t := r.submit if r.submit is not None else r.start) is not None]
        if submitted:
            requeued = parse_sacct_parsable(self._call(
                ["sacct", "-P", "-X", "-D", "-a", "-S", _slurm_time(min(submitted) - REQUEUE_MARGIN_S),
                 "-E", _slurm_time(at), "--state=RQ", f"--format={SACCT_PARSABLE_FORMAT}"], utc), tz=UTC,
                skip=skipped)
            records = _with_requeued_runs(records, requeued)
        _warn_left_out(skipped)
        return records

    def associations(self) -> str:
        """``sacctmgr -P show associations`` with the columns a tree needs (the default columns lack
        ParentName); parse it with ``AssocTree.from_sacctmgr``."""
        return self._call(["sacctmgr", "-P", "show", "associations", f"format={SACCTMGR_FORMAT}"])

    def pending_jobs(self) -> list[PendingJob]:
        """Pending job records (an array's tasks that share one record are one entry): ``squeue -r -t PD``,
        which is several times cheaper than ``squeue --json`` with thousands of jobs."""
        return parse_squeue_pending(self._call(["squeue", "-h", "-r", "-t", "PD", "-o", SQUEUE_PENDING_FORMAT]))

    def site_factors(self) -> dict[str, int]:
        """Current site factor of every pending job sprio lists (held jobs, priority 0, are not listed)."""
        return parse_sprio(self._call(["sprio", "-h", "-o", SPRIO_FORMAT]))

    def set_site_factor(self, job_id: str, value: int) -> None:
        """``scontrol update jobid=N SiteFactor=M`` (root only)."""
        self.set_site_factors([job_id], value)

    def set_site_factors(self, job_ids: Sequence[str], value: int) -> None:
        """``scontrol update jobid=A,B,C SiteFactor=M``: one command for many jobs (checked on 22.05: scontrol
        updates every listed job, and exits non-zero if any one of them failed, e.g. a job that has ended)."""
        for job_id in job_ids:
            if not _SCONTROL_JOB_ID.fullmatch(job_id):
                raise ValueError(f"job id {job_id!r} is not N, N_T or N_[T-U,V]")
        if not job_ids:
            return
        self._call(["scontrol", "update", f"jobid={','.join(job_ids)}", f"SiteFactor={int(value)}"])
