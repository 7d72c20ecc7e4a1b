"""Accounting commands: fairshare, report, priority, jobs. Library code raises; only this module exits."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from gpuledger.accounting.audit import (
    EntryDamaged,
    bind,
    gap_key,
    record_fairshare,
    record_job_records,
    record_priority_changes,
    usage_key,
)
from gpuledger.accounting.charge import allocated_gpu_seconds
from gpuledger.accounting.cli_common import (
    CONFIG_NAME,
    ConfigOpt,
    DataDir,
    LedgerUrl,
    cli_ledger_url,
    open_audit,
    read_ledger,
)
from gpuledger.accounting.cli_common import fail_exit as _fail
from gpuledger.accounting.cli_common import open_store as _open_store
from gpuledger.accounting.config import ConfigError, accounting_settings, load_config
from gpuledger.accounting.engine import LIVE_SLURM, association_usage, audit_charges, compute, load_tree
from gpuledger.accounting.ledger import GapInputs, LedgerEntry, gap_attribution, gap_inputs, join
from gpuledger.accounting.ledger import load as load_ledger
from gpuledger.accounting.priority import (
    FEED_NAME,
    FeedSource,
    feed_document,
    flat_path,
    priority_feed,
    write_feed,
)
from gpuledger.accounting.privacy import decay_horizon_start
from gpuledger.accounting.report.jobs import JOB_COLUMNS, job_rows
from gpuledger.accounting.report.tables import show
from gpuledger.accounting.slurm import SlurmCommandError
from gpuledger.collector.auditlog.jobs import job_key
from gpuledger.collector.ledger_url import ledger_exists, ledger_fingerprint, ledger_label, open_ledger
from gpuledger.output import (
    FORMAT_HELP,
    Column,
    Format,
    console,
    emit,
    fixed,
    note,
    os_error,
    to_csv,
    write_atomically,
)
from gpuledger.schema.text import NotText, read_text

if TYPE_CHECKING:
    from gpuledger.accounting.apply import Applied, Plan
    from gpuledger.accounting.audit import Bound
    from gpuledger.accounting.config import AccountingSettings
    from gpuledger.accounting.engine import ChargedJob, UsageResult
    from gpuledger.accounting.fairshare import Row
    from gpuledger.schema.records import JobRecord

# `priority watch`'s import of ended jobs: the file in the data dir that says up to when sacct's job ends are in the
# ledger, and the longest window one sacct call asks for (a long downtime is caught up a day per call)
IMPORT_CURSOR_NAME = "priority-watch-import.json"
SACCT_CHUNK_S = 86400.0

MAX_SINCE_H = 100 * 365.25 * 24  # `jobs import --slurm --since`: further back overflows the clock

ASSOC_HELP = ("the association tree: `slurm` (ask sacctmgr), a file of `sacctmgr -P show associations "
              "format=cluster,account,parentname,user,share` output, or a CSV account,parent,user,shares "
              "(default: the config's accounts table)")
AssociationsOpt = Annotated[Path | None, typer.Option(help=ASSOC_HELP)]


INFLUX_HELP = ("also write the fairshare measurement (per association: fairshare, site factor, usage) to the "
               "InfluxDB of the collector table's influx_url")


Fmt = Format  # every table command takes --format table|json|csv (gpuledger.output)


class Algorithm(StrEnum):
    fair_tree = "fair-tree"
    classic = "classic"


err = console(stderr=True)  # in a pipe, a warning stays one line (rich would wrap it at 80 columns)

fairshare_app = typer.Typer(help="Slurm-conformant fairshare on measured usage.")
priority_app = typer.Typer(help="The priority feed Slurm consumes.", no_args_is_help=True)
jobs_app = typer.Typer(help="Job records in the ledger.", no_args_is_help=True)






def _config(data_dir: Path, config: Path | None) -> tuple[dict, Path]:
    path = config or data_dir / CONFIG_NAME
    try:
        return load_config(path), path
    except ConfigError as e:
        raise _fail(str(e)) from None


def _optional_config(data_dir: Path, config: Path | None) -> tuple[dict, Path]:
    """The configuration and its path: an explicit --config must exist; the data dir's is optional (defaults then,
    when files give the tree)."""
    path = config or data_dir / CONFIG_NAME
    return (_config(data_dir, config)[0] if (config is not None or path.exists()) else {}), path


def _settings(data_dir: Path, config: Path | None) -> AccountingSettings:
    """The ``[accounting]`` settings (defaults without a configuration file); a bad one exits 2 naming the file."""
    cfg, path = _optional_config(data_dir, config)
    try:
        return accounting_settings(cfg, path)
    except ConfigError as e:
        raise _fail(str(e)) from None


def fairshare_rows(data_dir: Path, config: Path | None, algorithm: str | None, associations: Path | None = None,
                   usage_file: Path | None = None, now: float | None = None, feed_weight: int | None = None,
                   record: bool = False, accept_store_changes: str | None = None, ledger_url: str | None = None,
                   ) -> tuple[list[Row], AccountingSettings]:
    """Rows of the fairshare computation and the settings used (shared by `fairshare`, `priority feed`, the demo),
    on the ledger at ``ledger_url`` (resolved; None: the data dir's embedded store); see :func:`_fairshare`."""
    rows, settings, _ = _fairshare(data_dir, config, algorithm, associations, usage_file, now, feed_weight, record,
                                   accept_store_changes, ledger_url)
    return rows, settings


def _fairshare(data_dir: Path, config: Path | None, algorithm: str | None, associations: Path | None,
               usage_file: Path | None, now: float | None, feed_weight: int | None, record: bool,
               accept_store_changes: str | None, ledger_url: str | None,
               ) -> tuple[list[Row], AccountingSettings, FeedSource | None]:
    """The fairshare rows, the settings, and the ``fairshare`` entry that recorded them (None: not recorded).

    With ``record`` (feeds, `priority apply`, `fairshare --record`) the store's job and usage records are first
    bound to the audit log (a record that differs from its final logged one is refused, exit 1, unless
    ``accept_store_changes`` gives the reason to log it as a correction), then the computation is appended with
    its inputs: each job's charge and decayed charge with the entries they came from, the decayed usage per
    association, the rows and, when ``feed_weight`` is given, the site factors of the feed. A query appends nothing.
    """
    from gpuledger.accounting.fairshare_render import parse_usage_csv

    cfg, cfg_path = _optional_config(data_dir, config)
    now = time.time() if now is None else now
    try:
        settings = accounting_settings(cfg, cfg_path)
        if associations is None and settings.associations is not None:
            associations = (Path(settings.associations) if settings.associations == LIVE_SLURM
                            else cfg_path.parent / settings.associations)
        if associations is None and "accounts" not in cfg:
            raise _fail(f"no association tree: pass --associations slurm|FILE, or set associations in the "
                        f"[accounting] table of {cfg_path}, or add an [accounts] table there")
        tree = load_tree(associations, cfg)
        if usage_file is not None:
            rows = compute(tree, parse_usage_csv(read_text(usage_file)), algorithm or settings.algorithm,
                           settings.dampening)
            return rows, settings, None
        store = _open_store(ledger_url, data_dir)
        try:
            jobs, usages, per_gpu = store.jobs(), store.job_usage(), store.job_usage(per_gpu=True)
            # what the charge reads is what is bound to the audit log: records, per-GPU rows, gaps, hour buckets
            stored, gaps = store.job_records(), gap_inputs(store)
            entries = join(stored, usages, per_gpu, gap_attribution(store, now, inputs=gaps).by_job(), now)
            if cfg.get("cluster"):
                # the tree is this cluster's (sacctmgr's rows for it): so are the jobs charged to it, as Slurm
                # keeps usage per cluster; a job no agent or record named a cluster for is this one's
                entries = [e for e in entries if e.cluster in (cfg["cluster"], "")]
            horizon = decay_horizon_start(now, settings.half_life_s, settings.usage_reset, settings.timezone or None)
            # from the first hour of every GPU record that reaches the horizon: a charge placed over only the hours
            # after it (a reset, or decayed away) would put the whole of it where it survives
            since = min((u.first_ts for u in per_gpu if u.last_ts >= horizon), default=horizon)
            busy = store.busy_hours(since)
        finally:
            store.close()
        alias = _history_alias(ledger_url, data_dir, entries)
        if not record:
            result = association_usage(entries, settings, tree, now, alias=alias, busy=busy)
            _warn(result)
            return compute(tree, result.usage, algorithm or settings.algorithm, settings.dampening), settings, None
        with open_audit(data_dir, ledger_url) as log:
            bound = bind(log, jobs, usages, now, per_gpu=per_gpu, gaps=gaps.records(), busy=busy, busy_since=since,
                         stored_jobs=[r for r, _ in stored], accept_reason=accept_store_changes)
            if bound.changes and accept_store_changes is None:
                lines = [f"  {c.label()} {c.field}: logged {c.logged!r} (entry {c.seq}), stored {c.stored!r}"
                         for c in bound.changes]
                err.print(escape("error: refused: store rows disagree with their logged record (edited after they "
                                 "were logged?); `--accept-store-changes REASON` logs them as corrections:\n"
                                 + "\n".join(lines)), highlight=False, soft_wrap=True)
                raise typer.Exit(code=1)
            result = association_usage(entries, settings, tree, now, alias=alias, busy=busy)
            _warn(result)
            rows = compute(tree, result.usage, algorithm or settings.algorithm, settings.dampening)
            charges = audit_charges(result.jobs)
            sources = _sources(entries, result.jobs, charges, bound, gaps)
            # the entry names the algorithm the rows were computed with (`fairshare --algorithm` overrides the
            # configured one): `audit verify` recomputes them with it
            used = settings.model_copy(update={"algorithm": algorithm or settings.algorithm})
            entry = record_fairshare(
                log, now=now, settings=used, charges=charges, usage=result.usage,
                rows=rows, feed=priority_feed(rows, feed_weight) if feed_weight is not None else (), sources=sources,
            )
    except EntryDamaged as e:
        err.print(escape(f"error: TAMPERED: {e} (run `gpuledger audit verify`)"), highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    except OSError as e:
        raise _fail(os_error(e)) from None
    except (ValueError, SlurmCommandError) as e:
        raise _fail(str(e)) from None
    return rows, settings, FeedSource(entry.seq, entry.leaf.hex())


def _sources(entries: list[LedgerEntry], jobs: Sequence[ChargedJob], charges: Sequence[ChargedJob],
             bound: Bound, gaps: GapInputs) -> dict[str, dict[str, Any]]:
    """Per charged job (by its id in the audit entry): the log entries of its usage and job records, of the
    per-GPU usage the charge read (in its order) and of the gaps its reassigned energy came from."""
    by_key = {e.key: e for e in entries}
    out: dict[str, dict[str, Any]] = {}
    for j, c in zip(jobs, charges):
        e = by_key[(j.cluster, j.job_id)]
        src: dict[str, Any] = {
            "usage_entry": bound.seq_of(usage_key(e.usage)) if e.usage is not None else None,
            "job_entry": bound.seq_of(job_key(e.described)) if e.described is not None else None}
        if e.gpus:
            src["gpu_entries"] = [bound.seq_of(usage_key(u)) for u in e.gpus]
        if e.gap_shares:
            seqs = {bound.seq_of(gap_key(g)) for s in e.gap_shares for g in gaps.holding(s)}
            src["gap_entries"] = sorted(seq for seq in seqs if seq is not None)
        out[c.job_id] = src
    return out


def _warn(result: UsageResult) -> None:
    for (acct, user), v in sorted(result.unknown.items()):
        err.print(f"[yellow]warning:[/yellow] usage {v:.6g} of {escape(user)}@{escape(acct)} "
                  "has no association in the tree")
    if result.unrecorded_jobs:  # most often running jobs whose record is not imported yet: a note, not a warning
        note(f"note: {len(result.unrecorded_jobs)} measured job(s) Slurm has no record of are not charged (an agent's "
             "description alone is not; `charge_unrecorded_jobs = true` in [accounting] charges them as described): "
             f"{', '.join(result.unrecorded_jobs[:10])}")
    if result.unmatched_jobs:
        err.print(f"[yellow]warning:[/yellow] {len(result.unmatched_jobs)} measured job(s) without a "
                  f"scheduler record or an agent's account are not charged: "
                  f"{escape(', '.join(result.unmatched_jobs[:10]))}")


def _history_alias(ledger_url: str | None, data_dir: Path, entries: Iterable[LedgerEntry]
                   ) -> Callable[[str], str] | None:
    """The ledger's pseudonymizer when some record's user was pseudonymized (``audit retention``), so that such
    history still charges its association."""
    from gpuledger.accounting.privacy import Pseudonymizer, is_pseudonym

    if any(e.described is not None and e.described.user and is_pseudonym(e.described.user) for e in entries):
        try:
            return Pseudonymizer.for_ledger(ledger_url, data_dir)
        except ValueError as e:
            raise _fail(str(e)) from None
    return None


@fairshare_app.callback(invoke_without_command=True)
def fairshare(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    associations: AssociationsOpt = None,
    usage: Annotated[Path | None, typer.Option(help="CSV account,user,usage (decayed raw usage)")] = None,
    algorithm: Annotated[Algorithm | None, typer.Option(help="default: the configured one")] = None,
    fmt: Annotated[Fmt, typer.Option("--format", help=FORMAT_HELP)] = Fmt.table,
    record: Annotated[bool, typer.Option("--record", help="append the computation and its inputs to the audit log "
                                         "(a plain query appends nothing)")] = False,
    influx: Annotated[bool, typer.Option("--influx", help=INFLUX_HELP)] = False,
    ledger_url: LedgerUrl = None,
) -> None:
    """Fairshare per association, like `sshare -l` (table), or JSON/CSV for machines."""
    from gpuledger.accounting.fairshare_render import render_csv, render_table, to_json

    now = time.time()
    url = cli_ledger_url(ledger_url, data_dir, config)
    rows, settings = fairshare_rows(data_dir, config, algorithm.value if algorithm else None, associations, usage,
                                    now=now, record=record and usage is None, ledger_url=url)
    if influx:
        _to_influx(data_dir, config, rows, feed_from_rows(rows, settings, now))
    if fmt is Fmt.json:
        typer.echo(json.dumps(to_json(rows), indent=2))
    elif fmt is Fmt.csv:
        typer.echo(render_csv(rows), nl=False)
    else:
        typer.echo(render_table(rows), nl=False)


def build_feed(data_dir: Path, config: Path | None, now: float | None = None,
               associations: Path | None = None, accept_store_changes: str | None = None,
               ledger_url: str | None = None) -> tuple[list[Row], dict]:
    """The fairshare rows and the feed document made of them, which names the ``fairshare`` entry that recorded
    both (as the feed files do), of the ledger at ``ledger_url`` (resolved; None: the data dir's embedded store)."""
    now = time.time() if now is None else now
    weight = _settings(data_dir, config).priority_weight
    rows, settings, source = _fairshare(data_dir, config, None, associations, None, now, weight, True,
                                        accept_store_changes, ledger_url)
    return rows, feed_from_rows(rows, settings, now, source)


def _influx_configured(data_dir: Path, config: Path | None) -> bool:
    from gpuledger.collector.config import ConfigError as CollectorConfigError
    from gpuledger.collector.config import load_settings

    try:
        return bool(load_settings(data_dir, config).influx_url)
    except CollectorConfigError as e:
        raise _fail(str(e)) from None


def _to_influx(data_dir: Path, config: Path | None, rows: list[Row], doc: dict) -> None:
    """The fairshare measurement to InfluxDB; a failure exits 1 (the feed file is written already)."""
    from gpuledger.accounting.influx_out import InfluxNotConfigured, InfluxPublishError, fairshare_to_influx

    try:
        where = fairshare_to_influx(data_dir, config, rows, doc["associations"], doc["generated_at"])
    except InfluxPublishError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2 if isinstance(e, InfluxNotConfigured) else 1) from None
    err.print(f"fairshare written to InfluxDB {where}", markup=False, highlight=False, soft_wrap=True)


def feed_from_rows(rows: list[Row], settings: AccountingSettings, now: float, source: FeedSource | None = None
                   ) -> dict:
    entries = priority_feed(rows, weight=settings.priority_weight)
    meta = {
        "generated_at": now,
        "algorithm": settings.algorithm,
        "policy": settings.policy,
        "unmeasured": settings.unmeasured,
        "priority_weight": settings.priority_weight,
        "half_life_s": settings.half_life_s,
    }
    return feed_document(entries, meta, source)


FEED_COLUMNS = (Column("Account", "account", left=True), Column("User", "user", left=True),
                Column("FairShare", "fairshare", fixed(6)), Column("SiteFactor", "site_factor"),
                Column("RawUsage", "raw_usage", fixed(1)), Column("EffectvUsage", "effective_usage", fixed(6)))


@priority_app.command("feed")
def priority_feed_cmd(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    output: Annotated[Path | None, typer.Option(
        help="write here (default: <data-dir>/priority-feed.json); the flat feed goes beside it as .txt")] = None,
    associations: AssociationsOpt = None,
    fmt: Annotated[Fmt, typer.Option("--format", help=FORMAT_HELP)] = Fmt.json,
    accept_store_changes: Annotated[str | None, typer.Option("--accept-store-changes", metavar="REASON", help="use "
                                    "store rows that differ from their final logged record, logging each as a "
                                    "correction with this reason (refused without it)")] = None,
    influx: Annotated[bool | None, typer.Option("--influx/--no-influx", show_default=False,
                                                   help="write to InfluxDB [default: when influx_url is set]")] = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Per association: measured fairshare and the Slurm site factor it implies; written atomically, as JSON and,
    beside it with the suffix .txt, as the flat `account user factor` file job_submit.lua reads; and to InfluxDB
    (measurement fairshare) when the collector table sets influx_url. Every record it uses is in the audit log
    first."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    rows, doc = build_feed(data_dir, config, associations=associations, accept_store_changes=accept_store_changes,
                           ledger_url=url)
    try:
        path = write_feed(output or data_dir / FEED_NAME, doc)
    except OSError as e:
        raise _fail(os_error(e)) from None
    except ValueError as e:
        raise _fail(str(e)) from None
    if influx is not False and (influx or _influx_configured(data_dir, config)):
        _to_influx(data_dir, config, rows, doc)
    emit(fmt, doc["associations"], FEED_COLUMNS, title=f"Priority feed ({path})", json_doc=doc)


# jobs list --format csv: the record and the measurement, one flat row a job (SI units, ratios)
JOBS_CSV = tuple(Column(k, k) for k in (
    "job_id", "cluster", "user", "account", "partition", "gpus", "start", "end", "state", "seen_by",
    "slurm_gpu_seconds", "observed_gpu_seconds", "coverage", "unmeasured_gpu_seconds",
    "allocated_gpu_seconds", "sm_active_gpu_seconds", "efficiency", "energy_joules", "gap_energy_joules",
    "sm_active_mean", "dram_bw_mean", "mem_used_peak_bytes",
    "out_of_scope_gpu_seconds", "out_of_scope_energy_joules", "out_of_scope_reasons"))
# a job's own fields; its usage's of the same name (its measured GPU count, its job id) never replace them
_JOB_FIELDS = ("job_id", "cluster", "gpus")


@jobs_app.command("list")
def jobs_list(
    data_dir: DataDir = Path("gpuledger-data"),
    fmt: Annotated[Fmt, typer.Option("--format", help=FORMAT_HELP)] = Fmt.table,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Jobs in the ledger: the scheduler's record joined with the measured usage."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    entries = read_ledger(url, data_dir)
    now = time.time()
    rows = job_rows(entries, now)
    objs: list[dict[str, Any]] = []
    for e, row in zip(entries, rows):
        r, u = e.described, e.usage
        slurm_s, observed = allocated_gpu_seconds(e.record, now), (u.allocated_gpu_seconds if u else 0.0)
        objs.append({
            "job_id": e.job_id,
            "cluster": e.cluster,
            "user": r.user if r else None,
            "account": r.account if r else None,
            "partition": r.partition if r else None,
            "gpus": (r.gpus if r and r.gpus is not None else (u.gpus if u else None)),
            "start": r.start if r else None,
            "end": r.end if r else None,
            "state": r.state if r else None,
            "seen_by": e.seen_by,
            "slurm_gpu_seconds": slurm_s,
            "observed_gpu_seconds": observed,
            "coverage": row.coverage,
            "unmeasured_gpu_seconds": 0.0 if slurm_s is None else max(0.0, slurm_s - observed),
            # the agents' samples plus the gap energy Slurm's record reassigned (as `report jobs` counts it)
            "energy_joules": e.energy_joules if (u is not None or e.gap_shares) else None,
            "gap_energy_joules": e.gap_energy_joules,
            # measured outside Slurm's record of the job (scope): not in `usage`, never charged
            "out_of_scope_gpu_seconds": e.out_of_scope_gpu_seconds,
            "out_of_scope_energy_joules": e.out_of_scope_energy_joules,
            "out_of_scope": [c.to_dict() for c in e.out_of_scope],
            "usage": u.to_dict() if u else None,
        })
    if not objs:
        note(f"no jobs in {ledger_label(url, data_dir)} yet")
    if fmt is Fmt.json:
        typer.echo(json.dumps(objs, indent=2))
    elif fmt is Fmt.csv:
        flat = [{**{k: v for k, v in (o["usage"] or {}).items() if k not in _JOB_FIELDS and k != "energy_joules"},
                 **{k: v for k, v in o.items() if k not in ("usage", "out_of_scope")},
                 "out_of_scope_reasons": ",".join(e.out_of_scope_reasons)} for o, e in zip(objs, entries)]
        typer.echo(to_csv(JOBS_CSV, flat), nl=False)
    else:
        show("Jobs", JOB_COLUMNS, rows)


def _read_arg(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else read_text(path)
    except UnicodeDecodeError as e:
        raise _fail(f"standard input: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except NotText as e:
        raise _fail(str(e)) from None


def _import_jobs(ledger_url: str | None, data_dir: Path, records: Sequence[JobRecord]) -> int:
    """Put Slurm job records into the ledger (made when there is none) and the audit trail; returns how many were
    new or changed (a record with no end changes no ended one: ``ledger_store.merge_record``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open_audit(data_dir, ledger_url) as log:
        store = open_ledger(ledger_url, data_dir, create=True)
        try:
            # logged before stored (nothing is charged that the log has not seen), merged as stored: a re-import
            # in another sacct format logs nothing, as it changes nothing of what Slurm said
            changed = store.put_jobs(records, before_store=lambda merged: record_job_records(log, merged))
        finally:
            store.close()
    return changed


@jobs_app.command("import")
def jobs_import(
    data_dir: DataDir = Path("gpuledger-data"),
    sacct_json: Annotated[str | None, typer.Option("--sacct-json", help="`sacct --json` output, FILE or -")] = None,
    sacct_parsable: Annotated[
        str | None, typer.Option("--sacct-parsable", help=(
            "`sacct -P` output with header, FILE or -. Its times carry no zone and are read in this machine's zone; "
            "in the hour repeated when DST ends they are ambiguous: run `TZ=UTC sacct -P ...` and this import with "
            "TZ=UTC"))] = None,
    slurm: Annotated[bool, typer.Option("--slurm", help="run sacct against the local cluster")] = False,
    since: Annotated[float, typer.Option(help="live mode: hours back from now (at most 100 years)")] = 24.0,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Import Slurm job records into the ledger (re-importing the same jobs changes nothing)."""
    from gpuledger.accounting.slurm import (
        SlurmClient,
        SlurmCommandError,
        SlurmParseError,
        merge_sacct,
        parse_sacct_json,
        parse_sacct_parsable,
    )

    url = cli_ledger_url(ledger_url, data_dir, config)
    if not (sacct_json or sacct_parsable or slurm):
        raise _fail("give --sacct-json, --sacct-parsable or --slurm")
    if sacct_json == "-" and sacct_parsable == "-":
        raise _fail("only one of --sacct-json and --sacct-parsable can read standard input")
    if slurm and (sacct_json or sacct_parsable):
        raise _fail("--slurm runs sacct itself: give it alone, or the files (--sacct-json, --sacct-parsable) alone")
    if slurm and not 0 < since <= MAX_SINCE_H:  # 0 or less: a window that ends before it starts
        raise _fail(f"--since must be hours in (0, {MAX_SINCE_H:g}], got {since:g}")

    def parsed(path: str | None, parse: Callable[[str], list[JobRecord]]) -> list[JobRecord]:
        """The file's records; a record no job can have refuses the whole import (nothing is stored), naming the
        file, and the line or record and job (the parser's message)."""
        if path is None:
            return []
        try:
            return parse(_read_arg(path))
        except SlurmParseError as e:
            raise _fail(f"{'standard input' if path == '-' else path}: {e}") from None

    try:
        if slurm:
            now = time.time()
            records = SlurmClient().sacct_jobs(now - since * 3600, now)
        else:
            # -P's times undecided in a repeated DST hour: said only for jobs the JSON (its epochs) does not time
            ambiguous: list[tuple[str, str]] = []
            as_json = parsed(sacct_json, parse_sacct_json)
            records = merge_sacct(as_json, parsed(sacct_parsable, lambda text: parse_sacct_parsable(
                text, ambiguous=ambiguous)))
            timed = {r.job_id for r in as_json if r.start is not None}
            for job_id, why in ambiguous:
                if job_id not in timed:
                    note(f"warning: {why}")
    except OSError as e:
        raise _fail(os_error(e)) from None
    except (SlurmParseError, SlurmCommandError) as e:
        raise _fail(str(e)) from None
    if data_dir.exists() and not data_dir.is_dir():
        raise _fail(f"--data-dir {data_dir} is not a directory")
    changed = _import_jobs(url, data_dir, records)
    typer.echo(f"imported {len(records)} job record(s); {changed} new or changed")


def _report_apply(plan: Plan, applied: Applied, verbose: bool) -> None:
    """Per association one line (jobs set, factor); each failed job on its own line; totals."""
    from collections import Counter

    per_assoc: Counter[tuple[str, str, str, int, float]] = Counter()
    for o in applied.outcomes:
        c = o.change
        if o.status == "failed":
            typer.echo(f"failed   job {c.job_id} {c.user}@{c.account}: SiteFactor {c.old_factor} -> {c.new_factor}: "
                       f"{o.error}")
            continue
        per_assoc[(o.status, c.user, c.account, c.new_factor, c.fairshare)] += c.tasks
        if verbose:
            typer.echo(f"{o.status:8} job {c.job_id} {c.user}@{c.account}: SiteFactor {c.old_factor} -> "
                       f"{c.new_factor} (fairshare {c.fairshare:.6f})")
    if not verbose:
        for (status, user, account, factor, fs), n in per_assoc.items():
            typer.echo(f"{status:8} {n} job(s) of {user}@{account}: SiteFactor -> {factor} (fairshare {fs:.6f})")
    for s in plan.skipped:
        err.print("[yellow]skipped[/yellow] " + escape(f"job {s.job_id} ({s.user}@{s.account}): {s.reason}"))
    changed = sum(o.change.tasks for o in applied.outcomes if o.status != "failed")
    failed = sum(o.change.tasks for o in applied.outcomes if o.status == "failed")
    verb = "would change" if any(o.status == "dry-run" for o in applied.outcomes) else "changed"
    typer.echo(f"{plan.jobs} pending job(s): {changed} {verb}, {failed} failed, {len(plan.unchanged)} record(s) "
               f"unchanged, {len(plan.skipped)} skipped; {applied.calls} scontrol call(s)")


@priority_app.command("apply")
def priority_apply(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    slurm: Annotated[
        bool, typer.Option("--slurm", help="apply to the local Slurm (scontrol update SiteFactor)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would change; change nothing")] = False,
    associations: AssociationsOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="one line per changed job record")] = False,
    ledger_url: LedgerUrl = None,
) -> None:
    """Set every pending job's SiteFactor from its association's measured fairshare, only where it changed
    (one scontrol command per factor and command line of jobs); then write both feed files, which job_submit.lua
    reads, so that new jobs get the factors Slurm's pending jobs now hold. With --dry-run: the plan only, nothing
    logged or written."""
    from gpuledger.accounting.apply import run_apply
    from gpuledger.accounting.priority import flat_feed
    from gpuledger.accounting.slurm import SlurmClient, SlurmCommandError, SlurmParseError

    url = cli_ledger_url(ledger_url, data_dir, config)
    if not slurm:
        raise _fail("priority apply needs a target: --slurm")
    if dry_run:  # the feed as a query computes it: no fairshare entry in the audit log, no feed file
        now = time.time()
        rows, settings = fairshare_rows(data_dir, config, None, associations=associations, now=now,
                                        ledger_url=url)
        doc = feed_from_rows(rows, settings, now)
    else:  # logged before Slurm is asked to change anything, as every change names it
        _, doc = build_feed(data_dir, config, associations=associations, ledger_url=url)
    try:
        if dry_run:
            plan, applied = run_apply(SlurmClient(), doc["associations"], dry_run=True)
        else:
            flat_feed(doc)  # a feed its flat file cannot hold (a name with whitespace) stops before any change
            with open_audit(data_dir, url) as log:
                plan, applied = run_apply(SlurmClient(), doc["associations"], record=record_priority_changes(log))
            # only once the apply ran (squeue and sprio answered): a failed one leaves the feed files as they were
            write_feed(data_dir / FEED_NAME, doc)
    except OSError as e:
        raise _fail(os_error(e)) from None
    except (SlurmParseError, SlurmCommandError, ValueError) as e:
        raise _fail(str(e)) from None
    _report_apply(plan, applied, verbose)
    if applied.count("failed"):
        raise typer.Exit(1)


def _newest_end(ledger_url: str | None, data_dir: Path) -> float | None:
    """End time of the newest ended job the feed charges (a scheduler record with measured usage): what the
    watch daemon's lag is measured from."""
    if not ledger_exists(ledger_url, data_dir):
        return None
    store = open_ledger(ledger_url, data_dir)
    try:
        entries = load_ledger(store)
    finally:
        store.close()
    return max((e.record.end for e in entries if e.record is not None and e.record.end is not None
                and e.usage is not None), default=None)


def _read_import_cursor(path: Path, ledger: str) -> float | None:
    """Up to when a watch imported sacct's job ends into ``ledger`` (None: no cursor, or one of another ledger);
    a file that is not a cursor exits 2 naming it."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _fail(os_error(e)) from None
    except ValueError as e:  # not JSON, not UTF-8
        raise _fail(f"{path}: not a priority watch import cursor ({e}); remove it to import the decay horizon "
                    "again") from None
    through = doc.get("imported_through") if isinstance(doc, dict) else None
    if isinstance(through, bool) or not isinstance(through, int | float) or not math.isfinite(through):
        raise _fail(f"{path}: imported_through is not a time in unix seconds: {through!r}")
    return float(through) if doc.get("ledger") == ledger else None


def _newest_job_end(ledger_url: str | None, data_dir: Path) -> float | None:
    """End time of the newest job record in the ledger (None: none)."""
    if not ledger_exists(ledger_url, data_dir):
        return None
    store = open_ledger(ledger_url, data_dir)
    try:
        return max((r.end for r in store.jobs() if r.end is not None), default=None)
    finally:
        store.close()


@contextmanager
def _printed_failure(what: str) -> Iterator[None]:
    """A command helper's exit (it printed the reason) as the watch daemon's expected failure of one step."""
    from gpuledger.accounting.priority_watch import CycleError

    try:
        yield
    except typer.Exit as e:
        raise CycleError(f"{what} (exit {e.exit_code}; the reason is on the line before)") from None


@priority_app.command("watch")
def priority_watch(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    associations: AssociationsOpt = None,
    output: Annotated[Path | None, typer.Option(
        help="JSON feed path (default: <data-dir>/priority-feed.json; the flat feed goes beside it as .txt)")] = None,
    slurm: Annotated[bool, typer.Option(
        "--slurm/--feed-only", help="apply to the local Slurm, or only write the feed")] = True,
    import_jobs: Annotated[bool, typer.Option(
        "--import-jobs/--no-import-jobs",
        help="import ended jobs from sacct at every poll, and the running ones' records (--import-running) (off "
             "when a timer imports them, running jobs included, as `jobs import --slurm` does: a job Slurm has no "
             "record of is not charged)")] = True,
    import_overlap: Annotated[float, typer.Option(
        help="seconds each sacct poll reaches back before the last one imported (job ends slurmdbd got late; "
             "later ones the catch-up finds)")
    ] = 900.0,
    import_catch_up: Annotated[float, typer.Option(
        help="once per this many seconds a sacct poll reaches back as far (job ends later still; 0: never)")
    ] = 86400.0,
    import_running: Annotated[float, typer.Option(
        help="with --import-jobs, import the records of the jobs running now (one sacct call) at most once per this "
             "many seconds, so that a running job is charged as Slurm describes it (one Slurm has no record of is "
             "not) and counts in no period closed before it ends (0: never)")
    ] = 60.0,
    poll: Annotated[float, typer.Option(help="seconds between looks at the ledger (and sacct)")] = 5.0,
    min_interval: Annotated[float, typer.Option(help="at most one cycle per this many seconds")] = 10.0,
    resync: Annotated[float, typer.Option(help="a cycle at least this often, for new pending jobs")] = 300.0,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port (0: none)")] = 9816,
    metrics_addr: Annotated[str, typer.Option(help="address the metrics listen on")] = "127.0.0.1",
    ledger_url: LedgerUrl = None,
) -> None:
    """Daemon: when jobs end (new job records or usage in the ledger), recompute the feed and apply it, at most
    every --min-interval seconds; with --import-jobs it imports the ended jobs' records from sacct, and the running
    jobs' (stored with no end until their ended records replace them); exports its lag (job end to applied factor)
    as a Prometheus metric."""
    import logging
    import signal

    from gpuledger.accounting.apply import run_apply
    from gpuledger.accounting.priority_watch import CycleError, CycleResult, PriorityWatch, Stopped
    from gpuledger.accounting.slurm import ENDED_STATES, SlurmClient, SlurmParseError
    from gpuledger.collector.db import DatabaseUnavailable

    url = cli_ledger_url(ledger_url, data_dir, config)
    settings = _settings(data_dir, config)  # a bad configuration ends the daemon at its start, not every poll after
    if min(import_overlap, import_catch_up, import_running) < 0:  # (NaN and the infinities: gpuledger.cli._finite)
        raise _fail("--import-overlap, --import-catch-up and --import-running must be seconds >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logger = logging.getLogger("gpuledger.priority.watch")
    feed_path = output or data_dir / FEED_NAME
    client = SlurmClient()
    label, cursor_path = ledger_label(url, data_dir), data_dir / IMPORT_CURSOR_NAME
    cursor = _read_import_cursor(cursor_path, label) if import_jobs else None
    # sacct's job ends up to this time are in the ledger (None: not yet compared with the ledger; -inf: none)
    through: list[float | None] = [None]
    next_catch_up = [time.monotonic() + import_catch_up]
    # (cluster, job id, end) of the jobs imported within the overlap, so that a poll imports only new ones
    imported: set[tuple[str, str, float]] = set()
    imports = [0]  # records this watch changed: part of the ledger's state (a PostgreSQL ledger has no file to stat)

    def import_ended() -> None:
        """sacct's job ends since the cursor (less the overlap, or the catch-up when due; never before the decay
        horizon) into the ledger, a day per sacct call at most, the cursor persisted after each."""
        last = through[0]
        if last is None:  # a ledger older than the cursor (restored from a backup) is imported from its newest end
            with _printed_failure("the ledger could not be read"):
                newest = _newest_job_end(url, data_dir)
            last = through[0] = -math.inf if cursor is None else min(cursor, cursor if newest is None else newest)
        now = time.time()
        catch_up = import_catch_up > 0 and time.monotonic() >= next_catch_up[0]
        reach = max(import_overlap, import_catch_up if catch_up else 0.0)
        horizon = decay_horizon_start(now, settings.half_life_s, settings.usage_reset, settings.timezone or None)
        # from the cursor (never before the horizon) less the reach: a usage reset's horizon moves to its boundary,
        # and the ends just before it are still to come (the poll before the boundary, slurmdbd's late ones)
        start = max(last, horizon) - reach if last > -math.inf else horizon
        if start == -math.inf:  # no cursor, and nothing decays: as far back as a catch-up reaches
            start = now - max(import_overlap, import_catch_up)
        while start < now:
            if watch.stopped():
                raise Stopped
            end = min(now, start + SACCT_CHUNK_S)
            ended = client.sacct_jobs(start, end, states=ENDED_STATES)
            new = [r for r in ended if r.end is not None and (r.cluster, r.job_id, r.end) not in imported]
            if new:  # a record imported before changes nothing (nor the log): put_jobs merges
                with _printed_failure("the ledger or the audit log could not be opened"):
                    imports[0] += _import_jobs(url, data_dir, new)
                imported.update((r.cluster, r.job_id, r.end) for r in new if r.end is not None)
            last = through[0] = end
            write_atomically(cursor_path, json.dumps({"ledger": label, "imported_through": end}) + "\n")
            start = end
        if catch_up:
            next_catch_up[0] = time.monotonic() + import_catch_up
        for key in [k for k in imported if k[2] < last - import_overlap]:  # out of the next window: bounded memory
            imported.discard(key)

    # the records the last import of running jobs put, as sacct gave them: only a changed one goes to the ledger
    running: dict[tuple[str, str], JobRecord] = {}

    def import_running_jobs() -> None:
        """sacct's records of the jobs running now into the ledger (stored with no end; the job's ended record,
        imported when it ends, replaces it; one never replaces an ended record: ``ledger_store.merge_record``)."""
        records = client.sacct_running(time.time())
        if watch.stopped():
            raise Stopped
        new = [r for r in records if running.get((r.cluster, r.job_id)) != r]
        if new:
            with _printed_failure("the ledger or the audit log could not be opened"):
                imports[0] += _import_jobs(url, data_dir, new)
        running.clear()
        running.update(((r.cluster, r.job_id), r) for r in records)

    def ledger_state() -> tuple:
        return (imports[0], *ledger_fingerprint(url, data_dir))

    def compute() -> tuple[dict, float | None]:
        with _printed_failure("the feed could not be computed"):
            # the newest end first: build_feed records the computation, which a failure after it would repeat
            newest_end = _newest_end(url, data_dir)
            _, doc = build_feed(data_dir, config, associations=associations, ledger_url=url)
            return doc, newest_end

    def apply(feed: tuple[dict, float | None]) -> CycleResult:
        doc, newest_end = feed
        try:
            write_feed(feed_path, doc)
        except ValueError as e:  # a name the flat feed cannot hold
            raise CycleError(str(e)) from None
        if not slurm:
            return CycleResult(newest_end, 0, 0)
        if watch.stopped():
            raise Stopped
        with _printed_failure("the audit log could not be opened"), open_audit(data_dir, url) as log:
            _, applied = run_apply(client, doc["associations"], record=record_priority_changes(log))
        for o in applied.outcomes:
            if o.status == "failed":
                logger.warning("job %s: %s", o.change.job_id, o.error)
        changed = sum(o.change.tasks for o in applied.outcomes if o.status == "applied")
        return CycleResult(newest_end, changed, applied.count("failed"))

    try:
        watch = PriorityWatch(compute, apply, ledger_state, import_ended if import_jobs else None,
                              import_running_jobs if import_jobs and import_running else None,
                              running_every_s=import_running or 60.0, poll_s=poll,
                              min_interval_s=min_interval, resync_s=resync,
                              expected=(SlurmCommandError, SlurmParseError, OSError, DatabaseUnavailable))
    except ValueError as e:
        raise _fail(str(e)) from None
    if metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr=metrics_addr, registry=watch.registry)
        except OSError as e:
            raise _fail(f"/metrics cannot listen on {metrics_addr}:{metrics_port}: {e.strerror or e}", 1) from None
    signal.signal(signal.SIGTERM, lambda *_: watch.stop())
    signal.signal(signal.SIGINT, lambda *_: watch.stop())
    logger.info("watching %s (feed %s and %s)", ledger_label(url, data_dir), feed_path, flat_path(feed_path))
    watch.run()
