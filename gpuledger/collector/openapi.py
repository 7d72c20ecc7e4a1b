"""The collector's OpenAPI 3.1 description, served at ``GET /api/v1/openapi.json``.

Written by hand (the server is the standard library's, no framework derives it), except the record schemas,
which are built from the record dataclasses and the validator's bounds so that they cannot drift from what
the collector accepts. A test checks that every route the server answers is described here and vice versa.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from gpuledger.collector.validate import FUTURE_SLACK_S, MAX_FLOAT, MAX_INT
from gpuledger.schema.records import INT_FIELDS, NONNEG_FIELDS, RATIO_FIELDS, GpuSample, JobRecord, JobUsage
from gpuledger.schema.wire import COLUMNS, ROW_LISTS, SERIES_CONSTANTS

API_VERSION = "1"
_REF = "#/components/schemas/"


def _annotation_schema(annotation: str) -> dict[str, Any]:
    if annotation.endswith(" | None"):
        inner = _annotation_schema(annotation[: -len(" | None")])
        return {"oneOf": [inner, {"type": "null"}]}
    if annotation == "str":
        return {"type": "string"}
    if annotation == "int":
        return {"type": "integer", "minimum": -MAX_INT - 1, "maximum": MAX_INT}
    if annotation == "float":
        return {"type": "number", "minimum": -MAX_FLOAT, "maximum": MAX_FLOAT}
    if annotation == "bool":
        return {"type": "boolean"}
    if annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        return {"type": "array", "items": _annotation_schema(annotation[len("tuple["): -len(", ...]")])}
    if annotation == "tuple[str, float]":
        return {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "minItems": 2, "maxItems": 2}
    if annotation == "tuple[float, float, tuple[str, ...]]":  # a requeued job's earlier run: start, end, hosts
        return {"type": "array", "prefixItems": [_annotation_schema("float"), _annotation_schema("float"),
                                                 _annotation_schema("tuple[str, ...]")], "minItems": 3, "maxItems": 3}
    raise TypeError(f"openapi: no schema for the annotation {annotation!r}")  # a new record shape: describe it


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [schema, {"type": "null"}]}


def sample_schema() -> dict[str, Any]:
    """GpuSample's wire form with the collector's rules (ratios in 0..1, non-negative readings, bounds)."""
    props: dict[str, Any] = {}
    for f in fields(GpuSample):
        name, ann = f.name, str(f.type)
        if name in RATIO_FIELDS:
            s = _nullable({"type": "number", "minimum": 0, "maximum": 1})
        elif name in NONNEG_FIELDS:
            s = _nullable({"type": "number", "minimum": 0, "maximum": MAX_FLOAT})
        elif name in INT_FIELDS:
            s = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_INT})
        elif name == "ts":
            s = {"type": "number", "exclusiveMinimum": 0,
                 "description": f"unix seconds; at most {FUTURE_SLACK_S:.0f} s ahead of the collector's clock"}
        elif name == "gpu_index":
            s = {"type": "integer", "minimum": 0, "maximum": MAX_INT}
        elif name in ("host", "gpu_uuid"):
            s = {"type": "string", "minLength": 1}
        elif name == "mig":
            s = _nullable({"type": "string", "minLength": 1})
        elif name == "processes":
            s = {"type": "array", "items": {
                "type": "array", "minItems": 2, "maxItems": 3,
                "description": "[pid, used_memory_bytes or null, gpu_util_ratio or null (optional): the share of the "
                               "sampling interval in which the process's kernels ran]",
                "prefixItems": [{"type": "integer", "minimum": 0},
                                _nullable({"type": "integer", "minimum": 0, "maximum": MAX_INT}),
                                _nullable({"type": "number", "minimum": 0, "maximum": 1})]}}
        elif name == "job_ids":
            s = {"type": "array", "uniqueItems": True, "items": {"type": "string", "minLength": 1}}
        elif name == "job_shares":
            s = {"type": "array", "items": {"type": "number", "minimum": 0},
                 "description": "one share per job id, summing to 1; empty: split equally"}
        elif name == "xid_errors":
            s = {"type": "array", "items": {"type": "integer"}}
        else:
            s = _annotation_schema(ann)
        props[name] = s
    required = [f.name for f in fields(GpuSample) if f.default is MISSING and f.default_factory is MISSING]
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props,
            "description": "One reading of one GPU or MIG instance, in SI base units; null: not reported."}


def series_schema() -> dict[str, Any]:
    """The columnar layout (``agent.wire``): one GPU's samples as constants plus one column per field."""
    sample = sample_schema()["properties"]
    props: dict[str, Any] = {k: sample[k] for k in SERIES_CONSTANTS}
    binary = {"type": "string", "contentMediaType": "application/octet-stream",
              "description": "msgpack only (bin): n little-endian 8-byte values (float64, int64 for integer "
                             "fields), no gaps; NaN and infinities are invalid"}
    for f in COLUMNS:
        item = sample[f]
        props[f] = {"oneOf": [{"type": "array", "items": item, "description": "n values (null: not reported)"},
                              binary],
                    "description": f"the column of {f}, one value per sample"}
    for f in ROW_LISTS:
        props[f] = {"type": "array", "items": sample[f], "description": f"one {f} list per sample"}
    return {"type": "object", "additionalProperties": False, "required": ["gpu_uuid", "gpu_index", "ts"],
            "properties": props,
            "description": "One GPU's (or MIG instance's) samples of a batch: sample j has the batch's host, the "
                           "series' constants and value j of every column; every column has as many values as ts "
                           "(at least one)."}


