"""What a GPU generation supports, by CUDA compute capability.

Sources:
  * vLLM 0.32.0 docs, features/quantization/llm_compressor/fp8: "FP8 computation
    is supported on NVIDIA GPUs with compute capability >= 8.9 (Ada Lovelace,
    Hopper, Blackwell). FP8 models will run on compute capability >= 7.5
    (Turing) as weight-only W8A16, utilizing FP8 Marlin."
  * vLLM docs, features/quantization/quantized_kvcache: FP8 KV cache (fp8 =
    fp8_e4m3, fp8_e5m2) on CUDA; stored in fp8 and dequantised by the attention
    kernel on GPUs without native FP8.
  * vLLM 0.32.0 log text (quantization/utils/marlin_utils_fp4.py): "Your GPU does
    not have native support for FP4 computation ... Weight-only FP4 compression
    will be used leveraging the Marlin kernel" — NVFP4/MXFP4 run natively on
    Blackwell (10.x, 12.x) and weight-only through Marlin from 8.0.
  * NVIDIA CUDA GPUs list: 8.0 A100, 8.6 RTX 30xx/A-series, 8.9 Ada (RTX 40xx,
    L40S, RTX 6000 Ada), 9.0 H100/H200, 10.0 B200, 12.0 RTX 50xx / RTX PRO
    Blackwell.
"""

from __future__ import annotations

from .errors import PlanError

# Native FP8 tensor cores: Ada, Hopper, Blackwell.
FP8_NATIVE_MIN = (8, 9)
# Anything older than Ampere cannot run vLLM 0.32's CUDA attention backends
# with an fp8 KV cache (and has no bf16).
FP8_KV_MIN = (8, 0)

# weight_format -> (minimum compute capability, native from, vLLM --quantization
#                   value for a 16-bit checkpoint it quantises at load time, or
#                   None when the format needs a pre-quantised checkpoint).
# The bytes of each format are teamserve_capacity.weights' (scales, zeros and
# unquantised embeddings included). bitsandbytes: vLLM 0.32
# BitsAndBytesConfig.get_min_capability() is 70.
WEIGHT_FORMATS: dict[str, tuple[tuple[int, int], tuple[int, int], str | None]] = {
    "bf16": ((8, 0), (8, 0), None),
    "fp16": ((7, 0), (7, 0), None),
    "fp8": ((7, 5), FP8_NATIVE_MIN, "fp8"),
    "awq": ((7, 5), (7, 5), None),
    "gptq": ((7, 5), (7, 5), None),
    "nvfp4": ((8, 0), (10, 0), None),
    "mxfp4": ((8, 0), (10, 0), None),
    "bitsandbytes": ((7, 0), (7, 0), "bitsandbytes"),
}

# vLLM --quantization names that a pre-quantised checkpoint's
# quantization_config.quant_method maps to (vLLM 0.32 QUANTIZATION_METHODS),
# with the weight formats such a checkpoint can be.
QUANT_METHOD_FLAG: dict[str, str] = {
    "fp8": "fp8",
    "awq": "awq",
    "gptq": "gptq",
    "mxfp4": "mxfp4",
    "modelopt": "modelopt",
    "modelopt_fp4": "modelopt_fp4",
    "compressed-tensors": "compressed-tensors",
    "bitsandbytes": "bitsandbytes",
}
QUANT_METHOD_FORMATS: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8",),
    "awq": ("awq",),
    "gptq": ("gptq",),
    "mxfp4": ("mxfp4",),
    "modelopt": ("fp8",),
    "modelopt_fp4": ("nvfp4",),
    "compressed-tensors": ("fp8", "gptq", "awq", "nvfp4"),
    "bitsandbytes": ("bitsandbytes",),
}


def parse_compute_cap(value: object, field: str) -> tuple[int, int]:
    """Parse nvidia-smi's ``compute_cap`` ("12.0") into (12, 0).

    Raises:
        PlanError: the value is not "MAJOR.MINOR".
    """
    text = str(value)
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise PlanError(field, value,
                        'give the compute capability as nvidia-smi prints it, e.g. "12.0"')
    return int(parts[0]), int(parts[1])


def fp8_kv_support(cap: tuple[int, int]) -> str:
    """How an fp8 KV cache runs on a GPU of compute capability ``cap``.

    Returns:
        "native" (>= 8.9: FP8 tensor cores), "emulated" (8.0-8.8: stored in
        fp8, dequantised in the kernel) or "unsupported" (< 8.0).
    """
    if cap >= FP8_NATIVE_MIN:
        return "native"
    if cap >= FP8_KV_MIN:
        return "emulated"
    return "unsupported"
