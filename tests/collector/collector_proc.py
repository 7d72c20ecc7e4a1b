"""Run the real collector (`gpuledger collector serve`) as a child process for kill/restart tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(cond: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Poll ``cond`` until it gives a true value, and return that; an AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def metric_value(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a /metrics exposition ``text``, which must hold it once."""
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} is in the exposition {len(values)} times"
    return values[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProc:
    """`collector serve` on ``port`` (0: the one it picks, then in ``url``); ``output()`` is what it wrote so far."""

    def __init__(self, data_dir: Path, port: int, *extra: str) -> None:
        self.data_dir, self.port, self.extra = data_dir, port, extra
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self, timeout: float = 30.0) -> CollectorProc:
        """Once it says it listens (every worker, with --workers) and answers /healthz."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "gpuledger.cli", "collector", "serve", "--data-dir", str(self.data_dir),
             "--port", str(self.port), *self.extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        # read all along: a collector writing to a full pipe would block
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listening = [line for line in self.lines if line.startswith("collector listening on ")]
            if self.proc.poll() is not None and not listening:
                self.proc.wait()
                time.sleep(0.1)  # the reader's last lines
                raise RuntimeError(f"collector exited {self.proc.returncode}: {self.output()}")
            if listening:
                self.url = listening[0].split("listening on ")[1].split(",")[0]
                try:
                    if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"collector did not come up: {self.output()}")

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
