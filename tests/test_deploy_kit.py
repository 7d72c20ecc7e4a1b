"""The deployment kit in contrib/ as an operator installs it: the systemd units pass `systemd-analyze verify`, keep
their hardening, and their ExecStart lines, with paths and ports substituted for this machine, boot a collector and
an agent that serve /healthz and /metrics, talk TLS with a node token, and stop cleanly on SIGTERM; the example
Prometheus configuration scrapes both. What is substituted is only what cannot exist here: /usr/local/bin, /etc,
/var/lib, systemd's credential and state directories, the public address, and the GPU (the simulated source).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from servers import PrometheusServer, free_port, self_signed_cert
from systemd_units import EXE, UNITS, environment, exec_start, unit

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "node-token-for-the-deploy-test-0123456789"
WATCH = ROOT / "contrib" / "slurm" / "gpuledger-priority-watch.service"  # installed beside slurmctld
SACCT = ROOT / "tests" / "data" / "slurm" / "sacct-json-23.02.6.json"
SITE_CONFIG = "--config /etc/gpuledger/gpuledger.toml"


def _get(url: str, ca: Path | None = None) -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def _wait(what: str, cond, proc: subprocess.Popen, log: Path, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what}: exited {proc.returncode}: {log.read_text()[-2000:]}"
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen, timeout_s: float) -> int:
    proc.send_signal(signal.SIGTERM)  # KillSignal=SIGTERM in both units
    return proc.wait(timeout=timeout_s)


@pytest.mark.parametrize("name", ["gpuledger-collector.service", "gpuledger-agent.service",
                                  "gpuledger-jobs-import.service", "gpuledger-jobs-import.timer", str(WATCH)],
                         ids=lambda name: Path(name).name)
def test_units_verify_and_keep_their_hardening(name: str, tmp_path: Path) -> None:
    u = unit(name)  # (UNITS / an absolute path is that path: the watch unit from contrib/slurm)
    if name.endswith(".timer"):
        assert (UNITS / name.replace(".timer", ".service")).exists() and u["OnUnitActiveSec"]
    else:
        _check_hardening(u)
    verify = shutil.which("systemd-analyze")
    assert verify, "systemd-analyze is needed to check the units (Debian package systemd)"
    # verify needs the binary to exist: the same units with the venv's gpuledger
    for f in [*UNITS.iterdir(), WATCH]:
        (tmp_path / f.name).write_text(f.read_text().replace("/usr/local/bin/gpuledger", EXE))
    r = subprocess.run([verify, "verify", str(tmp_path / Path(name).name)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if "gpuledger" in ln]
    assert r.returncode == 0 and problems == [], r.stdout + r.stderr


def _check_hardening(u: dict[str, list[str]]) -> None:
    assert u["ProtectSystem"] == ["strict"] and u["ProtectHome"] == ["yes"] and u["NoNewPrivileges"] == ["yes"]
    assert u.get("DynamicUser") == ["yes"] or u.get("User") == ["gpuledger"]
    # what it may write: its StateDirectory, or (the watch: slurmctld reads the feed there) the data dir it names
    assert (u.get("StateDirectory") and "${STATE_DIRECTORY}" in u["ExecStart"][0]
            or u.get("ReadWritePaths") == ["/var/lib/gpuledger"])
    assert u["ExecStart"][0].startswith("/usr/local/bin/gpuledger ")
    # exit 2 is bad configuration: a unit restarted on it would fail every RestartSec for ever
    assert "Restart" not in u or u.get("RestartPreventExitStatus") == ["2"]
    # every unit on the ledger's side reads the site's [ledger] table (the agent has no configuration file)
    assert u.get("DynamicUser") == ["yes"] or SITE_CONFIG in u["ExecStart"][0]


def test_jobs_import_unit_fills_the_ledger_the_config_names(tmp_path: Path) -> None:
    """The import unit's ExecStart on a site whose ledger is named in /etc/gpuledger/gpuledger.toml ([ledger] url,
    here a SQLite file outside the data dir; PostgreSQL alike): the jobs go there, not to a store of their own."""
    etc, state, ledger = tmp_path / "etc", tmp_path / "var-lib-gpuledger", tmp_path / "ledger" / "shared.sqlite"
    for d in (etc, state, ledger.parent):
        d.mkdir()
    (etc / "gpuledger.toml").write_text(f'cluster = "example"\n[ledger]\nurl = "{ledger}"\n')
    u = unit("gpuledger-jobs-import.service")
    sub = {"/usr/local/bin/gpuledger": EXE, "${STATE_DIRECTORY}": str(state), "/var/lib/gpuledger": str(state),
           "/etc/gpuledger/": f"{etc}/", "--slurm --since 2": f"--sacct-json {SACCT}"}  # sacct's output, as a file
    r = subprocess.run(exec_start(u, sub), capture_output=True, text=True, timeout=120, env=environment(u, sub),
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (state / "gpuledger.sqlite").exists(), "the import filled a stray store in the data dir"
    r = subprocess.run([EXE, "jobs", "list", "--ledger-url", str(ledger), "--format", "json"], capture_output=True,
                       text=True, timeout=60, env=environment(u, sub))
    assert r.returncode == 0 and json.loads(r.stdout), r.stderr


def test_units_boot_talk_tls_are_scraped_and_stop(tmp_path: Path) -> None:
    etc, creds = tmp_path / "etc", tmp_path / "credentials"
    etc.mkdir()
    creds.mkdir()
    cert, key = self_signed_cert(etc)
    port, metrics_port = free_port(), free_port()
    node = "deploy-node01"
    # The example configuration as installed, pointed at this machine's files and ports.
    cfg = (ROOT / "contrib" / "etc" / "gpuledger.toml").read_text()
    cfg = cfg.replace("/etc/gpuledger/collector.crt", str(cert)).replace("/etc/gpuledger/collector.key", str(key))
    cfg = cfg.replace("/etc/gpuledger/tokens.toml", str(etc / "tokens.toml"))
    (etc / "gpuledger.toml").write_text(cfg)
    tokens = (ROOT / "contrib" / "etc" / "tokens.toml").read_text()
    (etc / "tokens.toml").write_text(tokens.replace('# "gpu-node001" = "..."', f'"{node}" = "{TOKEN}"'))
    (creds / "collector-token").write_text(TOKEN + "\n")

    c_state, a_state = tmp_path / "var-lib-gpuledger", tmp_path / "var-lib-gpuledger-agent"
    c_state.mkdir()
    a_state.mkdir()
    c_sub = {"/usr/local/bin/gpuledger": EXE, "${STATE_DIRECTORY}": str(c_state), "/var/lib/gpuledger": str(c_state),
             "/etc/gpuledger/": f"{etc}/", "--host 0.0.0.0": "--host 127.0.0.1", "--port 8470": f"--port {port}"}
    a_sub = {"/usr/local/bin/gpuledger": EXE, "${STATE_DIRECTORY}": str(a_state),
             "${CREDENTIALS_DIRECTORY}": str(creds),
             "/etc/gpuledger/ca.pem": str(cert), "gpuledger.example.org:8470": f"127.0.0.1:{port}",
             "--source nvml": "--source simulated --load mixed --gpus 4",
             "--metrics-addr 0.0.0.0": "--metrics-addr 127.0.0.1",
             "--metrics-port 9445": f"--metrics-port {metrics_port}", "--interval 10": "--interval 0.5"}
    cu, au = unit("gpuledger-collector.service"), unit("gpuledger-agent.service")
    c_log, a_log = tmp_path / "collector.log", tmp_path / "agent.log"
    base = f"https://127.0.0.1:{port}"
    with c_log.open("w") as cl, a_log.open("w") as al:
        collector = subprocess.Popen(exec_start(cu, c_sub), stdout=cl, stderr=subprocess.STDOUT,
                                     env=environment(cu, c_sub), cwd=tmp_path)
        agent = None
        try:
            _wait("collector /healthz", lambda: _get(f"{base}/healthz", cert)[0] == 200, collector, c_log)
            agent = subprocess.Popen([*exec_start(au, a_sub), "--host", node], stdout=al, stderr=subprocess.STDOUT,
                                     env=environment(au, a_sub), cwd=tmp_path)
            _wait("agent /metrics", lambda: "gpuledger_gpu_sm_active_ratio" in _get(
                f"http://127.0.0.1:{metrics_port}/metrics")[1], agent, a_log)
            # the agent's batches arrive over TLS with its token (push every 3 cycles of 0.5 s)
            accepted = re.compile(r"^gpuledger_collector_samples_accepted_total (\S+)$", re.M)
            _wait("samples at the collector", lambda: (m := accepted.search(_get(f"{base}/metrics", cert)[1]))
                  and float(m.group(1)) >= 12, collector, c_log)

            prom_cfg = (ROOT / "contrib" / "prometheus" / "prometheus.yml").read_text()
            prom_cfg = re.sub(r"scrape_(interval|timeout): \d+s", r"scrape_\1: 1s", prom_cfg)
            prom_cfg = prom_cfg.replace("/etc/prometheus/gpuledger-agents.yml", str(tmp_path / "agents.yml"))
            prom_cfg = prom_cfg.replace('["gpuledger.example.org:8470"]', f'["127.0.0.1:{port}"]')
            prom_cfg = prom_cfg.replace("    static_configs:\n      - targets: [\"127.0.0",
                                        f"    scheme: https\n    tls_config: {{ca_file: {cert}}}\n"
                                        f"    static_configs:\n      - targets: [\"127.0.0")
            targets = (ROOT / "contrib" / "prometheus" / "gpuledger-agents.yml").read_text()
            targets = re.sub(r"(?m)^    - gpu-node001:9445\n    - gpu-node002:9445$",
                             f"    - 127.0.0.1:{metrics_port}", targets)
            (tmp_path / "agents.yml").write_text(targets)
            with PrometheusServer(tmp_path / "prom", {}, config=prom_cfg) as prom:
                deadline = time.monotonic() + 30
                up: dict[str, float] = {}
                while time.monotonic() < deadline and up != {"gpuledger-agent": 1.0, "gpuledger-collector": 1.0}:
                    time.sleep(0.5)
                    up = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query("up")["result"]}
                assert up == {"gpuledger-agent": 1.0, "gpuledger-collector": 1.0}, up
                inst = prom.query('gpuledger_gpu_sm_active_ratio{job="gpuledger-agent"}')["result"]
                assert {r["metric"]["instance"] for r in inst} == {"127.0.0.1"}  # the port is relabelled away
            assert _stop(agent, float(au["TimeoutStopSec"][0])) == 0
            assert "stopped after" in a_log.read_text()
            agent = None
        finally:
            if agent is not None and agent.poll() is None:
                agent.kill()
            code = (_stop(collector, float(cu["TimeoutStopSec"][0])) if collector.poll() is None
                    else collector.returncode)
        assert code == 0, c_log.read_text()[-2000:]
    # what the collector stored is there for the accounting commands, in the unit's state directory
    r = subprocess.run([EXE, "collector", "usage", "--format", "json"], capture_output=True, text=True, timeout=60,
                       env=environment(cu, c_sub))
    assert r.returncode == 0, r.stderr
    assert len({u["job_id"] for u in json.loads(r.stdout)}) == 3  # mixed load on 4 GPUs: training, inference, ...
    assert "Traceback" not in a_log.read_text() + c_log.read_text()
