"""A small real disk for the disk-full tests: a tmpfs of a few MB (needs root, as in CI), and filling it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def mount_tmpfs(mnt: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` (``1m``) on the existing directory ``mnt``; whether it could be (root only)."""
    return os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True).returncode == 0


def unmount(mnt: Path) -> None:
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def fill(mnt: Path) -> Path:
    """Every byte left on the disk, in one file (remove it to make room; fill again to take what was freed)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler
