#!/usr/bin/python
"""Ansible module: is a Hugging Face model snapshot complete in the host's HF cache? (read-only)"""

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_hf_snapshot
short_description: Report whether a pinned Hugging Face snapshot is complete in an HF hub cache
description:
  - Reads the hub cache layout of C(huggingface_hub) 2.x (the version in the pinned engine image,
    C(huggingface_hub/_snapshot_download.py) and C(_tree_cache.py)) -
    C(<cache_dir>/models--OWNER--NAME/trees/<revision>.json) lists every file of the repository at that
    commit (written by C(snapshot_download) before it fetches the files), and each must exist under
    C(snapshots/<revision>/). Files matching O(exclude) are not expected (the same C(fnmatchcase) rules as
    C(huggingface_hub.utils.filter_repo_objects); a pattern ending in C(/) matches everything below it).
  - Without the tree listing the snapshot counts as incomplete (a download then writes it).
  - Also reports the checkpoint's weight bytes for the capacity planner (C(vllm_model.checkpoint)): the
    snapshot's C(model.safetensors.index.json) C(metadata.total_size) once it is downloaded (the local
    cache), else the C(*.safetensors) sizes the tree listing records (the hub's metadata, written before
    any file is fetched).
  - Also reports where the snapshot's chat template is, as C(transformers) and vLLM 0.32.0 look for it
    (C(vllm/renderers/hf.py) C(resolve_chat_template)) - C(chat_template.jinja) or the C(chat_template) key
    of C(tokenizer_config.json) (the tokenizer's), or C(chat_template.json) (the processor's).
  - Changes nothing; supports check mode.
options:
  cache_dir:
    description: The HF hub cache on the host (C(HF_HOME/hub) of the engine container).
    type: path
    required: true
  repo_id:
    description: Repository id, C(OWNER/NAME).
    type: str
    required: true
  revision:
    description: The pinned commit (40 hex digits).
    type: str
    required: true
  exclude:
    description: Glob patterns of repository files that are not downloaded.
    type: list
    elements: str
    default: []
author: teamserve
"""

RETURN = r"""
complete:
  description: Every expected file of the commit is in the snapshot directory.
  type: bool
  returned: always
snapshot:
  description: The snapshot directory on the host.
  type: str
  returned: always
expected:
  description: Number of files the commit has after O(exclude) (0 when the tree listing is missing).
  type: int
  returned: always
missing:
  description: Up to 10 expected files that are not there (or the tree listing itself).
  type: list
  elements: str
  returned: always
checkpoint:
  description:
    - The weights' size for C(vllm_model.checkpoint), C({total_size, source, origin, revision}) in bytes;
      empty when neither the index nor the tree listing gives it.
  type: dict
  returned: always
chat_template:
  description:
    - The file that holds the default chat template (C(chat_template.jinja), C(chat_template.json) or
      C(tokenizer_config.json)); C(none) when C(tokenizer_config.json) is there and no file holds one;
      C(unknown) before the tokenizer's files are downloaded.
  type: str
  returned: always
