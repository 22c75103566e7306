#!/usr/bin/python
"""Ansible module: wait for a vLLM engine container to become ready and time its cold start."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.teamserve.core.plugins.module_utils.sse import (
    STREAM_ERRORS,
    StreamError,
    events,
    has_token,
    open_stream,
)

# PHASE_MARKERS and LOGGED_DURATIONS: the log lines this module reads (re-exported for the tests)
from ansible_collections.teamserve.core.plugins.module_utils.vllm_log import (  # noqa: F401
    LOGGED_DURATIONS,
    PHASE_MARKERS,
    engine_failure,
    parse_docker_time,
    parse_start_phases,
)

try:
    import docker  # Debian: python3-docker

    HAS_DOCKER = True
except ImportError:  # pragma: no cover - reported through fail_json
    HAS_DOCKER = False

DOCUMENTATION = r"""
module: vllm_engine_probe
short_description: Wait for a vLLM container to answer /health and time its cold start
description:
  - Polls the engine's C(/health) endpoint until it answers 200, reading the container's state between
    polls, so an engine that exits while loading fails at once with its last log lines instead of
    waiting out the timeout.
  - Times are measured from the container's C(State.StartedAt), so they are the cold start as users feel
    it: seconds to C(/health) 200 and, when O(chat) is given, seconds to the first streamed token of a
    chat completion sent through the gateway.
  - With O(restart), the module restarts the container itself first, so the cold start is timed from
    the moment the restart was asked for (C(seconds_to_container_start) includes stopping the old
    process); it then reports changed.
  - The phases in between are read from the engine's own log (Docker's timestamps on vLLM's lines
    "Model loading took", "torch.compile takes", "Graph capturing finished", "init engine (profile,
    create kv cache, warmup model) took", "Application startup complete"; see RETURN).
