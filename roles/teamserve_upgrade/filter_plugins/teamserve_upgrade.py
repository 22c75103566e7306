"""Filters of the upgrade: what a change of pins does to the engine (``teamserve_engine_changes``) and
whether it reaches the gateway (``teamserve_gateway_changes``).

    {{ recorded_engine | teamserve_engine_changes(new_engine) }}
    {{ recorded_engine | teamserve_gateway_changes(new_engine, changed_pins, gateway_pins) }}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _flags(argv: Iterable[Any]) -> dict[str, list[str]]:
    """``[model, "--a", "1", "--b", "--c=2"]`` -> ``{"--a": ["1"], "--b": [], "--c": ["2"]}`` (model skipped)."""
    flags: dict[str, list[str]] = {}
    current = None
    for token in [str(t) for t in argv][1:]:
        if token.startswith("-") and not token[1:2].isdigit():
            current, _, value = token.partition("=")
            flags[current] = [value] if value else []
        elif current is not None:
            flags[current].append(token)
    return flags


def teamserve_engine_changes(old: Any, new: Any) -> list[str]:
    """What the new pins change in the engine, one line each, for the upgrade's summary.

    Inputs: two engine records ``{"vllm_version": str, "argv": [model, flags...], "kv_tokens": int,
    "max_num_seqs": int, "max_model_len": int}``: ``old`` as the box recorded it (None or {} when the box
    recorded none), ``new`` from this run's plan. Output: lines such as "vLLM: 0.31.0 -> 0.32.0",
    "KV cache tokens: 120000 -> 118000 (-1.7 %)", "--max-num-seqs: 8 -> 16", "flag added: --x 1",
    "flag removed: --y"; ["the box recorded no engine plan; ..."] without ``old``; ["no change to the engine's
    plan or flags"] when nothing differs.
    """
    if not isinstance(old, dict) or not old:
        return ["the box recorded no engine plan (site.yml records one from now on); the new plan is shown above"]
    lines = []
    if old.get("vllm_version") != new.get("vllm_version"):
        lines.append(f"vLLM: {old.get('vllm_version')} -> {new.get('vllm_version')}")
    for key, label in (("kv_tokens", "KV cache tokens"), ("max_num_seqs", "max-num-seqs"),
                       ("max_model_len", "max-model-len")):
        was, now = old.get(key), new.get(key)
        if was != now:
            change = ""
            if isinstance(was, int) and isinstance(now, int) and was > 0:
                change = f" ({(now - was) / was * 100:+.1f} %)"
            lines.append(f"{label}: {was} -> {now}{change}")
    before, after = _flags(old.get("argv") or []), _flags(new.get("argv") or [])
    for flag in after:
        if flag not in before:
            lines.append(f"flag added: {' '.join([flag, *after[flag]])}")
        elif before[flag] != after[flag]:
            lines.append(f"{flag}: {' '.join(before[flag]) or '(switch)'} -> {' '.join(after[flag]) or '(switch)'}")
    lines.extend(f"flag removed: {' '.join([flag, *before[flag]])}" for flag in before if flag not in after)
    return lines or ["no change to the engine's plan or flags"]


# The parts of the engine record the gateway is configured from: the engine's flags (max-num-seqs,
# max-model-len, the scheduling policy, the served model name are in its argv) and the per-user admission.
_GATEWAY_FIELDS = (("argv", "the engine's flags"), ("admission", "the per-user admission"),
                   ("max_model_len", "max-model-len"))


def teamserve_gateway_changes(old: Any, new: Any, changed_pins: Iterable[str], gateway_pins: Iterable[str]) -> list[str]:
    """Why an upgrade must apply the gateway again (the caddy role), or [] when the new pins leave its inputs
    as the box runs them.

    Inputs: ``old`` and ``new`` engine records as for teamserve_engine_changes (here also ``admission``,
    the plan's per-user caps); ``changed_pins``, the lock keys this upgrade changes; ``gateway_pins``, the
    lock keys the gateway is deployed from. Output: one reason per differing input, e.g. "caddy_version
    changed", "the engine's flags changed"; "the box recorded no plan for the gateway" when ``old`` is missing
    or lacks a field, so an older record always applies the gateway.
    """
    reasons = [f"{pin} changed" for pin in gateway_pins if pin in set(changed_pins)]
    if not isinstance(old, dict) or any(field not in old for field, _ in _GATEWAY_FIELDS):
        return [*reasons, "the box recorded no plan for the gateway"]
    reasons += [f"{label} changed" for field, label in _GATEWAY_FIELDS if old.get(field) != new.get(field)]
    return reasons


class FilterModule:
    """Registers teamserve_engine_changes and teamserve_gateway_changes."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_engine_changes": teamserve_engine_changes,
                "teamserve_gateway_changes": teamserve_gateway_changes}
