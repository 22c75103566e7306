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
