"""What a GPU source could not read, by field and reason: degrade per field, never per GPU.

A field the driver, DCGM or the exporter cannot give is None in the sample and the rest of the sample goes
out. Each (GPU, field) is counted once, under the reason it first became unavailable, so
``unavailable[(field, reason)]`` is the number of GPUs (or MIG instances) that lack that field for that
reason. The agent exports it as ``gpuledger_agent_unavailable_fields{field, reason}``.

Reasons (Prometheus label values): ``function_not_found`` (the driver lacks the function),
``library_mismatch`` (nvidia-ml-py and the driver disagree on a versioned function), ``not_supported``,
``no_permission`` (the agent is not root), ``unknown_field`` (the installed DCGM does not know the field
id), ``watch_failed`` (DCGM refused to watch it, e.g. profiling not supported), ``not_exported`` (the
dcgm-exporter's counters CSV leaves it out), ``not_a_number`` (a NaN or infinite reading).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_MAX_KEYS = 65536  # (GPU, field) pairs remembered; bounded so a churning GPU set cannot grow memory


class FieldHealth:
    """Counts, once per (GPU, field), the fields a source could not read and why; logs each first time."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.unavailable: dict[tuple[str, str], int] = {}
        self._seen: set[tuple[str, str]] = set()

    def note(self, gpu: str, field: str, reason: str, detail: str = "") -> bool:
        """Record that ``gpu`` cannot give ``field``; True the first time for that (gpu, field)."""
        key = (gpu, field)
        if key in self._seen:
            return False
        if len(self._seen) < _MAX_KEYS:
            self._seen.add(key)
        self.unavailable[(field, reason)] = self.unavailable.get((field, reason), 0) + 1
        log.info("%s: GPU %s: %s unavailable (%s)%s; that field is None, the rest of the sample goes out",
                 self.source, gpu, field, reason, f": {detail}" if detail else "")
        return True

    def forget(self, gpu: str) -> None:
        """A GPU was re-opened or reconfigured: what it lacked may be back, so it is asked again."""
        for key in [k for k in self._seen if k[0] == gpu]:
            self._seen.discard(key)


__all__ = ["FieldHealth"]
