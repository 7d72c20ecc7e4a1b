#!/usr/bin/env python3
"""Which HTTP layer for the collector: the standard library's threading server, aiohttp, uvicorn (uvloop +
httptools) with starlette, and the collector's own (``collector.server``: uvloop + httptools, no framework),
measured on the fleet shape.

Every candidate serves the same handler: read the body, run the collector's real validation
(``collector.validate.parse_batch``) and answer a small JSON document; no store, so what differs is the
HTTP layer alone. "collector" is the product's ``CollectorServer`` itself, its transport and its whole
POST /api/v1/samples path (auth, ingest slot, validation, metrics, answer), with the one step that stores
(``_ingest``) answering as if stored. The clients are simulated agents (``bench/loadgen.py``): each node
holds one keep-alive connection and pushes an 80-sample msgpack batch from the agent's own encoder (8 GPUs
x 10 s at 1 Hz) every --period seconds. Two phases per candidate, each server in its own process:

- fleet: --nodes connections (default 2,000), one push per node per --period: requests/s, p50/p99
  latency, connection errors, server CPU per request, server RSS with all connections open;
- saturation: --conns connections posting back to back for --burst seconds: the most requests/s.

    .venv/bin/python bench/http_layer.py                 # ~3 minutes
    .venv/bin/python bench/http_layer.py --nodes 500 --seconds 10 --burst 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loadgen  # noqa: E402

from gpuledger.agent.push import encode_batch  # noqa: E402
from gpuledger.schema.records import GpuSample  # noqa: E402

PATH = "/api/v1/samples"
CANDIDATES = ("stdlib", "aiohttp", "uvicorn", "collector")

# Each candidate's server; argv: port. The handler is the same everywhere: parse_batch, then a JSON reply.
SERVE = {
    "stdlib": """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from gpuledger.collector.validate import BatchError, parse_batch
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            b = parse_batch(body, self.headers["Content-Type"], time.time())
            status, out = 200, json.dumps({"accepted": b.n_samples}).encode()
        except BatchError as e:
            status, out = e.status, json.dumps({"error": e.message}).encode()
        self.send_response(status); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
class S(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096
S(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""",
    "aiohttp": """
import json, sys, time
from aiohttp import web
from gpuledger.collector.validate import BatchError, parse_batch
async def post(request):
    body = await request.read()
    try:
        b = parse_batch(body, request.content_type, time.time())
        return web.json_response({"accepted": b.n_samples})
    except BatchError as e:
        return web.json_response({"error": e.message}, status=e.status)
async def get(request):
    return web.Response()
app = web.Application(client_max_size=64 * 2**20)
app.router.add_post("/api/v1/samples", post)
app.router.add_get("/healthz", get)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), backlog=4096, access_log=None, print=None)
""",
    "uvicorn": """
import sys, time
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from gpuledger.collector.validate import BatchError, parse_batch
async def post(request):
    body = await request.body()
    try:
        b = parse_batch(body, request.headers.get("content-type", ""), time.time())
        return JSONResponse({"accepted": b.n_samples})
    except BatchError as e:
        return JSONResponse({"error": e.message}, status_code=e.status)
async def get(request):
    return Response()
app = Starlette(routes=[Route("/api/v1/samples", post, methods=["POST"]), Route("/healthz", get)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), backlog=4096, log_level="warning", access_log=False,
            loop="uvloop", http="httptools", timeout_keep_alive=60)
""",
    "collector": """
import sys, tempfile
from gpuledger.collector.server import CollectorServer
from gpuledger.collector.store import IngestResult, Store
class ParseOnly(CollectorServer):
    async def _ingest(self, batch):
        return IngestResult(batch.n_samples)
