"""Render and check the argv the vLLM container is started with.

The official ``vllm/vllm-openai`` image's entrypoint is ``vllm serve`` (vLLM's docker/Dockerfile,
``ENTRYPOINT ["vllm", "serve"]``), so the container command is ``[MODEL, --flag, value, ...]``: one argv
token per element, never a shell string. Every flag is checked against a snapshot of the pinned vLLM
version's own ``vllm serve`` parser (``roles/vllm/files/vllm-serve-options-<version>.json``, generated from
the real package by ``tools/vllm_serve_options.py``), so a renamed, removed or misspelled flag fails the
play before anything is deployed instead of crash-looping the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

try:  # The pure functions below are unit-tested without Ansible's error type.
    from ansible.errors import AnsibleFilterError
except ImportError:  # pragma: no cover
    AnsibleFilterError = ValueError

_FLAG = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9-]*$")  # long options and short aliases (-tp)
_IMAGE_REF = re.compile(
    r"^(?P<repository>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)"
    r":(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})@(?P<digest>sha256:[0-9a-f]{64})$"
)


def _options_index(snapshot: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Map every option string of a parser snapshot to its description.

    Input: the parsed JSON snapshot, ``{"vllm_version": str, "options": [{"option": "--max-model-len",
    "dest": str, "takes_value": bool, "nargs": ..., "choices": [..] | null}, ...]}`` (one entry per option
    string; aliases and ``--no-`` forms have entries of their own); other keys (``generated_from``, the
    build the list was read from) are not used here.
    Output: ``{"--max-model-len": {...}, "--no-enable-prefix-caching": {...}, ...}``.
    Raises AnsibleFilterError when the snapshot has no ``options`` list.
    """
    options = snapshot.get("options") if isinstance(snapshot, Mapping) else None
    if not isinstance(options, list) or not options:
        raise AnsibleFilterError(
            "vllm_options_snapshot has no 'options' list; regenerate it with tools/vllm_serve_options.py"
        )
    index: dict[str, dict[str, Any]] = {}
    for option in options:
        index[option["option"]] = option
    return index


def _release(snapshot: Any) -> str:
    """The release a snapshot describes ("0.32.0+cpu" -> "0.32.0"), "?" when it names none."""
    return str(snapshot.get("vllm_version", "?")).split("+")[0] if isinstance(snapshot, Mapping) else "?"


def _removed_note(flag: str, previous: Mapping[str, Any] | None, version: str) -> str:
    """Why ``flag`` is unknown when the release the box runs (``previous``) knew it; "" otherwise."""
    if not previous:
        return ""
    old = _options_index(previous).get(flag)
    if old is None:
        return ""
    note = f" vLLM {_release(previous)}, which the box runs, accepts it; {version} does not"
    if old.get("deprecated"):
        note += f" (vLLM {_release(previous)} said: {old['deprecated']})"
    return note + "."


def _choice_note(flag: str, value: str, previous: Mapping[str, Any] | None) -> str:
    """Say so when the release the box runs accepted ``value`` for ``flag``; "" otherwise."""
    old = _options_index(previous).get(flag) if previous else None
    if old and value in [str(c) for c in old.get("choices") or []]:
        return f" (vLLM {_release(previous)}, which the box runs, accepts it)"
    return ""


