"""playbooks/verify.yml on the testbed box (run by side_effect.yml): the JSON report it wrote holds the
checklist's real numbers, and the checks that must pass on the testbed passed."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

testinfra_hosts = ["ansible://teamserve-box"]

REPORT = pathlib.Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")) / "verify" / "report.json"
BOX_ADDRESSES = {"10.231.0.10", "10.232.0.10"}  # the box on the LAN and on the "outside" network


@pytest.fixture(scope="module")
def report() -> dict:
    assert REPORT.is_file(), f"{REPORT} missing: did side_effect (playbooks/verify.yml) run?"
    return json.loads(REPORT.read_text())


@pytest.fixture(scope="module")
def checks(report) -> dict:
    return {check["id"]: check for check in report["checks"]}


def positive(value) -> bool:
    return isinstance(value, float) and value > 0


def test_every_check_is_reported_once_and_the_run_passed(report, checks):
    assert sorted(checks) == list(range(1, 10))
    assert len(report["checks"]) == 9
    failed = {i: c["summary"] for i, c in checks.items() if c["status"] == "FAIL"}
    assert not failed and report["passed"] is True, failed
    assert [i for i, c in checks.items() if c["status"] == "SKIP"] == [7]  # see side_effect.yml
    assert (report["api_endpoint"], report["chat"]) == ("/v1/chat/completions", "available")  # a chat model
    for check in checks.values():
        assert check["status"] in ("PASS", "SKIP") and check["summary"].strip()
        if check["status"] == "SKIP":
            assert check["reason"].strip(), f"check {check['id']} skipped without a reason"


def test_capacity_and_engine(checks):
    assert checks[1]["status"] == "PASS" and checks[1]["measured"]["max_concurrency_at_avg_context"] >= 8
    # the CPU engine logged its KV cache size ("CPU KV cache size: N tokens"); it holds 8 x 1,000 tokens
    kv = checks[1]["measured"]["engine_kv_cache"]
    assert kv["device"] == "CPU" and kv["tokens"] >= 8 * 1000
    engine = checks[2]
    assert engine["status"] == "PASS"
    assert engine["measured"]["argv"] == engine["target"]["argv"]
    assert engine["measured"]["image"] == engine["target"]["image"]
    assert engine["target"]["served_model_name"] in engine["measured"]["gateway_models"]


def test_load_test_percentiles_at_1x_and_2x(checks):
    assert checks[3]["status"] == "PASS"
    assert positive(checks[3]["measured"]["ttft_p95_seconds"]) and positive(checks[3]["measured"]["tpot_p95_seconds"])
    runs = checks[4]["measured"]["runs"]
    assert [run["concurrency"] for run in runs] == [8, 16]  # vllm_workload.concurrent_sequences and twice it
    for run in runs:
        bench = run["bench"]
        assert bench["failed"] == 0 and bench["completed"] == bench["num_prompts"] > 0
        assert positive(bench["ttft_seconds"]["p50"])
        for metric in ("ttft_seconds", "tpot_seconds", "itl_seconds"):
            p50, p95, p99 = (bench[metric][p] for p in ("p50", "p95", "p99"))
            # chunks that reach the client in one read (CPU-starved testbed) give 0.0 gaps: p50 may be 0
            assert isinstance(p50, float) and 0 <= p50 <= p95 <= p99 and p99 > 0, (metric, bench[metric])
        # every request of the run finished inside the scrape window, so the engine's queue histogram saw them
        assert run["queue"]["requests"] >= bench["completed"]
        assert 0 <= run["queue"]["queued"] <= run["queue"]["requests"]


def test_long_prompt_others_keep_streaming(checks):
    long = checks[5]
    assert long["status"] == "PASS"
    measured = long["measured"]
    assert measured["long_prompt_tokens"] == 2048 - 8  # --max-model-len minus 8
    assert positive(measured["long_prompt_ttft_seconds"])
    for window in ("before", "during"):
        gaps = measured[window]
        assert gaps["count"] > 0 and 0 <= gaps["p50"] <= gaps["p99"] <= gaps["max"] and gaps["max"] > 0, (window, gaps)
    assert measured["during"]["max"] <= long["target"]["max_stall_seconds"]
    assert measured["streams_alive_after"] == measured["streams"] and measured["streams_reopened"] >= 0


def test_rate_limit_exhausted_user_gets_429_the_other_200(checks):
    limits = checks[6]["measured"]
    assert checks[6]["status"] == "PASS"
    assert (limits["limited_user"], limits["limited_status"]) == ("carol", 429)
    assert int(limits["retry_after"]) > 0
    assert limits["limited_error_code"] == "rate_limit_exceeded"
    assert (limits["other_user"], limits["other_status"]) == ("alice", 200)


def test_cold_start_skipped_with_a_reason(checks):
    """side_effect.yml sets teamserve_verify_cold_start: false (converge measured a restart already)."""
    cold = checks[7]
    assert cold["status"] == "SKIP"
    assert "teamserve_verify_cold_start" in cold["reason"]


def test_eval_set_answered_and_kept_on_the_box_per_engine_and_kv_dtype(checks, host):
    """Check 8 keeps its answers in the box's one store of evaluation answers (the upgrade's too): a root-only
    file in the folder of the eval set and model, named by the engine's pins and its KV-cache dtype."""
    evaluation = checks[8]
    assert evaluation["status"] == "PASS"
    assert evaluation["measured"]["prompts"] == 6 and evaluation["measured"]["kv_cache_dtype"] == "auto"
    path = evaluation["measured"]["answers_file"]
    kept = host.file(path)
    assert kept.exists and kept.user == "root" and kept.mode == 0o640, path
    stored = json.loads(kept.content_string)
    assert stored["kv_cache_dtype"] == "auto" and len(stored["answers"]) == 6
    pins = stored["pins"]
    assert path.startswith("/var/lib/teamserve/eval/eval.tiny/"), path
    assert path.rsplit("/", 1)[1].startswith(f"{pins['vllm_version']}-{pins['vllm_image_digest'][7:19]}-"), path
    assert path.endswith(".auto.json"), path


