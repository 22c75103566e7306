"""The hand-over to a cluster engine: production-stack values from the planned argv
(playbooks/filter_plugins/teamserve_handover.py) and playbooks/handover.yml on the example inventory."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible.plugins.filter.core import to_nice_yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment
from repo_modules import REPO, load

handover = load("teamserve_handover", "playbooks/filter_plugins/teamserve_handover.py")
vllm_argv = load("vllm_argv", "roles/vllm/filter_plugins/vllm_argv.py")

DIGEST = "sha256:" + "ab" * 32
IMAGE = {"repository": "10.231.0.3:5000/vllm/vllm-openai", "tag": "v0.32.0", "digest": DIGEST}
MODEL = {"name": "teamserve/tiny-llama", "served_model_name": "tiny", "revision": "ef486eba9ff0b47394b3d9daf8a30e736bf68ef8"}
KEY = "0123456789abcdef0123456789abcdef-engine-key"
STRUCTURED = '{"backend": "xgrammar", "disable_any_whitespace": true}'
# What the planner decides for the testbed's tiny model (teamserve_capacity.planner's flags), then what the
# vllm role adds (roles/vllm/tasks/plan.yml's vllm_fixed_flags) and the testbed's vllm_flags.
PLANNED = {"max-model-len": 2048, "max-num-seqs": 8, "gpu-memory-utilization": 0.9, "kv-cache-dtype": "auto",
           "max-num-batched-tokens": 2048, "enable-prefix-caching": True, "enable-chunked-prefill": True,
           "tensor-parallel-size": 1, "quantization": None, "max-num-queued-reqs": 32}
FIXED = {"served-model-name": "tiny", "revision": MODEL["revision"], "config": "/run/teamserve/engine-config.yaml",
         "port": "8000", "override-generation-config": json.dumps({"max_new_tokens": 1500}), "chat-template": None}
TESTBED_FLAGS = {"enable-auto-tool-choice": True, "tool-call-parser": "pythonic", "structured-outputs-config": STRUCTURED}
PLAN = {"flags": PLANNED, "vllm_version": "0.32.0",
        "numbers": {"gpu": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "gpu_count": 1, "gpu_total_gib": 94.97,
                    "kv_tokens": 12345}}


@pytest.fixture(scope="module")
def snapshot() -> dict:
    """The committed parser snapshot of the pinned vLLM version: the argv below is the one the role renders."""
    return json.loads((REPO / "roles/vllm/files/vllm-serve-options-0.32.0.json").read_text())


def render(snapshot: dict, extra_flags: dict | None = None, extra_args: tuple = ()) -> list[str]:
    return vllm_argv.vllm_serve_argv({**PLANNED, **FIXED, **TESTBED_FLAGS, **(extra_flags or {})},
                                     MODEL["name"], snapshot, list(extra_args))


def values_for(argv: list[str], options: dict | None = None, plan: dict | None = None) -> dict:
    return handover.teamserve_production_stack_values(argv, IMAGE, PLAN if plan is None else plan, MODEL, options)


def spec_of(values: dict) -> dict:
    return values["servingEngineSpec"]["modelSpec"][0]


def test_testbed_plan_carries_image_model_and_planned_flags(snapshot):
    spec = spec_of(values_for(render(snapshot)))
    assert spec["repository"] == "10.231.0.3:5000/vllm/vllm-openai"
    assert spec["tag"] == f"v0.32.0@{DIGEST}"  # the chart's image is "<repository>:<tag>": pulled by digest
    assert spec["annotations"]["teamserve/image-digest"] == DIGEST
    assert spec["modelURL"] == "teamserve/tiny-llama"
    assert spec["modelRevision"] == MODEL["revision"]
    assert spec["name"] == "tiny"
    assert (spec["replicaCount"], spec["requestGPU"]) == (1, 1)
    config = spec["vllmConfig"]
    assert config["maxModelLen"] == 2048 and config["maxNumSeqs"] == 8
    assert config["gpuMemoryUtilization"] == 0.9
    assert config["enablePrefixCaching"] is True and config["enableChunkedPrefill"] is True
    assert config["tensorParallelSize"] == 1


def test_extra_args_carry_every_other_flag_token_for_token(snapshot):
    argv = render(snapshot)
    extra = spec_of(values_for(argv))["vllmConfig"]["extraArgs"]
    assert extra[extra.index("--kv-cache-dtype") + 1] == "auto"
    assert extra[extra.index("--structured-outputs-config") + 1] == STRUCTURED  # one token, JSON intact
    assert json.loads(extra[extra.index("--override-generation-config") + 1]) == {"max_new_tokens": 1500}
    assert extra[extra.index("--served-model-name") + 1] == "tiny"
    assert "--enable-auto-tool-choice" in extra and extra[extra.index("--tool-call-parser") + 1] == "pythonic"
    # The chart's own (--host, --port), the key (--config holds it) and what moved into keys are not repeated.
    for flag in ("--port", "--config", "--api-key", "--max-model-len", "--max-num-seqs", "--revision",
                 "--enable-prefix-caching", "--tensor-parallel-size", "--gpu-memory-utilization"):
        assert flag not in extra
    # Everything else is there, in the argv's order.
    dropped = {"--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--enable-prefix-caching",
               "--enable-chunked-prefill", "--tensor-parallel-size", "--revision", "--config", "--port"}
    kept, skip = [], False
    for token in argv[1:]:
        if token.startswith("--"):
            skip = token in dropped
        if not skip:
            kept.append(token)
    assert extra == kept


def test_the_engine_key_is_never_written(snapshot):
    argv = render(snapshot, extra_args=("--api-key", KEY))
    values = values_for(argv, {"api_key_secret": {"secretName": "llm-key", "secretKey": "k"}})
    text = yaml.safe_dump(values) + handover.teamserve_production_stack_header(values, {}, "box", argv)
    assert KEY not in text and "--api-key" not in yaml.safe_dump(values)
    assert values["servingEngineSpec"]["vllmApiKey"] == {"secretName": "llm-key", "secretKey": "k"}
    assert "--api-key <hidden>" in handover.teamserve_production_stack_header(values, {}, "box", argv)


def test_the_key_reference_defaults_to_a_named_secret(snapshot):
    values = values_for(render(snapshot))
    assert values["servingEngineSpec"]["vllmApiKey"] == {"secretName": "teamserve-vllm-api-key", "secretKey": "api-key"}
    with pytest.raises(AnsibleFilterError, match="options.api_key_secret: expected {secretName"):
        values_for(render(snapshot), {"api_key_secret": KEY})


def test_two_gpus_request_two_and_set_tensor_parallel_two(snapshot):
    spec = spec_of(values_for(render(snapshot, {"tensor-parallel-size": 2}), {"replica_count": "3"}))
    assert spec["requestGPU"] == 2 and spec["vllmConfig"]["tensorParallelSize"] == 2
    assert spec["replicaCount"] == 3


def test_tensor_parallel_alias_and_pipeline_parallel_multiply_the_gpus():
    argv = ["m/x", "--enable-prefix-caching", "-tp", "2", "--pipeline-parallel-size", "2"]
    spec = spec_of(values_for(argv, plan={}))
    assert spec["vllmConfig"]["tensorParallelSize"] == 2 and spec["requestGPU"] == 4
    assert spec["vllmConfig"]["extraArgs"] == ["--pipeline-parallel-size", "2"]


def test_tensor_parallel_from_the_plan_when_the_argv_has_none():
    spec = spec_of(values_for(["m/x", "--enable-prefix-caching"], plan={"flags": {"tensor-parallel-size": 2}}))
    assert spec["requestGPU"] == 2 and spec["vllmConfig"]["tensorParallelSize"] == 2


@pytest.mark.parametrize(("extra", "flag"), [
    (("--ssl-keyfile", "/etc/k.pem"), "--ssl-keyfile"),
    (("--uds", "/run/vllm.sock"), "--uds"),
    (("--headless",), "--headless"),
    (("--nnodes", "2"), "--nnodes"),
])
def test_a_flag_the_chart_cannot_express_is_refused_by_name(snapshot, extra, flag):
    with pytest.raises(AnsibleFilterError, match=rf"'{flag}' cannot be expressed in production-stack's chart 0.1.12"):
        values_for(render(snapshot, extra_args=extra))


def test_a_box_chat_template_needs_its_text(snapshot):
    argv = render(snapshot, {"chat-template": "/run/teamserve/chat-template.jinja"})
    with pytest.raises(AnsibleFilterError, match="'--chat-template' names a file mounted on the box"):
        values_for(argv)
    text = (REPO / "tests/unit/fixtures/chat-template.jinja").read_text()
    spec = spec_of(values_for(argv, {"chat_template": text}))
    assert spec["chatTemplate"] == "chat-template.jinja" and "--chat-template" not in spec["vllmConfig"]["extraArgs"]


@pytest.mark.parametrize("text", [
    (REPO / "tests/unit/fixtures/chat-template.jinja").read_text(),
    "\n{{ messages[0].content }}\n\n",
    "  {% for m in messages %}{{ m.role }}\n{% endfor %}",
    "{%- if add_generation_prompt %}{{ bos_token }}{% endif %}\n\n\n",
])
def test_the_chat_template_renders_as_on_the_box_after_the_charts_block_scalar(text):
    """The chart writes the ConfigMap with `|-` after `nindent`: a newline before, trailing newlines cut."""
    in_configmap = ("\n" + handover.chart_chat_template(text)).rstrip("\n")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders templates
    context = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
               "bos_token": "<s>", "eos_token": "</s>"}
    assert env.from_string(in_configmap).render(**context) == env.from_string(text).render(**context)


def test_prefix_caching_must_be_stated(snapshot):
    """The chart passes --no-enable-prefix-caching when the key is unset: the handover does not guess."""
    with pytest.raises(AnsibleFilterError, match="neither --enable-prefix-caching nor --no-enable-prefix-caching"):
        values_for(render(snapshot, {"enable-prefix-caching": None}))
    spec = spec_of(values_for(render(snapshot, {"enable-prefix-caching": False})))
    assert spec["vllmConfig"]["enablePrefixCaching"] is False


def test_values_outside_the_charts_keys_stay_in_extra_args():
    argv = ["m/x", "--enable-prefix-caching", "--max-model-len", "32k", "--runner", "generate", "--dtype", "bfloat16"]
    config = spec_of(values_for(argv, plan={}))["vllmConfig"]
    assert config["extraArgs"] == ["--max-model-len", "32k", "--runner", "generate"]
    assert config["dtype"] == "bfloat16" and "maxModelLen" not in config and "runner" not in config


def test_a_mapped_flag_given_twice_is_refused():
    with pytest.raises(AnsibleFilterError, match="'-tp' repeats '--tensor-parallel-size'"):
        values_for(["m/x", "--enable-prefix-caching", "--tensor-parallel-size", "2", "-tp", "2"], plan={})


@pytest.mark.parametrize(("served", "release", "name"), [
    ("Llama-3.1-8B_Instruct", "vllm", "llama-3-1-8b-instruct"),
    ("x" * 80, "vllm", "x" * 43),
    ("a" * 50, "teamserve-prod", "a" * 33),
])
def test_the_model_name_is_a_dns_label_that_fits_the_charts_object_names(served, release, name):
    values = handover.teamserve_production_stack_values(["m/x", "--enable-prefix-caching"], IMAGE, {},
                                                        {"served_model_name": served}, {"release_name": release})
    assert spec_of(values)["name"] == name
    assert len(f"{release}-{name}-engine-service") <= 63


def test_options_are_checked():
    argv = ["m/x", "--enable-prefix-caching"]
    with pytest.raises(AnsibleFilterError, match=r"options.name: 'Tiny_Model' must be a DNS-1123 label"):
        values_for(argv, {"name": "Tiny_Model"})
    with pytest.raises(AnsibleFilterError, match=r"options: \['replicas'\] are not options"):
        values_for(argv, {"replicas": 2})
    with pytest.raises(AnsibleFilterError, match="options.env: 'HF_TOKEN' looks like a secret"):
        values_for(argv, {"env": {"HF_TOKEN": "hf_x"}})
    with pytest.raises(AnsibleFilterError, match="vllm_image_parts.digest is empty"):
        handover.teamserve_production_stack_values(argv, {**IMAGE, "digest": ""}, {}, MODEL)
    env = spec_of(values_for(argv, {"env": {"VLLM_MAX_N_SEQUENCES": 4, "MAX_TOKENS_HINT": "x"}}))["env"]
    assert env == [{"name": "MAX_TOKENS_HINT", "value": "x"}, {"name": "VLLM_MAX_N_SEQUENCES", "value": "4"}]


def test_the_validator_rejects_an_unknown_key_with_its_path(snapshot):
    values = values_for(render(snapshot))
    spec_of(values)["vllmConfig"]["maxNumSeq"] = 8
    with pytest.raises(AnsibleFilterError,
                       match=r"^values.servingEngineSpec.modelSpec\[0\].vllmConfig.maxNumSeq: not a key of "
                             r"production-stack's chart 0.1.12"):
        handover.teamserve_production_stack_check(values)


@pytest.mark.parametrize(("path", "value", "match"), [
    (("vllmConfig", "maxModelLen"), "2048", r"modelSpec\[0\].vllmConfig.maxModelLen: expected integer, got '2048'"),
    (("replicaCount",), True, r"modelSpec\[0\].replicaCount: expected integer, got True"),
    (("vllmConfig", "extraArgs"), ["--seed", 3], r"vllmConfig.extraArgs\[1\]: expected string, got 3"),
    (("vllmConfig", "runner"), "generate", r"vllmConfig.runner: 'generate' is not one of \['auto', 'pooling'\]"),
    (("annotations",), {"a": 1}, r"modelSpec\[0\].annotations: expected a mapping of strings to strings"),
    (("hf_token",), "hf_secret", r"modelSpec\[0\].hf_token: expected a mapping, got str"),
])
def test_the_validator_rejects_a_wrong_type_with_its_path(snapshot, path, value, match):
    values = values_for(render(snapshot))
    target = spec_of(values)
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(AnsibleFilterError, match=match):
        handover.teamserve_production_stack_check(values)


def test_the_validator_refuses_a_key_in_place_of_its_reference(snapshot):
    values = values_for(render(snapshot))
    values["servingEngineSpec"]["vllmApiKey"] = KEY
    with pytest.raises(AnsibleFilterError, match="values.servingEngineSpec.vllmApiKey: expected a mapping"):
        handover.teamserve_production_stack_check(values)
    values = values_for(render(snapshot))
    spec_of(values)["vllmConfig"]["extraArgs"] += ["--api-key", KEY]
    with pytest.raises(AnsibleFilterError, match=r"extraArgs\[\d+\]: '--api-key' does not belong here"):
        handover.teamserve_production_stack_check(values)


def test_yaml_round_trip_of_the_written_file(snapshot):
    argv = render(snapshot)
    values = values_for(argv)
    pins = {"vllm_version": "0.32.0", "vllm_image_digest": DIGEST, "vllm_model_revision": MODEL["revision"],
            "monitoring_dcgm_exporter_digest": ""}
    header = handover.teamserve_production_stack_header(values, pins, "teamserve-box", argv)
    text = header + to_nice_yaml(values, indent=2, sort_keys=False)
    assert all(line.startswith("#") for line in header.splitlines())
    assert "vllm-stack --version 0.1.12" in header and f"vllm_image_digest: {DIGEST}" in header
    assert "monitoring_dcgm_exporter_digest: (not pinned)" in header
    loaded = yaml.safe_load(text)
    assert loaded == values
    extra = spec_of(loaded)["vllmConfig"]["extraArgs"]
    assert all(isinstance(token, str) for token in extra) and "2048" in extra  # numbers stay argv strings
    handover.teamserve_production_stack_check(loaded)


def test_the_filters_are_registered():
    assert set(handover.FilterModule().filters()) == {
        "teamserve_production_stack_values", "teamserve_production_stack_check", "teamserve_production_stack_header"}


def test_the_playbook_writes_the_values_file_and_check_mode_writes_nothing(tmp_path):
    """playbooks/handover.yml on the example inventory, the box being this machine (nothing on it changes)."""
    out = tmp_path / "handover"
    extra = {"ansible_connection": "local", "ansible_become": False, "ansible_python_interpreter": sys.executable,
             "vault_vllm_api_key": KEY, "vault_vllm_hf_token": "hf_test_token_value",
             "vllm_image_digest": DIGEST, "vllm_model_revision": "0123456789abcdef0123456789abcdef01234567",
             "vllm_data_dir": str(tmp_path / "data"), "teamserve_handover_dir": str(out),
             "teamserve_handover_replicas": 2}
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"}

    def play(*args: str) -> str:
        run = subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                              str(REPO / "inventories/example"), "-e", f"@{tmp_path / 'extra.json'}",
                              str(REPO / "playbooks/handover.yml"), *args],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return run.stdout

    assert "Would write" in play("--check") and not out.exists()
    written = out / "gpu-workstation-production-stack-values.yaml"
    assert f"Wrote {written}" in play()
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    text = written.read_text()
    assert KEY not in text and "hf_test_token_value" not in text
    values = yaml.safe_load(text)
    spec = spec_of(values)
    assert spec["modelURL"] == "meta-llama/Llama-3.1-8B-Instruct" and spec["replicaCount"] == 2
    assert spec["hf_token"] == {"secretName": "teamserve-hf-token", "secretKey": "token"}
    assert text.startswith("# vLLM production-stack values") and "#   vllm_version: 0.32.0" in text
    assert "changed=0" in play()  # a second run rewrites nothing
