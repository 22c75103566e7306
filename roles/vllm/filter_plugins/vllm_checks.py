"""Input and host checks of the vllm role that run before anything changes.

* ``vllm_weights_source``: where the weights come from — a path inside the engine image/container, or a
  Hugging Face repository pinned to a commit (the role downloads it to the host's HF cache).
* ``vllm_max_model_len``: the ``--max-model-len`` the engine gets, refused above the model's own limit
  (vLLM 0.32 ``vllm/config/model.py`` ``_get_and_verify_max_len`` raises the same at start-up, after
  the old engine is gone, unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).
* ``vllm_cuda_check``: the engine image's CUDA requirement against what the driver supports.
* ``vllm_gpu_holders``: ``nvidia-smi --query-compute-apps`` rows as readable text for error messages.
* ``vllm_ceilings``: the per-request ceilings (output tokens, ``n``, prompts per completions call) from
  the plan, or the admin's values checked against it.
* ``vllm_check_overrides``: ``vllm_flags`` and ``vllm_extra_args`` may not set what the capacity plan or
  the role sets; each refusal names the planner input or role variable to use instead.
* ``vllm_check_exposure``: settings that open the engine beyond the gateway (or log prompts) are refused
  unless ``vllm_allow_unsafe`` names them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

try:  # The pure functions below are unit-tested without Ansible's error type.
    from ansible.errors import AnsibleFilterError
except ImportError:  # pragma: no cover
    AnsibleFilterError = ValueError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Hugging Face repo ids: OWNER/NAME, letters, digits, '-', '_', '.' (huggingface_hub validate_repo_id).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SMI_CUDA = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")
_REQUIRE_CUDA = re.compile(r"^cuda>=(\d+)\.(\d+)$")


def vllm_weights_source(model: Mapping[str, Any]) -> dict[str, Any]:
    """Classify ``vllm_model`` by where its weights come from.

    Input: the model profile (keys ``name`` and optional ``revision``).
    Output: ``{"kind": "local", "path": name}`` for an absolute path (weights inside the image or a
    mounted directory: nothing is downloaded), or ``{"kind": "hub", "repo_id", "revision",
    "cache_subdir": "models--OWNER--NAME"}`` (huggingface_hub's ``repo_folder_name``).
    Raises AnsibleFilterError naming the field, the value and the fix when a repository has no revision
    or a revision that is not a 40-hex commit (a branch or tag moves under a deployed box), when a local
    path carries a revision, or when the name is neither an absolute path nor ``OWNER/NAME``.
    """
    name = str(model.get("name") or "")
    revision = model.get("revision")
    if name.startswith("/"):
        if revision not in (None, ""):
            raise AnsibleFilterError(
                f"vllm_model.revision: '{revision}' is set, but vllm_model.name '{name}' is a path in the "
                "container, which has no revisions; remove vllm_model.revision or use a Hugging Face repo id")
        return {"kind": "local", "path": name}
    if not _REPO_ID.match(name):
        raise AnsibleFilterError(
            f"vllm_model.name: '{name}' is neither a Hugging Face repo id (OWNER/NAME) nor an absolute path "
            "inside the engine container; fix the profile")
    if revision in (None, ""):
        raise AnsibleFilterError(
            f"vllm_model.revision is missing for '{name}': pin the 40-hex commit id you tested (e.g. "
            f"`git ls-remote https://huggingface.co/{name} refs/heads/main`), so every box serves the "
            "same weights")
    if not _COMMIT.match(str(revision)):
        raise AnsibleFilterError(
            f"vllm_model.revision: '{revision}' is not a 40-hex commit id; a branch or tag can move under a "
            f"deployed box. Pin the commit (e.g. `git ls-remote https://huggingface.co/{name} {revision}`)")
    return {"kind": "hub", "repo_id": name, "revision": str(revision),
            "cache_subdir": "models--" + name.replace("/", "--")}


# Flags the capacity plan sets, and the planner input that decides each: an override applied after the
# plan would invalidate it (the KV-cache size, the gateway's caps and the alert thresholds follow the plan).
PLANNED_FLAGS = {
    "max-num-seqs": "vllm_workload.concurrent_sequences (the plan caps max-num-seqs at what the KV cache holds)",
    "max-model-len": "vllm_workload.max_context_tokens",
    "gpu-memory-utilization": "vllm_engine.gpu_memory_utilization",
    "kv-cache-dtype": "vllm_engine.kv_cache_dtype",
    "max-num-batched-tokens": "vllm_workload.tpot_seconds (the plan sizes the batch for the TPOT target)",
    "max-num-queued-reqs": "vllm_workload.concurrent_sequences (the queue bound is a multiple of max-num-seqs)",
    "tensor-parallel-size": "vllm_engine.tensor_parallel_size",
    "block-size": "vllm_engine.block_size",
    "quantization": "vllm_model.weight_format",
}
# Flags the role itself sets or must not be given in argv.
ROLE_FLAGS = {
    "served-model-name": "vllm_model.served_model_name",
    "revision": "vllm_model.revision (or the lock file's vllm_model_revision)",
    "model": "vllm_model.name",
    "port": "vllm_port (the container always listens on 8000; vllm_port is the host's loopback port)",
    "host": "vllm_bind_address (the address the container's port is published on)",
    "api-key": "vllm_api_key, kept in the vault (a key in argv shows in `ps` and `docker inspect`)",
    "override-generation-config": "vllm_max_output_tokens (the role sets max_new_tokens from the plan)",
    "hf-token": "vllm_hf_token, kept in the vault (the role fetches the weights; a token in argv shows in `docker inspect`)",
    "config": "vllm_flags for the options (the role's own --config file carries the engine key, vllm_api_key)",
}
# Engine environment variables the role sets from vllm_ceilings.
CEILING_ENV = {"VLLM_MAX_N_SEQUENCES": "vllm_max_n", "VLLM_MAX_COMPLETION_PROMPTS": "vllm_max_completion_prompts"}


def vllm_ceilings(plan: Mapping[str, Any], workload: Mapping[str, Any], max_output_tokens: Any = 0,
                  max_n: Any = 0, max_completion_prompts: Any = 0) -> dict[str, int]:
    """Per-request ceilings the engine enforces, from the capacity plan.

    Inputs: the plan (``flags['max-model-len']``, ``flags['max-num-seqs']``), ``vllm_workload``
    (``avg_context_tokens``) and the admin's values, 0 meaning derived:
      - ``max_output_tokens`` (tokens): the average context the plan was sized for, at least 256, at most
        --max-model-len; vLLM 0.32 clamps every request's max_tokens to it (serve/utils/api_utils.py
        ``get_max_tokens``, ``override_max_tokens`` from --override-generation-config max_new_tokens);
      - ``max_n`` and ``max_completion_prompts``: the plan's ``admission.user_max_inflight`` (max(1,
        max-num-seqs // 4)), the share of the batch one user may hold in flight at the gateway, so one
        request cannot hold more of the batch than its sender may; vLLM 0.32 answers 400 above them (sampling_params.py
        ``VLLM_MAX_N_SEQUENCES``; completion/protocol.py ``VLLM_MAX_COMPLETION_PROMPTS``).
    Output: ``{"max_output_tokens", "max_n", "max_completion_prompts"}``, ints.
    Raises AnsibleFilterError naming the variable, the value and the allowed range when a value is not
    an integer in [1, --max-model-len] (output tokens) or [1, max-num-seqs] (the others).
    """
    flags = plan.get("flags", {})
    max_len, seqs = int(flags["max-model-len"]), int(flags["max-num-seqs"])
    share = int(plan["admission"]["user_max_inflight"])
    derived = {"max_output_tokens": min(max_len, max(256, int(workload.get("avg_context_tokens", 0)))),
               "max_n": share, "max_completion_prompts": share}
    given = {"max_output_tokens": max_output_tokens, "max_n": max_n, "max_completion_prompts": max_completion_prompts}
    bounds = {"max_output_tokens": (max_len, "--max-model-len"), "max_n": (seqs, "max-num-seqs"),
              "max_completion_prompts": (seqs, "max-num-seqs")}
    out: dict[str, int] = {}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
            raise AnsibleFilterError(f"vllm_{key}: {value!r} is not a whole number; use 0 to derive it from the plan")
        number = int(value)
        upper, name = bounds[key]
        if number > upper:
            raise AnsibleFilterError(
                f"vllm_{key}: {number} is above the plan's {name} ({upper}); use at most {upper}, or 0 to derive "
                f"it from the plan ({derived[key]})")
        out[key] = number or derived[key]
    return out


def vllm_check_overrides(flags: Mapping[str, Any] | None, extra_args: Any = (),
                         env: Mapping[str, Any] | None = None) -> bool:
    """Refuse engine flags that bypass the capacity plan or the role.

    Inputs: ``vllm_flags`` (mapping of vLLM long option names without ``--``) and ``vllm_extra_args``
    (list of argv tokens), ``vllm_env`` (the engine's extra environment). Output: True when nothing is
    refused.
    Raises AnsibleFilterError naming the field, the value and the fix for: a flag the plan sets (use the
    planner input in ``PLANNED_FLAGS``, so the plan is recomputed and checked), a flag the role sets
    (``ROLE_FLAGS``), the ``serve`` subcommand, or one token holding a flag and its value separated by
    a space, an environment variable the role sets (``CEILING_ENV``).
    """
    for name, value in (env or {}).items():
        if name in CEILING_ENV:
            raise AnsibleFilterError(f"vllm_env.{name}: {value!r} is set by the role; set {CEILING_ENV[name]} instead")
    owned = {**PLANNED_FLAGS, **ROLE_FLAGS}
    for name, value in (flags or {}).items():
        key = str(name).removeprefix("--").removeprefix("no-")
        if key in owned:
            raise AnsibleFilterError(
                f"vllm_flags.{name}: {value!r} is set by the {'capacity plan' if key in PLANNED_FLAGS else 'role'}; "
                f"set {owned[key]} instead and drop the override")
    if isinstance(extra_args, (str, bytes)) or not isinstance(extra_args, (list, tuple)):
        raise AnsibleFilterError(f"vllm_extra_args: {extra_args!r} is not a list; give one argv token per item, "
                                 "e.g. ['--enforce-eager', '--max-log-len', '100']")
    for token in extra_args:
        text = str(token)
        if text == "serve":
            raise AnsibleFilterError(
                "vllm_extra_args: 'serve' is the subcommand the role already runs (vllm serve <model>); remove it")
        if text.startswith("--") and " " in text.strip():
            flag, _, rest = text.strip().partition(" ")
            raise AnsibleFilterError(
                f"vllm_extra_args: {text!r} is one token; split the flag from its value: "
                f"[{flag!r}, {rest.strip()!r}]")
        if text.startswith("-"):
            key = text.split("=", 1)[0].lstrip("-").removeprefix("no-")
            if key in owned:
                raise AnsibleFilterError(
                    f"vllm_extra_args: {text!r} is set by the "
                    f"{'capacity plan' if key in PLANNED_FLAGS else 'role'}; set {owned[key]} instead")
    return True


# Settings that open the engine to more than the gateway, each with the opt-in word that accepts it
# (vllm_allow_unsafe). vLLM 0.32's --api-key check guards only /v1, /v2, /inference and /cohere, so
# /invocations answers without a key (vllm-project/vllm#58144).
UNSAFE = {
    "bind_address": "the engine answers /invocations without a key, so only the gateway on this host may "
                    "reach it; keep 127.0.0.1",
    "dev_mode": "VLLM_SERVER_DEV_MODE adds /sleep, /wake_up, /reset_prefix_cache, /collective_rpc and other "
                "admin routes to the engine; remove it",
    "runtime_lora": "VLLM_ALLOW_RUNTIME_LORA_UPDATING lets any key holder load code-bearing adapters through "
                    "/v1/load_lora_adapter; remove it and list adapters with --lora-modules",
    "trust_remote_code": "--trust-remote-code runs Python from the model repository inside the engine; use a "
                         "model whose architecture vLLM ships",
    "log_requests": "--enable-log-requests writes every user's prompt to the engine's log (docker logs, 5 x "
                    "50 MiB kept); remove it",
}
_TRUTHY = {"1", "true", "yes", "on"}


def vllm_check_exposure(flags: Mapping[str, Any] | None, extra_args: Any = (), env: Mapping[str, Any] | None = None,
                        bind_address: Any = "127.0.0.1", allowed: Any = ()) -> bool:
    """Refuse settings that would let more than the gateway reach the engine, or leak what users send.

    Inputs: ``vllm_flags`` (mapping of long option names without ``--``), ``vllm_extra_args`` (argv
    tokens), ``vllm_env`` (mapping), ``vllm_bind_address`` (the address the engine's port is published
    on) and ``vllm_allow_unsafe`` (list of words from ``UNSAFE`` the admin accepts). Output: True when
    nothing is refused. Raises AnsibleFilterError naming the field, the value, why and the fix (including
    the opt-in word) for the first setting in ``UNSAFE`` that is present and not allowed, or for an
    unknown word in ``allowed``.
    """
    accepted = set(allowed or ())
    unknown = sorted(accepted - set(UNSAFE))
    if unknown:
        raise AnsibleFilterError(f"vllm_allow_unsafe: {unknown} are not settings this check knows; use any of "
                                 f"{sorted(UNSAFE)}")
    found: list[tuple[str, str, Any]] = []
    address = str(bind_address).strip().strip("[]")
    if not (address.startswith("127.") or address in ("::1", "localhost")):
        found.append(("bind_address", "vllm_bind_address", bind_address))
    for name, value in (env or {}).items():
        word = {"VLLM_SERVER_DEV_MODE": "dev_mode", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "runtime_lora"}.get(name)
        if word and str(value).strip().lower() in _TRUTHY:
            found.append((word, f"vllm_env.{name}", value))
    flag_words = {"trust-remote-code": "trust_remote_code", "enable-log-requests": "log_requests"}
    for name, value in (flags or {}).items():
        word = flag_words.get(str(name).removeprefix("--"))
        if word and value not in (False, None, "false", "False"):
            found.append((word, f"vllm_flags.{name}", value))
    for token in extra_args if isinstance(extra_args, (list, tuple)) else ():
        word = flag_words.get(str(token).split("=", 1)[0].removeprefix("--"))
        if word:
            found.append((word, "vllm_extra_args", token))
    for word, field, value in found:
        if word not in accepted:
            raise AnsibleFilterError(
                f"{field}: {value!r} opens the engine: {UNSAFE[word]}. If you mean it, add '{word}' to "
                "vllm_allow_unsafe (and say why in the inventory)")
    return True


def vllm_max_model_len(limit: Any, workload: Mapping[str, Any]) -> int:
    """The engine's ``--max-model-len``: the workload's maximum context, checked against the model.

    Inputs: ``limit`` — the model's own limit in tokens (the planner's ``numbers.model_max_len``:
    ``max_position_embeddings`` or the other length keys of config.json, times the RoPE scaling factor,
    as vLLM 0.32 derives it); ``workload`` — ``vllm_workload`` (``max_context_tokens``). Output: tokens.
    Raises AnsibleFilterError naming the field, the value, the limit and the fix when it exceeds the limit.
    """
    field, given = "vllm_workload.max_context_tokens", workload.get("max_context_tokens")
    try:
        value, limit = int(str(given)), int(limit)
    except (TypeError, ValueError) as err:
        raise AnsibleFilterError(f"{field}: '{given}' is not a number of tokens") from err
    if value > limit:
        raise AnsibleFilterError(
            f"{field}: {value} tokens is above the model's own limit of {limit} (max_position_embeddings and "
            f"RoPE scaling in vllm_model.config); vLLM would refuse to start. Use at most {limit}, or a model "
            "(or RoPE scaling) made for longer contexts")
    return value


def _require_cuda(env: Mapping[str, str]) -> tuple[tuple[int, int], str] | None:
    """The minimum CUDA version an image declares: ``cuda>=X.Y`` of NVIDIA_REQUIRE_CUDA, else CUDA_VERSION."""
    for alternative in env.get("NVIDIA_REQUIRE_CUDA", "").split():
        # Space-separated alternatives are ORed, comma-separated constraints ANDed (libnvidia-container).
        # The brand=...,driver>=N alternatives admit older datacenter drivers only through the image's
        # CUDA forward-compatibility libraries, which vLLM's images switch off
        # (VLLM_ENABLE_CUDA_COMPATIBILITY=0): the driver itself must support the image's CUDA.
        match = _REQUIRE_CUDA.match(alternative)
        if match:
            return (int(match.group(1)), int(match.group(2))), f"NVIDIA_REQUIRE_CUDA={alternative}"
    version = env.get("CUDA_VERSION", "")
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match:
        return (int(match.group(1)), int(match.group(2))), f"CUDA_VERSION={version}"
    return None


def vllm_cuda_check(image_env: Any, nvidia_smi: str, image: str = "the engine image") -> dict[str, Any]:
    """Check that the driver supports the CUDA version the engine image was built for.

    Inputs: ``image_env`` — the image's ``Config.Env`` (list of ``KEY=value``, as ``docker image inspect``
    returns it) or a dict; ``nvidia_smi`` — the plain ``nvidia-smi`` output, whose header line carries
    ``CUDA Version: X.Y`` (the newest CUDA the loaded driver supports, e.g. 13.0 for R580 drivers such
    as 580.95.05); ``image`` — the reference, for messages.
    Output: ``{"required": "X.Y" | None, "source": str, "driver": "X.Y" | None}``; ``required`` is None
    for an image without a CUDA requirement (a CPU build), and the driver is then not consulted.
    Raises AnsibleFilterError with "upgrade the driver or pin an older image" when the driver's CUDA is
    older than the image's, or when the nvidia-smi output has no CUDA version (driver not loaded).
    """
    env = dict(image_env) if isinstance(image_env, Mapping) else dict(
        str(item).split("=", 1) for item in (image_env or []) if "=" in str(item))
    required = _require_cuda(env)
    if required is None:
        return {"required": None, "source": "no CUDA requirement in the image", "driver": None}
    (need_major, need_minor), source = required
    match = _SMI_CUDA.search(nvidia_smi or "")
    if not match:
        first = (nvidia_smi or "").strip().splitlines()[:1] or ["no output"]
        raise AnsibleFilterError(
            f"{image} needs CUDA >= {need_major}.{need_minor} ({source}), but nvidia-smi reports no CUDA "
            f"version ('{first[0]}'); is the NVIDIA driver loaded? Fix the driver before switching images")
    have = (int(match.group(1)), int(match.group(2)))
    if have < (need_major, need_minor):
        raise AnsibleFilterError(
            f"{image} needs CUDA >= {need_major}.{need_minor} ({source}), but the installed NVIDIA driver "
            f"supports CUDA {have[0]}.{have[1]} at most (nvidia-smi): upgrade the driver (nvidia_driver_version) "
            "or pin an older image built for that CUDA. The running engine was left untouched")
    return {"required": f"{need_major}.{need_minor}", "source": source, "driver": f"{have[0]}.{have[1]}"}


def vllm_gpu_holders(csv_text: str) -> list[str]:
    """Describe GPU processes from ``nvidia-smi --query-compute-apps=pid,process_name,used_memory
    --format=csv,noheader,nounits`` output (one ``PID, NAME, MIB`` line each).

    Output: ``["pid 4242 (/usr/bin/python3, 1024 MiB)", ...]``; blank lines are skipped, a line that does
    not split into three fields is kept verbatim. Raises nothing.
    """
    holders = []
    for line in (csv_text or "").splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            mib = fields[2] if fields[2].endswith("MiB") else f"{fields[2]} MiB"
            holders.append(f"pid {fields[0]} ({fields[1]}, {mib})")
        else:
            holders.append(line.strip())
    return holders


class FilterModule:
    """Ansible filters of the vllm role (checks)."""

    def filters(self) -> dict[str, Any]:
        return {
            "vllm_weights_source": vllm_weights_source,
            "vllm_max_model_len": vllm_max_model_len,
            "vllm_cuda_check": vllm_cuda_check,
            "vllm_gpu_holders": vllm_gpu_holders,
            "vllm_check_overrides": vllm_check_overrides,
            "vllm_check_exposure": vllm_check_exposure,
            "vllm_ceilings": vllm_ceilings,
        }