def vllm_serve_argv(
    flags: Mapping[str, Any],
    model: str,
    snapshot: Mapping[str, Any],
    extra_args: Iterable[str] = (),
    previous: Mapping[str, Any] | None = None,
) -> list[str]:
    """Build the ``vllm serve`` argv (entrypoint arguments) from a flag mapping, checking every flag.

    Inputs:
      flags: ``{"max-model-len": 8192, "enable-prefix-caching": True, "quantization": None, ...}``; keys are
        vLLM long option names without the leading ``--``; ``None`` omits the flag; ``True`` renders a bare
        switch; ``False`` renders ``--no-<flag>`` (argparse BooleanOptionalAction) and is an error for a
        switch that has no ``--no-`` form; lists render one value token each.
      model: the positional model argument (HF repo id or a path inside the container).
      snapshot: the pinned version's parser snapshot (see ``_options_index``).
      extra_args: admin-supplied tokens appended verbatim after their flags are checked.
      previous: the snapshot of the release the box runs now (an upgrade), or None; a flag or value it
        accepted and the pinned release does not is named as removed, with the old release's deprecation
        note (vLLM's help text, which names the replacement when there is one).
    Output: list of argv tokens, flags in the mapping's order, then ``extra_args``.
    Raises AnsibleFilterError naming the flag, the pinned version and the fix when a flag is unknown to
    the pinned vLLM, a value is not among the option's choices, or a value-taking flag has no value.
    """
    # The CPU build names itself 0.32.0+cpu; the snapshot file is named after the release.
    version = _release(snapshot)
    index = _options_index(snapshot)
    argv: list[str] = [str(model)]

    def check(flag: str, source: str) -> dict[str, Any]:
        if not _FLAG.match(flag) or flag not in index:
            removed = _removed_note(flag, previous, version)
            if removed:
                raise AnsibleFilterError(
                    f"{source}: '{flag}' is not an option of 'vllm serve' in vLLM {version}.{removed} Remove it (or use "
                    "its replacement) before switching releases; nothing on the box has changed"
                )
            raise AnsibleFilterError(
                f"{source}: '{flag}' is not an option of 'vllm serve' in vLLM {version}; "
                f"check the spelling against roles/vllm/files/vllm-serve-options-{version}.json "
                "(the option may have been renamed or removed in this version)"
            )
        return index[flag]

    for name, value in flags.items():
        if value is None:
            continue
        flag = f"--{name}"
        if value is False:
            negated = f"--no-{name}"
            check(negated, f"vllm flag '{name}: false'")
            argv.append(negated)
            continue
        option = check(flag, f"vllm flag '{name}'")
        if value is True:
            if option.get("takes_value"):
                raise AnsibleFilterError(f"vllm flag '{name}' takes a value in vLLM {version}; got true")
            argv.append(flag)
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        choices = option.get("choices")
        for item in values:
            if choices and str(item) not in [str(c) for c in choices]:
                raise AnsibleFilterError(
                    f"vllm flag '{name}': '{item}' is not one of {choices} in vLLM {version}"
                    f"{_choice_note(flag, str(item), previous)}"
                )
        argv.append(flag)
        argv.extend(str(item) for item in values)

    extra = list(extra_args or [])
    # Every option the mapping owns, an omitted one (None, e.g. no quantization) included.
    set_by = {index[f"--{name}"]["dest"]: f"--{name}" for name in flags if f"--{name}" in index}
    _check_extra_args(extra, check, set_by, str(model), version, previous)
    argv.extend(extra)
    return argv


def _is_value(token: str) -> bool:
    """True for a token argparse reads as a value, not an option: no leading '-', or a negative number."""
    return not token.startswith("-") or bool(re.match(r"^-\d", token))


def _needs_value(option: Mapping[str, Any]) -> bool:
    """True when argparse requires a value after the option (nargs None or '+'; '?' may stand alone)."""
    return bool(option.get("takes_value")) and option.get("nargs") != "?"


