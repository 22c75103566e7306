"""Ansible filters ``teamserve_capacity_plan``, the capacity planner for the vllm role, and
``teamserve_plan_changes``, what a new plan changes in the engine's planned flags.

    {{ vllm_model | teamserve_capacity_plan(vllm_workload, vllm_gpus, vllm_engine) }}
    {{ recorded_plan.flags | teamserve_plan_changes(vllm_plan.flags) }}

Returns the planner's dict (fits, verdict, levers, advice, table, numbers,
flags, layers, admission); ``vllm_model.checkpoint`` may carry the weights'
size the ``vllm_hf_snapshot`` module reports (its ``checkpoint``), and
``vllm_engine.users_trust_each_other`` the role's ``vllm_users_trust_each_other``.
Bad input becomes an AnsibleFilterError carrying the planner's message, which
names the field, the value and the fix.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from teamserve_capacity import PlanError, plan
except ImportError as exc:  # pragma: no cover - depends on the controller's venv
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None


def _plain(value: Any) -> Any:
    """Convert Ansible's lazy/tagged containers into plain dicts, lists and scalars."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


def teamserve_capacity_plan(model: Any, workload: Any, gpus: Any, engine: Any = None) -> dict[str, Any]:
    """Plan a vLLM deployment; see teamserve_capacity.planner.plan."""
    if _IMPORT_ERROR is not None:
        raise AnsibleFilterError(
            "teamserve_capacity_plan: the teamserve_capacity package is not importable on the "
            f"controller ({_IMPORT_ERROR}); run `.venv/bin/pip install --no-deps -e .` in the repo")
    try:
        return plan(_plain(model), _plain(workload), _plain(gpus), _plain(engine or {}))
    except PlanError as err:
        raise AnsibleFilterError(f"teamserve_capacity_plan: {err}") from err


def teamserve_plan_changes(recorded_flags: Any, planned_flags: Any) -> list[str]:
    """The planned engine flags that differ from the recorded ones, one line each.

    Inputs: two mappings of ``vllm serve`` option names (without dashes) to values, as in
    ``vllm_plan.flags`` (the plan the box's engine runs, and the one just computed). Output: sorted lines
    ``"max-num-seqs: 8 -> 16"``; a flag only one side has shows ``(none)`` on the other. Empty when equal.
    """
    before, after = _plain(recorded_flags or {}), _plain(planned_flags or {})
    return [f"{flag}: {before.get(flag, '(none)')} -> {after.get(flag, '(none)')}"
            for flag in sorted(set(before) | set(after)) if before.get(flag) != after.get(flag)]


class FilterModule:
    """Registers the teamserve_capacity_plan filter."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_capacity_plan": teamserve_capacity_plan, "teamserve_plan_changes": teamserve_plan_changes}
