"""A real loopback HTTP server for agent tests: GET answers a fixed body (a /metrics page), POST bodies are kept and
answered as the collector acknowledges a batch (the agent counts nothing else as delivered)."""

from __future__ import annotations

import http.server
import threading


def serve(body: bytes, received: list[bytes] | None = None) -> http.server.ThreadingHTTPServer:
    """Start a server on a free 127.0.0.1 port; call ``shutdown()`` and ``server_close()`` when done."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("Content-Length", "0"))
            data = self.rfile.read(n)
            if received is not None:
                received.append(data)
            ack = b'{"accepted": 0, "duplicate": false, "duplicate_samples": 0, "too_late": 0}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ack)))
            self.end_headers()
            self.wfile.write(ack)

        def log_message(self, *a) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
