"""The job mapper protocol: which job(s) hold each GPU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gpuledger.schema.records import GpuSample


@runtime_checkable
class JobMapper(Protocol):
    def map(self, samples: Sequence[GpuSample]) -> list[GpuSample]:
        """Return the samples with ``job_ids`` (and ``job_shares`` where known) filled in.

        Records are immutable: return new ones (``dataclasses.replace``). Never raises for one
        unreadable process or file: that GPU simply gets no job from this mapper.
        """
