"""`gpuledger report ...` and `gpuledger audit ...`. Library code raises; only this module exits.

Exit codes: 0 fine, 1 a check failed (`audit verify` found tampering, always naming the entry or range) or the
ledger's server cannot be reached, 2 bad input (missing store, bad date, bad configuration or ledger URL, an
unreadable checkpoint or key).

Every command reads the ledger that ``--ledger-url``, ``GPULEDGER_LEDGER_URL`` or the ``[ledger]`` table name
(``collector.ledger_url``; the data dir's embedded store by default); reports, keys and the audit log stay in the
data dir.
"""

from __future__ import annotations

import hashlib
import json
import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuledger.accounting import audit as au
from gpuledger.accounting import jobreport as jr
from gpuledger.accounting.audit.manifest import open_manifest
from gpuledger.accounting.audit.verify import read_checkpoints
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
from gpuledger.accounting.ledger import gap_attribution, gap_inputs
from gpuledger.accounting.ledger import load as load_ledger
from gpuledger.accounting.priority import FEED_NAME, flat_path
from gpuledger.accounting.privacy import pseudonymize_entries
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.idle import IDLE_COLUMNS, idle_jobs
from gpuledger.accounting.report.jobs import JOB_COLUMNS, job_rows
from gpuledger.accounting.report.period import (
    ALL_TIME,
    PERIOD_FORMS,
    in_period,
    iso_utc,
    not_ended_note,
    parse_period,
    run_ends,
)
from gpuledger.accounting.report.settings import ReportSettings, load_report_settings
from gpuledger.accounting.report.tables import show, to_csv, to_json
from gpuledger.accounting.report.usage import (
    usage_columns,
    usage_report,
    usage_report_csv,
    usage_report_json,
    usage_report_text,
)
from gpuledger.collector.auditlog import LogDamaged
from gpuledger.collector.db import DatabaseUnavailable, is_postgres_url
from gpuledger.collector.ledger_url import ledger_exists, ledger_label
from gpuledger.output import Format, note, os_error, write_atomically

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gpuledger.accounting.ledger import LedgerEntry
    from gpuledger.accounting.privacy import Pseudonymizer
    from gpuledger.accounting.report.period import Period
    from gpuledger.schema.records import JobUsage


Pseudo = Annotated[
    bool, typer.Option("--pseudonymize", help="Replace user names by stable keyed pseudonyms (HMAC-SHA256).")]
# the period of a report: --period, or --from/--to (gpuledger.accounting.report.period.parse_period)
FromOpt = Annotated[str | None, typer.Option("--from", help="YYYY-MM-DD or ISO date-time (UTC), inclusive")]
ToOpt = Annotated[str | None, typer.Option("--to", help="YYYY-MM-DD or ISO date-time (UTC), exclusive")]
PeriodOpt = Annotated[str | None, typer.Option("--period", help=PERIOD_FORMS + ", UTC")]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout; signed when "
                                                   "an audit signing key exists (see `audit keygen`).")]


report_app = typer.Typer(help="Usage reports for admins and auditors.", no_args_is_help=True)
audit_app = typer.Typer(help="The tamper-evident audit trail and signed reports.", no_args_is_help=True)


