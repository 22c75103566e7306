"""The capacity sweep (playbooks/sweep.yml) and the upgrade's capacity gate: the steps to run from the plan,
each step's verdict, the knee, the document kept on the box, the baseline an upgrade is compared with.
The arithmetic is the planner package's (teamserve_capacity.sweep); these filters feed it what Ansible
measured.

    {{ sweep_history | teamserve.core.verify_sweep_baseline(pins) }}
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.teamserve.core.plugins.filter.bench import bench_inputs
from ansible_collections.teamserve.core.plugins.filter.evaluation import prompt_lines


def sweep_prompts(text: str, source: str = "teamserve_verify_sweep_prompts_file") -> str:
    """The admin's prompts as ``vllm bench serve --dataset-name custom`` reads them: one ``{"prompt": ...}``
    per line and nothing else (its pandas reader takes no comments or blank lines). Raises
    AnsibleFilterError naming the line for a bad one, or when there is no prompt."""
    lines = [json.dumps({"prompt": item["prompt"]}) for _, item in prompt_lines(text, source, '{"prompt": "..."}')]
    if not lines:
        raise AnsibleFilterError(f"{source} holds no prompts; add JSON lines like "
                                 '{"prompt": "Summarise this contract: ..."}')
    return "\n".join(lines) + "\n"


def _sweep() -> ModuleType:
    """teamserve_capacity.sweep, the sweep's arithmetic (the project's planner package, in the venv)."""
    try:
        from teamserve_capacity import sweep
    except ImportError as err:  # pragma: no cover - depends on the controller's venv
        raise AnsibleFilterError(f"the teamserve_capacity package is not importable on the controller ({err}); "
                                 "run `.venv/bin/pip install --no-deps -e .` in the repository") from err
    return sweep


def sweep_inputs(plan: Any, workload: Any, model: Any, settings: Any) -> dict[str, Any]:
    """What the sweep runs, from the plan and the role's settings (``teamserve_verify_sweep_*``, keys without
    the prefix): ``steps`` (concurrencies), ``bound``, ``targets`` (seconds, and where they came from),
    ``points`` (the plan's numbers the knee is compared with), ``input_tokens``/``output_tokens``,
    ``tokenizer`` and ``args`` (the ``vllm bench serve`` dataset arguments; ``plain_args`` too when a shared
    prefix is asked for: the same prompt length without it, for the prefix cache's A/B).

    ``bound`` 0 is the plan's ``--max-num-queued-reqs`` (the plan's ``--max-num-seqs`` when it sets no queue):
    that many requests fit in the engine's waiting queue even with nothing running, so no step reaches the
    point where the engine answers 503. Targets 0 are ``vllm_workload``'s. Raises AnsibleFilterError naming the setting when a value cannot work.
    """
    sweep = _sweep()
    s = dict(settings or {})
    points = sweep.plan_points(plan)
    output_tokens = int(s.get("output_tokens") or 0)
    base = bench_inputs(plan, workload, model, int(s.get("input_tokens") or 0), output_tokens)
    bound = int(s.get("bound") or 0) or points["max_num_queued_reqs"] or points["max_num_seqs"]
    given = [int(c) for c in s.get("concurrencies") or []]
    if any(c < 1 for c in given):
        raise AnsibleFilterError(f"teamserve_verify_sweep_concurrencies={given}: every step must be >= 1 request")
    steps = sorted(set(given)) if given else sweep.steps(points["concurrent_sequences"], points["max_num_seqs"], bound)
    targets = {"ttft_seconds": float(s.get("ttft_p95_seconds") or workload["ttft_p95_seconds"]),
               "tpot_seconds": float(s.get("tpot_seconds") or workload["tpot_seconds"])}
    source = ("teamserve_verify_sweep_* (a what-if)" if s.get("ttft_p95_seconds") or s.get("tpot_seconds")
              else "vllm_workload")
    prefix = int(s.get("shared_prefix_tokens") or 0)
    prompts_file = str(s.get("prompts_file") or "")
    if prompts_file:
        if prefix:
            raise AnsibleFilterError("teamserve_verify_sweep_shared_prefix_tokens applies to random prompts; with "
                                     "teamserve_verify_sweep_prompts_file the prompts are yours as they are: set one")
        args = ["--dataset-name=custom", f"--dataset-path={prompts_file}", f"--custom-output-len={output_tokens}"]
        if s.get("api_endpoint") == "/v1/completions":
            args.append("--skip-chat-template")  # a completions-only model has no chat template to apply
        dataset = "file"
    else:
        if prefix >= base["input_tokens"]:
            raise AnsibleFilterError(
                f"teamserve_verify_sweep_shared_prefix_tokens={prefix} leaves no random part in a "
                f"{base['input_tokens']}-token prompt; lower it below the prompt length")
        args = ["--dataset-name=random", f"--random-input-len={base['input_tokens'] - prefix}",
                f"--random-output-len={output_tokens}", "--random-range-ratio=0"]
        dataset = "random"
    plain = list(args)
    if prefix:
        args.append(f"--random-prefix-len={prefix}")
        plain[1] = f"--random-input-len={base['input_tokens']}"
    goodput = ["--goodput", f"ttft:{targets['ttft_seconds'] * 1000:g}", f"tpot:{targets['tpot_seconds'] * 1000:g}"]
    # one request before each step's measurement: the first after an idle engine is the slowest of a step
    # (1.28 s against 0.035 s at p95 on the testbed), which at small steps is the whole p95
    common = ["--ignore-eos", "--save-detailed", "--num-warmups=1"]
    return {"steps": steps, "bound": bound, "targets": targets, "targets_source": source, "points": points,
            "input_tokens": base["input_tokens"], "output_tokens": output_tokens, "tokenizer": base["tokenizer"],
            "dataset": dataset, "shared_prefix_tokens": prefix,
            "args": args + common + goodput, "plain_args": plain + common + goodput if prefix else None,
            "rounds": int(s.get("rounds") or 1), "min_prompts": int(s.get("min_prompts") or 1),
            "attempts": int(s.get("attempts") or 1)}


def sweep_step(run: Any) -> dict[str, Any]:
    """One :func:`bench_step` run as the sweep keeps it (flat, seconds and tokens; see teamserve_capacity.sweep)."""
    b, q, e = run["bench"], run["queue"], run.get("engine") or {}
    return {"concurrency": int(run["concurrency"]), "prompts": b["num_prompts"], "completed": b["completed"],
            "failed": b["failed"], "duration_seconds": b["duration_seconds"],
            **{f"{m}_seconds": b[f"{m}_seconds"] for m in ("ttft", "tpot", "itl", "e2el")},
            "request_throughput": b["request_throughput"], "output_throughput": b["output_throughput"],
            "request_goodput": b.get("request_goodput"), "queue_peak": e.get("waiting_peak"),
            "queued": q["queued"], "mean_queue_wait_seconds": q["mean_wait_seconds"],
            "kv_cache_usage_peak": e.get("kv_cache_usage_peak"), "running_peak": e.get("running_peak"),
            "prefix_cache_hit_rate": e.get("prefix_cache_hit_rate"), "preemptions": e.get("preemptions"),
            "samples": e.get("samples"), "errors": b["errors"], "attempt": int(run.get("attempt") or 1),
            "earlier": list(run.get("earlier") or []),
            "input_lens": run.get("input_lens") or [], "output_lens": run.get("output_lens") or []}


def sweep_summary(run: Any) -> dict[str, Any]:
    """A :func:`bench_step` run in a few numbers (a measurement a repeat replaced): concurrency, TTFT and
    TPOT p95 (s), completed and failed requests."""
    b = run["bench"]
    return {"concurrency": int(run["concurrency"]), "ttft_p95_seconds": b["ttft_seconds"]["p95"],
            "tpot_p95_seconds": b["tpot_seconds"]["p95"], "completed": b["completed"], "failed": b["failed"]}


def sweep_meets(run: Any, targets: Any) -> bool:
    """Whether one :func:`bench_step` run met both p95 ``targets`` with every request served."""
    met: bool = _sweep().meets(sweep_step(run), targets, "p95")
    return met


def sweep_stop(run: Any, inputs: Any) -> str:
    """Why the sweep stops after this :func:`bench_step` run, or "" to go on (teamserve_capacity.sweep.stop_after)."""
    reason: str = _sweep().stop_after(sweep_step(run), inputs["targets"], inputs["points"]["concurrent_sequences"],
                                      inputs["bound"])
    return reason


def sweep_document(runs: Any, inputs: Any, meta: Any, plain_run: Any = None) -> dict[str, Any]:
    """The sweep's JSON: ``meta`` (host, at, versions, pins, settings) + the steps, the targets, the plan's
    points, the knees, the recommendation, the context against the plan, the prefix cache's A/B (when
    ``plain_run`` is given: the same concurrency without the shared prefix) and the report lines."""
    sweep = _sweep()
    steps = [sweep_step(r) for r in runs or []]
    document: dict[str, Any] = {**dict(meta or {}), "steps": steps, "targets": dict(inputs["targets"]),
                                "targets_source": inputs["targets_source"], "plan": dict(inputs["points"]),
                                "settings": {k: inputs[k] for k in ("dataset", "input_tokens", "output_tokens",
                                                                    "shared_prefix_tokens", "bound", "rounds",
                                                                    "min_prompts", "attempts", "args")},
                                **sweep.analyse(steps, inputs["targets"], inputs["points"])}
    document["prefix_cache"] = None
    if plain_run:
        plain = sweep_step(plain_run)
        shared = next((s for s in steps if s["concurrency"] == plain["concurrency"]), None)
        if shared:
            document["prefix_cache"] = {**sweep.prefix_win(shared, plain), "plain_step": plain}
    document["report"] = sweep.report(document)
    return document


def sweep_history(document: Any) -> dict[str, Any]:
    """One line of the box's sweep history: the document without its per-request lists and report."""
    line = {k: v for k, v in dict(document).items() if k not in ("report", "table")}
    line["steps"] = [{k: v for k, v in s.items() if k not in ("input_lens", "output_lens")} for s in line["steps"]]
    if line.get("prefix_cache"):
        line["prefix_cache"] = {k: v for k, v in line["prefix_cache"].items() if k != "plain_step"}
    for percentile in list((line.get("knee") or {}).keys()):
        line["knee"][percentile] = {k: v for k, v in line["knee"][percentile].items() if k != "fitted"}
    return line


