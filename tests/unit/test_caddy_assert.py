"""roles/caddy/tasks/assert.yml (the `assert` entry point, site.yml's preflight) refuses a gateway without an
in-flight cap and one without users, with a message naming the variable, the value and the fix; the cases
that legitimately have no team users of their own (a box behind a front, an explicit opt-in) pass, and so do
the derived caps of a box and of a front.

One ansible-playbook run on localhost: each case is an inventory host of its own, with its variables; a
block/rescue records the outcome per case.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from repo_modules import run_cases

USERS = [{"name": "alice", "key": "a" * 40, "rate_limit": {"events": 60, "window": "1m"}}]
# A box's engine, as the capacity plan gives it: batch 8, queue 16.
BOX = {"caddy_engine_max_num_seqs": 8, "caddy_engine_max_num_queued_reqs": 16, "caddy_engine_max_model_len": 2048,
       "caddy_upstream_api_key": "e" * 40, "caddy_users": USERS}
FRONT = {"caddy_users": USERS, "caddy_upstream_api_key": "f" * 48,
         "caddy_upstreams": [{"name": "gpu1", "url": "https://10.0.0.1:8443", "max_inflight": 8, "models": ["m"],
                              "max_model_len": 2048, "ca_cert": "/tmp/gpu1-root.crt"}]}

CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "box_with_the_derived_cap": (BOX, None),
    "front_with_the_derived_cap": (FRONT, None),
    "no_cap": (BOX | {"caddy_max_inflight": 0},
               r"caddy_max_inflight=0 must be a whole number of requests >= 1: above it the gateway answers 503 "
               r"server_full with Retry-After; with no cap every request would reach the engine\. Remove the "
               r"override to get the default, what the engine holds: caddy_capacity_seqs \+ "
               r"caddy_engine_max_num_queued_reqs = 24\."),
    "negative_cap": (BOX | {"caddy_max_inflight": -5}, r"caddy_max_inflight=-5 must be a whole number of requests >= 1"),
    "a_cap_of_one": (BOX | {"caddy_max_inflight": 1}, None),
    "no_users": (BOX | {"caddy_users": []},
                 r"caddy_users is empty, so the gateway would answer every request 401\. List the team, e\.g\. "
                 r"caddy_users: \[\{name: alice, rate_limit: \{events: 60, window: 1m\}\}\], then issue keys with "
                 r"playbooks/users\.yml; or set caddy_allow_no_users: true to run a gateway nobody can use yet\."),
    "front_without_users": (FRONT | {"caddy_users": []}, r"caddy_users is empty"),
    "no_users_allowed": (BOX | {"caddy_users": [], "caddy_allow_no_users": True}, None),
    # Behind a front the team's users live at the front; the box's one user is the front itself.
    "no_users_behind_a_front": (BOX | {"caddy_users": [], "caddy_front_user_key": "k" * 48}, None),
}

PLAYBOOK = """
- hosts: all
  gather_facts: true
  gather_subset: [min]
  strategy: free
  tasks:
    - block:
        - ansible.builtin.include_role:
            name: caddy
            tasks_from: assert
        - ansible.builtin.set_fact:
            outcome: passed
      rescue:
        - ansible.builtin.set_fact:
            outcome: "{{ ansible_failed_result.msg }}"
    - ansible.builtin.copy:
        content: "{{ outcome }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.txt"
        mode: "0600"
      delegate_to: localhost
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str]:
    return run_cases(tmp_path_factory.mktemp("caddy-assert"), {name: v for name, (v, _) in CASES.items()}, PLAYBOOK)


@pytest.mark.parametrize("case", list(CASES))
def test_caddy_assert_outcome(outcomes, case):
    expected = CASES[case][1]
    if expected is None:
        assert outcomes[case] == "passed", outcomes[case]
    else:
        assert outcomes[case] != "passed", f"{case} was accepted"
        assert re.search(expected, " ".join(outcomes[case].split())), outcomes[case]
