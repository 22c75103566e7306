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
from ansible.template import Templar
from repo_modules import trust

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


class Role:
    """A role's variables for one distribution, with helpers to render its expressions."""

    def __init__(self, role: str, facts: dict, **overrides):
        self.role = ROLES / role
        self.vars: dict = {"ansible_managed": "Ansible managed", "ansible_facts": facts}
        for part in ("defaults/main.yml", "vars/main.yml"):
            self.vars.update(trust(LOADER.load_from_file(str(self.role / part))))
        self.vars.update(overrides)

    def render(self, value):
        return Templar(loader=LOADER, variables=self.vars).template(trust(value))

    def template(self, name: str) -> str:
        return self.render((self.role / "templates" / name).read_text())

    def task(self, tasks_file: str, name: str) -> dict:
        for task in LOADER.load_from_file(str(self.role / "tasks" / tasks_file)):
            if task.get("name") == name:
                return task
        raise KeyError(name)

    def condition(self, expr: str) -> bool:
        return self.render("{{ " + expr + " }}")

    def include(self, tasks_file: str, name: str) -> Role:
        """The role that the include_role task `name` of `tasks_file` calls, with the include's vars
        rendered in this role's scope (as ansible-core passes them), on top of its defaults and below its vars."""
        task = self.task(tasks_file, name)
        target = task["ansible.builtin.include_role"]
        callee = Role.__new__(Role)
        callee.role = ROLES / target["name"]
        callee.vars = dict(self.vars)
        callee.vars.update(trust(LOADER.load_from_file(str(callee.role / "defaults/main.yml"))))
        callee.vars.update({k: self.render(v) for k, v in task.get("vars", {}).items()})
        if (callee.role / "vars/main.yml").exists():
            callee.vars.update(trust(LOADER.load_from_file(str(callee.role / "vars/main.yml"))))
        return callee


@pytest.mark.parametrize("version,distro", [("22.04", "ubuntu2204"), ("24.04", "ubuntu2404")])
def test_driver_repository_url_and_key_for_ubuntu(version, distro):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    base = "https://developer.download.nvidia.com/compute/cuda/repos"
    assert role.render("{{ __nvidia_driver_repo_url }}") == f"{base}/{distro}/x86_64/"
    assert role.render("{{ __nvidia_driver_repo_key }}") == f"{base}/{distro}/x86_64/3bf863cc.pub"


@pytest.mark.parametrize("version", ["12", "13"])
def test_driver_repository_url_for_debian_uses_major_version(version):
    role = Role("nvidia_driver", FACTS[("Debian", version)])
    assert role.render("{{ __nvidia_driver_repo_url }}").endswith(f"/debian{version}/x86_64/")


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_driver_packages_and_version_for_ubuntu(version):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    names = role.render("{{ __nvidia_driver_package_names }}")
    assert "nvidia-driver-580-open" in names and "nvidia-dkms-580-open" in names
    assert "nvidia-utils-580" in names  # ships nvidia-smi on Ubuntu
    assert all(not n.startswith("nvidia-dkms-580") or n.endswith("-open") for n in names)
    assert role.render("{{ __nvidia_driver_package_version }}") == "580.95.05-0ubuntu1"
    assert role.render("{{ __nvidia_driver_headers_package }}") == "linux-headers-generic"


def test_ubuntu_package_names_follow_the_branch():
    role = Role("nvidia_driver", FACTS[("Ubuntu", "24.04")], nvidia_driver_branch="590",
                nvidia_driver_version="590.44.01")
    assert "nvidia-driver-590-open" in role.render("{{ __nvidia_driver_package_names }}")
    assert role.render("{{ __nvidia_driver_package_version }}") == "590.44.01-0ubuntu1"


