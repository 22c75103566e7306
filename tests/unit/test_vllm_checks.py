"""The vllm role's pre-change checks: weights source, --max-model-len, the image's CUDA requirement
against the driver, GPU holders (roles/vllm/filter_plugins/vllm_checks.py), and the HF snapshot
completeness check (roles/vllm/library/vllm_hf_snapshot.py)."""

from __future__ import annotations

import json
import pathlib

import pytest
from ansible.errors import AnsibleFilterError
from repo_modules import load

from teamserve_capacity.planner import user_inflight_share

checks = load("vllm_checks", "roles/vllm/filter_plugins/vllm_checks.py")
snapshot = load("vllm_hf_snapshot", "roles/vllm/library/vllm_hf_snapshot.py")

REV = "ef486eba9ff0b47394b3d9daf8a30e736bf68ef8"
# The official image's env (recorded from vllm/vllm-openai v0.23.0/v0.28.0; the testbed image carries it).
OFFICIAL_ENV = [
    "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/bin:/bin",
    "NVIDIA_REQUIRE_CUDA=cuda>=13.0 brand=unknown,driver>=535,driver<536 brand=tesla,driver>=570,driver<571",
    "NV_CUDA_CUDART_VERSION=13.0.96-1",
    "CUDA_VERSION=13.0.2",
    "VLLM_ENABLE_CUDA_COMPATIBILITY=0",
]
# Header of the real nvidia-smi with driver 580.95.05 (R580 = CUDA 13.0).
SMI_580 = """Mon Nov 30 12:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
"""
SMI_570 = SMI_580.replace("580.95.05", "570.195.03").replace("13.0", "12.8")


# --- weights source -------------------------------------------------------------------------------------
def test_a_path_in_the_container_downloads_nothing():
    assert checks.vllm_weights_source({"name": "/opt/models/teamserve-tiny"}) == {
        "kind": "local", "path": "/opt/models/teamserve-tiny"}


def test_a_repo_pinned_to_a_commit_is_downloaded_into_its_cache_folder():
    src = checks.vllm_weights_source({"name": "teamserve/tiny-llama", "revision": REV})
    assert src == {"kind": "hub", "repo_id": "teamserve/tiny-llama", "revision": REV,
                   "cache_subdir": "models--teamserve--tiny-llama"}


@pytest.mark.parametrize("model, match", [
    ({"name": "meta-llama/Llama-3.1-8B-Instruct"}, "vllm_model.revision is missing"),
    ({"name": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main"}, "'main' is not a 40-hex commit"),
    ({"name": "meta-llama/Llama-3.1-8B-Instruct", "revision": REV.upper()}, "is not a 40-hex commit"),
    ({"name": "/opt/models/x", "revision": REV}, "has no revisions"),
    ({"name": "llama-8b"}, "neither a Hugging Face repo id"),
    ({"name": "s3://bucket/model", "revision": REV}, "neither a Hugging Face repo id"),
])
def test_unpinned_or_malformed_models_are_refused(model, match):
    with pytest.raises(AnsibleFilterError, match=match):
        checks.vllm_weights_source(model)


# --- --max-model-len ------------------------------------------------------------------------------------
def test_max_model_len_within_the_limit_passes():
    assert checks.vllm_max_model_len(2048, {"max_context_tokens": 2048}) == 2048


def test_workload_above_the_models_limit_is_refused_naming_field_value_and_limit():
    with pytest.raises(AnsibleFilterError,
                       match=r"vllm_workload.max_context_tokens: 4096 tokens is above the model's own limit of 2048"):
        checks.vllm_max_model_len(2048, {"max_context_tokens": 4096})


# --- flags the plan or the role sets ---------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "extra", "match"), [
    ({"max-num-seqs": 4}, [], r"vllm_flags.max-num-seqs: 4 is set by the capacity plan; set "
                              r"vllm_workload.concurrent_sequences"),
    ({"max-model-len": 131072}, [], r"vllm_flags.max-model-len: 131072 .* vllm_workload.max_context_tokens"),
    ({"kv-cache-dtype": "fp8"}, [], r"vllm_flags.kv-cache-dtype: 'fp8' .* vllm_engine.kv_cache_dtype"),
    ({"gpu-memory-utilization": 0.95}, [], r"vllm_engine.gpu_memory_utilization"),
    ({"max-num-batched-tokens": 8192}, [], r"vllm_workload.tpot_seconds"),
    ({"api-key": "x"}, [], r"vllm_flags.api-key: .* set by the role; set vllm_api_key"),
    ({}, ["--max-num-seqs", "4"], r"vllm_extra_args: '--max-num-seqs' is set by the capacity plan"),
    ({}, ["--max-num-seqs=4"], r"'--max-num-seqs=4' is set by the capacity plan"),
    ({}, ["--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5"], r"vllm_engine.gpu_memory_utilization"),
    ({}, ["--host", "0.0.0.0"], r"'--host' is set by the role; set vllm_bind_address"),
    ({}, ["--port", "9000"], r"'--port' is set by the role; set vllm_port"),
    ({}, ["serve", "--enforce-eager"], r"'serve' is the subcommand the role already runs"),
    ({}, ["--max-log-len 100"], r"'--max-log-len 100' is one token; split the flag from its value: "
                                r"\['--max-log-len', '100'\]"),
    ({}, "--enforce-eager", r"vllm_extra_args: '--enforce-eager' is not a list"),
])
def test_overrides_of_what_the_plan_or_the_role_sets_are_refused_with_the_input_to_use(flags, extra, match):
    with pytest.raises(AnsibleFilterError, match=match):
        checks.vllm_check_overrides(flags, extra)


