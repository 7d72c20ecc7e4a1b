"""The collector's operational limits on the HTTP side (one place for the server and the settings).

What one batch may hold is ``collector.validate.Limits`` (checked while decoding)."""

REQUEST_TIMEOUT_S = 30.0  # from a request's first byte to its last: headers and body, however they trickle
IDLE_TIMEOUT_S = 120.0  # a keep-alive connection silent this long between requests is closed (agents push every 10 s)
LISTEN_BACKLOG = 4096  # a fleet reconnecting at once after a restart; the kernel caps it at net.core.somaxconn
MAX_CONNECTIONS = 16_384  # open connections (one thread each); beyond, new ones are closed at once
MAX_PER_HOST = 4  # concurrent ingest requests of one node token
MAX_SERIES_POINTS = 10_000  # GET /api/v1/series answers at most this many points (a coarser step if needed)
MAX_PAGE = 10_000  # GET /api/v1/jobs and /api/v1/usage: rows per answer (the rest by ?offset=)
