"""Numbers in the text that agents, files and other programs hand us: one rule for what counts as digits."""

from __future__ import annotations


def ascii_int(text: str) -> int | None:
    """``text`` as a non-negative integer when it is ASCII digits only, else None. ``str.isdigit`` alone takes other
    scripts' digits: ``int('²')`` raises (a job id an agent sent once stopped every report), ``int('٣')`` is 3."""
    return int(text) if text.isascii() and text.isdigit() else None