"""

import json
import os
import re
from fnmatch import fnmatchcase

from ansible.module_utils.basic import AnsibleModule

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def snapshot_status(cache_dir: str, repo_id: str, revision: str, exclude: list[str] | None = None) -> dict:
    """Check one snapshot in a huggingface_hub cache.

    Inputs: ``cache_dir`` (the hub cache, e.g. ``/var/lib/teamserve/vllm/huggingface/hub``), ``repo_id``
    (``owner/name``), ``revision`` (40-hex commit), ``exclude`` (glob patterns of skipped files).
    Output: ``{"complete": bool, "snapshot": str, "expected": int, "missing": [str, ...] (at most 10),
    "checkpoint": dict, "chat_template": str}`` (see ``checkpoint_size`` and ``chat_template_source``).
    Layout (huggingface_hub 2.x ``repo_folder_name`` and ``_tree_cache``): ``models--OWNER--NAME/
    trees/<commit>.json`` = ``{"format_version": 1, "files": {path: {...}}}``, files under
    ``snapshots/<commit>/<path>`` (symlinks into ``blobs/``; a dangling link counts as missing).
    Raises ValueError for a repo id that is not ``owner/name`` or a revision that is not a commit id.
    """
    if not _REPO_ID.match(repo_id or ""):
        raise ValueError(f"repo_id '{repo_id}' is not OWNER/NAME")
    if not _COMMIT.match(revision or ""):
        raise ValueError(f"revision '{revision}' is not a 40-hex commit id")
    storage = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", revision)
    tree_file = os.path.join(storage, "trees", revision + ".json")
    result = {"complete": False, "snapshot": snapshot, "expected": 0, "missing": [], "checkpoint": {},
              "chat_template": chat_template_source(snapshot)}
    try:
        with open(tree_file, encoding="utf-8") as handle:
            tree = json.load(handle)
        files = tree["files"] if tree.get("format_version") == 1 else None
    except (OSError, ValueError, KeyError, AttributeError):
        files = None
    if not isinstance(files, dict) or not files:
        result["missing"] = [os.path.relpath(tree_file, storage)]
        result["checkpoint"] = checkpoint_size(snapshot, {}, revision)
        return result
    patterns = [p + "*" if p.endswith("/") else p for p in (exclude or [])]
    expected = [path for path in files if not any(fnmatchcase(path, p) for p in patterns)]
    missing = [path for path in expected if not os.path.isfile(os.path.join(snapshot, *path.split("/")))]
    result.update(expected=len(expected), missing=missing[:10], complete=not missing,
                  checkpoint=checkpoint_size(snapshot, files, revision))
    return result


# Files any of which gives vLLM 0.32.0 a default chat template (vllm/renderers/hf.py: the processor's
# chat_template.json, else the tokenizer's). transformers' save_pretrained writes chat_template.jinja;
# older checkpoints carry the template as tokenizer_config.json's chat_template key.
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def chat_template_source(snapshot: str) -> str:
    """Where the snapshot's default chat template is.

    Input: ``snapshot`` (the snapshot directory). Output: the file name that holds it
    (``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``), ``"none"`` when
    ``tokenizer_config.json`` is there and readable and no file holds a template, ``"unknown"`` when
    ``tokenizer_config.json`` is absent or unreadable (not downloaded yet). A template in
    ``tokenizer_config.json`` is a non-empty string, or a list of ``{"name", "template"}`` with one named
    ``default`` (transformers' multi-template form). Raises nothing.
    """
    for name in _TEMPLATE_FILES:
        try:
            if os.path.getsize(os.path.join(snapshot, name)) > 0:
                return name
        except OSError:
            pass
    try:
        with open(os.path.join(snapshot, "tokenizer_config.json"), encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return "unknown"
    if isinstance(template, str) and template.strip():
        return "tokenizer_config.json"
    if isinstance(template, list) and any(isinstance(t, dict) and t.get("name") == "default" for t in template):
        return "tokenizer_config.json"
    return "none"


def checkpoint_size(snapshot: str, files: dict, revision: str) -> dict:
    """The weights' bytes for the capacity planner's ``vllm_model.checkpoint``, or {} when unknown.

    Inputs: ``snapshot`` (the snapshot directory), ``files`` (the tree listing's ``{path: {"size": bytes}}``),
    ``revision``. Output: ``{"total_size": bytes, "source", "origin", "revision"}`` from the snapshot's
    ``model.safetensors.index.json`` ``metadata.total_size`` (origin "local HF cache"), else the sum of the
    listing's ``*.safetensors`` sizes outside ``original/`` (origin "hub tree listing").
    """
    try:
        with open(os.path.join(snapshot, "model.safetensors.index.json"), encoding="utf-8") as handle:
            total = json.load(handle)["metadata"]["total_size"]
        if isinstance(total, int) and total > 0:
            return {"total_size": total, "source": "safetensors index metadata.total_size",
                    "origin": "local HF cache", "revision": revision}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sizes = [(info or {}).get("size") for path, info in files.items()
             if path.endswith(".safetensors") and not path.startswith("original/") and isinstance(info, dict)]
    if sizes and all(isinstance(size, int) and size > 0 for size in sizes):
        return {"total_size": sum(sizes), "source": f"{len(sizes)} safetensors files",
                "origin": "hub tree listing", "revision": revision}
    return {}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "cache_dir": {"type": "path", "required": True},
            "repo_id": {"type": "str", "required": True},
            "revision": {"type": "str", "required": True},
            "exclude": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    try:
        status = snapshot_status(module.params["cache_dir"], module.params["repo_id"],
                                 module.params["revision"], module.params["exclude"])
    except ValueError as err:
        module.fail_json(msg=f"vllm_hf_snapshot: {err}")
    module.exit_json(changed=False, **status)


if __name__ == "__main__":
    main()