def sweep_baseline(history: Any, pins: Any) -> dict[str, Any] | None:
    """The newest full sweep in the box's history (JSON lines) made with ``pins`` (the box's recorded pins),
    with a p95 knee; None when there is none (the gate then has nothing to compare with)."""
    for text in reversed(str(history or "").splitlines()):
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if (line.get("kind") == "sweep" and line.get("pins") == pins
                and (line.get("knee") or {}).get("p95", {}).get("concurrency")):
            return dict(line)
    return None


def sweep_gate_steps(baseline: Any, margin: float) -> list[int]:
    """The gate's short sweep for a baseline sweep (teamserve_capacity.sweep.gate_steps on its p95 knee)."""
    steps: list[int] = _sweep().gate_steps(int(baseline["knee"]["p95"]["concurrency"]), float(margin))
    return steps


def sweep_gate(baseline: Any, runs: Any, margin: float) -> dict[str, Any]:
    """The upgrade's verdict: the new engine's p95 knee within ``margin`` of the baseline sweep's
    (teamserve_capacity.sweep.gate), judged against the baseline's own targets."""
    sweep = _sweep()
    result: dict[str, Any] = sweep.gate(int(baseline["knee"]["p95"]["concurrency"]), float(margin),
                                        [sweep_step(r) for r in runs or []], baseline["targets"])
    result["steps"] = [{k: v for k, v in sweep_step(r).items() if k not in ("input_lens", "output_lens")}
                       for r in runs or []]
    return result


class FilterModule:
    """The capacity sweep's filters, as ``teamserve.core.verify_<function>``."""

    def filters(self) -> dict[str, Any]:
        functions = (sweep_prompts, sweep_inputs, sweep_summary, sweep_meets, sweep_stop, sweep_document, sweep_history,
                     sweep_baseline, sweep_gate_steps, sweep_gate)
        return {f"verify_{f.__name__}": f for f in functions}
