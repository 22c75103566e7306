"""The gateway in front of the REAL vLLM CPU engine, for what the caddy scenario's test double cannot
stand in for: 401/429 bodies parse as OpenAI errors with the official SDK, a client that
disconnects stops its generation in the engine, the access log names users and holds no key, and
streams in flight survive a dockerd restart. (A key issued and revoked with playbooks/users.yml, the
engine untouched: test_admission.py's dana.)

Traffic goes only to the testbed box (the gateway on 10.231.0.10:8443; the engine's loopback port is
read from inside the box). Every request loop is bounded.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai
import pytest
import testinfra
from conftest import GROUP_VARS, engine_cmd, engine_identity, engine_metrics, vault_view

testinfra_hosts = ["ansible://teamserve-box"]
# The same box through `docker exec`: a read of the engine's counters in a fraction of the ansible
# backend's second or more, which the streams would spend generating.
BOX = testinfra.get_host("docker://teamserve-box")

BOX_LAN = "10.231.0.10"
# Long enough that nothing finishes while a test holds it (the model's context is 2,048 tokens).
LONG = 1500


def access_log(host) -> list[dict[str, Any]]:
    """The box gateway's access-log entries, oldest first."""
    return [json.loads(line) for line in host.file("/var/log/caddy/access.log").content_string.splitlines()
            if line.strip()]


