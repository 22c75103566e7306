"""The sweep's analysis on synthetic steps: which steps run, where the knee is (flat, cliff, noisy, never
breaking, failures), what max-num-seqs is recommended, how the measured context compares with the plan,
the upgrade's gate, and the plot's data read back from the PNG."""

from __future__ import annotations

from typing import Any

import pytest

from teamserve_capacity import sweep
from teamserve_capacity.sweep_plot import plot, read

TARGETS = {"ttft_seconds": 1.0, "tpot_seconds": 0.05}
# A plan for 8 expected sequences, --max-num-seqs 8, 20 sequences fitting at the 1,000-token average.
POINTS = {"concurrent_sequences": 8, "max_num_seqs": 8, "max_concurrency_avg": 20, "avg_context_tokens": 1000,
          "blocks": 1280, "block_size": 16}


def step(concurrency: int, ttft_p95: float, tpot_p95: float = 0.02, failed: int = 0, **extra: Any) -> dict[str, Any]:
    """A step whose p50 is half and p99 1.2 x its p95."""
    return {"concurrency": concurrency, "completed": 4 * concurrency - failed, "failed": failed,
            "ttft_seconds": {"p50": ttft_p95 / 2, "p95": ttft_p95, "p99": ttft_p95 * 1.2},
            "tpot_seconds": {"p50": tpot_p95 / 2, "p95": tpot_p95, "p99": tpot_p95 * 1.2}, **extra}


def curve(*ttfts: float, start: int = 1) -> list[dict[str, Any]]:
    return [step(start << i, t) for i, t in enumerate(ttfts)]


def test_steps_are_powers_of_two_with_the_plans_points():
    assert sweep.steps(8, 8, 32) == [1, 2, 4, 8, 16, 32]
    assert sweep.steps(14, 16, 64) == [1, 2, 4, 8, 14, 16, 28, 32, 64]
    assert sweep.steps(14, 16, 20) == [1, 2, 4, 8, 14, 16]
    assert sweep.steps(1, 1, 1) == [1]
    with pytest.raises(ValueError, match="bound must be at least 1"):
        sweep.steps(8, 8, 0)


def test_isotonic_pools_a_dip_with_the_step_before():
    assert sweep.isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert sweep.isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert sweep.isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]


def test_flat_below_the_targets_never_breaks_and_the_knee_is_a_lower_bound():
    k = sweep.knee(curve(0.2, 0.2, 0.2, 0.2), TARGETS)
    assert k["concurrency"] == 8 and k["never_broke"] and k["first_break"] is None and k["noisy"] == []
    assert sweep.knee(curve(0.3, 0.2, 0.25, 0.2), TARGETS)["noisy"] == []  # dips, all far below the target


def test_flat_above_the_targets_has_no_knee():
    k = sweep.knee(curve(1.5, 1.5, 1.5), TARGETS)
    assert k["concurrency"] is None and k["first_break"] == 1 and k["broke_on"] == ["ttft"]
    assert not k["never_broke"]
    advice = sweep.recommend(k, POINTS)
    assert advice["max_num_seqs"] is None and not advice["change"] and "not even 1" in advice["summary"]


def test_a_cliff_puts_the_knee_on_the_last_step_before_it():
    k = sweep.knee(curve(0.2, 0.25, 0.3, 0.4, 4.0, 9.0), TARGETS)
    assert (k["concurrency"], k["first_break"], k["broke_on"]) == (8, 16, ["ttft"])


def test_tpot_breaks_too_and_both_are_named():
    steps = [step(1, 0.2, 0.01), step(2, 0.3, 0.03), step(4, 1.2, 0.08)]
    k = sweep.knee(steps, TARGETS)
    assert (k["concurrency"], k["broke_on"]) == (2, ["ttft", "tpot"])


def test_noise_is_read_off_the_monotone_fit_and_named():
    # 4 misses by 2 %, 8 meets by 2 %: latency does not fall with load, so the two are one measurement.
    k = sweep.knee(curve(0.5, 0.6, 1.02, 0.98, 1.5, 3.0), TARGETS)
    assert k["concurrency"] == 8 and k["first_break"] == 16 and k["noisy"] == [4]
    analysed = sweep.analyse(curve(0.5, 0.6, 1.02, 0.98, 1.5, 3.0), TARGETS, POINTS)
    assert "overruled the measurement at 4 concurrent" in analysed["recommendation"]["summary"]


