"""Per-GPU memory budget, the way vLLM 0.32.0 sizes its KV cache.

vLLM 0.32 ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory`` and
``vllm/utils/mem_utils.py`` ``memory_profiling``::

    requested  = ceil(total_memory x gpu_memory_utilization)      (worker/utils.request_memory)
    available  = requested - non_kv_cache_memory - cudagraph_estimate
    non_kv_cache_memory = total_consumed + transient_peak_headroom
    total_consumed      = free memory at start-up - free memory after profiling
                          (weights + non-torch memory + persistent buffers)
    transient_peak_headroom = torch peak - torch allocated after the profile run

The worker (``gpu_worker.py``) is shared by both model runners; vLLM 0.32.0
runs the V2 model runner (``vllm/v1/worker/gpu/model_runner.py``) on CUDA
unless a feature it lacks is asked for (``config/vllm.py``
``VllmConfig.use_v2_model_runner``: Triton present, none of
``_get_v2_model_runner_unsupported_features``, e.g. suffix/medusa
speculative decoding; ``VLLM_USE_V2_MODEL_RUNNER=0`` forces V1,
``gpu_model_runner.py``). Below, "V2" names that file and its
``cudagraph_utils.py``/``sample/`` neighbours, "V1" the older runner.

The profile run (V2 ``GPUModelRunner.profile_run``, and V1's alike) is one
forward pass of ``max_num_batched_tokens`` dummy tokens split over
``min(tokens, max_num_seqs)`` requests (``_dummy_run``), followed by
``_dummy_sampler_run`` on one row per request; the transient peak is the
larger of the two phases (the forward's activations are freed before the
sampler runs; the forward's output hidden states stay alive). vLLM then logs
"Available KV cache memory: X GiB". The CUDA-graph estimate
(``profile_cudagraph_memory``) is subtracted by default since v0.21
(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS).

The estimates below are read off that source; the two constants that are not
(non-torch memory, per-graph cost) come from published start-up logs, named at
each. A measured start-up log (see :mod:`teamserve_capacity.logs`) overrides
every one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .kv import cdiv
from .model import ModelSpec

GIB = 1024 ** 3
MIB = 1024 ** 2

# Non-torch memory counted by the profiler: everything the process allocates
# outside PyTorch's allocator after the start-up snapshot (cuBLAS/cuDNN
# handles, lazily loaded kernel modules; the CUDA context itself predates the
# snapshot). Measured: 0.13-0.14 GiB on H100 with the V1 engine (llm-d
# llm-d-benchmark config_explorer/empirical-vllm-memory-results.md, five
# models), 0.35 GiB on an RTX 3090 (vLLM issue #10517), 0.25 GiB on RTX 4090s
# (issue #13061); the estimate takes the middle.
NON_TORCH_BYTES_TP1 = int(0.25 * GIB)
# Tensor parallelism adds NCCL's buffers, which NCCL allocates per peer
# connection (NCCL docs, NCCL_BUFFSIZE), and the custom all-reduce buffers:
# +0.42 GiB at TP=2 on H100 (same llm-d log, Llama-3.3-70B-FP8: 0.55 vs 0.13
# GiB), so +0.42 GiB per additional rank.
NON_TORCH_BYTES_PER_EXTRA_RANK = int(0.42 * GIB)


def non_torch_bytes(tensor_parallel_size: int) -> int:
    """Estimated non-torch memory per GPU, bytes (see the constants' sources)."""
    return NON_TORCH_BYTES_TP1 + (tensor_parallel_size - 1) * NON_TORCH_BYTES_PER_EXTRA_RANK


# CUDA-graph estimate, shaped like vLLM 0.32's V2 profile_cudagraph_memory
# (v1/worker/gpu/cudagraph_utils.py): PIECEWISE graphs are all captured and
# measured, FULL ones extrapolated from the two largest as first capture +
# (graphs - 1) x max(second capture, 1 MiB), both in one pool, so the first
# captures of the two modes overlay (max) and the per-graph costs add; V1's
# (gpu_model_runner.py) extrapolates both modes the same way. The first capture
# holds one forward's activations for the largest capture size; the per-graph
# cost per layer is calibrated on V1's "Profiling CUDA graph memory:
# PIECEWISE=3 (largest=16), FULL=2 (largest=8)" -> "Estimated CUDA graph memory:
# 0.09 GiB total" for a 64-layer model (noonghunna/club-3090 issue #434): 92 MiB
# / 5 graphs / 64 layers (no V2 log with a known model was found).
CUDAGRAPH_BYTES_PER_GRAPH_LAYER = int(0.29 * MIB)
# vLLM 0.32 config/vllm.py _set_cudagraph_sizes: capture sizes up to
# min(2 x max_num_seqs, 512, max_num_batched_tokens) (1024 instead of 512 on
# compute capability 10.x, which no card of the GPU table is): 1, 2, 4, then
# steps of 8 below 256 and of 16 above, plus max_num_batched_tokens when it is
# the cap and max_num_seqs (the widest decode batch) when it is off that grid;
# FULL graphs for decode batches up to max_num_seqs (V2 ModelCudaGraphManager
# _init_candidates), PIECEWISE graphs for every size.
CUDAGRAPH_MAX_CAPTURE = 512

# Bytes per logit (rows x vocabulary) live at the peak of the profile run's
# sampler phase. vLLM 0.32's V2 runner (the CUDA default): _dummy_sampler_run ->
# Sampler.__call__ (v1/worker/gpu/sample/sampler.py) on a dummy batch whose
# requests were never added, so apply_sampling_params returns the logits
# untouched (no float32 copy), top-k/top-p are off and gumbel_sample
# (sample/gumbel.py) reduces in place into per-1,024-logit partials (12 bytes
# each, 0.6 % of a bf16 row, left out): only the model-dtype logits
# compute_logits returns (2).
SAMPLER_BYTES_PER_LOGIT = 2
# The same run on vLLM 0.32's V1 runner: _dummy_sampler_run
# (gpu_model_runner.py) -> Sampler.forward (v1/sample/sampler.py) ->
# TopKTopPSampler (v1/sample/ops/topk_topp_sampler.py): the model-dtype logits
# (2, held by the caller), their float32 copy (4; temperature, top-k and top-p
# work in place on it: Triton apply_top_k_top_p_triton, or FlashInfer's
# top_k_top_p_sampling_from_logits), the float32 softmax probabilities (4) and
# random_sample's exponential noise (4, empty_like(probs)).
V1_SAMPLER_BYTES_PER_LOGIT = 14
# The same run before the Triton top-k/top-p kernel (V0, and V1 up to the
# releases the benchmark's "v1" cases come from): apply_top_k_top_p_pytorch
# sorts the float32 logits, which holds the model-dtype logits (2) and float32
# copy (4), the sorted values (4) and int64 indices (8), and inside torch.sort
# (PyTorch aten/src/ATen/native/cuda/SortStable.cu segmented_sort_pairs) an int64
# iota of every position (8) plus cub's segmented-sort double buffer for keys
# and values (4 + 8). Used by the benchmark for logs of those releases.
SORT_SAMPLER_BYTES_PER_LOGIT = 38


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int | None = None) -> list[int]:
    """The batch sizes (tokens) vLLM 0.32 captures CUDA graphs for by default.

    ``config/vllm.py`` ``VllmConfig._set_cudagraph_sizes`` without
    speculative decoding (one query token per decode request).

    Args:
        max_num_seqs: --max-num-seqs.
        max_num_batched_tokens: --max-num-batched-tokens, tokens; None: the
            grid up to ``min(2 x max_num_seqs, 512)`` alone, without the
            token cap and the two extra sizes.
    Returns:
        the sizes, ascending, each once.
    """
    grid_top = min(2 * max_num_seqs, CUDAGRAPH_MAX_CAPTURE)
    top = grid_top if max_num_batched_tokens is None else min(grid_top, max_num_batched_tokens)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens is not None:
        if max_num_batched_tokens <= top:
            sizes.append(max_num_batched_tokens)
        # The widest decode batch, compared with the cap before max_num_batched_tokens lowers it.
        if max_num_seqs <= grid_top and max_num_seqs <= max_num_batched_tokens:
            sizes.append(max_num_seqs)
    return sorted(set(sizes))


