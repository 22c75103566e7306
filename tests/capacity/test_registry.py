"""The plan against the pinned release's model registry (teamserve_capacity.registry): an architecture or
a quantisation the release cannot load is refused, naming the release and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from teamserve_capacity import PlanError, plan, registry

from .conftest import CONFIGS, ENGINE, RTX_PRO_6000, load_config

WL = {"concurrent_sequences": 8, "avg_context_tokens": 2000, "max_context_tokens": 8192,
      "ttft_p95_seconds": 1.0, "tpot_seconds": 0.05}

# A small registry in the shape tools/vllm_release.py writes.
SMALL = {
    "vllm_version": "0.32.0",
    "architectures": {
        "LlamaForCausalLM": {"module": "llama", "class": "LlamaForCausalLM", "kinds": ["text_generation"]},
        "GptOssForCausalLM": {"module": "gpt_oss", "class": "GptOssForCausalLM", "kinds": ["text_generation"]},
    },
    "previously_supported": {"MPTForCausalLM": "0.28.0"},
    "out_of_tree": {"BartModel": "https://github.com/vllm-project/bart-plugin"},
    "quantization_methods": ["awq", "fbgemm_fp8", "fp8", "gpt_oss_mxfp4", "mxfp4"],
    "deprecated_quantization_methods": ["fbgemm_fp8"],
    "architecture_quantization": {"gpt_oss_mxfp4": ["GptOssForCausalLM"]},
}


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """SMALL as the 0.32.0 registry the planner reads."""
    (tmp_path / "vllm-architectures-0.32.0.json").write_text(json.dumps(SMALL))
    monkeypatch.setattr(registry, "REGISTRY_DIR", tmp_path)
    return tmp_path


def llama(**changes: Any) -> dict[str, Any]:
    config = load_config("meta-llama--Llama-3.1-8B-Instruct")
    config.update(changes)
    return {"name": "l", "config": config}


def test_a_listed_architecture_plans_and_says_it_was_checked(small: Path) -> None:
    result = plan(llama(), WL, [RTX_PRO_6000], ENGINE)
    assert result["registry"]["checked"] is True
    assert result["registry"]["architecture"] == "LlamaForCausalLM"
    assert result["registry"]["kinds"] == ["text_generation"]


def test_an_architecture_the_release_does_not_list_is_refused_naming_release_and_fix(small: Path) -> None:
    with pytest.raises(PlanError) as err:
        plan(llama(architectures=["LlamaForCausalLMX"]), WL, [RTX_PRO_6000], ENGINE)
    assert err.value.field == "config.architectures"
    assert err.value.value == ["LlamaForCausalLMX"]
    message = str(err.value)
    assert "vLLM 0.32.0" in message and "vllm-architectures-0.32.0.json" in message
    assert "LlamaForCausalLM (a different model class)" in message  # the close match as a hint
    assert "Pick a checkpoint whose architecture it lists, or pin a release" in message


def test_one_listed_entry_of_several_is_enough(small: Path) -> None:
    result = plan(llama(architectures=["SomethingElse", "LlamaForCausalLM"]), WL, [RTX_PRO_6000], ENGINE)
    assert result["registry"]["architecture"] == "LlamaForCausalLM"


@pytest.mark.parametrize("architecture,said", [
    ("MPTForCausalLM", "vLLM supported it up to 0.28.0"),
    ("BartModel", "through the plugin https://github.com/vllm-project/bart-plugin"),
])
def test_a_dropped_or_plugin_architecture_is_explained(small: Path, architecture: str, said: str) -> None:
    reg = registry.load_registry("0.32.0")
    with pytest.raises(PlanError, match=said):
        registry.check_model([architecture], None, None, "0.32.0", reg)


def test_a_quantisation_the_release_does_not_know_is_refused(small: Path) -> None:
    config = load_config("meta-llama--Llama-3.1-8B-Instruct")
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    with pytest.raises(PlanError) as err:
        plan({"name": "l", "config": config}, WL, [RTX_PRO_6000], ENGINE)
    assert err.value.field == "config.quantization_config.quant_method" and err.value.value == "gptq"
    assert "vLLM 0.32.0 does not know the checkpoint's quantisation method" in str(err.value)
    assert "awq, fbgemm_fp8, fp8, gpt_oss_mxfp4, mxfp4" in str(err.value)


def test_a_quantisation_listed_only_for_another_architecture_is_refused(small: Path) -> None:
    reg = registry.load_registry("0.32.0")
    with pytest.raises(PlanError, match="applies gpt_oss_mxfp4 only to GptOssForCausalLM, not LlamaForCausalLM"):
        registry.check_model(["LlamaForCausalLM"], "gpt_oss_mxfp4", None, "0.32.0", reg)
    assert registry.check_model(["GptOssForCausalLM"], "gpt_oss_mxfp4", None, "0.32.0", reg)["checked"]


def test_a_deprecated_quantisation_plans_with_a_note(small: Path) -> None:
    reg = registry.load_registry("0.32.0")
    note = registry.check_model(["LlamaForCausalLM"], "fbgemm_fp8", None, "0.32.0", reg)["note"]
    assert "fbgemm_fp8 is deprecated there" in note and "--allow-deprecated-quantization" in note


def test_without_a_registry_file_nothing_is_refused_and_the_plan_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(registry, "REGISTRY_DIR", tmp_path)
    result = plan(llama(architectures=["NotInAnyRegistry"]), WL, [RTX_PRO_6000], ENGINE)
    assert result["registry"]["checked"] is False
    assert "no model registry snapshot for vLLM 0.32.0" in result["registry"]["note"]


def test_a_broken_registry_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "vllm-architectures-0.32.0.json").write_text('{"architectures": {}}')
    monkeypatch.setattr(registry, "REGISTRY_DIR", tmp_path)
    with pytest.raises(PlanError, match="is not a model registry snapshot") as err:
        plan(llama(), WL, [RTX_PRO_6000], ENGINE)
    assert err.value.field == "vllm_engine.vllm_version"


# --- the committed snapshots of vLLM's own registry (tools/vllm_release.py) -------------------------

def test_the_pin_has_a_registry_snapshot_listing_every_fixture_model() -> None:
    reg = registry.load_registry(ENGINE["vllm_version"])
    assert reg is not None, f"no vllm-architectures-{ENGINE['vllm_version']}.json: run tools/vllm_release.py"
    for path in sorted(CONFIGS.glob("*.json")):
        config = json.loads(path.read_text())
        quant = (config.get("quantization_config") or {}).get("quant_method")
        result = registry.check_model(config["architectures"], quant, None, reg.version, reg)
        assert result["checked"] and {"text_generation", "multimodal"} & set(result["kinds"]), (path.name, result)


def test_the_pinned_release_refuses_bitsandbytes() -> None:
    """vLLM 0.32.0's QuantizationMethods has no bitsandbytes (its quantization package dropped it; RFC
    vllm-project/vllm#39583), so both load-time and pre-quantised bitsandbytes are refused there."""
    with pytest.raises(PlanError) as err:
        plan(dict(llama(), weight_format="bitsandbytes"), WL, [RTX_PRO_6000], ENGINE)
    assert err.value.field == "vllm_model.weight_format" and "--quantization bitsandbytes" in str(err.value)
    config = load_config("meta-llama--Llama-3.1-8B-Instruct")
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4"}
    with pytest.raises(PlanError) as err:
        plan({"name": "l", "config": config}, WL, [RTX_PRO_6000], ENGINE)
    assert err.value.field == "config.quantization_config.quant_method"
