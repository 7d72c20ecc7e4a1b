"""A job mapper from a fixed (but changeable) table: GPU UUID or index -> job id(s).

For demos, tests and hosts without a scheduler. Keys may be a GPU UUID, a MIG instance's own UUID (matched when
the mapper is given ``mig_uuids``, the NVML source's) or a GPU index; an all-digit string key counts as an index
because TOML table keys are always strings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from gpuledger.schema.records import GpuSample
from gpuledger.schema.text import ascii_int

GpuKey = str | int


def _normalise_key(gpu: GpuKey) -> GpuKey:
    if isinstance(gpu, bool):
        raise TypeError(f"static mapper: GPU key must be a UUID or an index, got {gpu!r}")
    if isinstance(gpu, int):
        if gpu < 0:
            raise ValueError(f"static mapper: GPU index must be >= 0, got {gpu}")
        return gpu
    if isinstance(gpu, str):
        key = gpu.strip()
        if not key:
            raise ValueError("static mapper: empty GPU key")
        index = ascii_int(key)
        return key if index is None else index
    raise TypeError(f"static mapper: GPU key must be a UUID or an index, got {type(gpu).__name__} {gpu!r}")


def _normalise_jobs(gpu: GpuKey, job_ids: str | Sequence[str]) -> tuple[str, ...]:
    items = [job_ids] if isinstance(job_ids, str) else list(job_ids)
    out: list[str] = []
    for j in items:
        if not isinstance(j, str) or not j.strip():
            raise ValueError(f"static mapper: GPU {gpu!r}: job id must be a non-empty string, got {j!r}")
        if j.strip() not in out:
            out.append(j.strip())
    return tuple(out)


class StaticMapper:
    """Assigns the configured job ids; GPUs absent from the table are passed through unchanged."""

    def __init__(self, mapping: Mapping[GpuKey, str | Sequence[str]] | None = None,
                 mig_uuids: Callable[[], Mapping[tuple[str, str], str]] | None = None) -> None:
        self.mig_uuids = mig_uuids  # (GPU UUID, mig) -> MIG UUID: the source's (NvmlSource.mig_uuids)
        self._lock = threading.Lock()
        self._table: dict[GpuKey, tuple[str, ...]] = {}
        for gpu, jobs in (mapping or {}).items():
            self.set(gpu, jobs)

    def set(self, gpu: GpuKey, job_ids: str | Sequence[str]) -> None:
        """Map a GPU to one or more jobs; an empty sequence is the same as :meth:`clear`."""
        key = _normalise_key(gpu)
        jobs = _normalise_jobs(gpu, job_ids)
        with self._lock:
            if jobs:
                self._table[key] = jobs
            else:
                self._table.pop(key, None)

    def clear(self, gpu: GpuKey) -> None:
        """Forget a GPU's jobs (its samples then carry no job from this mapper)."""
        key = _normalise_key(gpu)
        with self._lock:
            self._table.pop(key, None)

    def table(self) -> dict[GpuKey, tuple[str, ...]]:
        """A copy of the current table."""
        with self._lock:
            return dict(self._table)

    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        with self._lock:
            table = dict(self._table)
        out: list[GpuSample] = []
        mig_uuids = self.mig_uuids() if self.mig_uuids is not None and any(s.mig for s in samples) else {}
        for s in samples:
            jobs = None
            if s.mig is not None and (mig_uuid := mig_uuids.get((s.gpu_uuid, s.mig))) is not None:
                jobs = table.get(mig_uuid)
            if jobs is None:
                jobs = table.get(s.gpu_uuid)
            if jobs is None:
                jobs = table.get(s.gpu_index)
            # Equal split: no shares are known to a static table.
            out.append(s if jobs is None else replace(s, job_ids=jobs, job_shares=()))
        return out
