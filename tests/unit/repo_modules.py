"""Load the project's plugin and module files (roles/*/library, roles/*/filter_plugins, tests/testbed) by path:
they are not importable packages; and plan the example inventory's profiles the way Ansible does. Shared by
the unit, capacity and gateway tests. The project's collection (teamserve.core) is imported by its Python
name, ansible_collections.teamserve.core (pyproject.toml puts collections/ on pytest's path)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]


def load(name: str, relative_path: str) -> ModuleType:
    """Import the Python file at REPO/relative_path as module `name`; raises FileNotFoundError if it is absent."""
    path = REPO / relative_path
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cases(tmp: pathlib.Path, hosts: dict[str, dict[str, Any]], playbook: str, forks: int = 10) -> dict[str, str]:
    """Run ``playbook`` (YAML text) with ansible-playbook on localhost, one inventory host per case, and
    return what each case wrote to ``<out_dir>/<case>.txt``, by case name.

    ``hosts`` maps case names to their variables; each host also gets a local connection, this Python and
    ``out_dir`` = ``tmp``. The project's ansible.cfg and roles are used. Raises AssertionError with the
    play's output tail if the play itself fails (the playbook records each case's own failure)."""
    inventory = {name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                        "out_dir": str(tmp), **variables} for name, variables in hosts.items()}
    (tmp / "inventory.yml").write_text(json.dumps({"all": {"hosts": inventory}}))
    (tmp / "play.yml").write_text(playbook)
    # PYTHONPATH: the filter plugins import this checkout's teamserve_capacity, not the one the venv was
    # installed from (another worktree's).
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp / "inventory.yml"),
                          "--forks", str(forks), str(tmp / "play.yml")], cwd=REPO, env=env, capture_output=True,
                         text=True, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {name: (tmp / f"{name}.txt").read_text() for name in hosts}


def example_profile_plans() -> dict[str, dict[str, Any]]:
    """Each profile of inventories/example, planned by tests/capacity/plan_profiles.yml through
    ansible-playbook (the inventory's lookups, the vllm role's defaults and filter), by profile name.
    Raises AssertionError with the play's output tail if the play fails."""
    env = dict(os.environ, ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
               ANSIBLE_CALLBACKS_ENABLED="ansible.posix.json",
               ANSIBLE_FILTER_PLUGINS=str(REPO / "roles/vllm/filter_plugins"), PYTHONPATH=str(REPO))
    run = subprocess.run(
        [str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i", str(REPO / "inventories/example"),
         str(REPO / "tests/capacity/plan_profiles.yml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    task = json.loads(run.stdout)["plays"][0]["tasks"][-1]
    results = next(iter(task["hosts"].values()))["results"]
    return {r["msg"]["profile"]: r["msg"]["plan"] for r in results}


def trust(value: Any) -> Any:
    """Mark YAML-loaded strings (inside dicts and lists too) as templates: ansible-core 2.19 renders only
    trusted strings."""
    from ansible.template import trust_as_template

    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trust(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trust(v) for v in value]
    return value
