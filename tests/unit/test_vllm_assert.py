"""roles/vllm/tasks/plan.yml (the `plan` entry point) refuses bad input with a message naming the field,
the value and the fix.

One ansible-playbook run on localhost: each case is an inventory host of its own (facts set by one case
cannot leak into another), with its variables; a block/rescue records the outcome per case.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import yaml
from repo_modules import run_cases

REPO = pathlib.Path(__file__).resolve().parents[2]
REV = "ef486eba9ff0b47394b3d9daf8a30e736bf68ef8"
TINY = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/main.yml").read_text())["vllm_model"]
HUB_MODEL = dict(TINY, name="teamserve/tiny-llama", revision=REV)
LOCAL_MODEL = {k: v for k, v in TINY.items() if k != "revision"} | {"name": "/opt/models/teamserve-tiny"}
CHAT_TEMPLATE = REPO / "tests/unit/fixtures/chat-template.jinja"
WORKLOAD = {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 2048}

CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "ok_local": ({"vllm_model": LOCAL_MODEL}, None),
    "ok_hub_with_token": ({"vllm_model": HUB_MODEL, "vllm_hf_token": "hf_" + "x" * 34}, None),
    "ok_hub_cached_without_token": ({"vllm_model": HUB_MODEL, "cached": True}, None),
    "unknown_profile": ({"vllm_profile": "llama-70b", "vllm_profiles": {"tiny": {"vllm_model": LOCAL_MODEL}}},
                        r"vllm_profile 'llama-70b' is not defined in vllm_profiles; choose one of \['tiny'\]"),
    "hub_without_token_or_weights": ({"vllm_model": HUB_MODEL},
                                     "the weights are not in .*models--teamserve--tiny-llama/snapshots/" + REV
                                     + r".* vllm_hf_token is empty.* vault_vllm_hf_token"),
    "unpinned_revision": ({"vllm_model": dict(HUB_MODEL, revision="main")},
                          "vllm_model.revision: 'main' is not a 40-hex commit id"),
    "max_model_len_above_limit": ({"vllm_model": LOCAL_MODEL, "vllm_workload": dict(WORKLOAD, max_context_tokens=4096)},
                                  "vllm_workload.max_context_tokens: 4096 tokens is above the model's own limit of 2048"),
    "max_model_len_flag_bypassing_the_plan": ({"vllm_model": LOCAL_MODEL, "vllm_flags": {"max-model-len": 8192}},
                                              "vllm_flags.max-model-len: 8192 is set by the capacity plan; set "
                                              "vllm_workload.max_context_tokens instead"),
    "unsupported_kv_dtype": ({"vllm_profile": "tiny", "vllm_profiles": {"tiny": {
                                  "vllm_model": LOCAL_MODEL, "vllm_engine": {"kv_cache_dtype": "fp4"}}}},
                             "vllm_engine.kv_cache_dtype.*fp4.*use one of auto"),
    "kv_dtype_override_bypassing_the_plan": ({"vllm_model": LOCAL_MODEL, "vllm_flags": {"kv-cache-dtype": "fp8"}},
                                             "vllm_flags.kv-cache-dtype: 'fp8' is set by the capacity plan; set vllm_engine.kv_cache_dtype"),
    "ceiling_above_the_plan": ({"vllm_model": LOCAL_MODEL, "vllm_max_n": 99},
                               r"vllm_max_n: 99 is above the plan's max-num-seqs \(8\); use at most 8, or 0"),
    "ceiling_env_set_by_hand": ({"vllm_model": LOCAL_MODEL, "vllm_env": {"VLLM_MAX_N_SEQUENCES": "64"}},
                                "vllm_env.VLLM_MAX_N_SEQUENCES: '64' is set by the role; set vllm_max_n instead"),
    "extra_args_repeating_a_planned_flag": ({"vllm_model": LOCAL_MODEL, "vllm_extra_args": ["--max-num-seqs", "4"]},
                                            "vllm_extra_args: '--max-num-seqs' is set by the capacity plan"),
    "engine_published_off_loopback": ({"vllm_model": LOCAL_MODEL, "vllm_bind_address": "0.0.0.0"},
                                      "vllm_bind_address: '0.0.0.0' opens the engine.*add 'bind_address' to vllm_allow_unsafe"),
    "engine_published_off_loopback_allowed": ({"vllm_model": LOCAL_MODEL, "vllm_bind_address": "0.0.0.0",
                                               "vllm_allow_unsafe": ["bind_address"]}, None),
    "dev_mode_routes": ({"vllm_model": LOCAL_MODEL, "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"}},
                        "vllm_env.VLLM_SERVER_DEV_MODE: '1' opens the engine.*'dev_mode'"),
    "remote_code": ({"vllm_model": LOCAL_MODEL, "vllm_extra_args": ["--trust-remote-code"]},
                    "vllm_extra_args: '--trust-remote-code' opens the engine.*'trust_remote_code'"),
    "prompts_in_the_log": ({"vllm_model": LOCAL_MODEL, "vllm_flags": {"enable-log-requests": True}},
                           "vllm_flags.enable-log-requests: True opens the engine.*'log_requests'"),
    # A base model's snapshot already on the host: its tokenizer has no chat template.
    "cached_without_a_chat_template": ({"vllm_model": HUB_MODEL, "cached": "tokenizer without template"},
                                       f"vllm_model teamserve/tiny-llama at {REV} has no chat template .*"
                                       "Set vllm_chat_template to a Jinja template file on the controller"),
    "cached_without_a_chat_template_given_one": ({"vllm_model": HUB_MODEL, "cached": "tokenizer without template",
                                                  "vllm_chat_template": str(CHAT_TEMPLATE)}, None),
    "release_without_a_snapshot": ({"vllm_model": LOCAL_MODEL, "vllm_version": "0.30.0"},
                                   r"vllm_version=0.30.0 has no option snapshot .*vllm-serve-options-0.30.0.json.* "
                                   r"Snapshots exist for: 0.31.0, 0.32.0, 0.33.0\. Pin one of those, or write the "
                                   r"release's snapshot from its GPU package with tools/vllm_release.py <release>"),
    # An upgrade from 0.31.0: a value 0.31.0 accepted and 0.32.0 dropped is named as such.
    "value_the_running_release_accepted": ({"vllm_model": LOCAL_MODEL, "vllm_previous_version": "0.31.0",
                                            "vllm_extra_args": ["--mamba-cache-mode", "all"]},
                                           r"vllm_extra_args\[1\]: 'all' is not one of \[.*\] for '--mamba-cache-mode' "
                                           r"in vLLM 0.32.0 \(vLLM 0.31.0, which the box runs, accepts it\)"),
    "cpu_weight_below_dockers_range": ({"vllm_model": LOCAL_MODEL, "vllm_cpu_shares": 1},
                                       "vllm_cpu_shares is 1; Docker takes a CPU weight from 2 to 262144"),
    "chat_template_file_missing": ({"vllm_model": LOCAL_MODEL, "vllm_chat_template": "/nonexistent/chat.jinja"},
                                   "vllm_chat_template is '/nonexistent/chat.jinja', and /nonexistent/chat.jinja "
                                   "is not a file on the controller"),
}

PLAYBOOK = """
- hosts: all
  gather_facts: false
  strategy: free
  tasks:
    - block:
        - ansible.builtin.include_role:
            name: vllm
            tasks_from: plan
        - ansible.builtin.set_fact:
            outcome: passed
      rescue:
        - ansible.builtin.set_fact:
            outcome: "{{ ansible_failed_result.msg }}"
    - ansible.builtin.copy:
        content: "{{ outcome }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.txt"
        mode: "0600"
      delegate_to: localhost
