"""The README's commands, run as written: every ```bash block, in order, as one bash script each, in a fresh
directory (the repository's Makefile, pyproject.toml and .venv linked in, so `make demo` uses this checkout), with
a PATH that has no gpuledger on it. `make test` is dry-run (`make -n test`): running the suite inside itself
would recurse; the dry run still checks that the target exists and what it runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, flags=re.M | re.S)


def test_readme_has_bash_blocks_and_extraction_sees_them() -> None:
    blocks = bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3 and blocks[0].startswith("make demo")
    assert bash_blocks("x\n```bash\necho a\n```\n```toml\nb = 1\n```\n") == ["echo a\n"]


@pytest.mark.timeout(300)
def test_readme_commands_run_in_order_on_a_fresh_dir(tmp_path: Path) -> None:
    # Bring the checkout's install stamp up to date here first: a stale one would make the linked Makefile
    # reinstall from the fresh directory, which has no package, and leave the shared .venv without gpuledger.
    subprocess.run(["make", "-s", ".venv/.installed"], cwd=ROOT, check=True, capture_output=True, timeout=600)
    for name in ("Makefile", "pyproject.toml", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    assert "gpuledger" not in os.listdir("/usr/bin")
    for i, block in enumerate(bash_blocks((ROOT / "README.md").read_text())):
        script = re.sub(r"(?m)^make test\b", "make -n test", block)
        p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=240)
        out = p.stdout + p.stderr
        assert p.returncode == 0, f"README bash block {i + 1} exited {p.returncode}:\n{block}\n{out[-3000:]}"
        assert "Traceback" not in out, f"README bash block {i + 1}:\n{out[-3000:]}"
        if block.startswith("make demo"):
            assert (tmp_path / "gpuledger-data" / "gpuledger.sqlite").exists()
        if "collector usage --data-dir hand-run" in block:
            jobs = {ln.split()[0] for ln in p.stdout.splitlines() if re.match(r"\d{6,}\s+sim01\s+GPU-", ln)}
            assert len(jobs) == 6, p.stdout  # mixed load on 8 GPUs: training x2, inference x2, idle, stall
