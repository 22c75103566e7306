"""Bad input: an error naming the field, the value and the fix — never a number."""

from __future__ import annotations

import pytest

from teamserve_capacity import PlanError, plan

from .conftest import ENGINE, RTX_PRO_6000, tiny_llama_config

WORKLOAD = {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 2048}


def _model(**config_changes):
    cfg = tiny_llama_config()
    for key, value in config_changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    return {"name": "tiny", "config": cfg, "weight_format": "bf16"}


@pytest.mark.parametrize(("changes", "field"), [
    ({"num_hidden_layers": ...}, "config.num_hidden_layers"),
    ({"num_hidden_layers": 0}, "config.num_hidden_layers"),
    ({"num_attention_heads": ...}, "config.num_attention_heads"),
    ({"num_attention_heads": 0}, "config.num_attention_heads"),
    ({"num_key_value_heads": 0}, "config.num_key_value_heads"),
    ({"num_key_value_heads": 3}, "config.num_key_value_heads"),
    ({"head_dim": -64}, "config.head_dim"),
    ({"torch_dtype": "float8"}, "config.torch_dtype"),
    ({"model_type": "rwkv"}, "config.model_type"),
    ({"model_type": ...}, "config.model_type"),
])
def test_bad_config(changes, field) -> None:
    with pytest.raises(PlanError) as err:
        plan(_model(**changes), WORKLOAD, [RTX_PRO_6000], ENGINE)
    assert err.value.field == field
    assert field in str(err.value) and err.value.fix


@pytest.mark.parametrize(("where", "key", "value"), [
    ("engine", "kv_cache_dtype", "int3"),
    ("engine", "gpu_memory_utilization", 1.5),
    ("engine", "gpu_memory_utilization", 0),
    ("engine", "tensor_parallel_size", 2),
    ("engine", "block_size", 7),
    ("engine", "vllm_version", "0.10.1"),
    ("gpu", "memory_total_mib", -1),
    ("gpu", "memory_total_mib", 0),
    ("gpu", "compute_cap", "twelve"),
    ("gpu", "memory_reserved_mib", -1),
    ("gpu", "memory_reserved_mib", "616 MiB"),
    ("gpu", "memory_reserved_mib", True),
    ("gpu", "memory_reserved_mib", 97887),
    ("workload", "concurrent_sequences", 0),
    ("workload", "avg_context_tokens", 5000),
    ("workload", "max_context_tokens", None),
    ("model", "weight_format", "int2"),
    ("model", "weight_bytes", -5),
])
def test_bad_engine_gpu_workload_model(where, key, value) -> None:
    model, workload = _model(), dict(WORKLOAD)
    gpu, engine = dict(RTX_PRO_6000), dict(ENGINE)
    {"engine": engine, "gpu": gpu, "workload": workload, "model": model}[where][key] = value
    with pytest.raises(PlanError) as err:
        plan(model, workload, [gpu], engine)
    assert key in err.value.field
    assert repr(value) in str(err.value) or "missing" in str(err.value)


def test_no_gpus() -> None:
    with pytest.raises(PlanError, match="nvidia_driver_gpus"):
        plan(_model(), WORKLOAD, [], ENGINE)


def test_forced_fp8_kv_on_unsupported_gpu_is_an_error() -> None:
    turing = dict(RTX_PRO_6000, compute_cap="7.5", name="Tesla T4")
    model = _model()
    model["weight_format"] = "fp16"
    with pytest.raises(PlanError, match="fp8 KV cache needs compute capability"):
        plan(model, WORKLOAD, [turing], dict(ENGINE, kv_cache_dtype="fp8"))


def test_nvfp4_without_quantised_checkpoint_is_an_error() -> None:
    model = _model()
    model["weight_format"] = "nvfp4"
    with pytest.raises(PlanError, match="pre-quantised checkpoint"):
        plan(model, WORKLOAD, [RTX_PRO_6000], ENGINE)


def test_impossible_memory_is_a_verdict_not_a_crash() -> None:
    """A real GPU too small for the weights plans to 'does not fit', with zero blocks."""
    model = _model()
    model["weight_bytes"] = 200 * 1024 ** 3
    result = plan(model, WORKLOAD, [RTX_PRO_6000], ENGINE)
    assert result["fits"] is False and result["numbers"]["blocks"] == 0
    assert "nothing is left for the KV cache" in result["verdict"]
