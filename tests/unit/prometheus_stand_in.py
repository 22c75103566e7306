"""A stand-in for Prometheus's HTTP query API on 127.0.0.1, for the monitoring role's read-only entry points
(status, usage): each GET is answered with the result list a test's function gives for the API path and
its parameters, in Prometheus's JSON envelope."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator

Answer = Callable[[str, dict[str, str]], list[dict]]


@contextlib.contextmanager
def serve(answer: Answer) -> Iterator[int]:
    """Serve ``answer(path, params)`` (params: the query string, one value each) until the block ends; the
    result is a matrix when its rows carry ``values``, else a vector. Yields the port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's API)
            url = urllib.parse.urlsplit(self.path)
            result = answer(url.path, {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()})
            kind = "matrix" if result and "values" in result[0] else "vector"
            body = json.dumps({"status": "success", "data": {"resultType": kind, "result": result}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
