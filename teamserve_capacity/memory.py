"""Per-GPU memory budget, the way vLLM 0.32.0 sizes its KV cache.

vLLM 0.32 ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``::

    requested  = ceil(total_memory x gpu_memory_utilization)      (utils.request_memory)
    available  = requested - non_kv_cache_memory - cudagraph_estimate
    non_kv_cache_memory = weights + non-torch increase + activation peak
                          (memory_profiling around one profile_run of
                           max_num_batched_tokens dummy tokens)

and logs "Available KV cache memory: X GiB". The CUDA-graph estimate is
subtracted by default since v0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS).

The overhead estimates below come from published start-up logs; a measured
start-up log (see :mod:`teamserve_capacity.logs`) overrides every one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .kv import cdiv
from .model import ModelSpec

GIB = 1024 ** 3
MIB = 1024 ** 2

# nvidia-smi memory.total vs the total torch.cuda.mem_get_info reports (what
# vLLM multiplies by gpu_memory_utilization): H100 80GB 81559 MiB -> 79.22 GiB
# (vLLM PR #10511 log), RTX 3090 24576 MiB -> 23.58 GiB (vLLM issue #10517 log):
# both 0.42 GiB less.
DRIVER_RESERVED_BYTES = 432 * MIB

# Non-torch memory (CUDA context, cuBLAS/cuDNN workspaces) in vLLM's profile:
# 0.25-0.35 GiB on RTX 3090/4090 (vLLM issues #10517, #13061), 1.79 GiB on H100
# (PR #10511); the estimate takes the middle. Tensor parallelism adds NCCL and
# custom all-reduce buffers: +1.79 GiB at TP=2 in the same PR #10511 log.
NON_TORCH_BYTES_TP1 = int(0.75 * GIB)
NON_TORCH_BYTES_TP_EXTRA = int(1.79 * GIB)

# CUDA-graph estimate, shaped like vLLM 0.32 gpu_model_runner.py
# profile_cudagraph_memory: the first (largest) capture's buffers plus a
# per-graph cost for every further graph. The per-graph cost per layer is
# calibrated on "Profiling CUDA graph memory: PIECEWISE=3 (largest=16), FULL=2
# (largest=8)" -> "Estimated CUDA graph memory: 0.09 GiB total" for a 64-layer
# model (noonghunna/club-3090 issue #434): 92 MiB / 5 graphs / 64 layers.
CUDAGRAPH_BYTES_PER_GRAPH_LAYER = int(0.29 * MIB)
# vLLM 0.32 config/vllm.py _set_cudagraph_sizes: capture sizes up to
# min(2 x max_num_seqs, 512) (1024 on compute capability 10.x): 1, 2, 4, then
# steps of 8 below 256 and of 16 above; FULL graphs for decode batches up to
# max_num_seqs, PIECEWISE graphs for every size.
CUDAGRAPH_MAX_CAPTURE = 512


def cudagraph_capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes vLLM 0.32 captures by default for ``max_num_seqs``."""
    top = min(2 * max_num_seqs, CUDAGRAPH_MAX_CAPTURE)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    return sizes


def cudagraph_bytes(spec: ModelSpec, tensor_parallel_size: int, max_num_seqs: int, act_bytes: int) -> int:
    """Estimated CUDA-graph memory vLLM 0.32 deducts from the KV budget.

    Args:
        spec: the model.
        tensor_parallel_size: GPUs per model copy.
        max_num_seqs: --max-num-seqs (sets the capture sizes).
        act_bytes: bytes per activation element.
    Returns:
        bytes: largest capture's activations + per-graph cost x further graphs.
    """
    sizes = cudagraph_capture_sizes(max_num_seqs)
    graphs = len(sizes) + len([s for s in sizes if s <= max_num_seqs])
    first = max(sizes) * activation_bytes_per_token(spec, tensor_parallel_size, act_bytes)
    return first + (graphs - 1) * spec.num_layers * CUDAGRAPH_BYTES_PER_GRAPH_LAYER

# Sampler dummy run: fp32 logits plus one softmax copy for max_num_seqs rows.
SAMPLER_COPIES = 2


@dataclass(frozen=True)
class Measured:
    """Numbers read from a real vLLM start-up log; each overrides an estimate.

    All values in bytes per GPU; ``None`` means "not measured".
    """

    total_memory_bytes: int | None = None
    weights_bytes: int | None = None
    non_torch_bytes: int | None = None
    activation_bytes: int | None = None
    cudagraph_bytes: int | None = None
    kv_cache_bytes: int | None = None


@dataclass(frozen=True)
class Budget:
    """One GPU's memory, bytes.

    Attributes:
        total_bytes: memory the CUDA runtime reports (nvidia-smi total minus
            the driver's reservation, or measured).
        requested_bytes: ``ceil(total x gpu_memory_utilization)``.
        weights_bytes, non_torch_bytes, activation_bytes, cudagraph_bytes:
            the deductions.
        kv_budget_bytes: what is left for the KV cache (may be negative).
        sources: for each deduction, "estimated", "given" or "measured".
    """

    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    non_torch_bytes: int
    activation_bytes: int
    cudagraph_bytes: int
    kv_budget_bytes: int
    sources: dict[str, str] = field(default_factory=dict)