class UsageFmt(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    html = "html"


TableFmt = Format  # gpuledger.output: every table command takes --format table|json|csv


class TextFmt(StrEnum):
    text = "text"
    json = "json"


class By(StrEnum):
    account = "account"
    user = "user"
    partition = "partition"  # type: ignore[assignment]  # shadows str.partition; typer reads the values
    model = "model"
    node = "node"




def _note(msg: str) -> None:
    """A message on stderr, one line, never wrapped (paths and hashes stay whole and greppable)."""
    note(msg)




def _settings(data_dir: Path, config: Path | None) -> ReportSettings:
    try:
        return load_report_settings(data_dir, config)
    except ReportError as e:
        raise _fail(str(e)) from None


def _alias(url: str | None, data_dir: Path) -> Pseudonymizer:
    """The ledger's pseudonymizer (a PostgreSQL ledger keeps its key; else the data dir's)."""
    from gpuledger.accounting.privacy import Pseudonymizer

    try:
        return Pseudonymizer.for_ledger(url, data_dir)
    except ValueError as e:
        raise _fail(str(e)) from None


def _per_gpu(entries: Sequence[LedgerEntry]) -> dict[str, tuple[JobUsage, ...]]:
    """Each job's per-GPU usage records, as the ledger joined them (held to Slurm's record), by job id."""
    return {e.job_id: e.gpus for e in entries if e.gpus}


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    try:
        write_atomically(output, text)  # a report already there is replaced whole or kept
    except OSError as e:
        raise _fail(os_error(e)) from None


def bound_settings(settings: ReportSettings) -> dict[str, Any]:
    """The report settings a usage report's figures are computed with, resolved: the prices, the constant CO2e
    factor, the grid intensity series as its points' digest (not the file's: its name and layout change no
    figure), the idle threshold. What a signed manifest binds and `audit verify --config` compares."""
    grid = settings.grid
    series = None
    if grid is not None:
        points = au.canonical_json([[t, v] for t, v in zip(grid.times, grid.values)])
        series = {"points": len(grid.times), "sha256": hashlib.sha256(points.encode()).hexdigest()}
    return {"currency": settings.currency, "price_per_kwh": settings.price_per_kwh,
            "price_per_gpu_hour": dict(sorted(settings.price_per_gpu_hour.items())),
            "co2e_kg_per_kwh": settings.co2e_kg_per_kwh, "grid_intensity": series,
            "idle_threshold": settings.idle_threshold}


def _settings_text(bound: Any) -> str:
    if not isinstance(bound, dict):
        return "binds no report settings"
    grid = bound.get("grid_intensity")
    series = (f"{grid.get('points')} point(s), sha256 {str(grid.get('sha256'))[:16]}" if isinstance(grid, dict)
              else "none")
    shown = ", ".join(f"{k} {json.dumps(bound.get(k))}" for k in ("currency", "price_per_kwh", "price_per_gpu_hour",
                                                                   "co2e_kg_per_kwh"))
    return f"{shown}, grid intensity series {series}, idle_threshold {json.dumps(bound.get('idle_threshold'))}"


def _sign(output: Path | None, ledger_url: str | None, data_dir: Path, config: Path | None, inputs: dict[str, Any],
          period: dict[str, Any], settings: ReportSettings | None = None) -> None:
    """Sign a written report when a key exists; say so either way (an unsigned report is not an error). The
    manifest binds the job and usage records used, which must match the audit log (else exit 1, unsigned), and the
    report ``settings`` its figures were computed with (:func:`bound_settings`)."""
    if output is None:
        return
    key_path = au.default_private_key_path()
    if not key_path.exists():
        _note(f"report written to {output} (unsigned: no signing key at {key_path}; run `gpuledger audit keygen`)")
        return
    cfg = config or data_dir / CONFIG_NAME
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.exists() else None
    inputs = {**inputs, "config": {"name": cfg.name, "sha256": digest}}
    if settings is not None:
        inputs["settings"] = bound_settings(settings)
    try:
        key = au.load_signing_key(key_path)
        with open_audit(data_dir, ledger_url) as log:
            bound = _bind_store(ledger_url, data_dir, log, write=True)
            if bound.changes:
                raise _fail(f"report written to {output} but NOT signed: store rows disagree with their logged record "
                            "(see `gpuledger audit verify --store`):\n" + _store_changes(bound.changes), 1)
            m = au.sign_report(output, key, log, inputs=inputs, period=period, used=bound.used())
    except au.AuditError as e:
        raise _fail(str(e)) from None
    _note(f"report written to {output}, signed manifest {m}")


def _note_empty(per: Period, entries: Sequence[LedgerEntry], now: float) -> None:
    """An empty period is not an error, but say so, and where the ledger's jobs are (``now``: the report's instant
    of the period rule)."""
    ends = [t for e in entries for t in run_ends(e, now)]
    days = [str(iso_utc(t))[:10] for t in (min(ends), max(ends))] if ends else []  # job ends are finite
    where = (f"the ledger's jobs ended between {days[0]} and {days[1]}" if days
             else "the ledger holds no jobs yet")
    _note(f"note: no job ended in period {per.label} (jobs count in the period they ended); {where}")


def _note_not_ended(per: Period, entries: Sequence[LedgerEntry], now: float) -> None:
    """Say what the period rule did with the jobs still running: counted up to now in an open period, else left
    out."""
    note = not_ended_note(entries, per, now)
    if note is not None:
        _note(f"note: {note}")


def _jobs_to_influx(data_dir: Path, config: Path | None, entries: Sequence[LedgerEntry]) -> None:
    from gpuledger.accounting.influx_out import InfluxNotConfigured, InfluxPublishError, jobs_to_influx

    try:
        where = jobs_to_influx(data_dir, config, entries)
    except InfluxPublishError as e:
        raise _fail(str(e), 2 if isinstance(e, InfluxNotConfigured) else 1) from None
    _note(f"job usage written to InfluxDB {where}")


# -- report ---------------------------------------------------------------------------------------------------------
@report_app.command("usage")
def report_usage(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    start: FromOpt = None,
    end: ToOpt = None,
    period: PeriodOpt = None,
    by: Annotated[By, typer.Option("--by")] = By.account,
    fmt: Annotated[UsageFmt, typer.Option("--format")] = UsageFmt.table,
    pseudonymize: Pseudo = False,
    output: OutputOpt = None,
    influx: Annotated[bool, typer.Option("--influx", help="also write the period's jobs (measurement job_usage, "
                                         "tagged with account and user) to the InfluxDB of the collector table's "
                                         "influx_url")] = False,
    ledger_url: LedgerUrl = None,
) -> None:
    """Per group: GPU-hours allocated and SM-active, efficiency, HBM, energy, CO2e, cost, idle GPU-hours, queue
    wait. Jobs count whole in the period they ended; totals are exactly the sum of the job records."""
    try:
        per = parse_period(period, start, end)
    except ReportError as e:
        raise _fail(str(e)) from None
    settings = _settings(data_dir, config)
    url = cli_ledger_url(ledger_url, data_dir, config)
    store = _open_store(url, data_dir)
    try:
        entries = load_ledger(store)
    finally:
        store.close()
    per_gpu = _per_gpu(entries) if by is By.node else None
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(url, data_dir))
    now = time.time()  # one instant for the period rule of every part of the report
    try:
        rep = usage_report(entries, by.value, per, settings, per_gpu, now)
    except ReportError as e:
        raise _fail(str(e)) from None
    if influx:
        _jobs_to_influx(data_dir, config, in_period(entries, per, now))
    if rep.total.jobs == 0:
        _note_empty(per, entries, now)
    _note_not_ended(per, entries, now)
    if fmt is UsageFmt.table and output is None:
        show(f"GPU usage by {by.value}, period {per.label}", usage_columns(by.value, rep.currency),
             [*rep.rows, rep.total])
        return
    if fmt is UsageFmt.json:
        text = usage_report_json(rep) + "\n"
    elif fmt is UsageFmt.csv:
        text = usage_report_csv(rep)
    elif fmt is UsageFmt.html:
        from gpuledger.accounting.html import render_html

        with open_audit(data_dir, url) as log:
            size, root = log.head()
        text = render_html(rep, entries, f"GPU usage by {by.value}, {per.label}", now=now,
                           manifest={"audit log head": f"{size} entries, root {root[:16]}...",
                                     "user names": "pseudonymized" if pseudonymize else "shown as recorded"})
    else:
        text = usage_report_text(rep)
    _emit(text, output)
    _sign(output, url, data_dir, config, {"report": "usage", "by": by.value, "format": fmt.value,
                                          "jobs": rep.total.jobs, "pseudonymized": pseudonymize}, per.to_dict(),
          settings)


