#!/usr/bin/env python3
"""Write a tiny random-weight Gemma 3 text model (5 sliding-window layers : 1 full).

Run inside the testbed engine image (it has torch and transformers):
    docker run --rm --network none -v DIR:/out --entrypoint /opt/venv/bin/python \
        vllm/vllm-openai:v0.32.0 /bench/make_tiny_hybrid.py /out/tiny-gemma3
The tokenizer is copied from the image's tiny Llama (/opt/models/teamserve-tiny).
Used by cpu_engine.py to check the planner's hybrid (sliding-window) accounting
against the real vLLM 0.32.0 CPU build.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main(out: str) -> None:
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
        max_position_embeddings=2048, query_pre_attn_scalar=64, rope_scaling=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16",
    )
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path("/opt/models/teamserve-tiny") / name
        if src.exists():
            shutil.copy(src, target / name)


if __name__ == "__main__":
    main(sys.argv[1])
