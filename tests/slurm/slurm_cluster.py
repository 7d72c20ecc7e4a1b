"""A real single-node Slurm 22.05 cluster on loopback for the ``slurm`` tests (session fixture; ~6 s up, ~3 s down).

The cluster comes from ``slurm-localhost.sh`` beside this file (munged, MariaDB, slurmdbd, slurmctld, slurmd; all
state in a scratch directory under /tmp; free loopback ports picked here). It installs gpuledger's
``contrib/slurm/job_submit.lua`` with the feed path pointed into the scratch directory, and sets
``PriorityWeightFairshare=0`` so that the site factor is the only fairness signal, as PRIORITY.md advises.

Nothing is installed here: without root or the Debian packages the fixture fails and says what is missing.
Teardown (``purge``) cancels the jobs, stops every daemon it started by PID, kills stragglers that carry this
cluster's SLURM_CONF, and removes the directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuledger.accounting.priority import flat_path
from gpuledger.accounting.slurm import SlurmClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "slurm-localhost.sh"
LUA = ROOT / "contrib" / "slurm" / "job_submit.lua"
DEBS = "slurmctld slurmd slurmdbd slurm-client munge mariadb-server"
NEEDED = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sacctmgr", "sbatch",
          "sacct", "squeue", "sprio", "scontrol", "runuser", "setpriv", "mariadb-admin")
USERS = {"alice": "proj_a", "bob": "proj_a", "carol": "proj_b"}
PARTITION = "gpu"
GPUS = 2


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    feed: Path  # the JSON feed; job_submit.lua reads the flat one beside it (flat_path)
    env: dict[str, str] = field(default_factory=dict)

    def client(self) -> SlurmClient:
        return SlurmClient(env={"SLURM_CONF": str(self.conf)})

    def cmd(self, *argv: str, check: bool = True) -> str:
        """Run a Slurm command as root against this cluster; a failure shows its stderr."""
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SLURM_CONF": str(self.conf)})
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def sbatch_as(self, user: str, *args: str) -> str:
        """Submit as ``user`` (slurmd runs the job as that uid); returns the job id."""
        out = self.cmd("runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", "sbatch", "--parsable",
                       f"--chdir={self.dir / 'jobs'}", "-o", "/dev/null", *args)
        return out.strip().split(";")[0]

    def wait(self, what: str, cond: Callable[[], Any], timeout_s: float = 30.0, every_s: float = 0.1) -> Any:
        """Poll ``cond`` until it returns something truthy, and return that."""
        end = time.monotonic() + timeout_s
        while True:
            value = cond()
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(every_s)

    def log_tail(self, name: str = "slurmctld.log", lines: int = 30) -> str:
        path = self.dir / "log" / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def free_ports(n: int) -> list[int]:
    """n free loopback TCP ports (free now; the caller binds them soon after)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _preflight() -> None:
    if os.geteuid() != 0:
        pytest.fail("the slurm tests need root: slurmd must switch to the job users (run `make test` as root)")
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [b for b in NEEDED if shutil.which(b, path=path) is None]
    if missing:
        pytest.fail(f"the slurm tests need a real Slurm; missing {', '.join(missing)}. "
                    f"Install the Debian packages: apt-get install -y {DEBS}  (`make deps` does it)")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    with running_cluster() as cluster:
        yield cluster


@contextlib.contextmanager
def running_cluster(extra_env: dict[str, str] | None = None, with_lua: bool = True) -> Iterator[SlurmCluster]:
    """Bring a cluster up (also for bench/priority.py), yield it, purge it. ``extra_env``: SLH_* knobs."""
    _preflight()
    d = Path(tempfile.mkdtemp(prefix="gpuledger-slurm-", dir="/tmp"))
    own = d / "gpuledger"
    own.mkdir()
    feed = own / "priority-feed.json"
    lua, n = re.subn(r'(?m)^local FEED_PATH = ".*"$', f'local FEED_PATH = "{flat_path(feed)}"', LUA.read_text())
    assert n == 1, f"{LUA}: no `local FEED_PATH = \"...\"` line to point at the test feed"
    (own / "job_submit.lua").write_text(lua)
    ctld, slurmd, dbd, mysql = free_ports(4)
    env = {
        **os.environ,
        "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin",
        "SLH_USERS": " ".join(f"{u}:{a}" for u, a in USERS.items()),
        "SLH_PARTITION": PARTITION, "SLH_GPUS": str(GPUS), "SLH_GPU_TYPE": "h200",
        "SLH_LUA": "1" if with_lua else "0", "SLH_LUA_SCRIPT": str(own / "job_submit.lua") if with_lua else "",
        "SLH_WEIGHT_FAIRSHARE": "0",
        "SLH_CTLD_PORT": str(ctld), "SLH_SLURMD_PORT": str(slurmd), "SLH_DBD_PORT": str(dbd),
        "SLH_MYSQL_PORT": str(mysql), "SLH_TIMEOUT": "60", **(extra_env or {}),
    }
    cluster = SlurmCluster(d, d / "etc" / "slurm.conf", feed, env)
    try:
        up = subprocess.run(["bash", str(SCRIPT), "up", str(d)], env=env, capture_output=True, text=True,
                            timeout=180)
        if up.returncode != 0:
            pytest.fail(f"Slurm bring-up failed ({up.returncode}):\n{up.stderr[-3000:]}\n"
                        f"slurmctld.log:\n{cluster.log_tail()}")
        yield cluster
    finally:
        down = subprocess.run(["bash", str(SCRIPT), "purge", str(d)], env=env, capture_output=True, text=True,
                              timeout=120)
        if down.returncode != 0:
            print(f"Slurm teardown of {d} exited {down.returncode}:\n{down.stderr[-2000:]}")