# --- per-request ceilings ---------------------------------------------------------------------------------
def plan_of(max_model_len: int, max_num_seqs: int) -> dict:
    """The parts of a capacity plan the ceilings read; the share is the planner's own rule."""
    return {"flags": {"max-model-len": max_model_len, "max-num-seqs": max_num_seqs},
            "admission": {"user_max_inflight": user_inflight_share(max_num_seqs)}}


PLAN = plan_of(32768, 32)


def test_ceilings_derive_from_the_plan():
    assert checks.vllm_ceilings(PLAN, {"avg_context_tokens": 4000}) == {
        "max_output_tokens": 4000, "max_n": 8, "max_completion_prompts": 8}
    small = plan_of(2048, 2)
    assert checks.vllm_ceilings(small, {"avg_context_tokens": 100}) == {
        "max_output_tokens": 256, "max_n": 1, "max_completion_prompts": 1}
    assert checks.vllm_ceilings(small, {"avg_context_tokens": 9000})["max_output_tokens"] == 2048


def test_ceilings_follow_the_profile():
    """A profile with more sequences raises n and prompts with it (the gateway's share rule)."""
    low, high = (plan_of(8192, seqs) for seqs in (8, 64))
    assert checks.vllm_ceilings(low, {"avg_context_tokens": 1000})["max_n"] == 2
    assert checks.vllm_ceilings(high, {"avg_context_tokens": 1000})["max_n"] == 16


def test_given_ceilings_are_kept_within_the_plan():
    assert checks.vllm_ceilings(PLAN, {"avg_context_tokens": 4000}, 1500, 4, 32) == {
        "max_output_tokens": 1500, "max_n": 4, "max_completion_prompts": 32}
    with pytest.raises(AnsibleFilterError, match=r"vllm_max_output_tokens: 40000 is above the plan's --max-model-len "
                                                 r"\(32768\)"):
        checks.vllm_ceilings(PLAN, {"avg_context_tokens": 4000}, 40000)
    with pytest.raises(AnsibleFilterError, match=r"vllm_max_completion_prompts: 33 is above the plan's max-num-seqs"):
        checks.vllm_ceilings(PLAN, {"avg_context_tokens": 4000}, 0, 0, 33)
    with pytest.raises(AnsibleFilterError, match=r"vllm_max_n: -1 is not a whole number"):
        checks.vllm_ceilings(PLAN, {"avg_context_tokens": 4000}, 0, -1)


def test_other_flags_pass():
    assert checks.vllm_check_overrides({"enforce-eager": True, "enable-prefix-caching": False},
                                       ["--max-log-len", "100", "--no-enable-chunked-prefill"]) is True


# --- CUDA -----------------------------------------------------------------------------------------------
def test_image_cuda_13_runs_on_the_580_driver():
    assert checks.vllm_cuda_check(OFFICIAL_ENV, SMI_580) == {
        "required": "13.0", "source": "NVIDIA_REQUIRE_CUDA=cuda>=13.0", "driver": "13.0"}


def test_image_cuda_13_on_an_older_driver_stops_with_the_fix():
    with pytest.raises(AnsibleFilterError, match="needs CUDA >= 13.0 .* supports CUDA 12.8 at most .*"
                                                 "upgrade the driver .* or pin an older image"):
        checks.vllm_cuda_check(OFFICIAL_ENV, SMI_570, "vllm/vllm-openai:v0.32.0")