def test_debian_packages_use_open_kernel_modules():
    role = Role("nvidia_driver", FACTS[("Debian", "12")])
    assert role.render("{{ __nvidia_driver_package_names }}")[:3] == ["nvidia-open", "nvidia-driver", "nvidia-kernel-open-dkms"]
    assert role.render("{{ __nvidia_driver_package_version }}") == "580.95.05-1"
    assert role.render("{{ __nvidia_driver_headers_package }}") == "linux-headers-amd64"


def test_headers_none_installs_no_headers_package():
    role = Role("nvidia_driver", FACTS[("Ubuntu", "24.04")], nvidia_driver_kernel_headers_package="none")
    assert role.render("{{ __nvidia_driver_headers_package }}") == ""


DRIVER_PACKAGES = "Install the pinned driver with the open kernel modules, DKMS and the kernel headers"


def _packages(common: Role) -> tuple[str, list, list]:
    """The pin file, the held names and the apt names that gpu_host_common's packages entry point renders."""
    held = common.render(common.task("packages.yml", "Hold the pinned packages (dpkg selections)")["loop"])
    installed = common.render(common.task("packages.yml", "Install the packages")["block"][1]["ansible.builtin.apt"]["name"])
    return common.template("pin.pref.j2"), held, installed


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_ubuntu_pin_hold_and_unattended_blacklist_cover_every_package(version):
    role = Role("nvidia_driver", FACTS[("Ubuntu", version)])
    names = role.render("{{ __nvidia_driver_package_names }}")
    common = role.include("main.yml", DRIVER_PACKAGES)
    pref, held, installed = _packages(common)
    assert re.search(r"^Package: (.+)$", pref, re.M).group(1).split() == names
    assert re.search(r"^Pin: version (\S+)$", pref, re.M).group(1) == "580.95.05-0ubuntu1"
    assert re.search(r"^Pin-Priority: 1001$", pref, re.M)
    assert held == names
    # DKMS and the headers follow kernel upgrades: installed, not pinned or held.
    assert installed == [f"{n}=580.95.05-0ubuntu1" for n in names] + ["dkms", "linux-headers-generic"]
    blacklist = common.template("unattended-upgrades.conf.j2")
    assert re.findall(r'"\^(.+)\$";', blacklist) == [re.escape(n) for n in names]
    assert common.render("{{ gpu_host_common_packages_allow_downgrade }}") is False
    rollback = Role("nvidia_driver", FACTS[("Ubuntu", version)], nvidia_driver_allow_downgrade=True)
    assert rollback.include("main.yml", DRIVER_PACKAGES).render("{{ gpu_host_common_packages_allow_downgrade }}") is True


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
def test_docker_package_version_pin_and_holds(facts, expected):
    role = Role("docker", FACTS[facts])
    assert role.render("{{ __docker_package_version }}") == expected
    common = role.include("main.yml", "Install Docker Engine")
    pref, held, installed = _packages(common)
    assert f"Package: docker-ce docker-ce-cli\nPin: version {expected}\nPin-Priority: 1001" in pref
    assert "Package: containerd.io\nPin: version 1.7.28-1*\nPin-Priority: 1001" in pref
    assert held == ["docker-ce", "docker-ce-cli", "containerd.io"]
    assert installed == [f"docker-ce={expected}", f"docker-ce-cli={expected}", "containerd.io=1.7.28-1*",
                         "docker-buildx-plugin", "docker-compose-plugin", "pigz", "python3-docker"]
    assert common.render("{{ gpu_host_common_packages_start_services_on_first_install }}") is False


def test_docker_repository_for_ubuntu():
    common = Role("docker", FACTS[("Ubuntu", "24.04")]).include("main.yml", "Add Docker's apt repository")
    repo = common.task("repository.yml", "Add the repository as a deb822 source signed by that keyring")[
        "ansible.builtin.deb822_repository"]
    assert common.render(repo["uris"]) == ["https://download.docker.com/linux/ubuntu"]
    assert common.render(repo["suites"]) == ["noble"]
    assert common.render(repo["components"]) == ["stable"]
    assert common.render(repo["signed_by"]) == "/etc/apt/keyrings/docker.asc"
    assert common.render("{{ gpu_host_common_repo_key_url }}") == "https://download.docker.com/linux/ubuntu/gpg"


