"""Canonical JSON: the one text of a value that the audit log hashes and signs.

``canonical_json`` sorts keys, drops whitespace, writes ASCII, floats as Python's shortest round-trip ``repr`` and
refuses NaN/inf, so one value has exactly one text.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from enum import Enum
from typing import Any


class AuditError(ValueError):
    """Bad input to the audit log (an unserialisable value, an unknown kind); the message says what and where."""


class _Bad(Exception):
    """Raised inside _plain; the path to the bad value is built while unwinding (no path strings on success)."""

    def __init__(self, value: Any, why: str) -> None:
        self.value, self.why, self.path = value, why, ""


def plain(obj: Any, where: str = "$") -> Any:
    """JSON-ready copy of ``obj``: dataclasses, NamedTuples and mappings become dicts (string keys), tuples lists.

    Raises AuditError naming the path of a value JSON cannot carry exactly (NaN, inf, an arbitrary object).
    """
    try:
        return _plain(obj)
    except _Bad as b:
        raise AuditError(f"{where}{b.path}: {b.value!r} {b.why}") from None


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if obj - obj != 0.0:  # NaN or inf
            raise _Bad(obj, "has no exact JSON form")
        return obj
    if isinstance(obj, Enum):
        return _plain(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):  # a NamedTuple keeps its field names
        return _plain(obj._asdict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise _Bad(k, "is not a string key")
            try:
                out[k] = _plain(v)
            except _Bad as b:
                b.path = f".{k}{b.path}"
                raise
        return out
    if isinstance(obj, (list, tuple)):
        out_l = []
        for i, v in enumerate(obj):
            try:
                out_l.append(_plain(v))
            except _Bad as b:
                b.path = f"[{i}]{b.path}"
                raise
        return out_l
    raise _Bad(obj, f"({type(obj).__name__}) cannot be written to the audit log")


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII, floats as their shortest round-trip repr; one text per value."""
    return dumps(plain(obj))


def dumps(plain_obj: Any) -> str:
    """canonical_json for a value already made plain (no second walk over it)."""
    return json.dumps(plain_obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
