"""Weight bytes: from the checkpoint when it is known, else a quantisation-aware estimate.

Two ways to the bytes vLLM loads (before tensor parallelism splits them):

* the checkpoint itself: the safetensors index's ``metadata.total_size`` or the
  ``*.safetensors`` files' sizes at the pinned revision, from the hub's tree
  listing (before a download) or the local HF cache (after one) —
  :func:`checkpoint_total`;
* the config alone: every tensor of the model laid out from config.json
  (:func:`tensor_layout`) and sized in its checkpoint format
  (:func:`estimate_weights`). Embeddings, norms, routers and (unless the format
  quantises it) ``lm_head`` stay 16-bit; only the linear layers a format
  quantises shrink.

Sources of each format's bytes (tensor shapes of the published formats):
  * AWQ GEMM (AutoAWQ ``WQLinear_GEMM``): ``qweight`` int32 [in, out/8],
    ``qzeros`` int32 [in/g, out/8], ``scales`` 16-bit [in/g, out] — checked to
    the byte against Qwen/Qwen3-32B-AWQ's safetensors headers
    (models/checkpoints.json).
  * GPTQ (AutoGPTQ/GPTQModel ``QuantLinear``): ``qweight`` int32 [in/8, out],
    ``qzeros`` int32 [in/g, out/8], ``scales`` 16-bit [in/g, out], ``g_idx``
    int32 [in].
  * compressed-tensors ``pack-quantized`` (W4A16/W8A16): ``weight_packed``,
    ``weight_scale`` 16-bit per group, ``weight_shape``; FP8 ``float-quantized``:
    fp8 weight and a scale per output channel (or per tensor).
  * FP8 block quantisation (DeepSeek-V3 / Qwen3 FP8, ``weight_block_size``):
    fp8 weight and a float32 ``weight_scale_inv`` per 128 x 128 block.
  * MXFP4 (gpt-oss): experts only, ``*_blocks`` uint8 (two 4-bit values per
    byte) and ``*_scales`` uint8 (one E8M0 scale per 32 values); attention,
    router, embeddings and ``lm_head`` bf16 — checked to the byte against
    openai/gpt-oss-20b's and -120b's indexes.
  * NVFP4 (ModelOpt ``modelopt_fp4``): 4-bit values, an fp8 scale per 16 and
    two float32 scales per layer.
  * bitsandbytes 4-bit (NF4/FP4, bitsandbytes ``quantize_4bit``): 4-bit
    values, a float32 absmax per block of 64 (with double quantisation an
    8-bit absmax per 64 and a float32 per 256 blocks); 8-bit (LLM.int8): int8
    values and a float32 scale per output row. vLLM 0.32 quantises a 16-bit
    checkpoint to 4-bit NF4 at load time with ``--quantization bitsandbytes``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import PlanError
from .kv import cdiv
from .model import LINEAR, ModelSpec

# Roles of linear layers.
ATTENTION = "attention"
MLP = "mlp"
EXPERT = "expert"
SHARED_EXPERT = "shared_expert"
ROUTER = "router"
LM_HEAD = "lm_head"
# Roles of other tensors (always 16-bit unless stated).
EMBEDDING = "embedding"
NORM = "norm"
OTHER = "other"

# Linear roles a weight-quantising format converts; routers (tiny, accuracy
# critical) and lm_head stay 16-bit in every format modelled here (AutoAWQ,
# GPTQModel, llm-compressor and ModelOpt defaults; the FP8 checkpoints of
# DeepSeek-V3 and Qwen3 keep ``mlp.gate`` in bf16).
QUANTISED_ROLES = frozenset({ATTENTION, MLP, EXPERT, SHARED_EXPERT})

# Formats whose checkpoint is 16-bit and that vLLM converts when it loads it
# (--quantization fp8 / bitsandbytes): the loaded bytes are the checkpoint's
# times estimate(format) / estimate(16-bit).
ONLINE_FORMATS = frozenset({"fp8", "bitsandbytes"})


@dataclass(frozen=True)
class Linear:
    """``count`` weight matrices of ``in_features`` x ``out_features`` (plus an optional bias)."""

    role: str
    in_features: int
    out_features: int
    count: int = 1
    bias: bool = False


@dataclass(frozen=True)
class Plain:
    """``count`` x ``numel`` elements kept unquantised, ``elem_bytes`` each (2 = 16-bit)."""

    role: str
    numel: int
    count: int = 1
    elem_bytes: int = 2


@dataclass(frozen=True)
class Quant:
    """How a checkpoint stores its quantised linear layers.

    Attributes:
        method: awq, gptq, pack (compressed-tensors int), fp8, mxfp4, nvfp4, bnb4, bnb8.
        bits: bits per quantised value (4 or 8 for the integer formats).
        group_size: input channels per scale (int formats; the whole row when -1).
        zero_points: whether a packed zero point is stored per group.
        g_idx: whether an int32 group index per input channel is stored (GPTQ).
        block: fp8 block shape (rows, columns) of one float32 scale, or None.
        double_quant: bitsandbytes nested absmax quantisation.
        skip: linear roles left unquantised besides router and lm_head.
    """

    method: str
    bits: int = 4
    group_size: int = 128
    zero_points: bool = True
    g_idx: bool = False
    block: tuple[int, int] | None = None
    double_quant: bool = False
    skip: frozenset[str] = frozenset()


@dataclass(frozen=True)
class WeightEstimate:
    """Weights of a whole model (all tensor-parallel ranks together).

    Attributes:
        total_bytes: bytes of every tensor vLLM loads.
        params: parameters (elements before packing).
        quantised_params: parameters in quantised linear layers.
        quantised_bytes: their bytes including scales, zeros and indexes.
        method: the Quant.method, or "16-bit".
    """

    total_bytes: int
    params: int
    quantised_params: int
    quantised_bytes: int
    method: str


def _cfg_int(raw: Mapping[str, Any], key: str, default: int = 0) -> int:
    """``raw[key]`` as an int (0 / ``default`` when absent or null)."""
    value = raw.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _moe_layer(spec: ModelSpec, index: int) -> bool:
    """Whether decoder layer ``index`` has a mixture-of-experts MLP (per the HF config conventions)."""
    if spec.moe is None:
        return False
    raw = spec.raw
    if index < spec.moe.first_dense_layers:
        return False
    if index in (raw.get("mlp_only_layers") or []):
        return False
    step = _cfg_int(raw, "decoder_sparse_step") or _cfg_int(raw, "interleave_moe_layer_step") or 1
    # Qwen2/3-MoE: (index + 1) % step == 0; Llama 4 the same with interleave_moe_layer_step.
    return (index + 1) % step == 0


def tensor_layout(spec: ModelSpec) -> list[Linear | Plain]:
    """Every tensor group of the model, as its config.json describes it.

    Covers embeddings, ``lm_head`` (unless tied), norms (2 per layer, 4 for
    Gemma 2/3, q/k norms for Qwen3 and Gemma 3, MLA's latent norms),
    attention (GQA/MHA with optional biases and gpt-oss sinks; MLA's low-rank
    projections; Qwen3-Next's gated attention and gated-delta-net layers),
    dense gated MLPs, MoE experts, shared experts and routers. Vision towers
    of multimodal configs and multi-token-prediction layers (which vLLM does
    not load without speculative decoding) are not counted.

    Args:
        spec: the parsed config.
    Returns:
        tensor groups; element counts are for the whole model (TP = 1).
    """
    h, raw = spec.hidden_size, spec.raw
    heads, kv, hd = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    out: list[Linear | Plain] = [Plain(EMBEDDING, spec.vocab_size * h), Plain(NORM, h)]
    if not spec.tie_word_embeddings:
        out.append(Linear(LM_HEAD, h, spec.vocab_size))
    n = spec.num_layers
    mt = spec.model_type
    norms_per_layer = 4 if mt.startswith(("gemma2", "gemma3")) else 2
    out.append(Plain(NORM, h, n * norms_per_layer))
    qk_norm = mt.startswith(("qwen3", "gemma3"))
    attn_bias = bool(raw.get("attention_bias")) or mt in ("qwen2", "qwen2_moe")
    out_bias = bool(raw.get("attention_bias"))  # Qwen2 biases q/k/v only

    full_layers = sum(1 for kind in spec.layer_kinds if kind != LINEAR)
    if spec.mla_latent_dim is not None:
        nope = _cfg_int(raw, "qk_nope_head_dim", hd)
        rope = _cfg_int(raw, "qk_rope_head_dim")
        v_dim = _cfg_int(raw, "v_head_dim", hd)
        q_rank = _cfg_int(raw, "q_lora_rank")
        kv_rank = _cfg_int(raw, "kv_lora_rank")
        if q_rank:
            out += [Linear(ATTENTION, h, q_rank, n), Plain(NORM, q_rank, n),
                    Linear(ATTENTION, q_rank, heads * (nope + rope), n)]
        else:
            out.append(Linear(ATTENTION, h, heads * (nope + rope), n))
        out += [Linear(ATTENTION, h, kv_rank + rope, n), Plain(NORM, kv_rank, n),
                Linear(ATTENTION, kv_rank, heads * (nope + v_dim), n),
                Linear(ATTENTION, heads * v_dim, h, n)]
    else:
        # Qwen3-Next's full-attention layers gate their output: q_proj is twice as wide.
        q_width = heads * hd * (2 if spec.linear is not None else 1)
        out += [Linear(ATTENTION, h, q_width, full_layers, attn_bias),
                Linear(ATTENTION, h, kv * hd, 2 * full_layers, attn_bias),
                Linear(ATTENTION, heads * hd, h, full_layers, out_bias)]
        if qk_norm or spec.linear is not None:
            out.append(Plain(NORM, hd, 2 * full_layers))
        if mt == "gpt_oss":
            out.append(Plain(OTHER, heads, full_layers))  # attention sinks
    if spec.linear is not None:
        la = spec.linear
        linear_layers = n - full_layers
        key_dim, value_dim = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
        conv_dim = 2 * key_dim + value_dim
        out += [Linear(ATTENTION, h, 2 * key_dim + 2 * value_dim, linear_layers),
                Linear(ATTENTION, h, 2 * la.num_v_heads, linear_layers),
                Linear(ATTENTION, value_dim, h, linear_layers),
                Plain(OTHER, conv_dim * la.conv_kernel_size + 2 * la.num_v_heads + la.head_v_dim,
                      linear_layers)]

    moe_layers = sum(1 for i in range(n) if _moe_layer(spec, i))
    dense_layers = n - moe_layers
    dense_width = _cfg_int(raw, "intermediate_size_mlp") or spec.intermediate_size
    if dense_layers:
        out += [Linear(MLP, h, dense_width, 2 * dense_layers), Linear(MLP, dense_width, h, dense_layers)]
    if spec.moe is not None and moe_layers:
        moe = spec.moe
        e, width = moe.num_experts, moe.expert_intermediate_size
        expert_bias = mt == "gpt_oss"
        out += [Linear(EXPERT, h, width, 2 * e * moe_layers, expert_bias),
                Linear(EXPERT, width, h, e * moe_layers, expert_bias),
                Linear(ROUTER, h, e, moe_layers, expert_bias)]
        shared = moe.shared_intermediate_size
        if not shared and mt.startswith("llama4"):
            shared = spec.intermediate_size  # Llama 4: one shared expert as wide as a routed one
        if shared:
            out += [Linear(SHARED_EXPERT, h, shared, 2 * moe_layers),
                    Linear(SHARED_EXPERT, shared, h, moe_layers)]
            if "shared_expert_intermediate_size" in raw:  # Qwen2-MoE / Qwen3-Next shared-expert gate
                out.append(Linear(ROUTER, h, 1, moe_layers))
        if mt.startswith(("deepseek", "kimi")):
            out.append(Plain(OTHER, e, moe_layers, 4))  # e_score_correction_bias, float32
    return out


def _skip_roles(patterns: Any) -> frozenset[str]:
    """Linear roles named by a modules_to_not_convert / ignore list (module-name patterns)."""
    if not isinstance(patterns, list):
        return frozenset()
    roles: set[str] = set()
    for pattern in patterns:
        text = str(pattern)
        if "attn" in text:
            roles.add(ATTENTION)
        if "shared_expert" in text:
            roles.add(SHARED_EXPERT)
        elif "experts" in text:
            roles.add(EXPERT)
        if text.endswith(("mlp", "mlp.*")) or ".mlp." in text and "proj" in text:
            roles.add(MLP)
    return frozenset(roles)


def quant_from_config(spec: ModelSpec, weight_format: str) -> Quant | None:
    """How the checkpoint (or vLLM at load time) quantises the linear layers.

    Args:
        spec: the parsed config; its ``quantization_config`` is read when present.
        weight_format: the plan's weight format (bf16, fp16, fp8, awq, gptq,
            nvfp4, mxfp4, bitsandbytes).
    Returns:
        the storage rule, or None for a 16-bit model.
    Raises:
        PlanError: a quantisation_config the planner cannot size (bits other
            than 4/8, a bitsandbytes 4-bit type other than nf4/fp4).
    """
    qc = spec.raw.get("quantization_config")
    qc = qc if isinstance(qc, Mapping) else {}
    field = "vllm_model.config.quantization_config"
    if weight_format in ("bf16", "fp16"):
        return None
    skip = _skip_roles(qc.get("modules_to_not_convert") or qc.get("ignore"))
    if qc.get("quant_method") == "compressed-tensors":
        return _compressed_tensors(qc, skip)
    if weight_format in ("awq", "gptq"):
        bits = int(qc.get("bits") or qc.get("w_bit") or 4)
        if bits not in (4, 8):
            raise PlanError(f"{field}.bits", bits,
                            "the planner sizes 4- and 8-bit AWQ/GPTQ checkpoints; give weight_bytes or "
                            "the checkpoint's safetensors index instead")
        group = int(qc.get("group_size") or qc.get("q_group_size") or 128)
        return Quant(weight_format, bits=bits, group_size=group,
                     zero_points=bool(qc.get("zero_point", True)) or weight_format == "gptq",
                     g_idx=weight_format == "gptq", skip=skip)
    if weight_format == "fp8":
        block = qc.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2:
            return Quant("fp8", bits=8, block=(int(block[0]), int(block[1])), skip=skip)
        return Quant("fp8", bits=8, skip=skip)  # per-channel or per-tensor scales
    if weight_format == "mxfp4":
        return Quant("mxfp4", bits=4, group_size=32,
                     skip=frozenset({ATTENTION, MLP, SHARED_EXPERT}))
    if weight_format == "nvfp4":
        return Quant("nvfp4", bits=4, group_size=16, skip=skip)
    if weight_format == "bitsandbytes":
        if qc.get("load_in_8bit"):
            return Quant("bnb8", bits=8, skip=skip)
        kind = qc.get("bnb_4bit_quant_type", "nf4")
        if kind not in ("nf4", "fp4"):
            raise PlanError(f"{field}.bnb_4bit_quant_type", kind,
                            "the planner sizes nf4 and fp4 bitsandbytes checkpoints; use an AWQ/GPTQ "
                            "checkpoint of the model or give weight_bytes")
        return Quant("bnb4", bits=4, group_size=64,
                     double_quant=bool(qc.get("bnb_4bit_use_double_quant")), skip=skip)
    raise AssertionError(weight_format)


def _compressed_tensors(qc: Mapping[str, Any], skip: frozenset[str]) -> Quant:
    """The storage rule of a compressed-tensors (llm-compressor) checkpoint's first config group.

    Raises:
        PlanError: no config group with weight settings, or a scheme not sized here.
    """
    field = "vllm_model.config.quantization_config.config_groups"
    groups = qc.get("config_groups")
    first = next(iter(groups.values()), None) if isinstance(groups, Mapping) and groups else None
    weights = first.get("weights") if isinstance(first, Mapping) else None
    if not isinstance(weights, Mapping):
        raise PlanError(field, groups, "a compressed-tensors config needs config_groups.*.weights; "
                        "give weight_bytes or the checkpoint's safetensors index instead")
    bits = int(weights.get("num_bits") or 0)
    kind = weights.get("type", "int")
    if kind == "float" and bits == 8:
        return Quant("fp8", bits=8, skip=skip)
    if kind == "float" and bits == 4:
        return Quant("nvfp4", bits=4, group_size=16, skip=skip)
    if kind == "int" and bits in (4, 8):
        group = weights.get("group_size")
        return Quant("pack", bits=bits, group_size=int(group) if group else -1,
                     zero_points=not weights.get("symmetric", True), skip=skip)
    raise PlanError(field, dict(weights), "the planner sizes int4/int8 and fp8/fp4 compressed-tensors "
                    "weights; give weight_bytes or the checkpoint's safetensors index instead")


def _quantised_linear_bytes(lin: Linear, q: Quant) -> int:
    """Bytes of ONE quantised matrix of ``lin`` in storage ``q`` (scales, zeros, indexes included)."""
    i, o = lin.in_features, lin.out_features
    values = i * o
    if q.method in ("awq", "gptq", "pack"):
        groups = 1 if q.group_size <= 0 else cdiv(i, q.group_size)
        size = values * q.bits // 8 + groups * o * 2            # packed values + 16-bit scales
        if q.method == "pack":
            size += 16                                           # int64 weight_shape
        if q.zero_points:
            size += groups * o * q.bits // 8                     # packed zeros
        if q.g_idx:
            size += i * 4                                        # int32 group index per input channel
        return size
    if q.method == "fp8":
        if q.block is not None:
            return values + cdiv(o, q.block[0]) * cdiv(i, q.block[1]) * 4
        return values + o * 4
    if q.method == "mxfp4":
        return values // 2 + cdiv(values, 32)
    if q.method == "nvfp4":
        return values // 2 + cdiv(values, 16) + 8
    if q.method == "bnb4":
        blocks = cdiv(values, 64)
        absmax = blocks + cdiv(blocks, 256) * 4 + 256 * 4 if q.double_quant else blocks * 4
        return values // 2 + absmax
    if q.method == "bnb8":
        return values + o * 4
    raise AssertionError(q.method)


def estimate_weights(spec: ModelSpec, quant: Quant | None) -> WeightEstimate:
    """Bytes of the model's weights as vLLM loads them, from the config alone.

    16-bit tensors count 2 bytes (vLLM's dtype "auto" also serves float32
    checkpoints in 16 bits); quantised linear layers count their packed
    values plus scales, zeros and indexes (module docstring).

    Args:
        spec: the parsed config.
        quant: the storage rule from :func:`quant_from_config` (None: 16-bit).
    Returns:
        the estimate, whole model (TP = 1).
    """
    total = params = q_params = q_bytes = 0
    for t in tensor_layout(spec):
        if isinstance(t, Plain):
            total += t.numel * t.count * t.elem_bytes
            params += t.numel * t.count
            continue
        values = t.in_features * t.out_features
        bias = t.out_features * 2 if t.bias else 0
        params += (values + (t.out_features if t.bias else 0)) * t.count
        quantised = quant is not None and t.role in QUANTISED_ROLES and t.role not in quant.skip
        if quant is not None and quant.method == "mxfp4":
            quantised = t.role == EXPERT
        if quantised:
            assert quant is not None
            size = _quantised_linear_bytes(t, quant)
            q_params += values * t.count
            q_bytes += size * t.count
        else:
            size = values * 2
        total += (size + bias) * t.count
    return WeightEstimate(total_bytes=total, params=params, quantised_params=q_params,
                          quantised_bytes=q_bytes, method=quant.method if quant else "16-bit")


def _round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def mxfp4_moe_backend(compute_cap: tuple[int, int]) -> str:
    """The MXFP4 MoE kernel vLLM picks by default on a GPU of ``compute_cap``.

    vLLM ``model_executor/layers/quantization/mxfp4.py`` ``get_mxfp4_backend``
    (main at commit 007d5005, the 0.1x line; the FlashInfer SM90 and CUTLASS
    paths need opt-in variables and are not modelled): compute capability 10.x
    with FlashInfer -> ``flashinfer`` (SM100_FI_MXFP4_BF16); 9.0 up to 11.0 with
    triton_kernels -> ``triton``; every other CUDA GPU (Ampere, Ada, 12.x
    Blackwell workstation cards) -> ``marlin``.

    Args:
        compute_cap: (major, minor).
    Returns:
        "marlin", "triton" or "flashinfer".
    """
    if compute_cap[0] == 10:
        return "flashinfer"
    if (9, 0) <= compute_cap < (11, 0):
        return "triton"
    return "marlin"


def mxfp4_padding_bytes_per_rank(spec: ModelSpec, tensor_parallel_size: int, compute_cap: tuple[int, int]) -> int:
    """Bytes one tensor-parallel rank loads beyond its share of an MXFP4 checkpoint's experts.

    vLLM ``Mxfp4MoEMethod.create_weights`` (mxfp4.py, commit 007d5005) pads each
    rank's expert matrices before loading into them: the intermediate size per
    partition (``I / TP``) is rounded up to 128 for Marlin, 256 for FlashInfer on
    SM100 and 64 otherwise; the hidden size to 256 for Marlin and FlashInfer.
    Each expert then holds ``w13`` [2 I', H' / 2] uint8 with [2 I', H' / 32]
    scales and a [2 I'] bf16 bias, and ``w2`` [H', I' / 2] with [H', I' / 32]
    scales and an [H'] bf16 bias (``w2``'s bias is not split by TP). Triton's
    later swizzle (``_swizzle_mxfp4``) may pad further; that is not modelled.

    Args:
        spec: the parsed config (an MoE model).
        tensor_parallel_size: GPUs the experts are split across.
        compute_cap: the GPU's (major, minor), which picks the kernel (:func:`mxfp4_moe_backend`).
    Returns:
        padded per-rank expert bytes minus the unpadded expert bytes / TP (0 for a dense model).
    """
    moe = spec.moe
    if moe is None:
        return 0
    moe_layers = sum(1 for i in range(spec.num_layers) if _moe_layer(spec, i))
    h, width, tp = spec.hidden_size, moe.expert_intermediate_size, tensor_parallel_size
    backend = mxfp4_moe_backend(compute_cap)
    i_align, h_align = {"marlin": (128, 256), "flashinfer": (256, 256), "triton": (64, 1)}[backend]
    ip, hp = _round_up(width // tp, i_align), _round_up(h, h_align)

    def expert_bytes(i: int, hh: int) -> int:
        w13 = 2 * i * hh // 2 + 2 * i * hh // 32 + 2 * i * 2
        w2 = hh * i // 2 + hh * i // 32 + hh * 2
        return w13 + w2

    padded = expert_bytes(ip, hp)
    share = expert_bytes(width, h) / tp
    return max(0, int((padded - share) * moe.num_experts * moe_layers))


def estimate_params(spec: ModelSpec) -> int:
    """Parameters of the model counted from its config (:func:`tensor_layout`), whole model."""
    return estimate_weights(spec, None).params


def estimate_from_params(spec: ModelSpec, quant: Quant | None, params: int) -> int:
    """Weight bytes for a stated parameter count, laid out as the config says.

    The config fixes the unquantised parts (embeddings, norms, routers,
    lm_head); the rest of ``params`` is stored at the format's quantised rate,
    so a 4-bit 8B model is not sized as if its embeddings were 4-bit too.

    Args:
        spec: the parsed config; quant: as for :func:`estimate_weights`.
        params: the model card's total parameter count.
    Returns:
        bytes, whole model.
    Raises:
        PlanError: ``params`` differs from the config's own count by more than
            a factor of 2 (a typo, or the count of another model).
    """
    est = estimate_weights(spec, quant)
    if not 0.5 <= params / est.params <= 2.0:
        raise PlanError("vllm_model.params", params,
                        f"the config.json describes about {est.params:.3g} parameters; give the "
                        "model card's total count for this config, or drop params to use the config's")
    fixed_params = est.params - est.quantised_params
    fixed_bytes = est.total_bytes - est.quantised_bytes
    if est.quantised_params == 0:
        return int(est.total_bytes * params / est.params)
    rate = est.quantised_bytes / est.quantised_params
    return int(fixed_bytes + max(0, params - fixed_params) * rate)


# --- the checkpoint's own size -------------------------------------------------------------------

def _weight_file(path: str) -> bool:
    """A file vLLM loads weights from (``*.safetensors``, not under ``original/`` or consolidated)."""
    name = path.rsplit("/", 1)[-1]
    return (name.endswith(".safetensors") and not path.startswith("original/")
            and not name.startswith("consolidated"))


def checkpoint_total(checkpoint: Mapping[str, Any]) -> tuple[int, str]:
    """The checkpoint's weight bytes and where they were read from.

    Accepts, in ``vllm_model.checkpoint``:
      * ``{"total_size": N}`` — bytes already read (e.g. by the vllm role's
        ``vllm_hf_snapshot`` module);
      * ``{"index": <model.safetensors.index.json>}`` — its ``metadata.total_size``;
      * ``{"files": {path: bytes, ...}}`` — the ``*.safetensors`` files' sizes
        (their few-KiB JSON headers included);
      * ``{"tree": <hub tree listing>}`` — the hub API's ``/tree`` list
        (``[{"type": "file", "path", "size"}, ...]``) or huggingface_hub's cached
        ``trees/<commit>.json`` (``{"format_version": 1, "files": {path: {"size"}}}``).
    Optional ``origin`` (e.g. "hub", "local HF cache") and ``revision`` are
    named in the returned source.

    Returns:
        (bytes, source text).
    Raises:
        PlanError: none of the forms, or no safetensors weights in it.
    """
    where = "vllm_model.checkpoint"
    if not isinstance(checkpoint, Mapping):
        raise PlanError(where, checkpoint, "give a mapping with total_size, index, files or tree")
    origin = str(checkpoint.get("origin") or "given")
    revision = str(checkpoint.get("revision") or "")
    at = f" @{revision[:12]}" if revision else ""
    if checkpoint.get("total_size") is not None:
        total, how = checkpoint["total_size"], str(checkpoint.get("source") or "total_size")
    elif checkpoint.get("index") is not None:
        index = checkpoint["index"]
        meta = index.get("metadata") if isinstance(index, Mapping) else None
        total = meta.get("total_size") if isinstance(meta, Mapping) else None
        how = "safetensors index metadata.total_size"
        where += ".index.metadata.total_size"
    else:
        files = checkpoint.get("files")
        tree = checkpoint.get("tree")
        if isinstance(tree, Mapping) and isinstance(tree.get("files"), Mapping):
            files = {p: (v or {}).get("size") for p, v in tree["files"].items() if isinstance(v, Mapping)}
        elif isinstance(tree, list):
            files = {e.get("path"): e.get("size") for e in tree
                     if isinstance(e, Mapping) and e.get("type", "file") == "file"}
        if not isinstance(files, Mapping):
            raise PlanError(where, dict(checkpoint),
                            "give total_size, index (model.safetensors.index.json), files "
                            "({path: bytes}) or tree (the hub's file listing)")
        sizes = [v for p, v in files.items() if _weight_file(str(p))]
        if not sizes or not all(isinstance(v, int) and v > 0 for v in sizes):
            raise PlanError(where + ".files", sorted(map(str, files))[:5],
                            "no *.safetensors weights with sizes; vLLM serves safetensors checkpoints "
                            "only here, give weight_bytes otherwise")
        total, how = sum(sizes), f"{len(sizes)} safetensors files"
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise PlanError(where, total, "must be the checkpoint's size in bytes, a whole number > 0")
    return total, f"checkpoint: {how} ({origin}{at})"


def read_checkpoint_file(text: str) -> dict[str, Any]:
    """Turn the text of a saved index or hub tree listing into a ``vllm_model.checkpoint`` mapping.

    Args:
        text: a ``model.safetensors.index.json``, the hub API's tree listing
            (JSON list) or huggingface_hub's ``trees/<commit>.json``.
    Returns:
        ``{"index": ...}`` or ``{"tree": ...}``.
    Raises:
        PlanError: not JSON, or none of these shapes.
    """
    try:
        data = json.loads(text)
    except ValueError as err:
        raise PlanError("--checkpoint", str(err)[:60], "give a model.safetensors.index.json or the "
                        "hub's tree listing of the pinned revision (JSON)") from err
    if isinstance(data, Mapping) and "weight_map" in data:
        return {"index": data}
    if isinstance(data, list) or (isinstance(data, Mapping) and "files" in data):
        return {"tree": data}
    raise PlanError("--checkpoint", type(data).__name__,
                    "give a model.safetensors.index.json (with metadata.total_size) or the hub's "
                    "tree listing of the pinned revision")