def _record_schema(cls: type, required: list[str]) -> dict[str, Any]:
    props = {f.name: _annotation_schema(str(f.type)) for f in fields(cls)}
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF + "Error"}}}}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_BODY_TYPES = ("application/json", "application/msgpack")
_AUTH_ERRORS = {"401": _error("No valid bearer token (auth on)."),
                "403": _error("The token lacks the right (role, another host's samples, or a cluster other than "
                              "the token's).")}
_SECURED: list[dict[str, list[str]]] = [{"bearer": []}]
# what an endpoint that waits on the store answers while a commit stalls (collector.server: ledger_timeout_s)
_STALLED = "the ledger has not committed for longer than ledger_timeout_s (ledger_stalled)"
_STALLED_ERROR = {"503": _error(f"Waiting on the store: {_STALLED}; retry later.")}
# GET /api/v1/jobs and /usage: the collector reads just the page asked for (in SQL)
_PAGE_PARAMS: list[dict[str, Any]] = [
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1},
     "description": "rows in this answer (at most the collector's max_page); X-Total-Count says how many there are, "
                    "X-Next-Offset where the next page starts"},
    {"name": "offset", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0}},
]


def _body(ref: str) -> dict[str, Any]:
    return {
        "required": True,
        "description": "JSON or msgpack (the same structure); Content-Encoding gzip or zstd optional.",
        "content": {t: {"schema": {"$ref": _REF + ref}} for t in _BODY_TYPES},
    }


