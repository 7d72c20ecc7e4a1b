"""The text that agents, files and other programs hand us: one rule for what counts as digits, one reader of a text
file."""

from __future__ import annotations

from pathlib import Path


def ascii_int(text: str) -> int | None:
    """``text`` as a non-negative integer when it is ASCII digits only, else None. ``str.isdigit`` alone takes other
    scripts' digits: ``int('²')`` raises (a job id an agent sent once stopped every report), ``int('٣')`` is 3."""
    return int(text) if text.isascii() and text.isdigit() else None


class NotText(ValueError):
    """A file that should hold UTF-8 text does not; the message names it and the first bad byte."""


def read_text(path: str | Path) -> str:
    """A text file the user handed us (a config, an association tree, a CSV): NotText naming the file where it is not
    UTF-8, rather than the decoder's message that names no file. OSError as ``Path.read_text`` raises it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NotText(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
