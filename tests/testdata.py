"""Where the tests' captured real outputs live (tests/data/, origins in its README), and a reader that fails,
never skips, when a capture is missing."""

from __future__ import annotations

from pathlib import Path

DATA_ROOT = Path(__file__).resolve().parent / "data"


def capture(relative: str | Path) -> Path:
    """The path of a capture under tests/data/; a missing one is a test failure, not a skip."""
    path = DATA_ROOT / relative
    assert path.is_file(), f"missing capture {path}: every capture a test reads is committed under tests/data/"
    return path
