"""playbooks/users.yml's filters (playbooks/filter_plugins/teamserve_users.py): the one key generator (sk-ts- and 48
characters of [A-Za-z0-9], for users.yml and the testbed alike), and the list, which prints each user's
in-flight cap as a number from the plan the box records (the lane's share for a batch key), never a key; and
users.yml's list itself against a box whose plan record is a local file."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from repo_modules import REPO, load

users = load("teamserve_users", "playbooks/filter_plugins/teamserve_users.py")
caddy_users = load("caddy_users", "roles/caddy/filter_plugins/caddy_users.py")
KEY_FORMAT = re.compile(r"sk-ts-[A-Za-z0-9]{48}")  # what molecule's key tests assert too
AT = 1764686400  # 2025-12-02T14:40:00Z


def test_every_key_has_the_one_format_and_is_drawn_anew():
    keys = {users.teamserve_new_key() for _ in range(200)}
    assert len(keys) == 200
    assert all(KEY_FORMAT.fullmatch(k) for k in keys)
    assert set("".join(k[6:] for k in keys)) == set(users.KEY_ALPHABET)  # the whole alphabet is drawn
    assert KEY_FORMAT.fullmatch(users.teamserve_new_key("48"))  # users.yml hands the length as a string
    assert re.fullmatch(r"sk-ts-[A-Za-z0-9]{64}", users.teamserve_new_key(64))
    with pytest.raises(ValueError, match="at least 32"):
        users.teamserve_new_key(16)


def test_a_new_key_passes_the_gateways_own_checks():
    key = users.teamserve_new_key()
    assert caddy_users.caddy_users_problems([{"name": "dana", "rate_limit": {"events": 5, "window": "1m"}}],
                                            {"dana": key}) == []


def test_the_testbed_script_draws_with_the_same_generator():
    run = subprocess.run([sys.executable, str(REPO / "playbooks" / "filter_plugins" / "teamserve_users.py")],
                         capture_output=True, text=True, check=True, timeout=30)
    assert KEY_FORMAT.fullmatch(run.stdout.strip())
    script = (REPO / "tests" / "testbed" / "inventory.sh").read_text()
    assert "playbooks/filter_plugins/teamserve_users.py" in script and "openssl rand -hex 24" not in script


TEAM = [
    {"name": "alice", "rate_limit": {"events": 120, "window": "1m"}, "max_inflight": 8, "tokens_per_day": 50000,
     "tokens_per_minute": 6000},
    {"name": "bob", "rate_limit": {"events": 60, "window": "1m"}, "expires": "2025-12-01"},
    {"name": "nightly", "rate_limit": {"events": 600, "window": "1h"}, "lane": "batch", "expires": "2030-01-01"},
    {"name": "svc", "rate_limit": {"events": 10, "window": "1m"}, "key": "sk-ts-" + "k" * 48},
]


def test_the_list_prints_numbers_lanes_limits_and_expiry_never_a_key():
    lines = users.teamserve_users_listing(TEAM, ["alice", "nightly"], 6, AT, "", 0)
    assert lines == [
        "alice            key: yes; expires: never; rate: 120/1m; in flight: 8 sequences; lane: interactive; "
        "tokens/day: 50000; tokens/min: 6000",
        "bob              key: none (no access; issue one); expires: 2025-12-01 - EXPIRED, answered 401; rate: 60/1m; "
        "in flight: 6 sequences; lane: interactive; tokens/day: no budget",
        "nightly          key: yes; expires: 2030-01-01; rate: 600/1h; in flight: 3 sequences; lane: batch; "
        "tokens/day: no budget",
        "svc              key: in the inventory (caddy_users.key); expires: never; rate: 10/1m; "
        "in flight: 6 sequences; lane: interactive; tokens/day: no budget",
    ]
    assert not any("k" * 48 in line for line in lines)


def test_the_list_caps_are_the_gateways():
    """The same numbers as the Caddyfile's (caddy_users_effective) for every user with a key."""
    keys = {"alice": "a" * 40, "bob": "b" * 40, "nightly": "n" * 40}
    effective = {u["name"]: u for u in caddy_users.caddy_users_effective(TEAM, keys, "5", "288000")}
    for line in users.teamserve_users_listing(TEAM, list(keys), "5", AT, "", "288000"):
        name = line.split()[0]
        assert f"in flight: {effective[name]['max_inflight']} sequences;" in line
        assert f"; tokens/day: {effective[name]['tokens_per_day']}" in line
        per_minute = effective[name]["tokens_per_minute"]
        assert line.endswith(f"; tokens/min: {per_minute}") if per_minute else "tokens/min" not in line


