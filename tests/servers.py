"""Real PostgreSQL, InfluxDB 1.x, VictoriaMetrics and Prometheus servers for the tests (Debian packages, loopback,
free ports).

Each server runs from a temporary directory, binds only 127.0.0.1 and is stopped (SIGTERM to the PID we
started, SIGKILL after a grace period) when its context exits. Nothing here knows about gpuledger.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, data: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _Server:
    binary: str = ""

    def __init__(self, workdir: Path) -> None:
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not installed (Debian package; see .ci/ensure-debs)")
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / f"{self.binary}.log"

    def _spawn(self, argv: list[str]) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)

    def _wait(self, ready: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready after {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


class _PrometheusApi:
    """Prometheus' HTTP query API, which VictoriaMetrics serves too."""

    url: str
    log: Path

    def api(self, path: str, **params: str | float) -> Any:
        status, body = _http(f"{self.url}{path}?{urllib.parse.urlencode(params)}")
        doc = json.loads(body or b"{}")
        if status != 200 or doc.get("status") != "success":
            raise RuntimeError(f"{type(self).__name__} {path} failed ({status}): {doc.get('error')} {params}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return dict(self.api("/api/v1/query", query=expr, time=at if at is not None else time.time()))

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
        return dict(self.api("/api/v1/query_range", query=expr, start=start, end=end, step=step))

    def metric_names(self) -> set[str]:
        return set(self.api("/api/v1/label/__name__/values"))

    def wait_for(self, expr: str, timeout: float = 20.0) -> None:
        """Until ``expr`` returns a non-empty instant vector (e.g. every target scraped at least once)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query(expr)["result"]:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{type(self).__name__}: {expr!r} still empty after {timeout} s: "
                           f"{self.log.read_text()[-1500:]}")


class InfluxServer(_Server):
    """InfluxDB 1.x (``influxd``) with one database; ``query`` runs InfluxQL and returns the JSON results;
    ``port`` may be chosen in advance."""

    binary = "influxd"

    def __init__(self, workdir: Path, db: str = "gpuledger", port: int | None = None) -> None:
        super().__init__(workdir)
        self.db = db
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InfluxServer:
        w = self.workdir
        # Every listener on loopback; Debian's build spells the phone-home switch "reporting-enabled".
        conf = f"""reporting-enabled = false
bind-address = "127.0.0.1:{free_port()}"
[meta]
  dir = "{w}/meta"
[data]
  dir = "{w}/data"
  wal-dir = "{w}/wal"
  query-log-enabled = false
  max-series-per-database = 0
  max-values-per-tag = 0
[monitor]
  store-enabled = false
[http]
  bind-address = "127.0.0.1:{self.port}"
  log-enabled = false
[ifql]
  bind-address = "127.0.0.1:{free_port()}"
"""
        (w / "influxdb.conf").write_text(conf)
        self._spawn(["influxd", "run", "-config", str(w / "influxdb.conf")])
        try:
            self._wait(lambda: _http(f"{self.url}/ping")[0] == 204, "influxd")
            self.query(f'CREATE DATABASE "{self.db}"', post=True)
        except BaseException:
            self.stop()
            raise
        return self

    def query(self, q: str, post: bool = False) -> list[dict[str, Any]]:
        """Run InfluxQL; returns the ``results`` list; raises on an error in any statement."""
        params = {"q": q, "db": self.db, "epoch": "ms"}
        if post:
            status, body = _http(f"{self.url}/query", urllib.parse.urlencode(params).encode())
        else:
            status, body = _http(f"{self.url}/query?{urllib.parse.urlencode(params)}")
        doc = json.loads(body or b"{}")
        if status != 200 or "error" in doc:
            raise RuntimeError(f"InfluxQL failed ({status}): {doc.get('error')}\n{q}")
        for r in doc.get("results", []):
            if "error" in r:
                raise RuntimeError(f"InfluxQL failed: {r['error']}\n{q}")
        return list(doc.get("results", []))

    def write_lines(self, lines: list[str]) -> None:
        status, body = _http(f"{self.url}/write?db={self.db}&precision=ns", "\n".join(lines).encode())
        if status != 204:
            raise RuntimeError(f"InfluxDB write failed ({status}): {body[:500]!r}")


class VictoriaMetricsServer(_PrometheusApi, _Server):
    """VictoriaMetrics (InfluxDB line protocol in, Prometheus API out); ``port`` may be chosen in advance."""

    binary = "victoria-metrics"

    def __init__(self, workdir: Path, port: int | None = None, flags: tuple[str, ...] = ()) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags  # more command-line flags, e.g. "-dedup.minScrapeInterval=1ms"

    def __enter__(self) -> VictoriaMetricsServer:
        # No query latency offset, so a test reads back what it has just written.
        self._spawn(["victoria-metrics", f"-httpListenAddr=127.0.0.1:{self.port}",
                     f"-storageDataPath={self.workdir / 'data'}", "-retentionPeriod=100y", "-search.latencyOffset=0s",
                     *self.flags])
        try:
            self._wait(lambda: _http(f"{self.url}/health")[0] == 200, "victoria-metrics")
        except BaseException:
            self.stop()
            raise
        return self

    def flush(self) -> None:
        """Make what was imported searchable now (VictoriaMetrics flushes its buffers every second or so)."""
        _http(f"{self.url}/internal/force_flush")

    def export(self, match: str) -> list[dict[str, Any]]:
        """Every raw point of the series ``match`` selects: one dict (metric, values, timestamps) per series."""
        status, body = _http(f"{self.url}/api/v1/export?{urllib.parse.urlencode({'match[]': match})}")
        if status != 200:
            raise RuntimeError(f"export failed ({status}): {body[:500]!r}")
        return [json.loads(line) for line in body.splitlines() if line.strip()]


def _pg_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise RuntimeError("PostgreSQL not installed (Debian package postgresql; see .ci/ensure-debs)")
    return found[-1].parent


class PostgresServer(_Server):
    """A throwaway PostgreSQL cluster (``initdb`` + ``pg_ctl``) in ``workdir`` on a free loopback port, trust auth,
    fsync on. As root it runs as the ``postgres`` account (initdb refuses root). ``new_database()`` gives each
    test its own empty database; ``url`` names the cluster's ``postgres`` database."""

    binary = "psql"

    def __init__(self, workdir: Path) -> None:
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:  # the postgres account cannot enter pytest's private temporary tree: a directory of its own
            workdir = Path(tempfile.mkdtemp(prefix="gpuledger-pg-"))
            shutil.chown(workdir, "postgres")
        super().__init__(workdir)
        self.bin = _pg_bin()
        self.port = free_port()
        self.user = "gl"
        self._names = itertools.count(1)

    def url_for(self, db: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def _run(self, *argv: str) -> None:
        subprocess.run([*self._as, *argv], check=True, capture_output=True, cwd="/")

    def __enter__(self) -> PostgresServer:
        w = self.workdir
        self._run(str(self.bin / "initdb"), "-D", str(w / "pg"), "-A", "trust", "-U", self.user, "-E", "UTF8")
        # autovacuum off: its ANALYZE takes transaction ids at times of its own, and tests count a store's
        # commits by the ids assigned (ledger_engines.commit_counter); each test's database is small and brief
        opts = (f"-p {self.port} -k {w} -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=200 "
                "-c shared_buffers=64MB -c autovacuum=off")
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(w / "pg"), "-w", "-t", "60", "-l", str(w / "pg.log"),
                      "-o", opts, "start")
        except subprocess.CalledProcessError as exc:
            log = (w / "pg.log").read_text() if (w / "pg.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {exc.stderr.decode()[-1000:]} {log[-2000:]}") from exc
        return self

    def psql(self, sql: str, db: str = "postgres") -> str:
        out = subprocess.run([str(self.bin / "psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                              "-p", str(self.port), "-U", self.user, "-d", db, "-c", sql],
                             check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def new_database(self, prefix: str = "t") -> str:
        """A fresh empty database; returns its URL."""
        name = f"{prefix}{os.getpid()}_{next(self._names)}"
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def stop(self) -> None:
        if (self.workdir / "pg" / "postmaster.pid").exists():
            subprocess.run([*self._as, str(self.bin / "pg_ctl"), "-D", str(self.workdir / "pg"), "-m", "fast", "-w",
                            "stop"], capture_output=True, cwd="/")
        if self._as:
            shutil.rmtree(self.workdir, ignore_errors=True)


class PrometheusServer(_PrometheusApi, _Server):
    """Prometheus scraping the given loopback targets every second; ``query``/``query_range`` use its HTTP API."""

    binary = "prometheus"

    def __init__(self, workdir: Path, targets: dict[str, list[str]], interval_s: int = 1,
                 config: str | None = None) -> None:
        """``config``: a whole prometheus.yml to run instead of one built from ``targets``."""
        super().__init__(workdir)
        self.config = config
        self.targets = targets
        self.interval_s = interval_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        w = self.workdir
        jobs = "".join(
            f"  - job_name: {name}\n    static_configs:\n      - targets: {json.dumps(addrs)}\n"
            for name, addrs in self.targets.items()
        )
        (w / "prometheus.yml").write_text(self.config or (
            f"global:\n  scrape_interval: {self.interval_s}s\n  evaluation_interval: {self.interval_s}s\n"
            f"scrape_configs:\n{jobs}"
        ))
        self._spawn([
            "prometheus", f"--config.file={w / 'prometheus.yml'}", f"--storage.tsdb.path={w / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ])
        try:
            self._wait(lambda: _http(f"{self.url}/-/ready")[0] == 200, "prometheus")
        except BaseException:
            self.stop()
            raise
        return self


def self_signed_cert(workdir: Path, ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed CA certificate for ``ip`` and its key (PEM files in ``workdir``): TLS on loopback."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuledger-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = workdir / "cert.pem", workdir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