def access_log_after(host, started: float, match) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The access log, and its entries written at or after ``started`` (Unix seconds, the clock the box
    shares) that ``match``, read again every 0.5 s until one matches or 10 s have passed: the gateway writes
    a request's entry when its handler returns, which can be just after its client read the last event or
    hung up."""
    deadline = time.monotonic() + 10
    while True:
        entries = access_log(host)
        found = [e for e in entries if e["ts"] >= started and match(e)]
        if found or time.monotonic() > deadline:
            return entries, found
        time.sleep(0.5)


def stream_tokens(cmd: list[str]) -> int:
    """Tokens a stream that asks for LONG gets from the engine run with ``cmd``: its output ceiling clamps it."""
    return min(LONG, json.loads(cmd[cmd.index("--override-generation-config") + 1])["max_new_tokens"])


def base_url(testbed_vars: dict) -> str:
    return f"{'http' if testbed_vars['caddy_tls_mode'] == 'off' else 'https'}://{BOX_LAN}:{testbed_vars['caddy_listen_port']}/v1"


def sdk(testbed_vars: dict, key: str, verify) -> openai.OpenAI:
    """The official SDK for one user; no retries, so 429/503 reach the test as typed errors."""
    return openai.OpenAI(base_url=base_url(testbed_vars), api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=verify))


@contextlib.contextmanager
def engine_paused_while(threads: list[threading.Thread], opened: threading.Semaphore, what: str) -> Iterator[None]:
    """Pause vLLM's engine-core process (SIGSTOP), start the client threads and wait until each has opened
    its stream (released ``opened``), so none can finish before the block acts; SIGCONT when it ends."""
    # The anchor keeps pkill off the shell that runs it, whose argv holds the pattern too.
    BOX.check_output("pkill -STOP -f '^VLLM::EngineCore'")
    try:
        for thread in threads:
            thread.start()
        for _ in threads:
            assert opened.acquire(timeout=120), f"a {what} did not open"
        yield
    finally:
        BOX.check_output("pkill -CONT -f '^VLLM::EngineCore'")


def test_unknown_key_is_an_openai_authentication_error(testbed_vars, gateway_verify):
    with pytest.raises(openai.AuthenticationError) as err:
        sdk(testbed_vars, "sk-ts-" + "x" * 48, gateway_verify).models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert err.value.body["type"] == "invalid_request_error"


def test_user_over_the_limit_gets_an_openai_rate_limit_error(testbed_vars, keys, gateway_verify):
    carol = sdk(testbed_vars, keys["carol"], gateway_verify)
    limit = next(u for u in testbed_vars["caddy_users"] if u["name"] == "carol")["rate_limit"]["events"]
    with pytest.raises(openai.RateLimitError) as err:
        for _ in range(limit + 1):  # bounded: the limit, then one more
            carol.models.list()
    assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert sdk(testbed_vars, keys["bob"], gateway_verify).models.list().data[0].id == "tiny"


def test_disconnects_stop_the_engine(host, testbed_vars, keys, gateway_verify):
    """alice and bob each hold their in-flight cap of long streams (derived from the engine's max-num-seqs;
    the gateway-wide cap, max-num-seqs + max-num-queued-reqs, is out of reach of two users, so its 503 is
    tested in molecule/caddy), then hang up. vLLM's engine-core process is paused (SIGSTOP) while they
    connect and hang up, so no stream can finish first: the tiny model writes 1,500 tokens in about 2 s,
    and on a loaded machine a hang-up took longer than that to reach the engine. Once it runs again, the
    engine must generate (almost) nothing for them; kept open instead, the same streams generate every token
    (measured: 0 of 6,000 against 6,000 of 6,000)."""
    cmd = engine_cmd(host)
    default = max(1, int(cmd[cmd.index("--max-num-seqs") + 1]) // 4)  # roles/caddy caddy_user_max_inflight
    per_stream = stream_tokens(cmd)
    caps = {u["name"]: u.get("max_inflight", default) for u in testbed_vars["caddy_users"]}
    cap = 2 * min(caps["alice"], caps["bob"])
    url = base_url(testbed_vars) + "/chat/completions"
    opened = threading.Semaphore(0)
    hang_up = threading.Event()
    errors: list[str] = []

    def hold(key: str) -> None:
        body = {"model": "tiny", "stream": True, "max_tokens": LONG, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count."}]}
        try:
            with httpx.Client(verify=gateway_verify, timeout=60) as client, \
                    client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
                if response.status_code != 200:
                    errors.append(f"holder got {response.status_code}")
                opened.release()
                hang_up.wait(60)  # leaving the with-blocks closes the connection mid-stream
        except httpx.HTTPError as err:
            errors.append(f"holder: {err!r}")
            opened.release()

    before = engine_metrics(BOX)
    holders = [threading.Thread(target=hold, args=(keys["alice" if i % 2 else "bob"],), daemon=True)
               for i in range(cap)]
    try:
        with engine_paused_while(holders, opened, "holding stream"):
            assert not errors, errors
            hang_up.set()
            for thread in holders:
                thread.join(timeout=60)
            time.sleep(1)  # for the API server to see the hang-ups before the engine runs again
    finally:
        hang_up.set()
    deadline = time.monotonic() + 60
    while True:
        now = engine_metrics(BOX)
        busy = now.get("vllm:num_requests_running", 0) + now.get("vllm:num_requests_waiting", 0)
        if busy == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert busy == 0, f"{busy} requests still in the engine 60 s after every client hung up"
    after = now["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert after < cap * per_stream / 2, \
        f"{after:.0f} of {cap * per_stream} tokens were generated for {cap} streams whose clients hung up: hang-ups did not stop them"


def test_access_log_names_users_and_holds_no_key(host, testbed_vars, keys, vault, gateway_verify):
    client = sdk(testbed_vars, keys["bob"], gateway_verify)
    client.models.list()
    # A streamed answer read to its end through the official SDK, which hangs up right after [DONE]: such
    # entries were once logged with duration 0 and no user.
    started = time.time()
    stream = client.chat.completions.create(model="tiny", stream=True, max_tokens=32,
                                            messages=[{"role": "user", "content": "Count."}])
    assert sum(1 for _ in stream) > 1
    # An earlier test's stream that its client cut short is bob's last entry until this one is written.
    entries, streamed = access_log_after(host, started, lambda e: e.get("user") == "bob" and e["status"] == 200
                                         and e["request"]["uri"] == "/v1/chat/completions")
    bob = [e for e in entries if e.get("user") == "bob"]
    assert bob and {"status", "size", "duration"} <= bob[-1].keys()
    assert streamed and streamed[-1]["duration"] > 0 and streamed[-1]["size"] > 0, streamed[-1:]
    # Every entry names its user but the refusals of a key the gateway does not know, and the public /health
    # (no key by design; logged only while the box drains, when it answers 503).
    anonymous = [e for e in entries if "user" not in e and e["request"]["uri"] != "/health"]
    assert all(e["status"] in (401, 404) for e in anonymous), [(e["request"]["uri"], e["status"]) for e in anonymous]
    assert all("headers" not in e["request"] for e in entries)
    text = host.file("/var/log/caddy/access.log").content_string + host.check_output(
        "journalctl -u caddy --no-pager -o cat")
    for secret in list(keys.values()) + [vault["vault_vllm_api_key"]]:
        assert secret not in text
    # users.yml given a key file of its own (dana's, test_admission.py) wrote only there, not to the inventory's.
    assert vault_view(GROUP_VARS / "caddy_keys.vault.yml")["caddy_user_keys"] == keys


def mtail_tokens(host, user: str) -> dict[str, float]:
    """The per-user token counters mtail exports on the box's loopback: kind (prompt, completion) -> tokens."""
    out: dict[str, float] = {}
    for line in host.check_output("curl -sf http://127.0.0.1:3903/metrics").splitlines():
        match = re.match(r'teamserve_gateway_tokens_total\{(.*)\} (\S+)$', line)
        kind = re.search(r'kind="(\w+)"', match.group(1)) if match else None
        if match and kind and f'user="{user}"' in match.group(1):
            out[kind.group(1)] = out.get(kind.group(1), 0.0) + float(match.group(2))
    return out


