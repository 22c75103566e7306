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
    (lambda: limits.caddy_user_inflight_default(0), "caddy_engine_max_num_seqs=0"),
    (lambda: limits.caddy_user_inflight_default(None), "caddy_engine_max_num_seqs=None"),
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
"""


def render(tmp_path: pathlib.Path, hosts: dict[str, dict]) -> dict[str, str]:
    """Run the caddy role's checks and render its Caddyfile once per host (vars = the host's vars)."""
    inventory = {"all": {"hosts": {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                                          **host} for name, host in hosts.items()}}}
    (tmp_path / "inventory.yml").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(repo=REPO, out=tmp_path))
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_NOCOLOR="1")
    run = subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                          str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml")],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
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
        assert f"{sha256(b'a' * 40).hexdigest()} alice 0 {k} rate_60_per_1m\n" in caddyfile
        assert f"{sha256(b'b' * 40).hexdigest()} bob 0 1 rate_60_per_1m\n" in caddyfile  # her own cap
        assert "a" * 40 not in caddyfile and "b" * 40 not in caddyfile  # the keys themselves are not written
        # One zone per distinct limit: alice and bob share one.
        assert sorted(re.findall(r"zone (\S+) \{", caddyfile)) == ["rate_5_per_1h", "rate_60_per_1m"]
        assert "limit {teamserve_max_inflight}" in caddyfile
