"""Rendering shared by the reports: columns are (header, cell function) pairs; rich tables for a terminal,
fixed-width text for files and pipes (never truncated), JSON and CSV of dataclass rows for machines."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

Columns = Sequence[tuple[str, Callable[[Any], str]]]


def to_json(rows: Sequence[Any]) -> str:
    """Dataclass rows as a JSON array of objects."""
    return json.dumps([asdict(r) for r in rows], indent=2)


def to_csv(rows: Sequence[Any]) -> str:
    """Dataclass rows as CSV with a header of their field names."""
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return buf.getvalue()


def exact_csv(rows: Sequence[Any], header: Mapping[str, str] | None = None) -> str:
    """Dataclass rows as CSV at full float precision (``repr``), so the file reconciles like the numbers;
    None is an empty cell. ``header`` renames columns (field name -> header)."""
    buf = io.StringIO()
    if rows:
        names = [f.name for f in fields(rows[0])]
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([(header or {}).get(n, n) for n in names])
        for r in rows:
            w.writerow(["" if (v := getattr(r, n)) is None else repr(v) if isinstance(v, float) else v for n in names])
    return buf.getvalue()


def fmt_optional(v: float | None, spec: str) -> str:
    """``v`` formatted by ``spec``, "-" when unknown."""
    return "-" if v is None else format(v, spec)


LEFT = ("Job", "User", "Account")  # text columns; the rest are numbers, right-aligned


def rich_table(title: str, columns: Columns, rows: Sequence[Any]) -> Table:
    from rich.table import Table

    t = Table(title=title)
    for name, _ in columns:
        t.add_column(name, justify="left" if name in LEFT else "right")
    for r in rows:
        t.add_row(*(f(r) for _, f in columns))
    return t


def show(title: str, columns: Columns, rows: Sequence[Any]) -> None:
    """Print rows for people (gpuledger.output.print_table: rich on a terminal, plain text in a pipe)."""
    from gpuledger.output import print_table

    print_table(title, [name for name, _ in columns], [[f(r) for _, f in columns] for r in rows],
                [name in LEFT for name, _ in columns])


def plain_table(columns: Columns, rows: Sequence[Any]) -> str:
    """A fixed-width text table (for files and pipes)."""
    cells = [[name for name, _ in columns]] + [[f(r) for _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells) + "\n"
