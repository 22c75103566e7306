"""Filter of the upgrade: what a change of pins does to the engine (``teamserve_engine_changes``).

    {{ recorded_engine | teamserve_engine_changes(new_engine) }}
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


class FilterModule:
    """Registers teamserve_engine_changes."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_engine_changes": teamserve_engine_changes}
