"""Slurm job metadata for the agent: pure parsers plus a small cached resolver.

The parsers turn three real formats into one normalised job dict (``JobMeta``):
``scontrol show job -d`` text, ``squeue --json`` and a process's ``/proc/PID/environ``.
GPU indexes are always the node's numbering (``SLURM_JOB_GPUS``, GRES ``IDX``), never
``CUDA_VISIBLE_DEVICES``, which Slurm renumbers from 0 inside a job with ConstrainDevices.

SLUID (Slurm >= 26.05): we read a ``SLUID=`` key in scontrol text and a ``sluid`` key in squeue
JSON. Both names are our assumption about 26.05's output (no capture yet); where absent the
value is None and the resolver falls back to asking ``scontrol show job <sluid>``.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from gpuledger.schema.records import JobRecord
from gpuledger.schema.text import ascii_int

log = logging.getLogger(__name__)

JobMeta = dict[str, Any]
"""Keys: job_id (text, "1234_7" for array tasks), raw_job_id, sluid, cluster, user, uid, account,
partition, state, hosts (tuple), gpus (int | None), gpu_indexes (tuple[int, ...]: the node's
numbering; for several nodes, those of the first), gpu_indexes_by_node (dict), submit, start,
end (unix seconds | None), tres (tuple of (name, float))."""

# A Slurm 26.05 SLUID: "s" + 13 Crockford base32 characters (no I, L, O, U).
SLUID_RE = re.compile(r"s[0-9A-HJKMNP-TV-Z]{13}")
# "gpu:h200:2(IDX:1-2)", "gpu:2(IDX:0,2-3)", "gpu:a100:1(IDX:N/A)"
_GRES_IDX_RE = re.compile(r"(?:^|,)gpu(?::(?!\d+\()[^:(,]+)?(?::(\d+))?\(IDX:([^)]*)\)")
# scontrol keys: letters, digits, '_', ':' and '/' ("AllocNode:Sid", "CPUs/Task"), then '='.
_SCONTROL_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][\w:/]*)=")


def _empty_meta() -> JobMeta:
    return {
        "job_id": None,
        "raw_job_id": None,
        "sluid": None,
        "cluster": None,
        "user": None,
        "uid": None,
        "account": None,
        "partition": None,
        "state": None,
        "hosts": (),
        "gpus": None,
        "gpu_indexes": (),
        "gpu_indexes_by_node": {},
        "submit": None,
        "start": None,
        "end": None,
        "tres": (),
    }


MAX_GPU_INDEX = 4095  # far above any node's GPUs: a range beyond is no node's, and would be built whole


def parse_index_list(text: str) -> tuple[int, ...]:
    """"0,2-3" -> (0, 2, 3). Empty, "N/A" or "(null)" -> (). ValueError for anything else, or an index above
    ``MAX_GPU_INDEX``."""
    out: list[int] = []
    text = text.strip()
    if not text or text in ("N/A", "(null)"):
        return ()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        values = [ascii_int(b.strip()) for b in ((lo, hi) if sep else (part,))]
        bounds = [b for b in values if b is not None and b <= MAX_GPU_INDEX]
        if len(bounds) != len(values):
            raise ValueError(f"not a GPU index list: {text!r}")
        out.extend(range(bounds[0], bounds[-1] + 1))
    return tuple(out)


def parse_gres_idx(gres: str) -> tuple[int | None, tuple[int, ...]]:
    """GPU count and node indexes from a GRES detail string such as ``gpu:h200:2(IDX:1-2)``."""
    count: int | None = None
    idx: list[int] = []
    for m in _GRES_IDX_RE.finditer(gres):
        if m.group(1) is not None:
            count = (count or 0) + int(m.group(1))
        idx.extend(parse_index_list(m.group(2)))
    return count, tuple(idx)


# Slurm's own bound on a host range (src/common/hostlist.c, MAX_RANGE: "anything larger will be assumed to be an
# error"), here on a whole list: counted before any name is built, so no text can make a list of millions
MAX_HOSTLIST_HOSTS = 64 * 1024
_HOSTLIST_RE = re.compile(r"([^,\[]+)(?:\[([^\]]*)\]([^,]*))?(?:,|$)")


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist: "gpu[01-03,07],login1" -> gpu01, gpu02, gpu03, gpu07, login1.

    Handles one bracket group per name (the common form); anything else is returned as is. SlurmParseError (a
    ValueError) for what no hostlist is: a bracket left open, a range part that is not ``N`` or ``LO-HI`` (ASCII
    digits, LO <= HI), more than ``MAX_HOSTLIST_HOSTS`` hosts.
    """
    text = text.strip()
    if not text or text == "(null)":
        return ()
    groups: list[tuple[str, list[tuple[int, int, int]] | None, str]] = []  # prefix, (lo, hi, width)s, suffix
    count, at = 0, 0
    shown = repr(text if len(text) <= 80 else text[:77] + "...")
    for m in _HOSTLIST_RE.finditer(text):
        if text[at:m.start()].strip(","):  # what no name matched: an open bracket
            raise SlurmParseError(f"hostlist {shown}: unbalanced brackets")
        at = m.end()
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
        parts: list[tuple[int, int, int]] | None = None
        if ranges is None:
            count += 1
        else:
            parts = []
            for part in ranges.split(","):
                lo, sep, hi = part.partition("-")
                # (a host number of 40 digits is no host's, and int() refuses more than 4300)
                first, last = (ascii_int(lo), ascii_int(hi if sep else lo)) if len(part) < 40 else (None, None)
                if first is None or last is None or last < first:
                    raise SlurmParseError(f"hostlist {shown}: {part[:40]!r} is not a number or a range LO-HI")
                parts.append((first, last, len(lo)))
                count += last - first + 1
        if count > MAX_HOSTLIST_HOSTS:
            raise SlurmParseError(f"hostlist {shown}: more than {MAX_HOSTLIST_HOSTS} hosts")
        groups.append((prefix, parts, suffix))
    if text[at:].strip(","):
        raise SlurmParseError(f"hostlist {shown}: unbalanced brackets")
    names: list[str] = []
    for prefix, parts, suffix in groups:
        if parts is None:
            names.append(prefix)
            continue
        for first, last, width in parts:
            names.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(first, last + 1))
    return tuple(names)


