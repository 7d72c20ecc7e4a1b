"""Files that hold user names and the audit trail: created readable by their owner only, whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) mode 0700; an existing directory is left as the admin set it."""
    p = Path(path)
    if not p.is_dir():
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, 0o700)
            os.chmod(p, 0o700)  # mkdir's mode is masked by the umask only downwards; chmod makes it exact
        except FileExistsError:
            pass
    return p


def private_file(path: str | os.PathLike[str]) -> Path:
    """Create an empty ``path`` mode 0600 unless it exists (SQLite gives its -wal and -shm files the same mode)."""
    p = Path(path)
    private_dir(p.parent)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return p
    os.fchmod(fd, 0o600)
    os.close(fd)
    return p
