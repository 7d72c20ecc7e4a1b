"""The collector's operational limits on the HTTP side (one place for the server and the settings).

What one batch may hold is ``collector.validate.Limits`` (checked while decoding)."""

REQUEST_TIMEOUT_S = 30.0  # from a request's first byte to its last: headers and body, however they trickle
# A request waits this long at most for the ledger: an ingest request for its batch's commit, a read for the store
# behind a commit that stalls (a synchronous standby gone, a link gone silent); then 503, and the agent keeps the batch
# in its spool. Over db.LOCK_TIMEOUT (5 s: a lock another collector holds, which the store answers itself), under the
# agent's 10 s read timeout (agent.push), so that the agent hears the 503 rather than timing out.
LEDGER_TIMEOUT_S = 8.0
IDLE_TIMEOUT_S = 120.0  # a keep-alive connection silent this long between requests is closed (agents push every 10 s)
LISTEN_BACKLOG = 4096  # a fleet reconnecting at once after a restart; the kernel caps it at net.core.somaxconn
# Open connections; beyond, new ones are closed at once (the agent retries). An idle connection costs the event
# loop a few KiB and a file descriptor, no thread: 32,768 is a 10,000-node fleet three times over, and stays
# under the hard RLIMIT_NOFILE of most systems (the server raises the soft limit to the hard one).
MAX_CONNECTIONS = 32_768
MAX_PER_HOST = 4  # concurrent ingest requests of one node token
MAX_SERIES_POINTS = 10_000  # GET /api/v1/series answers at most this many points (a coarser step if needed)
MAX_PAGE = 10_000  # GET /api/v1/jobs and /api/v1/usage: rows per answer (the rest by ?offset=)
# A request's head (request line and headers) is held whole before it is acted on: these bound it (431, 414).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_URL_BYTES = 8 * 1024  # a series query with a 1,024-character host and uuid (the most they may have) fits
