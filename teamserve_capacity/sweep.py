"""The real capacity number: where a concurrency sweep's latencies cross the targets.

A sweep runs ``vllm bench serve`` at rising concurrency (1, 2, 4, ... past twice the plan) and records per
step the TTFT and TPOT percentiles in seconds. This module, pure and standard library only, turns those
steps into:

- the steps to run (:func:`steps`) and when to stop (:func:`stop_after`);
- the knee (:func:`knee`): the highest concurrency whose p95 (or p99) TTFT and TPOT meet the targets,
  read off a monotone fit, because latency does not fall when concurrency rises and a step that says it
  did is noise;
- a ``max-num-seqs`` the admin applies through the plan's inputs (:func:`recommend`);
- how the measured prompt lengths compare with the plan's average context (:func:`lengths`,
  :func:`context_against_plan`);
- the upgrade's gate (:func:`gate_steps`, :func:`gate`): did the knee move down by more than a margin.

Source of the method: "knowing the concurrency at which p99 time-to-first-token crosses what your users
will tolerate is the real capacity number", measured "at double the concurrency, because what you need to
know is the shape of the failure" (the serving guide this project follows); the percentile targets are
the inventory's ``vllm_workload.ttft_p95_seconds`` and ``tpot_seconds``.

A step is a mapping with ``concurrency`` (requests in flight), ``completed`` and ``failed`` (requests),
and ``ttft_seconds`` / ``tpot_seconds`` mappings of ``p50``/``p95``/``p99`` to seconds (None when the step
measured nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

PERCENTILES = ("p95", "p99")
METRICS = ("ttft_seconds", "tpot_seconds")


def steps(expected: int, max_num_seqs: int, bound: int) -> list[int]:
    """Concurrencies to sweep, ascending: powers of two up to ``bound``, plus the plan's points.

    Args:
        expected: the workload's concurrent sequences (``vllm_workload.concurrent_sequences``).
        max_num_seqs: the plan's ``--max-num-seqs``.
        bound: the highest concurrency to try (requests in flight).
    Returns:
        1, 2, 4, ... <= ``bound`` with ``expected``, ``2 * expected`` and ``max_num_seqs`` added where they
        are <= ``bound``.
    Raises:
        ValueError: when any argument is below 1.
    """
    for name, value in (("expected", expected), ("max_num_seqs", max_num_seqs), ("bound", bound)):
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    points = {1 << k for k in range(int(bound).bit_length()) if 1 << k <= bound}
    points |= {c for c in (expected, 2 * expected, max_num_seqs) if c <= bound}
    return sorted(points)


def meets(step: Mapping[str, Any], targets: Mapping[str, float], percentile: str = "p95") -> bool:
    """Whether one step, as measured, met both targets at ``percentile`` with every request served.

    ``targets``: ``{"ttft_seconds": s, "tpot_seconds": s}``.
    """
    if int(step.get("failed") or 0) > 0 or int(step.get("completed") or 0) < 1:
        return False
    for metric in METRICS:
        value = (step.get(metric) or {}).get(percentile)
        if value is None or float(value) > float(targets[metric]):
            return False
    return True


def isotonic(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators).

    Latency at a higher concurrency is never truly lower, so a dip is averaged with the step before it.
    Source: the pool-adjacent-violators algorithm (Ayer et al., 1955; Barlow et al., "Statistical Inference
    under Order Restrictions", 1972). Same length and units as ``values``.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted.extend([total / count] * int(count))
    return fitted


def knee(sweep_steps: Sequence[Mapping[str, Any]], targets: Mapping[str, float],
         percentile: str = "p95") -> dict[str, Any]:
    """The highest concurrency at which ``percentile`` TTFT and TPOT meet ``targets``, every request served.

    Each metric is fitted non-decreasing in concurrency (:func:`isotonic`); so is the share of failed
    requests, so a failure is never noise. A step missing a measurement counts as infinitely slow.
    Returns ``{"percentile", "concurrency" (None when even the lowest step broke), "first_break" (the
    lowest step above the knee, None when none broke), "broke_on" (what broke there: "ttft", "tpot",
    "failed"), "never_broke" (the knee is only a lower bound), "noisy" (steps whose verdict the monotone fit
    turned: measured over a target and fitted under it, or the other way), "fitted" ({metric: [seconds per
    step]})}``.
    """
    ordered = sorted(sweep_steps, key=lambda s: int(s["concurrency"]))
    concurrencies = [int(s["concurrency"]) for s in ordered]
    fitted: dict[str, list[float]] = {}
    noisy: set[int] = set()
    for metric in METRICS:
        raw = [(s.get(metric) or {}).get(percentile) for s in ordered]
        values = [math.inf if v is None else float(v) for v in raw]
        finite = [v if math.isfinite(v) else 1e9 for v in values]
        fitted[metric] = [round(v, 6) for v in isotonic(finite)]
        target = float(targets[metric])
        noisy |= {c for c, v, f in zip(concurrencies, finite, fitted[metric], strict=True) if (v > target) != (f > target)}
    failed_share = isotonic([int(s.get("failed") or 0) / max(1, int(s.get("failed") or 0) + int(s.get("completed")
                                                                                                   or 0))
                             for s in ordered])
    best: int | None = None
    first_break: int | None = None
    broke_on: list[str] = []
    for index, concurrency in enumerate(concurrencies):
        reasons = [m.split("_")[0] for m in METRICS if fitted[m][index] > float(targets[m])]
        if failed_share[index] > 0 or int(ordered[index].get("completed") or 0) < 1:
            reasons.append("failed")
        if reasons:
            first_break, broke_on = concurrency, reasons
            break
        best = concurrency
    return {"percentile": percentile, "concurrency": best, "first_break": first_break, "broke_on": broke_on,
            "never_broke": first_break is None and best is not None, "noisy": sorted(noisy),
            "fitted": {m: fitted[m] for m in METRICS}, "concurrencies": concurrencies}


def stop_after(step: Mapping[str, Any], targets: Mapping[str, float], expected: int, bound: int) -> str:
    """Why the sweep stops after ``step``, or "" to go on.

    It goes on to twice the expected concurrency whatever happens (the shape of the failure is the point),
    then stops at the first step that misses a p95 target or fails a request, or at ``bound``.
    """
    concurrency = int(step["concurrency"])
    if concurrency >= bound:
        return f"reached the bound of {bound} concurrent requests"
    if concurrency >= 2 * expected and not meets(step, targets, "p95"):
        return f"a target broke at {concurrency} concurrent requests, past twice the plan's {expected}"
    return ""


def plan_points(plan: Mapping[str, Any]) -> dict[str, int]:
    """What a sweep compares with, taken from the capacity planner's result (:func:`teamserve_capacity.plan`).

    Returns ``{"concurrent_sequences" (expected), "max_num_seqs" (the flag), "max_num_queued_reqs" (the
    engine's queue, requests; the flag, or 0 when the plan sets none), "max_concurrency_avg" (sequences
    the KV cache holds at the average context), "avg_context_tokens", "blocks", "block_size"}``.
    """
    flags, numbers = plan["flags"], plan["numbers"]
    return {"concurrent_sequences": int(numbers["concurrent_sequences"]),
            "max_num_seqs": int(flags["max-num-seqs"]),
            "max_num_queued_reqs": int(flags.get("max-num-queued-reqs") or 0),
            "max_concurrency_avg": int(numbers["max_concurrency_avg"]),
            "avg_context_tokens": int(numbers["avg_context_tokens"]),
            "blocks": int(numbers["blocks"]), "block_size": int(numbers["block_size"])}


def recommend(knee_p95: Mapping[str, Any], points: Mapping[str, Any]) -> dict[str, Any]:
    """A ``--max-num-seqs`` for the plan, from the p95 knee.

    ``points``: :func:`plan_points`. Returns ``{"max_num_seqs" (None = no concurrency met the targets),
    "change" (bool), "inventory" ({variable: value} to set, empty when nothing changes), "summary"}``. The
    inventory variables are the plan's inputs, so the engine's flags, the gateway's caps and the alerts
    follow the new number.
    """
    k = knee_p95.get("concurrency")
    current = int(points["max_num_seqs"])
    expected = int(points["concurrent_sequences"])
    kv_limit = int(points.get("max_concurrency_avg") or current)
    if k is None:
        return {"max_num_seqs": None, "change": False, "inventory": {},
                "summary": "no concurrency met the targets, not even 1 request at a time: the model, prompt "
                           "length or GPU cannot meet them; shorten prompts, take a smaller or quantised model, "
                           "or loosen the targets"}
    k = int(k)
    if k < expected:
        return {"max_num_seqs": k, "change": True,
                "inventory": {"vllm_engine.max_num_seqs": k, "vllm_workload.concurrent_sequences": k},
                "summary": f"the targets hold up to {k} concurrent requests, below the {expected} the plan "
                           f"expects: cap the batch at {k} and plan for {k} (or add a box, shorten the "
                           "context, or loosen the targets)"}
    if k < current:
        return {"max_num_seqs": k, "change": True, "inventory": {"vllm_engine.max_num_seqs": k},
                "summary": f"a batch above {k} breaks the targets: lower --max-num-seqs from {current} to {k} "
                           f"(still >= the {expected} expected); requests above it wait in the queue"}
    more = (f"; the KV cache holds {kv_limit} sequences at the average context, so a larger batch "
            f"(vllm_engine.max_num_seqs up to {kv_limit}) may serve more: sweep again after raising it"
            if knee_p95.get("never_broke") and kv_limit > current else "")
    bound = "at least " if knee_p95.get("never_broke") else ""
    return {"max_num_seqs": current, "change": False, "inventory": {},
            "summary": f"keep --max-num-seqs {current}: the targets held up to {bound}{k} concurrent requests "
                       f"({expected} expected){more}"}


def _percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence (``fraction`` in 0..1)."""
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))])


