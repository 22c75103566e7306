#!/usr/bin/env python3
"""A TEST DOUBLE of an OpenAI-compatible inference server, used behind the Caddy gateway in molecule/caddy.

It is not vLLM and does not pretend to be: it answers the few endpoints the gateway tests need, with the
wire format of the OpenAI API (the format vLLM's OpenAI-compatible server also speaks):

* ``GET /health`` -> 200, no key needed (vLLM's /health is unauthenticated too).
* ``GET /v1/models`` -> a model list with one model, ``fixture`` (``FIXTURE_MODEL``).
* ``POST /v1/chat/completions`` -> a completion; with ``"stream": true`` a ``text/event-stream`` of
  ``chat.completion.chunk`` events, one per token, ``FIXTURE_TOKEN_DELAY_S`` seconds apart (the test of
  unbuffered streaming measures these gaps on the client side), ending with ``data: [DONE]``; with
  ``"stream_options": {"include_usage": true}`` a last chunk with empty ``choices`` and ``usage`` before it,
  as vLLM sends, and with ``"continuous_usage_stats": true`` as well each chunk's running ``usage`` (the
  prompt and the completion tokens so far, vLLM's extension). Every answer's usage is 1 prompt token and
  ``max_tokens`` completion tokens.
  ``max_tokens`` sets the number of tokens (default 8, at most 10000). ``"model": "fixture-busy"`` gets
  the 503 vLLM answers when its queue is full (``--max-num-queued-reqs``), body copied from the real
  vLLM 0.32.0 CPU build's answer on the testbed (no Retry-After); so does a request with the header
  ``X-Fixture-Busy`` (any value), whatever its model: gateways pass the header on, so a test can mark
  requests this engine refuses while a real engine, which ignores it, answers them (a front's retry).
  ``"model": "fixture-wait"`` answers a non-streamed request only after ``max_tokens`` x
  ``FIXTURE_TOKEN_DELAY_S`` seconds, as an engine does that generates before it sends anything (a client
  can go away before the answer).
* A request with the header ``X-Fixture-Idle-Close`` (any value) is answered, and the next request on
  its connection is not: the connection is closed when it arrives, as an HTTP server closes a keep-alive
  connection whose idle timeout fires just as the client writes into it (vLLM's uvicorn, after
  ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds).
* ``GET /fixture/stats`` -> JSON counters: requests served, streams completed, streams aborted by the
  client (a write to a closed socket), and the Authorization header values seen, hashed with SHA-256
  (so tests can prove which key reached the engine without the key ever being logged).

Every /v1 request must carry ``Authorization: Bearer <FIXTURE_API_KEY>`` (the engine's own key) or it is
refused with 401 and an OpenAI-style error body, like ``vllm serve --api-key``.

Configuration (environment): FIXTURE_LISTEN (default ``127.0.0.1:8000``), FIXTURE_API_KEY (required),
FIXTURE_TOKEN_DELAY_S (float seconds, default 0.2), FIXTURE_MODEL (default ``fixture``; a second instance
with another name stands in for a hosted fallback endpoint, which names its own model in its answers). Standard library only, so it runs on a bare box.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

API_KEY = os.environ["FIXTURE_API_KEY"]
TOKEN_DELAY_S = float(os.environ.get("FIXTURE_TOKEN_DELAY_S", "0.2"))
HOST, _, PORT = os.environ.get("FIXTURE_LISTEN", "127.0.0.1:8000").rpartition(":")
MODEL = os.environ.get("FIXTURE_MODEL", "fixture")  # the model it serves and names in every answer
# Asking for this model gets the engine's "queue full" 503 (body as the real vLLM 0.32.0 CPU build sends it).
BUSY_MODEL = "fixture-busy"
# A request with this header (any value) gets the same 503, whatever its model.
BUSY_HEADER = "X-Fixture-Busy"
# Asking for this model delays a non-streamed answer by the time its tokens take.
WAIT_MODEL = "fixture-wait"
# A request with this header (any value) gets its connection closed, unanswered, at its next request.
IDLE_CLOSE_HEADER = "X-Fixture-Idle-Close"

_lock = threading.Lock()
_stats: dict[str, Any] = {
    "requests": 0,
    "streams_completed": 0,
    "streams_aborted": 0,
    "in_flight": 0,
    "max_in_flight": 0,
    "closed_as_idle": 0,
    "authorization_sha256": [],
}


def _bump(name: str, delta: int = 1) -> None:
    """Add ``delta`` to the integer counter ``name`` under the lock; tracks the in-flight maximum."""
    with _lock:
        _stats[name] = int(_stats[name]) + delta
        _stats["max_in_flight"] = max(int(_stats["max_in_flight"]), int(_stats["in_flight"]))


def _openai_error(message: str, err_type: str, code: str) -> bytes:
    """Return an OpenAI-style error body: {"error": {"message", "type", "param", "code"}} as UTF-8 JSON."""
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()


class Handler(BaseHTTPRequestHandler):
    """Request handler; HTTP/1.1 so SSE responses can be sent with chunked transfer encoding."""

    protocol_version = "HTTP/1.1"
    close_at_next = False  # set on the connection's handler by IDLE_CLOSE_HEADER

    def _closed_as_idle(self) -> bool:
        """Close the connection without an answer if its last request asked for it (IDLE_CLOSE_HEADER)."""
        if self.close_at_next:
            _bump("closed_as_idle")
            self.close_connection = True
            return True
        if self.headers.get(IDLE_CLOSE_HEADER) is not None:
            self.close_at_next = True
        return False

    def log_message(self, fmt: str, *args: object) -> None:  # keep journal quiet; stats are at /fixture/stats
        return

    def _send_json(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        with _lock:
            seen = _stats["authorization_sha256"]
            digest = hashlib.sha256(header.encode()).hexdigest()
            if digest not in seen:
                seen.append(digest)
        if header != f"Bearer {API_KEY}":
            self._send_json(401, _openai_error("Unauthorized", "invalid_request_error", "invalid_api_key"))
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self._closed_as_idle():
            return
        path = urlsplit(self.path).path  # routed by path, a query string ignored, as vLLM's server does
        if path == "/health":
            self._send_json(200, b"")
        elif path == "/fixture/stats":
            with _lock:
                self._send_json(200, json.dumps(_stats).encode())
        elif path == "/v1/models":
            if self._authorized():
                body = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fixture"}]}
                self._send_json(200, json.dumps(body).encode())
        else:
            self._send_json(404, _openai_error("Not found", "invalid_request_error", "not_found"))

    def do_POST(self) -> None:  # noqa: N802
        if self._closed_as_idle():
            return
        length = int(self.headers.get("Content-Length", "0"))
        request = json.loads(self.rfile.read(length) or b"{}")
        body: dict[str, Any]
        if urlsplit(self.path).path != "/v1/chat/completions":
            self._send_json(404, _openai_error("Not found", "invalid_request_error", "not_found"))
            return
        if not self._authorized():
            return
        _bump("requests")
        # vLLM 0.32's answer when --max-num-queued-reqs is reached
        if request.get("model") == BUSY_MODEL or self.headers.get(BUSY_HEADER) is not None:
            body = {"error": {"message": "The engine is currently busy and cannot accept new requests. Please try "
                              "again later or on a different instance.", "type": "Service Unavailable",
                              "param": None, "code": 503}}
            self._send_json(503, json.dumps(body).encode())
            return
        tokens = max(1, min(int(request.get("max_tokens") or 8), 10000))
        created = int(time.time())
        if not request.get("stream"):
            if request.get("model") == WAIT_MODEL:
                time.sleep(tokens * TOKEN_DELAY_S)
            body = {
                "id": "chatcmpl-fixture", "object": "chat.completion", "created": created, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * tokens},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
            }
            try:
                self._send_json(200, json.dumps(body).encode())
            except (BrokenPipeError, ConnectionResetError):  # the gateway dropped it: its client went away
                self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        _bump("in_flight")
        try:
            options = request.get("stream_options") or {}
            running = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
            for i in range(tokens):
                chunk = {
                    "id": "chatcmpl-fixture", "object": "chat.completion.chunk", "created": created, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                 "finish_reason": "length" if i == tokens - 1 else None}],
                }
                if running:  # vLLM: chunk.usage with the choice's tokens so far
                    chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": i + 1, "total_tokens": i + 2}
                self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                time.sleep(TOKEN_DELAY_S)
            if options.get("include_usage"):  # vLLM's usage-only last chunk
                chunk = {"id": "chatcmpl-fixture", "object": "chat.completion.chunk", "created": created, "model": MODEL,
                         "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                                  "total_tokens": tokens + 1}}
                self._write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")
            _bump("streams_completed")
        except (BrokenPipeError, ConnectionResetError):
            _bump("streams_aborted")
            self.close_connection = True
        finally:
            _bump("in_flight", -1)

    def _write_chunk(self, data: bytes) -> None:
        """Write one HTTP/1.1 chunk and flush it at once (the empty chunk ends the body)."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 256  # listen backlog: bursts of 64+ connections (benchmarks)
    ThreadingHTTPServer((HOST, int(PORT)), Handler).serve_forever()
