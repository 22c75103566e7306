"""Bad input stops the GPU host roles before anything on the host changes: run the roles' own checks
with ansible-playbook on this machine (read-only: fact gathering and assert tasks only), the way
site.yml's preflight includes them (one include_role per role, tasks_from: assert.yml).

A toolkit that does not go with the driver branch must be refused by the first role that runs
(nvidia_driver), not only by nvidia_container_toolkit after the driver and Docker were installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = """
- name: The GPU host roles' input checks, as site.yml's preflight runs them
  hosts: all
  gather_facts: true
  tasks:
    - name: Check the inputs of each role
      ansible.builtin.include_role:
        name: "{{ r }}"
        tasks_from: assert.yml
      loop: %s
      loop_control:
        loop_var: r
"""


def run_checks(tmp_path: Path, roles: list[str], **extra_vars: str) -> subprocess.CompletedProcess:
    """Run the roles' assert.yml on localhost; return the finished ansible-playbook process."""
    play = tmp_path / "checks.yml"
    play.write_text(PLAYBOOK % roles, encoding="utf-8")
    bindir = Path(sys.executable).parent
    playbook = bindir / "ansible-playbook"
    if not playbook.exists():
        playbook = Path(shutil.which("ansible-playbook") or "ansible-playbook")
    argv = [str(playbook), "-i", "localhost,", "-c", "local", str(play)]
    for key, value in extra_vars.items():
        argv += ["-e", f"{key}={value}"]
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               ANSIBLE_NOCOLOR="1", ANSIBLE_PYTHON_INTERPRETER=sys.executable)
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)


@pytest.fixture(scope="module")
def debian_host():
    """These checks accept only the supported distributions; skip elsewhere."""
    release = Path("/etc/os-release").read_text(encoding="utf-8") if Path("/etc/os-release").exists() else ""
    if 'ID=debian' not in release or not any(f'VERSION_ID="{v}"' in release for v in ("12", "13")):
        pytest.skip("needs a Debian 12/13 machine (the test machines are)")


def test_defaults_pass(tmp_path, debian_host):
    proc = run_checks(tmp_path, ["nvidia_driver", "docker", "nvidia_container_toolkit"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_toolkit_driver_mismatch_is_refused_by_the_first_role(tmp_path, debian_host):
    # Only nvidia_driver's checks run: the first role of the GPU play must already refuse the pair.
    proc = run_checks(tmp_path, ["nvidia_driver"], nvidia_container_toolkit_version="1.16.2")
    assert proc.returncode != 0
    assert ("nvidia_container_toolkit_version=1.16.2 does not go with driver branch 580: that branch needs "
            "1.17.8 or newer") in proc.stdout, proc.stdout[-3000:]


def test_driver_branch_older_than_blackwell_is_refused(tmp_path, debian_host):
    proc = run_checks(tmp_path, ["nvidia_driver"], nvidia_driver_branch="550", nvidia_driver_version="550.163.01")
    assert proc.returncode != 0
    assert "nvidia_driver_branch=550 is older than 570" in proc.stdout, proc.stdout[-3000:]