def test_brand_forward_compat_clauses_do_not_admit_an_older_driver():
    """cuda>=13.0 OR brand=tesla,driver 570: vLLM's image disables the compat libraries, so 570 fails."""
    with pytest.raises(AnsibleFilterError, match="upgrade the driver"):
        checks.vllm_cuda_check(OFFICIAL_ENV, SMI_570)


def test_cuda_version_is_the_fallback_requirement():
    assert checks.vllm_cuda_check({"CUDA_VERSION": "12.9.1"}, SMI_580)["required"] == "12.9"
    with pytest.raises(AnsibleFilterError, match="needs CUDA >= 12.9"):
        checks.vllm_cuda_check(["CUDA_VERSION=12.9.1"], SMI_580.replace("13.0", "12.8"))


def test_an_image_without_cuda_needs_no_driver():
    assert checks.vllm_cuda_check(["PATH=/usr/bin"], "")["required"] is None


def test_no_cuda_version_from_nvidia_smi_is_an_error():
    with pytest.raises(AnsibleFilterError, match="Driver/library version mismatch"):
        checks.vllm_cuda_check(OFFICIAL_ENV, "Failed to initialize NVML: Driver/library version mismatch\n")


def test_gpu_holders_are_named():
    text = "4242, /usr/bin/python3, 1024\n\n77, VLLM::EngineCore, 88098 MiB\n"
    assert checks.vllm_gpu_holders(text) == ["pid 4242 (/usr/bin/python3, 1024 MiB)",
                                             "pid 77 (VLLM::EngineCore, 88098 MiB)"]
    assert checks.vllm_gpu_holders("") == []


# --- snapshot completeness ------------------------------------------------------------------------------
def _cache(tmp_path: pathlib.Path, files: dict[str, str], present: list[str]) -> pathlib.Path:
    """An HF hub cache in huggingface_hub 2.x's layout: trees/<rev>.json + snapshots/<rev>/ links to blobs/."""
    storage = tmp_path / "hub" / "models--teamserve--tiny-llama"
    (storage / "trees").mkdir(parents=True)
    (storage / "trees" / f"{REV}.json").write_text(json.dumps(
        {"format_version": 1, "files": {p: {"size": len(c), "blob_id": "0" * 40} for p, c in files.items()}}))
    for path in present:
        blob = storage / "blobs" / f"b{abs(hash(path))}"
        blob.parent.mkdir(exist_ok=True)
        blob.write_text(files[path])
        link = storage / "snapshots" / REV / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    return tmp_path / "hub"


FILES = {"config.json": "{}", "model.safetensors": "w", "tokenizer.json": "t", "original/consolidated.pth": "x"}


def test_complete_snapshot(tmp_path):
    hub = _cache(tmp_path, FILES, ["config.json", "model.safetensors", "tokenizer.json"])
    status = snapshot.snapshot_status(str(hub), "teamserve/tiny-llama", REV, ["original/"])
    assert status["complete"] and status["expected"] == 3 and status["missing"] == []
    assert status["snapshot"].endswith(f"models--teamserve--tiny-llama/snapshots/{REV}")


def test_excluded_files_are_expected_without_the_pattern(tmp_path):
    hub = _cache(tmp_path, FILES, ["config.json", "model.safetensors", "tokenizer.json"])
    status = snapshot.snapshot_status(str(hub), "teamserve/tiny-llama", REV, [])
    assert not status["complete"] and status["missing"] == ["original/consolidated.pth"]


def test_interrupted_download_is_incomplete(tmp_path):
    hub = _cache(tmp_path, FILES, ["config.json"])
    status = snapshot.snapshot_status(str(hub), "teamserve/tiny-llama", REV, ["original/"])
    assert not status["complete"] and sorted(status["missing"]) == ["model.safetensors", "tokenizer.json"]


def test_dangling_link_is_missing(tmp_path):
    hub = _cache(tmp_path, FILES, ["config.json", "model.safetensors", "tokenizer.json"])
    for blob in (hub / "models--teamserve--tiny-llama" / "blobs").iterdir():
        if blob.read_text() == "w":
            blob.unlink()
    status = snapshot.snapshot_status(str(hub), "teamserve/tiny-llama", REV, ["original/"])
    assert status["missing"] == ["model.safetensors"]


def test_no_tree_listing_means_not_downloaded(tmp_path):
    status = snapshot.snapshot_status(str(tmp_path / "hub"), "teamserve/tiny-llama", REV)
    assert not status["complete"] and status["missing"] == [f"trees/{REV}.json"]