def openapi_document() -> dict[str, Any]:
    """The whole document, built fresh on each call (so a caller may change its copy)."""
    usage_schema = _record_schema(JobUsage, ["job_id", "host", "gpu_uuid"])
    usage_schema["properties"]["efficiency"] = _nullable({"type": "number"})
    usage_schema["properties"]["mem_used_peak_bytes"] = _nullable({"type": "integer"})
    rejected = {"400": _error("Malformed or invalid: the message names the batch, the sample and the field."),
                "411": _error("Content-Length missing."), "413": _error("Body (or decompressed body) too large."),
                "415": _error("Unsupported Content-Type or Content-Encoding.")}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpuledger collector",
            "version": API_VERSION,
            "description": "Ingest of GPU samples from node agents; per-job usage, job records, totals and the "
                           "priority feed. With tokens configured, node tokens write their own host's samples, "
                           "read-only tokens read, admin tokens read and write job records; without tokens "
                           "authentication is off.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "GpuSample": sample_schema(),
                "GpuSeries": series_schema(),
                "Batch": {
                    "type": "object", "additionalProperties": False,
                    "required": ["agent_id", "seq", "host"],
                    "oneOf": [{"required": ["series"]}, {"required": ["samples"]}],
                    "description": "Exactly one of series (columns per GPU: what agents send) and samples (one "
                                   "object a sample: simple clients).",
                    "properties": {
                        "agent_id": {"type": "string", "minLength": 1},
                        "seq": {"type": "integer", "minimum": 0, "maximum": MAX_INT,
                                "description": "(agent_id, seq) identifies a batch: a batch seen before is "
                                               "acknowledged and not stored again"},
                        "host": {"type": "string", "minLength": 1, "description": "every sample's host"},
                        "cluster": {"type": "string", "maxLength": 256,
                                    "description": "optional: the Slurm cluster the host is in (jobs are "
                                                   "(cluster, job_id)); absent or empty = not named"},
                        "samples": {"type": "array", "items": {"$ref": _REF + "GpuSample"}},
                        "series": {"type": "array", "items": {"$ref": _REF + "GpuSeries"}},
                        "jobs": {"type": "array", "items": {"$ref": _REF + "JobRecord"},
                                 "description": "optional: metadata of jobs on this host (user, account, GPUs); "
                                                "each must list the batch's host in hosts (one without hosts "
                                                "is left out), and is kept only for a job whose samples came "
                                                "from the host; the scheduler's record of a job always wins"},
                    },
                },
                "IngestResult": {
                    "type": "object", "required": ["accepted", "duplicate", "duplicate_samples", "too_late"],
                    "properties": {
                        "accepted": {"type": "integer", "minimum": 0},
                        "duplicate": {"type": "boolean", "description": "the batch was seen before"},
                        "duplicate_samples": {"type": "integer", "minimum": 0},
                        "too_late": {"type": "integer", "minimum": 0,
                                     "description": "samples older than the late-arrival window"},
                    },
                },
                "JobRecord": _record_schema(JobRecord, ["job_id"]),
                "JobRecordList": {"type": "array", "items": {"$ref": _REF + "JobRecord"}},
                "JobUsage": usage_schema,
                "Totals": {"type": "object",
                           "required": ["samples", "gpus", "energy_joules", "hours_start", "hours_end"],
                           "properties": {"start": _nullable({"type": "number"}), "end": _nullable({"type": "number"}),
                                          **{n: {**_nullable({"type": "number"}), "description": d} for n, d in (
                                              ("hours_start", "the first hour bucket summed (its start, unix "
                                                              "seconds; null: unbounded)"),
                                              ("hours_end", "the hour bucket the sum stops before (null: "
                                                            "unbounded)"))},
                                          "gpus": {"type": "integer"}, "samples": {"type": "integer"},
                                          "observed_gpu_seconds": {"type": "number"},
                                          "allocated_gpu_seconds": {"type": "number"},
                                          "sm_active_gpu_seconds": {"type": "number"},
                                          "energy_joules": {"type": "number"},
                                          "jobs_measured": {"type": "integer", "description": (
                                              "jobs whose measured span on a GPU (first to last sample) reaches "
                                              "into the hours summed")}}},
                "PriorityFeed": {
                    "type": "object", "required": ["associations"],
                    "description": "Written by `gpuledger priority feed` (accounting); served as is.",
                    "properties": {
                        "generated_at": {"type": "number"}, "priority_weight": {"type": "integer"},
                        "associations": {"type": "array", "items": {
                            "type": "object", "required": ["account", "user", "fairshare", "site_factor"],
                            "properties": {"account": {"type": "string"}, "user": {"type": "string"},
                                           "fairshare": {"type": "number", "minimum": 0, "maximum": 1},
                                           "site_factor": {"type": "integer"}}}},
                    },
                },
                "Error": {"type": "object", "required": ["error"], "properties": {
                    "error": {"type": "string"},
                    "reason": {"type": "string", "description": "machine-readable: malformed, too_large, invalid, "
                               "future, forbidden, overloaded, ..."},
                    "job": {"type": "integer", "minimum": 0, "description": "the index in the batch's jobs of the "
                            "job record that is refused, when one is the cause (the same samples without it are "
                            "taken)"}}},
            },
        },
        "paths": {
            "/api/v1/samples": {"post": {
                "operationId": "postSamples", "summary": "Ingest one batch of samples (all or nothing).",
                "description": "A 2xx is sent only after the batch is durably committed.",
                "security": _SECURED, "requestBody": _body("Batch"),
                "responses": {"200": _json("Stored, or a duplicate acknowledged.", {"$ref": _REF + "IngestResult"}),
                              **rejected, **_AUTH_ERRORS,
                              "409": _error("The batch's key (host, agent_id, seq) was stored with other content."),
                              "422": _error("Stored except for samples behind their GPU's aggregation window "
                                            "(reason too_late; the counts ride along); or not stored: too many "
                                            "GPUs for its host (gpu_limit), a value the ledger cannot hold "
                                            "(unstorable)."),
                              "429": _error("This node has too many ingest requests in flight; retry later."),
                              "503": _error("Too many ingest requests in flight (overloaded), the ledger cannot be "
                                            "reached (ledger_unavailable), or did not commit the batch within "
                                            "ledger_timeout_s (ledger_timeout: it may still, and the resend is then "
                                            "a duplicate) or has not committed for longer (ledger_stalled); retry "
                                            "with backoff."),
                              "507": _error("The collector's disk is full; retry after Retry-After.")},
            }},
            "/api/v1/jobs": {
                "get": {"operationId": "getJobs", "summary": "Job records known to the collector.",
                        "security": _SECURED, "parameters": [
                    *_PAGE_PARAMS,
                        ],
                        "responses": {"200": _json("Job records.",
                                                   {"type": "array", "items": {"$ref": _REF + "JobRecord"}}),
                                      "400": _error("An unknown or invalid parameter."), **_AUTH_ERRORS,
                                      **_STALLED_ERROR}},
                "post": {"operationId": "postJobs", "summary": "Insert or update job records (admin).",
                         "security": _SECURED, "requestBody": _body("JobRecordList"),
                         "responses": {"200": _json("Received and changed counts.", {
                             "type": "object", "required": ["received", "changed"],
                             "properties": {"received": {"type": "integer"}, "changed": {"type": "integer"}}}),
                             **rejected, **_AUTH_ERRORS,
                             "422": _error("A value the ledger cannot hold (unstorable); nothing was stored."),
                             "503": _error(f"The ledger cannot be reached, or {_STALLED}; retry later."),
                             "507": _error("The collector's disk is full; retry after Retry-After.")}},
            },
            "/api/v1/usage": {"get": {
                "operationId": "getUsage", "summary": "Measured usage per job (or per job and GPU).",
                "security": _SECURED,
                "parameters": [
                    {"name": "job", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "per_gpu", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": ["0", "1", "true", "false", "yes", "no"]}},
                    *_PAGE_PARAMS,
                ],
                "responses": {"200": _json("Usage records.", {"type": "array", "items": {"$ref": _REF + "JobUsage"}}),
                              "400": _error("An unknown or invalid parameter."), **_AUTH_ERRORS, **_STALLED_ERROR},
            }},
            "/api/v1/totals": {"get": {
                "operationId": "getTotals",
                "summary": "Cluster totals over whole hours: the hour buckets from the one holding start up to, not "
                           "including, the one holding end (adjacent ranges partition the hours; a range inside one "
                           "hour sums none; hours_start and hours_end in the answer name the buckets summed).",
                "security": _SECURED,
                "parameters": [{"name": n, "in": "query", "required": False, "schema": {"type": "number"},
                                "description": "unix seconds"} for n in ("start", "end")],
                "responses": {"200": _json("Totals.", {"$ref": _REF + "Totals"}),
                              "400": _error("A parameter is not unix seconds in range, or end is before start."),
                              **_AUTH_ERRORS, **_STALLED_ERROR},
            }},
            "/api/v1/series": {"get": {
                "operationId": "getSeries",
                "summary": "One GPU's samples (raw tier, no step) or rollup buckets in [start, end]; the tier is "
                           "picked by the range, the step and retention.",
                "security": _SECURED,
                "parameters": [
                    *({"name": n, "in": "query", "required": True, "schema": {"type": "string", "minLength": 1}}
                      for n in ("host", "uuid")),
                    *({"name": n, "in": "query", "required": True, "schema": {"type": "number"},
                       "description": "unix seconds"} for n in ("start", "end")),
                    {"name": "step", "in": "query", "required": False, "schema": {"type": "number"},
                     "description": "bucket seconds (rounded up to the tier's resolution, and coarsened so that an "
                                    "answer holds at most the collector's max_series_points points)"},
                    {"name": "mig", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
                "responses": {"200": _json("Samples (GpuSample) or buckets (mean/min/max/count per field).",
                                           {"type": "array", "items": {"type": "object"}}),
                              "400": _error("A parameter is missing or not a number."),
                              "502": _error("VictoriaMetrics (series_url) answered with an error."),
                              "503": _error("VictoriaMetrics (series_url) is unreachable or overloaded, or (the "
                                            f"local store) {_STALLED}; retry later."),
                              **_AUTH_ERRORS},
            }},
            "/api/v1/priority": {"get": {
                "operationId": "getPriority", "summary": "The priority feed (per association fairshare, site factor).",
                "security": _SECURED,
                "responses": {"200": _json("The feed document.", {"$ref": _REF + "PriorityFeed"}),
                              "404": _error("No feed written yet (run `gpuledger priority feed`)."),
                              "503": _error("The feed file is unreadable."), **_AUTH_ERRORS},
            }},
            "/api/v1/openapi.json": {"get": {
                "operationId": "getOpenapi", "summary": "This document.", "security": [],
                "responses": {"200": _json("OpenAPI 3.1 document.", {"type": "object"})},
            }},
            "/metrics": {"get": {
                "operationId": "getMetrics", "summary": "Prometheus metrics (self-metrics, fairshare gauges).",
                "security": [],
                "responses": {"200": {"description": "Prometheus text format.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_STALLED_ERROR},
            }},
            "/healthz": {"get": {
                "operationId": "getHealth", "summary": "Liveness, and whether the ledger commits.", "security": [],
                "responses": {"200": _json("Alive.", {"type": "object", "required": ["status"],
                                                      "properties": {"status": {"const": "ok"}}}),
                              "503": _json("A batch has waited for its commit longer than ledger_timeout_s (the "
                                           "ledger stalls); 200 again once that commit ends.", {
                                               "type": "object", "required": ["status", "reason", "error"],
                                               "properties": {"status": {"const": "unavailable"},
                                                              "reason": {"const": "ledger_stalled"},
                                                              "error": {"type": "string"}}})},
            }},
        },
        "security": _SECURED,
    }