def _check_extra_args(extra: list[Any], check: Any, set_by: Mapping[str, str], model: str, version: str,
                      running: Mapping[str, Any] | None = None) -> None:
    """Check ``vllm_extra_args`` the way ``vllm serve``'s parser would read it, before the engine does.

    Inputs: the tokens; ``check`` (flag, source) -> the option's snapshot entry (raises for an unknown
    flag); ``set_by`` maps each option dest the rendered flags already set to the flag that sets it; the
    model positional; the pinned version (for messages); the snapshot of the release the box runs, or None.
    Raises AnsibleFilterError naming the element, its value and the fix for: a non-string, a positional
    (``serve``, ``vllm``, the model, any word that follows no value-taking flag), a value after a switch,
    a value-taking flag with no value, a value outside the option's choices, or an option (alias or
    ``--no-`` form included) that the plan, the role or ``vllm_flags`` already sets - argparse keeps the
    last one, so a repeat would silently replace the planned value.
    """
    previous: dict[str, Any] | None = None  # the option that may still take the next token
    previous_flag = ""
    taken = 0
    for position, token in enumerate(extra):
        field = f"vllm_extra_args[{position}]"
        if not isinstance(token, str):
            raise AnsibleFilterError(f"{field}: {token!r} is not a string; quote it so each element is one argv token")
        if _is_value(token):
            if previous is not None and previous.get("takes_value") and (taken == 0 or previous.get("nargs") == "+"):
                choices = previous.get("choices")
                if choices and token not in [str(c) for c in choices]:
                    raise AnsibleFilterError(
                        f"{field}: {token!r} is not one of {choices} for '{previous_flag}' in vLLM {version}"
                        f"{_choice_note(previous_flag, token, running)}")
                taken += 1
                continue
            if token in ("serve", "vllm"):
                fix = "the role runs `vllm serve <model>` itself; remove it"
            elif token == model:
                fix = "the role passes the model (vllm_model.name) itself; remove it"
            elif previous is not None and not previous.get("takes_value"):
                fix = f"'{previous_flag}' is a switch and takes no value; remove {token!r}"
            elif previous is not None:
                fix = f"'{previous_flag}' takes one value; remove {token!r} or give it to a flag"
            else:
                fix = "give only flags, each followed by its value, e.g. ['--max-log-len', '100']"
            raise AnsibleFilterError(f"{field}: {token!r} is not a flag: {fix}")
        if previous is not None and _needs_value(previous) and taken == 0:
            raise AnsibleFilterError(
                f"{field}: '{previous_flag}' takes a value in vLLM {version} and none follows it; put the value "
                f"in the next element, e.g. ['{previous_flag}', '<value>']")
        flag, has_value, value = token.partition("=")
        option = check(flag, field)
        if option["dest"] in set_by:
            owner = set_by[option["dest"]]
            alias = "" if owner == flag else f" (the same option as '{owner}')"
            raise AnsibleFilterError(
                f"{field}: '{flag}'{alias} is already set by the capacity plan, the role or vllm_flags, and argparse "
                "would keep the last one; change it through vllm_flags if the plan does not own it, else through "
                "the planner input the preflight names for it")
        set_by = {**set_by, option["dest"]: flag}
        previous, previous_flag, taken = option, flag, 0
        if has_value:
            if not option.get("takes_value"):
                raise AnsibleFilterError(f"{field}: '{flag}' is a switch and takes no value; write it without '={value}'")
            choices = option.get("choices")
            if choices and value not in [str(c) for c in choices]:
                raise AnsibleFilterError(f"{field}: {value!r} is not one of {choices} for '{flag}' in vLLM {version}"
                                         f"{_choice_note(flag, value, running)}")
            taken = 1
    if previous is not None and _needs_value(previous) and taken == 0:
        raise AnsibleFilterError(
            f"vllm_extra_args[{len(extra) - 1}]: '{previous_flag}' takes a value in vLLM {version} and none follows "
            f"it; add the value as the next element, e.g. ['{previous_flag}', '<value>']")


def vllm_image_ref(ref: str) -> dict[str, str]:
    """Split and check a pinned image reference ``repository:tag@sha256:<64 hex>``.

    Input: the reference string. Output: ``{"repository", "tag", "digest"}``.
    Raises AnsibleFilterError when the tag or the digest is missing, or the tag is ``latest``: an
    unpinned engine image changes behaviour under the team without anyone deciding to upgrade.
    """
    match = _IMAGE_REF.match(str(ref))
    if not match:
        raise AnsibleFilterError(
            f"vllm_image: '{ref}' is not pinned; write it as REPOSITORY:TAG@sha256:<64 hex digits> "
            "(e.g. vllm/vllm-openai:v0.32.0@sha256:...), taking the digest from the lock file"
        )
    if match.group("tag") == "latest":
        raise AnsibleFilterError(f"vllm_image: '{ref}' uses the tag 'latest'; pin a version tag")
    return match.groupdict()


def vllm_argv_deprecations(argv: Iterable[str], snapshot: Mapping[str, Any]) -> list[str]:
    """The options in ``argv`` that the snapshot's release marks deprecated, with vLLM's note.

    Inputs: the rendered argv; the snapshot it was checked against. Output: one line per option in use,
    e.g. "--log-config-file: --log-config-file is deprecated and will be removed in v0.33.0. Use ...".
    """
    index = _options_index(snapshot)
    lines = []
    for token in argv:
        option = index.get(str(token).partition("=")[0])
        if option and option.get("deprecated"):
            lines.append(f"{token.partition('=')[0]}: {option['deprecated']}")
    return lines


class FilterModule:
    """Ansible filters of the vllm role."""

    def filters(self) -> dict[str, Any]:
        return {"vllm_serve_argv": vllm_serve_argv, "vllm_image_ref": vllm_image_ref,
                "vllm_argv_deprecations": vllm_argv_deprecations}
