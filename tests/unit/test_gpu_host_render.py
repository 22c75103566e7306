"""What the GPU host roles render for distributions the testbed cannot boot (Ubuntu 22.04/24.04),
next to Debian 12/13 for comparison: repository URLs, package names and versions, apt pins, holds
and the unattended-upgrades blacklist. The role's own defaults, vars, set_fact expressions, assert
conditions and templates are rendered with ansible-core's Templar, so a change in the role shows here.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

ROLES = Path(__file__).resolve().parents[2] / "roles"
LOADER = DataLoader()

FACTS = {
    ("Ubuntu", "22.04"): {"distribution": "Ubuntu", "distribution_version": "22.04",
                          "distribution_major_version": "22", "distribution_release": "jammy",
                          "architecture": "x86_64"},
    ("Ubuntu", "24.04"): {"distribution": "Ubuntu", "distribution_version": "24.04",
                          "distribution_major_version": "24", "distribution_release": "noble",
                          "architecture": "x86_64"},
    ("Debian", "12"): {"distribution": "Debian", "distribution_version": "12.15",
                       "distribution_major_version": "12", "distribution_release": "bookworm",
                       "architecture": "x86_64"},
    ("Debian", "13"): {"distribution": "Debian", "distribution_version": "13.8",
                       "distribution_major_version": "13", "distribution_release": "trixie",
                       "architecture": "x86_64"},
    ("Ubuntu", "20.04"): {"distribution": "Ubuntu", "distribution_version": "20.04",
                          "distribution_major_version": "20", "distribution_release": "focal",
                          "architecture": "x86_64"},
}


def _trust(value):
    """Mark YAML-loaded strings as templates (ansible-core 2.19 renders only trusted strings)."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: _trust(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_trust(v) for v in value]
    return value


class Role:
    """A role's variables for one distribution, with helpers to render its expressions."""

    def __init__(self, role: str, facts: dict, **overrides):
        self.role = ROLES / role
        self.vars: dict = {"ansible_managed": "Ansible managed", "ansible_facts": facts}
        for part in ("defaults/main.yml", "vars/main.yml"):
            self.vars.update(_trust(LOADER.load_from_file(str(self.role / part))))
        self.vars.update(overrides)
        facts_file = self.role / "tasks/facts.yml"
        if facts_file.exists():
            for task in LOADER.load_from_file(str(facts_file)):
                for key, expr in task["ansible.builtin.set_fact"].items():
                    self.vars[key] = self.render(expr)

    def render(self, value):
        return Templar(loader=LOADER, variables=self.vars).template(_trust(value))

    def template(self, name: str) -> str:
        return self.render((self.role / "templates" / name).read_text())

    def task(self, tasks_file: str, name: str) -> dict:
        for task in LOADER.load_from_file(str(self.role / "tasks" / tasks_file)):
            if task.get("name") == name:
                return task
        raise KeyError(name)

    def condition(self, expr: str) -> bool:
        return self.render("{{ " + expr + " }}")


@pytest.mark.parametrize("version,distro", [("22.04", "ubuntu2204"), ("24.04", "ubuntu2404")])
def test_driver_repository_url_and_key_for_ubuntu(version, distro):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    base = "https://developer.download.nvidia.com/compute/cuda/repos"
    assert role.vars["nvidia_driver_repo_url"] == f"{base}/{distro}/x86_64/"
    assert role.vars["nvidia_driver_repo_key"] == f"{base}/{distro}/x86_64/3bf863cc.pub"


@pytest.mark.parametrize("version", ["12", "13"])
def test_driver_repository_url_for_debian_uses_major_version(version):
    role = Role("nvidia_driver", FACTS[("Debian", version)])
    assert role.vars["nvidia_driver_repo_url"].endswith(f"/debian{version}/x86_64/")


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_driver_packages_and_version_for_ubuntu(version):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    names = role.vars["nvidia_driver_package_names"]
    assert "nvidia-driver-580-open" in names and "nvidia-dkms-580-open" in names
    assert "nvidia-utils-580" in names  # ships nvidia-smi on Ubuntu
    assert all(not n.startswith("nvidia-dkms-580") or n.endswith("-open") for n in names)
    assert role.vars["nvidia_driver_package_version"] == "580.95.05-0ubuntu1"
    assert role.vars["nvidia_driver_headers_package"] == "linux-headers-generic"


