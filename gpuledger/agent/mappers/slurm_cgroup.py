"""Slurm job of each GPU process, from ``/proc/PID/cgroup``.

Layouts (a path component ``job_J`` under a Slurm cgroup root):

- cgroup v1: ``/slurm/uid_U/job_J/step_S/task_T`` or, with a node name,
  ``/slurm_<node>/uid_U/job_J/step_S/...`` (captured: ``6:freezer:/slurm_vm/uid_1002/job_16/step_batch``);
- cgroup v2: ``0::/system.slice/slurmstepd.scope/job_J/step_S/user/task_T``;
- Slurm >= 26.05 names v2 job directories by SLUID (``.../slurmstepd.scope/sEKNKTV3WPV500/...``)
  unless ``CgroupJobIdPaths=yes``; a ``JobResolver`` maps the SLUID back to the job id.

The cgroup is Slurm's, the process environment its user's: a user can start a process with any
``SLURM_ARRAY_JOB_ID``, ``SLURM_JOB_ACCOUNT`` or ``SLURM_JOB_ID`` (``env SLURM_ARRAY_JOB_ID=777 ./train``), not move
it to another job's cgroup. So the job id comes from the cgroup, and what the cgroup does not say (an array task's
name ``1234_7``, the job's user and account, a SLUID's job id) from Slurm itself: the ``JobResolver``
(``scontrol show job``, once per job). ``/proc/PID/environ`` is read only with ``trust_environ=True`` (a site whose
users cannot run code there), as a fallback after the resolver.

With proctrack/linuxproc no cgroup names the job (captured: every line is ``/`` or the
host's own cgroup). ``env_fallback=True`` then takes ``SLURM_JOB_ID`` from ``/proc/PID/environ`` (so it trusts the
environment); it is off by default.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from gpuledger.agent.sharing import split_shares
from gpuledger.agent.slurm import SLUID_RE, JobMeta, JobResolver, job_record, parse_job_environ
from gpuledger.schema.records import GpuSample, JobRecord, sorted_job_ids

log = logging.getLogger(__name__)

# v1: slurm or slurm_<node> (MULTIPLE_SLURMD); v2: system.slice/slurmstepd.scope, or <node>_slurmstepd.scope
# (cgroup_v2.c with MULTIPLE_SLURMD)
_ROOT_RE = re.compile(r"slurm(_[^/]*)?|([^/]+_)?slurmstepd(_[^/]*)?\.scope")
_JOB_RE = re.compile(r"job_([0-9]+)")  # [0-9], not \d: \d takes other scripts' digits, which int() refuses
_UID_RE = re.compile(r"uid_([0-9]+)")
_STEP_RE = re.compile(r"step_(\w+)")


@dataclass(frozen=True, slots=True)
class JobRef:
    """Where a cgroup path puts a process: a job id or (26.05) a SLUID, and what else it says."""

    job_id: str | None = None
    sluid: str | None = None
    uid: int | None = None
    step: str | None = None  # "batch", "extern", "0", ...


def _parse_path(path: str) -> JobRef | None:
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        if not _ROOT_RE.fullmatch(part):
            continue
        uid: int | None = None
        for j in range(i + 1, len(parts)):
            comp = parts[j]
            if m := _UID_RE.fullmatch(comp):
                uid = int(m.group(1))
                continue
            job = _JOB_RE.fullmatch(comp)
            sluid = None if job else SLUID_RE.fullmatch(comp)
            if not (job or sluid):
                break
            step = None
            if j + 1 < len(parts) and (s := _STEP_RE.fullmatch(parts[j + 1])):
                step = s.group(1)
            if job:
                return JobRef(job_id=job.group(1), uid=uid, step=step)
            return JobRef(sluid=comp, uid=uid, step=step)
    return None


def parse_cgroup(text: str) -> JobRef | None:
    """The Slurm job of a ``/proc/PID/cgroup`` text (``ID:controllers:path`` lines), or None."""
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        _, sep, path = rest.partition(":")
        if not sep:
            continue
        ref = _parse_path(path.strip())
        if ref is not None:
            return ref
    return None


def _add(totals: dict[str, Any], job: str, value: int | float | None) -> None:
    """Add one process's ``value`` to its job's total: unknown (None) once any of the job's processes' is."""
    prev = totals.get(job, 0)
    totals[job] = None if prev is None or value is None else prev + value


class SlurmCgroupMapper:
    """JobMapper: GPU process pids -> ``<proc_root>/<pid>/cgroup`` -> Slurm job ids.

    Jobs on a shared GPU get ``job_shares`` by the time their processes' kernels ran (all known), else
    by their processes' GPU memory (all known), else equal (``agent.sharing.split_shares``). ``skipped``
    counts pids that vanished, were unreadable, were not in a job, had a SLUID nobody could resolve, or failed
    otherwise (``error``: one process never costs the others their jobs).
    ``job_metadata()`` gives a JobRecord per job seen in the last ``map`` call, from the resolver (the real
    ``scontrol`` by default; None: no Slurm calls), or the process environment with ``trust_environ``.
    """

    def __init__(
        self,
        proc_root: str | Path = "/proc",
        resolver: JobResolver | None | Literal["scontrol"] = "scontrol",
        *,
        env_fallback: bool = False,
        trust_environ: bool = False,
    ) -> None:
        self.proc_root = Path(proc_root)
        self.resolver = JobResolver() if resolver == "scontrol" else resolver
        self.env_fallback = env_fallback
        self.trust_environ = trust_environ or env_fallback
        self.skipped: Counter[str] = Counter()
        self._meta: dict[str, JobMeta] = {}
        self._uuids: dict[str, set[str]] = {}
        self._raw_to_id: dict[str, str] = {}

    # -- reading /proc (the machine boundary) ---------------------------------------------------

    def _read(self, pid: int, name: str, count: bool = True) -> bytes | None:
        try:
            return (self.proc_root / str(pid) / name).read_bytes()
        except FileNotFoundError:
            self.skipped["vanished"] += count
        except OSError:  # permission, ESRCH mid-read, a pid that is a zombie
            self.skipped["unreadable"] += count
        return None

    def _environ_meta(self, pid: int) -> JobMeta | None:
        # Not counted as skipped: another user's environ is unreadable unless we are root, and
        # the resolver covers that case; only the cgroup decides whether a pid was mapped.
        data = self._read(pid, "environ", count=False)
        return None if data is None else parse_job_environ(data)

    def _job_of_pid(self, pid: int, cache: dict[int, str | None]) -> str | None:
        if pid in cache:
            return cache[pid]
        cache[pid] = None
        data = self._read(pid, "cgroup")
        if data is None:
            return None
        ref = parse_cgroup(data.decode("utf-8", "replace"))
        env_meta: JobMeta | None = None
        raw: str | None = None
        if ref is not None and ref.job_id is not None:
            raw = ref.job_id
        elif ref is not None and ref.sluid is not None:
            raw = self.resolver.job_id_for_sluid(ref.sluid) if self.resolver else None
            if raw is None and self.trust_environ:
                env_meta = self._environ_meta(pid)
                raw = env_meta["raw_job_id"] if env_meta else None
            if raw is None:
                self.skipped["sluid_unresolved"] += 1
                return None
        elif self.env_fallback:
            env_meta = self._environ_meta(pid)
            raw = env_meta["raw_job_id"] if env_meta else None
        if raw is None:
            self.skipped["not_in_job"] += 1
            return None
        cache[pid] = self._job_id(raw, pid, env_meta)
        return cache[pid]

    def _job_id(self, raw: str, pid: int, env_meta: JobMeta | None) -> str:
        """The job's id as accounting names it ("1234_7" for array tasks), plus its metadata: Slurm's (the
        resolver), else (``trust_environ``) the environment's. Asked once per job, not per pid per cycle; a job
        Slurm did not answer for goes by its cgroup's id and is asked again later (the resolver's cache bounds how
        often)."""
        if raw in self._raw_to_id:
            return self._raw_to_id[raw]
        meta = self.resolver.meta(raw) if self.resolver is not None else None
        if meta is None and self.trust_environ:
            meta = env_meta or self._environ_meta(pid)
            if meta is not None and meta.get("raw_job_id") != raw:
                meta = None  # a process can carry a stale SLURM_JOB_ID (e.g. nested sbatch)
        job_id = str(meta["job_id"]) if meta and meta.get("job_id") else raw
        if meta is not None or self.resolver is None:
            self._raw_to_id[raw] = job_id
        if meta is not None:
            self._meta[job_id] = meta
        return job_id

    # -- the protocol --------------------------------------------------------------------------

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        pid_cache: dict[int, str | None] = {}
        uuids: dict[str, set[str]] = {}
        out: list[GpuSample] = []
        for s in samples:
            mem: dict[str, int | None] = {}
            busy: dict[str, float | None] = {}
            for proc in s.processes:
                try:
                    job = self._job_of_pid(proc.pid, pid_cache)
                except Exception:  # noqa: BLE001 - whatever one process holds, the GPU's other jobs stay mapped
                    log.warning("mapping pid %d failed", proc.pid, exc_info=True)
                    self.skipped["error"] += 1
                    pid_cache[proc.pid] = None
                    continue
                if job is None:
                    continue
                _add(mem, job, proc.used_memory_bytes)
                _add(busy, job, proc.gpu_util_ratio)
            if not mem:
                out.append(s)
                continue
            jobs = sorted_job_ids(mem.keys())
            for j in jobs:
                uuids.setdefault(j, set()).add(s.gpu_uuid)
            shares = split_shares(jobs, mem, busy) if len(jobs) > 1 else ()
            out.append(replace(s, job_ids=jobs, job_shares=shares))
        seen_raw = {raw for raw, jid in self._raw_to_id.items() if jid in uuids}
        # Forget jobs no longer on any GPU: their ids and metadata must not grow without bound.
        self._raw_to_id = {raw: self._raw_to_id[raw] for raw in seen_raw}
        self._meta = {j: m for j, m in self._meta.items() if j in uuids}
        self._uuids = uuids
        return out

    def job_metadata(self) -> dict[str, JobRecord]:
        """A JobRecord for each job seen in the last ``map`` call (gpu_uuids: the GPUs its
        processes were on). Jobs whose metadata nobody could read get a bare record."""
        out: dict[str, JobRecord] = {}
        for job_id in sorted_job_ids(self._uuids.keys()):
            uuids = sorted(self._uuids[job_id])
            meta: Mapping[str, Any] = self._meta.get(job_id) or {"job_id": job_id}
            out[job_id] = job_record(meta, gpu_uuids=uuids)
        return out


__all__ = ["JobRef", "SlurmCgroupMapper", "parse_cgroup"]
