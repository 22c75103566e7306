"""The vllm role's argv rendering and image-pin checks (roles/vllm/filter_plugins/vllm_argv.py)."""

from __future__ import annotations

import json
import pathlib

import pytest
from ansible.errors import AnsibleFilterError
from repo_modules import load

ROLE = pathlib.Path(__file__).resolve().parents[2] / "roles" / "vllm"
vllm_argv = load("vllm_argv", "roles/vllm/filter_plugins/vllm_argv.py")

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def snapshot() -> dict:
    """The committed parser snapshot of the pinned vLLM version (generated from the real package)."""
    return json.loads((ROLE / "files" / "vllm-serve-options-0.32.0.json").read_text())


def test_renders_one_token_per_element(snapshot):
    argv = vllm_argv.vllm_serve_argv(
        {"max-model-len": 8192, "max-num-seqs": 16, "gpu-memory-utilization": 0.9,
         "enable-prefix-caching": True, "quantization": None},
        "org/model-8b-instruct", snapshot)
    assert argv == ["org/model-8b-instruct", "--max-model-len", "8192", "--max-num-seqs", "16",
                    "--gpu-memory-utilization", "0.9", "--enable-prefix-caching"]


def test_false_renders_the_negated_switch(snapshot):
    argv = vllm_argv.vllm_serve_argv({"enable-prefix-caching": False}, "m", snapshot)
    assert argv == ["m", "--no-enable-prefix-caching"]


def test_misspelled_flag_is_refused_with_its_name(snapshot):
    with pytest.raises(AnsibleFilterError, match="'--max-num-seq' is not an option of 'vllm serve' in vLLM 0.32.0"):
        vllm_argv.vllm_serve_argv({"max-num-seq": 16}, "m", snapshot)


def test_removed_flag_is_refused(snapshot):
    """A flag the pinned version no longer has (removed from the snapshot here) fails before deploy."""
    trimmed = dict(snapshot)
    trimmed["options"] = [o for o in snapshot["options"] if o["option"] != "--max-num-seqs"]
    with pytest.raises(AnsibleFilterError, match="--max-num-seqs"):
        vllm_argv.vllm_serve_argv({"max-num-seqs": 16}, "m", trimmed)


def test_value_outside_choices_is_refused(snapshot):
    with pytest.raises(AnsibleFilterError, match="kv-cache-dtype"):
        vllm_argv.vllm_serve_argv({"kv-cache-dtype": "fp7"}, "m", snapshot)


def test_extra_args_are_checked_too(snapshot):
    argv = vllm_argv.vllm_serve_argv({}, "m", snapshot, ["--enforce-eager", "--seed=3"])
    assert argv == ["m", "--enforce-eager", "--seed=3"]
    with pytest.raises(AnsibleFilterError, match=r"vllm_extra_args\[0\]: '--enforce-eagr'"):
        vllm_argv.vllm_serve_argv({}, "m", snapshot, ["--enforce-eagr"])


# What a plan and the role put in argv before the extra args (quantization omitted, as for bf16 weights).
PLANNED = {"max-num-seqs": 8, "max-model-len": 2048, "tensor-parallel-size": 1, "quantization": None,
           "enable-prefix-caching": True, "served-model-name": "tiny", "port": 8000}


@pytest.mark.parametrize(("extra", "match"), [
    (["serve", "--enforce-eager"], r"\[0\]: 'serve' is not a flag: the role runs `vllm serve <model>` itself"),
    (["vllm", "serve"], r"\[0\]: 'vllm' is not a flag: the role runs `vllm serve <model>` itself"),
    (["org/model"], r"\[0\]: 'org/model' is not a flag: the role passes the model \(vllm_model.name\)"),
    (["fast"], r"\[0\]: 'fast' is not a flag: give only flags, each followed by its value"),
    (["--enforce-eager", "true"], r"\[1\]: 'true' is not a flag: '--enforce-eager' is a switch and takes no value"),
    (["--max-log-len", "100", "200"], r"\[2\]: '200' is not a flag: '--max-log-len' takes one value"),
    (["--max-log-len"], r"\[0\]: '--max-log-len' takes a value in vLLM 0.32.0 and none follows it; add the value"),
    (["--max-log-len", "--enforce-eager"], r"\[1\]: '--max-log-len' takes a value .* none follows it"),
    (["--enforce-eager=yes"], r"\[0\]: '--enforce-eager' is a switch and takes no value; write it without '=yes'"),
    (["--dtype", "float64"], r"\[1\]: 'float64' is not one of \[.*'bfloat16'.*\] for '--dtype'"),
    (["--dtype=float64"], r"\[0\]: 'float64' is not one of"),
    (["-tp", "2"], r"\[0\]: '-tp' \(the same option as '--tensor-parallel-size'\) is already set"),
    (["-q", "awq"], r"\[0\]: '-q' \(the same option as '--quantization'\) is already set"),
    (["--no-enable-prefix-caching"], r"'--no-enable-prefix-caching' \(the same option as '--enable-prefix-caching'\)"),
    (["--max-num-seqs", "4"], r"\[0\]: '--max-num-seqs' is already set by the capacity plan, the role or vllm_flags"),
    (["--seed", "1", "--seed", "2"], r"\[2\]: '--seed' is already set"),
    ([8], r"\[0\]: 8 is not a string; quote it"),
])
def test_extra_args_are_read_as_the_engine_would_read_them(snapshot, extra, match):
    """Each refusal names the element, its value and the fix, before the engine would crash-loop on it."""
    with pytest.raises(AnsibleFilterError, match=match):
        vllm_argv.vllm_serve_argv(PLANNED, "org/model", snapshot, extra)


