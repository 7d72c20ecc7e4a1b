"""The ``dcgm-exporter`` GPU source: scrape an existing NVIDIA dcgm-exporter ``/metrics`` and convert it.

``parse_dcgm_exporter`` is pure (text in, samples out); ``DcgmExporterSource`` only fetches. Conversion
uses the DCGM field table of ``agent.sources.dcgm`` (by metric name): % -> ratio, MiB -> bytes, mJ -> J,
MHz -> Hz; DCGM blank sentinels and NaN become None.

Names: both the metric names of the stock counters (``DCGM_FI_DEV_POWER_USAGE``, ``DCGM_FI_PROF_SM_ACTIVE``,
...) and DCGM 4.6's names of the same fields (``DCGM_FI_DEV_BOARD_POWER_WATTS``, ``DCGM_FI_PROF_SM_UTIL_RATIO``,
...), which an exporter configured with the new names prints, are read (``DcgmField.names``).

Labels: ``UUID`` (``GPU_UUID`` with DCGM 4.6 names) names the GPU (series without it are skipped), ``gpu``
its index, ``modelName`` its model,
``Hostname`` (older exporters) or ``hostname`` (newer) the host unless the caller passes ``host`` -- in
Kubernetes that label is the exporter pod's name, so a caller that knows the node should pass it.

Jobs: with ``--hpc-job-mapping-dir`` the exporter emits one copy of each series per job on that GPU,
labelled ``hpc_job``; all copies become ONE sample whose ``job_ids`` lists every job (never one sample
per job: that would count the GPU several times). Empty ``hpc_job`` values are ignored.

MIG rule (count device values once): series with ``GPU_I_ID`` become one sample per GPU instance
(``mig=GPU_I_ID``, model "<model> MIG <GPU_I_PROFILE>"), carrying the instance's own fields (profiling
ratios, framebuffer, Xid; utilisation is ``GR_ENGINE_ACTIVE``, as ``GPU_UTIL`` reads 0 on a busy instance).
Device-level fields (power, energy, temperature, clocks, PCIe, ECC; ``DcgmField.device_level``) are
repeated by the exporter on every instance of the GPU, with or without a parent row; they are taken off the
instances and put once on the GPU's own sample (``mig=None``) together with any parent row's values, using
the maximum (the copies differ only by read time; for the energy counter the maximum is the latest
reading). That parent sample exists only when some device-level value was seen. ``agent.mig`` then shares
the GPU's power and energy out to its instances, exactly once.

Xid: ``XID_ERRORS`` is the last Xid of the GPU or instance and stays set; ``DcgmExporterSource`` keeps an
``XidLatch`` so a value counts once, when it changes (the pure parser reports none without one).

Start-up check: the stock counters CSV comments out ``PROF_SM_ACTIVE`` and ``PROF_SM_OCCUPANCY``. Without
them SM activity is None everywhere and MIG shares fall back to utilisation or slice size, so ``open()``
warns, naming the counters to enable, and counts the fields ``not_exported``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuledger.agent.sources.base import SourceUnavailable
from gpuledger.agent.sources.dcgm import FIELDS_BY_ID, FIELDS_BY_NAME, XidLatch, convert_fields, dcgm_number
from gpuledger.agent.sources.health import FieldHealth
from gpuledger.schema.records import GpuSample
from gpuledger.schema.text import ascii_int

log = logging.getLogger(__name__)

# SM activity and occupancy (ids 1002, 1003) under either name; without them MIG shares lose their activity.
SM_ACTIVITY_FIELDS = (1002, 1003)


@dataclass
class _Group:
    host: str
    uuid: str
    index: int
    model: str
    mig: str | None
    values: dict[int, float] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)


def _index(labels: dict[str, str]) -> int:
    try:
        return int(labels.get("gpu", "-1"))
    except ValueError:
        return -1


def parse_dcgm_exporter(text: str, host: str | None = None, ts: float | None = None,
                        xids: XidLatch | None = None) -> list[GpuSample]:
    """Convert one dcgm-exporter scrape into GpuSamples (one per GPU, one per MIG GPU instance).

    ``xids`` is the caller's latch of the sticky last-Xid values (without one, no Xid events are reported)."""
    ts = time.time() if ts is None else ts
    xids = xids if xids is not None else XidLatch()
    groups: dict[tuple[str, str, str | None], _Group] = {}

    def group(h: str, uuid: str, labels: dict[str, str], mig: str | None) -> _Group:
        g = groups.get((h, uuid, mig))
        if g is None:
            model = labels.get("modelName", "")
            profile = labels.get("GPU_I_PROFILE")
            if mig is not None and profile:
                model = f"{model} MIG {profile}"
            g = groups[(h, uuid, mig)] = _Group(h, uuid, _index(labels), model, mig)
        return g

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            spec = FIELDS_BY_NAME.get(s.name) or FIELDS_BY_NAME.get(s.name.removesuffix("_total"))
            labels = s.labels
            uuid = labels.get("UUID") or labels.get("uuid") or labels.get("GPU_UUID")
            if spec is None or not uuid:
                continue
            h = host if host is not None else (labels.get("Hostname") or labels.get("hostname") or "")
            mig = labels.get("GPU_I_ID") or None
            inst = group(h, uuid, labels, mig)
            job = labels.get("hpc_job")
            if job and job not in inst.jobs:
                inst.jobs.append(job)
            v = dcgm_number(s.value, spec.double)
            if v is None:
                continue
            target = group(h, uuid, labels, None) if (mig is not None and spec.device_level) else inst
            old = target.values.get(spec.field_id)
            target.values[spec.field_id] = v if old is None else max(old, v)

    out: list[GpuSample] = []
    for (h, uuid, mig), g in groups.items():
        if mig is None and not g.values and not g.jobs and any(k[:2] == (h, uuid) and k[2] for k in groups):
            continue  # a MIG GPU's parent with nothing device-level to carry
        conv = convert_fields(g.values, mig=mig is not None)
        last_xid = conv.pop("_last_xid", None)
        out.append(GpuSample(
            ts=ts, host=h, gpu_uuid=uuid, gpu_index=g.index, model=g.model, mig=mig,
            job_ids=tuple(g.jobs), source="dcgm-exporter", xid_errors=xids.events((h, uuid, mig), last_xid),
            **conv,
        ))
    out.sort(key=lambda s: (s.host, s.gpu_index, s.gpu_uuid, s.mig is not None, _mig_order(s.mig)))
    return out


