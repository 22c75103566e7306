"""The full planner: the testbed model, real configs, flags, verdicts, levers."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from teamserve_capacity import PlanError, plan
from teamserve_capacity.kv import hybrid_block_step, kv_layout
from teamserve_capacity.model import CHUNKED, FULL, LINEAR, SLIDING, parse_config

from .conftest import CONFIGS, ENGINE, RTX_PRO_6000, load_config, tiny_llama_config

ALL_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.json"))


def test_testbed_tiny_llama_fits(tiny_model, workload) -> None:
    result = plan(tiny_model, workload, [RTX_PRO_6000], ENGINE)
    assert result["fits"] is True
    assert result["verdict"].startswith("fits")
    assert result["levers"] == []
    flags = result["flags"]
    assert flags["max-model-len"] == 2048
    assert flags["max-num-seqs"] == 8
    assert flags["tensor-parallel-size"] == 1
    assert flags["kv-cache-dtype"] == "auto"
    assert flags["quantization"] is None
    assert flags["enable-prefix-caching"] is True and flags["enable-chunked-prefill"] is True
    assert flags["max-num-batched-tokens"] >= flags["max-num-seqs"]
    # 2 layers x 2 KV heads x 64 x 2 (K,V) x 2 bytes
    assert result["numbers"]["kv_bytes_per_token"] == 1024
    assert "left for KV" in result["table"]


@pytest.mark.parametrize("seqs", [1, 8, 16, 64])
def test_admission_share_follows_the_planned_batch(tiny_model, workload, seqs: int) -> None:
    """The per-user in-flight share is a quarter of the planned max-num-seqs, at least 1: a change of
    workload that changes the batch changes the gateway's default cap and the engine's n ceiling."""
    result = plan(tiny_model, dict(workload, concurrent_sequences=seqs), [RTX_PRO_6000], ENGINE)
    planned = result["flags"]["max-num-seqs"]
    cap = max(1, planned // 4)
    assert result["admission"] == {"user_max_inflight": cap, "user_fair_share": max(1, cap // 2),
                                   "user_tokens_per_day": int(max(1, cap // 2) * 86_400 / workload["tpot_seconds"])}
    assert 1 <= result["admission"]["user_max_inflight"] <= planned
    assert result["flags"]["scheduling-policy"] == "priority"  # the gateway's priorities need it


def test_daily_token_budget_follows_the_fair_share_and_the_tpot_target(tiny_model, workload) -> None:
    """A stricter TPOT target (fewer tokens per second per sequence) gives a smaller default budget; the
    budget is what the fair share generates in a day at the target."""
    loose = plan(tiny_model, dict(workload, tpot_seconds=0.05), [RTX_PRO_6000], ENGINE)
    strict = plan(tiny_model, dict(workload, tpot_seconds=0.1), [RTX_PRO_6000], ENGINE)
    share = loose["admission"]["user_fair_share"]
    assert loose["admission"]["user_tokens_per_day"] == share * 86_400 * 20
    assert strict["admission"]["user_tokens_per_day"] == strict["admission"]["user_fair_share"] * 86_400 * 10


@pytest.mark.parametrize("seqs", range(1, 70))
def test_no_plan_lets_one_user_hold_the_batch(seqs: int) -> None:
    """Whatever the rounding, a user's default cap and fair share stay within half of max-num-seqs once
    the batch has room for two; the share never exceeds the cap."""
    from teamserve_capacity.planner import user_fair_share, user_inflight_share
    cap, share = user_inflight_share(seqs), user_fair_share(seqs)
    assert 1 <= share <= cap
    if seqs >= 2:
        assert cap <= seqs // 2


def test_max_model_len_never_exceeds_model_or_workload(tiny_model, workload) -> None:
    workload["max_context_tokens"] = 100_000
    result = plan(tiny_model, workload, [RTX_PRO_6000], ENGINE)
    assert result["flags"]["max-model-len"] == 2048
    llama = {"name": "l", "config": load_config("meta-llama--Llama-3.1-8B-Instruct"), "weight_format": "bf16"}
    result = plan(llama, workload, [RTX_PRO_6000], ENGINE)
    assert result["flags"]["max-model-len"] == 100_000  # llama3 rope: 131072 already scaled


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_fixture_config_plans(name: str) -> None:
    model = {"name": name, "config": load_config(name), "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 2000, "max_context_tokens": 8192}
    result = plan(model, wl, [RTX_PRO_6000], ENGINE)
    assert result["numbers"]["kv_bytes_per_token"] > 0
    assert result["numbers"]["blocks"] > 0
    assert result["fits"] is True
    json.dumps(result)  # JSON-serialisable for --json and Ansible


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_supported_releases_plan_alike_and_the_plan_names_its_release(name: str) -> None:
    """0.31.0 accounts for memory as 0.32.0 does on every path the planner models (docs/vllm-versions.md):
    the same numbers and flags for every fixture model; only the recorded release differs."""
    model = {"name": name, "config": load_config(name), "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 2000, "max_context_tokens": 8192}
    plans = {v: plan(model, wl, [RTX_PRO_6000], dict(ENGINE, vllm_version=v)) for v in ("0.31.0", "0.32.0")}
    assert plans["0.31.0"]["vllm_version"] == "0.31.0" and plans["0.32.0"]["vllm_version"] == "0.32.0"
    assert plans["0.31.0"]["numbers"] == plans["0.32.0"]["numbers"]
    assert plans["0.31.0"]["flags"] == plans["0.32.0"]["flags"]


def test_a_release_whose_accounting_was_not_compared_is_refused() -> None:
    model = {"name": "m", "config": tiny_llama_config(), "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 500, "max_context_tokens": 2048}
    with pytest.raises(PlanError) as err:
        plan(model, wl, [RTX_PRO_6000], dict(ENGINE, vllm_version="0.33.0"))
    assert err.value.field == "vllm_engine.vllm_version" and "0.31.0, 0.32.0" in str(err.value)


def test_mla_stores_one_latent_per_layer() -> None:
    spec = parse_config(load_config("deepseek-ai--DeepSeek-V3"))
    assert spec.attention_type == "MLA"
    model = {"name": "dsv3", "config": load_config("deepseek-ai--DeepSeek-V3"), "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 1, "avg_context_tokens": 1000, "max_context_tokens": 4096}
    for tp in (1, 2):
        gpus = [RTX_PRO_6000, dict(RTX_PRO_6000, index=1)]
        result = plan(model, wl, gpus, dict(ENGINE, tensor_parallel_size=tp))
        # 61 layers x (512 + 64) x 2 bytes, the same on every TP rank
        assert result["numbers"]["kv_bytes_per_token"] == 61 * 576 * 2
    assert spec.max_model_len_limit == 163840  # yarn: already scaled


def test_gqa_kv_heads_split_over_tensor_parallel() -> None:
    model = {"name": "l", "config": load_config("meta-llama--Llama-3.3-70B-Instruct"), "weight_format": "bf16"}
    wl = {"concurrent_sequences": 1, "avg_context_tokens": 1000, "max_context_tokens": 4096}
    gpus = [dict(RTX_PRO_6000, index=i) for i in range(2)]
    one = plan(model, wl, gpus, dict(ENGINE, tensor_parallel_size=1))
    two = plan(model, wl, gpus, dict(ENGINE, tensor_parallel_size=2))
    assert one["numbers"]["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2
    assert two["numbers"]["kv_bytes_per_token"] == one["numbers"]["kv_bytes_per_token"] // 2
    assert one["fits"] is False and two["fits"] is True


def test_budget_parts_add_up_and_tensor_parallel_splits_them() -> None:
    """The table's deductions sum to the KV budget; TP=2 halves the weights, adds NCCL's non-torch."""
    model = {"name": "l", "config": load_config("meta-llama--Llama-3.3-70B-Instruct"), "weight_format": "fp8"}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 4000, "max_context_tokens": 8192}
    gpus = [dict(RTX_PRO_6000, index=i) for i in range(2)]
    one, two = (plan(model, wl, gpus, dict(ENGINE, tensor_parallel_size=tp))["numbers"] for tp in (1, 2))
    for n in (one, two):
        parts = n["weights_gib"] + n["non_torch_gib"] + n["activation_peak_gib"] + n["cudagraph_gib"]
        assert abs(n["requested_gib"] - parts - n["kv_budget_gib"]) < 0.03  # four values rounded to 0.01
    assert abs(two["weights_gib"] - one["weights_gib"] / 2) < 0.01
    # +0.42 GiB per extra rank: llm-d's H100 logs, Llama-3.3-70B-FP8 at TP=1 and TP=2
    assert round(two["non_torch_gib"] - one["non_torch_gib"], 2) == 0.42


def test_gemma3_hybrid_groups_like_vllm() -> None:
    spec = parse_config(load_config("google--gemma-3-27b-it"))
    counts = spec.kind_counts()
    assert counts == {SLIDING: 52, FULL: 10}
    assert spec.sliding_window == 1024
    assert spec.max_model_len_limit == 131072  # gemma3: linear factor not applied again
    model = {"name": "g", "config": load_config("google--gemma-3-27b-it"), "weight_format": "bf16"}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 8000, "max_context_tokens": 32768}
    result = plan(model, wl, [RTX_PRO_6000], ENGINE)
    groups = {layer["kind"]: layer["kv_groups"] for layer in result["layers"]}
    # group size 10 (the smaller count): 52 sliding -> 6 groups (8 padding layers), 10 full -> 1
    assert groups == {SLIDING: 6, FULL: 1}
    assert result["numbers"]["bytes_per_block"] == 10 * 16 * 16 * 128 * 2 * 2


def test_gpt_oss_alternating_layers_one_group_each() -> None:
    spec = parse_config(load_config("openai--gpt-oss-120b"))
    assert spec.kind_counts() == {SLIDING: 18, FULL: 18}
    assert spec.quant_method == "mxfp4"


def test_llama4_chunked_local_every_fourth_global() -> None:
    spec = parse_config(load_config("meta-llama--Llama-4-Scout-17B-16E-Instruct"))
    assert spec.kind_counts() == {CHUNKED: 36, FULL: 12}
    assert spec.layer_kinds[3] == FULL and spec.layer_kinds[0] == CHUNKED


def test_qwen3_next_linear_state_grows_attention_block() -> None:
    model = {"name": "q", "config": load_config("Qwen--Qwen3-Next-80B-A3B-Instruct"),
             "weight_format": "bf16", "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 2000, "max_context_tokens": 8192}
    result = plan(model, wl, [RTX_PRO_6000], ENGINE)
    # GDN state per layer: (8192 x 3 + 32 x 128 x 128) x 2 bytes = 1,097,728 B; attention
    # 2 heads x 256 x 2 x 2 = 2048 B/token -> block 16 x cdiv(1097728, 16 x 2048) = 544 tokens
    assert result["numbers"]["block_size"] == 544
    kinds = {layer["kind"]: layer for layer in result["layers"]}
    assert kinds[LINEAR]["state_bytes_per_seq"] == 1_097_728
    assert result["numbers"]["kv_bytes_per_token"] == 12 * 2048


@pytest.mark.parametrize(("block", "expected"), [(16, 544), (32, 544), (64, 576), (128, 640), (256, 768)])
def test_hybrid_block_grows_in_steps_of_the_block_size(block: int, expected: int) -> None:
    """vLLM 0.32 _align_hybrid_block_size: steps of max(16, --block-size) until a page holds the state."""
    model = {"name": "q", "config": load_config("Qwen--Qwen3-Next-80B-A3B-Instruct"),
             "weight_format": "bf16", "weight_bytes": 2 * 1024 ** 3}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 2000, "max_context_tokens": 8192}
    numbers = plan(model, wl, [RTX_PRO_6000], dict(ENGINE, block_size=block))["numbers"]
    assert numbers["block_size"] == expected and expected % block == 0
    assert (expected - block) * 2048 < 1_097_728 <= expected * 2048  # the smallest such block that holds it


def test_hybrid_block_step() -> None:
    assert [hybrid_block_step(b, False) for b in (8, 16, 32, 64)] == [16, 16, 32, 64]
    assert hybrid_block_step(16, True) == 128 and hybrid_block_step(256, True) == 256


def test_does_not_fit_names_numbers_and_levers() -> None:
    model = {"name": "l", "config": load_config("meta-llama--Llama-3.1-8B-Instruct"), "weight_format": "bf16"}
    wl = {"concurrent_sequences": 64, "avg_context_tokens": 32000, "max_context_tokens": 131072}
    result = plan(model, wl, [RTX_PRO_6000], ENGINE)
    assert result["fits"] is False
    assert "64 requested" in result["verdict"]
    text = " ".join(result["levers"])
    for word in ("shorter context", "fewer concurrent sequences", "fp8 KV cache", "4-bit weights",
                 "second GPU"):
        assert word in text


def test_fp8_kv_lever_only_where_supported() -> None:
    model = {"name": "l", "config": load_config("meta-llama--Llama-3.1-8B-Instruct"), "weight_format": "fp16"}
    wl = {"concurrent_sequences": 64, "avg_context_tokens": 32000, "max_context_tokens": 131072}
    volta = dict(RTX_PRO_6000, compute_cap="7.0", name="Tesla V100")
    result = plan(model, wl, [volta], ENGINE)
    assert not any("fp8 KV" in lever for lever in result["levers"])


def test_measured_log_overrides_estimates(tiny_model, workload) -> None:
    engine = dict(ENGINE, measured={"kv_cache_bytes": 10 * 1024 ** 3})
    result = plan(tiny_model, workload, [RTX_PRO_6000], engine)
    assert result["numbers"]["kv_budget_bytes"] == 10 * 1024 ** 3
    assert result["numbers"]["sources"]["kv_budget"] == "measured"
    # 10 GiB / (2 layers x 16 tokens x 512 B) blocks, 16 tokens each
    assert result["numbers"]["kv_block_tokens"] == 10 * 1024 ** 3 // 1024


def test_prequantised_checkpoint_leaves_quantization_to_vllm() -> None:
    model = {"name": "q", "config": load_config("Qwen--Qwen3-32B-FP8"), "weight_format": "fp8"}
    wl = {"concurrent_sequences": 4, "avg_context_tokens": 2000, "max_context_tokens": 8192}
    assert plan(model, wl, [RTX_PRO_6000], ENGINE)["flags"]["quantization"] is None
    model["config"] = load_config("Qwen--Qwen3-32B")
    assert plan(model, wl, [RTX_PRO_6000], ENGINE)["flags"]["quantization"] == "fp8"


def test_cli_table_and_json(tmp_path: Path) -> None:
    cfg = CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json"
    base = [sys.executable, "-m", "teamserve_capacity.cli", "plan", "--config", str(cfg),
            "--concurrent", "16", "--avg-context", "4000", "--max-context", "32768"]
    table = subprocess.run(base, capture_output=True, text=True, check=False)
    assert table.returncode == 0, table.stderr
    assert "max_concurrent" in table.stdout and "vllm serve" in table.stdout
    js = subprocess.run(base + ["--json"], capture_output=True, text=True, check=False)
    data = json.loads(js.stdout)
    assert data["fits"] is True and data["flags"]["max-model-len"] == 32768
    bad = subprocess.run(base[:6] + ["--concurrent", "0"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "concurrent_sequences" in bad.stderr
    too_many = subprocess.run(base[:6] + ["--concurrent", "4000", "--avg-context", "32000",
                                          "--max-context", "32768"], capture_output=True, text=True,
                              check=False)
    assert too_many.returncode == 1 and "does not fit" in too_many.stdout


def test_inputs_are_not_mutated(tiny_model, workload) -> None:
    before = copy.deepcopy((tiny_model, workload))
    plan(tiny_model, workload, [RTX_PRO_6000], ENGINE)
    assert (tiny_model, workload) == before


# Measured on the real vLLM 0.32.0 CPU build (testbed image vllm/vllm-openai:v0.32.0,
# benchmarks/capacity/cpu_engine.py): VLLM_CPU_KVCACHE_SPACE=1, --max-model-len 2048,
# --max-num-batched-tokens 512, block size 128 chosen by the CPU backend, one batch in flight.
@pytest.mark.parametrize(("name", "kv_bytes", "batched", "logged"), [
    ("tiny-llama", 2, 512, 1_048_576),
    ("tiny-llama", 1, 512, 2_097_152),
    ("teamserve-testbed--tiny-gemma3", 2, 512, 729_444),
    ("teamserve-testbed--tiny-gemma3", 1, 512, 1_458_888),
    ("teamserve-testbed--tiny-gemma3", 2, 2048, 332_222),
])
def test_reproduces_vllm_cpu_kv_cache_size(name: str, kv_bytes: int, batched: int, logged: int) -> None:
    config = tiny_llama_config() if name == "tiny-llama" else load_config(name)
    layout = kv_layout(parse_config(config), tensor_parallel_size=1, kv_dtype_bytes=kv_bytes,
                       block_size=128, state_dtype_bytes=2, prefix_caching=True)
    blocks = 1024 ** 3 // layout.bytes_per_block
    assert layout.logged_kv_tokens(blocks, 2048, batched) == logged