def test_without_a_plan_the_list_says_why():
    (line,) = users.teamserve_users_listing(TEAM[2:3], [], None, AT, "no plan read from box: File not found")
    assert "in flight: unknown (no plan read from box: File not found); lane: batch" in line


LIST_INVENTORY = {
    "all": {"children": {"teamserve": {"hosts": {"box": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "caddy_users": TEAM,
        "caddy_user_keys": {"alice": "sk-ts-" + "a" * 48, "nightly": "sk-ts-" + "n" * 48}}}}}}}


def users_list(tmp_path: pathlib.Path, **box: object) -> subprocess.CompletedProcess:
    """playbooks/users.yml -e caddy_users_action=list against LIST_INVENTORY (the box's vars updated by `box`)."""
    inventory = json.loads(json.dumps(LIST_INVENTORY))
    inventory["all"]["children"]["teamserve"]["hosts"]["box"].update(box)
    (tmp_path / "inventory").mkdir()
    (tmp_path / "inventory" / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "vault-pass").write_text("not used by a list\n")
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
           "ANSIBLE_VAULT_PASSWORD_FILE": str(tmp_path / "vault-pass"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                          str(tmp_path / "inventory" / "hosts.yml"), str(REPO / "playbooks" / "users.yml"),
                          "-e", "caddy_users_action=list"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_users_yml_list_reads_the_cap_from_the_plan_the_box_records(tmp_path):
    record = tmp_path / "plan.json"  # the shape the vllm role records (/var/lib/teamserve/plan.json)
    record.write_text(json.dumps({"gpus": [], "plan": {"admission": {"user_max_inflight": 6, "user_fair_share": 3,
                                                                     "user_tokens_per_day": 288000}}}))
    run = users_list(tmp_path, vllm_plan_record=str(record))
    out = " ".join(run.stdout.split())
    assert "alice key: yes; expires: never; rate: 120/1m; in flight: 8 sequences; lane: interactive; " \
           "tokens/day: 50000; tokens/min: 6000" in out
    assert "bob key: none (no access; issue one); expires: 2025-12-01 - EXPIRED, answered 401; rate: 60/1m; " \
           "in flight: 6 sequences; lane: interactive; tokens/day: 288000" in out
    assert "nightly key: yes; expires: 2030-01-01; rate: 600/1h; in flight: 3 sequences; lane: batch" in out
    assert "per-user share" not in out
    assert "a" * 48 not in run.stdout and "n" * 48 not in run.stdout and "k" * 48 not in run.stdout


def test_users_yml_list_takes_the_inventorys_own_default_cap(tmp_path):
    run = users_list(tmp_path, vllm_plan_record=str(tmp_path / "absent.json"), caddy_user_max_inflight=4)
    out = " ".join(run.stdout.split())
    assert "bob key: none (no access; issue one); expires: 2025-12-01 - EXPIRED, answered 401; rate: 60/1m; " \
           "in flight: 4 sequences" in out
    assert "in flight: 2 sequences; lane: batch" in out


def test_users_yml_list_without_a_plan_says_why(tmp_path):
    run = users_list(tmp_path, vllm_plan_record=str(tmp_path / "absent.json"))
    out = " ".join(run.stdout.split())
    assert f"in flight: unknown (no plan read from box: File not found: {tmp_path / 'absent.json'}" in out
    assert "alice key: yes; expires: never; rate: 120/1m; in flight: 8 sequences" in out