def cudagraph_bytes(spec: ModelSpec, tensor_parallel_size: int, max_num_seqs: int, act_bytes: int,
                    max_num_batched_tokens: int | None = None) -> int:
    """Estimated CUDA-graph memory vLLM 0.32 deducts from the KV budget.

    Follows ``profile_cudagraph_memory`` (vLLM 0.32 V2
    ``v1/worker/gpu/cudagraph_utils.py``; see
    :data:`CUDAGRAPH_BYTES_PER_GRAPH_LAYER`):
    ``max(first capture per mode) + sum over modes of per_graph x (graphs - 1)``.
    The first capture holds one forward's activations for the largest capture
    size (:func:`activation_bytes_per_token`); the per-graph cost is
    :data:`CUDAGRAPH_BYTES_PER_GRAPH_LAYER` per decoder layer.

    Args:
        spec: the model.
        tensor_parallel_size: GPUs per model copy.
        max_num_seqs: --max-num-seqs (sets the capture sizes).
        act_bytes: bytes per activation element.
        max_num_batched_tokens: --max-num-batched-tokens (caps the capture
            sizes, :func:`cudagraph_capture_sizes`); None: not applied.
    Returns:
        bytes per GPU.
    """
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens)
    piecewise = len(sizes)
    full = len([s for s in sizes if s <= max_num_seqs])
    first = max(sizes) * activation_bytes_per_token(spec, tensor_parallel_size, act_bytes)
    further = max(piecewise - 1, 0) + max(full - 1, 0)
    return first + further * spec.num_layers * CUDAGRAPH_BYTES_PER_GRAPH_LAYER


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
        total_bytes: memory the CUDA runtime reports (the GPU table's figure,
            nvidia-smi's total minus a reservation, or measured).
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


def activation_bytes_per_token(spec: ModelSpec, tensor_parallel_size: int, act_bytes: int, *,
                               eager: bool = False) -> int:
    """Peak live activation bytes one batched token costs in a forward pass.

    The largest transient of a decoder layer is its MLP. vLLM 0.32
    ``llama.py`` ``LlamaMLP.forward``: ``gate_up_proj`` (2 x I / TP) ->
    ``act_fn`` (SiluAndMul, I / TP) -> ``down_proj`` (H), beside the residual
    stream (H). Under torch.compile (the default; the profile run executes the
    compiled piecewise graphs) a buffer is freed after its last use, so the
    peak is at the activation: residual + gate_up + product = H + 3 x I / TP.
    Run eagerly the caller still holds the normed input and the old V0
    ``LlamaMLP`` kept ``gate_up`` referenced until it returned, so the peak is
    at ``down_proj``: residual + normed input + gate_up + product + output =
    3 x H + 3 x I / TP (this reproduces the 2.07 and 2.99 GiB V0 logged for
    Llama-3.1-8B at 20,000 and 29,000 tokens, vLLM issue #10517, to 0.01 GiB).

    MoE layers (vLLM 0.32 ``fused_moe.py`` ``fused_experts_impl``): the shared
    ``cache13`` of ``top_k x max(2 x N, H)`` and ``intermediate_cache2`` of
    ``top_k x N`` per token (N = expert intermediate / TP), beside the layer's
    input and output (2 x H); shared experts add a dense MLP (3 x S / TP).

    Args:
        spec: the model.
        tensor_parallel_size: GPUs the MLP/attention are split across.
        act_bytes: bytes per activation element (2 for bf16/fp16).
        eager: the model runs uncompiled (V0 / --enforce-eager).
    Returns:
        bytes per token.
    """
    tp = tensor_parallel_size
    h = spec.hidden_size
    residual_and_input = 3 * h if eager else h
    dense = residual_and_input + 3 * spec.intermediate_size // tp
    per_token = dense if (spec.moe is None or spec.moe.first_dense_layers) else 0
    if spec.moe is not None:
        n = spec.moe.expert_intermediate_size // tp
        moe = (2 * h + spec.moe.experts_per_token * (max(2 * n, h) + n)
               + 3 * spec.moe.shared_intermediate_size // tp)
        per_token = max(per_token, moe)
    return per_token * act_bytes


def sampler_peak_bytes(spec: ModelSpec, *, max_num_batched_tokens: int, max_num_seqs: int,
                       act_bytes: int, bytes_per_logit: int = SAMPLER_BYTES_PER_LOGIT) -> int:
    """Peak bytes of the profile run's sampler phase.

    ``profile_run`` keeps the forward's output hidden states (tokens x H) while
    ``_dummy_sampler_run`` samples one row per dummy request
    (``min(tokens, max_num_seqs)`` rows, vLLM 0.32 V2 ``_dummy_run``) over the
    whole vocabulary (logits are all-gathered, so every TP rank holds all of
    them): rows x vocab x :data:`SAMPLER_BYTES_PER_LOGIT`.

    Args:
        spec: the model.
        max_num_batched_tokens: tokens of the profiling forward pass.
        max_num_seqs: --max-num-seqs.
        act_bytes: bytes per activation element.
        bytes_per_logit: :data:`SAMPLER_BYTES_PER_LOGIT` (2) for vLLM 0.32's
            V2 runner; :data:`V1_SAMPLER_BYTES_PER_LOGIT` (14) for its V1
            runner; the benchmark passes :data:`SORT_SAMPLER_BYTES_PER_LOGIT`
            for older releases.
    Returns:
        bytes per GPU.
    """
    rows = min(max_num_batched_tokens, max_num_seqs)
    return max_num_batched_tokens * spec.hidden_size * act_bytes + rows * spec.vocab_size * bytes_per_logit


def profile_peak_bytes(spec: ModelSpec, *, tensor_parallel_size: int, max_num_batched_tokens: int,
                       max_num_seqs: int, act_bytes: int, eager: bool = False,
                       bytes_per_logit: int = SAMPLER_BYTES_PER_LOGIT) -> int:
    """The profile run's transient peak: max(forward, sampler phase), bytes.

    The two phases do not overlap (``profile_run`` runs the forward, frees its
    activations, then runs the sampler), so vLLM's ``transient_peak_headroom``
    is the larger one. At vLLM's defaults on an 80 GB card (8,192 tokens,
    1,024 sequences) the sampler phase dominates: with that release's sort
    path (:data:`SORT_SAMPLER_BYTES_PER_LOGIT`) this reproduces the 4.76,
    5.56, 5.64 and 7.38 GiB "peak activation" the llm-d vLLM 0.11 H100 logs
    show for Llama-3.1-8B, Qwen3-0.6B, Qwen3-32B and gpt-oss-20b within 1.1 %
    (benchmarks/capacity).

    Args:
        spec: the model.
        tensor_parallel_size: GPUs per model copy.
        max_num_batched_tokens: tokens of the profiling forward pass.
        max_num_seqs: --max-num-seqs.
        act_bytes: bytes per activation element.
        eager: see :func:`activation_bytes_per_token`.
        bytes_per_logit: see :func:`sampler_peak_bytes`.
    Returns:
        bytes per GPU.
    """
    forward = max_num_batched_tokens * activation_bytes_per_token(spec, tensor_parallel_size, act_bytes,
                                                                  eager=eager)
    sampler = sampler_peak_bytes(spec, max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs, act_bytes=act_bytes,
                                 bytes_per_logit=bytes_per_logit)
    return max(forward, sampler)


def estimate_budget(spec: ModelSpec, *, total_bytes: int, total_source: str, gpu_memory_utilization: float,
                    weights_bytes_total: int, weights_source: str, tensor_parallel_size: int,
                    max_num_batched_tokens: int, max_num_seqs: int,
                    measured: Measured | None = None) -> Budget:
    """Per-GPU KV budget: requested - weights - non-torch - activation - graphs.

    Args:
        spec: the model.
        total_bytes: GPU memory as vLLM sees it (torch.cuda.mem_get_info's total), bytes
            (:func:`teamserve_capacity.gpus.vllm_total`).
        total_source: where ``total_bytes`` comes from, for the report.
        gpu_memory_utilization: vLLM's --gpu-memory-utilization, 0 < x <= 1.
        weights_bytes_total: all weights of the model, bytes (split over TP).
        weights_source: where the weights come from (checkpoint, given, params, estimated), for the report.
        tensor_parallel_size: GPUs per model copy.
        max_num_batched_tokens: tokens of vLLM's profiling forward pass.
        max_num_seqs: rows of the sampler's dummy run and the CUDA-graph capture sizes.
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
        total = total_bytes
        sources["total"] = total_source
    requested = math.ceil(total * gpu_memory_utilization)
    act_elem = 2 if spec.dtype != "float32" else 4

    def pick(name: str, value: int | None, estimate: int, est_source: str = "estimated") -> int:
        """The measured bytes if given, else the estimate; records which in ``sources``."""
        if value is not None:
            sources[name] = "measured"
            return value
        sources[name] = est_source
        return estimate

    weights = pick("weights", m.weights_bytes, cdiv(weights_bytes_total, tensor_parallel_size),
                   weights_source)
    non_torch = pick("non_torch", m.non_torch_bytes, non_torch_bytes(tensor_parallel_size))
    activation = pick("activation", m.activation_bytes,
                      profile_peak_bytes(spec, tensor_parallel_size=tensor_parallel_size,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs, act_bytes=act_elem))
    graphs = pick("cudagraph", m.cudagraph_bytes,
                  cudagraph_bytes(spec, tensor_parallel_size, max_num_seqs, act_elem, max_num_batched_tokens))
    if m.kv_cache_bytes is not None:
        kv = m.kv_cache_bytes
        sources["kv_budget"] = "measured"
    else:
        kv = requested - weights - non_torch - activation - graphs
        sources["kv_budget"] = "computed"
    return Budget(total_bytes=total, requested_bytes=requested, weights_bytes=weights,
                  non_torch_bytes=non_torch, activation_bytes=activation, cudagraph_bytes=graphs,
                  kv_budget_bytes=kv, sources=sources)

