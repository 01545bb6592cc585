"""The node's HTTP port (cluster.cfg `<alias>.metricsPort`, bound on the node's host).

    GET /metrics       Prometheus text exposition (metrics.py; OpenMetrics if asked for)
    GET /              the status page (status_page.py), refreshing by itself
    GET /fragment      the page's body, which the page's script fetches
    GET /status.json   the page's document
    GET /healthz       200 "serving" / 503 "not serving" (as grpc.health.v1 says)

Plain stdlib HTTP: one thread per request, at most `REQUESTS_MAX` at once (others get 503),
each bounded by a socket timeout, so a stuck scraper cannot pile threads up. Read-only: it
changes nothing on the node.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from prometheus_client.exposition import choose_encoder

from raftstore.metrics import MetricsSource, registry_for
from raftstore.status_page import (
    RateTracker,
    render_fragment,
    render_page,
    rows_by_table,
    status_document,
)
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

REQUESTS_MAX: Final = 8
REQUEST_TIMEOUT_S: Final = 10.0


class StatusServer:
    """Serves the node's metrics and status page on `host:port` from a thread that `start`
    starts through `spawn` (the node's threads.Threads)."""

    def __init__(self, source: MetricsSource, host: str, port: int, *, spawn: Spawn) -> None:
        self._source = source
        self._registry = registry_for(source)
        self._rates = RateTracker()
        self._slots = threading.BoundedSemaphore(REQUESTS_MAX)
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._spawn = spawn
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread = self._spawn("status-http", self._server.serve_forever)

    def close(self) -> None:
        if self._thread is not None:  # shutdown() waits for a serve_forever that started
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def respond(self, path: str, accept: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for GET `path`."""
        route = path.split("?", 1)[0]
        if route == "/metrics":
            encoder, content_type = choose_encoder(accept)
            return 200, content_type, encoder(self._registry)
        if route == "/healthz":
            serving = self._source.serving()
            body = b"serving\n" if serving else b"not serving\n"
            return (200 if serving else 503), "text/plain; charset=utf-8", body
        if route not in ("/", "/fragment", "/status.json"):
            return 404, "text/plain; charset=utf-8", b"not found\n"
        document = status_document(self._source)
        if route == "/status.json":
            return 200, "application/json", json.dumps(document).encode()
        rates = self._rates.update(rows_by_table(document))
        text = render_page(document, rates) if route == "/" else render_fragment(document, rates)
        return 200, "text/html; charset=utf-8", text.encode()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S
            server_version = "hastream"

            def do_GET(self) -> None:
                if not server._slots.acquire(blocking=False):
                    self._send(503, "text/plain; charset=utf-8", b"busy\n")
                    return
                try:
                    status, content_type, body = server.respond(
                        self.path, self.headers.get("Accept", "")
                    )
                except Exception:  # a failed render must not kill the server; logged
                    log.exception("status page request failed path=%s", self.path[:200])
                    status, content_type, body = 500, "text/plain", b"internal error\n"
                finally:
                    server._slots.release()
                self._send(status, content_type, body)

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http " + format, *args)

        return Handler
