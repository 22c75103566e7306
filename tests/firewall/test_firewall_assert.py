"""The firewall role's `assert` entry point (site.yml's preflight) refuses networks wider than any LAN,
judged by the addresses they cover together, unless the matching opt-in says so, and interface names
nft would refuse (after the packages were installed) or that would open the LAN, an engine port that
is also the gateway's or SSH's, and an engine client that is neither an account name nor a uid.

One ansible-playbook run on localhost, one inventory host per case; a block/rescue records each outcome.
Only the input checks are reached: they come first, and the cases that pass them stop at the next check
(the play is not on a box with nftables), which is recorded as passing this one.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from repo_modules import run_cases  # noqa: E402

LAN = ["10.231.0.0/24"]
CASES: dict[str, tuple[dict, str | None]] = {
    "lan_as_two_halves": ({"firewall_lan_cidrs": ["0.0.0.0/1", "128.0.0.0/1"]},
                          r"firewall_lan_cidrs: 0\.0\.0\.0/1 \+ 128\.0\.0\.0/1 \(4,294,967,296 IPv4 addresses.*"
                          r"firewall_allow_any_lan: true"),
    "admin_everyone": ({"firewall_lan_cidrs": LAN, "firewall_admin_cidrs": ["0.0.0.0/0"]},
                       r"firewall_admin_cidrs: 0\.0\.0\.0/0 .* opens SSH to the internet.*firewall_allow_any_admin: true"),
    "admin_ipv6_halves": ({"firewall_lan_cidrs": LAN, "firewall_admin_cidrs": ["::/1", "8000::/1"]},
                          r"firewall_admin_cidrs: ::/1 \+ 8000::/1"),
    "admin_everyone_allowed": ({"firewall_lan_cidrs": LAN, "firewall_admin_cidrs": ["0.0.0.0/0"],
                                "firewall_allow_any_admin": True}, None),
    "private_networks": ({"firewall_lan_cidrs": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]}, None),
    "every_interface_a_container_bridge": ({"firewall_lan_cidrs": LAN, "firewall_container_interfaces": ["docker0", "*"]},
                                           r"firewall_container_interfaces: \['\*'\] are not interface names"),
    "interface_name_too_long": ({"firewall_lan_cidrs": LAN, "firewall_container_interfaces": ["a" * 16]},
                                r"firewall_container_interfaces: \['a{16}'\]"),
    "engine_port_is_the_gateway_port": ({"firewall_lan_cidrs": LAN, "firewall_engine_ports": [8443]},
                                        r"firewall_engine_ports=\[8443\].*none may be a gateway or SSH port.*8443 is both"),
    "engine_client_not_an_account_name": ({"firewall_lan_cidrs": LAN, "firewall_engine_ports": [8000],
                                           "firewall_engine_clients": ["caddy", "nobody; drop"]},
                                          r"clients must be account names or numeric uids, not nobody; drop"),
    "engine_port_and_clients": ({"firewall_lan_cidrs": LAN, "firewall_engine_ports": [8000],
                                 "firewall_engine_clients": ["caddy", "998"]}, None),
    # Behind a front gateway: only the front (and an explicit opt-in) reaches the box's gateway.
    "behind_front_defaults_to_the_front": ({"firewall_lan_cidrs": LAN, "firewall_gateway_front_addresses": ["10.231.0.30"]},
                                           None),
    "behind_front_lan_wide_refused": ({"firewall_lan_cidrs": LAN, "firewall_gateway_front_addresses": ["10.231.0.30"],
                                       "firewall_gateway_cidrs": LAN},
                                      r"firewall_gateway_cidrs reaches 10\.231\.0\.0/24 beyond the front gateways this "
                                      r"box is behind \(10\.231\.0\.30\).*firewall_gateway_around_front_cidrs"),
    "behind_front_opt_in": ({"firewall_lan_cidrs": LAN, "firewall_gateway_front_addresses": ["10.231.0.30"],
                             "firewall_gateway_around_front_cidrs": ["10.231.0.1/32"],
                             "firewall_gateway_cidrs": ["10.231.0.30/32", "10.231.0.1"]}, None),
    "behind_front_address_unknown": ({"firewall_lan_cidrs": LAN,
                                      "firewall_gateway_front_addresses": ["(no address known for front)"]},
                                     r"'\(no address known for front\)' is not an IPv4 or IPv6 network.*"
                                     r"set teamserve_front_address"),
}
ENGINE_TASK = "Check the engine ports and the accounts that may use them"
FRONT_TASK = "Check that only the front gateways reach a box behind them"
FAILING_TASK = {"every_interface_a_container_bridge": "Check the container interface names",
                "interface_name_too_long": "Check the container interface names",
                "engine_port_is_the_gateway_port": ENGINE_TASK,
                "engine_client_not_an_account_name": ENGINE_TASK,
                "behind_front_lan_wide_refused": FRONT_TASK, "behind_front_address_unknown": FRONT_TASK}

PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - block:
        - ansible.builtin.include_role:
            name: firewall
            tasks_from: assert
        - ansible.builtin.set_fact:
            outcome: passed
      rescue:
        - ansible.builtin.set_fact:
            outcome: "{{ ansible_failed_task.name }}: {{ ansible_failed_result.msg | default('') }}"
    - ansible.builtin.copy:
        content: "{{ outcome }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.txt"
        mode: "0600"
"""
CIDR_TASK = "Refuse a LAN or admin network wider than any LAN unless explicitly allowed"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str]:
    hosts = {name: overrides for name, (overrides, _) in CASES.items()}
    return run_cases(tmp_path_factory.mktemp("firewall-assert"), hosts, PLAYBOOK, forks=5)


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_anything_changes(outcomes, case):
    expected, outcome = CASES[case][1], " ".join(outcomes[case].split())
    if expected is None:
        assert not outcome.startswith((CIDR_TASK, "Check the LAN", ENGINE_TASK, FRONT_TASK)), outcome
    else:
        assert outcome.startswith(FAILING_TASK.get(case, CIDR_TASK)) and re.search(expected, outcome), outcome