def test_ubuntu_package_names_follow_the_branch():
    role = Role("nvidia_driver", FACTS[("Ubuntu", "24.04")], nvidia_driver_branch="590",
                nvidia_driver_version="590.44.01")
    assert "nvidia-driver-590-open" in role.vars["nvidia_driver_package_names"]
    assert role.vars["nvidia_driver_package_version"] == "590.44.01-0ubuntu1"


def test_debian_packages_use_open_kernel_modules():
    role = Role("nvidia_driver", FACTS[("Debian", "12")])
    assert role.vars["nvidia_driver_package_names"][:3] == ["nvidia-open", "nvidia-driver", "nvidia-kernel-open-dkms"]
    assert role.vars["nvidia_driver_package_version"] == "580.95.05-1"
    assert role.vars["nvidia_driver_headers_package"] == "linux-headers-amd64"


def test_headers_none_installs_no_headers_package():
    role = Role("nvidia_driver", FACTS[("Ubuntu", "24.04")], nvidia_driver_kernel_headers_package="none")
    assert role.vars["nvidia_driver_headers_package"] == ""


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_ubuntu_pin_hold_and_unattended_blacklist_cover_every_package(version):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    names = role.vars["nvidia_driver_package_names"]
    pref = role.template("nvidia-driver.pref.j2")
    assert re.search(r"^Package: (.+)$", pref, re.M).group(1).split() == names
    assert re.search(r"^Pin: version (\S+)$", pref, re.M).group(1) == "580.95.05-0ubuntu1"
    assert re.search(r"^Pin-Priority: 1001$", pref, re.M)
    held = role.render(role.task("install.yml", "Hold the driver packages (dpkg selections)")["loop"])
    assert held == names
    installed = role.render(role.task("install.yml", "Install the pinned driver with the open kernel modules")
                            ["ansible.builtin.apt"]["name"])
    assert installed == [f"{n}=580.95.05-0ubuntu1" for n in names]
    blacklist = role.template("unattended-upgrades.conf.j2")
    assert re.findall(r'"\^(.+)\$";', blacklist) == [re.escape(n) for n in names]


@pytest.mark.parametrize("role_name", ["nvidia_driver", "docker", "nvidia_container_toolkit"])
@pytest.mark.parametrize("key,ok", [
    (("Ubuntu", "22.04"), True), (("Ubuntu", "24.04"), True),
    (("Debian", "12"), True), (("Debian", "13"), True), (("Ubuntu", "20.04"), False)])
def test_supported_distributions(role_name, key, ok):
    role = Role(role_name, FACTS[key])
    task = role.task("assert.yml", "Refuse an unsupported distribution")["ansible.builtin.assert"]
    assert all(role.condition(c) for c in task["that"]) is ok
    if not ok:
        msg = role.render(task["fail_msg"])
        assert f"{role_name}: Ubuntu 20.04" in msg and "is not supported" in msg


@pytest.mark.parametrize("branch,ok", [("535", False), ("550", False), ("570", True), ("580", True)])
def test_branch_older_than_blackwell_is_refused(branch, ok):
    role = Role("nvidia_driver", FACTS[("Ubuntu", "24.04")], nvidia_driver_branch=branch,
                nvidia_driver_version=f"{branch}.10.01")
    task = role.task("assert.yml", "Refuse a branch older than the GPU needs")
    assert all(role.condition(c) for c in task["ansible.builtin.assert"]["that"]) is ok


@pytest.mark.parametrize("facts,expected", [
    (("Ubuntu", "24.04"), "5:28.5.1-1~ubuntu.24.04~noble"),
    (("Ubuntu", "22.04"), "5:28.5.1-1~ubuntu.22.04~jammy"),
    (("Debian", "12"), "5:28.5.1-1~debian.12~bookworm")])
def test_docker_package_version_and_pin(facts, expected):
    role = Role("docker", FACTS[facts])
    assert role.render("{{ __docker_package_version }}") == expected
    pref = role.template("docker.pref.j2")
    assert f"Pin: version {expected}" in pref
    assert "Package: docker-ce docker-ce-cli" in pref


def test_docker_repository_for_ubuntu():
    role = Role("docker", FACTS[("Ubuntu", "24.04")])
    repo = role.task("install-docker.yml", "Add Docker's repository as a deb822 source")["ansible.builtin.deb822_repository"]
    assert role.render(repo["uris"]) == ["https://download.docker.com/linux/ubuntu"]
    assert role.render(repo["suites"]) == ["noble"]
    assert repo["components"] == ["stable"]
    assert role.render(repo["signed_by"]) == "/etc/apt/keyrings/docker.asc"