def test_extra_args_that_vllm_accepts_pass(snapshot):
    extra = ["--seed", "-1", "--max-log-len=100", "--enforce-eager", "--hf-token", "--allowed-origins", '["x"]',
             "--api-key", "unused-but-valid", "second"]  # nargs '+' takes several; '?' may stand alone
    argv = vllm_argv.vllm_serve_argv({}, "m", snapshot, extra)
    assert argv == ["m", *extra]


def test_switch_given_a_value_is_refused(snapshot):
    with pytest.raises(AnsibleFilterError, match="takes a value"):
        vllm_argv.vllm_serve_argv({"max-model-len": True}, "m", snapshot)


@pytest.mark.parametrize("ref", [
    "vllm/vllm-openai:v0.32.0",                      # no digest
    "vllm/vllm-openai@" + DIGEST,                     # no tag
    "vllm/vllm-openai:latest@" + DIGEST,              # latest
    "vllm/vllm-openai:v0.32.0@sha256:abc",            # short digest
])
def test_unpinned_images_are_refused(ref):
    with pytest.raises(AnsibleFilterError, match="vllm_image"):
        vllm_argv.vllm_image_ref(ref)


def test_pinned_image_is_split():
    parts = vllm_argv.vllm_image_ref("10.231.0.3:5000/vllm/vllm-openai:v0.32.0@" + DIGEST)
    assert parts == {"repository": "10.231.0.3:5000/vllm/vllm-openai", "tag": "v0.32.0", "digest": DIGEST}


@pytest.fixture(scope="module")
def snapshot_0_31() -> dict:
    return json.loads((ROLE / "files" / "vllm-serve-options-0.31.0.json").read_text())


def test_upgrade_names_a_value_the_running_release_accepted(snapshot, snapshot_0_31):
    """--mamba-cache-mode all: accepted by 0.31.0 (read from its GPU package), gone in 0.32.0."""
    with pytest.raises(AnsibleFilterError, match=r"'all' is not one of \[.*\] in vLLM 0.32.0 \(vLLM 0.31.0, which "
                       r"the box runs, accepts it\)"):
        vllm_argv.vllm_serve_argv({"mamba-cache-mode": "all"}, "m", snapshot, previous=snapshot_0_31)
    with pytest.raises(AnsibleFilterError, match=r"vllm_extra_args\[1\]: 'all' .*0.31.0, which the box runs"):
        vllm_argv.vllm_serve_argv({}, "m", snapshot, ["--mamba-cache-mode", "all"], previous=snapshot_0_31)
    # Without the running release, the plain refusal.
    with pytest.raises(AnsibleFilterError) as plain:
        vllm_argv.vllm_serve_argv({"mamba-cache-mode": "all"}, "m", snapshot)
    assert "box runs" not in str(plain.value)


def test_upgrade_names_a_removed_flag_with_the_old_releases_note(snapshot):
    """A release that drops a flag it had deprecated: the refusal names the release the box runs and
    repeats vLLM's note, which names the replacement (0.32.0 says --log-config-file goes in v0.33.0)."""
    newer = {"vllm_version": "0.33.0",
             "options": [o for o in snapshot["options"] if o["option"] != "--log-config-file"]}
    with pytest.raises(AnsibleFilterError) as refused:
        vllm_argv.vllm_serve_argv({}, "m", newer, ["--log-config-file", "/etc/log.json"], previous=snapshot)
    message = str(refused.value)
    assert message.startswith("vllm_extra_args[0]: '--log-config-file' is not an option of 'vllm serve' in vLLM 0.33.0.")
    assert "vLLM 0.32.0, which the box runs, accepts it; 0.33.0 does not" in message
    assert "Use --logging-config.pylogging_config_file instead" in message and "nothing on the box has changed" in message


def test_deprecated_flags_in_use_are_listed_with_vllms_note(snapshot):
    argv = vllm_argv.vllm_serve_argv({"max-num-seqs": 8}, "m", snapshot, ["--disable-cascade-attn",
                                                                          "--log-config-file=/etc/l.json"])
    notes = vllm_argv.vllm_argv_deprecations(argv, snapshot)
    assert [n.split(":")[0] for n in notes] == ["--disable-cascade-attn", "--log-config-file"]
    assert "has no effect since cascade attention has been removed" in notes[0]
    assert vllm_argv.vllm_argv_deprecations(["m", "--max-num-seqs", "8"], snapshot) == []
