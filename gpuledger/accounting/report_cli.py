"""`gpuledger report ...` and `gpuledger audit ...`. Library code raises; only this module exits.

Exit codes: 0 fine, 1 a check failed (`audit verify` found tampering), 2 bad input (missing store, bad date,
bad configuration).
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from gpuledger.accounting import audit as au
from gpuledger.accounting import jobreport as jr
from gpuledger.accounting.privacy import pseudonymize_entries
from gpuledger.accounting.report.errors import ReportError
from gpuledger.accounting.report.idle import IDLE_COLUMNS, idle_jobs
from gpuledger.accounting.report.jobs import JOB_COLUMNS, job_rows
from gpuledger.accounting.report.period import ALL_TIME, in_period, parse_period
from gpuledger.accounting.report.settings import load_report_settings, ReportSettings
from gpuledger.accounting.report.tables import rich_table, to_csv, to_json
from gpuledger.accounting.report.usage import usage_columns, usage_report, usage_report_csv, usage_report_json, usage_report_text
from gpuledger.accounting.ledger import load as load_ledger

STORE_NAME = "gpuledger.sqlite"
CONFIG_NAME = "gpuledger.toml"

DataDir = Annotated[
    Path, typer.Option("--data-dir", envvar="GPULEDGER_DATA_DIR", help="Where the embedded store and outputs live."),
]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML configuration (default: <data-dir>/gpuledger.toml).")]
Pseudo = Annotated[bool, typer.Option("--pseudonymize", help="Replace user names by stable keyed pseudonyms (HMAC-SHA256).")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of stdout; signed when "
                                                   "the data dir has an audit signing key (see `audit keygen`).")]

console = Console()
err = Console(stderr=True)

report_app = typer.Typer(help="Usage reports for admins and auditors.", no_args_is_help=True)
audit_app = typer.Typer(help="The tamper-evident audit trail and signed reports.", no_args_is_help=True)


class UsageFmt(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    html = "html"


class TableFmt(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


class TextFmt(str, Enum):
    text = "text"
    json = "json"


class By(str, Enum):
    account = "account"
    user = "user"
    partition = "partition"
    model = "model"
    node = "node"


def _fail(msg: str, code: int = 2) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)


def _note(msg: str) -> None:
    """A message on stderr, never wrapped (paths and hashes stay whole and greppable)."""
    err.print(msg, markup=False, highlight=False, soft_wrap=True)


def _open_store(data_dir: Path):  # -> collector.store.SqliteStore
    from gpuledger.collector.store import SqliteStore

    path = data_dir / STORE_NAME
    if not path.exists():
        raise _fail(f"no gpuledger store at {path} (run `gpuledger demo` or a collector first, or pass --data-dir)")
    return SqliteStore(path)


def _settings(data_dir: Path, config: Path | None) -> ReportSettings:
    try:
        return load_report_settings(data_dir, config)
    except ReportError as e:
        raise _fail(str(e)) from None


def _alias(data_dir: Path):
    from gpuledger.accounting.privacy import Pseudonymizer

    return Pseudonymizer.for_data_dir(data_dir)


def _per_gpu(store) -> dict[str, list]:
    out: dict[str, list] = {}
    for u in store.job_usage(per_gpu=True):
        out.setdefault(u.job_id, []).append(u)
    return out


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)


def _sign(output: Path | None, data_dir: Path, config: Path | None, inputs: dict[str, Any], period: dict[str, Any]) -> None:
    """Sign a written report when a key exists; say so either way (an unsigned report is not an error)."""
    if output is None:
        return
    if not (data_dir / au.PRIVATE_KEY_NAME).exists():
        _note(f"report written to {output} (unsigned: no key in {data_dir}; run `gpuledger audit keygen`)")
        return
    cfg = config or data_dir / CONFIG_NAME
    inputs = {**inputs, "store": str(data_dir / STORE_NAME),
              "config": {"path": str(cfg), "sha256": hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.exists() else None}}
    try:
        with au.open_log(data_dir) as log:
            m = au.sign_report(output, data_dir, inputs=inputs, period=period, log=log)
    except au.AuditError as e:
        raise _fail(str(e)) from None
    _note(f"report written to {output}, signed manifest {m}")


# -- report ---------------------------------------------------------------------------------------------------------
@report_app.command("usage")
def report_usage(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    start: Annotated[Optional[str], typer.Option("--from", help="YYYY-MM-DD or ISO date-time (UTC), inclusive")] = None,
    end: Annotated[Optional[str], typer.Option("--to", help="YYYY-MM-DD or ISO date-time (UTC), exclusive")] = None,
    period: Annotated[Optional[str], typer.Option("--period", help="YYYY, YYYY-MM or YYYY-MM-DD (UTC)")] = None,
    by: Annotated[By, typer.Option("--by")] = By.account,
    fmt: Annotated[UsageFmt, typer.Option("--format")] = UsageFmt.table,
    pseudonymize: Pseudo = False,
    output: OutputOpt = None,
) -> None:
    """Per group: GPU-hours allocated and SM-active, efficiency, HBM, energy, CO2e, cost, idle GPU-hours, queue
    wait. Jobs count whole in the period they ended; totals are exactly the sum of the job records."""
    try:
        per = parse_period(period, start, end)
    except ReportError as e:
        raise _fail(str(e)) from None
    settings = _settings(data_dir, config)
    store = _open_store(data_dir)
    try:
        entries = load_ledger(store)
        per_gpu = _per_gpu(store) if by is By.node else None
    finally:
        store.close()
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(data_dir))
    try:
        rep = usage_report(entries, by.value, per, settings, per_gpu)
    except ReportError as e:
        raise _fail(str(e)) from None
    if fmt is UsageFmt.table and output is None:
        console.print(rich_table(f"GPU usage by {by.value}, period {per.label}", usage_columns(by.value, rep.currency),
                                     [*rep.rows, rep.total]))
        return
    if fmt is UsageFmt.json:
        text = usage_report_json(rep) + "\n"
    elif fmt is UsageFmt.csv:
        text = usage_report_csv(rep)
    elif fmt is UsageFmt.html:
        from gpuledger.accounting.html import render_html

        with au.open_log(data_dir) as log:
            seq, head = log.head()
        text = render_html(rep, entries, f"GPU usage by {by.value}, {per.label}",
                           manifest={"audit log head": f"entry {seq}, {head[:16]}...", "pseudonymized": pseudonymize})
    else:
        text = usage_report_text(rep)
    _emit(text, output)
    _sign(output, data_dir, config, {"report": "usage", "by": by.value, "format": fmt.value, "jobs": rep.total.jobs,
                                     "pseudonymized": pseudonymize}, per.to_dict())


@report_app.command("jobs")
def report_jobs(
    data_dir: DataDir = Path("gpuledger-data"),
    fmt: Annotated[TableFmt, typer.Option("--format")] = TableFmt.table,
    pseudonymize: Pseudo = False,
) -> None:
    """Per-job measured usage (jobs seen by only one side are marked with *)."""
    store = _open_store(data_dir)
    try:
        entries = load_ledger(store)
    finally:
        store.close()
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(data_dir))
    rows = job_rows(entries)
    if fmt is TableFmt.json:
        typer.echo(to_json(rows))
    elif fmt is TableFmt.csv:
        typer.echo(to_csv(rows), nl=False)
    else:
        console.print(rich_table("Jobs", JOB_COLUMNS, rows))


@report_app.command("job")
def report_job(
    job_id: Annotated[str, typer.Argument(help="the job id (\"1234\", \"1234_7\")")],
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    fmt: Annotated[TextFmt, typer.Option("--format")] = TextFmt.text,
    pseudonymize: Pseudo = False,
) -> None:
    """One job's efficiency report: per GPU activity, memory, power, energy, events; notes with their numbers."""
    settings = _settings(data_dir, config)
    try:
        rules = jr.Rules.from_mapping(settings.rules)
    except ValueError as e:
        raise _fail(f"{config or data_dir / CONFIG_NAME}: {e}") from None
    store = _open_store(data_dir)
    try:
        rep = jr.load_job_report(store, job_id, rules)
    except LookupError as e:
        raise _fail(str(e)) from None
    finally:
        store.close()
    if pseudonymize and rep.record is not None and rep.record.user is not None:
        import dataclasses

        rec = dataclasses.replace(rep.record, user=_alias(data_dir)(rep.record.user), uid=None)
        rep = dataclasses.replace(rep, record=rec)
    typer.echo(jr.to_json(rep) if fmt is TextFmt.json else jr.to_text(rep), nl=fmt is TextFmt.json)


