"""Behaviour of the GPU host roles on the testbed boxes (run by molecule after converge and again
after the upgrade converge in side_effect.yml, so version checks read the pin from the host)."""
import json
import re

import pytest

DRIVER_PACKAGES = ["nvidia-open", "nvidia-driver", "nvidia-kernel-open-dkms", "nvidia-smi",
                   "nvidia-persistenced", "libnvidia-ml1", "libcuda1"]
TOOLKIT_PACKAGES = ["nvidia-container-toolkit", "nvidia-container-toolkit-base",
                    "libnvidia-container-tools", "libnvidia-container1"]
STAND_IN_DRIVER_VERSIONS = {"580.95.05-1", "580.105.08-1"}
# converge pins 1.18.0-1 (molecule.yml), side_effect.yml upgrades to 1.18.2-1
STAND_IN_TOOLKIT_VERSIONS = {"1.18.0-1", "1.18.2-1"}
TOOLKIT_PREF = "/etc/apt/preferences.d/nvidia-container-toolkit.pref"


def pinned_version(host, pref):
    content = host.file(pref).content_string
    return re.search(r"^Pin: version (\S+)$", content, re.M).group(1)


def test_cuda_repository_is_deb822_with_signed_by_keyring(host):
    src = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources")
    assert src.exists
    codename = host.system_info.codename
    distro = {"bookworm": "debian12", "trixie": "debian13"}[codename]
    text = src.content_string
    assert f"URIs: http://10.231.0.2/compute/cuda/repos/{distro}/x86_64/" in text
    assert "Suites: /" in text
    assert "Signed-By: /etc/apt/keyrings/nvidia-cuda.asc" in text
    key = host.file("/etc/apt/keyrings/nvidia-cuda.asc")
    assert key.exists and key.mode == 0o644 and "BEGIN PGP PUBLIC KEY BLOCK" in key.content_string
    assert not host.file("/etc/apt/sources.list.d/cuda.list").exists


def test_toolkit_repository_is_deb822_with_arch_variable(host):
    text = host.file("/etc/apt/sources.list.d/nvidia-container-toolkit.sources").content_string
    assert "URIs: http://10.231.0.2/libnvidia-container/stable/deb/$(ARCH)/" in text
    assert "Signed-By: /etc/apt/keyrings/nvidia-container-toolkit.asc" in text


def test_apt_trusts_the_repositories(host):
    # apt policy lists a source only when its InRelease signature verified against signed-by.
    out = host.check_output("apt-cache policy nvidia-smi nvidia-container-toolkit")
    assert "http://10.231.0.2/compute/cuda/repos/" in out
    assert "http://10.231.0.2/libnvidia-container/stable/deb/amd64" in out


@pytest.mark.parametrize("name", DRIVER_PACKAGES)
def test_driver_package_installed_at_pin_and_held(host, name):
    pin = pinned_version(host, "/etc/apt/preferences.d/nvidia-driver.pref")
    assert pin in STAND_IN_DRIVER_VERSIONS
    pkg = host.package(name)
    assert pkg.is_installed and pkg.version == pin
    assert host.check_output(f"dpkg --get-selections {name}").split()[-1] == "hold"


@pytest.mark.parametrize("name", TOOLKIT_PACKAGES)
def test_toolkit_package_installed_at_pin_and_held(host, name):
    pin = pinned_version(host, TOOLKIT_PREF)
    assert pin in STAND_IN_TOOLKIT_VERSIONS
    assert host.package(name).version == pin
    assert host.check_output(f"dpkg --get-selections {name}").split()[-1] == "hold"


def test_apt_would_not_upgrade_the_driver(host):
    # Even with a newer version in the repository, the candidate is the pin.
    pin = pinned_version(host, "/etc/apt/preferences.d/nvidia-driver.pref")
    out = host.check_output("apt-cache policy nvidia-smi")
    assert re.search(r"Candidate: (\S+)", out).group(1) == pin
    sim = host.run("apt-get -s -o Debug::NoLocking=1 upgrade")
    assert sim.rc == 0
    assert not re.search(r"^Inst (nvidia|libnvidia|libcuda)", sim.stdout, re.M)


def test_unattended_upgrades_blacklist(host):
    dump = host.check_output("apt-config dump Unattended-Upgrade::Package-Blacklist")
    for name in ["nvidia-smi", "nvidia-open", "libnvidia-ml1", "nvidia-container-toolkit", "libnvidia-container1"]:
        assert f'"^{re.escape(name)}$"' in dump.replace("\\\\", "\\"), dump


def test_nouveau_blacklisted(host):
    conf = host.file("/etc/modprobe.d/nvidia-driver-blacklist-nouveau.conf").content_string
    assert re.search(r"^blacklist nouveau$", conf, re.M)
    assert re.search(r"^options nouveau modeset=0$", conf, re.M)


