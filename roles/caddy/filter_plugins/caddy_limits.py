"""The gateway's admission limits, derived from the engine's capacity plan (``vllm_plan.flags``).

Plain functions with no Ansible imports, tested by ``tests/gateway/test_caddy_limits.py``. The role's
defaults call them; nothing here is typed by hand in an inventory. The admission rules themselves are
the capacity planner's (``teamserve_capacity.planner``), so the plan and the gateway cannot disagree.
"""
from __future__ import annotations

from typing import Any

from teamserve_capacity.planner import user_inflight_share

# Request body bound per token of --max-model-len, in bytes. A token of text is about 4 bytes of UTF-8
# on average for English; 32 covers the worst cases with room to spare: a 4-byte UTF-8 character
# JSON-escaped as a surrogate pair "\\uXXXX\\uXXXX" is 12 bytes, and BPE tokens rarely hold more than
# a few characters. A prompt longer than --max-model-len is refused by the engine anyway.
BODY_BYTES_PER_TOKEN = 32
# Fixed allowance for the JSON around the prompt (message structure, tool schemas, sampling options).
BODY_OVERHEAD_BYTES = 1024 * 1024


# Where the two numbers below come from, for the error messages.
_FROM_PLAN = ("comes from the capacity plan (vllm_plan.flags, published by the vllm role's checks, which must run "
              "first) or, on a front gateway, from caddy_upstreams")
_SEQS_FIX = (f"it {_FROM_PLAN} (the sum of their max_inflight); for an engine teamserve does not plan, set "
             "caddy_engine_max_num_seqs to the engine's --max-num-seqs")
_LEN_FIX = (f"it {_FROM_PLAN} (the largest max_model_len); for an engine teamserve does not plan, set it to the "
            "engine's --max-model-len")


def _positive_int(value: Any, field: str, fix: str) -> int:
    """``value`` as an int >= 1; raises ValueError naming ``field``, the value and ``fix`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a whole number >= 1; {fix}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field}={value!r} is not a whole number >= 1; {fix}") from None
    if number < 1:
        raise ValueError(f"{field}={value!r} is not a whole number >= 1; {fix}")
    return number


def caddy_user_inflight_default(max_num_seqs: Any) -> int:
    """Default per-user in-flight cap K, in requests: the planner's share of the batch,
    ``max(1, max_num_seqs // 4)`` (``teamserve_capacity.planner.user_inflight_share``, which says why).

    Input: the engine's --max-num-seqs (sequences in one batch). Output: int >= 1.
    Raises ValueError if max_num_seqs is not a whole number >= 1.
    """
    return user_inflight_share(_positive_int(max_num_seqs, "caddy_capacity_seqs", _SEQS_FIX))


def caddy_global_inflight(max_num_seqs: Any, max_num_queued_reqs: Any) -> int:
    """Gateway-wide in-flight cap, in requests: --max-num-seqs + --max-num-queued-reqs.

    That is what the engine holds (running plus its bounded waiting queue); more would only be refused
    by the engine's own 503. Inputs: the two engine flags (requests). Output: int >= 1.
    Raises ValueError if max_num_seqs < 1 or max_num_queued_reqs < 0.
    """
    seqs = _positive_int(max_num_seqs, "caddy_capacity_seqs", _SEQS_FIX)
    problem = (f"caddy_engine_max_num_queued_reqs={max_num_queued_reqs!r} is not a whole number >= 0; it comes "
               "from the capacity plan (vllm_plan.flags['max-num-queued-reqs']); for an engine teamserve does "
               "not plan, set it to the engine's --max-num-queued-reqs")
    try:
        queued = int(max_num_queued_reqs)
    except (TypeError, ValueError):
        raise ValueError(problem) from None
    if queued < 0 or isinstance(max_num_queued_reqs, bool):
        raise ValueError(problem)
    return seqs + queued


def caddy_request_body_max_bytes(max_model_len: Any) -> int:
    """Default request body limit, in bytes: max_model_len * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES.

    Input: the engine's --max-model-len (tokens). Output: int bytes (32,768 tokens -> 2 MiB).
    Raises ValueError if max_model_len is not a whole number >= 1.
    """
    return _positive_int(max_model_len, "caddy_engine_max_model_len", _LEN_FIX) * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


# The slowest decode the engine-silence bound allows for: 5 tokens a second, far below any GPU's speed
# for a model that fits the box (a 2-core CPU runs the testbed's tiny model at about 50).
SLOWEST_TOKENS_PER_SECOND = 5
UPSTREAM_SILENCE_MARGIN_S = 120


def caddy_upstream_read_timeout(max_model_len: Any) -> int:
    """Default longest silence from the engine, in seconds, before the gateway gives up on a request.

    The longest normal silence is a request that waits for a slot behind a full-length generation and
    is then answered without streaming (headers come only when it is done): two generations of
    --max-model-len tokens at SLOWEST_TOKENS_PER_SECOND, plus UPSTREAM_SILENCE_MARGIN_S for prefill.
    Input: the engine's --max-model-len (tokens). Output: int seconds (32,768 tokens -> 13,227 s;
    2,048 -> 939 s). Raises ValueError if max_model_len is not a whole number >= 1.
    """
    tokens = _positive_int(max_model_len, "caddy_engine_max_model_len", _LEN_FIX)
    return 2 * tokens // SLOWEST_TOKENS_PER_SECOND + UPSTREAM_SILENCE_MARGIN_S


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {
            "caddy_user_inflight_default": caddy_user_inflight_default,
            "caddy_global_inflight": caddy_global_inflight,
            "caddy_request_body_max_bytes": caddy_request_body_max_bytes,
            "caddy_upstream_read_timeout": caddy_upstream_read_timeout,
        }
