"""Shared fixtures of the molecule/caddy tests: the scenario's settings, the gateway's URL and CA."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import docker
import pytest
import yaml

SCENARIO = pathlib.Path(__file__).resolve().parent.parent
VARS = yaml.safe_load((SCENARIO / "inventory" / "group_vars" / "teamserve" / "gateway.yml").read_text())
EPHEMERAL = pathlib.Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
BOX = "caddydev-box"
PORT = 8443


@pytest.fixture(scope="session")
def gateway_vars() -> dict:
    """inventory/group_vars/teamserve/gateway.yml as converged."""
    return VARS


@pytest.fixture(scope="session")
def side_effect() -> dict:
    """What side_effect.yml left: the current keys (after rotate/revoke/issue) and frank's expiry."""
    path = EPHEMERAL / "keys-after-side-effect.json"
    assert path.exists(), "run the side_effect step first (molecule side-effect -s caddy, or molecule test)"
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def keys(side_effect) -> dict:
    """The keys in force now: name -> key."""
    return side_effect["keys"]


@pytest.fixture(scope="session")
def base_url() -> str:
    """https://<box address on Docker's bridge>:8443/v1"""
    box = docker.from_env().containers.get(BOX)
    address = next(n["IPAddress"] for n in box.attrs["NetworkSettings"]["Networks"].values() if n["IPAddress"])
    return f"https://{address}:{PORT}/v1"


@pytest.fixture(scope="session")
def ca_file() -> str:
    """The internal CA root the role fetched to the controller."""
    path = EPHEMERAL / "caddy-root.crt"
    assert path.read_text().startswith("-----BEGIN CERTIFICATE-----")
    return str(path)


def access_log_entries(host) -> list[dict]:
    """Every entry of the current access log, oldest first."""
    return [json.loads(line) for line in host.file("/var/log/caddy/access.log").content_string.splitlines()
            if line.strip()]


def access_log_entry(host, request_id: str, timeout: float = 15) -> dict:
    """The access log's entry for the request sent with header X-Request-Id: request_id. Caddy writes it
    when its handler returns, which can be after the client has its last byte, so this polls (every
    0.3 s, at most `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in host.file("/var/log/caddy/access.log").content_string.splitlines():
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                return entry
        assert time.monotonic() < deadline, f"no access log entry for X-Request-Id {request_id}"
        time.sleep(0.3)


def run_converge(extra: dict, timeout: int = 600, playbook: pathlib.Path = SCENARIO / "converge.yml") \
        -> subprocess.CompletedProcess:
    """The scenario's converge.yml (the caddy role), or another `playbook`, with `extra` as extra vars,
    through ansible-playbook as an admin runs it. The vars go in a 0600 temporary file, so keys stay out
    of argv."""
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(SCENARIO.parents[1] / "roles"), ANSIBLE_FORCE_COLOR="0")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as extra_vars:
        json.dump(extra, extra_vars)
        extra_vars.flush()
        return subprocess.run(
            [str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i", os.environ["MOLECULE_INVENTORY_FILE"],
             str(playbook), "-e", f"@{extra_vars.name}"],
            env=env, capture_output=True, text=True, timeout=timeout, check=False)