def test_docker_distribution_packages_for_ubuntu():
    role = Role("docker", FACTS[("Ubuntu", "24.04")])
    task = role.task("install-debian.yml", "Install docker.io from the distribution")
    assert role.render(task["vars"]["__docker_install_names"]) == ["docker.io", "python3-docker"]


def test_toolkit_pin_and_blacklist():
    role = Role("nvidia_container_toolkit", FACTS[("Ubuntu", "24.04")])
    pref = role.template("nvidia-container-toolkit.pref.j2")
    assert re.search(r"^Pin: version 1\.18\.2-1$", pref, re.M)
    assert "Package: nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools libnvidia-container1" in pref
    blacklist = role.template("unattended-upgrades.conf.j2")
    assert '"^nvidia\\-container\\-toolkit$";' in blacklist


@pytest.mark.parametrize("toolkit,branch,ok", [
    ("1.18.2", "580", True), ("1.17.8", "580", True), ("1.17.4", "580", False),
    ("1.17.4", "570", True), ("1.16.2", "570", False), ("1.16.2", "", True)])
def test_toolkit_driver_pair(toolkit, branch, ok):
    role = Role("nvidia_container_toolkit", FACTS[("Ubuntu", "24.04")],
                nvidia_container_toolkit_version=toolkit, nvidia_container_toolkit_driver_branch=branch)
    task = role.task("assert.yml", "Refuse a toolkit older than the driver branch needs")
    role.vars.update(_trust(task["vars"]))
    assert all(role.condition(c) for c in task["ansible.builtin.assert"]["that"]) is ok


def test_nvidia_driver_gpus_fact_matches_contract():
    """docs/contracts.md: list of {index:int, name, memory_total_mib:int, compute_cap:str, driver_version}."""
    role = Role("nvidia_driver", FACTS[("Debian", "12")])
    task = role.task("verify.yml", "Publish nvidia_driver_gpus (docs/contracts.md)")
    role.vars["__nvidia_driver_smi"] = {"stdout_lines": [
        "0, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 12.0, 580.95.05",
        "1, NVIDIA H100 80GB HBM3, 81559, 9.0, 580.95.05", ""]}
    role.vars.update(_trust(task["vars"]))
    gpus = role.render(task["ansible.builtin.set_fact"]["nvidia_driver_gpus"])
    assert gpus == [
        {"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "memory_total_mib": 97887,
         "compute_cap": "12.0", "driver_version": "580.95.05"},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
         "compute_cap": "9.0", "driver_version": "580.95.05"}]
    assert isinstance(gpus[0]["compute_cap"], str) and isinstance(gpus[0]["memory_total_mib"], int)


def _pci_ids(*ids):
    """slurp results of /sys/bus/pci/devices/*/device as the preflight registers them."""
    import base64
    return {"results": [{"content": base64.b64encode(f"{i}\n".encode()).decode()} for i in ids]}


@pytest.mark.parametrize("ids,branch,refused", [
    (["0x2bb1"], "550", True),             # RTX PRO 6000 Blackwell Workstation (GB202) with R550
    (["0x2bb1"], "570", False),
    (["0x2330", "0x2901"], "560", True),   # an H100 and a B200 (GB100) in one box
    (["0x2330"], "550", False),            # Hopper only: R550 supports it, nothing to refuse
    ([], "550", False)])