ParseOnly(Store(tempfile.mkdtemp() + "/unused.sqlite"), port=int(sys.argv[1])).serve_forever()
""",
}


def fleet_body(node: int, t0: float) -> bytes:
    """80 samples of one node (8 GPUs x 10 s), msgpack series layout, as the agent encodes them."""
    host = f"node{node:05d}"
    samples = [GpuSample(ts=t0 + k, host=host, gpu_uuid=f"GPU-{node:05d}-{g}", gpu_index=g, model="NVIDIA H200",
                         sm_active_ratio=0.5, dram_bw_ratio=0.3, power_watts=300.0 + k, energy_joules=1e6 + 300.0 * k,
                         mem_used_bytes=60 * 2**30, temp_celsius=50.0, sm_clock_hz=1.98e9, mem_clock_hz=2.6e9,
                         job_ids=(str(1000 + node // 2),))
               for g in range(8) for k in range(10)]
    return encode_batch(f"agent-{node}", host, 1, samples, fmt="msgpack")


def run_candidate(name: str, nodes: int, period: float, seconds: float, conns: int, burst: float) -> dict:
    port = loadgen.free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVE[name], str(port)], cwd=ROOT)
    try:
        loadgen.wait_ready(port, proc)
        t0 = time.time() - 20
        headers = {"Content-Type": "application/msgpack"}
        reqs = [loadgen.request_bytes(PATH, fleet_body(i, t0), headers) for i in range(nodes)]

        def make(i: int, node: int = 0) -> tuple[bytes, int]:
            return reqs[node], 80

        fleet = loadgen.Stats()
        cpu0, wall0 = loadgen.cpu_s(proc.pid), time.monotonic()
        rss_open = [0]

        async def run_fleet() -> None:
            until = time.monotonic() + seconds
            rng = random.Random(1)

            async def sample_rss() -> None:
                while time.monotonic() < until:
                    await asyncio.sleep(1.0)
                    rss_open[0] = max(rss_open[0], loadgen.rss_bytes(proc.pid))

            await asyncio.gather(sample_rss(), *(
                loadgen.node("127.0.0.1", port, lambda i, n=n: make(i, n), period, until, fleet, rng)
                for n in range(nodes)))

        asyncio.run(run_fleet())
        fleet_wall = time.monotonic() - wall0
        fleet_cpu = loadgen.cpu_s(proc.pid) - cpu0
        sat = loadgen.Stats()
        cpu1 = loadgen.cpu_s(proc.pid)
        asyncio.run(loadgen.closed_loop("127.0.0.1", port, lambda i: make(i, i % nodes), conns, burst, sat))
        sat_cpu = loadgen.cpu_s(proc.pid) - cpu1
        n = len(fleet.latencies)
        return {
            "fleet": {"requests_per_s": round(n / fleet_wall, 1), "ok": fleet.ok, "statuses": fleet.statuses,
                      "p50_ms": loadgen.ms(loadgen.percentile(fleet.latencies, 0.5)),
                      "p99_ms": loadgen.ms(loadgen.percentile(fleet.latencies, 0.99)),
                      "connection_errors": fleet.conn_errors, "error_kinds": fleet.error_kinds,
                      "server_cpu_ms_per_request": round(1e3 * fleet_cpu / max(n, 1), 3),
                      "server_rss_mb": round(rss_open[0] / 2**20, 1)},
            "saturation": {"requests_per_s": round(len(sat.latencies) / burst, 1),
                           "samples_per_s": round(sat.samples / burst),
                           "p99_ms": loadgen.ms(loadgen.percentile(sat.latencies, 0.99)),
                           "connection_errors": sat.conn_errors, "statuses": sat.statuses,
                           "server_cpu_ms_per_request": round(1e3 * sat_cpu / max(len(sat.latencies), 1), 3)},
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between one node's pushes")
    ap.add_argument("--seconds", type=float, default=25.0, help="fleet phase length")
    ap.add_argument("--conns", type=int, default=64, help="saturation phase connections")
    ap.add_argument("--burst", type=float, default=8.0, help="saturation phase length")
    ap.add_argument("--only", choices=CANDIDATES, action="append")
    a = ap.parse_args()
    loadgen.raise_nofile()
    results = {}
    for name in a.only or CANDIDATES:
        print(f"-- {name}", file=sys.stderr, flush=True)
        results[name] = run_candidate(name, a.nodes, a.period, a.seconds, a.conns, a.burst)
    base = results.get("stdlib")
    if base:
        for r in results.values():
            r["saturation"]["vs_stdlib"] = round(r["saturation"]["requests_per_s"]
                                                 / max(base["saturation"]["requests_per_s"], 1e-9), 2)
    print(json.dumps({"nodes": a.nodes, "period_s": a.period, "fleet_seconds": a.seconds,
                      "saturation_conns": a.conns, "results": results}, indent=1))


if __name__ == "__main__":
    main()
