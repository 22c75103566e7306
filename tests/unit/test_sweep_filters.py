"""The capacity sweep's box and controller sides: the metrics sampler run for real against a local /metrics
server, what the engine said during a run, the sweep's inputs from the testbed's real plan, its document
from real bench results, the history line, the baseline the upgrade gate picks and the gate itself."""

from __future__ import annotations

import http.server
import json
import pathlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from repo_modules import REPO, load

from ansible_collections.teamserve.core.plugins.filter import bench
from ansible_collections.teamserve.core.plugins.filter import sweep as sweep_filters
from teamserve_capacity import plan

FIX = pathlib.Path(__file__).resolve().parent / "fixtures" / "verify"
sampler = load("bench_sampler", "roles/teamserve_verify/files/bench_sampler.py")
TESTBED = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/main.yml").read_text())
MODEL = dict(TESTBED["vllm_model"], revision="ef486eba9ff0b47394b3d9daf8a30e736bf68ef8")
BEFORE, AFTER = (FIX / "metrics-before.txt").read_text(), (FIX / "metrics-after.txt").read_text()


def planned() -> dict[str, Any]:
    defaults = yaml.safe_load((REPO / "roles/vllm/defaults/main.yml").read_text())
    return plan(TESTBED["vllm_model"], TESTBED["vllm_workload"], defaults["vllm_gpu_expected"], {})


def settings(**changes: Any) -> dict[str, Any]:
    base = {"concurrencies": [], "bound": 0, "rounds": 4, "min_prompts": 16, "input_tokens": 0, "output_tokens": 256,
            "prompts_file": "", "shared_prefix_tokens": 0, "ttft_p95_seconds": 0, "tpot_seconds": 0,
            "api_endpoint": "/v1/chat/completions"}
    return {**base, **changes}


