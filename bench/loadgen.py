"""A small asyncio HTTP/1.1 load generator for the fleet benches (bench/http_layer.py, bench/fleet.py).

Each simulated node holds one keep-alive connection and posts a pre-encoded body every ``period_s``
seconds (first push at a random offset, as agents started at different times). A raw-socket client, not
httpx: on a 2-core machine the client must cost far less CPU than the server it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def machine_busy_s() -> tuple[float, float]:
    """(CPU seconds busy, CPU seconds in all) of the whole machine since boot, summed over its cores (/proc/stat:
    idle and iowait are not busy). The load generator shares the machine with the server: a busy share near 100%
    means the figures measure the machine's limit, not the server's."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest time is in user already)
    return (total - ticks[3] - ticks[4]) / CLK_TCK, total / CLK_TCK


def _status_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    return _status_bytes(pid, "VmRSS")


def hwm_bytes(pid: int) -> int:
    """Peak RSS (VmHWM) of a process."""
    return _status_bytes(pid, "VmHWM")


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on (a collector's workers and its compactor)."""
    out: list[int] = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every running process below it (a collector, its workers, its compactor)."""
    total = cpu_s(pid)
    for p in descendants(pid):
        try:
            total += cpu_s(p)
        except OSError:  # gone between the listing and the read
            pass
    return total


def group_commits(port: int) -> tuple[float, float]:
    """The collector's (batches, group commits) so far, from its /metrics (every worker's, summed)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line.startswith("gpuledger_collector_group_commit_batches_"))
    return (float(values.get("gpuledger_collector_group_commit_batches_sum", 0.0)),
            float(values.get("gpuledger_collector_group_commit_batches_count", 0.0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, path: str = "/healthz", timeout: float = 60) -> None:
    """Until the server in ``proc`` answers GET ``path`` on ``port`` with a status below 500."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status < 500:  # a server still starting may answer 503
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready")


def serve_workers(data: Path, port: int, workers: int, settings: str, log: Path | None = None) -> subprocess.Popen:
    """The real `gpuledger collector serve --workers N` on ``data`` (its gpuledger.toml: ``settings``, lines of its
    [collector] table; its standard error to ``log``), once the supervisor says every worker listens."""
    data.mkdir()
    (data / "gpuledger.toml").write_text("[collector]\n" + settings)
    with log.open("wb") if log is not None else contextlib.nullcontext() as err:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "gpuledger"), "collector", "serve", "--data-dir",
                                 str(data), "--port", str(port), "--workers", str(workers)], stdout=subprocess.PIPE,
                                stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "collector listening on" not in line:
        said = log.read_text()[-2000:] if log is not None else line
        raise RuntimeError(f"collector serve --workers {workers} did not start: {said!r}")
    return proc


def request_bytes(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: bench", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    ok: int = 0
    samples: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    conn_errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, exc: BaseException) -> None:
        self.conn_errors += 1
        k = type(exc).__name__
        self.error_kinds[k] = self.error_kinds.get(k, 0) + 1


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 response: (status, body, whether the server closes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, close = 0, False
    for line in lines[1:]:
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k == "content-length":
            length = int(v)
        elif k == "connection" and v.strip().lower() == "close":
            close = True
    body = await reader.readexactly(length) if length else b""
    return status, body, close


async def node(host: str, port: int, make_request: Callable[[int], tuple[bytes, int]], period_s: float,
               until: float, stats: Stats, rng: random.Random, ok_status: int = 200) -> None:
    """One agent: connect, then post ``make_request(i)`` (request bytes, samples) every period_s until ``until``."""
    await asyncio.sleep(rng.random() * period_s)
    reader = writer = None
    i = 0
    next_at = time.monotonic()
    while next_at < until:
        req, n = make_request(i)
        t0 = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(req)
            status, _body, close = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            stats.error(exc)
            if writer is not None:
                writer.close()
            reader = writer = None
        else:
            stats.latencies.append(time.monotonic() - t0)
            stats.statuses[status] = stats.statuses.get(status, 0) + 1
            if status == ok_status:
                stats.ok += 1
                stats.samples += n
            if close:
                writer.close()
                reader = writer = None
        i += 1
        next_at += period_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    if writer is not None:
        writer.close()


async def closed_loop(host: str, port: int, make_request: Callable[[int], tuple[bytes, int]], conns: int,
                      seconds: float, stats: Stats) -> None:
    """``conns`` connections posting back to back for ``seconds`` (saturation): connection c sends
    ``make_request(c)``, ``make_request(c + conns)``, ..."""
    until = time.monotonic() + seconds
    await asyncio.gather(*(_post_until(host, port, map(make_request, itertools.count(c, conns)), until, stats)
                           for c in range(conns)))


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds for a report (None stays None: JSON has no NaN)."""
    return None if seconds is None else round(1e3 * seconds, 2)


def raise_nofile() -> None:
    """Thousands of connections need thousands of file descriptors."""
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def post_each(host: str, port: int, requests: Iterator[tuple[bytes, int]], conns: int, until: float,
                    stats: Stats) -> None:
    """``conns`` keep-alive connections posting the next of ``requests`` (request bytes, samples) back to back until
    the iterator is exhausted or ``time.monotonic()`` passes ``until``: each request is sent once (unlike
    :func:`closed_loop`, which may repeat them), so a store that deduplicates batches is measured on new ones."""
    await asyncio.gather(*(_post_until(host, port, requests, until, stats) for _ in range(conns)))


async def _post_until(host: str, port: int, requests: Iterator[tuple[bytes, int]], until: float,
                      stats: Stats) -> None:
    """One keep-alive connection posting ``requests`` (request bytes, samples) back to back until they run out or
    ``time.monotonic()`` passes ``until``; reconnects after an error or a ``Connection: close``."""
    reader, writer = await asyncio.open_connection(host, port)
    for req, n in requests:
        if time.monotonic() >= until:
            break
        t0 = time.monotonic()
        try:
            writer.write(req)
            status, _b, close = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            stats.error(exc)
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
            continue
        stats.latencies.append(time.monotonic() - t0)
        stats.statuses[status] = stats.statuses.get(status, 0) + 1
        if status == 200:
            stats.ok += 1
            stats.samples += n
        if close:
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
    writer.close()