def test_eval_tool_prompts_are_answered_with_calls_to_the_named_tools(checks, host):
    """The eval set's tool lines go through the gateway with their tools; for a named function vLLM
    constrains the output to that tool's schema, so even the random-weight model calls it."""
    stored = json.loads(host.file(checks[8]["measured"]["answers_file"]).content_string)
    calls = {a["prompt"]: a["tool_calls"] for a in stored["answers"] if a["tool_calls"]}
    assert len(calls) == 2, stored["answers"]
    weather = calls["What is the weather in Paris? Use the tool."]
    assert [c["name"] for c in weather] == ["get_weather"] and weather[0]["arguments"]["city"] in ("Paris", "Oslo", "Lima")
    booked = calls["Book a table for two tonight."]
    assert [c["name"] for c in booked] == ["book_table"] and booked[0]["arguments"]["party"] in ("one", "two", "four")


def test_gateway_unreachable_from_outside(checks):
    outside = checks[9]
    assert outside["status"] == "PASS"
    assert outside["measured"]["outside_host"] == "teamserve-wan-client"
    assert set(outside["measured"]["probed"]) == BOX_ADDRESSES  # not the box's inner Docker bridges
    assert outside["measured"]["connected"] == []


def test_report_kept_on_the_box_root_only(host, report):
    name = report["started_at"].replace(":", "").replace("-", "") + ".json"
    kept = host.file(f"/var/lib/teamserve/verify/{name}")
    assert kept.exists and kept.user == "root" and kept.mode == 0o640
    assert json.loads(kept.content_string)["checks"] == report["checks"]
    assert not host.file("/var/lib/teamserve/verify/bench.key").exists  # the user's key is removed after the bench
