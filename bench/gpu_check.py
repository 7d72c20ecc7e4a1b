"""Check the NVML source against a real NVIDIA GPU under known loads (needs torch + nvidia-ml-py only).

Runs ``NvmlSource`` in a background thread every ~0.5 s while the GPU runs, one after another for
``--phase-s`` seconds each: a bf16 matrix-multiply loop, a device-to-device copy loop, and nothing.
Prints per phase: SM activity, DRAM bandwidth utilisation, power, and the energy counter's delta against
the integral of the sampled power. The first ``--settle-s`` seconds of each phase are left out (ramp).

Passes (exit 0) when matmul SM activity >= 0.8, copy DRAM bandwidth >= 0.6, idle SM activity <= 0.05 and,
in every phase, the energy delta is within 10% of the power integral. Exit 1: a check failed; exit 2: no
GPU, torch or driver here. About 60 s in all.

    python bench/gpu_check.py [--device 0] [--phase-s 15]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpuledger.schema.records import GpuSample  # noqa: E402
from gpuledger.agent.sources.base import SourceUnavailable  # noqa: E402
from gpuledger.agent.sources.nvml import NvmlSource  # noqa: E402

SM_MATMUL_MIN = 0.8
DRAM_COPY_MIN = 0.6
SM_IDLE_MAX = 0.05
ENERGY_TOLERANCE = 0.10


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    samples: list[GpuSample] = field(default_factory=list)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarise(phase: Phase, settle_s: float) -> dict[str, float | None]:
    # Only samples whose GPM window (since the previous sample) lies inside the steady part of the phase.
    s = [x for x in phase.samples if phase.start + settle_s <= x.ts <= phase.end]
    sm = _mean([x.sm_active_ratio for x in s[1:] if x.sm_active_ratio is not None])
    dram = _mean([x.dram_bw_ratio for x in s[1:] if x.dram_bw_ratio is not None])
    power = _mean([x.power_watts for x in s if x.power_watts is not None])
    pts = [(x.ts, x.power_watts, x.energy_joules) for x in s if x.power_watts is not None and x.energy_joules is not None]
    energy = integral = None
    if len(pts) >= 2:
        energy = pts[-1][2] - pts[0][2]
        integral = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(pts, pts[1:]))
    return {"samples": float(len(s)), "sm": sm, "dram": dram, "power": power, "energy": energy, "integral": integral}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="torch CUDA device number")
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--interval-s", type=float, default=0.5)
    a = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("gpu_check: PyTorch is not installed; this check needs torch with CUDA on an NVIDIA GPU host",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU (no NVIDIA GPU or driver here); nothing to check", file=sys.stderr)
        return 2
    src = NvmlSource(host="gpu-check")
    try:
        src.open()
    except SourceUnavailable as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2

    dev = torch.device("cuda", a.device)
    props = torch.cuda.get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    want = f"GPU-{uuid}" if uuid is not None else None

    phases = [Phase("matmul"), Phase("copy"), Phase("idle")]
    current: list[Phase | None] = [None]
    stop = threading.Event()
    errors: list[str] = []

    def sampler() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                for s in src.sample():
                    if s.mig is None and (s.gpu_uuid == want or (want is None and s.gpu_index == a.device)):
                        if current[0] is not None:
                            current[0].samples.append(s)
            except Exception as exc:  # noqa: BLE001 - reported at the end
                errors.append(f"{type(exc).__name__}: {exc}")
            stop.wait(max(0.0, a.interval_s - (time.monotonic() - t0)))

    n = 8192
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    big_src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev)  # 2 GiB: far beyond L2
    big_dst = torch.empty_like(big_src)
    torch.cuda.synchronize(dev)

    def matmul_step() -> None:
        for _ in range(10):
            torch.matmul(x, y)

    def copy_step() -> None:
        for _ in range(10):
            big_dst.copy_(big_src)

    work = {"matmul": matmul_step, "copy": copy_step, "idle": None}
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    started = time.time()
    try:
        for ph in phases:
            ph.start = time.time()
            current[0] = ph
            step = work[ph.name]
            while time.time() - ph.start < a.phase_s:
                if step is None:
                    time.sleep(0.1)
                else:
                    step()
                    torch.cuda.synchronize(dev)
            ph.end = time.time()
        current[0] = None
    finally:
        stop.set()
        thread.join(timeout=5)
        src.close()

    print(f"gpu_check: {props.name} ({want or f'device {a.device}'}), {time.time() - started:.0f} s, "
          f"sampled every {a.interval_s} s, first {a.settle_s} s of each phase left out")
    header = f"{'phase':<8} {'n':>3} {'SM act':>7} {'DRAM bw':>8} {'power W':>8} {'energy J':>9} {'P integral J':>13} {'diff':>7}"
    print(header)
    ok = True
    fails: list[str] = []
    results = {}
    for ph in phases:
        r = summarise(ph, a.settle_s)
        results[ph.name] = r
        diff = None
        if r["energy"] is not None and r["integral"]:
            diff = (r["energy"] - r["integral"]) / r["integral"]

        def f(v: float | None, d: int = 3) -> str:
            return "-" if v is None else f"{v:.{d}f}"

        print(f"{ph.name:<8} {int(r['samples'] or 0):>3} {f(r['sm']):>7} {f(r['dram']):>8} {f(r['power'], 1):>8} "
              f"{f(r['energy'], 1):>9} {f(r['integral'], 1):>13} {f(diff if diff is None else diff * 100, 1):>6}%")
        if diff is None or abs(diff) > ENERGY_TOLERANCE:
            fails.append(f"{ph.name}: energy delta vs power integral {f(None if diff is None else diff * 100, 1)}% "
                         f"(limit {ENERGY_TOLERANCE * 100:.0f}%)")
    checks = [
        ("matmul SM activity", results["matmul"]["sm"], lambda v: v >= SM_MATMUL_MIN, f">= {SM_MATMUL_MIN}"),
        ("copy DRAM bandwidth", results["copy"]["dram"], lambda v: v >= DRAM_COPY_MIN, f">= {DRAM_COPY_MIN}"),
        ("idle SM activity", results["idle"]["sm"], lambda v: v <= SM_IDLE_MAX, f"<= {SM_IDLE_MAX}"),
    ]
    for name, v, good, need in checks:
        if v is None or not good(v):
            fails.append(f"{name} = {'-' if v is None else f'{v:.3f}'} (need {need})")
    if errors:
        fails.append(f"sampling errors: {errors[:3]}")
    ok = not fails
    print("PASS" if ok else "FAIL:\n  " + "\n  ".join(fails))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