"""


def _cached_snapshot(data_dir: pathlib.Path, tokenizer: bool) -> None:
    """A complete snapshot of the hub repo, in the layout `hf download` leaves (tree listing + files):
    config.json, and with `tokenizer` a tokenizer_config.json that has no chat template."""
    storage = data_dir / "huggingface" / "hub" / "models--teamserve--tiny-llama"
    files = {"config.json": "{}"} | ({"tokenizer_config.json": '{"model_max_length": 2048}'} if tokenizer else {})
    (storage / "trees").mkdir(parents=True)
    (storage / "trees" / f"{REV}.json").write_text(json.dumps(
        {"format_version": 1, "files": {name: {"size": len(text), "blob_id": "0" * 40} for name, text in files.items()}}))
    (storage / "snapshots" / REV).mkdir(parents=True)
    for name, text in files.items():
        (storage / "snapshots" / REV / name).write_text(text)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("assert")
    hosts = {}
    for name, (overrides, _) in CASES.items():
        data_dir = tmp / "data" / name
        data_dir.mkdir(parents=True)
        if overrides.get("cached"):
            _cached_snapshot(data_dir, tokenizer=overrides["cached"] == "tokenizer without template")
        hosts[name] = {
            "vllm_data_dir": str(data_dir), "vllm_api_key": "k" * 40,
            "vllm_image": "vllm/vllm-openai:v0.32.0@sha256:" + "ab" * 32, "vllm_workload": WORKLOAD,
            **{k: v for k, v in overrides.items() if k != "cached"},
        }
    return run_cases(tmp, hosts, PLAYBOOK)


@pytest.mark.parametrize("case", list(CASES))
def test_assert_outcome(outcomes, case):
    expected = CASES[case][1]
    if expected is None:
        assert outcomes[case] == "passed"
    else:
        assert outcomes[case] != "passed", f"{case} was accepted"
        assert re.search(expected, " ".join(outcomes[case].split())), outcomes[case]