def lengths(input_lens: Sequence[int], output_lens: Sequence[int]) -> dict[str, Any]:
    """Token counts of the prompts and answers a step sent and got back (``vllm bench serve --save-detailed``).

    Returns ``{"requests", "prompt": {"mean", "p50", "p95", "max"}, "output": {...}, "context_mean"}``
    (tokens; context = prompt + output, what a sequence holds in the KV cache at its end).
    """
    def stats(values: Sequence[int]) -> dict[str, float]:
        ordered = sorted(float(v) for v in values)
        if not ordered:
            return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
        return {"mean": round(sum(ordered) / len(ordered), 1), "p50": _percentile(ordered, 0.50),
                "p95": _percentile(ordered, 0.95), "max": ordered[-1]}
    prompt, output = stats(input_lens), stats(output_lens)
    return {"requests": len(input_lens), "prompt": prompt, "output": output,
            "context_mean": round(prompt["mean"] + output["mean"], 1)}


def context_against_plan(measured: Mapping[str, Any], points: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep's mean context against the plan's ``avg_context_tokens``, and what the KV cache holds at it.

    ``measured``: :func:`lengths`; ``points``: :func:`plan_points`. Sequences at the measured context are the
    plan's KV blocks divided by the blocks one such sequence needs, the arithmetic of the plan's own
    ``max_concurrency_avg`` (without its allowance for tokens in flight). Returns ``{"plan_avg_context_tokens", "measured_context_tokens",
    "ratio", "sequences_at_measured", "sequences_at_plan", "holds" (the measured context is at most the
    plan's), "summary"}``.
    """
    planned = int(points["avg_context_tokens"])
    context = float(measured["context_mean"])
    blocks, block_size = int(points.get("blocks") or 0), int(points.get("block_size") or 16)
    per_seq = max(1, math.ceil(context / block_size))
    at_measured = blocks // per_seq if blocks else None
    ratio = round(context / planned, 2) if planned else None
    holds = round(context) <= planned  # whole tokens: a prompt of 936.3 tokens on average is 936
    verb = "within" if holds else "above"
    summary = (f"mean context {context:,.0f} tokens (prompt {measured['prompt']['mean']:,.0f} + output "
               f"{measured['output']['mean']:,.0f}), {verb} the plan's {planned:,}")
    if at_measured is not None:
        summary += (f"; the KV cache holds {at_measured} sequences at it (the plan counted "
                    f"{points.get('max_concurrency_avg')} at {planned:,})")
    if not holds:
        summary += f": re-plan with vllm_workload.avg_context_tokens: {math.ceil(context)}"
    return {"plan_avg_context_tokens": planned, "measured_context_tokens": context, "ratio": ratio,
            "sequences_at_measured": at_measured, "sequences_at_plan": points.get("max_concurrency_avg"),
            "holds": holds, "summary": summary}


def gate_steps(previous_knee: int, margin: float) -> list[int]:
    """The upgrade's short sweep: the lowest concurrency the knee may fall to, and the previous knee.

    ``margin``: the fraction the knee may move down (0.25 = to 75 % of the previous knee). Raises
    ValueError when ``previous_knee`` < 1 or ``margin`` is outside [0, 1).
    """
    if int(previous_knee) < 1 or not 0 <= float(margin) < 1:
        raise ValueError(f"previous knee {previous_knee} must be >= 1 and margin {margin} in [0, 1)")
    low = max(1, math.ceil(int(previous_knee) * (1 - float(margin))))
    return sorted({low, int(previous_knee)})


def gate(previous_knee: int, margin: float, sweep_steps: Sequence[Mapping[str, Any]],
         targets: Mapping[str, float]) -> dict[str, Any]:
    """Whether an upgrade kept its capacity: the new p95 knee within ``margin`` of ``previous_knee``.

    ``sweep_steps``: the steps of :func:`gate_steps` run on the new engine. Returns ``{"passed", "knee"
    (:func:`knee`), "previous_knee", "lowest_allowed", "summary"}``. With a previous knee of 1 the gate
    runs one request at a time, which any engine that answers passes; the summary says so.
    """
    lowest = gate_steps(previous_knee, margin)[0]
    found = knee(sweep_steps, targets, "p95")
    k = found["concurrency"]
    passed = k is not None and k >= lowest
    if k is not None and k >= previous_knee:
        moved = f"the knee holds at {k} or above (was {previous_knee})"
    elif passed:
        moved = f"the knee moved down from {previous_knee} to between {k} and {previous_knee}, within the margin"
    else:
        broke = ", ".join(found["broke_on"]) or "nothing measured"
        moved = (f"the knee fell below {lowest} concurrent requests (was {previous_knee}; allowed down to "
                 f"{lowest}, margin {margin:.0%}): {broke} broke at {found['first_break']}")
    if int(previous_knee) == 1:
        moved += ("; the last sweep's knee was 1, so this gate ran one request at a time and cannot tell an engine "
                  "that serves one sequence at a time: run playbooks/sweep.yml on a quiet box to arm it")
    return {"passed": passed, "knee": found, "previous_knee": int(previous_knee), "lowest_allowed": lowest,
            "summary": moved}


def table(sweep_steps: Sequence[Mapping[str, Any]], targets: Mapping[str, float]) -> list[str]:
    """The sweep as terminal lines: one row per step, seconds and tokens/s, a mark where a p95 target broke."""
    head = (f"{'conc':>5} {'TTFT p50/p95/p99 s':>22} {'TPOT p50/p95/p99 s':>22} {'tok/s':>8} {'req/s':>6} "
            f"{'queued':>6} {'KV peak':>7} {'prefix hit':>10} {'ok':>7}")
    rows = [head]

    def trio(values: Mapping[str, Any] | None) -> str:
        values = values or {}
        return "/".join("-" if values.get(p) is None else f"{float(values[p]):.3f}" for p in ("p50", "p95", "p99"))

    for s in sorted(sweep_steps, key=lambda s: int(s["concurrency"])):
        kv, hit = s.get("kv_cache_usage_peak"), s.get("prefix_cache_hit_rate")
        mark = "" if meets(s, targets) else "  <- misses a p95 target" if not int(s.get("failed") or 0) else \
            "  <- requests failed"
        rows.append(f"{int(s['concurrency']):>5} {trio(s.get('ttft_seconds')):>22} {trio(s.get('tpot_seconds')):>22} "
                    f"{float(s.get('output_throughput') or 0):>8.1f} {float(s.get('request_throughput') or 0):>6.2f} "
                    f"{int(s.get('queue_peak') or 0):>6} {'-' if kv is None else f'{float(kv):.1%}':>7} "
                    f"{'-' if hit is None else f'{float(hit):.1%}':>10} "
                    f"{int(s.get('completed') or 0):>3}/{int(s.get('completed') or 0) + int(s.get('failed') or 0):<3}"
                    f"{mark}")
    return rows


def prefix_win(shared: Mapping[str, Any], plain: Mapping[str, Any]) -> dict[str, Any]:
    """The prefix cache's win at one concurrency: the same prompt length with and without a shared prefix.

    ``shared``/``plain``: two steps at the same concurrency, prompts that start with the same system prompt
    and prompts that do not. Returns ``{"concurrency", "ttft_p50_seconds" {"shared", "plain"},
    "ttft_p95_seconds" {...}, "prefix_cache_hit_rate" {...}, "summary"}``.
    """
    def pick(step: Mapping[str, Any], metric: str, percentile: str) -> float | None:
        value = (step.get(metric) or {}).get(percentile)
        return None if value is None else float(value)

    out: dict[str, Any] = {"concurrency": int(shared["concurrency"])}
    for percentile in ("p50", "p95"):
        out[f"ttft_{percentile}_seconds"] = {"shared": pick(shared, "ttft_seconds", percentile),
                                             "plain": pick(plain, "ttft_seconds", percentile)}
    out["prefix_cache_hit_rate"] = {"shared": shared.get("prefix_cache_hit_rate"),
                                    "plain": plain.get("prefix_cache_hit_rate")}
    p50 = out["ttft_p50_seconds"]
    hits = out["prefix_cache_hit_rate"]
    rate = "/".join("-" if hits[k] is None else f"{float(hits[k]):.0%}" for k in ("shared", "plain"))
    if p50["shared"] is not None and p50["plain"]:
        change = f"TTFT p50 {p50['plain']:.3f} s -> {p50['shared']:.3f} s ({p50['shared'] / p50['plain'] - 1:+.0%})"
    else:
        change = "TTFT not measured"
    out["summary"] = (f"at {out['concurrency']} concurrent, a shared system prompt: {change}; prefix cache hit "
                      f"rate {rate} (shared/plain)")
    return out


def analyse(sweep_steps: Sequence[Mapping[str, Any]], targets: Mapping[str, float],
            points: Mapping[str, Any]) -> dict[str, Any]:
    """What a sweep's steps say: ``knee`` ({"p95", "p99"}: :func:`knee`), ``recommendation``
    (:func:`recommend`, from the p95 knee), ``lengths`` (:func:`lengths` over every step's requests, when
    the steps carry ``input_lens``/``output_lens``), ``context`` (:func:`context_against_plan`) and
    ``table`` (:func:`table`)."""
    knees = {p: knee(sweep_steps, targets, p) for p in PERCENTILES}
    advice = recommend(knees["p95"], points)
    noisy = knees["p95"]["noisy"]
    if noisy:
        advice["summary"] += (f" (the fit overruled the measurement at {', '.join(map(str, noisy))} concurrent: "
                              "sweep again with more prompts per step before changing anything)")
    inputs = [int(v) for s in sweep_steps for v in s.get("input_lens") or []]
    outputs = [int(v) for s in sweep_steps for v in s.get("output_lens") or []]
    measured = lengths(inputs, outputs) if inputs else None
    return {"knee": knees, "recommendation": advice, "lengths": measured,
            "context": context_against_plan(measured, points) if measured else None,
            "table": table(sweep_steps, targets)}


def report(document: Mapping[str, Any]) -> list[str]:
    """The sweep document as the lines an admin reads: the table, both knees, the recommendation, the
    context against the plan and the prefix cache's win (each where the sweep has it)."""
    points, targets = document["plan"], document["targets"]
    lines = [f"targets (p95): TTFT {float(targets['ttft_seconds']):g} s, TPOT {float(targets['tpot_seconds']):g} s; "
             f"plan: {points['concurrent_sequences']} expected, --max-num-seqs {points['max_num_seqs']}"]
    lines += list(document["table"])
    for percentile in PERCENTILES:
        k = document["knee"][percentile]
        if k["concurrency"] is None:
            lines.append(f"knee ({percentile}): none, {'/'.join(k['broke_on'])} missed at {k['first_break']}")
        elif k["never_broke"]:
            lines.append(f"knee ({percentile}): at least {k['concurrency']} (nothing broke up to the last step)")
        else:
            lines.append(f"knee ({percentile}): {k['concurrency']} concurrent requests "
                         f"({'/'.join(k['broke_on'])} broke at {k['first_break']})")
    lines.append(f"recommendation: {document['recommendation']['summary']}")
    for key, value in document["recommendation"].get("inventory", {}).items():
        lines.append(f"  set {key}: {value}")
    if document.get("context"):
        lines.append(f"context: {document['context']['summary']}")
    if document.get("prefix_cache"):
        lines.append(f"prefix cache: {document['prefix_cache']['summary']}")
    if document.get("stopped"):
        lines.append(f"stopped: {document['stopped']}")
    return lines
