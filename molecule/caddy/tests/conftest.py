"""Shared fixtures of the molecule/caddy tests: the scenario's settings, the gateway's URL and CA."""
from __future__ import annotations

import json
import os
import pathlib

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
