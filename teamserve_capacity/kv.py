"""KV-cache page, block and per-request arithmetic the way vLLM 0.32.0 does it.

Sources (vLLM 0.32.0 wheel):
  * ``vllm/v1/kv_cache_interface.py``: ``AttentionSpec.page_size_bytes`` =
    kv_heads x block_size x (head_size + head_size_v) x dtype bytes; MLA keeps one
    latent per token (head_size = kv_lora_rank + qk_rope_head_dim, no V, one
    "head", not split by tensor parallelism); ``max_memory_usage_bytes`` /
    ``max_admission_blocks_per_request`` of the full, sliding-window,
    chunked-local and Mamba specs.
  * ``vllm/v1/core/kv_cache_utils.py``: ``_get_kv_cache_groups_uniform_page_size``
    (hybrid layers grouped by the smaller layer count, or the larger when it is
    below 1.5x the smaller; one block holds one page of every layer in a group),
    ``get_kv_cache_config_from_groups`` (num_blocks = memory // bytes per block),
    ``get_max_concurrency_for_kv_cache_config`` and ``update_kv_cache_capacity``
    (the logged "GPU KV cache size: N tokens" is
    ``int(num_blocks / blocks_per_request(max_model_len) * max_model_len)``).
  * ``vllm/platforms/interface.py`` ``_align_hybrid_block_size``: with
    linear-attention (Mamba-like) layers the attention block grows, in steps of
    ``max(smallest kernel block (16), --block-size)`` (128 at least for MLA),
    until one attention page holds a layer's state; the state page is padded
    to the attention page.
  * ``vllm/config/vllm.py`` ``max_in_flight_tokens`` = concurrent batches (2 with
    async scheduling, the default) x ``max_num_batched_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import CHUNKED, FULL, LINEAR, SLIDING, ModelSpec

# Smallest kernel block of vLLM's CUDA attention backends (FlashAttention
# supports MultipleOf(16)); used to align hybrid attention/state pages.
KERNEL_BLOCK_ALIGNMENT = 16
# vLLM 0.32 _align_hybrid_block_size: hybrid MLA/Mamba models align the block to
# 128 tokens (TRTLLM/FlashInfer MLA decode kernels).
MLA_HYBRID_BLOCK_ALIGNMENT = 128


def hybrid_block_step(block_size: int, mla: bool) -> int:
    """Tokens the attention block of a hybrid linear-attention model grows by, per step.

    vLLM 0.32.0 ``vllm/platforms/interface.py`` ``_align_hybrid_block_size``:
    ``max(smallest kernel block of the backend, cache_config.block_size)``,
    at least 128 for MLA, then rounded up to a multiple of every backend's
    smallest kernel block (16 on CUDA: a no-op for the block sizes the planner
    accepts). So ``--block-size 64`` grows the block in steps of 64 tokens.

    Args:
        block_size: the engine's --block-size, tokens.
        mla: the model's attention is MLA.
    Returns:
        the step, tokens.
    """
    step = max(KERNEL_BLOCK_ALIGNMENT, block_size)
    if mla:
        step = max(step, MLA_HYBRID_BLOCK_ALIGNMENT)
    return KERNEL_BLOCK_ALIGNMENT * cdiv(step, KERNEL_BLOCK_ALIGNMENT)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class LayerGroupKind:
    """One attention kind of a model, as vLLM groups it.

    Attributes:
        kind: FULL, SLIDING, CHUNKED or LINEAR.
        layers: how many decoder layers are of this kind.
        groups: how many KV cache groups (block tables) vLLM makes for them.
        bytes_per_token: KV bytes one token costs in one layer of this kind on
            one GPU (0 for LINEAR: its state does not grow with tokens).
        state_bytes: LINEAR only, one sequence's state per layer per GPU.
    """

    kind: str
    layers: int
    groups: int
    bytes_per_token: int
    state_bytes: int = 0


@dataclass(frozen=True)
class KVLayout:
    """The KV cache layout of one model on one GPU.

    Attributes:
        block_size: tokens per attention block (after hybrid alignment).
        page_bytes: bytes of one block of one layer (uniform across layers).
        group_size: layers per KV cache group.
        bytes_per_block: bytes one block of the shared pool costs
            (``group_size x page_bytes``); num_blocks = budget // this.
        kinds: per attention kind detail.
        kv_bytes_per_token: bytes one token costs summed over every
            token-storing layer, per GPU (``kv_token`` in the table).
        sliding_window, attention_chunk_size: window/chunk lengths in tokens.
        mamba_blocks_per_request: state blocks a sequence holds per LINEAR
            group (2 with prefix caching — vLLM's "align" mode — else 1).
    """

    block_size: int
    page_bytes: int
    group_size: int
    bytes_per_block: int
    kinds: tuple[LayerGroupKind, ...]
    kv_bytes_per_token: int
    sliding_window: int | None
    attention_chunk_size: int | None
    mamba_blocks_per_request: int

    def blocks_per_request(self, tokens: int, max_in_flight_tokens: int) -> int:
        """Pool blocks one request of ``tokens`` tokens can hold at most.

        Sum over KV cache groups of the per-group admission cap of vLLM 0.32
        (full: cdiv(tokens, block); sliding: cdiv(min(window - 1 + in-flight,
        tokens), block) + 1; chunked: cdiv(min(chunk + in-flight, tokens),
        block); linear: 1 or 2 state blocks).

        Args:
            tokens: the request's length (prompt + output), tokens.
            max_in_flight_tokens: tokens scheduled but not yet settled.
        Returns:
            blocks of the shared pool.
        """
        total = 0
        for k in self.kinds:
            if k.kind == FULL:
                per_group = cdiv(tokens, self.block_size)
            elif k.kind == SLIDING:
                assert self.sliding_window is not None
                per_group = cdiv(min(self.sliding_window - 1 + max_in_flight_tokens, tokens),
                                 self.block_size) + 1
            elif k.kind == CHUNKED:
                assert self.attention_chunk_size is not None
                per_group = cdiv(min(self.attention_chunk_size + max_in_flight_tokens, tokens),
                                 self.block_size)
            else:
                per_group = self.mamba_blocks_per_request
            total += k.groups * per_group
        return total

    def logged_kv_tokens(self, num_blocks: int, max_model_len: int, max_in_flight_tokens: int) -> int:
        """The number vLLM 0.32 prints as "GPU KV cache size: N tokens".

        Args:
            num_blocks: blocks in the pool.
            max_model_len: the engine's --max-model-len.
            max_in_flight_tokens: see :meth:`blocks_per_request`.
        Returns:
            ``int(num_blocks / blocks_per_request(max_model_len) * max_model_len)``.
        """
        per_req = self.blocks_per_request(max_model_len, max_in_flight_tokens)
        return int(num_blocks / per_req * max_model_len)


def kv_layout(spec: ModelSpec, *, tensor_parallel_size: int, kv_dtype_bytes: int,
              block_size: int, state_dtype_bytes: int, prefix_caching: bool) -> KVLayout:
    """Build the per-GPU KV layout of ``spec`` the way vLLM 0.32 groups it.

    Args:
        spec: the model.
        tensor_parallel_size: GPUs one copy of the model is split across.
        kv_dtype_bytes: bytes per cached K/V element (2 for bf16/fp16, 1 for fp8).
        block_size: the engine's --block-size, tokens (16 by default).
        state_dtype_bytes: bytes per element of linear-attention state.
        prefix_caching: whether --enable-prefix-caching is on (hybrid linear
            models then keep 2 state blocks per sequence).
    Returns:
        the layout.
    """
    if spec.mla_latent_dim is not None:
        # One latent per token per layer, replicated on every TP rank.
        per_token_layer = spec.mla_latent_dim * kv_dtype_bytes
    else:
        heads = max(1, spec.num_kv_heads // tensor_parallel_size)
        per_token_layer = 2 * heads * spec.head_dim * kv_dtype_bytes

    counts = spec.kind_counts()
    state = 0
    if LINEAR in counts:
        assert spec.linear is not None
        state = spec.linear.state_bytes(tensor_parallel_size, state_dtype_bytes)
        step = hybrid_block_step(block_size, spec.mla_latent_dim is not None)
        block_size = max(block_size, step * cdiv(state, step * per_token_layer))
    page = block_size * per_token_layer

    if len(counts) == 1:
        group_size = next(iter(counts.values()))
    else:
        smallest, largest = min(counts.values()), max(counts.values())
        group_size = largest if largest < smallest * 1.5 else smallest
    kinds = tuple(
        LayerGroupKind(kind=k, layers=n, groups=cdiv(n, group_size),
                       bytes_per_token=0 if k == LINEAR else per_token_layer,
                       state_bytes=state if k == LINEAR else 0)
        for k, n in counts.items()
    )
    token_layers = sum(n for k, n in counts.items() if k != LINEAR)
    return KVLayout(
        block_size=block_size,
        page_bytes=page,
        group_size=group_size,
        bytes_per_block=group_size * page,
        kinds=kinds,
        kv_bytes_per_token=token_layers * per_token_layer,
        sliding_window=spec.sliding_window,
        attention_chunk_size=spec.attention_chunk_size,
        mamba_blocks_per_request=2 if prefix_caching else 1,
    )


__all__ = ["KVLayout", "LayerGroupKind", "kv_layout", "hybrid_block_step", "cdiv", "FULL", "SLIDING", "CHUNKED", "LINEAR"]
