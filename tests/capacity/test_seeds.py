"""The seeds' worked example ("Sizing for ten people"), number for number."""

from __future__ import annotations

from teamserve_capacity import GIB, MIB, seeds_max_concurrent
from teamserve_capacity.kv import kv_layout
from teamserve_capacity.model import parse_config

EIGHT_B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
           "vocab_size": 128256, "torch_dtype": "float16"}
VRAM = 24 * GIB            # "a single 24 GB card" (the seeds subtract in GiB: 24 - 14.9 - 2.0)
WEIGHTS_FP16 = 8 * 10 ** 9 * 16 // 8   # 8e9 * 16 / 8 = 16.0 GB
WEIGHTS_4BIT = 8 * 10 ** 9 * 4 // 8
OVERHEAD = 2 * GIB


def kv_token(kv_bytes: int) -> int:
    layout = kv_layout(parse_config(EIGHT_B), tensor_parallel_size=1, kv_dtype_bytes=kv_bytes,
                       block_size=16, state_dtype_bytes=2, prefix_caching=True)
    return layout.kv_bytes_per_token


def test_kv_token_is_128_kib() -> None:
    assert kv_token(2) == 128 * 1024


def test_weights_and_left_for_kv() -> None:
    assert round(WEIGHTS_FP16 / GIB, 1) == 14.9
    assert round((VRAM - WEIGHTS_FP16 - OVERHEAD) / GIB, 1) == 7.1


def test_kv_per_sequence_at_4000_tokens_is_500_mib() -> None:
    assert kv_token(2) * 4000 == 500 * MIB


def test_fourteen_sequences() -> None:
    assert seeds_max_concurrent(VRAM, WEIGHTS_FP16, OVERHEAD, kv_token(2), 4000) == 14


def test_sixteen_k_context_gives_three() -> None:
    assert kv_token(2) * 16384 == 2 * GIB
    assert seeds_max_concurrent(VRAM, WEIGHTS_FP16, OVERHEAD, kv_token(2), 16000) == 3


def test_four_bit_weights_free_eleven_gib_and_pass_35() -> None:
    assert round((WEIGHTS_FP16 - WEIGHTS_4BIT) / GIB) == 11
    assert seeds_max_concurrent(VRAM, WEIGHTS_4BIT, OVERHEAD, kv_token(2), 4000) > 35


def test_eight_bit_kv_cache_doubles() -> None:
    assert kv_token(1) * 2 == kv_token(2)
    fp16 = seeds_max_concurrent(VRAM, WEIGHTS_FP16, OVERHEAD, kv_token(2), 4000)
    fp8 = seeds_max_concurrent(VRAM, WEIGHTS_FP16, OVERHEAD, kv_token(1), 4000)
    assert fp8 >= 2 * fp16
