"""The GPU source protocol: one small boundary per kind of telemetry backend."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuledger.schema.records import GpuSample


class SourceUnavailable(RuntimeError):
    """The source cannot run on this host (library, driver, bindings or endpoint missing), or cannot reach what it
    reads at a sample (dcgm-exporter, nv-hostengine): an operational failure, logged in one line; says why."""


@runtime_checkable
class GpuSource(Protocol):
    name: str

    def open(self) -> None:
        """Acquire handles; raise SourceUnavailable with the reason when the backend is absent."""

    def sample(self) -> list[GpuSample]:
        """One reading per GPU (and per MIG instance). Never raises for one bad GPU."""

    def close(self) -> None: ...
