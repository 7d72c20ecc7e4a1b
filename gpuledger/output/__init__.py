"""How commands print, in one place: ``--format table|json|csv``; tables for people, JSON and CSV for machines.

- Tables: a rich table on a terminal; in a pipe or file the same table as plain fixed-width text, never truncated
  and never wrapped (UUIDs and paths stay whole). Units for people: GiB, kWh, W, percentages. A cell's control
  characters are shown escaped (``\\n``), so a name holding a line break cannot split a row; widths are display
  widths (a CJK character takes two columns).
- JSON and CSV: the records' own fields in SI base units, ratios as 0..1 (what ``gpuledger.schema`` carries).

Imports nothing of ours, so every part's command-line module can use it (like ``gpuledger.schema``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

FORMAT_HELP = ("table for people; json or csv for machines (SI units, ratios 0..1; a CSV text cell that starts with "
               "= + - @ or a tab gets a leading ' so that no spreadsheet runs it as a formula)")


class Format(StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


def is_terminal(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def console(stderr: bool = False) -> Any:
    """A rich Console that never truncates: the terminal's width on a terminal, unbounded in a pipe."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if is_terminal(stream):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=1_000_000, no_color=True, highlight=False, soft_wrap=True)


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its header for people (with the unit), the record key for JSON/CSV, and how a value reads in
    the table (``cell``; "-" for None)."""

    header: str
    key: str
    cell: Callable[[Any], str] = str
    left: bool = False


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def gib(n_bytes: float | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / 2**30:.1f}"


def fixed(digits: int, scale: float = 1.0) -> Callable[[float | None], str]:
    return lambda v: "-" if v is None else f"{v * scale:.{digits}f}"


_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# control and format characters (line breaks, escape sequences, bidi overrides, zero-width marks), and the
# line/paragraph separators some terminals break lines at
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(c: str) -> str:
    if unicodedata.category(c) not in _ESCAPED_CATEGORIES:
        return c
    n = ord(c)
    return _SHORT_ESCAPES.get(c) or (f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")


def display_text(text: str) -> str:
    """``text`` for a table cell: control characters escaped (``\\n``, ``\\x1b``, ``\\u202e``), the rest as is."""
    if text.isprintable():  # the common case; isprintable is False for every escaped category
        return text
    return "".join(_escape(c) for c in text)


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide and fullwidth characters (CJK) two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.category(c) in ("Mn", "Me") else 2 if unicodedata.east_asian_width(c) in ("W", "F")
               else 1 for c in text)


def pad(text: str, width: int, left: bool = True) -> str:
    """``text`` padded with spaces to ``width`` display columns (``str.ljust``/``rjust`` count characters)."""
    fill = " " * max(0, width - display_width(text))
    return text + fill if left else fill + text


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[bool]) -> str:
    """Fixed-width text: columns as wide as their widest cell (display width), text left and numbers right;
    control characters escaped (:func:`display_text`)."""
    cells = [[display_text(c) for c in line] for line in [headers, *rows]]
    widths = [max(display_width(c[i]) for c in cells) for i in range(len(headers))]
    out = []
    for line in cells:
        out.append("  ".join(pad(c, w, lf) for c, w, lf in zip(line, widths, left)).rstrip())
    return "\n".join(out) + "\n"


def _cells(columns: Sequence[Column], record: Mapping[str, Any]) -> list[str]:
    return ["-" if record.get(c.key) is None else c.cell(record.get(c.key)) for c in columns]


# What makes a spreadsheet (Excel, LibreOffice, Sheets) take a cell as a formula (OWASP, "CSV Injection"); a user,
# account or partition name is anyone's text, and the CSV goes to whoever bills by it.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """``value`` for a CSV cell: text that starts like a formula gets a leading ``'`` (shown as text, not run);
    numbers and everything else as they are (-1.5 is a number, not text)."""
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_START) else value


def csv_text(header: Sequence[str], rows: Iterable[Sequence[Any]], lineterminator: str = "\n") -> str:
    """The one CSV writer: ``header``, then ``rows``, each cell :func:`csv_cell`; None is an empty cell, a float
    its shortest exact text (``repr``: the file reconciles to the last digit)."""
    buf = io.StringIO()
    # rows end in CRLF here, so that a cell holding a CR is quoted like one holding a LF (with a LF terminator the
    # csv module leaves a CR bare, which ends the row in a spreadsheet: "x\r=cmd" would start a row with a formula)
    w = csv.writer(buf, lineterminator="\r\n")
    lines = []
    for row in (header, *([csv_cell(v) for v in row] for row in rows)):
        w.writerow(row)
        lines.append(buf.getvalue()[:-2] + lineterminator)
        buf.seek(0)
        buf.truncate()
    return "".join(lines)


def to_csv(columns: Sequence[Column] | None, records: Sequence[Mapping[str, Any]]) -> str:
    """CSV (:func:`csv_text`) with the records' keys as header (``columns`` chooses and orders them; all keys
    without)."""
    keys = [c.key for c in columns] if columns else (list(records[0]) if records else [])
    return csv_text(keys, ([r.get(k) for k in keys] for r in records))


def print_table(title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]],
                left: Sequence[bool]) -> None:
    """Cells already formatted for people: a rich table on a terminal, fixed-width text in a pipe or a file."""
    if is_terminal():
        from rich.table import Table
        from rich.text import Text

        t = Table(title=title)
        for h, lf in zip(headers, left):
            t.add_column(h, justify="left" if lf else "right")
        for r in rows:
            # Text, not markup: a "[bold]" in a name is the name
            t.add_row(*(Text(display_text(c)) for c in r))
        console().print(t)
    else:
        sys.stdout.write((f"{title}\n\n" if title else "") + plain_table(headers, rows, left))


def emit(fmt: Format, records: Sequence[Mapping[str, Any]], columns: Sequence[Column], title: str | None = None,
         json_doc: Any = None) -> None:
    """Print ``records`` as ``fmt``: a table of ``columns``; JSON of the whole records (or ``json_doc``); CSV of the
    columns' keys."""
    if fmt is Format.json:
        sys.stdout.write(json.dumps(records if json_doc is None else json_doc, indent=2) + "\n")
    elif fmt is Format.csv:
        sys.stdout.write(to_csv(columns, records))
    else:
        print_table(title, [c.header for c in columns], [_cells(columns, r) for r in records],
                    [c.left for c in columns])


