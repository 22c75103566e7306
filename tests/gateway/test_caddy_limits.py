"""The gateway's admission limits are derived from the capacity plan (roles/caddy/filter_plugins/caddy_limits.py
and the role's defaults): switching the model profile switches the caps in the rendered Caddyfile."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from hashlib import sha256

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from repo_modules import example_profile_plans, load  # noqa: E402

limits = load("caddy_limits", "roles/caddy/filter_plugins/caddy_limits.py")



@pytest.mark.parametrize("seqs,expected", [(1, 1), (3, 1), (4, 1), (8, 2), (16, 4), (31, 7), (256, 64)])
def test_user_cap_is_a_quarter_of_the_batch(seqs, expected):
    assert limits.caddy_user_inflight_default(seqs) == expected
    assert 1 <= expected <= seqs


def test_global_cap_is_batch_plus_queue():
    assert limits.caddy_global_inflight(8, 32) == 40
    assert limits.caddy_global_inflight("16", "0") == 16


def test_body_limit_from_max_model_len():
    assert limits.caddy_request_body_max_bytes(32768) == 2 * 1024 * 1024
    assert limits.caddy_request_body_max_bytes(2048) == 2048 * 32 + 1024 * 1024


def test_engine_silence_bound_outlasts_two_full_generations_at_five_tokens_a_second():
    assert limits.caddy_upstream_read_timeout(32768) == 2 * 32768 // 5 + 120 == 13227
    assert limits.caddy_upstream_read_timeout("2048") == 939
    # Longer than any normal silence: waiting behind one full-length generation, then one of its own,
    # non-streamed, at 5 tokens/s.
    assert limits.caddy_upstream_read_timeout(8192) > 2 * 8192 / 5


@pytest.mark.parametrize("call,field", [
    (lambda: limits.caddy_upstream_read_timeout(0), "caddy_engine_max_model_len=0"),
    (lambda: limits.caddy_user_inflight_default(0), "caddy_capacity_seqs=0"),
    (lambda: limits.caddy_user_inflight_default(None), "caddy_capacity_seqs=None"),
    (lambda: limits.caddy_global_inflight(8, -1), "caddy_engine_max_num_queued_reqs=-1"),
    (lambda: limits.caddy_request_body_max_bytes("lots"), "caddy_engine_max_model_len='lots'"),
])
def test_missing_plan_is_named(call, field):
    with pytest.raises(ValueError, match=re.escape(field)) as err:
        call()
    assert "vllm_plan" in str(err.value)


PLAYBOOK = """
- hosts: all
  gather_facts: true
  gather_subset: [min]
  tasks:
    - name: The role's own checks (site.yml's preflight entry point)
      ansible.builtin.include_role:
        name: caddy
        tasks_from: assert.yml
        public: true
    - name: Render the role's Caddyfile template
      ansible.builtin.template:
        src: "{repo}/roles/caddy/templates/Caddyfile.j2"
        dest: "{out}/{{{{ inventory_hostname }}}}.Caddyfile"
        mode: "0600"
    - name: The facts the role publishes (its facts entry point)
      ansible.builtin.include_role:
        name: caddy
        tasks_from: facts
    - name: Write them beside the Caddyfile
      ansible.builtin.copy:
        content: >-
          {{{{ {{'caddy_metrics_url': caddy_metrics_url, 'caddy_admission': caddy_admission | default(none),
               'caddy_engine_max_num_seqs': caddy_engine_max_num_seqs | int,
               'caddy_capacity_seqs': caddy_capacity_seqs | int}} | to_json }}}}
        dest: "{out}/{{{{ inventory_hostname }}}}.facts.json"
        mode: "0600"