def test_a_dip_far_from_the_target_is_not_called_noise():
    # TPOT falls from 8 to 16 on the testbed (0.006 -> 0.005 s) against a 0.3 s target: no verdict changes.
    steps = [step(8, 0.2, 0.006), step(16, 0.3, 0.005)]
    assert sweep.knee(steps, {"ttft_seconds": 1.0, "tpot_seconds": 0.3})["noisy"] == []
    assert "overruled" not in sweep.analyse(steps, TARGETS, POINTS)["recommendation"]["summary"]


def test_noise_that_stays_above_the_target_is_a_break():
    k = sweep.knee(curve(0.5, 0.6, 1.3, 1.1, 1.5), TARGETS)
    assert k["concurrency"] == 2 and k["first_break"] == 4


def test_p99_is_judged_against_the_same_targets_and_breaks_first():
    steps = curve(0.5, 0.7, 0.9, 2.0)  # p99 = 1.2 x p95: 0.84 at 2, 1.08 at 4
    assert sweep.knee(steps, TARGETS, "p95")["concurrency"] == 4
    assert sweep.knee(steps, TARGETS, "p99")["concurrency"] == 2


def test_a_failed_request_is_never_noise():
    steps = [step(1, 0.2), step(2, 0.2, failed=1), step(4, 0.2), step(8, 0.2)]
    k = sweep.knee(steps, TARGETS)
    assert (k["concurrency"], k["first_break"], k["broke_on"]) == (1, 2, ["failed"])
    assert not sweep.meets(steps[1], TARGETS)


def test_a_step_that_measured_nothing_breaks():
    empty = {"concurrency": 4, "completed": 0, "failed": 16, "ttft_seconds": {}, "tpot_seconds": {}}
    k = sweep.knee([step(1, 0.2), step(2, 0.2), empty], TARGETS)
    assert k["concurrency"] == 2 and set(k["broke_on"]) == {"ttft", "tpot", "failed"}


def test_the_sweep_goes_on_to_twice_the_plan_then_stops_at_the_first_break():
    broken = step(4, 5.0)
    assert sweep.stop_after(broken, TARGETS, expected=8, bound=64) == ""
    assert sweep.stop_after(step(16, 5.0), TARGETS, expected=8, bound=64).startswith("a target broke at 16")
    assert sweep.stop_after(step(16, 0.2), TARGETS, expected=8, bound=64) == ""
    assert sweep.stop_after(step(64, 0.2), TARGETS, expected=8, bound=64).startswith("reached the bound of 64")


@pytest.mark.parametrize(("knee_at", "never", "expected"), [
    (4, False, {"max_num_seqs": 4, "change": True,
                "inventory": {"vllm_engine.max_num_seqs": 4, "vllm_workload.concurrent_sequences": 4}}),
    (16, False, {"max_num_seqs": 8, "change": False, "inventory": {}}),
    (8, False, {"max_num_seqs": 8, "change": False, "inventory": {}}),
])
def test_recommendation_applies_through_the_plans_inputs(knee_at, never, expected):
    advice = sweep.recommend({"concurrency": knee_at, "never_broke": never}, POINTS)
    assert {k: advice[k] for k in expected} == expected


def test_a_knee_between_the_expected_and_the_batch_lowers_the_batch():
    points = dict(POINTS, concurrent_sequences=6, max_num_seqs=16)
    advice = sweep.recommend({"concurrency": 8, "never_broke": False}, points)
    assert advice["inventory"] == {"vllm_engine.max_num_seqs": 8} and "from 16 to 8" in advice["summary"]


def test_a_sweep_that_never_broke_suggests_a_larger_batch_only_where_the_kv_cache_holds_it():
    advice = sweep.recommend({"concurrency": 32, "never_broke": True}, POINTS)
    assert not advice["change"] and "at least 32" in advice["summary"] and "up to 20" in advice["summary"]
    full = sweep.recommend({"concurrency": 32, "never_broke": True}, dict(POINTS, max_concurrency_avg=8))
    assert "vllm_engine.max_num_seqs" not in full["summary"]


def test_lengths_and_the_plans_average_context():
    measured = sweep.lengths([100, 200, 300, 400], [50, 50, 50, 50])
    assert measured["prompt"] == {"mean": 250.0, "p50": 200.0, "p95": 400.0, "max": 400.0}
    assert measured["context_mean"] == 300.0 and measured["requests"] == 4
    within = sweep.context_against_plan(measured, POINTS)
    assert within["holds"] and within["sequences_at_measured"] == 1280 // 19 and within["ratio"] == 0.3
    creep = sweep.context_against_plan(sweep.lengths([3000] * 4, [500] * 4), POINTS)
    assert not creep["holds"] and creep["sequences_at_measured"] == 1280 // 219
    assert "avg_context_tokens: 3500" in creep["summary"]


