"""The vllm role's engine container on the testbed box: its spec, the weights it reads, the secrets it
must not show, and its lifecycle — a no-op re-run keeps the container, a process still holding the GPU is
named (the engine is left stopped), and a change through site.yml whose engine does not start drains the
gateway, downloads nothing and puts the last good engine back once the GPU memory is free.

The lifecycle tests re-run the vllm role alone, then site.yml, against the converged box (ansible-playbook
with the scenario's inventory) and run in file order. They cost one engine cold start (the restore of
converge's engine after a change the engine rejects at once). A change that serves goes through site.yml
in test_upgrade.py (the box put on vLLM 0.31.0, behind the front).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai
import pytest
import yaml
from conftest import (
    GATEWAY,
    GROUP_VARS,
    REPO,
    GatewayWatcher,
    ansible_playbook,
    json_callback_document,
    users_play,
    vault_view,
)

testinfra_hosts = ["ansible://teamserve-box"]

HUB = "http://10.231.0.4"
DATA_DIR = "/var/lib/teamserve/vllm"
LOCK = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/lock.yml").read_text())
HOLDERS = "/etc/teamserve-testbed/gpu-processes.csv"
PLAY = "- hosts: teamserve\n  gather_facts: false\n  roles:\n    - role: vllm\n"


def inspect(host, name: str = "vllm") -> dict:
    return json.loads(host.check_output(f"docker inspect {name}"))[0]


# A flag the plan does not set (planned flags are refused in vllm_flags), added to the inventory's own
# vllm_flags as an admin would (an extra var replaces the whole dict): changes the container's spec.
CHANGED_FLAG = {**(yaml.safe_load((GROUP_VARS / "main.yml").read_text()).get("vllm_flags") or {}),
                "uvicorn-log-level": "warning"}


def hub_stats() -> dict:
    with urllib.request.urlopen(f"{HUB}/_testbed/stats", timeout=5) as resp:
        return json.load(resp)


def run_role(tmp_path: pathlib.Path, extra_vars: dict | None = None, args: tuple[str, ...] = ()) -> tuple[int, dict]:
    """Run the vllm role on the box (`args`: more ansible-playbook options); returns (rc, {task name: the
    box's result}) from the json callback."""
    if not os.environ.get("MOLECULE_INVENTORY_FILE"):
        pytest.skip("needs molecule's inventory (run through `molecule verify -s default`)")
    (tmp_path / "play.yml").write_text(PLAY)
    run = ansible_playbook(tmp_path / "play.yml", extra_vars, stdout_callback="ansible.builtin.json", args=args)
    document = json_callback_document(run.stdout)
    results = {}
    for task in document["plays"][0]["tasks"]:  # names come as "vllm : <task name>"
        results[task["task"]["name"].split(" : ", 1)[-1]] = task["hosts"].get("teamserve-box", {})
    return run.returncode, results


# --- the container as converge left it -------------------------------------------------------------------
def test_engine_labels_mounts_and_shm(host, testbed_vars):
    c = inspect(host)
    labels = c["Config"]["Labels"]
    assert labels["io.teamserve.role"] == "vllm"
    assert labels["io.teamserve.served-model-name"] == testbed_vars["vllm_model"]["served_model_name"]
    assert labels["org.opencontainers.image.version"] == "0.32.0"
    assert labels["io.teamserve.image-tag"] == "v0.32.0"
    mounts = {m["Destination"]: m["Source"] for m in c["Mounts"]}
    assert mounts == {"/root/.cache/huggingface": f"{DATA_DIR}/huggingface", "/root/.cache/vllm": f"{DATA_DIR}/cache",
                      "/run/teamserve/engine-config.yaml": f"{DATA_DIR}/secrets/engine-config.yaml"}
    assert not next(m for m in c["Mounts"] if m["Destination"] == "/run/teamserve/engine-config.yaml")["RW"]
    assert c["HostConfig"]["ShmSize"] == 1024 ** 3  # vllm_shm_size: 1g, not Docker's 64 MiB
    assert c["HostConfig"]["CpuShares"] == 256  # vllm_cpu_shares: the box's other services first, not Docker's 1024
    assert c["HostConfig"]["LogConfig"] == {"Type": "json-file", "Config": {"max-file": "5", "max-size": "50m"}}


def test_nothing_published_on_all_interfaces(host):
    c = inspect(host)
    bindings = [b for port in c["HostConfig"]["PortBindings"].values() for b in port]
    assert bindings and all(b["HostIp"] == "127.0.0.1" for b in bindings)
    listening = host.check_output("ss -Htln")
    assert ":8000 " in listening and "0.0.0.0:8000" not in listening and "[::]:8000" not in listening


def test_only_root_and_the_gateway_account_reach_the_engine(host):
    """The engine answers /invocations without a key, so a listener on 127.0.0.1 would serve every local
    account: the firewall resets other accounts on the loopback port and on the container's address,
    and lets root (docker-proxy, the probes) and caddy (the gateway) through."""
    addr = engine_address(host)
    curl = "curl -s -m 5 -o /dev/null -w '%{http_code}'"
    for url in ("http://127.0.0.1:8000/health", f"http://{addr}:8000/health"):
        assert host.run(f"{curl} {url}").stdout == "200", url
        assert host.run(f"runuser -u caddy -- {curl} {url}").stdout == "200", url
        refused = host.run(f"runuser -u nobody -- {curl} {url}")
        assert refused.rc == 7 and refused.stdout == "000", (url, refused.rc)  # 7: connection refused


def engine_address(host) -> str:
    networks = inspect(host)["NetworkSettings"]["Networks"]
    assert list(networks) == ["teamserve-engine"], list(networks)  # alone on its own network, not the default bridge
    return networks["teamserve-engine"]["IPAddress"]


def test_other_containers_cannot_reach_the_engine(host):
    """A container on Docker's default bridge (where an admin's other containers land) cannot connect to
    the engine's address; one on the engine's own network can, so the probe itself works."""
    addr, image = engine_address(host), inspect(host)["Config"]["Image"]
    probe = (f"docker run --rm --network {{}} --entrypoint python3 {image} -c "
             f"\"import socket; socket.create_connection(('{addr}', 8000), timeout=3); print('connected')\"")
    assert host.run(probe.format("teamserve-engine")).stdout.strip() == "connected"
    other = host.run(probe.format("bridge"))
    assert other.rc != 0 and "connected" not in other.stdout, other.stdout


def test_engine_is_offline_on_the_pinned_revision(host, testbed_vars):
    c = inspect(host)
    env = dict(item.split("=", 1) for item in c["Config"]["Env"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/root/.cache/huggingface"
    assert not {"HF_TOKEN", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"} & set(env)
    args = c["Config"]["Cmd"]
    model = dict(testbed_vars["vllm_model"], revision=LOCK["vllm_model_revision"])  # pinned in the lock file
    assert args[0] == model["name"] == "teamserve/tiny-llama"
    assert args[args.index("--revision") + 1] == model["revision"]
    snapshot = f"{DATA_DIR}/huggingface/hub/models--teamserve--tiny-llama/snapshots/{model['revision']}"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert host.file(f"{snapshot}/{name}").exists, name
    # vLLM 0.32 (engine/arg_utils.py) logs how it resolved the repo id while offline: to that snapshot.
    log = host.check_output("docker logs vllm 2>&1 | grep -F 'HF_HUB_OFFLINE is True' || true")
    snapshot_path = f"/root/.cache/huggingface/hub/models--teamserve--tiny-llama/snapshots/{model['revision']}"
    assert f"replace model_id [teamserve/tiny-llama] to model_path [{snapshot_path}]" in log


def test_engine_key_is_nowhere_but_its_root_only_file(host, vault):
    """The engine reads its --api-key from a root-only config file (--config): not in the container's
    environment, argv or `docker inspect`, and vLLM logs it as ***."""
    key = vault["vault_vllm_api_key"]
    config = host.file(f"{DATA_DIR}/secrets/engine-config.yaml")
    assert config.user == "root" and config.mode == 0o600 and key in config.content_string
    assert key not in host.check_output("docker ps -aq | xargs -r docker inspect")
    assert key not in host.check_output("docker logs vllm 2>&1")
    assert not host.file(f"{DATA_DIR}/engine.env").exists
    args = inspect(host)["Config"]["Cmd"]
    assert args[args.index("--config") + 1] == "/run/teamserve/engine-config.yaml"


def test_hf_token_is_nowhere_but_its_root_only_file(host, vault):
    token = vault["vault_vllm_hf_token"]
    token_file = host.file(f"{DATA_DIR}/secrets/hf_token")
    assert token_file.user == "root" and token_file.mode == 0o600
    assert host.file(f"{DATA_DIR}/secrets").mode == 0o700
    everything = host.check_output("docker ps -aq | xargs -r docker inspect")
    assert token not in everything
    assert not any("hf_token" in bind for bind in inspect(host)["HostConfig"]["Binds"])  # the engine does not mount it
    assert token not in host.check_output("docker logs vllm 2>&1")
    assert token not in host.file(f"{DATA_DIR}/secrets/engine-config.yaml").content_string
    # The hub really needs it: without a token the repository does not exist.
    req = urllib.request.Request(f"{HUB}/api/models/teamserve/tiny-llama/tree/main")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 401


# --- lifecycle (re-runs the role) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def original(host, engine_as_converged) -> dict:
    c = inspect(host)
    engine_as_converged.setdefault("cmd", c["Config"]["Cmd"])
    return {"id": c["Id"], "cmd": c["Config"]["Cmd"]}


def test_noop_rerun_keeps_the_container_and_downloads_nothing(host, original, tmp_path):
    before = hub_stats()
    rc, results = run_role(tmp_path)
    assert rc == 0
    assert results["Run the engine container"].get("changed") is False
    assert results["Check whether the pinned snapshot is complete in the host's HF cache"]["complete"] is True
    assert inspect(host)["Id"] == original["id"]
    assert hub_stats().get("download", 0) == before.get("download", 0)


def test_a_driver_too_old_for_the_image_stops_the_play_before_the_engine_is_touched(host, original, tmp_path):
    """The stand-in nvidia-smi reports CUDA 12.8 (an R570 driver); the image needs 13.0 (its NVIDIA_REQUIRE_CUDA)."""
    gpu_env = "/etc/teamserve-testbed/gpu.env"
    host.check_output(f"mkdir -p {os.path.dirname(gpu_env)} && cp -a {gpu_env} {gpu_env}.bak 2>/dev/null; "
                      f"echo TESTBED_CUDA_VERSION=12.8 >> {gpu_env}")
    try:
        rc, results = run_role(tmp_path, {"vllm_flags": CHANGED_FLAG})
    finally:
        host.check_output(f"if [ -e {gpu_env}.bak ]; then mv {gpu_env}.bak {gpu_env}; else rm -f {gpu_env}; fi")
    assert rc != 0
    message = " ".join(results["Check the driver runs the image's CUDA (upgrade the driver or pin an older image "
                               "otherwise)"]["msg"].split())
    assert "needs CUDA >= 13.0 (NVIDIA_REQUIRE_CUDA=cuda>=13.0)" in message
    assert "supports CUDA 12.8 at most" in message and "upgrade the driver" in message
    assert "Find out whether the engine container's spec changes" not in results
    c = inspect(host)
    assert c["Id"] == original["id"] and c["State"]["Running"]


def test_a_process_holding_the_gpu_stops_the_new_engine_and_is_named(host, original, tmp_path):
    """A changed flag stops the old engine; a foreign GPU holder keeps the new one from starting."""
    host.check_output(f"mkdir -p {os.path.dirname(HOLDERS)} && echo '4242, /usr/bin/python3, 1024' > {HOLDERS}")
    try:
        rc, results = run_role(tmp_path, {"vllm_flags": CHANGED_FLAG, "vllm_gpu_release_timeout": 4})
    finally:
        host.check_output(f"rm -f {HOLDERS}")
    assert rc != 0
    assert results["Stop the old engine so it releases the GPU before the new one starts"]["changed"]
    message = results["Name the processes that still hold GPU memory"]["msg"]
    assert "pid 4242 (/usr/bin/python3, 1024 MiB)" in message and "The new engine was not started" in message
    c = inspect(host)
    assert c["Id"] == original["id"] and not c["State"]["Running"]  # stopped, not replaced


# Passes the preflight (--max-logprobs is an option of vllm serve and takes a value; the snapshot records no
# types) but not vLLM's parser: the engine exits at start with argparse's error, and Docker restarts it.
BREAKING_ARGS = ["--max-logprobs", "many"]


def spec(container: dict) -> dict:
    """What the admin configured of an engine container (not its id or start time)."""
    return {"image": container["Config"]["Image"], "cmd": container["Config"]["Cmd"],
            "env": sorted(container["Config"]["Env"]), "labels": container["Config"]["Labels"],
            "ports": container["HostConfig"]["PortBindings"], "binds": sorted(container["HostConfig"]["Binds"])}


def test_an_engine_change_that_does_not_serve_puts_the_last_good_engine_back(host, testbed_vars, keys, vault,
                                                                           gateway_verify):
    """An admin changes a flag and adds an extra arg the engine rejects at start, and re-runs site.yml while
    the engine is down (the test above left it stopped, as a crash would), at -vvv as an admin debugging it
    would. The play fails with vLLM's own reason and the last good engine (converge's, kept on the box)
    runs again with the same spec and serves through the gateway. Users got the stopped engine's 502
    engine_unavailable until site.yml took over, then 503 maintenance with Retry-After (and /health 503)
    until the engine served again, never a bare 502; nothing was downloaded; neither the engine's key nor
    a user's appears in the output.
    Before it, users.yml issues erin a key into the inventory's own key file: the key survives site.yml
    (the gateway reopened from the inventory), users.yml's list shows it without the key, and lint ignores
    the file."""
    keys_file = GROUP_VARS / "caddy_keys.vault.yml"
    users = testbed_vars["caddy_users"] + [{"name": "erin", "rate_limit": {"events": 10, "window": "1m"}}]
    users_play("issue", "erin", keys_file, users)
    erin = vault_view(keys_file)["caddy_user_keys"]["erin"]
    try:
        good = inspect(host)
        last_good = host.file(f"{DATA_DIR}/last-good-engine.json")
        assert last_good.mode == 0o600 and last_good.user == "root"
        kept = json.loads(last_good.content_string)
        assert kept["command"] == good["Config"]["Cmd"]
        assert not good["State"]["Running"]
        downloads = hub_stats().get("download", 0)
        watcher = GatewayWatcher(keys["bob"])
        watcher.start()
        started = time.monotonic()
        run = ansible_playbook(REPO / "site.yml", {"vllm_flags": CHANGED_FLAG, "vllm_extra_args": BREAKING_ARGS,
                                                   "vllm_cold_start_measure": "never", "caddy_users": users},
                               verbosity=3)
        took = time.monotonic() - started
        time.sleep(2)
        seen = watcher.stop()
        assert run.returncode != 0
        output = " ".join(run.stdout.split())
        assert "vllm serve: error: argument --max-logprobs: invalid int value: 'many'" in output, run.stdout[-3000:]
        assert "The last good engine was put back and serves again" in output
        assert "ESTABLISH" in run.stdout + run.stderr  # really -vvv (the connection plugin reports at verbosity 3)
        leaked = [name for name, secret in [("vllm_api_key", vault["vault_vllm_api_key"]), *keys.items(),
                                            ("erin", erin)] if secret in run.stdout + run.stderr]
        assert not leaked, f"in site.yml's -vvv output: {leaked}"
        restored = inspect(host)
        assert restored["Id"] != good["Id"] and restored["State"]["Running"]
        assert spec(restored) == spec(good)
        assert json.loads(host.file(f"{DATA_DIR}/last-good-engine.json").content_string) == kept
        assert hub_stats().get("download", 0) == downloads  # recreating downloads nothing
        first = next((i for i, s in enumerate(seen) if s[:2] == (503, "maintenance")), None)
        assert first is not None, seen
        # Before it: the stopped engine's 502 engine_unavailable; from it on: maintenance, then served.
        assert {s[:2] for s in seen[:first]} <= {(502, "engine_unavailable")}, seen[:first]
        after = seen[first:]
        assert not [s for s in after if s[0] in (0, 502)], after
        assert all(int(s[2]) > 0 for s in after if s[0] == 503), after
        assert (503, seen[first][2]) in watcher.health, watcher.health  # /health told a balancer too
        assert after[-1][0] == 200, after[-10:]
        for key in (keys["bob"], erin):  # erin's key, issued by users.yml, survived site.yml's gateway
            client = openai.OpenAI(base_url=GATEWAY + "/v1", api_key=key, max_retries=0, timeout=60,
                                   http_client=httpx.Client(verify=gateway_verify))
            reply = client.chat.completions.create(
                model=restored["Config"]["Labels"]["io.teamserve.served-model-name"],
                messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
            assert reply.choices[0].message.content
        print(f"failed change and restore through site.yml: {took:.0f} s")

        listed = ansible_playbook(REPO / "playbooks" / "users.yml", {"caddy_users_action": "list", "caddy_users": users})
        assert listed.returncode == 0, listed.stdout[-3000:]
        # Caps as numbers, from the plan the box records: erin has none of her own (the plan's share),
        # alice has her own 8.
        share = max(1, int(restored["Config"]["Cmd"][restored["Config"]["Cmd"].index("--max-num-seqs") + 1]) // 4)
        assert re.search(rf"erin +key: yes; expires: never; rate: 10/1m; in flight: {share} sequences; lane: interactive",
                         listed.stdout), listed.stdout[-3000:]
        assert re.search(r"alice +key: yes; .*; in flight: 8 sequences; lane: interactive", listed.stdout)
        assert "unknown" not in listed.stdout and "per-user share" not in listed.stdout
        assert not [name for name, key in {**keys, "erin": erin}.items() if key in listed.stdout + listed.stderr]
        lint = subprocess.run([str(REPO / ".venv/bin/yamllint"), "--strict", "inventories/testbed"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert lint.returncode == 0, lint.stdout
    finally:
        users_play("revoke", "erin", keys_file, users)
    assert vault_view(keys_file)["caddy_user_keys"] == keys


# --- a model without a chat template ---------------------------------------------------------------------
NOCHAT = "teamserve/tiny-llama-nochat"


@pytest.fixture
def nochat(host, testbed_vars) -> Iterator[dict]:
    """The tiny model as a base model ships, without a chat template: a copy of its snapshot in the box's HF
    cache under another repository name, chat_template.jinja gone from the files and the tree listing (a
    complete snapshot, so nothing is downloaded). Returns the vllm_model profile; the copy is removed after."""
    rev = LOCK["vllm_model_revision"]
    hub = f"{DATA_DIR}/huggingface/hub"
    copy = f"{hub}/models--{NOCHAT.replace('/', '--')}"
    host.check_output(f"cp -a {hub}/models--teamserve--tiny-llama {copy} && rm {copy}/snapshots/{rev}/chat_template.jinja")
    tree = json.loads(host.file(f"{copy}/trees/{rev}.json").content_string)
    del tree["files"]["chat_template.jinja"]
    host.check_output(f"printf %s {shlex.quote(json.dumps(tree))} > {copy}/trees/{rev}.json")
    assert "chat_template" not in json.loads(host.file(f"{copy}/snapshots/{rev}/tokenizer_config.json").content_string)
    try:
        yield {**testbed_vars["vllm_model"], "name": NOCHAT, "revision": rev}
    finally:
        host.check_output(f"rm -rf {copy}")


def test_a_model_without_a_chat_template_is_refused_before_the_engine_changes(host, nochat, tmp_path):
    """vLLM would start it and answer every chat request with 400; the plan stops it, naming the fix."""
    before = inspect(host)
    rc, results = run_role(tmp_path, {"vllm_model": nochat})
    assert rc != 0
    message = " ".join(results["Refuse a model without a chat template"]["msg"].split())
    assert f"vllm_model {NOCHAT} at {LOCK['vllm_model_revision']} has no chat template" in message, message
    assert "Set vllm_chat_template to a Jinja template file" in message
    assert "Find out whether the engine container's spec changes" not in results
    after = inspect(host)
    assert after["Id"] == before["Id"] and after["State"]["StartedAt"] == before["State"]["StartedAt"]


def test_a_model_declared_completions_only_passes_and_is_probed_with_completions(host, nochat, tmp_path):
    """The same model without a template, declared completions-only: the preflight lets it through and
    the published endpoint every probe uses (readiness, cold start, upgrade smoke, verify) is
    /v1/completions; check mode, so the running engine is untouched."""
    before = inspect(host)
    rc, results = run_role(tmp_path, {"vllm_model": nochat, "vllm_completions_only": True}, args=("--check",))
    assert rc == 0, {name: r.get("msg") for name, r in results.items() if r.get("failed")}
    assert not results["Refuse a model without a chat template"].get("failed")
    facts = results["Publish where the engine answers on the box (its loopback port)"]["ansible_facts"]
    assert facts["vllm_api_endpoint"] == "/v1/completions"
    assert "--chat-template" not in results["Render the engine's argv and check every flag against vLLM 0.32.0"][
        "ansible_facts"]["vllm_argv"]
    assert inspect(host)["Id"] == before["Id"]


def test_a_chat_template_file_is_mounted_and_passed_to_the_engine(host, nochat, tmp_path):
    """With vllm_chat_template the same model passes; check mode shows the engine it would run: the file
    copied under its content's hash, mounted read-only and named by --chat-template (a new template, a
    new mount: the last good engine keeps the file it started with)."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    before = inspect(host)
    rc, results = run_role(tmp_path, {"vllm_model": nochat, "vllm_chat_template": str(template)}, args=("--check",))
    assert rc == 0, {name: r.get("msg") for name, r in results.items() if r.get("failed")}
    copied = f"{DATA_DIR}/chat-templates/{hashlib.sha256(template.read_bytes()).hexdigest()}.jinja"
    assert results["Copy the chat template to the box"]["changed"]
    argv = results["Render the engine's argv and check every flag against vLLM 0.32.0"]["ansible_facts"]["vllm_argv"]
    assert argv[argv.index("--chat-template") + 1] == "/run/teamserve/chat-template.jinja"
    assert argv[0] == NOCHAT
    volumes = results["Describe the engine container the plan asks for"]["ansible_facts"]["__vllm_spec"]["volumes"]
    assert f"{copied}:/run/teamserve/chat-template.jinja:ro" in volumes
    assert results["Run the engine container (dry run)"]["changed"]
    assert inspect(host)["Id"] == before["Id"]
    assert not host.file(copied).exists  # check mode
