"""A real loopback HTTP server for agent tests: GET answers a fixed body (a /metrics page), POST bodies are kept."""

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
            if received is not None:
                received.append(self.rfile.read(n))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
