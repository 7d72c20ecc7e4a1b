"""Jobs per GPU from a mapping directory that a Slurm prolog/epilog keeps (``contrib/slurm/``).

Two formats exist in the wild:

- **dcgm-exporter** (``--hpc-job-mapping-dir``): a file per GPU named ``<gpu index>`` or
  ``<gpu index>.<GPU instance id>`` (MIG), holding job ids, one a line.
- **jobstats** (Princeton): a file per GPU named ``<gpu index>`` or ``<GPU-UUID>`` holding
  ``jobid uid`` lines.

``format="auto"`` reads each line as ``jobid [uid]``, which accepts both.

Matching files to samples: a whole-GPU sample (``mig`` None) takes the files named by its
index and by its UUID. A MIG sample's ``mig`` is ``"<gi>.<ci>"`` or ``"<gi>"`` (the GPU
instance id, optionally with the compute instance id); only the GPU instance matters (a
dcgm-exporter file is per GPU instance), so it takes ``<index>.<gi>``, plus ``<index>`` and
the UUID files (a job that holds the whole GPU holds all its instances). A ``mig`` that is not
numeric (a profile name) matches only the whole-GPU files. A file named by a MIG instance's own UUID
(``MIG-...``, as jobstats names them) matches that instance when the mapper is given ``mig_uuids`` (the NVML
source's: samples carry the GPU's UUID and the instance id, not the instance's UUID).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from gpuledger.agent.sharing import split_shares
from gpuledger.schema.records import GpuSample, JobRecord, sorted_job_ids
from gpuledger.schema.text import ascii_int

log = logging.getLogger(__name__)

Format = Literal["auto", "dcgm", "jobstats"]
_FORMATS = ("auto", "dcgm", "jobstats")
_INDEX_NAME_RE = re.compile(r"(\d+)(?:\.(\d+))?")
# NVML UUIDs: "GPU-<hex/dashes>" and "MIG-<hex/dashes>" (older MIG form "MIG-GPU-<uuid>/<gi>/<ci>"
# cannot be a file name).
_UUID_NAME_RE = re.compile(r"(?:GPU|MIG)-[0-9A-Fa-f-]+")
_MAX_FILE_BYTES = 64 * 1024  # a mapping file is a few lines; never slurp a stray big file


@dataclass(frozen=True, slots=True)
class GpuKey:
    """What a mapping file's name says about its GPU: an index (with a MIG GPU instance) or a UUID."""

    index: int | None = None
    gpu_instance: int | None = None
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class JobEntry:
    job_id: str
    uid: int | None = None


def parse_mapping_name(name: str) -> GpuKey | None:
    """File name -> GpuKey; None for anything else (temporary files, locks, READMEs)."""
    if m := _INDEX_NAME_RE.fullmatch(name):
        return GpuKey(index=int(m.group(1)), gpu_instance=None if m.group(2) is None else int(m.group(2)))
    if _UUID_NAME_RE.fullmatch(name):
        return GpuKey(uuid=name)
    return None


def parse_dcgm_mapping(text: str) -> tuple[JobEntry, ...]:
    """dcgm-exporter's file body: one job id a line (blank lines ignored, duplicates once)."""
    seen: dict[str, JobEntry] = {}
    for line in text.splitlines():
        job = line.strip()
        if job and not job.startswith("#"):
            seen.setdefault(job, JobEntry(job))
    return tuple(seen.values())


def parse_jobstats_mapping(text: str) -> tuple[JobEntry, ...]:
    """jobstats' file body: ``jobid uid`` lines; a malformed line is skipped."""
    seen: dict[str, JobEntry] = {}
    for line in text.splitlines():
        parts = line.split()
        uid = ascii_int(parts[1]) if len(parts) == 2 else None
        if uid is None or parts[0].startswith("#"):
            continue
        seen.setdefault(parts[0], JobEntry(parts[0], uid))
    return tuple(seen.values())


def parse_auto_mapping(text: str) -> tuple[JobEntry, ...]:
    """Either format: ``jobid`` or ``jobid uid`` per line."""
    seen: dict[str, JobEntry] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("#") or len(parts) > 2:
            continue
        uid = ascii_int(parts[1]) if len(parts) == 2 else None
        if len(parts) == 2 and uid is None:
            continue
        prev = seen.get(parts[0])
        if prev is None or prev.uid is None:
            seen[parts[0]] = JobEntry(parts[0], uid if uid is not None else (prev.uid if prev else None))
    return tuple(seen.values())


_PARSERS = {"auto": parse_auto_mapping, "dcgm": parse_dcgm_mapping, "jobstats": parse_jobstats_mapping}


