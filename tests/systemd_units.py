"""Read contrib/systemd's unit files as systemd would, and turn an ExecStart line into argv for this machine."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

UNITS = Path(__file__).resolve().parents[1] / "contrib" / "systemd"
EXE = str(Path(sys.executable).with_name("gpuledger"))  # the checkout's gpuledger, for /usr/local/bin/gpuledger


def unit(name: str) -> dict[str, list[str]]:
    """A unit file's settings, every occurrence of each key in order (systemd allows repeats)."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def exec_start(u: dict[str, list[str]], subst: dict[str, str]) -> list[str]:
    (line,) = u["ExecStart"]
    for old, new in subst.items():
        line = line.replace(old, new)
    assert "${" not in line, f"unsubstituted systemd variable in {line}"
    return shlex.split(line)


def environment(u: dict[str, list[str]], subst: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEDGER_")}
    for item in u.get("Environment", []):
        key, _, value = item.partition("=")
        for old, new in subst.items():
            value = value.replace(old, new)
        env[key] = value
    return env
