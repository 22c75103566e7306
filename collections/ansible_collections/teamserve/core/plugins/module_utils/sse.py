"""Server-sent events client for the OpenAI-compatible streaming API (vLLM, or the gateway in front of it).

Standard library only, so Ansible modules ship it to the box and controller-side code imports the same
file (``ansible_collections.teamserve.core.plugins.module_utils.sse``). One client for every streamed request the
project makes: the engine probe's first token and the verify role's long-prompt measurement.

Wire format: ``text/event-stream`` (https://html.spec.whatwg.org/multipage/server-sent-events.html); vLLM
sends one ``data: <JSON>`` line per chunk and ``data: [DONE]`` at the end
(vllm/entrypoints/openai/serving_chat.py and serving_completion.py).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

# What a failed streamed request can raise: refused/reset/timed out sockets and TLS errors are OSError,
# a broken HTTP exchange HTTPException, a non-200 answer StreamError.
STREAM_ERRORS = (OSError, http.client.HTTPException)


class StreamError(RuntimeError):
    """The server answered a streamed request with a status other than 200."""


def open_stream(url: str, body: dict[str, Any], api_key: str, ca_path: str | None = None,
                timeout: float = 120.0, validate_certs: bool = True) -> tuple[http.client.HTTPConnection,
                                                                              http.client.HTTPResponse]:
    """POST ``body`` as JSON to ``url`` (the full endpoint URL, e.g. ``https://gw:8443/v1/completions``).

    ``api_key`` goes in the Authorization header; ``ca_path`` is the CA bundle that verifies an https
    server; ``timeout`` (seconds) bounds the connect and every read. Returns the open connection and
    response; the caller closes the connection. Raises StreamError (with the status and the start of the
    body) unless the answer is 200, and OSError / http.client.HTTPException on network errors.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        context = ssl.create_default_context(cafile=ca_path)
        if not validate_certs:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        conn = http.client.HTTPSConnection(host, parts.port or 443, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, parts.port or 80, timeout=timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
                          "Accept": "text/event-stream"})
    response = conn.getresponse()
    if response.status != 200:
        text = response.read(400).decode("utf-8", "replace")
        conn.close()
        raise StreamError(f"HTTP {response.status} from {url}: {text}")
    return conn, response


def events(response: http.client.HTTPResponse, stop: threading.Event | None = None) -> Iterator[dict[str, Any]]:
    """Yield each ``data:`` event of an SSE response as a dict, until ``[DONE]``, end of stream or ``stop``.

    Lines that are not ``data:`` (comments, ``event:``, blank separators) and data that is not a JSON
    object are skipped. The caller takes the arrival time when an event is yielded.
    """
    while stop is None or not stop.is_set():
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def has_token(event: dict[str, Any]) -> bool:
    """True when a chunk carries generated text: ``choices[].text`` (completions) or
    ``choices[].delta.content`` (chat completions)."""
    return any(choice.get("text") or (choice.get("delta") or {}).get("content")
               for choice in event.get("choices") or [])
