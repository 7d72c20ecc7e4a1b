"""Rendering fairshare rows the way sshare does, and parsing sshare's and the usage CSV's text.

* :func:`render_table` is ``sshare -a -l`` (fixed width: Account left-aligned and indented one space
  per level, numbers right-aligned, ``%f`` doubles, truncated RawUsage). sshare's widths are the
  minimums: where sshare would cut a value to ``name+`` (or a number to ``%e``), the column widens
  to its longest value instead, so two long names never print alike. GrpTRESMins/TRESRunMins are
  left out: gpuledger has no TRES limits to show. LevelFS is shown when any row has one (Fair
  Tree); classic sshare prints no LevelFS column.
* :func:`render_parsable` is the same as ``sshare -a -l -P``.
* :func:`to_json` / :func:`render_csv` are for machines: full precision, ``raw_shares`` a number or
  ``"parent"`` (null on the root row), ``level_fs`` a number, ``"inf"`` or null.
* :func:`parse_sshare_parsable` reads real ``sshare -l -P`` output back into rows (for tests and
  reconciliation); :func:`parse_usage_csv` reads ``account,user,usage``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from typing import Any

from gpuledger.accounting.associations import PARENT, AssociationError, parse_shares
from gpuledger.accounting.fairshare import Row, UsageError
from gpuledger.output import csv_text, display_text, display_width, pad

# (header, width, getter). A negative width is left-aligned, as in sshare's print_fields table; the width is
# sshare's, a minimum here (render_table widens a column rather than truncate).
_Column = tuple[str, int, Callable[[Row], Any]]


def _account_cell(r: Row) -> str:
    return " " * r.depth + r.account


_COLUMNS: list[_Column] = [
    ("Account", -20, _account_cell),
    ("User", 10, lambda r: r.user),
    ("RawShares", 10, lambda r: r.raw_shares),
    ("NormShares", 11, lambda r: r.norm_shares),
    ("RawUsage", 11, lambda r: None if r.raw_usage is None else int(r.raw_usage)),
    ("NormUsage", 11, lambda r: r.norm_usage),
    ("EffectvUsage", 13, lambda r: r.effective_usage),
    ("FairShare", 10, lambda r: r.fairshare),
    ("LevelFS", 10, lambda r: r.level_fs),
]


def _columns(rows: Sequence[Row], level_fs: bool | None) -> list[_Column]:
    show = any(r.level_fs is not None for r in rows) if level_fs is None else level_fs
    return _COLUMNS if show else _COLUMNS[:-1]


def _text(value: Any) -> str:
    """The parsable text of one cell (sshare prints floats with %f, nothing for None)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:f}"
    return str(value)


def render_table(rows: Sequence[Row], level_fs: bool | None = None) -> str:
    """``sshare -a -l`` fixed-width text (trailing spaces stripped): each cell plus a trailing space, as sshare's
    print_fields_* print them, in columns as wide as sshare's or as their longest value (never truncated; control
    characters escaped, display widths, as gpuledger.output's tables)."""
    cols = _columns(rows, level_fs)
    body = [[display_text(_text(get(r))) for _, _, get in cols] for r in rows]
    widths = [max([abs(w), *(display_width(line[i]) for line in body)]) for i, (_, w, _) in enumerate(cols)]
    lefts = [w < 0 for _, w, _ in cols]

    def line(cells: Sequence[str]) -> str:
        return "".join(pad(c, n, lf) + " " for c, n, lf in zip(cells, widths, lefts)).rstrip()

    return "\n".join([line([h for h, _, _ in cols]), line(["-" * n for n in widths]), *map(line, body)]) + "\n"


def render_parsable(rows: Sequence[Row], level_fs: bool | None = None) -> str:
    """``sshare -a -l -P`` text, without the TRES columns."""
    cols = _columns(rows, level_fs)
    lines = ["|".join(h for h, _, _ in cols)]
    for r in rows:
        lines.append("|".join(_text(get(r)) for _, _, get in cols))
    return "\n".join(lines) + "\n"


def _json_number(value: float | None) -> float | str | None:
    if value is None:
        return None
    if math.isinf(value):
        return "inf"
    return value


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """JSON-ready objects in sshare's order (see the module docstring for the keys)."""
    return [
        {
            "account": r.account,
            "user": r.user,
            "raw_shares": r.raw_shares,
            "norm_shares": r.norm_shares,
            "raw_usage": r.raw_usage,
            "norm_usage": r.norm_usage,
            "effective_usage": r.effective_usage,
            "fairshare": r.fairshare,
            "level_fs": _json_number(r.level_fs),
        }
        for r in rows
    ]


_CSV_KEYS = ("account", "user", "raw_shares", "norm_shares", "raw_usage", "norm_usage",
             "effective_usage", "fairshare", "level_fs", "depth")


