"""The deployment checklist's verdicts: one function per check, from what the role gathered on the box.

Each ``check_*`` filter takes what Ansible measured (bench results, ``/metrics`` text, the engine log, HTTP
answers, module results) and returns one record (module_utils/checklist.py). Times are seconds, sizes
tokens, unless a key says otherwise. The tasks only gather and report; every threshold and verdict is here
and in the bench, eval and sweep filters, so tests/unit/test_verify.py tests them with real captured inputs.

    {{ teamserve_verify_results | teamserve.core.verify_merge(new_records) }}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.teamserve.core.plugins.module_utils import vllm_log
from ansible_collections.teamserve.core.plugins.module_utils.checklist import Record, record, skipped

# Interfaces whose addresses are not the host's own network presence (loopback, container bridges and
# their veth ends): an outside probe of them would leave the LAN for an unrelated network.
_INTERNAL_IFACES = re.compile(r"^(lo|docker\d*|br-.*|veth.*|virbr.*|cni.*|flannel.*|cali.*|tun.*|tap.*)$")


def failed(checks: Any, result: Any = None, task: Any = None, measured: Any = None) -> list[Record]:
    """FAIL records for checks whose gathering stopped with an error (a task failed).

    ``checks``: one id or a list of ids; ``result``: the failed task's result (``ansible_failed_result``);
    ``task``: the failed task (``ansible_failed_task``). The summary is the task's name and the last
    non-empty line of its message (a program's traceback ends with the error); a failed
    ``vllm bench serve`` container reports its exit status.
    """
    result = result if isinstance(result, Mapping) else {}
    name = str((task or {}).get("name") or "") if isinstance(task, Mapping) else ""
    lines = [line for line in str(result.get("msg") or "").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "failed"
    if "vllm bench serve" in name and isinstance(result.get("status"), int):
        summary = f"vllm bench serve exited with status {result['status']}: {last}"
    else:
        summary = f"{name}: {last}" if name else last
    ids = checks if isinstance(checks, Sequence) and not isinstance(checks, str) else [checks]
    extra = {"measured": measured} if measured else {}
    return [record(int(i), "FAIL", summary[:300], **extra) for i in ids]


def _flag(argv: Sequence[Any], name: str) -> str | None:
    """The value of ``--name`` in an argv (``--name value`` or ``--name=value``); None when absent."""
    items = [str(a) for a in argv]
    for index, item in enumerate(items):
        if item == f"--{name}" and index + 1 < len(items):
            return items[index + 1]
        if item.startswith(f"--{name}="):
            return item.split("=", 1)[1]
    return None


def _unpinned(image: str) -> str:
    """``repo:tag@digest`` -> ``repo@digest``, the reference the vllm role runs the engine from."""
    name, _, digest = str(image).partition("@")
    repo = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return f"{repo}@{digest}" if digest else repo


def engine(container: Any) -> dict[str, Any]:
    """What the checks need from the running engine container (``docker_container_info``'s ``container``).

    Returns ``running`` (bool), ``started_at`` (Docker's RFC 3339 time), ``started_epoch`` (seconds), ``argv``,
    ``image``,    ``metrics_url`` (the published API port on the box, ``http://host:port/metrics``), ``hf_cache`` (host
    directory mounted as the HF cache, or None) and ``kv_cache_dtype`` (``--kv-cache-dtype``, vLLM's
    default ``auto``). Raises AnsibleFilterError when the container does not exist or publishes no port.
    """
    if not isinstance(container, Mapping) or not container:
        raise AnsibleFilterError("the engine container does not exist; converge site.yml first")
    argv = list((container.get("Config") or {}).get("Cmd") or [])
    port = _flag(argv, "port") or "8000"
    bindings = ((container.get("HostConfig") or {}).get("PortBindings") or {}).get(f"{port}/tcp") or []
    if not bindings:
        raise AnsibleFilterError(f"the engine container publishes no host port for its API port {port}")
    host = bindings[0].get("HostIp") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    started = (container.get("State") or {}).get("StartedAt") or ""
    mounts = container.get("Mounts") or []
    hf_cache = next((m.get("Source") for m in mounts if m.get("Destination") == "/root/.cache/huggingface"), None)
    return {
        "running": bool((container.get("State") or {}).get("Running")),
        "started_at": started,
        "started_epoch": vllm_log.parse_docker_time(started) if started else None,
        "argv": argv,
        "image": (container.get("Config") or {}).get("Image"),
        "metrics_url": f"http://{host}:{bindings[0].get('HostPort')}/metrics",
        "hf_cache": hf_cache,
        "kv_cache_dtype": _flag(argv, "kv-cache-dtype") or "auto",
    }


def check_capacity(plan: Any, engine_log: str | None, tolerance: float = 0.10) -> Record:
    """Check 1: the plan fits, and the KV cache the engine allocated matches the plan.

    ``plan``: the vllm role's ``vllm_plan`` (the capacity planner's dict: fits, verdict, levers, numbers).
    ``engine_log``: the engine's log since its start (its "GPU/CPU KV cache size: N tokens" line).
    ``tolerance``: largest relative difference between the logged and the planned KV tokens. The default
    0.10 comes from benchmarks/capacity/README.md: the planner's KV memory, derived from the GPU's total
    memory, utilisation and weights, is off by 0.69 % median and 8.2 % at most over 10 public logs, and KV
    tokens scale with it (from the logged KV memory the tokens are within 0.1 %).
    A CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, not GPU memory, so the GPU plan's count does
    not apply: the logged cache must then hold the workload (concurrent sequences x average context).
    A log without the line (rotated away since the start) leaves the verdict to the plan.
    """
    if not isinstance(plan, Mapping) or "numbers" not in plan:
        return record(1, "FAIL", "no capacity plan (the vllm role could not compute one)")
    n = plan["numbers"]
    ok = bool(plan.get("fits"))
    planned = int(n.get("kv_tokens") or 0)
    need = int(n["concurrent_sequences"]) * int(n["avg_context_tokens"])
    kv = vllm_log.kv_cache_size(engine_log or "")
    error = None
    if kv is None:
        kv_text = "the engine log has no KV cache size line since its start (rotated away?): not compared"
    elif kv["device"] == "GPU":
        error = round((planned - kv["tokens"]) / kv["tokens"], 4) if kv["tokens"] else math.inf
        ok = ok and abs(error) <= tolerance
        kv_text = (f"engine's GPU KV cache {kv['tokens']:,} tokens, plan {planned:,} "
                   f"({100 * error:+.1f} %, tolerance {100 * tolerance:.0f} %)")
    else:
        ok = ok and kv["tokens"] >= need
        kv_text = (f"engine's {kv['device']} KV cache {kv['tokens']:,} tokens (sized by the {kv['device']} build, "
                   f"not the GPU plan) {'holds' if kv['tokens'] >= need else 'does NOT hold'} "
                   f"{n['concurrent_sequences']} x {n['avg_context_tokens']:,} = {need:,} tokens")
    return record(
        1, "PASS" if ok else "FAIL", f"{plan.get('verdict')}; {kv_text}",
        measured={
            "gpus": f"{n.get('gpu_count')} x {n.get('gpu')}",
            "kv_budget_gib": n.get("kv_budget_gib"),
            "kv_bytes_per_token": n.get("kv_bytes_per_token"),
            "max_concurrency_at_avg_context": n.get("max_concurrency_avg"),
            "max_concurrency_at_max_context": n.get("max_concurrency_max"),
            "plan_kv_tokens": planned,
            "engine_kv_cache": kv,
            "kv_tokens_error": error,
        },
        target={
            "concurrent_sequences": n.get("concurrent_sequences"),
            "avg_context_tokens": n.get("avg_context_tokens"),
            "max_context_tokens": n.get("max_model_len"),
            "kv_tokens_tolerance": tolerance,
        },
        levers=[] if plan.get("fits") else list(plan.get("levers") or []),
    )


def check_engine(running: Any, argv: Any, image: str, served_model_name: str, vllm_version: Any,
                 models: Any) -> Record:
    """Check 2: the engine runs the planned argv from the pinned image and the gateway lists the model.

    ``running``: :func:`engine` of the running container. ``argv``: the planned ``vllm_argv`` (every flag
    already checked against the pinned vLLM's option snapshot when it was rendered). ``image``: the pin
    ``repo:tag@digest``. ``models``: the ``uri`` result of ``GET /v1/models`` through the gateway.
    """
    if argv is None:
        return record(2, "FAIL", "no planned argv to compare with (the vllm role could not compute the plan)")
    planned = [str(a) for a in argv]
    pinned = _unpinned(image)
    models = models if isinstance(models, Mapping) else {}
    body = models.get("json") if isinstance(models.get("json"), Mapping) else {}
    served = [m.get("id") for m in body.get("data") or [] if isinstance(m, Mapping)]
    is_running = bool(running.get("running"))
    argv_ok = running.get("argv") == planned
    image_ok = running.get("image") == pinned
    listed = served_model_name in served
    flags = sum(1 for a in planned if a.startswith("--"))
    return record(
        2, "PASS" if is_running and argv_ok and image_ok and listed else "FAIL",
        f"vLLM {vllm_version}: container {'running' if is_running else 'NOT running'}, "
        f"argv {'equals the plan' if argv_ok else 'DIFFERS from the plan'} ({flags} flags in the {vllm_version} "
        f"option snapshot), image {'pinned digest' if image_ok else 'NOT the pinned digest'}, /v1/models via "
        f"gateway (HTTP {models.get('status', 'none')}) {'lists' if listed else 'does NOT list'} '{served_model_name}'",
        measured={"running": is_running, "argv": running.get("argv"), "image": running.get("image"),
                  "gateway_models": served},
        target={"vllm_version": vllm_version, "argv": planned, "image": pinned,
                "served_model_name": served_model_name},
    )


def check_targets(runs: Any, workload: Any) -> Record:
    """Check 3: TTFT p95 and TPOT p95 of the 1x run against ``vllm_workload``'s targets (seconds).

    Judged at p95, TPOT as well as TTFT: the target is what 19 in 20 requests must meet, and a median
    hides the slow streams people complain about. ``runs``: :func:`bench_run` results, 1x first.
    """
    if not runs:
        return record(3, "FAIL", "no bench run")
    run = runs[0]
    b = run["bench"]
    ttft, tpot = b["ttft_seconds"]["p95"], b["tpot_seconds"]["p95"]
    ttft_target, tpot_target = float(workload["ttft_p95_seconds"]), float(workload["tpot_seconds"])
    ok = (b["failed"] == 0 and b["completed"] > 0 and ttft is not None and tpot is not None
          and ttft <= ttft_target and tpot <= tpot_target)
    return record(
        3, "PASS" if ok else "FAIL",
        f"at {run['concurrency']} concurrent: TTFT p95 {ttft} s (target {ttft_target}), TPOT p95 {tpot} s "
        f"(target {tpot_target}), {b['completed']}/{b['num_prompts']} ok",
        measured={"concurrency": run["concurrency"], "ttft_p95_seconds": ttft, "tpot_p95_seconds": tpot,
                  "completed": b["completed"], "failed": b["failed"]},
        target={"ttft_p95_seconds": ttft_target, "tpot_p95_seconds": tpot_target, "failed": 0},
    )


def check_load(runs: Any, inputs: Any, workload: Any) -> Record:
    """Check 4: both runs (1x and 2x the expected concurrency) served every request.

    A batching server under twice the load should queue, not fail; the percentiles and how many requests
    queued in the engine are reported. ``runs``: :func:`bench_run` results; ``inputs``: :func:`bench_inputs`.
    """
    runs = list(runs or [])
    ok = len(runs) == 2 and all(r["bench"]["failed"] == 0 and r["bench"]["completed"] > 0 for r in runs)
    parts = []
    for r in runs:
        b, q = r["bench"], r["queue"]
        parts.append(
            f"{r['concurrency']} concurrent: TTFT p50/p95/p99 {b['ttft_seconds']['p50']}/{b['ttft_seconds']['p95']}/"
            f"{b['ttft_seconds']['p99']} s, TPOT p50/p95 {b['tpot_seconds']['p50']}/{b['tpot_seconds']['p95']} s, "
            f"{b['completed']}/{b['num_prompts']} ok, {q['queued']} of the {q['requests']} requests the engine "
            f"finished meanwhile queued > {q['threshold_seconds']} s")
    return record(
        4, "PASS" if ok else "FAIL", "; ".join(parts or ["no bench run"]) + " (target: every request served)",
        measured={"input_tokens": inputs["input_tokens"], "output_tokens": inputs["output_tokens"], "runs": runs},
        target={"failed": 0, "ttft_p95_seconds": float(workload["ttft_p95_seconds"]),
                "tpot_p95_seconds": float(workload["tpot_seconds"])},
    )


def check_long_prompt(result: Any, max_stall_seconds: float) -> Record:
    """Check 5: others keep streaming while a near-maximum prompt is prefilled.

    ``result``: the ``teamserve_verify_long_prompt`` module's result (ITL of the other streams before and
    during the prefill, seconds). PASS when no other stream paused longer than ``max_stall_seconds`` and
    every stream kept going. With chunked prefill a pause is one batch; without it, the whole prefill.
    ``attempts`` in ``result`` (set by the task's ``until``) is the measurement judged, counted from 1.
    """
    r = {k: v for k, v in dict(result or {}).items() if k not in ("changed", "failed", "invocation")}
    longest = (r.get("during") or {}).get("max")
    ok = (longest is not None and float(longest) <= float(max_stall_seconds)
          and r.get("streams_alive_after") == r.get("streams"))
    before, during = r.get("before") or {}, r.get("during") or {}
    return record(
        5, "PASS" if ok else "FAIL",
        f"{r.get('streams')} others' ITL p50/p99 {before.get('p50')}/{before.get('p99')} s before, "
        f"{during.get('p50')}/{during.get('p99')} s during the {r.get('long_prompt_tokens')}-token prefill "
        f"({r.get('long_prompt_ttft_seconds')} s); longest pause {longest} s (target <= {max_stall_seconds} s), "
        f"{r.get('streams_alive_after')}/{r.get('streams')} streams kept going"
        + (f" (measurement {r['attempts']})" if int(r.get("attempts") or 1) > 1 else ""),
        measured=r, target={"max_stall_seconds": float(max_stall_seconds), "streams_alive_after": r.get("streams")},
    )


def check_limits(limited_user: str, rate_limit: Any, limited: Any, other_user: str, other: Any) -> Record:
    """Check 6: one user's exhausted rate limit refuses them (429 with Retry-After), another user gets 200.

    ``limited``: the ``uri`` result of the requests sent as ``limited_user`` until a 429 (``attempts``,
    ``status``, ``retry_after``, ``content``); ``other``: the ``uri`` result of one request as
    ``other_user``. SKIP when ``limited_user`` is empty.
    """
    if not limited_user:
        return skipped(6, "no test user to exhaust; set teamserve_verify_limited_user (their key is refused for "
                          "one window)", "teamserve_verify_limited_user is empty")
    limited, other = dict(limited or {}), dict(other or {})
    status, attempts = limited.get("status"), limited.get("attempts", 1)
    retry_after = str(limited.get("retry_after") or "")
    try:
        code = (json.loads(limited.get("content") or "{}").get("error") or {}).get("code")
    except (ValueError, AttributeError):
        code = None
    if status != 429:
        return record(6, "FAIL", f"no 429 for {limited_user} after {attempts} requests (last HTTP {status}): the "
                                 "rate limit is not enforced",
                      measured={"limited_user": limited_user, "limited_status": status, "limited_requests": attempts},
                      target={"limited_status": 429, "rate_limit": rate_limit})
    ok = bool(retry_after) and other.get("status") == 200
    return record(
        6, "PASS" if ok else "FAIL",
        f"{limited_user} ({rate_limit['events']}/{rate_limit['window']}): HTTP {status} after {attempts} requests, "
        f"Retry-After {retry_after or 'MISSING'}; {other_user} then got HTTP {other.get('status', 'none')} "
        "(target 429 vs 200)",
        measured={"limited_user": limited_user, "limited_status": status, "limited_requests": attempts,
                  "retry_after": retry_after, "limited_error_code": code, "other_user": other_user,
                  "other_status": other.get("status")},
        target={"limited_status": 429, "other_status": 200, "rate_limit": rate_limit},
    )


def check_cold_start(enabled: bool, result: Any) -> Record:
    """Check 7: a restart's time to /health is within the budget and no regression on the previous one.

    ``result``: the vllm role's ``vllm_cold_start_result`` (``seconds_to_health``, ``seconds_to_first_token``,
    ``budget_seconds``, ``regression``, ``verdict``, phases). SKIP when ``enabled`` is false.
    """
    if not enabled:
        return skipped(7, "not measured (teamserve_verify_cold_start is false); it restarts the engine",
                       "teamserve_verify_cold_start is false")
    cs = dict(result or {})
    if cs.get("seconds_to_health") is None:
        return record(7, "FAIL", "the engine restart was not measured", measured=cs)
    budget = float(cs.get("budget_seconds") or 0)
    ok = float(cs["seconds_to_health"]) <= budget and not cs.get("regression")
    return record(
        7, "PASS" if ok else "FAIL",
        f"{cs.get('verdict') or str(cs['seconds_to_health']) + ' s to /health'}; "
        f"{cs.get('seconds_to_first_token', '?')} s to the first token through the gateway (budget {budget:.0f} s)",
        measured=cs, target={"budget_seconds": budget, "regression": False},
    )


def host_addresses(facts: Any) -> list[str]:
    """The host's own addresses from ``ansible_facts`` (network subset), for the outside probe.

    Every IPv4 address (primary and secondaries) and every global IPv6 address of each interface except
    loopback and container networks (docker*, br-*, veth*, ...), whose addresses are private to the host.
    Sorted, without duplicates.
    """
    addresses: set[str] = set()
    for name in (facts or {}).get("interfaces", []):
        if _INTERNAL_IFACES.match(name):
            continue
        iface = facts.get(name.replace("-", "_").replace(".", "_")) or facts.get(name) or {}
        ipv4 = iface.get("ipv4") or {}
        if ipv4.get("address"):
            addresses.add(ipv4["address"])
        for extra in iface.get("ipv4_secondaries") or []:
            if extra.get("address"):
                addresses.add(extra["address"])
        for six in iface.get("ipv6") or []:
            if six.get("scope") == "global" and six.get("address"):
                addresses.add(six["address"])
    return sorted(addresses)


def check_outside(outside_host: str, port: int, probes: Any) -> Record:
    """Check 9: from a host outside the LAN, no address of the box accepts a connection on the gateway port.

    ``probes``: the looped ``wait_for`` results, one per box address (``item``); ``wait_for`` returns
    ``state`` only when the port accepted. SKIP when ``outside_host`` is empty.
    """
    if not outside_host:
        return skipped(9, "no outside host; set teamserve_verify_outside_host to an inventory host outside the LAN",
                       "teamserve_verify_outside_host is empty")
    results = list(probes or [])
    probed = [p["item"] for p in results]
    connected = [p["item"] for p in results if "state" in p]
    ok = not connected and bool(probed)
    return record(
        9, "PASS" if ok else "FAIL",
        f"from {outside_host}: {len(probed)} address(es) x port {port}, {len(connected)} connected "
        f"{'(' + ', '.join(map(str, connected)) + ')' if connected else ''} (target 0)",
        measured={"outside_host": outside_host, "port": int(port), "probed": probed, "connected": connected,
                  "refused_or_timed_out": [a for a in probed if a not in connected]},
        target={"connected": []},
    )


def table(results: Any) -> list[str]:
    """Check records as aligned table lines, sorted by id; the last line counts PASS/FAIL/SKIP."""
    rows = sorted(results or [], key=lambda r: int(r["id"]))
    width = max([len(str(r["name"])) for r in rows] + [5])
    lines = [f"{'id':>2}  {'check':<{width}}  {'status':<6}  measured vs target",
             f"{'-' * 2}  {'-' * width}  {'-' * 6}  {'-' * 18}"]
    lines += [f"{r['id']:>2}  {r['name']:<{width}}  {r['status']:<6}  {r.get('summary', '')}" for r in rows]
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return lines


def merge(results: Any, new: Any) -> list[Record]:
    """``results`` with ``new`` (one record or a list) added; a later record for an id replaces the earlier."""
    added = [new] if isinstance(new, Mapping) else list(new)
    ids = {r["id"] for r in added}
    return [r for r in results or [] if r["id"] not in ids] + added


class FilterModule:
    """The checklist's filters, as ``teamserve.core.verify_<function>``."""

    def filters(self) -> dict[str, Any]:
        functions = (engine, failed, check_capacity, check_engine, check_targets, check_load, check_long_prompt,
                     check_limits, check_cold_start, host_addresses, check_outside, table, merge)
        return {f"verify_{f.__name__}": f for f in functions}
