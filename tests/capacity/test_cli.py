"""``teamserve-plan``: exit codes, refusals and the flags, run in-process (``main()``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from teamserve_capacity import GIB
from teamserve_capacity.cli import main

from .conftest import CONFIGS

LLAMA = str(CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json")
BASE = ["plan", "--config", LLAMA, "--avg-context", "4000", "--max-context", "32768"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    status, out, _ = _run(capsys, argv + ["--json"])
    return status, json.loads(out)


@pytest.mark.parametrize("as_json", [False, True])
def test_exit_codes_are_the_same_in_text_and_json(capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    extra = ["--json"] if as_json else []
    assert _run(capsys, BASE + ["--concurrent", "16"] + extra)[0] == 0
    status, out, _ = _run(capsys, BASE + ["--concurrent", "4000"] + extra)
    assert status == 1 and "does not fit" in out
    status, out, err = _run(capsys, BASE + ["--concurrent", "0"] + extra)
    assert status == 2 and "vllm_workload.concurrent_sequences" in err
    if as_json:
        error = json.loads(out)["error"]
        assert error["field"] == "vllm_workload.concurrent_sequences" and error["value"] == 0 and error["fix"]
    with pytest.raises(SystemExit) as usage:
        main(BASE + ["--no-such-flag"] + extra)
    assert usage.value.code == 2


def test_input_with_other_flags_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"model": {"name": "l", "config": json.loads(Path(LLAMA).read_text())},
                                "workload": {"concurrent_sequences": 4, "avg_context_tokens": 1000,
                                             "max_context_tokens": 4096},
                                "gpus": [{"name": "NVIDIA L40S", "memory_total_mib": 46068, "compute_cap": "8.9"}]}))
    status, out = _json(capsys, ["plan", "--input", str(path)])
    assert status == 0 and out["numbers"]["gpu_total_gib"] == 44.42
    status, _, err = _run(capsys, ["plan", "--input", str(path), "--gpu-mib", "24576", "--concurrent", "9"])
    assert status == 2 and "--input" in err and "--gpu-mib" in err and "--concurrent" in err


def test_gpu_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _json(capsys, BASE + ["--gpu", "a100-80gb"])
    n = out["numbers"]
    assert status == 0 and n["gpu"] == "NVIDIA A100-SXM4-80GB" and n["gpu_total_gib"] == 79.15
    assert n["compute_cap"] == "8.0" and n["gpu_class"] == "datacenter"
    status, _, err = _run(capsys, BASE + ["--gpu", "tpu-v9"])
    assert status == 2 and "known GPUs: rtx-pro-6000" in err and "--gpu-mib" in err
    status, _, err = _run(capsys, BASE + ["--gpu", "l40s", "--gpu-mib", "46068"])
    assert status == 2 and "drop --gpu-mib" in err


def test_another_gpu_by_size_shows_no_default_name(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _json(capsys, BASE + ["--gpu-mib", "65536", "--compute-cap", "9.0"])
    assert status == 0 and out["numbers"]["gpu"] == "GPU (65,536 MiB)"
    assert out["numbers"]["sources"]["total"].startswith("estimated")
    assert "RTX PRO" not in out["table"]
    status, _, err = _run(capsys, BASE + ["--gpu-mib", "65536"])
    assert status == 2 and "--compute-cap" in err
    # a total only one card of the table has is planned as that card, and the report says which
    status, out = _json(capsys, BASE + ["--gpu-mib", "97887"])
    assert status == 0 and out["numbers"]["gpu"] == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    assert out["numbers"]["compute_cap"] == "12.0" and out["numbers"]["gpu_total_gib"] == 94.97
    status, out = _json(capsys, BASE + ["--gpu-mib", "97887", "--compute-cap", "12.0"])
    assert out["numbers"]["gpu"] == "GPU (97,887 MiB)" and out["numbers"]["gpu_total_gib"] < 94.97
    status, _, err = _run(capsys, BASE + ["--compute-cap", "9.0"])
    assert status == 2 and "--gpu-mib" in err


def test_default_gpu_is_the_roles(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _json(capsys, BASE)
    assert out["numbers"]["gpu"] == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def test_measured_weights_and_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _json(capsys, BASE + ["--measured-weights-gib", "15.5", "--max-num-seqs", "48",
                                   "--max-num-batched-tokens", "4096"])
    assert out["numbers"]["weights_gib"] == 15.5 and out["numbers"]["sources"]["weights"] == "measured"
    assert out["flags"]["max-num-seqs"] == 48 and out["flags"]["max-num-batched-tokens"] == 4096
    status, _, err = _run(capsys, BASE + ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"])
    assert status == 2 and "vllm_engine.max_num_batched_tokens" in err
    status, out = _json(capsys, BASE + ["--concurrent", "16", "--max-num-seqs", "8"])
    assert status == 1 and "--max-num-seqs 8" in out["verdict"]
    assert any("vllm_engine.max_num_seqs" in lever for lever in out["levers"])
    assert _run(capsys, BASE + ["--measured-weights-gib", "0"])[0] == 2


def test_users_give_concurrent_sequences_with_the_assumption_printed(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, BASE + ["--users", "20"])
    assert status == 0 and "20 users x 0.25 active at once" in out and "5 sequences" in out
    assert "far fewer than ten concurrent generations" in out
    _, data = _json(capsys, BASE + ["--users", "10", "--active-fraction", "0.5"])
    assert data["numbers"]["concurrent_sequences"] == 5 and "(given)" in data["numbers"]["concurrency_assumption"]
    assert _run(capsys, BASE + ["--users", "10", "--concurrent", "4"])[0] == 2
    assert _run(capsys, BASE + ["--active-fraction", "0.5"])[0] == 2
    assert _run(capsys, BASE + ["--users", "10", "--active-fraction", "1.5"])[0] == 2


def test_checkpoint_file_and_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 16060522496}, "weight_map": {}}))
    _, out = _json(capsys, BASE + ["--checkpoint", str(index), "--revision", "0e9e39f2"])
    assert out["numbers"]["weights_source"] == ("checkpoint: safetensors index metadata.total_size "
                                                "(local file @0e9e39f2)")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    _, out = _json(capsys, BASE + ["--checkpoint", str(snapshot)])
    assert out["numbers"]["weights_source"] == "checkpoint: 1 safetensors files (local directory)"
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([{"type": "file", "path": "model.safetensors", "size": 8 * GIB}]))
    _, out = _json(capsys, BASE + ["--checkpoint", str(tree)])
    assert out["numbers"]["weights_gib"] == 8.0 and "(hub listing)" in out["numbers"]["weights_source"]
    assert _run(capsys, BASE + ["--checkpoint", str(tmp_path / "missing.json")])[0] == 2


def test_bad_files_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    status, _, err = _run(capsys, ["plan", "--config", str(bad)])
    assert status == 2 and "--config" in err
    assert _run(capsys, ["plan", "--config", str(tmp_path / "none.json")])[0] == 2
    assert _run(capsys, ["plan"])[0] == 2


def test_untrusted_users_flag_adds_the_advice(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _json(capsys, BASE + ["--concurrent", "16"])
    assert out["advice"] == []
    _, out = _json(capsys, BASE + ["--concurrent", "16", "--untrusted-users"])
    assert [a["id"] for a in out["advice"]] == ["untrusted_users"]


def test_gpus_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, ["gpus"])
    assert status == 0 and "rtx-pro-6000" in out and "94.97 GiB" in out and "estimated" in out
    status, out, _ = _run(capsys, ["gpus", "--json"])
    rows = json.loads(out)
    assert status == 0 and {r["key"] for r in rows} >= {"h200", "l40s", "rtx-3090"}


def test_gpu_reserved_mib_gives_the_exact_total(capsys: pytest.CaptureFixture[str]) -> None:
    """nvidia-smi memory.reserved of the box: memory.total - memory.reserved, on a known or another card."""
    status, out = _json(capsys, BASE + ["--gpu", "h200", "--gpu-reserved-mib", "616"])
    assert status == 0 and out["numbers"]["gpu_total_gib"] == round(143_155 / 1024, 2)
    assert "memory.reserved 616 MiB" in out["numbers"]["sources"]["total"]
    status, out = _json(capsys, BASE + ["--gpu-mib", "65536", "--compute-cap", "9.0", "--gpu-reserved-mib", "500"])
    assert status == 0 and out["numbers"]["gpu_total_gib"] == round((65536 - 500) / 1024, 2)
    for bad in ("-1", "143771"):
        status, _, err = _run(capsys, BASE + ["--gpu", "h200", "--gpu-reserved-mib", bad])
        assert status == 2 and "--gpu-reserved-mib" in err and "memory.reserved" in err