options:
  container: {description: Name of the engine container., type: str, required: true}
  health_url: {description: URL of the engine's health endpoint., type: str, required: true}
  timeout: {description: Seconds to wait for readiness, counted from the container's start., type: int, default: 900}
  poll_interval: {description: Seconds between polls., type: float, default: 1.0}
  log_lines: {description: Engine log lines returned when the engine fails., type: int, default: 40}
  restart: {description: Restart the container first and time from the restart request., type: bool, default: false}
  stop_timeout: {description: Seconds Docker gives the old engine to stop on restart before killing it., type: int, default: 30}
  chat:
    description:
      - When set, a streamed request is sent once the engine is ready. A chat completion, or a completion
        when O(chat.url) ends in C(/v1/completions) (a completions-only model).
    type: dict
    suboptions:
      url: {description: "Chat completions (or completions) URL, normally through the gateway.", type: str, required: true}
      api_key: {description: Bearer key for that URL., type: str, required: true, no_log: true}
      model: {description: Served model name., type: str, required: true}
      ca_path: {description: CA bundle to verify the gateway's certificate with., type: path}
      validate_certs: {description: Verify TLS certificates., type: bool, default: true}
      timeout: {description: Seconds to wait for the first token., type: int, default: 120}
requirements: [Docker SDK for Python (python3-docker)]
author: teamserve
"""

RETURN = r"""
started_at: {description: Container start time (epoch seconds)., returned: always, type: float}
seconds_to_health: {description: Seconds from container start to /health 200., returned: success, type: float}
seconds_to_first_token: {description: Seconds from container start to the first streamed token., returned: when chat is set, type: float}
first_token_latency: {description: TTFT of the probe request itself, in seconds., returned: when chat is set, type: float}
seconds_to_container_start:
  description: Seconds from the restart request to the container's start (stopping the old engine included).
  returned: when restart is set
  type: float
phases:
  description:
    - Seconds from the container's start to each start-up phase, from the timestamps of the engine's log lines
      (null when the line is absent, e.g. no CUDA graphs on the CPU build); keys weights_loaded, compiled,
      graphs_captured, engine_initialised, api_started.
  returned: success
  type: dict
logged_durations:
  description: What vLLM itself logged, in seconds - weights_loading, model_loading, torch_compile, graph_capture, engine_init.
  returned: success
  type: dict
log_tail: {description: Last engine log lines., returned: on failure, type: list}
reason:
  description:
    - Why the engine failed, in vLLM's own words - its argparse error or last exception line from the log, or
      the error body of the probe request - or null when neither says.
  returned: on failure
  type: str
"""


def http_status(url: str, timeout: float) -> int:
    """Return the HTTP status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def probe_body(url: str, model: str) -> dict[str, Any]:
    """The streamed request (8 tokens at most) for ``url``: a completion when it ends in ``/v1/completions``
    (a completions-only model), else a chat completion."""
    if url.rstrip("/").endswith("/v1/completions"):
        return {"model": model, "prompt": "Say hello.", "max_tokens": 8, "stream": True}
    return {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "stream": True}


def first_token(chat: dict[str, Any]) -> float:
    """Send one streamed request (probe_body); return the epoch time (seconds) its first token arrived.

    Raises StreamError (non-200, or a stream without a token), OSError or http.client.HTTPException.
    """
    body = probe_body(chat["url"], chat["model"])
    conn, response = open_stream(chat["url"], body, chat["api_key"], chat.get("ca_path"), chat["timeout"],
                                 chat.get("validate_certs", True))
    try:
        for event in events(response):
            if has_token(event):
                return time.time()
    finally:
        conn.close()
    raise StreamError("the stream ended without a content token")


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            container=dict(type="str", required=True),
            health_url=dict(type="str", required=True),
            timeout=dict(type="int", default=900),
            poll_interval=dict(type="float", default=1.0),
            log_lines=dict(type="int", default=40),
            restart=dict(type="bool", default=False),
            stop_timeout=dict(type="int", default=30),
            chat=dict(
                type="dict",
                options=dict(
                    url=dict(type="str", required=True),
                    api_key=dict(type="str", required=True, no_log=True),
                    model=dict(type="str", required=True),
                    ca_path=dict(type="path"),
                    validate_certs=dict(type="bool", default=True),
                    timeout=dict(type="int", default=120),
                ),
            ),
        ),
        supports_check_mode=True,
    )
    if not HAS_DOCKER:
        module.fail_json(msg="vllm_engine_probe needs the Docker SDK for Python on the host (apt: python3-docker)")
    params = module.params
    client = docker.APIClient(version="auto")

    def tail() -> list:
        raw = client.logs(params["container"], tail=params["log_lines"]).decode("utf-8", "replace")
        return raw.splitlines()

    def failed(msg: str, **extra: Any) -> None:
        # The reason may sit above the last log_lines (a traceback), so read further back for it.
        raw = client.logs(params["container"], tail=400).decode("utf-8", "replace")
        reason = engine_failure(raw.splitlines())
        module.fail_json(msg=f"{msg}: {reason}" if reason else msg, reason=reason, log_tail=tail(), **extra)

    try:
        state = client.inspect_container(params["container"])["State"]
    except docker.errors.NotFound:
        module.fail_json(msg=f"engine container '{params['container']}' does not exist")
    if module.check_mode and (params["restart"] or not state.get("Running")):
        module.exit_json(changed=params["restart"], skipped=True, msg="not measured in check mode")
    result: dict[str, Any] = {"changed": False}
    if params["restart"]:
        requested = time.time()
        client.restart(params["container"], timeout=params["stop_timeout"])
        result["changed"] = True
        state = client.inspect_container(params["container"])["State"]
        result["seconds_to_container_start"] = round(parse_docker_time(state["StartedAt"]) - requested, 2)
    started = parse_docker_time(state["StartedAt"])
    deadline = started + params["timeout"]
    result["started_at"] = started
    while True:
        state = client.inspect_container(params["container"])["State"]
        if not state.get("Running") or state.get("Restarting"):
            failed(f"engine container '{params['container']}' stopped while loading "
                   f"(status {state.get('Status')}, exit code {state.get('ExitCode')})", **result)
        if parse_docker_time(state["StartedAt"]) != started:
            failed("engine container restarted while loading", **result)
        if http_status(params["health_url"], timeout=5) == 200:
            result["seconds_to_health"] = round(time.time() - started, 2)
            break
        if time.time() > deadline:
            failed(f"engine not ready {params['timeout']} s after it started; if the model needs longer to load, raise "
                   "vllm_ready_timeout (the budget) or vllm_cold_start_regression_margin (the wait derived from the last "
                   "start)", **result)
        time.sleep(params["poll_interval"])

    since = int(started) - 1
    raw = client.logs(params["container"], timestamps=True, since=since).decode("utf-8", "replace")
    result["phases"], result["logged_durations"] = parse_start_phases(raw.splitlines(), started)
    result["phases"]["health"] = result["seconds_to_health"]

    if params["chat"]:
        sent = time.time()
        try:
            arrived = first_token(params["chat"])
        except (*STREAM_ERRORS, StreamError) as exc:
            module.fail_json(msg=f"engine is ready but the streamed probe through {params['chat']['url']} failed: {exc}",
                             reason=str(exc), log_tail=tail(), **result)
        result["first_token_latency"] = round(arrived - sent, 3)
        result["seconds_to_first_token"] = round(arrived - started, 2)
        result["phases"]["first_token"] = result["seconds_to_first_token"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