@report_app.command("idle")
def report_idle(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    threshold: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="a GPU is idle below this mean SM "
                                                       "activity (default: report.idle_threshold, 0.05)")] = None,
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="list jobs whose idle GPUs hold at least this "
                                             "share of their GPU-time")] = 0.5,
    period: Annotated[Optional[str], typer.Option("--period", help="YYYY, YYYY-MM or YYYY-MM-DD (UTC)")] = None,
    fmt: Annotated[TableFmt, typer.Option("--format")] = TableFmt.table,
    pseudonymize: Pseudo = False,
) -> None:
    """Jobs that held GPUs mostly idle, worst (most idle GPU-hours) first."""
    settings = _settings(data_dir, config)
    try:
        per = parse_period(period) if period else ALL_TIME
    except ReportError as e:
        raise _fail(str(e)) from None
    store = _open_store(data_dir)
    try:
        entries = in_period(load_ledger(store), per)
        per_gpu = _per_gpu(store)
    finally:
        store.close()
    if pseudonymize:
        entries = pseudonymize_entries(entries, _alias(data_dir))
    rows = idle_jobs(entries, per_gpu, settings.idle_threshold if threshold is None else threshold, min_share)
    if fmt is TableFmt.json:
        typer.echo(to_json(rows))
    elif fmt is TableFmt.csv:
        typer.echo(to_csv(rows), nl=False)
    else:
        console.print(rich_table("Jobs that held GPUs mostly idle", IDLE_COLUMNS, rows))


