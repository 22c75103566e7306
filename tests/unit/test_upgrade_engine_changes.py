"""What new pins change in the engine, as the upgrade shows it (roles/teamserve_upgrade/filter_plugins)."""

from __future__ import annotations

from repo_modules import load

upgrade = load("teamserve_upgrade_filters", "roles/teamserve_upgrade/filter_plugins/teamserve_upgrade.py")

OLD = {"vllm_version": "0.31.0", "kv_tokens": 120000, "max_num_seqs": 8, "max_model_len": 8192,
       "argv": ["org/m", "--max-model-len", "8192", "--max-num-seqs", "8", "--enable-prefix-caching",
                "--kv-cache-dtype", "auto", "--seed=1", "--mamba-cache-mode", "all"]}


def test_names_the_release_the_numbers_and_each_flag():
    new = {"vllm_version": "0.32.0", "kv_tokens": 118000, "max_num_seqs": 8, "max_model_len": 8192,
           "argv": ["org/m", "--max-model-len", "8192", "--max-num-seqs", "8", "--enable-prefix-caching",
                    "--kv-cache-dtype", "fp8", "--seed=2", "--grpc-port", "50051"]}
    assert upgrade.teamserve_engine_changes(OLD, new) == [
        "vLLM: 0.31.0 -> 0.32.0",
        "KV cache tokens: 120000 -> 118000 (-1.7 %)",
        "--kv-cache-dtype: auto -> fp8",
        "--seed: 1 -> 2",
        "flag added: --grpc-port 50051",
        "flag removed: --mamba-cache-mode all",
    ]


def test_same_engine_says_so_and_a_box_without_a_record_is_told_apart():
    assert upgrade.teamserve_engine_changes(OLD, dict(OLD)) == ["no change to the engine's plan or flags"]
    for recorded in (None, {}):
        assert upgrade.teamserve_engine_changes(recorded, OLD)[0].startswith("the box recorded no engine plan")


def test_a_negative_value_is_a_value_not_a_flag():
    old = {**OLD, "argv": ["m", "--seed", "-1"]}
    new = {**OLD, "argv": ["m", "--seed", "-2"]}
    assert upgrade.teamserve_engine_changes(old, new) == ["--seed: -1 -> -2"]


GATEWAY_PINS = ["caddy_version", "caddy_ratelimit_version", "caddy_xcaddy_version", "vllm_model_revision"]
RECORDED = {**OLD, "admission": {"user_max_inflight": 4, "user_fair_share": 2}}


def test_a_new_engine_image_alone_leaves_the_gateway_as_it_is():
    """Same flags, same caps: the upgrade does not re-run the caddy role (nor roll it back)."""
    new = {**RECORDED, "vllm_version": "0.32.0", "kv_tokens": 118000}
    assert upgrade.teamserve_gateway_changes(RECORDED, new, ["vllm_version", "vllm_image_digest"], GATEWAY_PINS) == []


def test_each_input_of_the_gateway_is_named():
    new = {**RECORDED, "argv": [*OLD["argv"], "--scheduling-policy", "priority"],
           "admission": {"user_max_inflight": 2, "user_fair_share": 1}, "max_model_len": 4096}
    assert upgrade.teamserve_gateway_changes(RECORDED, new, ["caddy_version", "vllm_version"], GATEWAY_PINS) == [
        "caddy_version changed", "the engine's flags changed", "the per-user admission changed", "max-model-len changed"]
    assert upgrade.teamserve_gateway_changes(RECORDED, dict(RECORDED), ["vllm_model_revision"], GATEWAY_PINS) == [
        "vllm_model_revision changed"]


def test_a_record_without_the_gateway_fields_always_applies_the_gateway():
    """A box recorded before the admission was kept, or with no record at all."""
    for recorded in (None, {}, OLD):
        assert upgrade.teamserve_gateway_changes(recorded, RECORDED, [], GATEWAY_PINS) == [
            "the box recorded no plan for the gateway"]
