"""Rendering shared by the reports: columns are (header, cell function) pairs; rich tables for a terminal,
fixed-width text for files and pipes (never truncated; ``show`` picks), JSON and CSV of dataclass rows for
machines."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any, Generic, TypeVar

from gpuledger.output import csv_text

Columns = Sequence[tuple[str, Callable[[Any], str]]]
R = TypeVar("R")


class Rows(list[R], Generic[R]):
    """A list of dataclass rows that knows their type, so that CSV of no rows still has its header."""

    def __init__(self, row_type: type[R], rows: Iterable[R] = ()) -> None:
        super().__init__(rows)
        self.row_type = row_type


def _names(rows: Sequence[Any], row_type: type | None) -> list[str] | None:
    """The CSV columns: the row type's fields (given, carried by ``Rows``, or the first row's); None if unknown."""
    row_type = row_type or getattr(rows, "row_type", None) or (type(rows[0]) if rows else None)
    return None if row_type is None else [f.name for f in fields(row_type)]


def to_json(rows: Sequence[Any]) -> str:
    """Dataclass rows as a JSON array of objects."""
    return json.dumps([asdict(r) for r in rows], indent=2)


def to_csv(rows: Sequence[Any], row_type: type | None = None) -> str:
    """Dataclass rows as CSV (``gpuledger.output.csv_text``) with a header of their field names, also when there
    are no rows (the columns come from ``row_type``, else from ``Rows``): the column set never depends on the
    data."""
    names = _names(rows, row_type)
    if names is None:
        return ""
    return csv_text(names, ([d[n] for n in names] for d in map(asdict, rows)), lineterminator="\r\n")


def exact_csv(rows: Sequence[Any], header: Mapping[str, str] | None = None, row_type: type | None = None) -> str:
    """Dataclass rows as CSV (``gpuledger.output.csv_text``) at full float precision (``repr``), so the file
    reconciles like the numbers; None is an empty cell. ``header`` renames columns (field name -> header); the
    header is there without rows too (as in :func:`to_csv`)."""
    names = _names(rows, row_type)
    if names is None:
        return ""
    return csv_text([(header or {}).get(n, n) for n in names], ([getattr(r, n) for n in names] for r in rows))


def fmt_optional(v: float | None, spec: str) -> str:
    """``v`` formatted by ``spec``, "-" when unknown."""
    return "-" if v is None else format(v, spec)


LEFT = ("Job", "User", "Account")  # text columns; the rest are numbers, right-aligned


def show(title: str, columns: Columns, rows: Sequence[Any]) -> None:
    """Print rows for people (gpuledger.output.print_table: rich on a terminal, plain text in a pipe)."""
    from gpuledger.output import print_table

    print_table(title, [name for name, _ in columns], [[f(r) for _, f in columns] for r in rows],
                [name in LEFT for name, _ in columns])


def plain_table(columns: Columns, rows: Sequence[Any]) -> str:
    """A fixed-width text table (for files and pipes), every column left-aligned; display widths and escaped
    control characters as ``gpuledger.output.plain_table``, which draws it."""
    from gpuledger.output import plain_table as draw

    return draw([name for name, _ in columns], [[f(r) for _, f in columns] for r in rows], [True] * len(columns))