MEM_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}  # Slurm's binary units


def parse_tres(text: str, where: str | None = None) -> tuple[tuple[str, float], ...]:
    """"cpu=2,mem=2000M,gres/gpu=2" -> (("cpu", 2.0), ("mem", 2000e6), ("gres/gpu", 2.0)).

    Memory suffixes K/M/G/T/P are Slurm's binary units (M = MiB) and become bytes; empty text -> (). Without
    ``where`` an item that is not ``name=number`` is skipped (an agent's metadata is best effort); with it,
    such an item raises :class:`SlurmParseError` naming ``where`` (imported records must be whole).
    """
    out: list[tuple[str, float]] = []
    if not text.strip():
        return ()
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name:
            if where is not None:
                raise SlurmParseError(f"{where}: {item!r} in {text.strip()!r} is not name=value")
            continue
        mult = 1
        if value and value[-1] in MEM_UNITS:
            mult, value = MEM_UNITS[value[-1]], value[:-1]
        try:
            out.append((name, float(value) * mult))
        except ValueError:
            if where is not None:
                raise SlurmParseError(f"{where}: value of {name!r} in {text.strip()!r} is not a number") from None
    return tuple(out)


def _tres_gpus(tres: Iterable[tuple[str, float]]) -> int | None:
    # The untyped "gres/gpu" is the total; typed "gres/gpu:h200" repeats it, never add both.
    for name, value in tres:
        if name == "gres/gpu":
            return int(value)
    return None


def _slurm_time(text: str | None) -> float | None:
    """scontrol's local-time "2026-11-29T16:23:29" -> unix seconds; "Unknown"/"None" -> None."""
    if not text or text in ("Unknown", "None", "N/A", "(null)"):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def _split_scontrol_line(line: str) -> list[tuple[str, str]]:
    keys = list(_SCONTROL_KEY_RE.finditer(line))
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        pairs.append((m.group(1), line[m.end() : end].strip()))
    return pairs


