"""Check the NVML source against a real NVIDIA GPU under known loads (needs torch + nvidia-ml-py only).

Runs ``NvmlSource`` in a background thread every ~0.5 s while the GPU runs, one after another for
``--phase-s`` seconds each: a bf16 matrix-multiply loop, a device-to-device copy loop, and nothing.
Prints per phase: SM activity, DRAM bandwidth utilisation, power, and the energy counter's delta against
the integral of the sampled power. The first ``--settle-s`` seconds of each phase are left out (ramp).

Passes (exit 0) when matmul SM activity >= 0.8, copy DRAM bandwidth >= 0.6, idle SM activity <= 0.05 and,
in every phase, the energy delta is within 10% of the power integral; and (issue #18):

- **degrade per field**: every tick gave the GPU's sample (no sample lost to a field the driver lacks),
  ``errors_total`` is 0; the fields the driver could not give are printed with their reasons;
- **processes**: this process's pid is in the GPU's process list during the matmul phase, and its per-process
  utilization (``gpu_util_ratio``, what a shared GPU is split by) averages >= 0.5 there where the driver
  reports it (a driver without it is reported as skipped);
- ``--as-user USER`` (run as root): a child process under USER's uid samples the GPU while this process
  holds a CUDA context; it passes when the sample is there and either lists this pid or counts the process
  list unavailable with a reason (nvml.h: other users' processes may need privileges);
- ``--mps``: an MPS control daemon in a private pipe directory and a child CUDA client under it; the client's
  pid must be listed (MPS clients come only from ``nvmlDeviceGetMPSComputeRunningProcesses``);
- ``--mig`` (root, a MIG-capable GPU with nothing else running on it): MIG turned on, the smallest GPU
  instance created, a child CUDA worker run on it; the whole-GPU sample keeps power and energy, the
  instance's sample lists the worker with its memory and (Hopper+) SM activity, the MIG split gives the
  instances exactly the GPU's power and counter; then the instance destroyed and MIG turned off, and the
  *same* source (not re-opened) sees the GPU without MIG again, with remapped rows back if they were there.
  A MIG mode change that stays pending (needs a GPU reset) is reported as skipped, not passed.

Exit 1: a check failed; exit 2: no GPU, torch or driver here. About 60 s in all, plus ~15 s per option.

    python bench/gpu_check.py [--device 0] [--phase-s 15] [--as-user nobody] [--mps] [--mig]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpuledger.agent.mig import MigEnergySplitter  # noqa: E402
from gpuledger.agent.sources.base import SourceUnavailable  # noqa: E402
from gpuledger.agent.sources.nvml import NvmlSource  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

SM_MATMUL_MIN = 0.8
DRAM_COPY_MIN = 0.6
SM_IDLE_MAX = 0.05
ENERGY_TOLERANCE = 0.10

# A CUDA worker run as a child process (under MPS, on a MIG instance): matmul until killed, printing its pid.
WORKER = """
import os, sys, time, torch
x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
print(os.getpid(), flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(10):
        x @ x
    torch.cuda.synchronize()
"""


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    samples: list[GpuSample] = field(default_factory=list)


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped (said why)
    detail: str


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarise(phase: Phase, settle_s: float) -> dict[str, float | None]:
    # Only samples whose GPM window (since the previous sample) lies inside the steady part of the phase.
    s = [x for x in phase.samples if phase.start + settle_s <= x.ts <= phase.end]
    sm = _mean([x.sm_active_ratio for x in s[1:] if x.sm_active_ratio is not None])
    dram = _mean([x.dram_bw_ratio for x in s[1:] if x.dram_bw_ratio is not None])
    power = _mean([x.power_watts for x in s if x.power_watts is not None])
    pts = [(x.ts, x.power_watts, x.energy_joules) for x in s
           if x.power_watts is not None and x.energy_joules is not None]
    energy = integral = None
    if len(pts) >= 2:
        energy = pts[-1][2] - pts[0][2]
        integral = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(pts, pts[1:]))
    return {"samples": float(len(s)), "sm": sm, "dram": dram, "power": power, "energy": energy, "integral": integral}


def _mine(samples: list[GpuSample], want: str | None, index: int) -> list[GpuSample]:
    """The checked GPU's samples (whole GPU first, then its MIG instances)."""
    return [s for s in samples if s.gpu_uuid == want or (want is None and s.gpu_index == index)]


def _start_worker(seconds: float, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(seconds)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"CUDA worker did not start (exit {proc.wait()})")
    return proc, int(line)


def _poll(src: NvmlSource, want: str | None, index: int, seconds: float, until: Any = None) -> list[list[GpuSample]]:
    """Sample every 0.5 s for ``seconds`` (or until ``until(samples)`` is true); the checked GPU's samples per tick."""
    ticks = []
    end = time.time() + seconds
    while time.time() < end:
        ticks.append(_mine(src.sample(), want, index))
        if until is not None and until(ticks[-1]):
            break
        time.sleep(0.5)
    return ticks


def check_as_user(user: str, want: str | None, index: int) -> Check:
    """Sample the GPU under another uid while this process holds a CUDA context on it."""
    if os.geteuid() != 0:
        return Check(f"process list as {user}", None, "skipped: needs root to switch user")
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return Check(f"process list as {user}", None, f"skipped: no user {user!r}")
    code = (  # a code template: %r quotes the values as Python literals
        "import json, sys, time; sys.path.insert(0, %r)\n"  # noqa: UP031
        "from gpuledger.agent.sources.nvml import NvmlSource\n"
        "src = NvmlSource(host='gpu-check'); src.open(); src.sample(); time.sleep(0.3)\n"
        "out = [s.to_dict() for s in src.sample() if s.gpu_uuid == %r or s.gpu_index == %d]\n"
        "print(json.dumps({'samples': out, 'unavailable': [[f, r, n] for (f, r), n in src.health.unavailable.items()],"
        " 'errors': src.errors_total}))\n" % (str(ROOT), want, index)
    )

    def demote() -> None:
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=demote,
                       cwd="/")
    if r.returncode != 0:
        return Check(f"process list as {user}", False, f"child failed: {r.stderr.strip()[-300:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    whole = [s for s in got["samples"] if s["mig"] is None]
    pids = [p[0] for s in got["samples"] for p in s["processes"]]
    why = [f"{f}: {reason}" for f, reason, _ in got["unavailable"] if f == "processes"]
    ok = bool(whole) and got["errors"] == 0 and (os.getpid() in pids or bool(why))
    return Check(f"process list as {user}", ok,
                 f"sample {'present' if whole else 'MISSING'}, "
                 f"this pid {'listed' if os.getpid() in pids else 'not listed'}"
                 f"{', processes unavailable (' + '; '.join(why) + ')' if why else ''}, errors {got['errors']}")


def check_mps(src: NvmlSource, want: str | None, index: int) -> Check:
    """An MPS client must be listed (it is not a compute process: only the MPS list has it)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return Check("MPS client listed", None, "skipped: nvidia-cuda-mps-control not installed")
    tmp = tempfile.mkdtemp(prefix="gpuledger-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": tmp, "CUDA_MPS_LOG_DIRECTORY": tmp}
    started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True)
    if started.returncode != 0:
        return Check("MPS client listed", None, f"skipped: MPS daemon did not start: {started.stderr.strip()}")
    worker = None
    try:
        worker, pid = _start_worker(20.0, env)
        ticks = _poll(src, want, index, 10.0, until=lambda ss: any(pid in x.pids for x in ss))
        listed = any(pid in x.pids for t in ticks for x in t)
        return Check("MPS client listed", listed, f"client pid {pid} {'listed' if listed else 'NOT listed'} "
                     f"after {len(ticks)} tick(s)")
    except RuntimeError as exc:
        return Check("MPS client listed", False, str(exc))
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        subprocess.run([control], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _smi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=120)


def check_mig(src: NvmlSource, want: str | None, index: int) -> list[Check]:
    """MIG on, one small instance with a worker on it, then MIG off again, all seen by one open source."""
    name = "MIG on/off"
    if os.geteuid() != 0 or shutil.which("nvidia-smi") is None:
        return [Check(name, None, "skipped: needs root and nvidia-smi")]
    src.sample()
    time.sleep(0.3)
    before = _mine(src.sample(), want, index)  # the second reading: GPM has a window
    if not before or before[0].mig is not None or len(before) > 1:
        return [Check(name, None, "skipped: the GPU is already in MIG mode; run with MIG off")]
    rows_before = before[0].remapped_rows_total
    nvml_index = str(before[0].gpu_index)
    on = _smi("-i", nvml_index, "-mig", "1")
    if on.returncode != 0 or "pending" in (on.stdout + on.stderr).lower():
        _smi("-i", nvml_index, "-mig", "0")
        return [Check(name, None, f"skipped: MIG cannot be turned on now: {(on.stdout + on.stderr).strip()[-200:]}")]
    checks: list[Check] = []
    worker = None
    try:
        profiles = _smi("mig", "-i", nvml_index, "-lgip").stdout
        m = re.search(r"MIG\s+(1g\.\d+gb)\s", profiles)
        if m is None:
            return [Check(name, False, f"no 1g profile in: {profiles.strip()[-300:]}")]
        created = _smi("mig", "-i", nvml_index, "-cgi", m.group(1), "-C")
        if created.returncode != 0:
            return [Check(name, False, f"creating a {m.group(1)} instance failed: {created.stderr.strip()}")]
        # nvidia-smi -L: "GPU i: ... (UUID: GPU-...)" then its "  MIG ... (UUID: MIG-...)" lines.
        listing = _smi("-L").stdout
        block = re.search(rf"^GPU {nvml_index}:.*?(?=^GPU |\Z)", listing, re.M | re.S)
        mig_uuid = next(iter(re.findall(r"\(UUID: (MIG-[^)]+)\)", block.group(0) if block else "")), None)
        if mig_uuid is None:
            return [Check(name, False, f"no MIG device in nvidia-smi -L: {listing.strip()[-300:]}")]
        worker, pid = _start_worker(30.0, {"CUDA_VISIBLE_DEVICES": mig_uuid})
        ticks = _poll(src, want, index, 15.0,
                      until=lambda ss: any(pid in x.pids and x.sm_active_ratio is not None for x in ss if x.mig))
        last = ticks[-1] if ticks else []
        parent = next((x for x in last if x.mig is None), None)
        insts = [x for x in last if x.mig is not None]
        mine = next((x for x in insts if pid in x.pids), None)
        checks.append(Check("MIG: whole-GPU sample keeps power and energy",
                            parent is not None and parent.power_watts is not None and parent.energy_joules is not None,
                            f"power {parent and parent.power_watts} W, energy {parent and parent.energy_joules} J"))
        checks.append(Check("MIG: worker listed on its instance with memory", mine is not None and
                            any(p.pid == pid and p.used_memory_bytes for p in mine.processes),
                            f"instances {[x.mig for x in insts]}, worker on {mine.mig if mine else None}"))
        checks.append(Check("MIG: remapped rows NOT_SUPPORTED while MIG is on",
                            parent is not None and parent.remapped_rows_total is None,
                            f"remapped rows {parent and parent.remapped_rows_total}"))
        if mine is not None and before[0].sm_active_ratio is not None:  # GPM (Hopper+): per instance too
            checks.append(Check("MIG: instance SM activity (GPM)", (mine.sm_active_ratio or 0.0) > 0.1,
                                f"sm_active_ratio {mine.sm_active_ratio}"))
        if parent is not None and insts:
            split = MigEnergySplitter().map(last)
            total_p = sum(x.power_watts or 0.0 for x in split)
            total_e = sum(x.energy_joules or 0.0 for x in split)
            ok = (abs(total_p - (parent.power_watts or 0.0)) < 1e-6
                  and abs(total_e - (parent.energy_joules or 0.0)) < 1e-3)
            checks.append(Check("MIG: shares sum to the GPU's power and counter once", ok,
                                f"{total_p:.3f} W / {parent.power_watts} W, "
                                f"{total_e:.1f} J / {parent.energy_joules} J"))
    except RuntimeError as exc:
        checks.append(Check(name, False, str(exc)))
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        _smi("mig", "-i", nvml_index, "-dci")
        _smi("mig", "-i", nvml_index, "-dgi")
        off = _smi("-i", nvml_index, "-mig", "0")
    after = _poll(src, want, index, 3.0)[-1]
    back = len(after) == 1 and after[0].mig is None and after[0].gpu_util_ratio is not None
    rows_ok = bool(after) and (rows_before is None or after[0].remapped_rows_total is not None)
    checks.append(Check("MIG off: seen by the open source, remapped rows back", back and rows_ok,
                        f"{off.stdout.strip()[-120:]}; samples {[x.mig for x in after]}, remapped rows "
                        f"{after[0].remapped_rows_total if after else None} (before MIG: {rows_before})"))
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="torch CUDA device number")
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--as-user", default=None, help="also list processes as this user (run as root)")
    ap.add_argument("--mps", action="store_true", help="also check that an MPS client is listed")
    ap.add_argument("--mig", action="store_true", help="also turn MIG on and off (root; GPU otherwise idle)")
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
    checks: list[Check] = []
    # Child processes first, before this process creates a CUDA context (MIG needs the GPU otherwise idle).
    if a.mig:
        checks += check_mig(src, want, a.device)
    if a.mps:
        checks.append(check_mps(src, want, a.device))

    phases = [Phase("matmul"), Phase("copy"), Phase("idle")]
    current: list[Phase | None] = [None]
    stop = threading.Event()
    errors: list[str] = []
    ticks = [0, 0]  # sampling ticks, ticks that had no sample of this GPU
    pids_in_matmul: set[int] = set()
    my_util_in_matmul: list[float] = []  # this process's gpu_util_ratio, where the driver gave it

    def sampler() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                mine = [s for s in _mine(src.sample(), want, a.device) if s.mig is None]
                ticks[0] += 1
                ticks[1] += not mine
                for s in mine:
                    if current[0] is not None:
                        current[0].samples.append(s)
                        if current[0].name == "matmul":
                            pids_in_matmul.update(s.pids)
                            my_util_in_matmul.extend(p.gpu_util_ratio for p in s.processes
                                                     if p.pid == os.getpid() and p.gpu_util_ratio is not None)
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
    if a.as_user:
        checks.append(check_as_user(a.as_user, want, a.device))  # while this process holds its CUDA context
    src.close()

    print(f"gpu_check: {props.name} ({want or f'device {a.device}'}), {time.time() - started:.0f} s, "
          f"sampled every {a.interval_s} s, first {a.settle_s} s of each phase left out")
    header = (f"{'phase':<8} {'n':>3} {'SM act':>7} {'DRAM bw':>8} {'power W':>8} {'energy J':>9} "
              f"{'P integral J':>13} {'diff':>7}")
    print(header)
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
    limits = [
        ("matmul SM activity", results["matmul"]["sm"], lambda v: v >= SM_MATMUL_MIN, f">= {SM_MATMUL_MIN}"),
        ("copy DRAM bandwidth", results["copy"]["dram"], lambda v: v >= DRAM_COPY_MIN, f">= {DRAM_COPY_MIN}"),
        ("idle SM activity", results["idle"]["sm"], lambda v: v <= SM_IDLE_MAX, f"<= {SM_IDLE_MAX}"),
    ]
    for name, v, good, need in limits:
        if v is None or not good(v):
            fails.append(f"{name} = {'-' if v is None else f'{v:.3f}'} (need {need})")
    if errors:
        fails.append(f"sampling errors: {errors[:3]}")
    unavailable = ", ".join(f"{fld} ({reason})" for (fld, reason), _ in sorted(src.health.unavailable.items()))
    checks.insert(0, Check("degrade per field: a sample every tick, no call errors",
                           ticks[1] == 0 and src.errors_total == 0,
                           f"{ticks[0]} ticks, {ticks[1]} without this GPU, {src.errors_total} call errors; "
                           f"unavailable fields: {unavailable or 'none'}"))
    checks.insert(1, Check("this process listed during matmul", os.getpid() in pids_in_matmul,
                           f"pid {os.getpid()}; pids seen {sorted(pids_in_matmul)[:8]}"))
    util = _mean(my_util_in_matmul)
    checks.insert(2, Check("this process's GPU time during matmul", None if util is None else util >= 0.5,
                           f"mean gpu_util_ratio {'-' if util is None else f'{util:.3f}'} over "
                           f"{len(my_util_in_matmul)} samples (need >= 0.5)"))
    print("checks:")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'SKIP' if c.ok is None else 'FAIL'} {c.name}: {c.detail}")
        if c.ok is False:
            fails.append(f"{c.name}: {c.detail}")
    print("PASS" if not fails else "FAIL:\n  " + "\n  ".join(fails))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
