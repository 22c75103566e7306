"""Pure-Python parts of playbooks/verify.yml (roles/teamserve_verify): Prometheus parsing, the bench
summary, the eval set and agreement, the outside-probe address list, the table, and the long-prompt
module's gap arithmetic."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
from repo_modules import load
from ansible.errors import AnsibleFilterError

ROLE = pathlib.Path(__file__).resolve().parents[2] / "roles" / "teamserve_verify"




filters = load("teamserve_verify_filters", "roles/teamserve_verify/filter_plugins/teamserve_verify.py")
long_prompt = load("teamserve_verify_long_prompt", "roles/teamserve_verify/library/teamserve_verify_long_prompt.py")

# Shaped like vLLM 0.32's /metrics (prometheus_client text format): one engine label set.
METRICS_BEFORE = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 0.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 10.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 10.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 10.0
"""
METRICS_AFTER = """\
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 6.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 22.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 24.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 26.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 26.0
"""


def test_metric_sums_label_sets_and_ignores_comments():
    text = METRICS_AFTER + 'vllm:num_requests_waiting{engine="1",model_name="tiny"} 3.0\n'
    assert filters.teamserve_verify_metric(text, "vllm:num_requests_waiting") == 5.0
    assert filters.teamserve_verify_metric(METRICS_BEFORE, "vllm:absent") is None


def test_histogram_reads_buckets_including_inf():
    hist = filters.teamserve_verify_histogram(METRICS_AFTER, "vllm:request_queue_time_seconds")
    assert hist["count"] == 26.0 and hist["sum"] == 6.5
    assert hist["buckets"][0.3] == 22.0 and hist["buckets"][math.inf] == 26.0


def test_queue_delta_counts_requests_that_waited_past_the_threshold():
    queue = filters.teamserve_verify_queue(METRICS_BEFORE, METRICS_AFTER)
    # 16 requests finished; 12 of them within 0.3 s, so 4 queued; 6.0 s waited in all
    assert queue == {"requests": 16, "queued": 4, "threshold_seconds": 0.3,
                     "waited_seconds_total": 6.0, "mean_wait_seconds": 0.375}
    # a threshold between bounds rounds up to the next bucket (0.5 s): 14 within, 2 queued
    assert filters.teamserve_verify_queue(METRICS_BEFORE, METRICS_AFTER, 0.4)["queued"] == 2


def test_queue_delta_refuses_a_restarted_engine_and_a_missing_histogram():
    with pytest.raises(AnsibleFilterError, match="restarted"):
        filters.teamserve_verify_queue(METRICS_AFTER, METRICS_BEFORE)
    with pytest.raises(AnsibleFilterError, match="no vllm:request_queue_time_seconds"):
        filters.teamserve_verify_queue("", "vllm:num_requests_waiting 0\n")


def test_bench_summary_converts_milliseconds_and_keeps_percentiles():
    # keys as vllm/benchmarks/serve.py (0.32) writes them with --metric-percentiles 50,95,99
    result = {"completed": 15, "failed": 1, "num_prompts": 16, "max_concurrency": 8, "duration": 3.21,
              "request_throughput": 4.67, "output_throughput": 74.7,
              "median_ttft_ms": 120.0, "p50_ttft_ms": 120.0, "p95_ttft_ms": 410.5, "p99_ttft_ms": 433.0,
              "median_tpot_ms": 20.0, "p50_tpot_ms": 20.0, "p95_tpot_ms": 31.0, "p99_tpot_ms": 35.0,
              "errors": ["", "HTTP 429: rate limited", "HTTP 429: rate limited", ""]}
    summary = filters.teamserve_verify_bench(result)
    assert summary["ttft_seconds"]["p95"] == pytest.approx(0.4105)
    assert summary["tpot_seconds"] == {"median": 0.02, "p50": 0.02, "p95": 0.031, "p99": 0.035}
    assert summary["itl_seconds"]["p99"] is None  # not in the result: reported as missing, not zero
    assert summary["completed"] == 15 and summary["failed"] == 1
    assert summary["errors"] == ["HTTP 429: rate limited"]
    with pytest.raises(AnsibleFilterError, match="completed"):
        filters.teamserve_verify_bench({"date": "x"})


def test_eval_parse_accepts_jsonl_with_comments_and_optional_expected():
    text = '# my set\n{"prompt": "2+2?", "expected": "4"}\n\n{"prompt": "Capital of France?"}\n'
    assert filters.teamserve_verify_eval_parse(text) == [
        {"prompt": "2+2?", "expected": "4"}, {"prompt": "Capital of France?", "expected": None}]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a"}\nnot json\n', "line 2 is not JSON"),
    ('{"question": "a"}\n', "line 1: 'prompt' must be a non-empty string"),
    ('{"prompt": "a", "expected": 4}\n', "'expected' must be a string"),
    ('{"prompt": "a"}\n{"prompt": "a"}\n', "duplicated prompt"),
    ("# nothing\n", "holds no prompts"),
])
def test_eval_parse_names_the_line_and_the_fix(text, message):
    with pytest.raises(AnsibleFilterError, match=message):
        filters.teamserve_verify_eval_parse(text, "eval.jsonl")


def test_agreement_is_exact_match_by_prompt_after_whitespace():
    auto = [{"prompt": "a", "answer": "Paris"}, {"prompt": "b", "answer": "4 "}, {"prompt": "c", "answer": "x"},
            {"prompt": "only-auto", "answer": "y"}]
    fp8 = [{"prompt": "a", "answer": "Paris"}, {"prompt": "b", "answer": " 4"}, {"prompt": "c", "answer": "z"}]
    assert filters.teamserve_verify_agreement(auto, fp8) == {"compared": 3, "agreed": 2, "rate": 0.6667}
    assert filters.teamserve_verify_agreement(auto, [])["rate"] is None


