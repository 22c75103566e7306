"""The team's own evaluation set (check 8, and the upgrade's before/after comparison): its prompts parsed
from JSON lines, each request's body, the answers kept from the engine's replies, and how far two
engines' answers agree.

    {{ lookup('ansible.builtin.file', teamserve_verify_eval_file) | teamserve.core.verify_eval_parse }}
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.teamserve.core.plugins.module_utils.checklist import Record, record, skipped


def completion_body(prompt: Any, endpoint: str, model: str, params: Any = None) -> dict[str, Any]:
    """The JSON body of one request to ``endpoint``: ``prompt`` as a completion's ``prompt`` for
    /v1/completions (a model declared completions-only), else as the user message of a chat completion;
    ``params`` (temperature, max_tokens, tools, ...) are added as given (:func:`eval_parse` refuses tools
    for /v1/completions, which has no tool calling).

        {{ item.prompt | teamserve.core.completion_body(vllm_api_endpoint, vllm_model.served_model_name, {'max_tokens': 32}) }}
    """
    body: dict[str, Any] = {"model": str(model), **dict(params or {})}
    if endpoint == "/v1/completions":
        body["prompt"] = str(prompt)
    else:
        body["messages"] = [{"role": "user", "content": str(prompt)}]
    return body


def prompt_lines(text: str, source: str, example: str) -> list[tuple[str, dict[str, Any]]]:
    """The JSON objects of a JSON Lines file that each carry a non-empty ``prompt``, with where each was.

    Blank lines and ``#`` lines are skipped. Raises AnsibleFilterError naming ``source``, the line and
    ``example`` (the expected shape) for invalid JSON or a missing/empty ``prompt``.
    """
    items: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(str(text).splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise AnsibleFilterError(f"{where} is not JSON ({err.msg}); each line must be one object like "
                                     f"{example}") from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise AnsibleFilterError(f"{where}: 'prompt' must be a non-empty string, got {line.strip()[:80]!r}")
        items.append((where, item))
    return items


_TOOL_CHOICES = ("none", "auto", "required")


def _tool_request(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tools`` and ``tool_choice`` of one evaluation line, checked, as request fields (``{}`` without).

    ``tools``: a non-empty list of OpenAI function tools (``{"type": "function", "function": {"name": ...}}``);
    ``tool_choice`` (only with ``tools``): "none", "auto", "required" or ``{"type": "function", "function":
    {"name": <one of the tools>}}``. vLLM 0.31 and 0.32 answer any choice but "none" only when the engine
    runs with --enable-auto-tool-choice and --tool-call-parser (vllm/parser/parser_manager.py); a named
    function constrains the output to that tool's JSON schema, so it suits an evaluation set best.
    Raises AnsibleFilterError naming ``where``, the field and the expected shape.
    """
    if "tools" not in item:
        if "tool_choice" in item:
            raise AnsibleFilterError(f"{where}: 'tool_choice' needs 'tools' on the same line")
        return {}
    tools = item["tools"]
    shape = '[{"type": "function", "function": {"name": "...", "parameters": {...}}}]'
    if not isinstance(tools, list) or not tools or not all(
            isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
        raise AnsibleFilterError(f"{where}: 'tools' must be a non-empty list of function tools like {shape}, "
                                 f"got {json.dumps(tools)[:80]}")
    request: dict[str, Any] = {"tools": tools}
    if "tool_choice" in item:
        choice, names = item["tool_choice"], [t["function"]["name"] for t in tools]
        named = (choice.get("function") or {}).get("name") if isinstance(choice, Mapping) else None
        if not (choice in _TOOL_CHOICES or (isinstance(choice, Mapping) and choice.get("type") == "function"
                                             and named in names)):
            raise AnsibleFilterError(f"{where}: 'tool_choice' must be one of {', '.join(_TOOL_CHOICES)} or "
                                     f'{{"type": "function", "function": {{"name": one of {names}}}}}, '
                                     f"got {json.dumps(choice)[:80]}")
        request["tool_choice"] = choice
    return request


def eval_parse(text: str, source: str = "teamserve_verify_eval_file",
               endpoint: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    """Parse an evaluation set: JSON Lines of ``{"prompt": str, "expected": str (optional), "tools": [...]
    (optional), "tool_choice": ... (optional)}`` (see :func:`_tool_request`), to be asked on ``endpoint``.

    Returns ``[{"prompt", "expected", "request"}]``, ``request`` being the extra request fields (tools) or
    ``{}``. Blank lines and ``#`` lines are skipped. Raises AnsibleFilterError naming the line and the
    expected shape for invalid JSON, a missing/empty ``prompt``, a non-string ``expected``, malformed
    tools, tools for /v1/completions (no tool calling there), a duplicated prompt, or an empty set.
    """
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for where, item in prompt_lines(text, source, '{"prompt": "...", "expected": "..."}'):
        if "expected" in item and not isinstance(item["expected"], str):
            raise AnsibleFilterError(f"{where}: 'expected' must be a string when present, got "
                                     f"{type(item['expected']).__name__}")
        if item["prompt"] in seen:
            raise AnsibleFilterError(f"{where}: duplicated prompt {item['prompt'][:60]!r}; answers are keyed by prompt")
        seen.add(item["prompt"])
        request = _tool_request(where, item)
        if request and endpoint == "/v1/completions":
            raise AnsibleFilterError(f"{where} carries tools, but the model is served on /v1/completions (declared "
                                     "completions-only), which has no tool calling; remove 'tools' from that line")
        items.append({"prompt": item["prompt"], "expected": item.get("expected"), "request": request})
    if not items:
        raise AnsibleFilterError(f"{source} holds no prompts; add JSON lines like "
                                 '{"prompt": "What is 2+2?", "expected": "4"}')
    return items

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _slug(value: Any) -> str:
    """``value`` as one file-name component: characters other than letters, digits, ``_ . -`` become ``_``."""
    return _UNSAFE.sub("_", str(value)).strip(".") or "_"


def _dtype(value: Any) -> str:
    """A KV-cache dtype as the last dotted part of a file name (no dots)."""
    return _slug(value).replace(".", "_")


def eval_key(pins: Any, kv_cache_dtype: str, eval_file: str, model: str) -> dict[str, Any]:
    """Where the answers of one engine to one evaluation set are kept in the box's store of evaluation answers.

    ``pins``: the engine's pins (``vllm_version``, ``vllm_image_digest`` as ``sha256:<hex>``, optionally
    ``vllm_model_revision``; other keys are ignored); ``kv_cache_dtype``: the engine's ``--kv-cache-dtype``;
    ``eval_file``: the evaluation set's path (only its name is used); ``model``: the served model name.

    Returns ``{"folder": "<eval file stem>.<model>", "file": "<vllm_version>-<digest, 12 hex>-<model revision,
    12 characters, or 'none'>.<kv_cache_dtype>.json", "pins": the three pins}``: one folder per evaluation set
    and model, one file per engine and KV-cache dtype (the dtype is the last dotted part before ``.json``; see
    :func:`eval_latest`). Raises AnsibleFilterError when ``vllm_version`` or ``vllm_image_digest`` is missing.
    """
    pins = dict(pins or {}) if isinstance(pins, Mapping) else {}
    version, digest = pins.get("vllm_version"), str(pins.get("vllm_image_digest") or "")
    if not version or not digest:
        raise AnsibleFilterError(f"the evaluation answers need the engine's vllm_version and vllm_image_digest, got {pins!r}; "
                                 "converge site.yml so the box records its pins")
    revision = pins.get("vllm_model_revision")
    stem = re.sub(r"\.jsonl?$", "", str(eval_file).rsplit("/", 1)[-1])
    engine = f"{_slug(version)}-{_slug(digest.removeprefix('sha256:'))[:12]}-{_slug(revision)[:12] if revision else 'none'}"
    return {"folder": f"{_slug(stem)}.{_slug(model)}", "file": f"{engine}.{_dtype(kv_cache_dtype)}.json",
            "pins": {"vllm_version": version, "vllm_image_digest": digest, "vllm_model_revision": revision}}


def eval_latest(files: Any, kv_cache_dtype: str) -> list[str]:
    """The paths of the newest answers kept for each KV-cache dtype other than ``kv_cache_dtype``.

    ``files``: ``ansible.builtin.find``'s ``files`` in one folder of the store (``path``, ``mtime`` in
    seconds), named as :func:`eval_key` names them. Returns their paths sorted by dtype.
    """
    newest: dict[str, Mapping[str, Any]] = {}
    for entry in files or []:
        parts = str(entry.get("path", "")).rsplit("/", 1)[-1].split(".")
        if len(parts) < 3 or parts[-1] != "json" or parts[-2] == _dtype(kv_cache_dtype):
            continue
        dtype = parts[-2]
        if dtype not in newest or float(entry.get("mtime") or 0) > float(newest[dtype].get("mtime") or 0):
            newest[dtype] = entry
    return [str(newest[dtype]["path"]) for dtype in sorted(newest)]


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` of a chat message's ``tool_calls``; ``arguments`` parsed from its JSON
    string (kept as the string when it is not JSON, which is itself a behaviour worth comparing)."""
    calls: list[dict[str, Any]] = []
    if not isinstance(message, Mapping):
        return calls
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            function = {}
        arguments = function.get("arguments")
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append({"name": function.get("name"), "arguments": arguments})
    return calls


def eval_answers(results: Any) -> list[dict[str, Any]]:
    """Answers from the looped ``uri`` results of the eval requests to /v1/chat/completions (the choice's
    ``message.content``) or, for a completions-only model, /v1/completions (the choice's ``text``).

    Returns ``[{"prompt", "expected", "answer", "prompt_tokens", "tool_calls"}]`` in order; ``prompt_tokens``
    is the response's ``usage.prompt_tokens`` (the prompt as the engine's chat template and tokenizer
    rendered it), None when the response has no usage; ``tool_calls`` is :func:`_tool_calls` of the message
    (``[]`` when it called none). Raises AnsibleFilterError naming the prompt and the HTTP status when a
    request did not answer 200 with a choice.
    """
    answers = []
    for result in results or []:
        item = result.get("item") or {}
        body = result.get("json") or {}
        choices = body.get("choices") if isinstance(body, Mapping) else None
        if result.get("status") != 200 or not choices:
            raise AnsibleFilterError(f"the eval request for prompt {str(item.get('prompt'))[:60]!r} got HTTP "
                                     f"{result.get('status')} {str(result.get('msg') or '')[:120]}".rstrip())
        usage = body.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        message = choices[0].get("message") or {}
        answers.append({"prompt": item.get("prompt"), "expected": item.get("expected"),
                        "answer": message.get("content") or choices[0].get("text") or "",
                        "prompt_tokens": prompt_tokens, "tool_calls": _tool_calls(message)})
    return answers


def _normalise(answer: Any) -> str:
    return " ".join(str(answer if answer is not None else "").split())


def _calls(item: Mapping[str, Any]) -> str:
    """An answer's tool calls as one comparable string (arguments with sorted keys)."""
    return json.dumps(item.get("tool_calls") or [], sort_keys=True)


def agreement(current: Any, other: Any) -> dict[str, Any]:
    """Exact-match agreement of two answer lists keyed by prompt: an answer agrees when its text
    (whitespace collapsed) and its tool calls (name and arguments) are the same. Returns ``compared``,
    ``agreed``, ``rate`` (None when no prompt is in both) and up to five ``changed`` answers
    (``{"prompt", "before" (``other``'s), "after" (``current``'s)}``, each cut to 200 characters).

    Also ``prompt_tokens_changed``: up to five ``{"prompt", "before", "after"}`` whose prompt token counts
    (see :func:`eval_answers`) differ, and ``prompt_tokens_differ``, how many do: the same messages rendered
    to a different length means the chat template or the tokenizer changed (a new vLLM release's default
    template, a changed tokenizer file), which shifts answers for a reason the admin should know. Likewise
    ``tool_calls_changed`` / ``tool_calls_differ`` for prompts whose tool calls differ: a release that
    calls another function, with other arguments or no longer at all (answers without ``tool_calls``, kept
    by an older version of this filter, count as calling none).
    """
    calls_now = {item["prompt"]: _calls(item) for item in current or []}
    calls_then = {item["prompt"]: _calls(item) for item in other or []}

    def text(item: Mapping[str, Any], calls: str) -> str:
        # the tool calls first, so the 200-character cut below never hides them
        return " ".join(part for part in ("" if calls == "[]" else "tool_calls=" + calls, _normalise(item.get("answer"))) if part)

    mine = {item["prompt"]: text(item, calls_now[item["prompt"]]) for item in current or []}
    theirs = {item["prompt"]: text(item, calls_then[item["prompt"]]) for item in other or []}
    common = sorted(set(mine) & set(theirs))
    agreed = sum(1 for prompt in common if mine[prompt] == theirs[prompt])
    changed = [{"prompt": p[:120], "before": theirs[p][:200], "after": mine[p][:200]}
               for p in common if mine[p] != theirs[p]]
    tokens_now = {item["prompt"]: item.get("prompt_tokens") for item in current or []}
    tokens_then = {item["prompt"]: item.get("prompt_tokens") for item in other or []}
    rendered = [{"prompt": p[:120], "before": tokens_then[p], "after": tokens_now[p]} for p in common
                if isinstance(tokens_now[p], int) and isinstance(tokens_then[p], int) and tokens_now[p] != tokens_then[p]]
    called = [{"prompt": p[:120], "before": calls_then[p][:200], "after": calls_now[p][:200]} for p in common
              if calls_now[p] != calls_then[p]]
    return {"compared": len(common), "agreed": agreed, "rate": round(agreed / len(common), 4) if common else None,
            "changed": changed[:5], "prompt_tokens_differ": len(rendered), "prompt_tokens_changed": rendered[:5],
            "tool_calls_differ": len(called), "tool_calls_changed": called[:5]}


def check_eval(answers: Any, kv_cache_dtype: str, others: Any, min_agreement: float, answers_file: str) -> Record:
    """Check 8: the admin's evaluation set, compared with the answers stored for other KV-cache dtypes.

    ``answers``: :func:`eval_answers` of this run (None: no eval set, SKIP); ``others``: the documents the
    box keeps for other dtypes, the newest of each (:func:`eval_latest`; ``{"kv_cache_dtype", "at", "pins",
    "answers"}``, ``pins`` absent in older documents); ``answers_file``: where this run's answers are kept
    on the box. PASS when every comparison agrees at least ``min_agreement`` (0..1). Matches with
    ``expected`` answers are reported, not judged.
    """
    if answers is None:
        return skipped(8, 'no evaluation set; set teamserve_verify_eval_file to a JSONL file of {"prompt", "expected"}',
                       "teamserve_verify_eval_file is empty")
    graded = [a for a in answers if a.get("expected") is not None]
    matched = sum(1 for a in graded if _normalise(a.get("answer")) == _normalise(a["expected"]))
    expected = {"with_expected": len(graded), "matched": matched,
                "rate": round(matched / len(graded), 4) if graded else None}
    comparisons = [{"kv_cache_dtype": d.get("kv_cache_dtype"), "at": d.get("at"),
                    "vllm_version": (d.get("pins") or {}).get("vllm_version") or d.get("vllm_version"),
                    **agreement(answers, d.get("answers") or [])}
                   for d in sorted(others or [], key=lambda d: str(d.get("kv_cache_dtype")))]
    low = [c for c in comparisons if c["rate"] is not None and c["rate"] < float(min_agreement)]
    compared = "; ".join(f"agreement with {c['kv_cache_dtype']}"
                         f"{' (vLLM ' + str(c['vllm_version']) + ')' if c['vllm_version'] else ''}: "
                         f"{c['agreed']}/{c['compared']} (target >= {min_agreement})" for c in comparisons) or (
        "no answers for another KV-cache dtype yet (switch vllm_engine.kv_cache_dtype, converge, run verify again)")
    return record(
        8, "FAIL" if low else "PASS",
        f"{len(answers)} prompts answered at kv-cache-dtype {kv_cache_dtype}, {matched}/{len(graded)} match the "
        f"expected answer; {compared}",
        measured={"kv_cache_dtype": kv_cache_dtype, "prompts": len(answers), "answers_file": answers_file,
                  "expected_match": expected, "comparisons": comparisons},
        target={"min_agreement": float(min_agreement)},
    )


class FilterModule:
    """The evaluation set's filters, as ``teamserve.core.verify_<function>``."""

    def filters(self) -> dict[str, Any]:
        functions = (eval_parse, eval_answers, eval_key, eval_latest, agreement, check_eval)
        return {"completion_body": completion_body, **{f"verify_{f.__name__}": f for f in functions}}