def read_mapping_dir(path: str | Path, format: Format = "auto") -> dict[GpuKey, tuple[JobEntry, ...]]:
    """Read every mapping file of a directory. Raises FileNotFoundError if the directory is
    missing; a file that vanishes or cannot be read while we list is skipped (an epilog may be
    removing it right now)."""
    parse = _PARSERS[format]
    out: dict[GpuKey, tuple[JobEntry, ...]] = {}
    with os.scandir(path) as it:
        entries = sorted((e.name, e.path) for e in it)
    for name, full in entries:
        key = parse_mapping_name(name)
        if key is None:
            continue
        if format == "dcgm" and key.uuid is not None:
            continue  # dcgm-exporter names files by index only
        if format == "jobstats" and key.gpu_instance is not None:
            continue
        try:
            with open(full, "rb") as f:
                text = f.read(_MAX_FILE_BYTES).decode("utf-8", "replace")
        except OSError:
            continue
        jobs = parse(text)
        if jobs:
            out[key] = jobs
    return out


def _gpu_instance(mig: str | None) -> int | None:
    if mig is None:
        return None
    return ascii_int(mig.split(".", 1)[0])


def jobs_for_sample(table: Mapping[GpuKey, Sequence[JobEntry]], s: GpuSample,
                    mig_uuid: str | None = None) -> list[JobEntry]:
    """The entries of every file that names this sample's GPU (see the module docstring); ``mig_uuid``: the
    MIG instance's own UUID, when known."""
    keys = [GpuKey(index=s.gpu_index), GpuKey(uuid=s.gpu_uuid)]
    gi = _gpu_instance(s.mig)
    if gi is not None:
        keys.append(GpuKey(index=s.gpu_index, gpu_instance=gi))
    if s.mig is not None and mig_uuid:
        keys.append(GpuKey(uuid=mig_uuid))
    found: list[JobEntry] = []
    for k in keys:
        found.extend(table.get(k, ()))
    return found


class MappingDirMapper:
    """JobMapper reading a prolog-written mapping directory on every ``map`` call.

    Shared GPUs get equal ``job_shares``: the files say who holds a GPU, not how much of it each
    uses. A missing directory is logged once (until it reappears) and means "no jobs".
    """

    def __init__(self, path: str | Path, format: Format = "auto",
                 mig_uuids: Callable[[], Mapping[tuple[str, str], str]] | None = None) -> None:
        if format not in _FORMATS:
            raise ValueError(f"unknown mapping format {format!r}; known: {', '.join(_FORMATS)}")
        self.path = Path(path)
        self.format: Format = format
        self.mig_uuids = mig_uuids  # (GPU UUID, mig) -> MIG UUID: the source's (NvmlSource.mig_uuids)
        self._missing_logged = False
        self._uids: dict[str, int | None] = {}
        self._uuids: dict[str, set[str]] = {}

    def _table(self) -> dict[GpuKey, tuple[JobEntry, ...]]:
        try:
            table = read_mapping_dir(self.path, self.format)
        except OSError as e:  # missing, not a directory, no permission
            if not self._missing_logged:
                log.warning("job mapping dir %s unreadable (%s): no jobs until it appears", self.path, e)
                self._missing_logged = True
            return {}
        self._missing_logged = False
        return table

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        table = self._table()
        uids: dict[str, int | None] = {}
        uuids: dict[str, set[str]] = {}
        out: list[GpuSample] = []
        mig_uuids = self.mig_uuids() if self.mig_uuids is not None and any(s.mig for s in samples) else {}
        for s in samples:
            entries = jobs_for_sample(table, s, mig_uuids.get((s.gpu_uuid, s.mig or "")))
            if not entries:
                out.append(s)
                continue
            for e in entries:
                if uids.get(e.job_id) is None:
                    uids[e.job_id] = e.uid
                uuids.setdefault(e.job_id, set()).add(s.gpu_uuid)
            jobs = sorted_job_ids({e.job_id for e in entries})
            shares = split_shares(jobs, None) if len(jobs) > 1 else ()
            out.append(replace(s, job_ids=jobs, job_shares=shares))
        self._uids, self._uuids = uids, uuids
        return out

    def job_metadata(self) -> dict[str, JobRecord]:
        """A JobRecord per job of the last ``map`` call: its uid (jobstats format) and GPUs."""
        return {
            j: JobRecord(job_id=j, uid=self._uids.get(j), gpu_uuids=tuple(sorted(self._uuids[j])))
            for j in sorted_job_ids(self._uuids.keys())
        }


__all__ = [
    "GpuKey",
    "JobEntry",
    "MappingDirMapper",
    "jobs_for_sample",
    "parse_auto_mapping",
    "parse_dcgm_mapping",
    "parse_jobstats_mapping",
    "parse_mapping_name",
    "read_mapping_dir",
]