def test_branch_older_than_the_detected_card_is_refused(ids, branch, refused):
    """preflight.yml: a Blackwell PCI device ID (0x29xx-0x2fxx) needs R570+, whatever nvidia_driver_min_branch says."""
    role = Role("nvidia_driver", FACTS[("Debian", "12")], nvidia_driver_branch=branch,
                nvidia_driver_version=f"{branch}.10.01", nvidia_driver_min_branch=535)
    role.vars["__nvidia_driver_pci_ids"] = _pci_ids(*ids)
    role.vars["inventory_hostname"] = "gpu-box"
    task = role.task("preflight.yml", "Refuse a branch older than the detected card needs")
    role.vars.update(_trust(task["vars"]))
    applies = role.condition(task["when"])
    passes = all(role.condition(c) for c in task["ansible.builtin.assert"]["that"])
    assert (applies and not passes) is refused
    if refused:
        msg = role.render(task["ansible.builtin.assert"]["fail_msg"])
        assert f"nvidia_driver_branch={branch}" in msg and "570" in msg and ids[-1] in msg


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_toolkit_repository_and_holds_for_ubuntu(version):
    role = Role("nvidia_container_toolkit", FACTS[("Ubuntu", version)])
    repo = role.task("repository.yml", "Add the libnvidia-container repository as a deb822 source")[
        "ansible.builtin.deb822_repository"]
    # One flat repository for every deb distribution; apt expands $(ARCH).
    assert role.render(repo["uris"]) == ["https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)/"]
    assert repo["suites"] == ["/"]
    assert role.render(repo["signed_by"]) == "/etc/apt/keyrings/nvidia-container-toolkit.asc"
    held = role.render(role.task("install.yml", "Hold the toolkit packages (dpkg selections)")["loop"])
    assert held == ["nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
                    "libnvidia-container1"]
    installed = role.render(role.task("install.yml", "Install the pinned toolkit")["ansible.builtin.apt"]["name"])
    assert installed == [f"{n}=1.18.2-1" for n in held]


def test_docker_holds_for_ubuntu():
    role = Role("docker", FACTS[("Ubuntu", "22.04")])
    held = role.render(role.task("install-docker.yml", "Hold Docker Engine (dpkg selections)")["loop"])
    assert held == ["docker-ce", "docker-ce-cli", "containerd.io"]
    pref = role.template("docker.pref.j2")
    assert re.search(r"^Pin: version 5:28\.5\.1-1~ubuntu\.22\.04~jammy$", pref, re.M)


# Tasks that can reload systemd (package maintainer scripts, `systemctl enable`) and the register each
# must feed into its role's "Re-check the GPU ..." include (NVIDIA/nvidia-container-toolkit#48).
# Installs of gpg/ca-certificates/python3-debian are left out: none of them ships a systemd unit.
RELOADING_TASKS = {
    "nvidia_driver": {"Install DKMS and the kernel headers meta-package (they follow kernel upgrades, not held)":
                      "__nvidia_driver_dkms",
                      "Install the pinned driver with the open kernel modules": "nvidia_driver_install",
                      "Enable and start nvidia-persistenced": "__nvidia_driver_persistenced"},
    "docker": {"Install the packages": "__docker_install_first",
               "Install or upgrade the packages (engine already installed, or check mode)": "__docker_install_update",
               "Enable and start Docker": "__docker_enable"},
    "nvidia_container_toolkit": {"Install the pinned toolkit": "nvidia_container_toolkit_install"},
}
PREREQUISITES = {"gpg", "ca-certificates", "python3-debian"}


def _walk(tasks):
    for task in tasks or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _walk(task.get(key))


def _role_tasks(role):
    for path in sorted((ROLES / role / "tasks").glob("*.yml")):
        for task in _walk(LOADER.load_from_file(str(path))):
            yield path.name, task


@pytest.mark.parametrize("role", sorted(RELOADING_TASKS))
def test_every_systemd_reload_is_followed_by_the_gpu_recheck(role):
    seen = {}
    for _, task in _role_tasks(role):
        apt = task.get("ansible.builtin.apt") or {}
        systemd = task.get("ansible.builtin.systemd_service") or {}
        installs = "name" in apt and not (isinstance(apt["name"], list) and PREREQUISITES.issuperset(apt["name"]))
        if installs or "enabled" in systemd or systemd.get("daemon_reload"):
            seen[task["name"]] = task.get("register")
    assert seen == RELOADING_TASKS[role], "a task that reloads systemd is not wired to the GPU re-check"
    main = LOADER.load_from_file(str(ROLES / role / "tasks/main.yml"))
    recheck = [t for t in main if t.get("name") == "Re-check the GPU in the running engine container after a systemd reload"]
    assert len(recheck) == 1 and main[-1] is recheck[0], "the re-check must be the role's last step"
    include = recheck[0].get("ansible.builtin.include_role") or recheck[0].get("ansible.builtin.include_tasks")
    assert include in ({"name": "nvidia_container_toolkit", "tasks_from": "recheck_gpu.yml"}, "recheck_gpu.yml")
    for register in RELOADING_TASKS[role].values():
        assert f"({register} | default({{}})) is changed" in recheck[0]["when"]
