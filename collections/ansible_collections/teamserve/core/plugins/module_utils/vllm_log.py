"""What vLLM's start-up log says: phase times, the durations vLLM logs itself, the KV cache size.

Standard library only: imported by the vllm role's engine probe on the box
(``ansible_collections.teamserve.core.plugins.module_utils.vllm_log``) and by the verify role's checks on the controller, so each
log line has one parser. Lines checked against the testbed's vLLM 0.32.0 CPU log and public GPU logs.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

# vLLM's start-up log lines, first match wins per phase: vllm/v1/worker/gpu_model_runner.py "Model loading
# took" (GPU) or vllm/model_executor/model_loader/default_loader.py "Loading weights took" (the CPU runner
# prints only this one); vllm/compilation/monitor.py "torch.compile takes" (GPU) or
# vllm/v1/worker/cpu_model_runner.py "Warming up done." (the CPU runner compiles while warming up);
# gpu_model_runner.py "Graph capturing finished in" (no CUDA graphs on the CPU build); vllm/v1/engine/core.py
# "init engine (profile, create kv cache, warmup model) took"; uvicorn's "Application startup complete"
# once the API server listens.
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
# vllm/v1/core/kv_cache_utils.py: "GPU KV cache size: 42,656 tokens"; the CPU build prints "CPU".
KV_CACHE_SIZE = re.compile(r"\b([A-Z]PU) KV cache size: ([0-9,]+) tokens")


def parse_docker_time(value: str) -> float:
    """Docker's RFC 3339 timestamp (nanosecond precision, ``Z``) as epoch seconds. Raises ValueError."""
    head, _, frac = value.rstrip("Z").partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return stamp + (float("0." + frac[:9]) if frac else 0.0)


def parse_start_phases(lines: list[str], started_at: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an engine start-up from its log.

    Input: ``lines`` as ``docker logs --timestamps`` prints them ("<RFC 3339 time> <text>"), and the
    container's start time ``started_at`` (epoch seconds). Output: ``(phases, logged)``:
    ``phases[name]`` = seconds from the container's start to the FIRST line carrying one of that phase's
    markers (PHASE_MARKERS), ``logged[name]`` = the duration vLLM printed itself, in seconds
    (LOGGED_DURATIONS). A phase or duration whose line is missing is None. Lines without a parsable
    timestamp are skipped. Raises nothing.
    """
    phases: dict[str, Any] = dict.fromkeys(PHASE_MARKERS)
    logged: dict[str, Any] = dict.fromkeys(LOGGED_DURATIONS)
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


def kv_cache_size(text: str) -> dict[str, Any] | None:
    """The KV cache vLLM allocated, from the first "GPU/CPU KV cache size: N tokens" line of a log.

    Returns ``{"device": "GPU" | "CPU" | ..., "tokens": int}`` (tokens of KV cache across the engine), or
    None when the log has no such line (e.g. it was rotated away since the engine started).
    """
    match = KV_CACHE_SIZE.search(text)
    if not match:
        return None
    return {"device": match.group(1), "tokens": int(match.group(2).replace(",", ""))}


# Why an engine failed, as vLLM says it: argparse's "vllm serve: error: ..." (a bad flag or value) or the
# last Python exception line ("ValueError: ...", pydantic's "ValidationError: 1 validation error for
# ModelConfig" followed by indented details). vllm/v1/engine/core_client.py ends a failed start with
# "RuntimeError: Engine core initialization failed. See root cause above." - a pointer, not the reason.
_ARGPARSE_ERROR = re.compile(r"(?:^|\s)(vllm(?: serve)?: error: .+)$")
_EXCEPTION = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception): .+)$")
_POINTERS = ("See root cause above", "Engine core initialization failed")
# Docker's timestamp and vLLM's logger prefix, e.g. "(APIServer pid=1) ERROR 12-03 01:02:03 [core.py:42] ".
_PREFIX = re.compile(r"^(?:\d{4}-\d\d-\d\dT\S+Z )?(?:\(\w+ pid=\d+\) )?(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")


def engine_failure(lines: list[str], limit: int = 400) -> str | None:
    """The reason a vLLM engine gave for failing, from the end of its log.

    Input: the log ``lines`` (oldest first, with or without Docker's timestamps) and ``limit`` (characters).
    Output: vLLM's own error line - the last argparse error, else the last exception line that is not
    the "see root cause above" pointer - with up to three indented detail lines that follow it (pydantic's
    validation details), joined by spaces and cut to ``limit`` characters; None when the log has none.
    Raises nothing.
    """
    texts = [_PREFIX.sub("", line.rstrip()) for line in lines]
    for pattern in (_ARGPARSE_ERROR, _EXCEPTION):
        for index in range(len(texts) - 1, -1, -1):
            match = pattern.search(texts[index])
            if not match or any(pointer in match.group(1) for pointer in _POINTERS):
                continue
            parts = [match.group(1).strip()]
            for detail in texts[index + 1 : index + 4]:
                if not detail[:1].isspace() or not detail.strip():
                    break
                parts.append(detail.strip())
            reason = " ".join(parts)
            return reason if len(reason) <= limit else reason[: limit - 1] + "…"
    return None