@pytest.mark.parametrize("facts,expected", [
    (("Ubuntu", "24.04"), ["docker.io", "pigz", "python3-docker"]),
    (("Debian", "12"), ["docker.io", "pigz", "python3-docker"]),
    (("Debian", "13"), ["docker.io", "docker-cli", "pigz", "python3-docker"])])
def test_docker_distribution_packages(facts, expected):
    role = Role("docker", FACTS[facts], docker_package_source="debian")
    pref, held, installed = _packages(role.include("main.yml", "Install Docker Engine"))
    assert held == [] and installed == expected


def test_toolkit_pin_and_blacklist():
    common = Role("nvidia_container_toolkit", FACTS[("Ubuntu", "24.04")]).include("main.yml", "Install, pin and hold the toolkit")
    pref, _, _ = _packages(common)
    assert re.search(r"^Pin: version 1\.18\.2-1$", pref, re.M)
    assert "Package: nvidia-container-toolkit nvidia-container-toolkit-base libnvidia-container-tools libnvidia-container1" in pref
    blacklist = common.template("unattended-upgrades.conf.j2")
    assert '"^nvidia\\-container\\-toolkit$";' in blacklist


@pytest.mark.parametrize("toolkit,branch,ok", [
    ("1.18.2", "580", True), ("1.17.8", "580", True), ("1.17.4", "580", False),
    ("1.17.4", "570", True), ("1.16.2", "570", False), ("1.16.2", "", True)])
def test_toolkit_driver_pair(toolkit, branch, ok):
    role = Role("nvidia_container_toolkit", FACTS[("Ubuntu", "24.04")],
                nvidia_container_toolkit_version=toolkit, nvidia_container_toolkit_driver_branch=branch)
    task = role.task("assert.yml", "Refuse a toolkit older than the driver branch needs")
    role.vars.update(trust(task["vars"]))
    assert all(role.condition(c) for c in task["ansible.builtin.assert"]["that"]) is ok


def test_nvidia_driver_gpus_fact_matches_contract():
    """docs/contracts.md: list of {index:int, name, memory_total_mib:int, memory_reserved_mib:int|None,
    compute_cap:str, driver_version}; [N/A] for memory.reserved is published as null."""
    role = Role("nvidia_driver", FACTS[("Debian", "12")])
    query = role.task("verify.yml", "Query the GPUs with nvidia-smi")["ansible.builtin.command"]["argv"]
    assert query[1] == "--query-gpu=index,name,memory.total,memory.reserved,compute_cap,driver_version"
    task = role.task("verify.yml", "Publish nvidia_driver_gpus (docs/contracts.md)")
    role.vars["__nvidia_driver_smi"] = {"stdout_lines": [
        "0, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 638, 12.0, 580.95.05",
        "1, NVIDIA H100 80GB HBM3, 81559, [N/A], 9.0, 580.95.05", ""]}
    role.vars.update(trust(task["vars"]))
    gpus = role.render(task["ansible.builtin.set_fact"]["nvidia_driver_gpus"])
    assert gpus == [
        {"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "memory_total_mib": 97887,
         "memory_reserved_mib": 638, "compute_cap": "12.0", "driver_version": "580.95.05"},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_reserved_mib": None,
         "compute_cap": "9.0", "driver_version": "580.95.05"}]
    assert isinstance(gpus[0]["compute_cap"], str) and isinstance(gpus[0]["memory_total_mib"], int)
    assert isinstance(gpus[0]["memory_reserved_mib"], int)


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
    role.vars.update(trust(task["vars"]))
    applies = role.condition(task["when"])
    passes = all(role.condition(c) for c in task["ansible.builtin.assert"]["that"])
    assert (applies and not passes) is refused
    if refused:
        msg = role.render(task["ansible.builtin.assert"]["fail_msg"])
        assert f"nvidia_driver_branch={branch}" in msg and "570" in msg and ids[-1] in msg


