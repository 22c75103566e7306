#!/usr/bin/python
"""Ansible module: wait for a vLLM engine container to become ready and time its cold start."""

from __future__ import annotations

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
    description: When set, a streamed chat completion is sent once the engine is ready.
    type: dict
    suboptions:
      url: {description: Chat completions URL (normally through the gateway)., type: str, required: true}
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
"""

import json
import re
import ssl
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any

from ansible.module_utils.basic import AnsibleModule

try:
    import docker  # Debian: python3-docker

    HAS_DOCKER = True
except ImportError:  # pragma: no cover - reported through fail_json
    HAS_DOCKER = False


def parse_docker_time(value: str) -> float:
    """Convert Docker's RFC 3339 timestamp (nanosecond precision, ``Z``) to epoch seconds (float)."""
    head, _, frac = value.rstrip("Z").partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return stamp + (float("0." + frac[:9]) if frac else 0.0)


def http_status(url: str, timeout: float) -> int:
    """Return the HTTP status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - URL from the role
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def first_token(chat: dict) -> float:
    """Send one streamed chat completion; return the epoch time its first content token arrived."""
    body = json.dumps(
        {
            "model": chat["model"],
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        chat["url"],
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {chat['api_key']}"},
    )
    context = None
    if chat["url"].startswith("https"):
        context = ssl.create_default_context(cafile=chat.get("ca_path"))
        if not chat.get("validate_certs", True):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(request, timeout=chat["timeout"], context=context) as response:  # noqa: S310
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    return time.time()
    raise RuntimeError("the stream ended without a content token")


# vLLM's start-up log lines, first match wins per phase: vllm/v1/worker/gpu_model_runner.py "Model loading
# took" (GPU) or vllm/model_executor/model_loader/default_loader.py "Loading weights took" (the CPU runner
# prints only this one); vllm/compilation/monitor.py "torch.compile takes" (GPU) or
# vllm/v1/worker/cpu_model_runner.py "Warming up done." (the CPU runner compiles while warming up);
# gpu_model_runner.py "Graph capturing finished in" (no CUDA graphs on the CPU build); vllm/v1/engine/core.py
# "init engine (profile, create kv cache, warmup model) took"; uvicorn's "Application startup complete"
# once the API server listens. Checked against the testbed's vLLM 0.32.0 CPU log and public GPU logs.
PHASE_MARKERS = {
    "weights_loaded": ("Model loading took", "Loading weights took"),
    "compiled": ("torch.compile takes", "Warming up done."),
    "graphs_captured": ("Graph capturing finished in",),
    "engine_initialised": ("init engine (profile, create kv cache, warmup model) took",),
    "api_started": ("Application startup complete",),
}
LOGGED_DURATIONS = {
    "weights_loading": re.compile(r"Loading weights took ([0-9.]+) s"),
    "model_loading": re.compile(r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) s"),
    "torch_compile": re.compile(r"torch\.compile takes ([0-9.]+) s in total"),
    "graph_capture": re.compile(r"Graph capturing finished in ([0-9.]+) secs?"),
    "engine_init": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"),
}


def parse_start_phases(lines: list[str], started_at: float) -> tuple[dict, dict]:
    """Read an engine start-up from its log.

    Input: ``lines`` as ``docker logs --timestamps`` prints them ("<RFC 3339 time> <text>"), and the
    container's start time ``started_at`` (epoch seconds). Output: ``(phases, logged)``:
    ``phases[name]`` = seconds from the container's start to the FIRST line carrying one of that phase's
    markers (PHASE_MARKERS), ``logged[name]`` = the duration vLLM printed itself, in seconds (LOGGED_DURATIONS).
    A phase or duration whose line is missing is None. Lines without a parsable timestamp are skipped.
    Raises nothing.
    """
    phases: dict = dict.fromkeys(PHASE_MARKERS)
    logged: dict = dict.fromkeys(LOGGED_DURATIONS)
    for line in lines:
        stamp, _, text = line.partition(" ")
        try:
            at = parse_docker_time(stamp)
        except ValueError:
            continue
        for name, markers in PHASE_MARKERS.items():
            if phases[name] is None and any(marker in text for marker in markers):
                phases[name] = round(at - started_at, 2)
        for name, pattern in LOGGED_DURATIONS.items():
            match = pattern.search(text)
            if logged[name] is None and match:
                logged[name] = float(match.group(1))
    return phases, logged


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
            module.fail_json(
                msg=f"engine container '{params['container']}' stopped while loading "
                f"(status {state.get('Status')}, exit code {state.get('ExitCode')}); last log lines follow",
                log_tail=tail(),
                **result,
            )
        if parse_docker_time(state["StartedAt"]) != started:
            module.fail_json(msg="engine container restarted while loading", log_tail=tail(), **result)
        if http_status(params["health_url"], timeout=5) == 200:
            result["seconds_to_health"] = round(time.time() - started, 2)
            break
        if time.time() > deadline:
            module.fail_json(
                msg=f"engine not ready {params['timeout']} s after it started; if the model needs longer to load, raise "
                "vllm_ready_timeout (the budget) or vllm_cold_start_regression_margin (the wait derived from the last start)",
                log_tail=tail(),
                **result,
            )
        time.sleep(params["poll_interval"])

    since = int(started) - 1
    raw = client.logs(params["container"], timestamps=True, since=since).decode("utf-8", "replace")
    result["phases"], result["logged_durations"] = parse_start_phases(raw.splitlines(), started)
    result["phases"]["health"] = result["seconds_to_health"]

    if params["chat"]:
        sent = time.time()
        try:
            arrived = first_token(params["chat"])
        except (urllib.error.URLError, OSError, RuntimeError, ValueError) as exc:
            module.fail_json(msg=f"engine is ready but the streamed probe through {params['chat']['url']} failed: {exc}", **result)
        result["first_token_latency"] = round(arrived - sent, 3)
        result["seconds_to_first_token"] = round(arrived - started, 2)
        result["phases"]["first_token"] = result["seconds_to_first_token"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
