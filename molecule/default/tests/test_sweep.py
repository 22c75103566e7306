"""playbooks/sweep.yml on the testbed box (run by side_effect.yml with the team-shaped prompts of
tests/fixtures/sweep-prompts.jsonl): the JSON holds a knee found from the real CPU engine's steps, the PNG
was drawn from the same numbers (read back from the data it carries), and the box's history has the sweep
with the pins site.yml recorded."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from teamserve_capacity import sweep
from teamserve_capacity.sweep_plot import read

testinfra_hosts = ["ansible://teamserve-box"]

SWEEP_DIR = pathlib.Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")) / "sweep"
PROMPTS = pathlib.Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "sweep-prompts.jsonl"


@pytest.fixture(scope="module")
def document() -> dict:
    files = sorted(SWEEP_DIR.glob("teamserve-box-*.json"))
    assert files, f"no sweep JSON in {SWEEP_DIR}: did side_effect (playbooks/sweep.yml) run?"
    return json.loads(files[-1].read_text())


def test_every_step_served_every_request_and_was_sampled(document):
    steps = document["steps"]
    concurrencies = [s["concurrency"] for s in steps]
    assert concurrencies == sorted(concurrencies) and concurrencies[0] == 1
    assert 2 * document["plan"]["concurrent_sequences"] in concurrencies  # on to twice the plan
    for step in steps:
        assert step["failed"] == 0 and step["completed"] == step["prompts"] > 0, step
        ttft, tpot = step["ttft_seconds"], step["tpot_seconds"]
        assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"], (step["concurrency"], ttft)
        # A stream whose tokens reach the client in one burst (the client waited for the CPU while the engine
        # went on) has a TPOT of 0: seen on a fast machine, at p50 of a step whose TTFT was 30 times its
        # neighbours'; rare since the engine's lower CPU weight (vllm_cpu_shares).
        assert 0 <= tpot["p50"] <= tpot["p95"] <= tpot["p99"], (step["concurrency"], tpot)
        # The engine's KV usage is sampled while the step runs; a step of a few hundred milliseconds (a fast
        # machine) can fall between two samples.
        assert step["samples"] > 0 and 0 <= step["kv_cache_usage_peak"] < 1
        assert step["running_peak"] <= document["plan"]["max_num_seqs"]
        assert step["output_throughput"] > 0 and step["request_goodput"] is not None
    assert any(step["tpot_seconds"]["p50"] > 0 for step in steps), steps  # the token gaps were measured
    assert any(step["kv_cache_usage_peak"] > 0 for step in steps), steps  # and the KV cache's use
    # Above --max-num-seqs the engine queues: the deepest step saw requests waiting, in the sampled gauge or
    # in the engine's queue-time histogram (every finished request is counted there; a step of a second or
    # two on a fast machine can show the gauge at 0 in all of its samples).
    deepest = steps[-1]
    if deepest["concurrency"] > document["plan"]["max_num_seqs"]:
        assert deepest["queue_peak"] >= 1 or deepest["queued"] >= 1, deepest


def test_the_knee_is_the_one_the_steps_give(document):
    for percentile in ("p95", "p99"):
        again = sweep.knee(document["steps"], document["targets"], percentile)
        recorded = document["knee"][percentile]
        assert {k: recorded[k] for k in ("concurrency", "first_break", "never_broke")} == \
               {k: again[k] for k in ("concurrency", "first_break", "never_broke")}
    knee = document["knee"]["p95"]
    assert knee["concurrency"] is not None and knee["first_break"] is not None, knee
    assert document["recommendation"]["summary"] and document["stopped"]
    assert any(line.startswith("knee (p95): ") for line in document["report"])


def test_prompt_lengths_are_the_files_and_compared_with_the_plan(document):
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.startswith("{")]
    lengths = document["lengths"]
    assert lengths["requests"] == sum(s["completed"] for s in document["steps"])
    assert 0 < lengths["prompt"]["p50"] <= lengths["prompt"]["p95"] <= lengths["prompt"]["max"]
    assert lengths["output"]["mean"] == document["settings"]["output_tokens"]  # --ignore-eos
    assert document["settings"]["dataset"] == "file" and len(prompts) == 20
    context = document["context"]
    assert context["plan_avg_context_tokens"] == 1000 and context["measured_context_tokens"] == lengths["context_mean"]
    assert context["holds"] == (lengths["context_mean"] <= 1000)


def test_the_plot_shows_the_steps_targets_plan_and_knee(document):
    pngs = sorted(SWEEP_DIR.glob("teamserve-box-*.png"))
    assert pngs, f"no sweep PNG in {SWEEP_DIR}"
    data = read(str(pngs[-1]))
    xs = [float(s["concurrency"]) for s in document["steps"]]
    for metric in ("ttft", "tpot"):
        for percentile in ("p50", "p95", "p99"):
            series = data[f"{metric}:{percentile}"]
            assert series["x"] == xs
            assert series["y"] == [s[f"{metric}_seconds"][percentile] for s in document["steps"]]
        assert data[f"{metric}:target"]["y"] == [document["targets"][f"{metric}_seconds"]] * 2
        assert data[f"{metric}:plan"]["x"] == [float(document["plan"]["concurrent_sequences"])] * 2
        assert data[f"{metric}:max-num-seqs"]["x"] == [float(document["plan"]["max_num_seqs"])] * 2
        assert data[f"{metric}:knee"]["x"] == [float(document["knee"]["p95"]["concurrency"])] * 2


def test_the_box_keeps_the_sweep_with_the_pins_in_force(host, document):
    lines = host.file("/var/lib/teamserve/sweeps.jsonl").content_string.splitlines()
    recorded = [json.loads(line) for line in lines if json.loads(line).get("at") == document["at"]]
    assert len(recorded) == 1 and recorded[0]["kind"] == "sweep"
    pins = json.loads(host.file("/var/lib/teamserve/lock.json").content_string)["pins"]
    assert recorded[0]["pins"] == pins and recorded[0]["knee"]["p95"]["concurrency"] == document["knee"]["p95"]["concurrency"]
    assert "input_lens" not in recorded[0]["steps"][0]
    assert host.file("/var/lib/teamserve/sweeps.jsonl").mode == 0o640
    assert not host.file("/var/lib/teamserve/verify/bench.key").exists  # removed after the runs