def parse_scontrol_show_job(text: str) -> list[JobMeta]:
    """Parse ``scontrol show job [-d]`` text: one JobMeta per ``JobId=`` record.

    Each dict also holds ``raw``: every ``Key=value`` of the record as text. With ``-d`` the
    per-node lines (``Nodes=vm CPU_IDs=2-3 Mem=2000 GRES=gpu:h200:2(IDX:1-2)``) give the GPU
    indexes per node.
    """
    records: list[tuple[dict[str, str], list[dict[str, str]]]] = []
    for line in text.splitlines():
        pairs = _split_scontrol_line(line)
        if not pairs:
            continue
        if pairs[0][0] == "JobId":
            records.append(({}, []))
        if not records:
            continue
        raw, nodes = records[-1]
        if pairs[0][0] == "Nodes" and line.startswith(" "):
            nodes.append(dict(pairs))
            continue
        for k, v in pairs:
            raw.setdefault(k, v)
    return [_meta_from_scontrol(raw, nodes) for raw, nodes in records]


def _meta_from_scontrol(raw: dict[str, str], nodes: list[dict[str, str]]) -> JobMeta:
    meta = _empty_meta()
    meta["raw"] = dict(raw)
    raw_id = raw.get("JobId")
    meta["raw_job_id"] = raw_id
    array_job, array_task = raw.get("ArrayJobId"), raw.get("ArrayTaskId")
    # A pending array's ArrayTaskId can be a range ("1-10%2"); only a single task has a name.
    if array_job and array_task and array_task.isdigit():
        meta["job_id"] = f"{array_job}_{array_task}"
    else:
        meta["job_id"] = raw_id
    if "SLUID" in raw and SLUID_RE.fullmatch(raw["SLUID"]):
        meta["sluid"] = raw["SLUID"]
    m = re.fullmatch(r"(.*?)\((\d+)\)", raw.get("UserId", ""))
    if m:
        meta["user"], meta["uid"] = m.group(1), int(m.group(2))
    for key, field in (("Account", "account"), ("Partition", "partition"), ("JobState", "state")):
        if raw.get(key) not in (None, "", "(null)"):
            meta[field] = raw[key]
    meta["hosts"] = expand_hostlist(raw.get("NodeList", ""))
    meta["tres"] = parse_tres(raw.get("TRES", "") or raw.get("AllocTRES", ""))
    meta["gpus"] = _tres_gpus(meta["tres"])
    by_node: dict[str, tuple[int, ...]] = {}
    for node in nodes:
        _, idx = parse_gres_idx(node.get("GRES", ""))
        for host in expand_hostlist(node.get("Nodes", "")):
            by_node[host] = idx
    meta["gpu_indexes_by_node"] = by_node
    if by_node:
        meta["gpu_indexes"] = next(iter(by_node.values()))
    meta["submit"] = _slurm_time(raw.get("SubmitTime"))
    meta["start"] = _slurm_time(raw.get("StartTime"))
    meta["end"] = _slurm_time(raw.get("EndTime"))
    return meta


class SlurmParseError(ValueError):
    """Output of a Slurm command that does not have the expected shape; the message says what and where."""


def slurm_number(v: Any) -> Any:
    """Slurm >= 23.02 JSON wraps numbers as {"set": bool, "infinite": bool, "number": n}: unwrap (None if unset)."""
    if isinstance(v, dict) and "number" in v:
        return v["number"] if v.get("set", True) and not v.get("infinite", False) else None
    return v