def test_expected_match_counts_only_items_with_an_expected_answer():
    answers = [{"prompt": "a", "expected": "4", "answer": "4"}, {"prompt": "b", "expected": "5", "answer": "6"},
               {"prompt": "c", "expected": None, "answer": "x"}]
    assert filters.teamserve_verify_expected_match(answers) == {"with_expected": 2, "matched": 1, "rate": 0.5}


def test_host_addresses_skip_loopback_and_container_bridges():
    facts = {
        "interfaces": ["lo", "eth0", "eth1", "docker0", "br-1a2b", "veth9f"],
        "lo": {"ipv4": {"address": "127.0.0.1"}},
        "eth0": {"ipv4": {"address": "10.231.0.10"}, "ipv4_secondaries": [{"address": "10.231.0.11"}],
                 "ipv6": [{"address": "fe80::1", "scope": "link"}, {"address": "2001:db8::10", "scope": "global"}]},
        "eth1": {"ipv4": {"address": "10.232.0.10"}},
        "docker0": {"ipv4": {"address": "172.17.0.1"}},
        "br_1a2b": {"ipv4": {"address": "172.18.0.1"}},
        "veth9f": {},
    }
    assert filters.teamserve_verify_host_addresses(facts) == ["10.231.0.10", "10.231.0.11", "10.232.0.10",
                                                              "2001:db8::10"]


def test_table_sorts_by_id_and_counts():
    lines = filters.teamserve_verify_table([
        {"id": 9, "name": "outside", "status": "SKIP", "summary": "no outside host"},
        {"id": 1, "name": "capacity arithmetic", "status": "PASS", "summary": "fits"},
        {"id": 3, "name": "targets", "status": "FAIL", "summary": "TTFT p95 2 s (target 1)"}])
    assert [line.split()[0] for line in lines[2:5]] == ["1", "3", "9"]
    assert "FAIL" in lines[3] and "TTFT p95 2 s" in lines[3]
    assert lines[-1] == "1 passed, 1 failed, 1 skipped"


def test_percentile_matches_numpy_linear_definition():
    values = [0.01, 0.02, 0.03, 0.04, 1.0]
    assert long_prompt.percentile(values, 50) == 0.03
    assert long_prompt.percentile(values, 99) == pytest.approx(0.04 + 0.96 * 0.96)  # rank 3.96
    assert long_prompt.percentile([], 50) is None
    with pytest.raises(ValueError):
        long_prompt.percentile(values, 101)


def test_split_gaps_before_and_during_the_prefill_window():
    # stream A steady at 10 ms, then one 300 ms stall across the prefill window (1.00 .. 1.25 s)
    stream_a = [0.90, 0.91, 0.92, 0.93, 1.23, 1.24, 1.25]
    # stream B: its first gap starts before the baseline and is ignored
    stream_b = [0.50, 0.95, 0.97, 0.99, 1.30, 1.32]
    before, during = long_prompt.split_gaps([stream_a, stream_b], 1.00, 1.25, 0.90)
    assert sorted(round(g, 3) for g in before) == [0.01, 0.01, 0.01, 0.02, 0.02]
    # overlapping the window: A's 0.93->1.23, 1.23->1.24, 1.24->1.25; B's 0.99->1.30 (B's 1.30->1.32 is after)
    assert sorted(round(g, 3) for g in during) == [0.01, 0.01, 0.3, 0.31]
    summary = long_prompt.summarise(during)
    assert summary["count"] == 4 and summary["max"] == 0.31


def test_example_eval_file_parses():
    path = ROLE.parents[1] / "inventories" / "testbed" / "eval.jsonl"
    items = filters.teamserve_verify_eval_parse(path.read_text(), str(path))
    assert len(items) >= 3 and all(isinstance(json.dumps(i), str) for i in items)


def test_eval_answers_take_the_first_choice_and_refuse_a_failed_request():
    results = [
        {"item": {"prompt": "a", "expected": "4"}, "status": 200,
         "json": {"choices": [{"message": {"role": "assistant", "content": "4"}}]}},
        {"item": {"prompt": "b", "expected": None}, "status": 200,
         "json": {"choices": [{"message": {"role": "assistant", "content": None}}]}},
    ]
    assert filters.teamserve_verify_eval_answers(results) == [
        {"prompt": "a", "expected": "4", "answer": "4"}, {"prompt": "b", "expected": None, "answer": ""}]
    refused = [{"item": {"prompt": "c"}, "status": 429, "json": {"error": {"code": "rate_limited"}}}]
    with pytest.raises(AnsibleFilterError, match="prompt 'c' got HTTP 429"):
        filters.teamserve_verify_eval_answers(refused)


def test_eval_compare_reports_one_row_per_other_dtype():
    current = [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "y"}]
    others = [{"kv_cache_dtype": "fp8", "at": "2026-11-30T12:00:00Z",
               "answers": [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "z"}]},
              {"kv_cache_dtype": "bfloat16", "at": "2026-11-29T12:00:00Z", "answers": current}]
    rows = filters.teamserve_verify_eval_compare(current, others)
    assert [(r["kv_cache_dtype"], r["agreed"], r["compared"], r["rate"]) for r in rows] == [
        ("bfloat16", 2, 2, 1.0), ("fp8", 1, 2, 0.5)]