@pytest.mark.parametrize("version", ["22.04", "24.04"])
def test_toolkit_repository_and_holds_for_ubuntu(version):
    role = Role("nvidia_container_toolkit", FACTS[("Ubuntu", version)])
    common = role.include("main.yml", "Configure NVIDIA's libnvidia-container repository")
    repo = common.task("repository.yml", "Add the repository as a deb822 source signed by that keyring")[
        "ansible.builtin.deb822_repository"]
    # One flat repository for every deb distribution; apt expands $(ARCH).
    assert common.render(repo["uris"]) == ["https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)/"]
    assert common.render(repo["suites"]) == ["/"]
    assert common.render("{{ gpu_host_common_repo_components }}") == []  # flat: no Components line
    assert common.render(repo["signed_by"]) == "/etc/apt/keyrings/nvidia-container-toolkit.asc"
    _, held, installed = _packages(role.include("main.yml", "Install, pin and hold the toolkit"))
    assert held == ["nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
                    "libnvidia-container1"]
    assert installed == [f"{n}=1.18.2-1" for n in held]


@pytest.mark.parametrize("installed,expected", [
    ({}, ["docker-ce", "docker-ce-cli", "containerd.io"]),     # fresh host
    ({"docker-ce": "5:28.5.1-1~debian.12~bookworm", "docker-ce-cli": "5:28.5.1-1~debian.12~bookworm",
      "containerd.io": "1.7.28-1~debian.12~bookworm"}, []),    # at the pins (containerd.io by prefix)
    ({"docker-ce": "5:28.0.0-1~debian.12~bookworm", "docker-ce-cli": "5:28.5.1-1~debian.12~bookworm",
      "containerd.io": "1.7.27-1~debian.12~bookworm"}, ["docker-ce", "containerd.io"])])
def test_packages_to_release_from_hold(installed, expected):
    """packages.yml: the holds released before apt runs are those of packages not at their pin."""
    role = Role("docker", FACTS[("Debian", "12")])
    common = role.include("main.yml", "Install Docker Engine")
    common.vars["ansible_facts"] = dict(common.vars["ansible_facts"],
                                        packages={n: [{"version": v}] for n, v in installed.items()})
    task = common.task("packages.yml", "Note the pinned packages not at their pin")
    assert common.render(task["ansible.builtin.set_fact"]["__gpu_host_common_to_change"]) == expected


@pytest.mark.parametrize("policy,skipped", [
    ("dkms:\n  Installed: (none)\n  Candidate: 3.0.10-8\n", True),   # fresh host: CUDA repo not in the lists yet
    ("".join(f"{n}:\n  Installed: (none)\n  Candidate: 580.95.05-1\n" for n in
             ["nvidia-open", "nvidia-driver", "nvidia-kernel-open-dkms", "nvidia-smi", "nvidia-persistenced",
              "libnvidia-ml1", "libcuda1"]) + "dkms:\n  Installed: (none)\n  Candidate: 3.0.10-8\n", False)])
def test_check_mode_skips_the_install_while_apt_does_not_know_the_packages(policy, skipped):
    role = Role("nvidia_driver", FACTS[("Debian", "12")], nvidia_driver_kernel_headers_package="none")
    common = role.include("main.yml", DRIVER_PACKAGES)
    common.vars.update(ansible_check_mode=True, __gpu_host_common_policy={"stdout_lines": policy.splitlines()})
    block = common.task("packages.yml", "Install the packages")
    common.vars.update(trust(block["vars"]))
    assert common.condition(block["when"]) is not skipped
    common.vars["ansible_check_mode"] = False
    assert common.condition(block["when"]) is True


