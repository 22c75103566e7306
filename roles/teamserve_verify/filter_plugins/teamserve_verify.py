"""Filters of the teamserve_verify role: parse what the checks measured and render the report.

Plain functions without Ansible logic in them (only AnsibleFilterError for bad input), so
``tests/unit/test_verify_filters.py`` tests them directly:

- ``teamserve_verify_metric`` / ``teamserve_verify_histogram``: read the engine's Prometheus text
  (``GET /metrics``, exposition format 0.0.4: https://prometheus.io/docs/instrumenting/exposition_formats/).
- ``teamserve_verify_queue``: how many requests waited in the engine's queue between two scrapes, from the
  ``vllm:request_queue_time_seconds`` histogram (vLLM 0.32 ``vllm/v1/metrics/loggers.py``: "time spent in
  WAITING phase for request", observed once per finished request).
- ``teamserve_verify_bench``: the numbers the checklist needs from a ``vllm bench serve --save-result``
  JSON (keys ``p<N>_<metric>_ms``, ``completed``, ``failed``, ``errors``: vLLM 0.32
  ``vllm/benchmarks/serve.py``), converted to seconds.
- ``teamserve_verify_eval_parse`` / ``teamserve_verify_agreement`` / ``teamserve_verify_expected_match``:
  the admin's evaluation set (JSONL) and the comparison of answers between KV-cache dtypes.
- ``teamserve_verify_host_addresses``: the host's own LAN/WAN addresses to probe from outside.
- ``teamserve_verify_table``: the pass/fail table people read.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ansible.errors import AnsibleFilterError

# One sample line: name{labels} value [timestamp]. Label values may hold escaped quotes.
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Interfaces whose addresses are not the host's own network presence (loopback, container bridges and
# their veth ends): an outside probe of them would leave the testbed/LAN for an unrelated network.
_INTERNAL_IFACES = re.compile(r"^(lo|docker\d*|br-.*|veth.*|virbr.*|cni.*|flannel.*|cali.*|tun.*|tap.*)$")


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into (name, labels, value) tuples; comments are skipped.

    Raises AnsibleFilterError when ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise AnsibleFilterError(f"teamserve_verify: expected the /metrics text, got {type(text).__name__}")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((match.group(1), labels, value))
    return out


def teamserve_verify_metric(text: str, name: str) -> float | None:
    """Sum of every sample named exactly ``name`` (all label sets, e.g. one per engine); None if absent.

    Units are the metric's own (vLLM gauges such as ``vllm:num_requests_waiting`` count requests).
    """
    values = [value for sample, _, value in _samples(text) if sample == name]
    return sum(values) if values else None


def teamserve_verify_histogram(text: str, name: str) -> dict[str, Any]:
    """A Prometheus histogram summed over its label sets.

    Returns ``{"count": float, "sum": float, "buckets": {upper_bound (float, inf allowed): cumulative
    count}}``; all zero/empty when the histogram is absent. ``name`` is the base name without the
    ``_bucket``/``_count``/``_sum`` suffix.
    """
    result: dict[str, Any] = {"count": 0.0, "sum": 0.0, "buckets": {}}
    for sample, labels, value in _samples(text):
        if sample == f"{name}_count":
            result["count"] += value
        elif sample == f"{name}_sum":
            result["sum"] += value
        elif sample == f"{name}_bucket" and "le" in labels:
            bound = float(labels["le"])  # "+Inf" parses to inf
            result["buckets"][bound] = result["buckets"].get(bound, 0.0) + value
    return result


def teamserve_verify_queue(before: str, after: str, threshold_seconds: float | None = None,
                           name: str = "vllm:request_queue_time_seconds") -> dict[str, Any]:
    """Requests that finished between two ``/metrics`` scrapes and how long they waited to be scheduled.

    ``threshold_seconds`` (seconds) picks the histogram bucket that separates "admitted at once" from
    "queued"; it is rounded up to the nearest bucket bound, and defaults to the smallest bound (vLLM 0.32's
    request-latency buckets start at 0.3 s). Returns ``requests`` (finished requests seen), ``queued``
    (requests that waited longer than the threshold), ``threshold_seconds`` (the bound actually used),
    ``mean_wait_seconds`` and ``waited_seconds_total``. Raises AnsibleFilterError when the scrapes do not
    contain the histogram or its counter went backwards (the engine restarted in between).
    """
    first = teamserve_verify_histogram(before, name)
    second = teamserve_verify_histogram(after, name)
    if not second["buckets"]:
        raise AnsibleFilterError(f"teamserve_verify_queue: /metrics has no {name} histogram")
    requests = second["count"] - first["count"]
    if requests < 0:
        raise AnsibleFilterError(f"teamserve_verify_queue: {name}_count went down ({first['count']} -> "
                                 f"{second['count']}): the engine restarted between the two scrapes")
    finite = sorted(bound for bound in second["buckets"] if not math.isinf(bound))
    if threshold_seconds is None:
        bound = finite[0] if finite else math.inf
    else:
        bound = next((b for b in finite if b >= float(threshold_seconds)), math.inf)
    admitted = second["buckets"].get(bound, 0.0) - first["buckets"].get(bound, 0.0)
    waited = second["sum"] - first["sum"]
    return {
        "requests": int(round(requests)),
        "queued": int(round(requests - admitted)),
        "threshold_seconds": bound if not math.isinf(bound) else None,
        "waited_seconds_total": round(waited, 4),
        "mean_wait_seconds": round(waited / requests, 4) if requests else None,
    }


def _seconds(result: dict[str, Any], key: str) -> float | None:
    value = result.get(key)
    return round(float(value) / 1000.0, 5) if isinstance(value, (int, float)) else None


def teamserve_verify_bench(result: Any, percentiles: Any = (50, 95, 99)) -> dict[str, Any]:
    """Summarise a ``vllm bench serve --save-result`` JSON (dict) in seconds.

    Picks ``completed``, ``failed``, ``duration`` (s), ``request_throughput`` (req/s),
    ``output_throughput`` (tokens/s), ``max_concurrency`` and, for ttft/tpot/itl/e2el, the requested
    percentiles (``p<N>_<metric>_ms`` in the bench's JSON, converted from ms to s) plus the median.
    ``errors`` lists up to three distinct non-empty error strings (truncated to 200 characters).
    Raises AnsibleFilterError when ``result`` is not a dict or has no ``completed`` count.
    """
    if not isinstance(result, dict) or "completed" not in result:
        raise AnsibleFilterError("teamserve_verify_bench: not a vllm bench serve result (no 'completed' key)")
    summary: dict[str, Any] = {
        "completed": int(result.get("completed") or 0),
        "failed": int(result.get("failed") or 0),
        "num_prompts": result.get("num_prompts"),
        "max_concurrency": result.get("max_concurrency"),
        "duration_seconds": round(float(result.get("duration") or 0.0), 3),
        "request_throughput": round(float(result.get("request_throughput") or 0.0), 3),
        "output_throughput": round(float(result.get("output_throughput") or 0.0), 2),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = {"median": _seconds(result, f"median_{metric}_ms")}
        for pct in percentiles:
            word = str(int(pct)) if float(pct) == int(pct) else str(pct)
            values[f"p{word}"] = _seconds(result, f"p{word}_{metric}_ms")
        summary[f"{metric}_seconds"] = values
    errors: list[str] = []
    for error in result.get("errors") or []:
        text = str(error or "").strip()
        if text and text[:200] not in errors:
            errors.append(text[:200])
        if len(errors) == 3:
            break
    summary["errors"] = errors
    return summary


def teamserve_verify_eval_parse(text: str, source: str = "teamserve_verify_eval_file") -> list[dict[str, Any]]:
    """Parse an evaluation set: JSON Lines of ``{"prompt": str, "expected": str (optional)}``.

    Blank lines and lines starting with ``#`` are skipped. Raises AnsibleFilterError naming the line,
    the problem and the expected shape for invalid JSON, a missing or empty ``prompt``, a non-string
    ``expected``, a duplicated prompt, or an empty set.
    """
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, line in enumerate(str(text).splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise AnsibleFilterError(f"{where} is not JSON ({err.msg}); each line must be one object like "
                                     '{"prompt": "...", "expected": "..."}') from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise AnsibleFilterError(f"{where}: 'prompt' must be a non-empty string, got {line.strip()[:80]!r}")
        if "expected" in item and not isinstance(item["expected"], str):
            raise AnsibleFilterError(f"{where}: 'expected' must be a string when present, got "
                                     f"{type(item['expected']).__name__}")
        if item["prompt"] in seen:
            raise AnsibleFilterError(f"{where}: duplicated prompt {item['prompt'][:60]!r}; answers are keyed by prompt")
        seen.add(item["prompt"])
        items.append({"prompt": item["prompt"], "expected": item.get("expected")})
    if not items:
        raise AnsibleFilterError(f"{source} holds no prompts; add JSON lines like "
                                 '{"prompt": "What is 2+2?", "expected": "4"}')
    return items


def _normalise(answer: Any) -> str:
    return " ".join(str(answer if answer is not None else "").split())


def teamserve_verify_agreement(current: Any, other: Any) -> dict[str, Any]:
    """Exact-match agreement between two answer lists (``[{"prompt", "answer"}, ...]``), keyed by prompt.

    Answers are compared after collapsing whitespace. Returns ``compared`` (prompts present in both),
    ``agreed`` and ``rate`` (agreed / compared, None when nothing overlaps).
    """
    mine = {item["prompt"]: _normalise(item.get("answer")) for item in current or []}
    theirs = {item["prompt"]: _normalise(item.get("answer")) for item in other or []}
    common = sorted(set(mine) & set(theirs))
    agreed = sum(1 for prompt in common if mine[prompt] == theirs[prompt])
    return {"compared": len(common), "agreed": agreed,
            "rate": round(agreed / len(common), 4) if common else None}


def teamserve_verify_expected_match(answers: Any) -> dict[str, Any]:
    """Exact-match rate of answers against the eval set's ``expected`` values (whitespace-collapsed).

    Returns ``with_expected`` (items that carry an expected answer), ``matched`` and ``rate`` (None when no
    item has an expected answer).
    """
    graded = [item for item in answers or [] if item.get("expected") is not None]
    matched = sum(1 for item in graded if _normalise(item.get("answer")) == _normalise(item["expected"]))
    return {"with_expected": len(graded), "matched": matched,
            "rate": round(matched / len(graded), 4) if graded else None}


def teamserve_verify_eval_answers(results: Any) -> list[dict[str, Any]]:
    """Answers from the registered results of the eval requests (a looped ``uri`` to /v1/chat/completions).

    Each result carries ``item`` (the eval item: ``prompt``, ``expected``), ``status`` and ``json`` (the
    OpenAI-style body). Returns ``[{"prompt", "expected", "answer"}]`` in order. Raises AnsibleFilterError
    naming the prompt and the HTTP status when a request did not answer 200 with a choice.
    """
    answers = []
    for result in results or []:
        item = result.get("item") or {}
        body = result.get("json") or {}
        choices = body.get("choices") if isinstance(body, dict) else None
        if result.get("status") != 200 or not choices:
            raise AnsibleFilterError(
                f"the eval request for prompt {str(item.get('prompt'))[:60]!r} got HTTP {result.get('status')} "
                f"{str(result.get('msg') or '')[:120]}".rstrip())
        message = choices[0].get("message") or {}
        answers.append({"prompt": item.get("prompt"), "expected": item.get("expected"),
                        "answer": message.get("content") or ""})
    return answers


def teamserve_verify_eval_compare(current: Any, others: Any) -> list[dict[str, Any]]:
    """Agreement of ``current`` answers with each earlier run stored for another KV-cache dtype.

    ``others`` are the stored documents (``{"kv_cache_dtype", "at", "answers"}``). Returns one
    ``{"kv_cache_dtype", "at", "compared", "agreed", "rate"}`` per document, ordered by dtype.
    """
    out = []
    for doc in sorted(others or [], key=lambda d: str(d.get("kv_cache_dtype"))):
        row = {"kv_cache_dtype": doc.get("kv_cache_dtype"), "at": doc.get("at")}
        row.update(teamserve_verify_agreement(current, doc.get("answers") or []))
        out.append(row)
    return out


def teamserve_verify_host_addresses(facts: Any) -> list[str]:
    """The host's own addresses from gathered facts (``ansible_facts``), for an outside reachability probe.

    Every IPv4 address (primary and secondaries) and every global-scope IPv6 address of each interface,
    except loopback and container-network interfaces (docker*, br-*, veth*, virbr*, cni*, ...), whose
    addresses are private to the host. Sorted, without duplicates.
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


def teamserve_verify_table(results: Any) -> list[str]:
    """Render check results (``[{"id", "name", "status", "summary"}, ...]``) as aligned table lines.

    Rows are sorted by id; the last line counts PASS/FAIL/SKIP.
    """
    rows = sorted(results or [], key=lambda r: int(r["id"]))
    width = max([len(str(r["name"])) for r in rows] + [5])
    lines = [f"{'id':>2}  {'check':<{width}}  {'status':<6}  measured vs target",
             f"{'-' * 2}  {'-' * width}  {'-' * 6}  {'-' * 18}"]
    for row in rows:
        lines.append(f"{row['id']:>2}  {row['name']:<{width}}  {row['status']:<6}  {row.get('summary', '')}")
    counts = {status: sum(1 for r in rows if r["status"] == status) for status in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return lines


class FilterModule:
    """Registers the teamserve_verify filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "teamserve_verify_metric": teamserve_verify_metric,
            "teamserve_verify_histogram": teamserve_verify_histogram,
            "teamserve_verify_queue": teamserve_verify_queue,
            "teamserve_verify_bench": teamserve_verify_bench,
            "teamserve_verify_eval_parse": teamserve_verify_eval_parse,
            "teamserve_verify_agreement": teamserve_verify_agreement,
            "teamserve_verify_expected_match": teamserve_verify_expected_match,
            "teamserve_verify_eval_answers": teamserve_verify_eval_answers,
            "teamserve_verify_eval_compare": teamserve_verify_eval_compare,
            "teamserve_verify_host_addresses": teamserve_verify_host_addresses,
            "teamserve_verify_table": teamserve_verify_table,
        }
