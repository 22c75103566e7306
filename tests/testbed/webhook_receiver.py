"""A stand-in for an alert receiver (a chat or paging webhook) on the testbed box: appends each JSON body
POSTed to it as one line of OUT. Usage: webhook_receiver.py HOST PORT OUT (loopback only in the tests)."""

from __future__ import annotations

import http.server
import json
import sys


class Receiver(http.server.BaseHTTPRequestHandler):
    """Answers every POST with 200 after storing its body; anything else with 405."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with open(self.server.out, "a", encoding="utf-8") as out:  # type: ignore[attr-defined]
            out.write(json.dumps(json.loads(body)) + "\n")
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(405)
        self.end_headers()


if __name__ == "__main__":
    host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    server = http.server.HTTPServer((host, port), Receiver)
    server.out = path  # type: ignore[attr-defined]
    server.serve_forever()
