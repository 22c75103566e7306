"""The one error type the planner raises on bad input."""

from __future__ import annotations

from typing import Any


class PlanError(ValueError):
    """Bad or unsupported planner input.

    The message always names the field, the value that was given and what to
    do about it, so the Ansible filter and the CLI can show it as-is.

    Attributes:
        field: dotted path of the offending input, e.g. ``config.num_hidden_layers``.
        value: the value that was given (``None`` when the field was missing).
        fix: one sentence telling the user what to change.
    """

    def __init__(self, field: str, value: Any, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        shown = "missing" if value is None else repr(value)
        super().__init__(f"{field}: {shown} — {fix}")