class Metrics:
    """A local /metrics server whose KV cache gauge and waiting queue rise with every scrape."""

    def __init__(self) -> None:
        self.scrapes = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                owner.scrapes += 1
                n = owner.scrapes
                body = (f'# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n'
                        f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {min(n, 9) / 100}\n'
                        f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {n % 4}\n'
                        f'vllm:num_requests_running{{engine="0",model_name="tiny"}} 2.0\n'
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {1000 * n}\n'
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {250 * n}\n'
                        f'vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {7 * n}\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def metrics() -> Iterator[Metrics]:
    server = Metrics()
    yield server
    server.server.shutdown()


def test_sampler_records_the_engine_while_the_command_runs(metrics, tmp_path):
    out = tmp_path / "samples.json"
    status = sampler.main(["--metrics-url", metrics.url, "--interval", "0.1", "--keep", "vllm:kv_cache_usage_perc",
                           "--keep", "vllm:num_requests_waiting", "--output", str(out), "--",
                           sys.executable, "-c", "import time, sys; time.sleep(0.6); sys.exit(3)"])
    assert status == 3
    sampled = json.loads(out.read_text())
    assert sampled["exit_code"] == 3 and 0.5 < sampled["seconds"] < 5
    assert len(sampled["samples"]) >= 3
    kept = {line.split("{")[0] for s in sampled["samples"] for line in s["lines"].splitlines()}
    assert kept == {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"}
    assert "vllm:prefix_cache_hits_total" in sampled["before"] and "vllm:prefix_cache_hits_total" in sampled["after"]
    during = bench.engine_during(sampled)
    last = metrics.scrapes - 1  # the after scrape is not a sample
    assert during["kv_cache_usage_peak"] == pytest.approx(min(last, 9) / 100)
    assert during["waiting_peak"] == 3 and during["running_peak"] is None  # running was not kept
    assert during["prefix_cache_hit_rate"] == 0.25 and during["samples"] == len(sampled["samples"])


def test_sampler_records_an_engine_that_goes_away_instead_of_stopping(tmp_path):
    server = Metrics()

    def stop() -> None:
        server.server.shutdown()
        server.server.server_close()

    threading.Timer(0.25, stop).start()
    result = sampler.run([sys.executable, "-c", "import time; time.sleep(0.8)"], server.url, 0.1,
                         ("vllm:kv_cache_usage_perc",), 0.5)
    assert result["exit_code"] == 0 and result["after"] == ""
    assert any("lines" in s for s in result["samples"]) and any("error" in s for s in result["samples"])
    assert result["samples"][-1]["error"].startswith("after: ")
    with pytest.raises(AnsibleFilterError, match="did the engine stop"):
        bench.bench_step(1, json.loads((FIX / "bench-c8.json").read_text()), result, 0.3)


def test_engine_during_real_scrapes_and_bad_input():
    sampled = {"before": BEFORE, "after": AFTER, "seconds": 1.0,
               "samples": [{"t": 0.1, "lines": 'vllm:kv_cache_usage_perc{engine="0"} 0.012\nvllm:num_requests_waiting{engine="0"} 4.0'},
                           {"t": 0.2, "error": "timed out"}]}
    during = bench.engine_during(sampled)
    assert during["kv_cache_usage_peak"] == 0.012 and during["waiting_peak"] == 4 and during["scrape_errors"] == 1
    assert during["preemptions"] == 0 and 0 <= (during["prefix_cache_hit_rate"] or 0) <= 1
    with pytest.raises(AnsibleFilterError, match="bench_sampler"):
        bench.engine_during({"before": ""})


def real_run(concurrency: int, name: str, **fields: Any) -> dict[str, Any]:
    result = {**json.loads((FIX / name).read_text()), **fields}
    sampled = {"before": BEFORE, "after": AFTER, "seconds": 2.0,
               "samples": [{"t": 0.5, "lines": 'vllm:kv_cache_usage_perc{engine="0"} 0.004'}]}
    return bench.bench_step(concurrency, result, sampled, 0.3)


def test_bench_step_keeps_lengths_and_refuses_an_engine_that_went_away():
    run = real_run(8, "bench-c8.json", input_lens=[100, 120], output_lens=[16, 16])
    assert run["engine"]["kv_cache_usage_peak"] == 0.004 and run["input_lens"] == [100, 120]
    with pytest.raises(AnsibleFilterError, match="did the engine stop"):
        bench.bench_step(8, json.loads((FIX / "bench-c8.json").read_text()), {"before": BEFORE, "after": ""}, 0.3)


def test_sweep_inputs_from_the_testbeds_plan():
    inputs = sweep_filters.sweep_inputs(planned(), TESTBED["vllm_workload"], MODEL, settings())
    # 8 expected, --max-num-seqs 8, --max-num-queued-reqs 32: powers of two to the engine's queue
    assert inputs["steps"] == [1, 2, 4, 8, 16, 32] and inputs["bound"] == 32
    ttft, tpot = TESTBED["vllm_workload"]["ttft_p95_seconds"], TESTBED["vllm_workload"]["tpot_seconds"]
    assert inputs["targets"] == {"ttft_seconds": ttft, "tpot_seconds": tpot} and inputs["targets_source"] == "vllm_workload"
    assert inputs["input_tokens"] == 1000 - 256 and inputs["dataset"] == "random" and inputs["plain_args"] is None
    assert inputs["args"][:4] == ["--dataset-name=random", "--random-input-len=744", "--random-output-len=256",
                                  "--random-range-ratio=0"]
    goodput = ["--goodput", f"ttft:{ttft * 1000:g}", f"tpot:{tpot * 1000:g}"]
    assert inputs["args"][-3:] == goodput and "--ignore-eos" in inputs["args"]
    assert inputs["tokenizer"].endswith("models--teamserve--tiny-llama/snapshots/" + MODEL["revision"])


def test_sweep_bound_is_the_plans_queue_not_a_factor_typed_again():
    """The bound follows the plan's --max-num-queued-reqs wherever it comes from (here a plan whose queue is
    not 4 x the batch), and falls back to --max-num-seqs for a plan that sets no queue."""
    small_queue = planned()
    small_queue["flags"] = {**small_queue["flags"], "max-num-queued-reqs": 12}
    inputs = sweep_filters.sweep_inputs(small_queue, TESTBED["vllm_workload"], MODEL, settings())
    assert inputs["bound"] == 12 and inputs["steps"] == [1, 2, 4, 8]
    no_queue = planned()
    no_queue["flags"] = {k: v for k, v in no_queue["flags"].items() if k != "max-num-queued-reqs"}
    assert sweep_filters.sweep_inputs(no_queue, TESTBED["vllm_workload"], MODEL, settings())["bound"] == 8
    assert sweep_filters.sweep_inputs(small_queue, TESTBED["vllm_workload"], MODEL, settings(bound=5))["bound"] == 5


def test_sweep_inputs_what_if_targets_fixed_steps_and_a_prompts_file():
    inputs = sweep_filters.sweep_inputs(planned(), TESTBED["vllm_workload"], MODEL,
                                 settings(concurrencies=[12, 3, 3], ttft_p95_seconds=1.5,
                                          prompts_file="/run/p/abc.jsonl", api_endpoint="/v1/completions"))
    assert inputs["steps"] == [3, 12] and inputs["targets"]["ttft_seconds"] == 1.5
    assert inputs["targets_source"].endswith("(a what-if)")
    assert inputs["args"][:4] == ["--dataset-name=custom", "--dataset-path=/run/p/abc.jsonl",
                                  "--custom-output-len=256", "--skip-chat-template"]


def test_sweep_inputs_shared_prefix_keeps_the_prompt_length_and_adds_the_plain_run():
    inputs = sweep_filters.sweep_inputs(planned(), TESTBED["vllm_workload"], MODEL, settings(shared_prefix_tokens=600))
    assert "--random-input-len=144" in inputs["args"] and "--random-prefix-len=600" in inputs["args"]
    assert "--random-input-len=744" in inputs["plain_args"] and not any("prefix" in a for a in inputs["plain_args"])


@pytest.mark.parametrize(("changes", "message"), [
    ({"shared_prefix_tokens": 744}, "leaves no random part"),
    ({"shared_prefix_tokens": 10, "prompts_file": "/x.jsonl"}, "applies to random prompts"),
    ({"concurrencies": [0, 4]}, "every step must be >= 1"),
])
def test_sweep_inputs_refuse_what_cannot_work(changes, message):
    with pytest.raises(AnsibleFilterError, match=message):
        sweep_filters.sweep_inputs(planned(), TESTBED["vllm_workload"], MODEL, settings(**changes))


def test_sweep_prompts_are_normalised_for_the_bench_reader():
    text = '# the team\'s prompts\n\n{"prompt": "a", "note": 1}\n{"prompt": "a"}\n{"prompt": "b\\nc"}\n'
    assert sweep_filters.sweep_prompts(text) == '{"prompt": "a"}\n{"prompt": "a"}\n{"prompt": "b\\nc"}\n'
    with pytest.raises(AnsibleFilterError, match="line 2: 'prompt' must be a non-empty string"):
        sweep_filters.sweep_prompts('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(AnsibleFilterError, match="holds no prompts"):
        sweep_filters.sweep_prompts("# nothing\n")


def document(**meta: Any) -> dict[str, Any]:
    """Two real runs of the loaded testbed (TTFT p95 6.6 s at 8, 17.4 s at 16) against what-if targets."""
    inputs = sweep_filters.sweep_inputs(planned(), TESTBED["vllm_workload"], MODEL,
                                 settings(ttft_p95_seconds=10, tpot_seconds=0.6))
    runs = [real_run(8, "bench-c8.json", input_lens=[744] * 4, output_lens=[256] * 4),
            real_run(16, "bench-c16.json", input_lens=[744] * 4, output_lens=[256] * 4)]
    return sweep_filters.sweep_document(runs, inputs, {"kind": "sweep", "host": "box", "at": "2026-12-03T00:00:00Z",
                                                "pins": {"vllm_version": "0.32.0"}, **meta})


def test_sweep_document_from_real_bench_results():
    doc = document()
    c8 = json.loads((FIX / "bench-c8.json").read_text())
    assert [s["concurrency"] for s in doc["steps"]] == [8, 16]
    assert doc["steps"][0]["ttft_seconds"]["p95"] == pytest.approx(c8["p95_ttft_ms"] / 1000, abs=1e-5)
    assert doc["targets"] == {"ttft_seconds": 10.0, "tpot_seconds": 0.6}
    assert (doc["knee"]["p95"]["concurrency"], doc["knee"]["p95"]["first_break"]) == (8, 16)
    assert doc["recommendation"]["max_num_seqs"] == 8 and not doc["recommendation"]["change"]
    assert doc["context"]["measured_context_tokens"] == 1000.0 and doc["context"]["holds"]
    assert doc["prefix_cache"] is None and doc["settings"]["args"][0] == "--dataset-name=random"
    assert "knee (p95): 8 concurrent requests (ttft broke at 16)" in doc["report"]
    assert doc["report"][-1].startswith("context: mean context 1,000 tokens")


def test_history_line_baseline_and_gate():
    doc = document()
    line = sweep_filters.sweep_history(doc)
    assert "input_lens" not in line["steps"][0] and "report" not in line and "fitted" not in line["knee"]["p95"]
    history = "\n".join([json.dumps(sweep_filters.sweep_history(document(at="2026-12-01T00:00:00Z"))),
                         json.dumps(line),
                         json.dumps({"kind": "gate", "pins": {"vllm_version": "0.32.0"}}),
                         "not json",
                         json.dumps(sweep_filters.sweep_history(document(at="2026-12-04T00:00:00Z", pins={"other": 1})))])
    baseline = sweep_filters.sweep_baseline(history, {"vllm_version": "0.32.0"})
    assert baseline is not None and baseline["at"] == "2026-12-03T00:00:00Z"
    assert sweep_filters.sweep_baseline(history, {"vllm_version": "0.31.0"}) is None
    assert sweep_filters.sweep_baseline("", None) is None
    assert sweep_filters.sweep_gate_steps(baseline, 0.25) == [6, 8]
    held = sweep_filters.sweep_gate(baseline, [real_run(6, "bench-c8.json"), real_run(8, "bench-c8.json")], 0.25)
    assert held["passed"] and held["previous_knee"] == 8 and [s["concurrency"] for s in held["steps"]] == [6, 8]
    # judged against the baseline's own (recorded) targets: 12 s misses its 10 s
    fell = sweep_filters.sweep_gate(baseline, [real_run(6, "bench-c8.json", p95_ttft_ms=12000.0),
                                        real_run(8, "bench-c8.json", p95_ttft_ms=12000.0)], 0.25)
    assert not fell["passed"] and "fell below 6" in fell["summary"]