def missing_sm_activity(text: str) -> tuple[str, ...]:
    """The SM-activity counters (old and DCGM 4.6 names) a scrape lacks: all of them, or ()."""
    names = [n for fid in SM_ACTIVITY_FIELDS for n in FIELDS_BY_ID[fid].names]
    if any(n + "{" in text or n + " " in text for n in names):
        return ()
    return tuple(names)


def _mig_order(mig: str | None) -> tuple[int, str]:
    if mig is None:
        return (-1, "")
    return (n, mig) if (n := ascii_int(mig)) is not None else (1 << 30, mig)


class DcgmExporterSource:
    """Scrapes ``url`` (a dcgm-exporter ``/metrics``); ``fetch(url) -> text`` defaults to an httpx GET."""

    name = "dcgm-exporter"

    def __init__(
        self,
        url: str,
        fetch: Callable[[str], str] | None = None,
        host: str | None = None,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"dcgm-exporter: url must be http(s)://.../metrics, got {url!r}")
        self.url = url
        self.host = host
        self._fetch_arg = fetch
        self._fetch: Callable[[str], str] | None = fetch
        self._timeout_s = timeout_s
        self._clock = clock
        self._client: Any = None
        self._xids = XidLatch()
        self.health = FieldHealth(self.name)

    def _http_fetch(self, url: str) -> str:
        response = self._client.get(url)
        response.raise_for_status()
        return response.text

    def open(self) -> None:
        if self._fetch_arg is None:
            import httpx  # noqa: PLC0415 - only the real fetch needs it

            self._client = httpx.Client(timeout=self._timeout_s)
            self._fetch = self._http_fetch
        try:
            text = self._fetch(self.url)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - any failure to reach the exporter means "unavailable"
            self.close()
            raise SourceUnavailable(f"dcgm-exporter: cannot scrape {self.url}: {type(exc).__name__}: {exc}") from exc
        if "DCGM_FI_" not in text:
            self.close()
            raise SourceUnavailable(f"dcgm-exporter: {self.url} answered, but with no DCGM_FI_* metrics")
        if missing_sm_activity(text):
            log.warning(
                "dcgm-exporter: %s exports no SM activity: sm_active_ratio and sm_occupancy_ratio will be None and "
                "MIG power/energy shares fall back to GR_ENGINE_ACTIVE or slice size. Enable DCGM_FI_PROF_SM_ACTIVE "
                "and DCGM_FI_PROF_SM_OCCUPANCY (DCGM 4.6 names: DCGM_FI_PROF_SM_UTIL_RATIO, "
                "DCGM_FI_PROF_SM_OCCUPANCY_RATIO) in the exporter's counters CSV (-f / --collectors); the stock "
                "default-counters.csv has them commented out", self.url)
            for fid in SM_ACTIVITY_FIELDS:
                self.health.note(self.url, FIELDS_BY_ID[fid].target, "not_exported")

    def sample(self) -> list[GpuSample]:
        if self._fetch is None:
            raise RuntimeError("dcgm-exporter: sample() before open()")
        try:
            text = self._fetch(self.url)
        except Exception as exc:
            raise SourceUnavailable(f"dcgm-exporter: scrape of {self.url} failed: {type(exc).__name__}: {exc}") from exc
        return parse_dcgm_exporter(text, host=self.host, ts=self._clock(), xids=self._xids)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._fetch_arg is None:
            self._fetch = None


__all__ = ["DcgmExporterSource", "missing_sm_activity", "parse_dcgm_exporter"]
