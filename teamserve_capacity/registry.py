"""Whether the pinned vLLM release can load the model at all: its architecture and its quantisation.

The planner models a model's memory from ``config.json``; whether vLLM serves that architecture, at
that quantisation, is a fact of the release, read from its own source by ``tools/vllm_release.py``
into ``roles/vllm/files/vllm-architectures-<release>.json``:

* ``architectures``: vLLM's model registry (``vllm/model_executor/models/registry.py``,
  ``_VLLM_MODELS``). vLLM takes the first entry of ``config.json``'s ``architectures`` it finds there
  (``ModelConfig`` -> ``registry.inspect_model_cls``), so one listed entry is enough;
* ``quantization_methods``: ``QuantizationMethods`` of
  ``vllm/model_executor/layers/quantization/__init__.py``; ``ModelConfig._verify_quantization``
  (``vllm/config/model.py``) refuses any other ("Unknown quantization method"), and a method in
  ``deprecated_quantization_methods`` unless ``--allow-deprecated-quantization`` is given;
* ``architecture_quantization``: methods vLLM sets only for some architectures
  (``vllm/model_executor/models/config.py``, ``MODELS_CONFIG_MAP``: gpt-oss's ``gpt_oss_mxfp4``).

Not modelled: vLLM's Transformers backend can run some architectures its registry does not list
(``--model-impl transformers``); the planner refuses those too, since it models vLLM's own model
files. A release without the file is not checked, and the plan says so.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError

# Where the vllm role keeps its per-release files. The planner is installed editable from the
# repository (pyproject.toml: pip install -e .), so the role's directory sits next to the package.
REGISTRY_DIR = Path(__file__).resolve().parents[1] / "roles" / "vllm" / "files"
# How the fix names the tool that writes a release's file.
WRITE_HINT = "python3 tools/vllm_release.py <release> (docs/vllm-versions.md)"


@dataclass(frozen=True)
class Registry:
    """One release's model registry and quantisation methods (the JSON file's content).

    Attributes:
        version: the release, "X.Y.Z".
        architectures: architecture name -> ``{"module", "class", "kinds"}``.
        quantization_methods: the ``quant_method`` / ``--quantization`` names the release knows.
        deprecated_quantization_methods: those it refuses without ``--allow-deprecated-quantization``.
        architecture_quantization: method -> the only architectures vLLM applies it to.
        previously_supported: architecture -> the last release that listed it.
        out_of_tree: architecture -> the plugin that serves it.
        path: the file read, for messages.
    """

    version: str
    architectures: Mapping[str, Mapping[str, Any]]
    quantization_methods: frozenset[str]
    deprecated_quantization_methods: frozenset[str]
    architecture_quantization: Mapping[str, tuple[str, ...]]
    previously_supported: Mapping[str, str]
    out_of_tree: Mapping[str, str]
    path: str


def registry_file(version: str, directory: Path | None = None) -> Path:
    """Path of ``vllm-architectures-<version>.json`` in ``directory`` (default :data:`REGISTRY_DIR`)."""
    return (directory or REGISTRY_DIR) / f"vllm-architectures-{version}.json"


def load_registry(version: str, directory: Path | None = None) -> Registry | None:
    """Read the registry file of ``version`` (a release "X.Y.Z"); None when there is none.

    Raises:
        PlanError: the file exists but is not a registry snapshot (field ``vllm_engine.vllm_version``).
    """
    path = registry_file(version, directory)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Registry(
            version=version,
            architectures=dict(data["architectures"]),
            quantization_methods=frozenset(data["quantization_methods"]),
            deprecated_quantization_methods=frozenset(data.get("deprecated_quantization_methods", [])),
            architecture_quantization={k: tuple(v) for k, v in data.get("architecture_quantization", {}).items()},
            previously_supported=dict(data.get("previously_supported", {})),
            out_of_tree=dict(data.get("out_of_tree", {})),
            path=str(path),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PlanError("vllm_engine.vllm_version", version,
                        f"{path} is not a model registry snapshot ({exc}); write it again with {WRITE_HINT}") from exc


def _why_not_listed(architecture: str, registry: Registry) -> str:
    """What the release says about an architecture it does not list, as a clause."""
    if architecture in registry.previously_supported:
        return f"vLLM supported it up to {registry.previously_supported[architecture]}"
    if architecture in registry.out_of_tree:
        return f"vLLM serves it through the plugin {registry.out_of_tree[architecture]}, which this project does not install"
    close = difflib.get_close_matches(architecture, list(registry.architectures), n=3, cutoff=0.75)
    return ("it lists " + ", ".join(close) + " (a different model class)") if close else \
        f"it lists {len(registry.architectures)} others"


def check_model(architectures: Sequence[str], quant_method: str | None, quantization_flag: str | None,
                version: str, registry: Registry | None) -> dict[str, Any]:
    """Refuse a model the release cannot load; say what was checked.

    Args:
        architectures: ``config.json``'s ``architectures`` (class names, e.g. "LlamaForCausalLM").
        quant_method: ``quantization_config.quant_method`` of a pre-quantised checkpoint, else None.
        quantization_flag: the ``--quantization`` the plan passes (load-time quantisation), else None.
        version: the release planned for (``vllm_engine.vllm_version``).
        registry: that release's :class:`Registry`, or None when it has no file.
    Returns:
        ``{"vllm_version", "checked", "architecture", "kinds", "note"}``: the first listed architecture
        and the registry tables listing it ("text_generation", ...); ``checked`` false (and architecture
        None) without a registry; ``note`` one sentence for the report.
    Raises:
        PlanError: field ``config.architectures`` (none listed),
            ``config.quantization_config.quant_method`` (a method the release does not know, or applies
            only to other architectures) or ``vllm_model.weight_format`` (a ``--quantization`` it does not
            know); each names the release, its file and the fix.
    """
    names = [str(a) for a in architectures]
    if registry is None:
        return {"vllm_version": version, "checked": False, "architecture": None, "kinds": [],
                "note": f"architecture not checked: there is no model registry snapshot for vLLM {version} "
                        f"({registry_file(version).name}); write it with {WRITE_HINT}"}
    listed = [a for a in names if a in registry.architectures]
    if not listed:
        shown = names[0] if names else "(none)"
        raise PlanError("config.architectures", names,
                        f"vLLM {version}'s model registry ({Path(registry.path).name}) does not list {shown}: "
                        f"{_why_not_listed(shown, registry)}. Pick a checkpoint whose architecture it lists, or "
                        f"pin a release that lists it (after writing its snapshot with {WRITE_HINT})")
    architecture = listed[0]
    for field, value in (("config.quantization_config.quant_method", quant_method),
                         ("vllm_model.weight_format", quantization_flag)):
        if value is None:
            continue
        if value not in registry.quantization_methods:
            what = ("the checkpoint's quantisation method" if field.startswith("config")
                    else f"the plan's --quantization {value}")
            raise PlanError(field, value,
                            f"vLLM {version} does not know {what} ({Path(registry.path).name}: "
                            f"{', '.join(sorted(registry.quantization_methods))}); pick a checkpoint or "
                            "weight_format in one of those, or pin a release that knows it")
        only_for = registry.architecture_quantization.get(value)
        if only_for and architecture not in only_for:
            raise PlanError(field, value,
                            f"vLLM {version} applies {value} only to {', '.join(only_for)}, not {architecture}; "
                            "pick a checkpoint of this model in another quantisation")
    kinds = list(registry.architectures[architecture].get("kinds", []))
    note = f"vLLM {version} lists {architecture} ({', '.join(kinds) or 'registry'})"
    method = quant_method or quantization_flag
    if method in registry.deprecated_quantization_methods:
        note += (f"; {method} is deprecated there: vLLM refuses it unless --allow-deprecated-quantization "
                 "is given (vllm_flags)")
    elif method:
        note += f" and knows {method}"
    return {"vllm_version": version, "checked": True, "architecture": architecture, "kinds": kinds, "note": note}
