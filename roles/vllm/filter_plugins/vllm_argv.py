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

_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
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


def vllm_serve_argv(
    flags: Mapping[str, Any],
    model: str,
    snapshot: Mapping[str, Any],
    extra_args: Iterable[str] = (),
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
    Output: list of argv tokens, flags in the mapping's order, then ``extra_args``.
    Raises AnsibleFilterError naming the flag, the pinned version and the fix when a flag is unknown to
    the pinned vLLM, a value is not among the option's choices, or a value-taking flag has no value.
    """
    # The CPU build names itself 0.32.0+cpu; the snapshot file is named after the release.
    version = str(snapshot.get("vllm_version", "?")).split("+")[0] if isinstance(snapshot, Mapping) else "?"
    index = _options_index(snapshot)
    argv: list[str] = [str(model)]

    def check(flag: str, source: str) -> dict[str, Any]:
        if not _FLAG.match(flag) or flag not in index:
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
                )
        argv.append(flag)
        argv.extend(str(item) for item in values)

    extra = list(extra_args or [])
    for token in extra:
        if not isinstance(token, str):
            raise AnsibleFilterError(f"vllm_extra_args: every element must be a string, got {token!r}")
        if token.startswith("--"):
            check(token.split("=", 1)[0], "vllm_extra_args")
    argv.extend(extra)
    return argv


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


class FilterModule:
    """Ansible filters of the vllm role."""

    def filters(self) -> dict[str, Any]:
        return {"vllm_serve_argv": vllm_serve_argv, "vllm_image_ref": vllm_image_ref}