@report_app.command("reconcile")
def report_reconcile(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    start: FromOpt = None,
    end: ToOpt = None,
    period: PeriodOpt = None,
    fmt: Annotated[TableFmt, typer.Option("--format")] = TableFmt.table,
    output: OutputOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Per account, node and GPU model: Slurm-allocated vs observed GPU-hours, coverage, unmeasured GPU-hours,
    GPU-time and energy with no job (unattributed), gap energy reassigned to jobs from Slurm's records and counter
    anomalies. What an auditor signs."""
    import math

    from gpuledger.accounting.report.reconcile import (
        RECONCILE_COLUMNS,
        reconcile,
        reconcile_csv,
        reconcile_json,
        reconcile_text,
    )

    try:
        per = parse_period(period, start, end)
    except ReportError as e:
        raise _fail(str(e)) from None
    url = cli_ledger_url(ledger_url, data_dir, config)
    store = _open_store(url, data_dir)
    lo, hi = (per.start if math.isfinite(per.start) else None), (per.end if math.isfinite(per.end) else None)
    try:
        gaps = gap_attribution(store)
        entries = load_ledger(store, gaps=gaps)
        hours, energy = store.gpu_hours(lo, hi), store.gpu_energy(lo, hi)
    finally:
        store.close()
    now = time.time()
    rec = reconcile(entries, hours, per, now, gpu_energy=energy, gaps=gaps)
    if not hours and not in_period(entries, per, now):  # nothing measured in it and no job ended in it: say so
        _note_empty(per, entries, now)
    if fmt is TableFmt.table and output is None:
        show(f"Reconciliation with Slurm, period {per.label}", RECONCILE_COLUMNS, [*rec.rows, rec.total])
        for n in rec.notes:
            _note(f"note: {n}")
        return
    _note_not_ended(per, entries, now)  # also among the notes of the JSON and text forms; CSV has none
    text = {TableFmt.json: lambda: reconcile_json(rec) + "\n", TableFmt.csv: lambda: reconcile_csv(rec),
            TableFmt.table: lambda: reconcile_text(rec)}[fmt]()
    _emit(text, output)
    _sign(output, url, data_dir, config, {"report": "reconcile", "format": fmt.value, "rows": len(rec.rows)},
          per.to_dict())


@report_app.command("jobs")
def report_jobs(
    data_dir: DataDir = Path("gpuledger-data"),
    fmt: Annotated[TableFmt, typer.Option("--format")] = TableFmt.table,
    pseudonymize: Pseudo = False,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Per-job measured usage (jobs seen by only one side are marked with *)."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    entries = read_ledger(url, data_dir)
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(url, data_dir))
    rows = job_rows(entries)
    if fmt is TableFmt.json:
        typer.echo(to_json(rows))
    elif fmt is TableFmt.csv:
        typer.echo(to_csv(rows), nl=False)
    else:
        show("Jobs", JOB_COLUMNS, rows)


@report_app.command("job")
def report_job(
    job_id: Annotated[str, typer.Argument(help="the job id (\"1234\", \"1234_7\")")],
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    fmt: Annotated[TextFmt, typer.Option("--format")] = TextFmt.text,
    pseudonymize: Pseudo = False,
    cluster: Annotated[str | None, typer.Option(help="the job's cluster, where two clusters share the id")] = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """One job's efficiency report: Slurm allocation vs observed (coverage); per GPU activity, memory, power,
    energy, events; notes with their numbers."""
    settings = _settings(data_dir, config)
    try:
        rules = jr.Rules.from_mapping(settings.rules)
    except ValueError as e:
        raise _fail(f"{config or data_dir / CONFIG_NAME}: {e}") from None
    url = cli_ledger_url(ledger_url, data_dir, config)
    store = _open_store(url, data_dir)
    try:
        rep = jr.load_job_report(store, job_id, rules, cluster)
    except LookupError as e:
        raise _fail(str(e)) from None
    finally:
        store.close()
    if pseudonymize and rep.record is not None and rep.record.user is not None:
        import dataclasses

        rec = dataclasses.replace(rep.record, user=_alias(url, data_dir)(rep.record.user), uid=None)
        rep = dataclasses.replace(rep, record=rec)
    typer.echo(jr.to_json(rep) if fmt is TextFmt.json else jr.to_text(rep), nl=fmt is TextFmt.json)


@report_app.command("idle")
def report_idle(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    threshold: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="a GPU is idle below this mean SM "
                                                       "activity (default: report.idle_threshold, 0.05)")] = None,
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="list jobs whose idle GPUs hold at least this "
                                             "share of their GPU-time")] = 0.5,
    period: PeriodOpt = None,
    fmt: Annotated[TableFmt, typer.Option("--format")] = TableFmt.table,
    pseudonymize: Pseudo = False,
    ledger_url: LedgerUrl = None,
) -> None:
    """Jobs that held GPUs mostly idle, worst (most idle GPU-hours) first."""
    settings = _settings(data_dir, config)
    try:
        per = parse_period(period) if period else ALL_TIME
    except ReportError as e:
        raise _fail(str(e)) from None
    url = cli_ledger_url(ledger_url, data_dir, config)
    store = _open_store(url, data_dir)
    try:
        everything = load_ledger(store)
    finally:
        store.close()
    now = time.time()
    entries = in_period(everything, per, now)
    if not entries:
        _note_empty(per, everything, now)
    _note_not_ended(per, everything, now)
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(url, data_dir))
    rows = idle_jobs(entries, _per_gpu(entries), settings.idle_threshold if threshold is None else threshold,
                     min_share)
    if fmt is TableFmt.json:
        typer.echo(to_json(rows))
    elif fmt is TableFmt.csv:
        typer.echo(to_csv(rows), nl=False)
    else:
        show("Jobs that held GPUs mostly idle", IDLE_COLUMNS, rows)


# -- audit ----------------------------------------------------------------------------------------------------------
KEY_HELP = ("the signing key (default: $GPULEDGER_AUDIT_KEY, else $XDG_CONFIG_HOME/gpuledger/audit-signing.key); "
            "never in the data dir")
KeyOpt = Annotated[Path | None, typer.Option("--private-key", help=KEY_HELP)]


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
        return True
    except ValueError:
        return False


def _audit_path(ledger_url: str | None, data_dir: Path) -> Path:
    """The data dir's audit log; exit 2 without a data dir, 1 when the log is gone but the ledger is there (or its
    server cannot be reached)."""
    path = data_dir / au.AUDIT_NAME
    if path.exists() or is_postgres_url(ledger_url):
        return path
    if not data_dir.is_dir():
        raise _fail(f"no data directory at {data_dir} (pass --data-dir)")
    try:
        ledger = ledger_exists(ledger_url, data_dir)
    except DatabaseUnavailable as e:
        raise _fail(str(e), 1) from None
    if ledger:
        raise _fail(f"TAMPERED: the audit log {path} is missing (deleted) beside the ledger "
                    f"{ledger_label(ledger_url, data_dir)}", 1)
    raise _fail(f"no audit log at {path}")


def _open(path: Path, data_dir: Path, ledger_url: str | None) -> au.AuditLog:
    try:
        return open_audit(data_dir, ledger_url) if path.name == au.AUDIT_NAME else au.AuditLog(path)
    except au.AuditError as e:
        raise _fail(str(e), 2 if "format 1" in str(e) else 1) from None


@audit_app.command("keygen")
def audit_keygen(
    data_dir: DataDir = Path("gpuledger-data"),
    private_key: KeyOpt = None,
    force: Annotated[bool, typer.Option("--force", help="rotate: replace an existing key; the keyring beside it and an "
                                        "audit entry keep old reports verifiable")] = False,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Create the Ed25519 key pair that signs checkpoints and report manifests (private key 0600, public 0644)."""
    cli_ledger_url(ledger_url, data_dir, config)  # a bad ledger URL is refused before a key is written
    path = private_key or au.default_private_key_path()
    if _inside(path, data_dir):
        raise _fail(f"{path} lies inside the data directory {data_dir}: whoever can rewrite the log could use it; "
                    "choose a path outside (the default is the config dir)")
    try:
        res = au.keygen(path, force=force)
    except (FileExistsError, au.AuditError, OSError) as e:
        raise _fail(str(e)) from None
    if res.rotation is not None and data_dir.is_dir():
        with _open(data_dir / au.AUDIT_NAME, data_dir, None) as log:
            rotation = log.append("key_rotation", res.rotation)
        where = rotation.seq if rotation else "?"
        _note(f"rotation recorded in audit entry {where} and in {au.keyring_path(res.private)}")
    typer.echo(f"private key: {res.private}\npublic key:  {res.public}\nkey id:      {res.key_id}")


