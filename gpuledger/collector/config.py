"""The collector's settings: the ``[collector]`` table of ``gpuledger.toml``, validated by pydantic.

Precedence, lowest first: defaults, the file (``<data-dir>/gpuledger.toml`` or ``--config``), environment
variables ``GPULEDGER_COLLECTOR_<SETTING>`` (for example ``GPULEDGER_COLLECTOR_PORT=8471``), command-line flags.
Example::

    [collector]
    host = "0.0.0.0"
    port = 8470
    window_s = 600                 # a late sample may trail its GPU's newest by this much and still count
    max_gap_s = 60                 # longer silences between two samples are gaps: not observed usage (a few of
                                   # the agents' sampling intervals: raise it with the agents' --interval)
    power_cap_w = 1500             # the most a GPU can draw when its sample reports no power limit; a counter
                                   # delta above cap x seconds is not trusted (see collector.aggregate)
    workers = 1                    # ingest processes sharing the port and the ledger (SO_REUSEPORT; "auto": one
                                   # per CPU this process may use, at most 8); max_inflight, max_per_host and the
                                   # connection limit are each worker's
    max_body_bytes = 16777216      # decoded request body limit
    max_inflight = 256             # ingest requests validating or storing at once (per worker); more get 503
    max_per_host = 4               # concurrent ingest requests of one node token (per worker); more get 429
    request_timeout_s = 30         # headers and body of one request, however slowly they arrive
    ledger_timeout_s = 8           # a batch's wait for its commit (and a read's behind a stalled one); then 503,
                                   # and /healthz says 503 until that commit ends (a commit may still finish: the
                                   # agent's resend is then a duplicate); keep it under the agents' timeout (10 s)
    idle_timeout_s = 120           # a keep-alive connection idle this long is closed
    max_samples = 20000            # per batch; further limits: max_series, max_job_ids (per series),
    max_job_ids = 64               # max_batch_job_ids, max_jobs, max_str (characters), max_list, max_job_hosts
    max_batch_list = 256000        # processes, and Xid errors, in one batch (all its samples together), and the
                                   # hosts of its job records; more: 413
    max_series_points = 10000      # GET /api/v1/series picks a coarser step rather than answer more points
    max_page = 10000               # GET /api/v1/jobs and /usage: most rows an answer holds (then ?offset=)
    metrics_user_labels = false    # publish user names in /metrics (the fairshare gauges); /metrics is open
    metrics_port = 8471            # /metrics also here (plain HTTP, GET /metrics only), answered by threads of
                                   # its own while a saturated event loop queues requests; unset: none
    max_gpus_per_host = 256        # GPUs and MIG instances one host may have; more get 422 (gpu_limit)
    dedupe_horizon_s = 604800      # batch keys kept this long (pruned at compaction): an agent's spool must
                                   # deliver within it, or a batch resent later is counted twice
    series_url = "http://vm.example.org:8428"  # series in VictoriaMetrics (single node; run it with
                                   # -dedup.minScrapeInterval=1ms -search.latencyOffset=0s, docs/deploy.md):
                                   # every sample is shipped there at least once, GET /api/v1/series reads it,
                                   # and the local store keeps raw samples for raw_retention_s (default then the
                                   # window plus an hour) and rollups briefly. Unset: the local store holds all.
    series_api = "victoriametrics" # what series_url is: "victoriametrics" (the default) or "influxdb" (InfluxDB
    series_database = "gpuledger"  # 1.x, /write and /query; the database must exist): the sink's measurements
                                   # gpu and gpu_job, which InfluxDB overwrites when resent (docs/deploy.md)
    tls_cert = "/etc/gpuledger/collector.crt"   # both or neither; relative paths are relative to this file
    tls_key = "/etc/gpuledger/collector.key"
    tokens_file = "/etc/gpuledger/tokens.toml"  # same keys as below; keeps secrets out of this file
    admin_tokens = ["..."]         # may read everything and POST /api/v1/jobs
    read_tokens = ["..."]          # may GET the query endpoints
    [collector.tokens]             # node tokens: each may write only its own host's samples
    "node01" = "..."               # a batch names its cluster (any), or none
    "gpu01" = { token = "...", cluster = "west" }  # bound to a cluster too: a batch naming another is refused
                                   # (403), one naming none is that cluster's
    [collector.power_caps]         # per GPU model (exact name, else the longest contained pattern), watts
    "A100" = 400
    "H200" = 700

``window_s``, ``max_gap_s``, ``dedupe_horizon_s``, ``power_cap_w``, ``power_caps`` and the tiers' retention are the
ledger's: every collector and compactor on one ledger must have the values it records (``store.AGREED_SETTINGS``;
``gpuledger collector set-settings`` changes them). The retention agreed is what the local store applies
(:meth:`CollectorSettings.retention`): with ``series_url``, the one it derives (raw samples for the window plus an
hour unless ``raw_retention_s`` is set, rollups an hour), so every process on a ledger sets ``series_url`` or none.

With no token configured at all, authentication is off (the demo and a single-host setup run that way);
``/healthz``, ``/metrics`` and ``/api/v1/openapi.json`` are always open.

Other tables of the same file belong to other parts and are not read here: ``[ledger]`` (where the ledger is,
``collector.ledger_url``), ``[accounting]``, ``[accounts]``, ``[report]``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuledger.collector.aggregate import DEFAULT_MAX_GAP_S, DEFAULT_POWER_CAP_W
from gpuledger.collector.limits import (
    IDLE_TIMEOUT_S,
    LEDGER_TIMEOUT_S,
    MAX_PAGE,
    MAX_PER_HOST,
    MAX_SERIES_POINTS,
    REQUEST_TIMEOUT_S,
)
from gpuledger.collector.series_outbox import local_retention
from gpuledger.collector.series_store import Retention
from gpuledger.collector.store import DEDUPE_HORIZON_S, MAX_GPUS_PER_HOST
from gpuledger.collector.validate import CLUSTER_RULE, DEFAULT_LIMITS, MAX_BODY_BYTES, Limits, is_cluster_name
from gpuledger.schema.text import NotText, ascii_int, read_text

CONFIG_NAME = "gpuledger.toml"
ENV_PREFIX = "GPULEDGER_COLLECTOR_"
MIN_TOKEN_CHARS = 16  # a guessable token is no authentication
# Settings an environment variable may override (the token tables are files' business, not the environment's).
MAX_AUTO_WORKERS = 8  # workers = "auto": one per usable CPU, up to this many (each is a whole collector's memory)


class ConfigError(ValueError):
    """The configuration is missing or invalid; the message names the file and the setting."""


class NodeToken(BaseModel):
    """A node token bound to a cluster as well as to its host (``"gpu01" = { token = "...", cluster = "west" }``):
    its batches may name that cluster or none (then they are that cluster's), never another."""

    model_config = ConfigDict(frozen=True, hide_input_in_errors=True)

    token: str = Field(repr=False)  # a logged setting never shows it
    cluster: str


def node_token(entry: str | NodeToken) -> str:
    """The token of a ``[collector.tokens]`` entry (a plain string binds the host only)."""
    return entry if isinstance(entry, str) else entry.token


class TokenTables(BaseModel):
    """What a tokens file holds (and the token part of the ``[collector]`` table)."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # an error never shows a token

    tokens: dict[str, str | NodeToken] = {}
    admin_tokens: list[str] = []
    read_tokens: list[str] = []

    @field_validator("tokens", mode="before")
    @classmethod
    def _node_tokens(cls, v: Any) -> Any:
        # checked here, before pydantic tries str, then NodeToken: a bad table gets one error, not one per type
        if not isinstance(v, dict):
            return v  # no table: pydantic's own error says so
        out: dict[str, str | NodeToken] = {}
        for host, entry in v.items():
            if not host:
                raise ValueError("a node token needs a non-empty host name")
            if isinstance(entry, NodeToken):  # merged with a tokens file's: checked again
                entry = entry.model_dump()
            if isinstance(entry, dict):
                if set(entry) != {"token", "cluster"}:
                    raise ValueError(f'the token of {host!r} must be a string or a table {{ token = "...", '
                                     f'cluster = "..." }}, got a table with keys {sorted(map(str, entry))}')
                token, cluster = entry["token"], entry["cluster"]
                if not (cluster and is_cluster_name(cluster)):
                    raise ValueError(f"the cluster of {host!r}'s token must be non-empty, {CLUSTER_RULE}, "
                                     f"got {cluster!r}")
                _check_token(token, f"token of {host!r}")
                out[host] = NodeToken(token=token, cluster=cluster)
            else:
                _check_token(entry, f"token of {host!r}")
                out[host] = entry
        return out

    @field_validator("admin_tokens", "read_tokens")
    @classmethod
    def _role_tokens(cls, v: list[str]) -> list[str]:
        for i, token in enumerate(v):
            _check_token(token, f"token #{i}")
        return v


def _check_token(token: Any, what: str) -> None:
    if not isinstance(token, str):
        raise ValueError(f"{what} must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS or token != token.strip():
        raise ValueError(f"{what} must be at least {MIN_TOKEN_CHARS} characters without surrounding blanks")
    if not (token.isascii() and token.isprintable()):
        # a header's bytes are read as latin-1 and a token hashed as UTF-8: any other character could never match
        raise ValueError(f"{what} must be printable ASCII (it travels in an HTTP header)")


def auto_workers() -> int:
    """``workers = "auto"``: the CPUs this process may run on (its affinity, not the machine's count), at most
    MAX_AUTO_WORKERS."""
    return min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS)


class CollectorSettings(TokenTables):
    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535)
    # ingest processes on one port and one ledger (collector.supervisor); 1: `collector serve` is one process
    workers: int = 1
    # the ledger's settings (store.AGREED_SETTINGS) are finite: the ledger records no infinity
    window_s: float = Field(600.0, ge=0, allow_inf_nan=False)
    max_gap_s: float = Field(DEFAULT_MAX_GAP_S, gt=0, allow_inf_nan=False)
    power_cap_w: float = Field(DEFAULT_POWER_CAP_W, gt=0, allow_inf_nan=False)
    power_caps: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(default_factory=dict)
    max_body_bytes: int = Field(MAX_BODY_BYTES, gt=0)
    max_inflight: int = Field(256, gt=0)
    max_per_host: int = Field(MAX_PER_HOST, gt=0)
    request_timeout_s: float = Field(REQUEST_TIMEOUT_S, gt=0, allow_inf_nan=False)
    ledger_timeout_s: float = Field(LEDGER_TIMEOUT_S, gt=0, allow_inf_nan=False)
    idle_timeout_s: float = Field(IDLE_TIMEOUT_S, gt=0, allow_inf_nan=False)
    max_samples: int = Field(DEFAULT_LIMITS.max_samples, gt=0)
    max_series: int = Field(DEFAULT_LIMITS.max_series, gt=0)
    max_job_ids: int = Field(DEFAULT_LIMITS.max_job_ids, gt=0)
    max_batch_job_ids: int = Field(DEFAULT_LIMITS.max_batch_job_ids, gt=0)
    max_jobs: int = Field(DEFAULT_LIMITS.max_jobs, gt=0)
    max_str: int = Field(DEFAULT_LIMITS.max_str, gt=0)
    max_list: int = Field(DEFAULT_LIMITS.max_list, gt=0)
    max_job_hosts: int = Field(DEFAULT_LIMITS.max_job_hosts, gt=0)
    max_batch_list: int = Field(DEFAULT_LIMITS.max_batch_list, gt=0)
    max_series_points: int = Field(MAX_SERIES_POINTS, gt=0)
    max_page: int = Field(MAX_PAGE, gt=0)
    metrics_user_labels: bool = False
    metrics_port: int | None = Field(None, ge=0, le=65535)
    dedupe_horizon_s: float = Field(DEDUPE_HORIZON_S, gt=0, allow_inf_nan=False)
    max_gpus_per_host: int = Field(MAX_GPUS_PER_HOST, gt=0)
    tokens_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    priority_feed: Path | None = None  # default: <data-dir>/priority-feed.json
    # Series in VictoriaMetrics or InfluxDB 1.x (collector.series_outbox, collector.victoriametrics,
    # collector.influxdb); unset: the local store.
    series_url: str | None = None
    series_api: Literal["victoriametrics", "influxdb"] = "victoriametrics"
    series_database: str = Field("gpuledger", min_length=1)  # InfluxDB's database (series_api = "influxdb")
    # Tiers (seconds; 0 = keep for good, except raw samples; the ledger's, as retention() makes them) and the
    # background compaction that applies them.
    raw_retention_s: float = Field(7 * 86400.0, gt=0, allow_inf_nan=False)
    minute_retention_s: float = Field(90 * 86400.0, ge=0, allow_inf_nan=False)
    hour_retention_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    compact_interval_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    # "process": compaction in a child process (collector.compactor), off ingest's GIL and memory; "thread": in the
    # collector's own process (one process, e.g. where a service manager counts them)
    compaction: Literal["process", "thread"] = "process"
    # InfluxDB sink (off unless influx_url is set): api "v2" (2.x, 3.x, 1.8+, VictoriaMetrics) or "v1" (/write).
    influx_url: str | None = None
    influx_api: Literal["v1", "v2"] = "v2"
    influx_database: str = "gpuledger"
    influx_bucket: str = "gpuledger"
    influx_org: str = "gpuledger"
    influx_token: str = ""

    def limits(self) -> Limits:
        return Limits(**{f: getattr(self, f) for f in Limits.__dataclass_fields__})

    def retention(self) -> Retention:
        """The tiers the local store keeps, as the ledger records and compares them (store.RETENTION_SETTINGS)."""
        if self.series_url:  # the series database keeps the series: locally only what restores need
            return local_retention(self.window_s,
                                   self.raw_retention_s if "raw_retention_s" in self.model_fields_set else None)
        return Retention(raw_s=self.raw_retention_s, minute_s=self.minute_retention_s or None,
                         hour_s=self.hour_retention_s or None)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int:
        if v == "auto":
            return auto_workers()
        if isinstance(v, str) and (n := ascii_int(v.strip())) is not None:  # from the environment or --workers
            v = n
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f'must be a whole number of processes, at least 1, or "auto", got {v!r}')
        return v

    @field_validator("series_url")
    @classmethod
    def _series_url(cls, v: str | None) -> str | None:
        if not v:
            return None
        parts = urlsplit(v.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"must be the series database's base URL, http(s)://host:port (a path prefix "
                             f"allowed; InfluxDB's database is series_database), got {v!r}")
        return v.strip().rstrip("/")

    def sinks(self) -> list[Any]:
        sink = self.influx_sink()
        return [] if sink is None else [sink]

    def influx_sink(self, **options: Any) -> Any:
        """The configured InfluxDB sink (None without ``influx_url``); ``options`` tune InfluxSink (retries, ...)."""
        if not self.influx_url:
            return None
        from gpuledger.collector.sinks.influx import InfluxSink

        return InfluxSink(self.influx_url, self.influx_api, database=self.influx_database, bucket=self.influx_bucket,
                          org=self.influx_org, token=self.influx_token, **options)

    @model_validator(mode="after")
    def _consistent(self) -> CollectorSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.workers > 1 and self.compaction == "thread":
            raise ValueError(f'compaction = "thread" compacts in the collector\'s one process: it needs workers = 1, '
                             f'not {self.workers} (the default, "process", runs one compactor for all workers)')
        for key in ("series_api", "series_database"):
            if key in self.model_fields_set and not self.series_url:
                raise ValueError(f"{key} is set but series_url is not: set both (or neither)")
        if "series_database" in self.model_fields_set and self.series_api != "influxdb":
            raise ValueError('series_database names an InfluxDB database: it needs series_api = "influxdb"')
        try:
            self.retention().check(self.window_s)
        except ValueError as e:
            raise ValueError(f"retention: {e}") from None
        seen: dict[str, str] = {}
        roles = [(node_token(t), f"node {h!r}") for h, t in self.tokens.items()]
        roles += [(t, "admin") for t in self.admin_tokens] + [(t, "read") for t in self.read_tokens]
        for token, role in roles:
            if token in seen:  # one token with two roles would make the caller's rights ambiguous
                raise ValueError(f"the same token is configured for {seen[token]} and {role}")
            seen[token] = role
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens or self.admin_tokens or self.read_tokens)


def _errors(e: ValidationError, prefix: str) -> str:
    return "; ".join(f"{prefix}{'.'.join(map(str, err['loc'])) or '(table)'}: {err['msg']}" for err in e.errors())


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except NotText as e:
        raise ConfigError(str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


# Every scalar setting may come from the environment (the token tables and other tables go in the files)
ENV_SETTINGS: tuple[str, ...] = tuple(n for n, f in CollectorSettings.model_fields.items()
                                      if n not in TokenTables.model_fields
                                      and getattr(f.annotation, "__origin__", None) not in (dict, list))


def load_settings(
    data_dir: Path,
    config: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> CollectorSettings:
    """Settings from the file, then the environment, then ``overrides`` (CLI flags; None values are skipped)."""
    env = os.environ if env is None else env
    path = config if config is not None else data_dir / CONFIG_NAME
    raw: dict[str, Any] = {}
    if config is not None or path.exists():
        table = read_toml(path).get("collector", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [collector] must be a table")
        raw = dict(table)
        # Paths in the file are relative to the file; those from the environment or flags to the working directory.
        for key in ("tokens_file", "tls_cert", "tls_key", "priority_feed"):
            if isinstance(raw.get(key), str):
                raw[key] = path.parent / raw[key]
    origin: dict[str, str] = {}  # a setting not from the file -> where it came from, for the error that names it
    for name in ENV_SETTINGS:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            raw[name] = value
            origin[name] = f"environment {ENV_PREFIX + name.upper()}"
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() not in ENV_SETTINGS)
    if unknown:  # a misspelt one would otherwise be ignored without a word
        raise ConfigError(f"environment: {', '.join(unknown)}: no such collector setting (known: "
                          f"{', '.join(ENV_PREFIX + n.upper() for n in ENV_SETTINGS)})")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    raw.update(given)
    origin.update({k: f"command line ({k})" for k in given})
    try:
        settings = CollectorSettings.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("; ".join(
            f"{origin.get(str(err['loc'][0]) if err['loc'] else '', path)}: collector."
            f"{'.'.join(map(str, err['loc'])) or '(table)'}: {err['msg']}" for err in e.errors())) from None
    if settings.tokens_file is not None:
        settings = _merge_tokens_file(settings, settings.tokens_file)
    return settings


def _merge_tokens_file(settings: CollectorSettings, tokens_file: Path) -> CollectorSettings:
    try:
        extra = TokenTables.model_validate(read_toml(tokens_file))
    except ValidationError as e:
        raise ConfigError(f"{tokens_file}: {_errors(e, '')}") from None
    # what was set, only: validators that tell a setting from its default (model_fields_set) see the same again
    merged = settings.model_dump(exclude_unset=True)
    clash = set(settings.tokens) & set(extra.tokens)
    if clash:
        raise ConfigError(f"{tokens_file}: node(s) {sorted(clash)} also have a token in the [collector] table")
    merged["tokens"] = {**settings.tokens, **extra.tokens}
    merged["admin_tokens"] = settings.admin_tokens + extra.admin_tokens
    merged["read_tokens"] = settings.read_tokens + extra.read_tokens
    try:
        return CollectorSettings.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(f"{tokens_file}: {_errors(e, '')}") from None
