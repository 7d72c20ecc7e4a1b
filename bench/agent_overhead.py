"""Agent overhead with the fake NVML library: CPU time per sampling cycle for 8 GPUs, and peak RSS.

Measures, with ``time.process_time`` over ``--cycles`` cycles (GPM on, a simulated 1 s between cycles):

- ``agent``: ``Agent.tick()`` over ``NvmlSource(lib=fake)`` -- everything one cycle costs;
- ``library``: the same fake NVML calls, recorded from one real cycle and replayed directly -- what the
  (fake) driver itself costs, a same-script reference;
- their difference: the agent's own work (target <= 2 ms per cycle), and the ratio.

Peak RSS: a child process runs the agent loop with the fake for ``--rss-seconds`` in real time; its
``ru_maxrss`` (RUSAGE_CHILDREN) is the peak (target <= 80 MB).

    .venv/bin/python bench/agent_overhead.py [--cycles 2000] [--gpus 8]

Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the NVML fake is a test double and lives with the tests

from nvml_fake import FakeNvml, fake_node  # noqa: E402

from gpuledger.agent.sampler import Agent  # noqa: E402
from gpuledger.agent.sources.nvml import NvmlSource  # noqa: E402

OWN_TARGET_S = 0.002
RSS_TARGET_MB = 80.0


class StepClock:
    """Simulated time: one agent interval per cycle, so every cycle has a full GPM window."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder:
    """Wraps the fake library and records (function, args) of each NVML call while ``on``."""

    def __init__(self, lib: FakeNvml) -> None:
        self._lib = lib
        self.on = False
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def call(*args: Any) -> Any:
            if self.on:
                self.calls.append((value, args))
            return value(*args)

        return call


def measure_agent(gpus: int, cycles: int) -> float:
    clock = StepClock()
    lib = fake_node(gpus, clock=clock)
    agent = Agent(NvmlSource(lib=lib, host="bench", clock=clock), clock=clock)
    agent.open()
    for _ in range(3):  # warm-up: probing, first GPM sample
        clock.t += 1.0
        agent.tick()
    clock.t += 1.0
    n = len(agent.tick())
    assert n == gpus and agent.snapshot[0].sm_active_ratio is not None, "GPM values expected"
    t0 = time.process_time()
    for _ in range(cycles):
        clock.t += 1.0
        agent.tick()
    elapsed = time.process_time() - t0
    agent.close()
    return elapsed / cycles


def measure_library(gpus: int, cycles: int) -> tuple[float, int]:
    clock = StepClock()
    lib = fake_node(gpus, clock=clock)
    rec = Recorder(lib)
    src = NvmlSource(lib=rec, host="bench", clock=clock)  # type: ignore[arg-type]
    src.open()
    for _ in range(3):
        clock.t += 1.0
        src.sample()
    rec.on = True
    clock.t += 1.0
    src.sample()
    rec.on = False
    calls = rec.calls
    err = lib.NVMLError
    t0 = time.process_time()
    for _ in range(cycles):
        clock.t += 1.0
        for fn, args in calls:
            if fn.__name__ == "nvmlDeviceGetProcessUtilization":  # since the last cycle, as the source asks
                args = (args[0], int((clock.t - 1.0) * 1e6))
            try:
                fn(*args)
            except err:  # the event poll's "timeout": part of what the library costs
                pass
    elapsed = time.process_time() - t0
    src.close()
    return elapsed / cycles, len(calls)


def child(seconds: float, gpus: int) -> None:
    import threading

    lib = fake_node(gpus)
    agent = Agent(NvmlSource(lib=lib, host="bench"))
    agent.open()
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    agent.run(0.2, stop)
    agent.close()


def measure_rss(seconds: float, gpus: int) -> float:
    subprocess.run([sys.executable, __file__, "--child", str(seconds), "--gpus", str(gpus)], check=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0  # KiB on Linux -> MiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rss-seconds", type=float, default=3.0)
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child, a.gpus)
        return 0
    agent_s = measure_agent(a.gpus, a.cycles)
    lib_s, ncalls = measure_library(a.gpus, a.cycles)
    own_s = agent_s - lib_s
    rss = measure_rss(a.rss_seconds, a.gpus)
    ok_own, ok_rss = own_s <= OWN_TARGET_S, rss <= RSS_TARGET_MB
    rows = [
        ("agent cycle (Agent.tick + NvmlSource.sample)", f"{agent_s * 1e3:.3f} ms", ""),
        (f"fake NVML alone ({ncalls} calls replayed)", f"{lib_s * 1e3:.3f} ms", ""),
        ("agent's own work (difference)", f"{own_s * 1e3:.3f} ms", f"<= {OWN_TARGET_S * 1e3:.0f} ms "
         + ("ok" if ok_own else "MISSED")),
        ("ratio agent / library", f"{agent_s / lib_s:.2f}x" if lib_s > 0 else "-", ""),
        (f"peak RSS of the agent loop ({a.rss_seconds:.0f} s)", f"{rss:.1f} MB", f"<= {RSS_TARGET_MB:.0f} MB "
         + ("ok" if ok_rss else "MISSED")),
    ]
    print(f"agent overhead: {a.gpus} GPUs (fake NVML, GPM on), {a.cycles} cycles, Python {sys.version.split()[0]}")
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'value':>12}  target")
    for name, value, target in rows:
        print(f"{name:<{w}}  {value:>12}  {target}")
    return 0 if ok_own and ok_rss else 1


if __name__ == "__main__":
    sys.exit(main())