def test_bad_repo_or_revision_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not OWNER/NAME"):
        snapshot.snapshot_status(str(tmp_path), "tiny", REV)
    with pytest.raises(ValueError, match="not a 40-hex commit"):
        snapshot.snapshot_status(str(tmp_path), "teamserve/tiny-llama", "main")


@pytest.mark.parametrize("files,source", [
    ({"chat_template.jinja": "{{ messages }}", "tokenizer_config.json": "{}"}, "chat_template.jinja"),
    ({"chat_template.json": '{"chat_template": "x"}', "tokenizer_config.json": "{}"}, "chat_template.json"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}, "tokenizer_config.json"),
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": "x"},
                                                              {"name": "tool_use", "template": "y"}]})},
     "tokenizer_config.json"),
    # A tokenizer without a template: every chat request would get vLLM's 400.
    ({"tokenizer_config.json": json.dumps({"model_max_length": 2048})}, "none"),
    ({"tokenizer_config.json": json.dumps({"chat_template": ""})}, "none"),
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "tool_use", "template": "y"}]})}, "none"),
    ({"chat_template.jinja": "", "tokenizer_config.json": "{}"}, "none"),
    # Not downloaded yet (or a broken file): nothing can be said.
    ({"config.json": "{}"}, "unknown"),
    ({"tokenizer_config.json": "{not json"}, "unknown"),
])
def test_chat_template_is_found_where_vllm_looks(tmp_path, files, source):
    hub = _cache(tmp_path, files, list(files))
    assert snapshot.snapshot_status(str(hub), "teamserve/tiny-llama", REV)["chat_template"] == source


def test_chat_template_unknown_before_the_download(tmp_path):
    assert snapshot.snapshot_status(str(tmp_path / "hub"), "teamserve/tiny-llama", REV)["chat_template"] == "unknown"


@pytest.mark.parametrize("kwargs,word,field", [
    ({"bind_address": "0.0.0.0"}, "bind_address", "vllm_bind_address: '0.0.0.0'"),
    ({"bind_address": "10.231.0.10"}, "bind_address", "vllm_bind_address"),
    ({"bind_address": "::"}, "bind_address", "vllm_bind_address"),
    ({"env": {"VLLM_SERVER_DEV_MODE": "1"}}, "dev_mode", "vllm_env.VLLM_SERVER_DEV_MODE: '1'"),
    ({"env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}, "runtime_lora", "vllm_env.VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    ({"flags": {"trust-remote-code": True}}, "trust_remote_code", "vllm_flags.trust-remote-code: True"),
    ({"extra_args": ["--trust-remote-code"]}, "trust_remote_code", "vllm_extra_args: '--trust-remote-code'"),
    ({"flags": {"enable-log-requests": True}}, "log_requests", "vllm_flags.enable-log-requests"),
    ({"extra_args": ["--enforce-eager", "--enable-log-requests"]}, "log_requests", "vllm_extra_args"),
])
def test_settings_that_open_the_engine_are_refused_unless_named(kwargs, word, field):
    args = {"flags": {}, "extra_args": [], "env": {}, "bind_address": "127.0.0.1", **kwargs}
    with pytest.raises(AnsibleFilterError) as refused:
        checks.vllm_check_exposure(args["flags"], args["extra_args"], args["env"], args["bind_address"], [])
    message = str(refused.value)
    assert message.startswith(field) and f"add '{word}' to vllm_allow_unsafe" in message
    assert checks.vllm_check_exposure(args["flags"], args["extra_args"], args["env"], args["bind_address"], [word])


@pytest.mark.parametrize("kwargs", [
    {}, {"bind_address": "127.0.0.1"}, {"bind_address": "::1"}, {"env": {"VLLM_SERVER_DEV_MODE": "0"}},
    {"flags": {"trust-remote-code": False}}, {"extra_args": ["--enforce-eager", "--max-log-len", "100"]},
    {"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}])
def test_settings_that_keep_the_engine_behind_the_gateway_pass(kwargs):
    args = {"flags": {}, "extra_args": [], "env": {}, "bind_address": "127.0.0.1", **kwargs}
    assert checks.vllm_check_exposure(args["flags"], args["extra_args"], args["env"], args["bind_address"], [])


def test_an_unknown_opt_in_word_is_refused():
    with pytest.raises(AnsibleFilterError, match=r"vllm_allow_unsafe: \['everything'\] are not settings"):
        checks.vllm_check_exposure({}, [], {}, "127.0.0.1", ["everything"])