def test_analyse_pools_the_lengths_of_every_step():
    steps = [step(1, 0.2, input_lens=[100], output_lens=[10]), step(2, 0.2, input_lens=[300, 300], output_lens=[10, 10])]
    analysed = sweep.analyse(steps, TARGETS, POINTS)
    assert analysed["lengths"]["requests"] == 3 and analysed["lengths"]["prompt"]["mean"] == pytest.approx(233.3, 0.01)
    assert analysed["context"]["holds"] and analysed["knee"]["p95"]["never_broke"]
    assert sweep.analyse([step(1, 0.2)], TARGETS, POINTS)["context"] is None


def test_gate_steps_and_verdicts():
    assert sweep.gate_steps(8, 0.25) == [6, 8]
    assert sweep.gate_steps(1, 0.25) == [1]
    assert sweep.gate_steps(16, 0.0) == [16]
    with pytest.raises(ValueError):
        sweep.gate_steps(8, 1.0)
    held = sweep.gate(8, 0.25, [step(6, 0.3), step(8, 0.4)], TARGETS)
    assert held["passed"] and "holds" in held["summary"]
    within = sweep.gate(8, 0.25, [step(6, 0.3), step(8, 1.4)], TARGETS)
    assert within["passed"] and "within the margin" in within["summary"]
    fell = sweep.gate(8, 0.25, [step(6, 3.5), step(8, 4.0)], TARGETS)
    assert not fell["passed"] and fell["lowest_allowed"] == 6 and "fell below 6" in fell["summary"]
    assert "cannot tell" not in held["summary"] + within["summary"] + fell["summary"]
    unarmed = sweep.gate(1, 0.25, [step(1, 0.3)], TARGETS)
    assert unarmed["passed"] and "cannot tell an engine that serves one sequence at a time" in unarmed["summary"]


def test_prefix_win_compares_the_same_concurrency():
    shared = step(8, 0.4, prefix_cache_hit_rate=0.8)
    plain = step(8, 1.0, prefix_cache_hit_rate=0.02)
    win = sweep.prefix_win(shared, plain)
    assert win["ttft_p50_seconds"] == {"shared": 0.2, "plain": 0.5}
    assert "-60%" in win["summary"] and "80%/2%" in win["summary"]


def test_table_marks_the_steps_that_miss():
    rows = sweep.table([step(1, 0.2, kv_cache_usage_peak=0.015), step(2, 2.0), step(4, 0.2, failed=2)], TARGETS)
    assert len(rows) == 4 and "1.5%" in rows[1]
    assert rows[2].endswith("<- misses a p95 target") and rows[3].endswith("<- requests failed")


def test_plot_carries_the_series_and_markers_it_draws(tmp_path):
    steps = curve(0.2, 0.3, 0.5, 0.9, 2.5)
    document = {"steps": steps, "targets": TARGETS, "plan": POINTS, "model": "tiny", "host": "box",
                "knee": {"p95": sweep.knee(steps, TARGETS)}}
    png = tmp_path / "sweep.png"
    drawn = plot(document, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = read(str(png))
    assert data == drawn
    assert data["ttft:p95"] == {"x": [1.0, 2.0, 4.0, 8.0, 16.0], "y": [0.2, 0.3, 0.5, 0.9, 2.5]}
    assert data["tpot:p99"]["y"] == pytest.approx([0.024] * 5)
    assert data["ttft:target"]["y"] == [1.0, 1.0] and data["tpot:target"]["y"] == [0.05, 0.05]
    assert data["ttft:knee"]["x"] == [8.0, 8.0] and data["tpot:plan"]["x"] == [8.0, 8.0]
    assert data["ttft:max-num-seqs"]["x"] == [8.0, 8.0]


def test_plot_leaves_out_the_knee_when_there_is_none(tmp_path):
    steps = curve(1.5, 2.0)
    document = {"steps": steps, "targets": TARGETS, "plan": POINTS, "knee": {"p95": sweep.knee(steps, TARGETS)}}
    data = plot(document, str(tmp_path / "none.png"))
    assert "ttft:knee" not in data and "ttft:plan" in data
    with pytest.raises(ValueError, match="no step"):
        plot({"steps": [], "targets": TARGETS, "plan": POINTS}, str(tmp_path / "empty.png"))
