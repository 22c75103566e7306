"""Shared fixtures for the capacity planner tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = FIXTURES / "configs"

# The testbed's tiny Llama and the GPU the stand-in nvidia-smi reports
# (docs/contracts.md; brief for issue 3).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048,
              "vocab_size": 4096, "torch_dtype": "bfloat16"}
RTX_PRO_6000 = {"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                "memory_total_mib": 97887, "compute_cap": "12.0", "driver_version": "580.95.05"}
ENGINE = {"gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
          "block_size": 16, "vllm_version": "0.32.0"}


def load_config(name: str) -> dict[str, Any]:
    """A fixture config.json by file stem."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.fixture
def tiny_model() -> dict[str, Any]:
    return {"name": "tiny", "served_model_name": "tiny", "config": dict(TINY_LLAMA), "weight_format": "bf16"}


@pytest.fixture
def workload() -> dict[str, Any]:
    return {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 2048,
            "ttft_p95_seconds": 1.0, "tpot_seconds": 0.05}
