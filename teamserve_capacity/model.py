"""Read a Hugging Face ``config.json`` into the few numbers the planner needs.

Only what decides the KV cache and the weight size is read. Each supported
``model_type`` is listed in :data:`ARCHITECTURES` with the rule the pinned vLLM
(0.32.0) uses to give each decoder layer its attention kind; a config whose
``model_type`` is not listed is refused rather than guessed at.

Sources (vLLM 0.32.0 wheel, read for this module):
  * ``vllm/v1/kv_cache_interface.py`` — FullAttentionSpec, SlidingWindowSpec,
    ChunkedLocalAttentionSpec, MLAAttentionSpec, MambaSpec page sizes.
  * ``vllm/config/model.py`` ``_get_and_verify_max_len`` — the model's own
    length limit and which RoPE scalings multiply it.
  * ``vllm/model_executor/layers/mamba/mamba_utils.py``
    ``gated_delta_net_state_shape`` — linear-attention (Qwen3-Next) state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import PlanError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"

# model_type -> how vLLM 0.32 lays out the layers' KV cache.
#   "dense": every layer full attention (GQA/MHA/MQA), sliding window only if
#            the config enables it for all layers;
#   "mla":   DeepSeek-style multi-head latent attention;
#   "alternating_sliding": layer_types, else even layers slide (Gemma 2, gpt-oss);
#   "pattern_sliding": layer_types, else sliding_window_pattern (Gemma 3);
#   "chunked_local": Llama 4 (no_rope_layers / nope_layer_interval);
#   "hybrid_linear": Qwen3-Next gated delta net + full attention.
ARCHITECTURES: dict[str, str] = {
    "llama": "dense",
    "mistral": "dense",
    "mixtral": "dense",
    "ministral": "dense",
    "qwen2": "dense",
    "qwen2_moe": "dense",
    "qwen3": "dense",
    "qwen3_moe": "dense",
    "phi3": "dense",
    "granite": "dense",
    "olmo2": "dense",
    "glm4_moe": "dense",
    "cohere": "dense",
    "gemma": "dense",
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "kimi_k2": "mla",
    "gemma2": "alternating_sliding",
    "gpt_oss": "alternating_sliding",
    "gemma3": "pattern_sliding",
    "gemma3_text": "pattern_sliding",
    "llama4": "chunked_local",
    "llama4_text": "chunked_local",
    "qwen3_next": "hybrid_linear",
}

# Defaults of the transformers config classes for keys some published
# config.json files leave out (transformers Gemma3TextConfig: 131072 positions,
# vocabulary 262208, sliding_window_pattern 6).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"max_position_embeddings": 131072, "vocab_size": 262208, "sliding_window_pattern": 6},
}

# torch dtype name -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
}

# RoPE scalings whose max_position_embeddings is already the scaled length
# (vLLM 0.32 vllm/config/model.py _get_and_verify_max_len); any other scaling
# type multiplies the limit by its "factor".
_ROPE_ALREADY_SCALED = {
    "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling",
    "default",
}


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated-delta-net (linear attention) sizes of one layer, whole model (TP=1)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int

    def state_bytes(self, tensor_parallel_size: int, dtype_bytes: int) -> int:
        """Bytes of one sequence's recurrent state for one layer on one GPU.

        Follows vLLM 0.32 ``gated_delta_net_state_shape``: a conv state of
        ``conv_dim / TP x (kernel - 1)`` plus a temporal state of
        ``num_v_heads / TP x head_v_dim x head_k_dim``, both in the model
        dtype when ``mamba_cache_dtype``/``mamba_ssm_cache_dtype`` are "auto".

        Args:
            tensor_parallel_size: GPUs the layer is split across.
            dtype_bytes: bytes per element of the state (2 for bf16).
        Returns:
            bytes per sequence per layer per GPU.
        """
        conv_dim = self.head_k_dim * self.num_k_heads * 2 + self.head_v_dim * self.num_v_heads
        conv = (conv_dim // tensor_parallel_size) * (self.conv_kernel_size - 1)
        temporal = (self.num_v_heads // tensor_parallel_size) * self.head_v_dim * self.head_k_dim
        return (conv + temporal) * dtype_bytes


@dataclass(frozen=True)
class MoEShape:
    """Mixture-of-experts sizes (per MoE layer)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    first_dense_layers: int


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a model, read from its config.json.

    Attributes:
        model_type: the config's ``model_type`` (text part for multimodal models).
        architecture: first entry of ``architectures`` (informational).
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (GQA/MQA); equals query heads for MHA.
        head_dim: dimension per head, elements.
        hidden_size, intermediate_size, vocab_size: standard HF fields.
        layer_kinds: per-layer attention kind (FULL/SLIDING/CHUNKED/LINEAR).
        sliding_window: window length in tokens for SLIDING layers.
        attention_chunk_size: chunk length in tokens for CHUNKED layers.
        mla_latent_dim: kv_lora_rank + qk_rope_head_dim for MLA models, else None.
        linear: gated-delta-net shape for LINEAR layers, else None.
        moe: expert shape, else None.
        max_model_len_limit: the longest context the model itself allows (tokens).
        dtype: the checkpoint's torch dtype name (bfloat16, float16...).
        quant_method: ``quantization_config.quant_method`` if the checkpoint is
            pre-quantized, else None.
        tie_word_embeddings: whether the LM head shares the embedding matrix.
    """

    model_type: str
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    layer_kinds: tuple[str, ...]
    sliding_window: int | None
    attention_chunk_size: int | None
    mla_latent_dim: int | None
    linear: LinearAttentionShape | None
    moe: MoEShape | None
    max_model_len_limit: int
    dtype: str
    quant_method: str | None
    tie_word_embeddings: bool
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def attention_type(self) -> str:
        """A one-word label of the attention: MHA, GQA, MQA or MLA."""
        if self.mla_latent_dim is not None:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "GQA"

    def kind_counts(self) -> dict[str, int]:
        """Number of layers of each attention kind, in first-seen order."""
        counts: dict[str, int] = {}
        for kind in self.layer_kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a multimodal config's ``text_config`` over its top level."""
    if not isinstance(config, Mapping):
        raise PlanError("config", type(config).__name__,
                        "pass the model's config.json content as a mapping (dict)")
    merged = dict(config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        merged.update(text)
        if "model_type" in text:
            merged["model_type"] = text["model_type"]
    return merged


def _positive_int(cfg: Mapping[str, Any], names: tuple[str, ...], *, required: bool = True,
                  default: int | None = None) -> int | None:
    """First of ``names`` present in ``cfg`` as a positive int."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"config.{name}", value,
                                "must be a positive whole number; check the model's config.json")
            return value
    if required and default is None:
        raise PlanError(f"config.{names[0]}", None,
                        "the config.json must state it; pass the model's own config.json "
                        "(for multimodal models the planner reads text_config)")
    return default


def _layer_types_from_config(cfg: Mapping[str, Any], n: int) -> list[str] | None:
    """The config's ``layer_types`` (one attention kind per layer, ``n`` layers), or None if absent.

    Raises:
        PlanError: not a list of ``n`` known kinds.
    """
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise PlanError("config.layer_types", types,
                        f"must list one entry per layer ({n} layers)")
    out = []
    for t in types:
        if t in (FULL, SLIDING, LINEAR):
            out.append(t)
        elif t == "chunked_attention":
            out.append(CHUNKED)
        else:
            raise PlanError("config.layer_types", t,
                            "the planner knows full_attention, sliding_attention, "
                            "chunked_attention and linear_attention layers only")
    return out


def _layer_kinds(kind: str, cfg: Mapping[str, Any], n: int) -> list[str]:
    """Per-layer attention kind, following each vLLM 0.32 model file."""
    declared = _layer_types_from_config(cfg, n)
    if kind == "mla":
        return [FULL] * n
    if kind == "dense":
        if declared is not None:
            return declared
        # Qwen-family configs carry sliding_window but only use it when
        # use_sliding_window is true; Mistral-style configs use it when set.
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True):
            return [SLIDING] * n
        return [FULL] * n
    if kind == "alternating_sliding":
        if declared is not None:
            return declared
        # vllm/model_executor/models/gemma2.py and gpt_oss.py: even layers slide.
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if kind == "pattern_sliding":
        if declared is not None:
            return declared
        pattern = _positive_int(cfg, ("sliding_window_pattern",), default=6)
        assert pattern is not None
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    if kind == "chunked_local":
        if not cfg.get("attention_chunk_size"):
            return [FULL] * n
        no_rope = cfg.get("no_rope_layers") or []
        if no_rope:
            if len(no_rope) != n:
                raise PlanError("config.no_rope_layers", no_rope,
                                f"must list one 0/1 entry per layer ({n} layers)")
            # vllm llama4.py: a layer with RoPE (1) uses chunked local attention;
            # a NoPE layer (0) attends globally.
            return [CHUNKED if flag else FULL for flag in no_rope]
        # HF Llama4TextConfig fills no_rope_layers from no_rope_layer_interval.
        interval = _positive_int(cfg, ("no_rope_layer_interval",), default=4)
        assert interval is not None
        return [FULL if (i + 1) % interval == 0 else CHUNKED for i in range(n)]
    if kind == "hybrid_linear":
        if declared is not None:
            return declared
        interval = _positive_int(cfg, ("full_attention_interval",), default=4)
        assert interval is not None
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    raise AssertionError(kind)


def _max_len_limit(cfg: Mapping[str, Any], model_type: str) -> int:
    """The model's own context limit, as vLLM 0.32 derives it.

    ``_get_and_verify_max_len``: the first present of the usual length keys,
    multiplied by the RoPE scaling factor unless the scaling type is one whose
    ``max_position_embeddings`` is already scaled (yarn, llama3, longrope, ...)
    or the model is Gemma 3.

    Raises:
        PlanError: none of the length keys is present (vLLM would use 2,048).
    """
    names = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
    limit = _positive_int(cfg, names, required=False)
    if limit is None:
        # vLLM itself would fall back to 2,048 tokens (_get_and_verify_max_len), a silent cap.
        raise PlanError("config.max_position_embeddings", None,
                        "the config.json states no context length (" + ", ".join(names) + "); vLLM would "
                        "silently cap the model at 2,048 tokens. Add max_position_embeddings with the "
                        "context length the model card gives")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(scaling, Mapping) or "gemma3" in model_type:
        return int(limit)
    # Newer transformers write one RoPE mapping per layer type.
    per_type = [v for v in scaling.values() if isinstance(v, Mapping)]
    factor_total = 1.0
    for rope in per_type or [scaling]:
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        factor = rope.get("factor")
        if rope_type not in _ROPE_ALREADY_SCALED and isinstance(factor, (int, float)) and factor > 0:
            factor_total = float(factor)  # vLLM assumes all layer types share one factor
    return int(limit * factor_total)


def parse_config(config: Mapping[str, Any]) -> ModelSpec:
    """Read a Hugging Face config.json (dict) into a :class:`ModelSpec`.

    Args:
        config: the parsed config.json; a multimodal config's ``text_config``
            is merged over the top level.
    Returns:
        the model's KV-relevant shape.
    Raises:
        PlanError: missing or non-positive layers/heads, inconsistent head
            counts, or a ``model_type`` the planner does not know.
    """
    cfg = _text_config(config)
    model_type = cfg.get("model_type")
    for key, value in HF_DEFAULTS.get(str(model_type), {}).items():
        cfg.setdefault(key, value)
    if not isinstance(model_type, str) or not model_type:
        raise PlanError("config.model_type", model_type,
                        "the config.json must name its model_type; pass the model's own config.json")
    kind = ARCHITECTURES.get(model_type)
    if kind is None:
        raise PlanError("config.model_type", model_type,
                        "this architecture is not modelled; the planner refuses rather than "
                        "guess its KV cache — known: " + ", ".join(sorted(ARCHITECTURES))
                        + " (add it to teamserve_capacity.model.ARCHITECTURES after checking "
                        "how vLLM 0.32 caches it)")
    architectures = cfg.get("architectures") or [model_type]
    n_layers = _positive_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"))
    n_heads = _positive_int(cfg, ("num_attention_heads", "n_head"))
    hidden = _positive_int(cfg, ("hidden_size", "n_embd", "d_model"))
    assert n_layers is not None and n_heads is not None and hidden is not None
    n_kv = _positive_int(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
                         required=False, default=n_heads)
    assert n_kv is not None
    if n_kv > n_heads or n_heads % n_kv:
        raise PlanError("config.num_key_value_heads", n_kv,
                        f"must divide num_attention_heads ({n_heads}); check the config.json")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % n_heads:
            raise PlanError("config.head_dim", None,
                            f"hidden_size {hidden} is not a multiple of num_attention_heads "
                            f"{n_heads}; the config must state head_dim")
        head_dim = hidden // n_heads
    head_dim = _positive_int({"head_dim": head_dim}, ("head_dim",))
    assert head_dim is not None

    mla_latent = None
    if kind == "mla":
        rank = _positive_int(cfg, ("kv_lora_rank",))
        rope = _positive_int(cfg, ("qk_rope_head_dim",))
        assert rank is not None and rope is not None
        mla_latent = rank + rope

    linear = None
    if kind == "hybrid_linear":
        nk = _positive_int(cfg, ("linear_num_key_heads",))
        nv = _positive_int(cfg, ("linear_num_value_heads",))
        dk = _positive_int(cfg, ("linear_key_head_dim",))
        dv = _positive_int(cfg, ("linear_value_head_dim",))
        ck = _positive_int(cfg, ("linear_conv_kernel_dim",))
        assert nk and nv and dk and dv and ck
        linear = LinearAttentionShape(nk, nv, dk, dv, ck)

    kinds = _layer_kinds(kind, cfg, n_layers)
    window = None
    if SLIDING in kinds:
        window = _positive_int(cfg, ("sliding_window",))
    chunk = None
    if CHUNKED in kinds:
        chunk = _positive_int(cfg, ("attention_chunk_size",))

    moe = None
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if n_experts:
        moe = MoEShape(
            num_experts=int(n_experts),
            experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
                                  or cfg.get("num_experts_per_token") or 1),
            expert_intermediate_size=int(cfg.get("moe_intermediate_size")
                                         or cfg.get("intermediate_size") or 0),
            shared_intermediate_size=int(
                (cfg.get("shared_expert_intermediate_size") or 0)
                or (cfg.get("n_shared_experts") or 0) * (cfg.get("moe_intermediate_size") or 0)),
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        )

    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise PlanError("config.torch_dtype", dtype,
                        "use bfloat16, float16 or float32 (the checkpoint's compute dtype)")
    quant = cfg.get("quantization_config")
    quant_method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    intermediate = cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden
    return ModelSpec(
        model_type=model_type,
        architecture=str(architectures[0]),
        num_layers=n_layers,
        num_attention_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        vocab_size=int(cfg.get("vocab_size") or 32000),
        layer_kinds=tuple(kinds),
        sliding_window=window,
        attention_chunk_size=chunk,
        mla_latent_dim=mla_latent,
        linear=linear,
        moe=moe,
        max_model_len_limit=_max_len_limit(cfg, model_type),
        dtype=str(dtype),
        quant_method=str(quant_method) if quant_method else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        raw=cfg,
    )