def activation_bytes_per_token(spec: ModelSpec, tensor_parallel_size: int, act_bytes: int) -> int:
    """Peak live activation bytes one batched token costs in a forward pass.

    The largest transient of a decoder layer is the MLP: the fused gate/up
    output (2 x I), the activated product (I) and the residual/normed hidden
    states (about 4 x hidden), plus the QKV output; MoE layers hold
    ``experts_per_token`` expert intermediates per token. This reproduces the
    1.26 GiB "PyTorch activation peak memory" logged for Llama-3-8B at 8,192
    batched tokens (vLLM PR #10511) within 2 %.

    Args:
        spec: the model.
        tensor_parallel_size: GPUs the MLP/attention are split across.
        act_bytes: bytes per activation element (2 for bf16/fp16).
    Returns:
        bytes per token.
    """
    if spec.moe is not None:
        inter = spec.moe.experts_per_token * spec.moe.expert_intermediate_size \
            + spec.moe.shared_intermediate_size
    else:
        inter = spec.intermediate_size
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_token = 3 * inter // tensor_parallel_size + 4 * spec.hidden_size + qkv // tensor_parallel_size
    return per_token * act_bytes


def estimate_budget(spec: ModelSpec, *, memory_total_mib: int, gpu_memory_utilization: float,
                    weights_bytes_total: int, weights_source: str, tensor_parallel_size: int,
                    max_num_batched_tokens: int, max_num_seqs: int,
                    measured: Measured | None = None) -> Budget:
    """Per-GPU KV budget: requested - weights - non-torch - activation - graphs.

    Args:
        spec: the model.
        memory_total_mib: GPU memory as nvidia-smi's memory.total, MiB.
        gpu_memory_utilization: vLLM's --gpu-memory-utilization, 0 < x <= 1.
        weights_bytes_total: all weights of the model, bytes (split over TP).
        weights_source: "given" or "estimated", for the report.
        tensor_parallel_size: GPUs per model copy.
        max_num_batched_tokens: tokens of vLLM's profiling forward pass.
        max_num_seqs: rows of the sampler's dummy run.
        measured: numbers from a real start-up log that replace estimates.
    Returns:
        the budget (kv_budget_bytes may be negative: the model does not fit).
    """
    m = measured or Measured()
    sources: dict[str, str] = {}
    if m.total_memory_bytes is not None:
        total = m.total_memory_bytes
        sources["total"] = "measured"
    else:
        total = memory_total_mib * MIB - DRIVER_RESERVED_BYTES
        sources["total"] = "nvidia-smi"
    requested = math.ceil(total * gpu_memory_utilization)
    act_elem = 2 if spec.dtype != "float32" else 4

    def pick(name: str, value: int | None, estimate: int, est_source: str = "estimated") -> int:
        if value is not None:
            sources[name] = "measured"
            return value
        sources[name] = est_source
        return estimate

    weights = pick("weights", m.weights_bytes, cdiv(weights_bytes_total, tensor_parallel_size),
                   weights_source)
    non_torch = pick("non_torch", m.non_torch_bytes,
                     NON_TORCH_BYTES_TP1 + (NON_TORCH_BYTES_TP_EXTRA if tensor_parallel_size > 1 else 0))
    activation = pick("activation", m.activation_bytes,
                      max_num_batched_tokens * activation_bytes_per_token(spec, tensor_parallel_size, act_elem)
                      + SAMPLER_COPIES * max_num_seqs * spec.vocab_size * 4 // tensor_parallel_size)
    graphs = pick("cudagraph", m.cudagraph_bytes,
                  cudagraph_bytes(spec, tensor_parallel_size, max_num_seqs, act_elem))
    if m.kv_cache_bytes is not None:
        kv = m.kv_cache_bytes
        sources["kv_budget"] = "measured"
    else:
        kv = requested - weights - non_torch - activation - graphs
        sources["kv_budget"] = "computed"
    return Budget(total_bytes=total, requested_bytes=requested, weights_bytes=weights,
                  non_torch_bytes=non_torch, activation_bytes=activation, cudagraph_bytes=graphs,
                  kv_budget_bytes=kv, sources=sources)


def seeds_max_concurrent(vram_bytes: int, weights_bytes: int, overhead_bytes: int,
                         kv_bytes_per_token: int, avg_context_tokens: int) -> int:
    """The seeds' simple form: floor((VRAM - weights - overhead) / (kv_token x avg_context)).

    Source: "Serving an Open Model to Your Whole Team", the capacity model
    (``max_concurrent = (vram - weights - overhead) / (kv_token * avg_context)``).

    Args:
        vram_bytes: GPU memory, bytes.
        weights_bytes: weights, bytes.
        overhead_bytes: CUDA context and activations, bytes.
        kv_bytes_per_token: 2 x layers x kv_heads x head_dim x element bytes.
        avg_context_tokens: average tokens per sequence.
    Returns:
        whole concurrent sequences (0 when nothing is left).
    """
    left = vram_bytes - weights_bytes - overhead_bytes
    if left <= 0:
        return 0
    return left // (kv_bytes_per_token * avg_context_tokens)