def test_daemon_json_merge_keeps_admin_keys_and_adds_the_nvidia_runtime():
    role = Role("docker", FACTS[("Debian", "12")], docker_daemon_options={"insecure-registries": ["10.231.0.3:5000"]})
    toolkit = Role("nvidia_container_toolkit", FACTS[("Debian", "12")], nvidia_container_toolkit_docker_default_runtime=True)
    handed = toolkit.task("main.yml", "Add the nvidia runtime to Docker's daemon.json")
    assert handed["ansible.builtin.include_role"] == {"name": "docker", "tasks_from": "daemon"}
    role.vars.update({k: toolkit.render(v) for k, v in handed["vars"].items() if k != "docker_daemon_restart"})
    admin = {"debug": False, "log-opts": {"labels": "admin-label"}, "runtimes": {"crun": {"path": "/usr/bin/crun"}}}
    import base64
    import json
    role.vars["__docker_daemon_current"] = {"content": base64.b64encode(json.dumps(admin).encode()).decode()}
    task = role.task("daemon.yml", "Compute the merged daemon.json")
    merged = role.render(task["ansible.builtin.set_fact"]["docker_daemon_config"])
    assert merged == {"debug": False, "log-driver": "json-file",
                      "log-opts": {"labels": "admin-label", "max-size": "50m", "max-file": "5"},
                      "live-restore": True, "userland-proxy": False, "insecure-registries": ["10.231.0.3:5000"],
                      "runtimes": {"crun": {"path": "/usr/bin/crun"},
                                   "nvidia": {"path": "nvidia-container-runtime", "args": []}},
                      "default-runtime": "nvidia"}


def test_recheck_finds_the_gpu_containers_by_their_device_requests():
    """recheck_gpu.yml: `docker run --gpus` (empty driver, gpu capability) and an nvidia device request count;
    a plain container, or one with another device request, does not."""
    import json
    common = Role("nvidia_driver", FACTS[("Debian", "12")]).include("main.yml", "Re-check the GPU containers after a systemd reload")
    containers = [
        {"Name": "/vllm", "HostConfig": {"DeviceRequests": [{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}]}},
        {"Name": "/trainer", "HostConfig": {"DeviceRequests": [{"Driver": "nvidia", "Count": 1, "Capabilities": None}]}},
        {"Name": "/caddy", "HostConfig": {"DeviceRequests": None}},
        {"Name": "/tpu", "HostConfig": {"DeviceRequests": [{"Driver": "other", "Capabilities": [["tpu"]]}]}}]
    common.vars["__gpu_host_common_inspect"] = {"stdout": json.dumps(containers)}
    task = common.task("recheck_gpu.yml", "Run the GPU check inside each running GPU container (--gpus or an nvidia device request)")
    common.vars.update(trust(task["vars"]))
    assert common.render(task["loop"]) == ["vllm", "trainer"]
    assert common.render(task["ansible.builtin.command"]["argv"].replace("item", "'vllm'")) == [
        "docker", "exec", "vllm", "nvidia-smi", "-L"]


# A systemd reload takes the GPU from running containers under Docker's systemd cgroup driver
# (NVIDIA/nvidia-container-toolkit#48). Package scripts reload systemd, and so does `systemctl enable`:
# each role's `enable` tasks (register) and its package install must feed its last step, the re-check.
ENABLING_TASKS = {
    "nvidia_driver": {"Enable and start nvidia-persistenced": "__nvidia_driver_persistenced"},
    "docker": {"Enable and start Docker": "__docker_enable"},
    "nvidia_container_toolkit": {},
}
PREREQUISITES = {"gpg", "ca-certificates", "python3-debian"}
GPU_ROLES = ["nvidia_driver", "docker", "nvidia_container_toolkit", "gpu_host_common"]


def _walk(tasks):
    for task in tasks or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _walk(task.get(key))


def _tasks(path):
    return list(_walk(LOADER.load_from_file(str(path)) or []))


def _role_tasks(role):
    for path in sorted((ROLES / role / "tasks").glob("*.yml")):
        for task in _tasks(path):
            yield path.name, task