def test_tokens_counted_per_user_equal_the_engines_usage(host, testbed_vars, keys, gateway_verify):
    """Chat, completions and two streams through the gateway: each access-log entry carries the engine's
    prompt and completion tokens, their sums equal what the engine's own counters rose by, and mtail's
    per-user counters rise by as much. A stream whose client did not ask for usage is asked for it by the
    gateway, and the client never sees the usage chunk; one that asked gets it. A stream cut short by its
    client counts the tokens sent until then."""
    client = sdk(testbed_vars, keys["alice"], gateway_verify)
    engine_before, counted_before = engine_metrics(host), mtail_tokens(host, "alice")
    seen = []  # the usage the client was shown, where it asked for it
    chat = client.chat.completions.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    seen.append((chat.usage.prompt_tokens, chat.usage.completion_tokens))
    text = client.completions.create(model="tiny", max_tokens=5, prompt="One two three")
    seen.append((text.usage.prompt_tokens, text.usage.completion_tokens))
    chunks = list(client.chat.completions.create(model="tiny", stream=True, max_tokens=7,
                                                 messages=[{"role": "user", "content": "Count."}]))
    assert chunks and all(c.choices and c.usage is None for c in chunks), "a usage chunk the client did not ask for"
    asked = list(client.chat.completions.create(model="tiny", stream=True, max_tokens=4,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Go."}]))
    assert asked[-1].choices == [] and asked[-1].usage is not None
    seen.append((asked[-1].usage.prompt_tokens, asked[-1].usage.completion_tokens))
    entries = access_log(host)
    logged = [(e.get("prompt_tokens"), e.get("completion_tokens")) for e in entries
              if e.get("user") == "alice" and e["status"] == 200][-4:]
    assert None not in {t for pair in logged for t in pair}, logged
    assert [logged[0], logged[1], logged[3]] == seen, (logged, seen)
    want = {"prompt": sum(p for p, _ in logged), "completion": sum(c for _, c in logged)}

    def engine_rise() -> dict[str, float]:
        # Each finished request's prompt and generated tokens, as the engine records them per request.
        after = engine_metrics(host)
        return {kind: after[name] - engine_before[name] for kind, name in
                (("prompt", "vllm:request_prompt_tokens_sum"), ("completion", "vllm:request_generation_tokens_sum"))}

    def counted_rise() -> dict[str, float]:
        counted = mtail_tokens(host, "alice")
        return {k: counted.get(k, 0.0) - counted_before.get(k, 0.0) for k in want}

    deadline = time.monotonic() + 30  # the engine publishes its stats, and mtail reads the log, as they come
    while (engine_rise() != want or counted_rise() != want) and time.monotonic() < deadline:
        time.sleep(1)
    assert engine_rise() == want, (engine_rise(), logged)
    assert counted_rise() == want, (counted_rise(), logged)

    # A stream its client cuts short never gets to its usage chunk: it is counted from the running usage
    # (continuous_usage_stats) the gateway asks the engine for and takes out of every chunk.
    whole = stream_tokens(engine_cmd(host))
    started = time.time()
    cut = client.chat.completions.create(model="tiny", stream=True, max_tokens=LONG, extra_body={"ignore_eos": True},
                                         messages=[{"role": "user", "content": "Count."}])
    read = list(itertools.islice(cut, 4))
    cut.close()
    assert len(read) == 4 and all(c.usage is None for c in read), read
    _, mine = access_log_after(host, started, lambda e: e.get("user") == "alice" and e["status"] == 200)
    assert mine, "no access-log entry for the cut stream"
    # the same prompt as the stream above; the role chunk and 3 content chunks were sent, the whole answer was not
    assert mine[-1].get("prompt_tokens") == logged[2][0] and 3 <= mine[-1].get("completion_tokens", 0) < whole, \
        (mine[-1], whole)


def logged_tokens(host, request_id: str) -> tuple[Any, Any]:
    """The prompt and completion tokens in the access-log entry of the request sent with X-Request-Id."""
    _, mine = access_log_after(host, 0, lambda e: e.get("request_id") == request_id)
    assert mine, f"no access-log entry for {request_id}"
    return mine[-1].get("prompt_tokens"), mine[-1].get("completion_tokens")


def test_bodies_no_sdk_sends_are_counted_and_steering_fields_refused(host, testbed_vars, keys, gateway_verify):
    """Bodies an SDK would not send: "stream": 1 and "stream": "true" stream (vLLM reads them as true) and
    are counted like "stream": true, the usage never shown to a client that did not ask; an answer past the
    4 MiB a gateway might hold (n 2 with top-20 logprobs) counts whole; the members that steer the engine are
    refused naming the member, and /v1/responses' background mode, whose usage would be null, too."""
    url = base_url(testbed_vars)
    auth = {"Authorization": f"Bearer {keys['bob']}"}
    tag = f"shape-{time.time_ns()}"
    with httpx.Client(verify=gateway_verify, timeout=120) as client:
        for n, stream in enumerate((1, "true")):
            body = {"model": "tiny", "stream": stream, "max_tokens": 5, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count."}]}
            answer = client.post(url + "/chat/completions", json=body, headers={**auth, "X-Request-Id": f"{tag}-{n}"})
            events = [line for line in answer.text.splitlines() if line.startswith("data: {")]
            assert answer.status_code == 200 and len(events) >= 5, answer.text[-500:]
            assert all('"usage"' not in e for e in events), events
            prompt, completion = logged_tokens(host, f"{tag}-{n}")
            assert isinstance(prompt, int) and prompt > 0 and completion == 5, (stream, prompt, completion)

        body = {"model": "tiny", "n": 2, "logprobs": True, "top_logprobs": 20, "max_tokens": LONG, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count."}]}
        # alice: her cap holds the two sequences whatever the plan gives bob
        answer = client.post(url + "/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {keys['alice']}", "X-Request-Id": f"{tag}-big"})
        assert answer.status_code == 200, answer.text[-500:]
        usage = answer.json()["usage"]
        assert len(answer.content) > 4 << 20, f"{len(answer.content)} bytes: not past the 4 MiB a gateway might hold"
        assert logged_tokens(host, f"{tag}-big") == (usage["prompt_tokens"], usage["completion_tokens"]), usage

        for path, member in (("/chat/completions", {"kv_transfer_params": {"do_remote_prefill": True}}),
                             ("/completions", {"vllm_xargs": {"a": 1}}), ("/chat/completions", {"request_id": "x"}),
                             ("/responses", {"background": True, "store": False})):
            answer = client.post(url + path, headers=auth, json={"model": "tiny", "input": "Hi", "prompt": "Hi",
                                                                 "messages": [], **member})
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["code"] == "unsupported_field", answer.text
            assert error["param"] == next(iter(member)), answer.text


def test_prefix_cache_is_per_person(testbed_vars, keys, gateway_verify):
    """The same document from bob after alice hits nothing in the prefix cache (cached_tokens 0: he cannot
    tell that she sent it), and hits for alice when she sends it again (her own cache works)."""
    words = ("budget", "meeting", "quarter", "design", "review", "client", "release", "server", "team", "plan")
    seed = time.time_ns()
    memo = " ".join(f"{words[(seed >> (i % 40)) % 10]}{i}" for i in range(300))  # unique to this run

    def cached(key: str) -> tuple[int, int]:
        with httpx.Client(verify=gateway_verify, timeout=120) as client:
            answer = client.post(base_url(testbed_vars) + "/responses", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "tiny", "input": f"Summarise this memo: {memo}", "max_output_tokens": 1})
        assert answer.status_code == 200, answer.text[-500:]
        usage = answer.json()["usage"]
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]

    prompt, _ = cached(keys["alice"])
    assert prompt >= 300, prompt  # several blocks, whatever the engine's block size
    assert cached(keys["bob"]) == (prompt, 0)
    again, hits = cached(keys["alice"])
    assert again == prompt and hits > 0, (again, hits)


def test_dockerd_restart_keeps_streams_in_flight(host, testbed_vars, keys, gateway_verify):
    """Four streams are in flight through the gateway while dockerd restarts (live-restore on). Each must
    end as a whole answer ([DONE] after every token) or with an error event; none may just stop. The
    engine's core process is paused (SIGSTOP) from before the streams open until dockerd is back, so no
    stream can finish before the restart. The engine container itself is the same one afterwards.

    Measured before dockerd's userland proxy was turned off: every stream cut at the restart (docker-proxy
    exits with dockerd and takes its connections with it): 4 of 4 ended "incomplete chunked read", with
    neither [DONE] nor an error event."""
    url = base_url(testbed_vars) + "/chat/completions"
    tokens = 64
    opened = threading.Semaphore(0)
    endings: list[dict] = []
    lock = threading.Lock()

    def stream(key: str) -> None:
        body = {"model": "tiny", "stream": True, "max_tokens": tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count."}]}
        ending: dict[str, Any] = {"status": None, "chunks": 0, "finish": None, "done": False, "error": None, "cut": None}
        try:
            with httpx.Client(verify=gateway_verify, timeout=120) as client, \
                    client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
                ending["status"] = response.status_code
                opened.release()
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        ending["done"] = True
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        ending["error"] = event["error"]
                    elif event.get("choices"):
                        ending["chunks"] += 1
                        ending["finish"] = event["choices"][0].get("finish_reason") or ending["finish"]
        except httpx.HTTPError as err:
            ending["cut"] = repr(err)
        finally:
            opened.release()
            with lock:
                endings.append(ending)

    engine_before = engine_identity(host)
    streams = [threading.Thread(target=stream, args=(keys["alice"],), daemon=True) for _ in range(4)]
    try:
        with engine_paused_while(streams, opened, "stream"):
            started = time.monotonic()
            host.run_expect([0], "systemctl restart docker")
            restart_s = time.monotonic() - started
            assert host.service("docker").is_running
    finally:
        for thread in streams:
            thread.join(timeout=120)
    print(f"dockerd restart took {restart_s:.1f} s; endings: {endings}")
    assert len(endings) == 4 and all(e["status"] == 200 for e in endings), endings
    silent = [e for e in endings if not e["error"] and not (e["done"] and e["finish"] == "length")]
    assert not silent, f"{len(silent)} of 4 streams stopped without [DONE] or an error event: {silent}"
    assert engine_identity(host) == engine_before
    # A new request is served once dockerd is back (its port mapping restored).
    assert sdk(testbed_vars, keys["bob"], gateway_verify).models.list().data[0].id == "tiny"