# -- audit ----------------------------------------------------------------------------------------------------------
@audit_app.command("keygen")
def audit_keygen(
    data_dir: DataDir = Path("gpuledger-data"),
    force: Annotated[bool, typer.Option("--force", help="replace an existing key (old reports then fail to verify)")] = False,
) -> None:
    """Create the Ed25519 key pair that signs report manifests (private key mode 0600)."""
    try:
        priv, pub = au.keygen(data_dir, force=force)
    except FileExistsError as e:
        raise _fail(str(e)) from None
    typer.echo(f"private key: {priv}\npublic key:  {pub}")


@audit_app.command("verify")
def audit_verify(
    report: Annotated[Optional[Path], typer.Argument(help="a signed report (its manifest lies beside it)")] = None,
    data_dir: DataDir = Path("gpuledger-data"),
) -> None:
    """Check the audit log's hash chain (and a report's signature); exit 1 naming the first bad entry."""
    path = data_dir / au.AUDIT_NAME
    if not path.exists():
        raise _fail(f"no audit log at {path}")
    with au.AuditLog(path) as log:
        res = log.verify()
        problems = au.verify_report(report, data_dir, log) if report is not None else []
    if res.ok:
        typer.echo(f"audit log {path}: {res.entries} entries, chain intact, head {res.head_seq} {res.head_hash}")
    else:
        _note(f"TAMPERED: {res.problem} (entries 1..{res.head_seq} verify)")
    for p in problems:
        _note(f"REPORT: {p}")
    if report is not None and not problems:
        typer.echo(f"report {report}: signature, content and audit head verify")
    if not res.ok or problems:
        raise typer.Exit(code=1)


@audit_app.command("explain")
def audit_explain(
    job_id: Annotated[str, typer.Argument()],
    data_dir: DataDir = Path("gpuledger-data"),
    fmt: Annotated[TextFmt, typer.Option("--format")] = TextFmt.text,
) -> None:
    """How a job's site factor was derived, step by step, with the audit entries (seq, hash) that prove it."""
    path = data_dir / au.AUDIT_NAME
    if not path.exists():
        raise _fail(f"no audit log at {path}")
    with au.open_log(data_dir) as log:
        ex = au.explain(log, job_id)
    if fmt is TextFmt.json:
        typer.echo(json.dumps(au.plain(ex), indent=2))
    else:
        chain = ex.chain
        lines = [f"Job {job_id}: " + ("audit chain intact" if chain and chain.ok else f"AUDIT CHAIN BROKEN: {chain.problem if chain else ''}")]
        for i, s in enumerate(ex.steps, 1):
            refs = ", ".join(f"#{seq} {h[:12]}" for seq, h in s.entries)
            lines.append(f"{i}. {s.name}: {s.summary}\n   proven by {refs}")
        lines += [f"not proven: {m}" for m in ex.missing]
        typer.echo("\n".join(lines))
    if ex.chain is not None and not ex.chain.ok:
        raise typer.Exit(code=1)


@audit_app.command("record")
def audit_record(data_dir: DataDir = Path("gpuledger-data")) -> None:
    """Append the store's job records and per-job usage to the audit log (unchanged ones are skipped)."""
    store = _open_store(data_dir)
    try:
        jobs, usage = store.jobs(), store.job_usage()
    finally:
        store.close()
    with au.open_log(data_dir) as log:
        n_jobs, n_usage = au.record_job_records(log, jobs), au.record_usage(log, usage)
        seq, head = log.head()
    typer.echo(f"appended {n_jobs} job record(s) and {n_usage} usage record(s); head {seq} {head}")


@audit_app.command("retention")
def audit_retention(
    data_dir: DataDir = Path("gpuledger-data"),
    config: ConfigOpt = None,
    days: Annotated[Optional[float], typer.Option(min=0.0, help="default: report.retention_days")] = None,
) -> None:
    """Pseudonymize user names in the store's job records that ended more than N days ago."""
    from gpuledger.accounting.privacy import apply_retention

    settings = _settings(data_dir, config)
    days = settings.retention_days if days is None else days
    if days is None:
        raise _fail("no retention period: pass --days or set report.retention_days")
    try:
        n = apply_retention(data_dir / STORE_NAME, _alias(data_dir), days)
    except (OSError, ValueError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"pseudonymized {n} job record(s) that ended more than {days:g} days ago")