def error(message: str) -> None:
    """``error: <message>`` on stderr as one line, whatever line breaks the message holds."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")


def unexpected(exc: Exception) -> int:
    """An unexpected exception at a command's top: one line and exit status 1, never a traceback; with
    GPULEDGER_DEBUG=1 it is raised again, traceback and all."""
    if os.environ.get("GPULEDGER_DEBUG"):
        raise exc
    error(f"unexpected {type(exc).__name__}: {exc} (GPULEDGER_DEBUG=1 shows where)")
    return 1


def fail(message: str, code: int = 2) -> NoReturn:
    """End a command: :func:`error`, then exit 2 (bad input) or 1 (a failure)."""
    import typer

    error(message)
    raise typer.Exit(code)


def os_error(exc: OSError) -> str:
    """``PATH: No such file or directory`` rather than Python's ``[Errno 2] ...: 'PATH'``."""
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return exc.strerror or str(exc)


def write_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temp file in the same directory, fsync, rename: a reader sees the old or the new file.
    An OSError names ``path`` when the system named no file (a full disk)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; slurmctld may run as another user than the writer
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write or fsync names no file: the target
            e.filename = str(path)
        raise
    return path


def note(message: str) -> None:
    """A remark for people on stderr (an empty period, where a file went), never mixed into the data on stdout."""
    sys.stderr.write(" ".join(str(message).split()) + "\n")


def int_ranges(values: Iterable[int]) -> str:
    """[3, 4, 5, 9] -> "3-5,9": runs of consecutive integers, sorted, each once (Slurm's array task expression,
    an audit manifest's entry list)."""
    ordered = sorted(set(values))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
