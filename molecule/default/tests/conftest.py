"""Shared fixtures for the default scenario: the testbed inventory's values and secrets."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[3]
GROUP_VARS = REPO / "inventories" / "testbed" / "group_vars" / "teamserve"
CACHE = pathlib.Path(os.environ.get("TESTBED_CACHE", "/var/cache/teamserve-testbed"))


@pytest.fixture(scope="session")
def testbed_vars() -> dict:
    """The committed testbed group_vars (main.yml), as plain data (no templating)."""
    return yaml.safe_load((GROUP_VARS / "main.yml").read_text())


@pytest.fixture(scope="session")
def vault() -> dict:
    """The testbed's decrypted vault (user keys, engine key), read with ansible-vault."""
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-vault"), "view", "--vault-password-file",
         str(CACHE / "vault-pass"), str(GROUP_VARS / "vault.yml")],
        check=True, capture_output=True, text=True,
    ).stdout
    return yaml.safe_load(out)


@pytest.fixture(scope="session")
def keys(vault) -> dict:
    return vault["vault_caddy_user_keys"]


@pytest.fixture(scope="session")
def gateway_verify(testbed_vars, tmp_path_factory):
    """What httpx should verify the gateway with: the box's Caddy root CA for https, True for http."""
    if testbed_vars.get("teamserve_gateway_scheme", "http") != "https":
        return True
    import testinfra

    box = testinfra.get_host("docker://teamserve-box")
    pem = box.file(testbed_vars["teamserve_gateway_ca_path"]).content_string
    path = tmp_path_factory.mktemp("ca") / "root.crt"
    path.write_text(pem)
    return str(path)