def slurm_epoch(v: Any) -> float | None:
    """A (possibly wrapped) unix time; None when unset, 0 or not a number."""
    v = slurm_number(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def first_flag(v: Any) -> Any:
    """23.11+ prints flag sets (state, exit status) as lists: their first element."""
    if isinstance(v, list):
        return v[0] if v else None
    return v


def state_word(state: str | None) -> str | None:
    """A job state as one word: "CANCELLED by 0" -> "CANCELLED"; sacct's human form may also add "+"."""
    if not state:
        return None
    return state.split()[0].rstrip("+") or None


def load_jobs_json(text: str, what: str) -> Mapping[str, Any]:
    """A Slurm JSON document with a ``jobs`` list (squeue, sacct, slurmrestd)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise SlurmParseError(f"{what}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SlurmParseError(f"{what}: expected an object with a 'jobs' list")
    return doc


def parse_squeue_json(text: str) -> list[JobMeta]:
    """Parse ``squeue --json`` (22.05's openapi/v0.0.38 to 24.11's data_parser, numbers plain or wrapped).

    The one squeue parser: the agent resolves jobs with it, accounting takes pending jobs from it
    (``accounting.slurm.parse_squeue_json``). squeue --json ignores ``-t``/``-u``, so finished jobs are
    included: filter on ``state`` yourself. Besides the JobMeta keys, each dict has ``priority`` (int | None)
    and ``reason`` (the pending reason | None). A record without an integer ``job_id`` or a ``job_state``
    raises SlurmParseError naming it.
    """
    doc = load_jobs_json(text, "squeue JSON")
    out: list[JobMeta] = []
    for i, job in enumerate(doc["jobs"]):
        where = f"squeue JSON jobs[{i}]"
        if not isinstance(job, dict):
            raise SlurmParseError(f"{where}: not an object")
        raw_id = slurm_number(job.get("job_id"))
        if not isinstance(raw_id, int) or isinstance(raw_id, bool):
            raise SlurmParseError(f"{where}: job_id {job.get('job_id')!r} is not an integer")
        state = state_word(first_flag(job.get("job_state")))
        if state is None:
            raise SlurmParseError(f"{where} (job {raw_id}): no job_state")
        meta = _empty_meta()
        meta["raw_job_id"] = str(raw_id)
        array_job, array_task = slurm_number(job.get("array_job_id")), slurm_number(job.get("array_task_id"))
        # A pending array's meta record has no task id: its raw id addresses every pending task.
        meta["job_id"] = f"{array_job}_{array_task}" if array_job and array_task is not None else str(raw_id)
        sluid = job.get("sluid")
        if isinstance(sluid, str) and SLUID_RE.fullmatch(sluid):
            meta["sluid"] = sluid
        meta["cluster"] = job.get("cluster") or None
        meta["user"] = job.get("user_name") or None
        meta["uid"] = slurm_number(job.get("user_id"))
        meta["account"] = job.get("account") or None
        meta["partition"] = job.get("partition") or None
        meta["state"] = state
        priority = slurm_number(job.get("priority"))
        meta["priority"] = int(priority) if isinstance(priority, (int, float)) and not isinstance(priority, bool) \
            else None
        reason = job.get("state_reason")
        meta["reason"] = None if reason in (None, "", "None") else reason
        meta["hosts"] = expand_hostlist(job.get("nodes") or "")
        meta["tres"] = parse_tres(job.get("tres_alloc_str") or "")
        meta["gpus"] = _tres_gpus(meta["tres"])
        meta["submit"] = slurm_epoch(job.get("submit_time"))
        meta["start"] = slurm_epoch(job.get("start_time"))
        meta["end"] = slurm_epoch(job.get("end_time"))
        details = [d for d in job.get("gres_detail") or [] if isinstance(d, str)]
        node_names = _squeue_node_names(job)
        by_node: dict[str, tuple[int, ...]] = {}
        if len(details) == len(node_names):
            for name, d in zip(node_names, details):
                by_node[name] = parse_gres_idx(d)[1]
        elif len(details) == 1 and len(meta["hosts"]) == 1:
            by_node[meta["hosts"][0]] = parse_gres_idx(details[0])[1]
        meta["gpu_indexes_by_node"] = by_node
        if by_node:
            meta["gpu_indexes"] = next(iter(by_node.values()))
        out.append(meta)
    return out


def _squeue_node_names(job: Mapping[str, Any]) -> list[str]:
    # gres_detail is per allocated node, in the order of job_resources' node list.
    res = job.get("job_resources") or {}
    nodes = res.get("allocated_nodes")  # 22.05
    if isinstance(nodes, list):
        return [n.get("nodename", "") for n in nodes if isinstance(n, dict)]
    alloc = (res.get("nodes") or {}).get("allocation") if isinstance(res.get("nodes"), dict) else None
    if isinstance(alloc, list):  # >= 24.05
        return [n.get("name", "") for n in alloc if isinstance(n, dict)]
    return []


def parse_environ(data: bytes) -> dict[str, str]:
    """NUL-separated ``/proc/PID/environ`` -> dict (undecodable bytes replaced, not fatal)."""
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def parse_job_environ(data: bytes) -> JobMeta | None:
    """Job metadata from a job process's environment; None if it is not in a Slurm job.

    GPU indexes come from SLURM_JOB_GPUS (node numbering), else SLURM_STEP_GPUS; the count
    from SLURM_GPUS_ON_NODE, else the number of indexes. Both describe this node only.
    """
    env = parse_environ(data)
    raw_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not raw_id:
        return None
    meta = _empty_meta()
    meta["raw_job_id"] = raw_id
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    meta["job_id"] = f"{array_job}_{array_task}" if array_job and array_task else raw_id
    if SLUID_RE.fullmatch(env.get("SLURM_JOB_SLUID", "")):
        meta["sluid"] = env["SLURM_JOB_SLUID"]
    meta["cluster"] = env.get("SLURM_CLUSTER_NAME") or None
    meta["user"] = env.get("SLURM_JOB_USER") or None
    uid = env.get("SLURM_JOB_UID", "")
    meta["uid"] = ascii_int(uid)
    meta["account"] = env.get("SLURM_JOB_ACCOUNT") or None
    meta["partition"] = env.get("SLURM_JOB_PARTITION") or None
    try:
        meta["hosts"] = expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))
    except SlurmParseError:  # the job's user writes this environment: a bad node list costs the hosts, not the job
        meta["hosts"] = ()
    for var in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        try:
            idx = parse_index_list(env.get(var, ""))
        except ValueError:  # e.g. GPU UUIDs or MIG names instead of indexes
            idx = ()
        if idx:
            meta["gpu_indexes"] = idx
            break
    on_node = env.get("SLURM_GPUS_ON_NODE", "")
    gpus = ascii_int(on_node)
    meta["gpus"] = gpus if gpus is not None else (len(meta["gpu_indexes"]) or None)
    return meta


def job_record(meta: Mapping[str, Any], *, gpu_uuids: Sequence[str] = ()) -> JobRecord:
    """The shared JobRecord of a JobMeta (gpu indexes have no field there; see ``JobMeta``)."""
    return JobRecord(
        job_id=str(meta["job_id"]),
        cluster=meta.get("cluster") or "",
        user=meta.get("user"),
        uid=meta.get("uid"),
        account=meta.get("account"),
        partition=meta.get("partition"),
        hosts=tuple(meta.get("hosts") or ()),
        gpus=meta.get("gpus"),
        gpu_uuids=tuple(gpu_uuids),
        submit=meta.get("submit"),
        start=meta.get("start"),
        end=meta.get("end"),
        state=meta.get("state"),
        tres=tuple(meta.get("tres") or ()),
    )


Run = Callable[[Sequence[str]], str]


def run_command(argv: Sequence[str], timeout_s: float = 10.0) -> str:
    """The real ``run``: stdout of a command; raises on a non-zero exit, a timeout or no binary."""
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=timeout_s).stdout


class JobResolver:
    """Job metadata and SLUID -> job id from Slurm's own commands, cached for ``ttl_s``.

    Failures (no Slurm on the host, a job gone) are cached as misses for ``ttl_s`` too, so a
    sampling loop never calls Slurm more than once per job per TTL.
    """

    def __init__(self, run: Run = run_command, ttl_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self._run = run
        self._ttl = ttl_s
        self._clock = clock
        self._jobs: dict[str, tuple[float, JobMeta | None]] = {}
        self._sluids: dict[str, tuple[float, str | None]] = {}
        self.calls = 0  # Slurm commands run (for tests and the agent's self-metrics)

    def _fresh(self, stamp: float) -> bool:
        return self._clock() - stamp < self._ttl

    def _call(self, argv: Sequence[str]) -> str | None:
        self.calls += 1
        try:
            return self._run(argv)
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("%s failed: %s", " ".join(argv), e)
            return None

    def _remember(self, metas: Iterable[JobMeta]) -> None:
        now = self._clock()
        for meta in metas:
            for key in {meta.get("job_id"), meta.get("raw_job_id")} - {None}:
                self._jobs[str(key)] = (now, meta)
            if meta.get("sluid"):
                self._sluids[meta["sluid"]] = (now, meta["job_id"])

    def meta(self, job_id: str) -> JobMeta | None:
        """JobMeta of a job id (raw or "array_task"), from ``scontrol show job -d``."""
        hit = self._jobs.get(job_id)
        if hit and self._fresh(hit[0]):
            return hit[1]
        out = self._call(["scontrol", "show", "job", "-d", job_id])
        metas = parse_scontrol_show_job(out) if out else []
        self._remember(metas)
        if job_id not in self._jobs or not self._fresh(self._jobs[job_id][0]):
            self._jobs[job_id] = (self._clock(), None)
        return self._jobs[job_id][1]

    def job(self, job_id: str) -> JobRecord | None:
        meta = self.meta(job_id)
        return None if meta is None else job_record(meta)

    def gpu_indexes(self, job_id: str, host: str | None = None) -> tuple[int, ...]:
        """The job's GPU indexes on ``host`` (node numbering); any node's when host is None."""
        meta = self.meta(job_id)
        if meta is None:
            return ()
        if host is not None:
            return tuple(meta["gpu_indexes_by_node"].get(host, ()))
        return tuple(meta["gpu_indexes"])

    def job_id_for_sluid(self, sluid: str) -> str | None:
        """The job id of a SLUID: ``scontrol show job -d <sluid>`` first, then ``squeue --json``."""
        hit = self._sluids.get(sluid)
        if hit and self._fresh(hit[0]):
            return hit[1]
        out = self._call(["scontrol", "show", "job", "-d", sluid])
        metas = parse_scontrol_show_job(out) if out else []
        if len(metas) == 1 and metas[0].get("job_id"):
            # scontrol answered for exactly this SLUID, even if it does not print a SLUID key.
            metas[0]["sluid"] = metas[0].get("sluid") or sluid
        self._remember(metas)
        if sluid not in self._sluids or not self._fresh(self._sluids[sluid][0]):
            out = self._call(["squeue", "--json"])
            try:
                self._remember(parse_squeue_json(out) if out else [])
            except SlurmParseError as e:
                log.warning("squeue --json: unreadable output: %s", e)
        if sluid not in self._sluids or not self._fresh(self._sluids[sluid][0]):
            self._sluids[sluid] = (self._clock(), None)
        return self._sluids[sluid][1]


__all__ = [
    "JobMeta",
    "JobResolver",
    "SLUID_RE",
    "SlurmParseError",
    "expand_hostlist",
    "first_flag",
    "job_record",
    "load_jobs_json",
    "parse_environ",
    "parse_gres_idx",
    "parse_index_list",
    "parse_job_environ",
    "parse_scontrol_show_job",
    "parse_squeue_json",
    "parse_tres",
    "run_command",
    "slurm_epoch",
    "slurm_number",
    "state_word",
]


def cluster_name_from_conf(text: str) -> str:
    """``ClusterName=`` of slurm.conf text ("" when absent); keys are case-insensitive, ``#`` starts a comment."""
    for line in text.splitlines():
        key, sep, value = line.split("#", 1)[0].strip().partition("=")
        if sep and key.strip().lower() == "clustername":
            return value.strip().split()[0] if value.strip() else ""
    return ""


def local_cluster_name(paths: Sequence[str] | None = None) -> str:
    """This host's Slurm cluster name from slurm.conf ($SLURM_CONF, then /etc/slurm/slurm.conf); "" if none."""
    import os

    for path in paths if paths is not None else (os.environ.get("SLURM_CONF", ""), "/etc/slurm/slurm.conf"):
        if not path:
            continue
        try:
            with open(path) as f:
                return cluster_name_from_conf(f.read())
        except OSError:
            continue
    return ""