def render_csv(rows: Sequence[Row]) -> str:
    """CSV with the JSON keys plus depth; empty cells where sshare prints nothing; repr floats."""
    return csv_text(_CSV_KEYS, ([
        r.account, r.user or "", "" if r.raw_shares is None else r.raw_shares,
        *("" if v is None else ("inf" if isinstance(v, float) and math.isinf(v) else v)
          for v in (r.norm_shares, r.raw_usage, r.norm_usage, r.effective_usage, r.fairshare, r.level_fs)),
        r.depth,
    ] for r in rows))


class SshareParseError(ValueError):
    """Bad sshare text; the message names the line and column."""


def parse_sshare_parsable(text: str) -> list[Row]:
    """Parse ``sshare [-a] [-l] -P`` output (header line required) into rows.

    RawUsage comes back as the integer sshare printed; blank cells are None; ``depth`` is the
    Account column's indentation. Columns other than Row's (GrpTRESMins, ...) are ignored; columns
    that ``sshare`` without ``-l`` omits come back as None.
    """
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise SshareParseError("sshare output: empty")
    n0, head = lines[0]
    header = head.split("|")
    if header and header[-1] == "":
        header = header[:-1]
    col = {name: i for i, name in enumerate(header)}
    for need in ("Account", "User", "RawShares", "NormShares", "RawUsage", "EffectvUsage", "FairShare"):
        if need not in col:
            raise SshareParseError(f"sshare output line {n0}: header lacks {need!r} (is this -P output?)")
    rows: list[Row] = []
    for n, line in lines[1:]:
        fields = line.split("|")
        if len(fields) == len(header) + 1 and fields[-1] == "":
            fields = fields[:-1]
        if len(fields) != len(header):
            raise SshareParseError(f"sshare output line {n}: {len(fields)} fields, expected {len(header)}")

        def cell(name: str, fields: list[str] = fields) -> str | None:
            i = col.get(name)
            return None if i is None else fields[i]

        def num(name: str, n: int = n) -> float | None:
            v = cell(name)
            if v is None or v == "":
                return None
            try:
                return float(v)
            except ValueError:
                raise SshareParseError(f"sshare output line {n}: {name} {v!r} is not a number") from None

        acct_cell = cell("Account") or ""
        account = acct_cell.strip()
        if not account:
            raise SshareParseError(f"sshare output line {n}: empty Account")
        raw_shares_text = cell("RawShares") or ""
        raw_shares: int | str | None
        if raw_shares_text == "":
            raw_shares = None
        else:
            try:
                raw_shares = parse_shares(raw_shares_text, f"sshare output line {n}")
            except AssociationError as e:
                raise SshareParseError(str(e)) from None
        raw_usage = num("RawUsage")
        if raw_usage is None:
            raise SshareParseError(f"sshare output line {n}: empty RawUsage")
        norm_shares = num("NormShares")
        eff = num("EffectvUsage")
        rows.append(Row(
            account=account,
            user=(cell("User") or None),
            raw_shares=raw_shares,
            norm_shares=0.0 if norm_shares is None else norm_shares,
            raw_usage=raw_usage,
            norm_usage=num("NormUsage"),
            effective_usage=0.0 if eff is None else eff,
            fairshare=num("FairShare"),
            level_fs=num("LevelFS"),
            depth=len(acct_cell) - len(acct_cell.lstrip(" ")),
        ))
    return rows


def parse_usage_csv(text: str) -> dict[tuple[str, str | None], float]:
    """Parse ``account,user,usage`` (raw, already decayed usage of each user association)."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        raise UsageError("usage CSV: empty input") from None
    if sorted(header) != ["account", "usage", "user"]:
        raise UsageError(f"usage CSV line 1: header must be account,user,usage (got {header})")
    col = {name: i for i, name in enumerate(header)}
    usage: dict[tuple[str, str | None], float] = {}
    first_line: dict[tuple[str, str | None], int] = {}
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 3:
            raise UsageError(f"usage CSV line {line}: {len(row)} fields, expected 3")
        account, user, value = (row[col[k]].strip() for k in ("account", "user", "usage"))
        if not account or not user:
            raise UsageError(f"usage CSV line {line}: account and user are required (user associations only)")
        try:
            v = float(value)
        except ValueError:
            raise UsageError(f"usage CSV line {line}: usage {value!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise UsageError(f"usage CSV line {line}: usage {value!r} must be finite and >= 0")
        key = (account, user)
        if key in usage:
            raise UsageError(f"usage CSV line {line}: duplicate {account}/{user} (first on line {first_line[key]})")
        usage[key] = v
        first_line[key] = line
    return usage


__all__ = [
    "PARENT", "render_table", "render_parsable", "render_csv", "to_json", "parse_sshare_parsable",
    "parse_usage_csv", "SshareParseError",
]