def test_persistenced_enabled_and_running(host):
    svc = host.service("nvidia-persistenced")
    assert svc.is_enabled and svc.is_running


def test_nvidia_smi_query_matches_contract(host):
    pin = pinned_version(host, "/etc/apt/preferences.d/nvidia-driver.pref").rsplit("-", 1)[0]
    out = host.check_output("nvidia-smi --query-gpu=index,name,memory.total,memory.reserved,compute_cap,"
                            "driver_version --format=csv,noheader,nounits")
    assert out.split(", ") == ["0", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "97887", "638", "12.0",
                               pin]


def test_daemon_json_keeps_admin_keys_and_has_nvidia_runtime(host):
    cfg = json.loads(host.file("/etc/docker/daemon.json").content_string)
    # the admin's keys (prepare.yml) survived
    assert cfg["debug"] is False
    assert cfg["features"] == {"buildkit": True}
    assert cfg["log-opts"]["labels"] == "admin-label"
    # the docker role's keys
    assert cfg["log-driver"] == "json-file"
    assert cfg["log-opts"]["max-size"] == "50m" and cfg["log-opts"]["max-file"] == "5"
    assert cfg["live-restore"] is True
    assert cfg["userland-proxy"] is False
    assert cfg["insecure-registries"] == ["10.231.0.3:5000"]
    # the toolkit role's key
    assert cfg["runtimes"]["nvidia"] == {"path": "nvidia-container-runtime", "args": []}
    backups = host.run("ls /etc/docker/ | grep -c '^daemon.json\\..*~$'")
    assert int(backups.stdout.strip() or 0) >= 1


def test_docker_started_once_and_restarted_once(host):
    # zz-gpudev-start-counter.conf (prepare.yml) appends a line per dockerd start: the first start with
    # the merged daemon.json + one restart for the nvidia runtime (converge, idempotence and check
    # mode add none), + one for the toolkit upgrade in side_effect.yml (none for the driver's).
    starts = host.file("/var/lib/gpudev-docker-starts").content_string.split()
    upgraded = pinned_version(host, TOOLKIT_PREF) == "1.18.2-1"
    assert len(starts) == (3 if upgraded else 2), starts


def test_docker_info_lists_nvidia_runtime(host):
    runtimes = json.loads(host.check_output("docker info --format '{{json .Runtimes}}'"))
    assert "nvidia" in runtimes
    assert runtimes["nvidia"]["path"] == "nvidia-container-runtime"


def test_python_docker_sdk_on_host(host):
    assert host.run("python3 -c 'import docker'").rc == 0


@pytest.fixture()
def tiny_image(host):
    """gpudev-tiny:1, a busybox-only image imported on the box (no registry here)."""
    if host.run("docker image inspect gpudev-tiny:1").rc != 0:
        build = host.run("set -e; d=$(mktemp -d); mkdir -p $d/bin; cp /bin/busybox $d/bin/busybox; "
                         "ln -s busybox $d/bin/sh; tar -C $d -c . | docker import - gpudev-tiny:1; rm -rf $d")
        assert build.rc == 0, build.stderr
    return "gpudev-tiny:1"


def test_docker_run_gpus_all_with_local_image(host, tiny_image):
    host.run("docker rm -f gpudev-gpu-probe")
    # --network none: nested Docker 26 (Debian 13) cannot set up bridge IPv6 inside this box; the GPU
    # path (device request -> nvidia-container-runtime-hook prestart) does not need a network.
    run = host.run("docker run --rm --network none --name gpudev-gpu-probe --gpus all gpudev-tiny:1 "
                   "/bin/busybox echo gpu-ok")
    assert run.rc == 0 and run.stdout.strip() == "gpu-ok", run.stderr
    run = host.run("docker run --rm --network none --runtime nvidia gpudev-tiny:1 /bin/busybox echo runtime-ok")
    assert run.rc == 0 and run.stdout.strip() == "runtime-ok", run.stderr


def test_gpu_container_sees_the_gpu_and_a_plain_one_does_not(host, tiny_image):
    # The toolkit's hook bind-mounts the driver's nvidia-smi into --gpus containers only.
    gpu = host.run("docker run --rm --network none --gpus all gpudev-tiny:1 nvidia-smi -L")
    assert gpu.rc == 0 and gpu.stdout.startswith("GPU 0: NVIDIA RTX PRO 6000 Blackwell"), gpu.stdout + gpu.stderr
    plain = host.run("docker run --rm --network none gpudev-tiny:1 nvidia-smi -L")
    assert plain.rc != 0 and "nvidia-smi" in plain.stderr, plain.stdout + plain.stderr