@pytest.mark.parametrize("role", sorted(ENABLING_TASKS))
def test_every_systemd_reload_is_followed_by_the_gpu_recheck(role):
    enabling, installs = {}, []
    for _, task in _role_tasks(role):
        apt = task.get("ansible.builtin.apt") or {}
        systemd = task.get("ansible.builtin.systemd_service") or {}
        if "name" in apt and not PREREQUISITES.issuperset(apt["name"]):
            installs.append(task["name"])
        if "enabled" in systemd or systemd.get("daemon_reload"):
            enabling[task["name"]] = task.get("register")
    assert installs == [], "packages are installed only through gpu_host_common's packages entry point"
    assert enabling == ENABLING_TASKS[role], "a task that reloads systemd is not wired to the GPU re-check"
    main = LOADER.load_from_file(str(ROLES / role / "tasks/main.yml"))
    packages = [n for n, t in enumerate(main)
                if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "packages"]
    assert len(packages) == 1
    noted = main[packages[0] + 1]["ansible.builtin.set_fact"]
    assert noted == {f"__{role}_packages_changed": "{{ gpu_host_common_packages_changed }}"}
    recheck = main[-1]
    assert recheck["ansible.builtin.include_role"] == {"name": "gpu_host_common", "tasks_from": "recheck_gpu"}
    assert f"__{role}_packages_changed" in recheck["when"]
    for register in ENABLING_TASKS[role].values():
        assert f"({register} | default({{}})) is changed" in recheck["when"]


def test_the_shared_install_publishes_whether_packages_changed():
    tasks = {t["name"]: t for t in _tasks(ROLES / "gpu_host_common/tasks/packages.yml")}
    installs = [t for t in tasks.values() if "name" in (t.get("ansible.builtin.apt") or {})]
    assert [t["register"] for t in installs] == ["__gpu_host_common_install"]
    assert "__gpu_host_common_install is changed" in (
        tasks["Publish gpu_host_common_packages_changed"]["ansible.builtin.set_fact"]["gpu_host_common_packages_changed"])


def _include_targets():
    """(file, role, tasks_from) of every include_role/import_role with tasks_from in the project."""
    root = ROLES.parent
    paths = [*root.glob("*.yml"), *root.glob("playbooks/**/*.yml"), *root.glob("roles/*/tasks/*.yml"),
             *root.glob("molecule/*/*.yml")]
    for path in paths:
        try:
            plays = LOADER.load_from_file(str(path))
        except Exception:  # noqa: BLE001 - not every YAML file is a task list
            continue
        for item in plays if isinstance(plays, list) else []:
            if not isinstance(item, dict):
                continue
            for section in ("tasks", "pre_tasks", "post_tasks", "handlers"):
                for task in _walk(item.get(section)):
                    yield from _include(path, task)
            yield from _include(path, item)
            for task in _walk(item.get("block")):
                yield from _include(path, task)


def _include(path, task):
    for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
        target = task.get(key)
        if isinstance(target, dict) and "tasks_from" in target:
            yield path, target["name"], target["tasks_from"]


@pytest.mark.parametrize("role", sorted(p.name for p in ROLES.iterdir() if (p / "meta/argument_specs.yml").exists()))
def test_every_tasks_from_is_a_declared_entry_point(role):
    specs = LOADER.load_from_file(str(ROLES / role / "meta/argument_specs.yml"))["argument_specs"]
    used = {(str(p.relative_to(ROLES.parent)), Path(t).stem) for p, r, t in _include_targets() if r == role}
    assert all(entry in specs for _, entry in used), sorted(used)
    for _, entry in used:
        assert (ROLES / role / "tasks" / f"{entry}.yml").exists()


def test_the_shared_role_is_not_reached_by_file_or_container_name():
    """The GPU re-check finds containers by their device requests: no role names another's container."""
    for role in GPU_ROLES:
        for path in (ROLES / role).rglob("*.yml"):
            text = path.read_text(encoding="utf-8")
            assert "vllm" not in text, path
            assert "recheck_gpu.yml" not in text, path