@audit_app.command("checkpoint")
def audit_checkpoint(
    data_dir: DataDir = Path("gpuledger-data"),
    private_key: KeyOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write here (default: stdout); ship it off "
                                                   "this machine")] = None,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Sign the audit log's tree head (size, root hash, time, key id) as a checkpoint (a signed note)."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = _audit_path(url, data_dir)
    try:
        key = au.load_signing_key(private_key or au.default_private_key_path())
    except au.AuditError as e:
        raise _fail(str(e)) from None
    with _open(path, data_dir, url) as log:
        try:
            text = au.make_checkpoint(log, key)
        except au.AuditError as e:
            raise _fail(str(e), 1) from None
        log.save_checkpoint(int(text.splitlines()[1]), text)
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
        _note(f"checkpoint of {text.splitlines()[1]} entries written to {output}")


def _trusted(public_keys: list[Path] | None, keyring: Path | None, log: au.AuditLog | None,
             required: bool) -> au.TrustedKeys | None:
    keys = list(public_keys or [])
    default_pub = au.public_path(au.default_private_key_path())
    if not keys and default_pub.exists():
        keys = [default_pub]
    if not keys:
        if required:
            raise _fail(f"no public key to verify signatures with: pass --public-key FILE (none at {default_pub})")
        return None
    rings = [keyring] if keyring is not None else [au.keyring_path(au.default_private_key_path())]
    try:
        return au.trusted_keys(keys, log, rings)
    except au.AuditError as e:
        raise _fail(str(e)) from None


