"""Where the collector copies what it accepted, besides the embedded store (e.g. InfluxDB).

A sink is handed every committed batch's accepted samples and, rate-limited, the per-job usage
summaries. Both calls happen under the store's lock, so a sink only enqueues; the network work runs
in the sink's own thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from gpuledger.schema.records import GpuSample, JobRecord, JobUsage


class Sink(Protocol):
    def write(self, samples: Sequence[GpuSample]) -> None: ...

    def write_job_usage(self, usage: Sequence[JobUsage], jobs: Mapping[str, JobRecord]) -> None: ...

    def close(self) -> None: ...