"""


def play(tmp_path: pathlib.Path, hosts: dict[str, dict]) -> subprocess.CompletedProcess:
    """Run the caddy role's checks and render its Caddyfile once per host (vars = the host's vars)."""
    inventory = {"all": {"hosts": {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                                          **host} for name, host in hosts.items()}}}
    (tmp_path / "inventory.yml").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(repo=REPO, out=tmp_path))
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_NOCOLOR="1")
    return subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                           str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def render(tmp_path: pathlib.Path, hosts: dict[str, dict]) -> dict[str, str]:
    """play(), which must pass; the rendered Caddyfile of each host."""
    run = play(tmp_path, hosts)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return {name: (tmp_path / f"{name}.Caddyfile").read_text() for name in hosts}


def test_switching_the_profile_switches_the_caps(tmp_path):
    """Two example profiles, planned by the real planner: the gateway's in-flight caps and body limit
    follow each plan's max-num-seqs, max-num-queued-reqs and max-model-len; the inventory types none."""
    users = [{"name": "alice", "key": "a" * 40, "rate_limit": {"events": 60, "window": "1m"}},
             {"name": "bob", "key": "b" * 40, "rate_limit": {"events": 60, "window": "1m"}, "max_inflight": 1},
             {"name": "carol", "key": "c" * 40, "rate_limit": {"events": 5, "window": "1h"}}]
    every = example_profile_plans()
    plans = {stem: every[stem] for stem in ("llama-3.1-8b-bf16", "qwen3-32b-fp8")}
    hosts = {stem: {"vllm_plan": {"flags": p["flags"]}, "caddy_users": users, "caddy_tls_mode": "off"}
             for stem, p in plans.items()}
    seqs = {stem: p["flags"]["max-num-seqs"] for stem, p in plans.items()}
    assert len(set(seqs.values())) == 2, seqs  # the two profiles really differ
    rendered = render(tmp_path, hosts)
    for stem, caddyfile in rendered.items():
        flags = plans[stem]["flags"]
        assert f"unhealthy_request_count {flags['max-num-seqs'] + flags['max-num-queued-reqs']}\n" in caddyfile
        assert f"max_size {flags['max-model-len'] * 32 + 1024 * 1024}\n" in caddyfile
        k = max(1, flags["max-num-seqs"] // 4)
        assert f"{sha256(b'a' * 40).hexdigest()} alice 0 {k} rate_60_per_1m interactive 0 0\n" in caddyfile
        assert f"{sha256(b'b' * 40).hexdigest()} bob 0 1 rate_60_per_1m interactive 0 0\n" in caddyfile  # her own cap
        assert "a" * 40 not in caddyfile and "b" * 40 not in caddyfile  # the keys themselves are not written
        # One zone per distinct limit: alice and bob share one.
        assert sorted(re.findall(r"zone (\S+) \{", caddyfile)) == ["rate_5_per_1h", "rate_60_per_1m"]
        assert "limit {teamserve_max_inflight}" in caddyfile


def test_priority_share_and_lanes_follow_the_plan(tmp_path):
    """The engine's priority scheduling and the gateway's share come from one plan: a plan that sets
    --scheduling-policy priority gets request_priority with the plan's user_fair_share (after the in-flight
    cap, before the engine); a batch-lane key gets half the default cap and its lane in the key map; a plan
    without the flag (recorded before it) and a fallback gateway are handled as documented."""
    plan = example_profile_plans()["llama-3.1-8b-bf16"]
    assert plan["flags"]["scheduling-policy"] == "priority"
    share, cap = plan["admission"]["user_fair_share"], plan["admission"]["user_max_inflight"]
    assert 1 <= share < cap <= plan["flags"]["max-num-seqs"] // 2
    users = [{"name": "alice", "key": "a" * 40, "rate_limit": {"events": 60, "window": "1m"}},
             {"name": "nightly", "key": "n" * 40, "rate_limit": {"events": 60, "window": "1m"}, "lane": "batch"}]
    old = {"flags": {k: v for k, v in plan["flags"].items() if k != "scheduling-policy"},
           "admission": plan["admission"]}
    hosts = {"box": {"vllm_plan": plan, "caddy_users": users, "caddy_tls_mode": "off"},
             "old": {"vllm_plan": old, "caddy_users": users, "caddy_tls_mode": "off"},
             "fallback": {"vllm_plan": plan, "caddy_users": users, "caddy_tls_mode": "off",
                          "caddy_overload_policy": "fallback", "caddy_fallback_url": "https://fallback.example",
                          "caddy_fallback_api_key": "f" * 40}}
    rendered = render(tmp_path, hosts)
    box = rendered["box"]
    # The daily token budget is the plan's too, whoever's lane; no per-minute budget by default (last column).
    budget = plan["admission"]["user_tokens_per_day"]
    assert budget > 0
    assert f"{sha256(b'a' * 40).hexdigest()} alice 0 {cap} rate_60_per_1m interactive {budget} 0\n" in box
    assert f"{sha256(b'n' * 40).hexdigest()} nightly 0 {max(1, cap // 2)} rate_60_per_1m batch {budget} 0\n" in box
    assert "\t\t\ttokens_per_day {teamserve_tokens_per_day}\n\t\t\ttokens_per_minute {teamserve_tokens_per_minute}\n" in box
    assert box.index("token_usage {") < box.index("reverse_proxy @proxied")
    block = f"\t\trequest_priority {{\n\t\t\tshare {share}\n\t\t\tlane {{teamserve_lane}}\n"
    assert block in box
    assert box.index("import user_inflight\n") < box.index(block) < box.index("reverse_proxy @proxied")
    assert "replace_only" not in box
    assert "request_priority" not in rendered["old"]  # an engine without the flag: no priorities
    fallback = rendered["fallback"]
    assert block in fallback and "\t\t\treplace_only\n" in fallback
    assert "header_up -X-Vllm-Priority" in fallback.split("(fallback) {", 1)[1].split("\n}\n", 1)[0]


USERS = [{"name": "alice", "key": "a" * 40, "rate_limit": {"events": 60, "window": "1m"}}]
PLAN = {"flags": {"max-num-seqs": 8, "max-num-queued-reqs": 4, "max-model-len": 2048}}
REFUSALS = {"invalid_api_key", "rate_limit_exceeded", "server_full", "engine_unavailable", "maintenance",
            "request_too_large", "not_found", "request_body_incomplete", "request_timeout",
            "engine_timeout"}  # concurrency_limit_exceeded: the inflight_limit module's own


def test_metrics_site_on_loopback_only_and_off_at_zero(tmp_path):
    """caddy_metrics_port: a second site bound to 127.0.0.1 that serves only /metrics (404 otherwise), and
    the global option that collects them; 0 leaves both out."""
    hosts = {"default": {"vllm_plan": PLAN, "caddy_users": USERS},
             "off": {"vllm_plan": PLAN, "caddy_users": USERS, "caddy_metrics_port": 0}}
    rendered = render(tmp_path, hosts)
    site = rendered["default"].split("\nhttp://127.0.0.1:2020 {\n", 1)[1]
    assert site == "\tbind 127.0.0.1\n\thandle /metrics {\n\t\tmetrics\n\t}\n\thandle {\n\t\trespond 404\n\t}\n}\n"
    options = rendered["default"].split("\n}\n", 1)[0]  # the global options block
    assert "\n\tmetrics\n" in options
    # Named servers: the metrics' `server` label does not depend on which sites there are.
    assert "\tservers :8443 {\n\t\tname gateway\n" in options and "\tservers :8443 {\n\t\tname gateway\n" in rendered["off"]
    assert "\tservers 127.0.0.1:2020 {\n\t\tname metrics\n\t}\n" in options
    assert rendered["default"].count("bind ") == 1  # the gateway's own site still listens on every address
    assert "2020" not in rendered["off"] and not re.search(r"^\s*metrics$", rendered["off"], re.M)
    # The scrape URL other roles read, empty when off.
    facts = {name: json.loads((tmp_path / f"{name}.facts.json").read_text()) for name in hosts}
    assert {name: f["caddy_metrics_url"] for name, f in facts.items()} == {
        "default": "http://127.0.0.1:2020/metrics", "off": ""}


def test_every_error_answer_labels_its_refusal_in_the_access_log(tmp_path):
    """Each OpenAI-style error the gateway writes goes through one snippet that also sets the access log's
    `refused` field to the error's code; every code it answers with is one of the known kinds."""
    caddyfile = render(tmp_path, {"box": {"vllm_plan": PLAN, "caddy_users": USERS}})["box"]
    snippet = caddyfile.split("(openai_error) {\n", 1)[1].split("\n}\n", 1)[0]
    assert snippet.startswith("\tlog_append refused {args[3]}\n")
    codes = set(re.findall(r"^\s*import openai_error \d{3} .* (\S+)$", caddyfile, re.M))
    assert codes == REFUSALS
    assert "\t\t\t\tlog_append refused maintenance\n" in caddyfile  # the public /health answer while draining


def test_draining_and_maintenance_are_flag_files_read_per_request(tmp_path):
    """The Caddyfile is the same in every state: /health and the API look for the state flag files that
    the `state` entry point writes, and take Retry-After from them (no re-render, no reload)."""
    caddyfile = render(tmp_path, {"box": {"vllm_plan": PLAN, "caddy_users": USERS,
                                          "caddy_state_dir": "/run/gw-state"}})["box"]
    assert "\t\t\t\troot /run/gw-state\n\t\t\t\ttry_files /draining\n" in caddyfile
    assert "\t\t\t\troot /run/gw-state\n\t\t\t\ttry_files /maintenance\n" in caddyfile
    assert "header Retry-After {file./run/gw-state/draining}" in caddyfile
    assert "header Retry-After {file./run/gw-state/maintenance}" in caddyfile
    # The maintenance answer comes before any limit, so a drained box never counts a refused request.
    assert caddyfile.index("handle @maintenance {") < caddyfile.index("import user_inflight\n")


@pytest.mark.parametrize("port,problem", [(8443, "other than"), (80, "1024-65535"), ("metrics", "1024-65535")])
def test_an_unusable_metrics_port_is_refused(tmp_path, port, problem):
    run = play(tmp_path, {"box": {"vllm_plan": PLAN, "caddy_users": USERS, "caddy_metrics_port": port}})
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0
    assert f"caddy_metrics_port={port} must be 0 (no metrics) or a port in 1024-65535 other than " \
           "caddy_listen_port=8443" in output, output[-2000:]
    assert not (tmp_path / "box.Caddyfile").exists()



def test_admission_counts_engine_sequences(tmp_path):
    """Each request is charged the engine sequences it asks for (request_cost reads n and the prompts from
    its body, bounded by the body limit) before the per-user cap counts them, on the engine and the
    fallback paths alike."""
    caddyfile = render(tmp_path, {"box": {"vllm_plan": PLAN, "caddy_users": USERS}})["box"]
    snippet = caddyfile.split("(user_inflight) {\n", 1)[1].split("\n}\n", 1)[0]
    assert "\t\tlimit {teamserve_max_inflight}\n\t\tcost {teamserve_cost}\n" in snippet
    route = caddyfile.split("\troute {\n", 1)[1]
    cost = route.index("\t\trequest_cost {teamserve_cost} {\n\t\t\tmax_size ")
    assert cost < route.index("\t\timport user_inflight\n") < route.index("reverse_proxy @proxied")
    assert caddyfile.count("request_cost {teamserve_cost}") == 1


def test_me_answers_the_callers_own_limits_after_the_key_checks(tmp_path):
    """/v1/me is answered by the gateway itself once the key is known and not expired (401 before it), ahead
    of maintenance, every limit and the engine; its rate limit comes from the caller's own zone, one map
    line per zone; proxied answers carry the caller's in-flight sequences and cap."""
    users = USERS + [{"name": "bob", "key": "b" * 40, "rate_limit": {"events": 5, "window": "1h"}}]
    caddyfile = render(tmp_path, {"box": {"vllm_plan": PLAN, "caddy_users": users}})["box"]
    route = caddyfile.split("\troute {\n", 1)[1]
    me = route.index("\t\t@me path /v1/me\n")
    assert "not path " in route and route.index(" /v1/me\n\t\terror @not_proxied") < route.index("error @anonymous")
    assert route.index("error @expired") < me < route.index("handle @maintenance") < route.index("rate_limit {")
    block = route[me:route.index("\n\t\t}\n", me)]
    assert "\t\t\t\trate_5_per_1h 5 1h\n\t\t\t\trate_60_per_1m 60 1m\n\t\t\t\tdefault 0 \"\"\n" in block
    assert "respond `{\"object\":\"teamserve.me\",\"user\":\"{teamserve_user}\"" in block and "reverse_proxy" not in block
    limit = route.index("\t\timport user_inflight\n")
    assert limit < route.index("header X-Teamserve-In-Flight {inflight_limit.in_flight}") < route.index("reverse_proxy @proxied")