def _store_changes(changes: Iterable[au.StoreChange]) -> str:
    lines = ["job\trecord\tfield\tlogged\tstored\tentry"]
    lines += [f"{c.job_id or '-'}\t{c.what()}\t{c.field}\t{json.dumps(c.logged)}\t"
              f"{json.dumps(c.stored)}\t{c.seq}" for c in changes]
    return "\n".join(lines)


@audit_app.command("verify")
def audit_verify(
    reports: Annotated[list[Path] | None, typer.Argument(help="signed reports (each manifest lies beside it)")] = None,
    data_dir: DataDir = Path("gpuledger-data"),
    checkpoint: Annotated[list[Path] | None, typer.Option(
        "--checkpoint", help="checkpoints the log must extend (repeat: several narrow the first changed entry)"),
    ] = None,
    public_key: Annotated[list[Path] | None, typer.Option("--public-key", help="pin the signing key (default: the "
                                                             "public key beside the default private key)")] = None,
    keyring: Annotated[Path | None, typer.Option("--keyring", help="rotation records linking retired keys to the "
                                                    "pinned one (default: beside the default private key)")] = None,
    store: Annotated[bool, typer.Option("--store", help="also list store rows that disagree with their logged "
                                        "record")] = False,
    feed: Annotated[list[Path] | None, typer.Option("--feed", help="priority feeds (JSON, the flat one beside it) "
                                                    "to compare with the fairshare entry they name (default: the data "
                                                    "dir's, where there is one)")] = None,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Recompute the Merkle log and every fairshare computation it holds, prove it extends every checkpoint and
    signed report, compare the priority feeds with their entries; exit 1 naming the first changed entry or range,
    0 when everything verifies, 2 on bad input. Shows the report settings each signed usage report binds; with
    --config, exit 1 when they are not that file's."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = _audit_path(url, data_dir)
    try:
        cps = read_checkpoints(checkpoint or [])
    except FileNotFoundError as e:
        raise _fail(str(e)) from None
    with _open(path, data_dir, url) as log:
        trusted = _trusted(public_key, keyring, log, required=bool(cps or reports))
        try:
            # the data dir's feed whatever the ledger is (a PostgreSQL log has no directory of its own)
            feeds = feed or [p for p in (data_dir / FEED_NAME,) if p.exists() or flat_path(p).exists()]
            missing = [p for p in feed or () if not (p.exists() or flat_path(p).exists())]
            if missing:
                raise au.AuditError(f"--feed {missing[0]}: no such file (nor {flat_path(missing[0]).name} beside it)")
            v = au.verify_all(log, trusted, cps, reports or [], feeds)
            signed = [(rp, open_manifest(rp, trusted)[0]) for rp in reports or [] if trusted is not None]
        except au.AuditError as e:
            raise _fail(str(e)) from None
        changes = _bind_store(url, data_dir, log, write=False).changes if store else []
    res = v.result
    if res.ok:
        typer.echo(f"audit log {path}: {res.entries} entries, Merkle tree intact, root {res.root.hex()}")
    for h in v.heads:
        if h.ok:
            typer.echo(f"extends {h.head.label()}")
    for n in v.notes:
        _note(n)
    for p in v.problems:
        _note(f"TAMPERED: {p}")
    if reports and v.ok:
        typer.echo(f"report(s) {', '.join(map(str, reports))}: signature, content, input records and audit head verify")
    settings_differ = _report_settings(signed, data_dir, config)
    if store:
        if changes:
            typer.echo(f"TAMPERED: {len(changes)} store field(s) disagree with their logged record:\n"
                       + _store_changes(changes), err=True)  # tab-separated: rich would expand the tabs
        else:
            typer.echo("store: every job and usage record matches its logged record")
    if not v.ok or changes or settings_differ:
        raise typer.Exit(code=1)


def _report_settings(signed: Sequence[tuple[Path, dict[str, Any] | None]], data_dir: Path, config: Path | None
                     ) -> bool:
    """One line per signed usage report: the settings its manifest binds; with ``config``, the settings that differ
    from that file's (their figures would differ). Returns whether any differ."""
    want = bound_settings(_settings(data_dir, config)) if config is not None and signed else None
    differ = False
    for rp, manifest in signed:
        inputs = manifest.get("inputs") if manifest is not None else None
        if not isinstance(inputs, dict) or inputs.get("report") != "usage":
            continue  # unsigned (its problem is reported), or a report computed without report settings
        bound = inputs.get("settings")
        typer.echo(f"report {rp}: {_settings_text(bound)}")
        if want is None:
            continue
        if not isinstance(bound, dict):
            _note(f"DIFFERS: report {rp} binds no report settings (signed before manifests bound them): its prices "
                  f"and CO2e factors cannot be compared with {config}")
            differ = True
            continue
        for k in sorted(set(want) | set(bound)):
            if bound.get(k) != want.get(k):
                _note(f"DIFFERS: report {rp} was computed with {k} {json.dumps(bound.get(k))}, {config} gives "
                      f"{json.dumps(want.get(k))}")
                differ = True
    return differ


def _bind_store(ledger_url: str | None, data_dir: Path, log: au.AuditLog, write: bool,
                accept_reason: str | None = None, now: float | None = None) -> au.Bound:
    store = _open_store(ledger_url, data_dir)
    try:  # everything a charge reads (``accounting.cli.fairshare_rows``), every hour bucket
        jobs, stored, usage = store.jobs(), store.job_records(), store.job_usage()
        per_gpu, gaps, busy = store.job_usage(per_gpu=True), gap_inputs(store).records(), store.busy_hours()
    finally:
        store.close()
    try:
        return au.bind(log, jobs, usage, time.time() if now is None else now, per_gpu=per_gpu, gaps=gaps, busy=busy,
                       stored_jobs=[r for r, _ in stored], write=write, accept_reason=accept_reason)
    except au.EntryDamaged as e:
        raise _fail(f"TAMPERED: {e}", 1) from None
    except au.AuditError as e:
        raise _fail(str(e)) from None


@audit_app.command("proof")
def audit_proof(
    entry: Annotated[int | None,
                     typer.Option("--entry", help="inclusion proof of this entry (numbered from 1)")] = None,
    since: Annotated[int | None, typer.Option("--since", help="consistency proof from this tree size")] = None,
    size: Annotated[int | None, typer.Option("--size", help="in the tree of this size (default: now)")] = None,
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """RFC 9162 proofs as JSON (hex hashes): an entry's inclusion proof, or a consistency proof between sizes."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = _audit_path(url, data_dir)
    with _open(path, data_dir, url) as log:
        try:
            n = log.size() if size is None else size
            if not 0 <= n <= log.size():
                raise ValueError(f"--size {n}: the log has {log.size()} entries")
            if entry is not None:
                # the leaf recomputed from the body: a proof of a stored leaf the body no longer states proves nothing
                e = log.checked(entry)
                if e is None or entry > n:
                    raise ValueError(f"--entry {entry}: no such entry in a tree of {n}")
                doc = {"leaf_index": entry - 1, "tree_size": n, "leaf_hash": e.leaf.hex(), "root": log.root(n).hex(),
                       "inclusion_path": [h.hex() for h in log.inclusion_proof(entry, n)]}
            elif since is not None:
                if not 0 <= since <= n:  # a size the log never had is a wrong question, not a damaged log
                    raise ValueError(f"--since {since}: the log has {n} entries (give 0..{n})")
                res = log.verify()  # every entry the proof covers, rehashed from its body, against the stored tree
                if res.problem is not None and res.problem.first <= n:
                    raise au.EntryDamaged(str(res.problem))
                doc = {"first": since, "second": n, "first_root": log.root(since).hex(),
                       "second_root": log.root(n).hex(),
                       "consistency_path": [h.hex() for h in log.consistency_proof(since, n)]}
            else:
                raise ValueError("give --entry N or --since SIZE")
        except (au.EntryDamaged, LogDamaged) as e:
            raise _fail(f"TAMPERED: {e} (no proof given; run `gpuledger audit verify`)", 1) from None
        except (ValueError, au.AuditError) as e:
            raise _fail(str(e)) from None
    typer.echo(json.dumps(doc, indent=2))


@audit_app.command("explain")
def audit_explain(
    job_id: Annotated[str, typer.Argument()],
    data_dir: DataDir = Path("gpuledger-data"),
    fmt: Annotated[TextFmt, typer.Option("--format")] = TextFmt.text,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """How a job's site factor was derived, step by step, with the audit entries that prove each step."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = _audit_path(url, data_dir)
    with _open(path, data_dir, url) as log:
        try:
            ex = au.explain(log, job_id)
            named = bool(ex.steps) or next(iter(log.entries(job_id=job_id)), None) is not None
        except au.AuditError as e:
            raise _fail(f"TAMPERED: {e}", 1) from None
    if not named and ex.chain_ok:  # a mistyped job id is a wrong question, not an explanation of nothing
        raise _fail(f"job {job_id}: no audit entry names it (not a job of this ledger, or not charged yet)")
    if fmt is TextFmt.json:
        typer.echo(json.dumps(au.plain(ex), indent=2))
    else:
        lines = [f"Job {job_id}: " + ("audit log intact" if ex.chain_ok else f"AUDIT LOG BROKEN: {ex.chain_problem}")]
        for i, s in enumerate(ex.steps, 1):
            refs = ", ".join(f"#{seq} {h[:12]}" for seq, h in s.entries)
            lines.append(f"{i}. {s.name}: {s.summary}\n   proven by {refs}")
        lines += [f"not proven: {m}" for m in ex.missing]
        typer.echo("\n".join(lines))
    if not ex.chain_ok:
        raise typer.Exit(code=1)


@audit_app.command("record")
def audit_record(
    data_dir: DataDir = Path("gpuledger-data"),
    accept_store_changes: Annotated[str | None, typer.Option("--accept-store-changes", metavar="REASON", help="log "
                                    "store rows that differ from their final logged record as corrections")] = None,
    config: ConfigOpt = None,
    ledger_url: LedgerUrl = None,
) -> None:
    """Append the store's job records and per-job usage that the log does not hold yet (final once a job ended)."""
    url = cli_ledger_url(ledger_url, data_dir, config)
    path = data_dir / au.AUDIT_NAME
    if not path.exists():
        _open_store(url, data_dir).close()  # exit 2 without a ledger
    with _open(path, data_dir, url) as log:
        b = _bind_store(url, data_dir, log, write=True, accept_reason=accept_store_changes)
        size, root = log.head()
    if b.changes and accept_store_changes is None:
        raise _fail("store rows disagree with their logged record (nothing appended; --accept-store-changes REASON "
                    "logs them as corrections):\n" + _store_changes(b.changes), 1)
    typer.echo(f"appended {b.appended} record(s); tree size {size}, root {root}")


@audit_app.command("retention")
def audit_retention(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    days: Annotated[float | None, typer.Option(min=0.0, help="default: report.retention_days")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="also records still inside the fairshare decay horizon")
    ] = False,
    ledger_url: LedgerUrl = None,
) -> None:
    """Pseudonymize user names in the store's job records that ended more than N days ago (records still inside
    the decay horizon, 10 half-lives or since the last usage reset, only with --force)."""
    from gpuledger.accounting.config import ConfigError, accounting_settings, load_config
    from gpuledger.accounting.privacy import apply_retention, decay_horizon_start

    settings = _settings(data_dir, config)
    url = cli_ledger_url(ledger_url, data_dir, config)
    days = settings.retention_days if days is None else days
    if days is None:
        raise _fail("no retention period: pass --days or set report.retention_days")
    cfg_path = config or data_dir / "gpuledger.toml"
    try:
        acct = accounting_settings(load_config(cfg_path) if cfg_path.exists() else {}, cfg_path)
    except ConfigError as e:
        raise _fail(str(e)) from None
    horizon = None if force else decay_horizon_start(time.time(), acct.half_life_s, acct.usage_reset,
                                                     acct.timezone or None)
    _open_store(url, data_dir).close()  # exit 2 without a ledger; an older one is migrated to today's tables
    try:
        n = apply_retention(url, data_dir, _alias(url, data_dir), days, horizon_start=horizon)
    except DatabaseUnavailable as e:
        raise _fail(str(e), 1) from None
    except (OSError, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"pseudonymized {n} job record(s) that ended more than {days:g} days ago")
