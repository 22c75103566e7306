"""End-to-end checks of site.yml on the testbed box: the real vLLM CPU engine behind the real Caddy.

Traffic goes only to the testbed's own containers (docs/contracts.md): the box (10.231.0.10 on the LAN,
10.232.0.10 outside), the LAN client and the outside client. Every request loop is bounded.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai
import testinfra
from conftest import REPO, ansible_playbook, engine_container, json_callback_document

testinfra_hosts = ["ansible://teamserve-box"]

BOX_LAN = "10.231.0.10"
BOX_WAN = "10.232.0.10"
LAN_CLIENT = testinfra.get_host("docker://teamserve-lan-client")
WAN_CLIENT = testinfra.get_host("docker://teamserve-wan-client")


def gateway_url(testbed_vars: dict, address: str = BOX_LAN) -> str:
    return f"{'http' if testbed_vars['caddy_tls_mode'] == 'off' else 'https'}://{address}:{testbed_vars['caddy_listen_port']}"


def curl_status(client, url: str, key: str | None = None) -> str:
    """HTTP status seen from a client container ('000' when nothing answers within 5 s)."""
    header = f"-H 'Authorization: Bearer {key}'" if key else ""
    out = client.run(f"curl -sk -o /dev/null -w '%{{http_code}}' --max-time 5 {header} {url}")
    return out.stdout.strip()


def test_services_are_active(host):
    for unit in ("docker", "caddy", "nftables"):
        assert host.service(unit).is_running, unit
        assert host.service(unit).is_enabled, unit


def test_engine_runs_with_the_planned_argv(host, testbed_vars):
    """The container's argv is exactly what the capacity planner computes from the inventory and the GPU."""
    from teamserve_capacity import plan as planner_plan  # what the role's filter calls

    gpu_csv = host.check_output(
        "nvidia-smi --query-gpu=index,name,memory.total,memory.reserved,compute_cap,driver_version "
        "--format=csv,noheader,nounits"
    )
    index, name, memory, reserved, cc, driver = [f.strip() for f in gpu_csv.splitlines()[0].split(",")]
    gpus = [{"index": int(index), "name": name, "memory_total_mib": int(memory),
             "memory_reserved_mib": int(reserved), "compute_cap": cc, "driver_version": driver}]
    engine = dict(testbed_vars.get("vllm_engine", {}))
    engine.setdefault("vllm_version", "0.32.0")
    plan = planner_plan(testbed_vars["vllm_model"], testbed_vars["vllm_workload"], gpus, engine)
    container = engine_container(host)
    args = container["Config"]["Cmd"]  # the image's entrypoint is `vllm serve`; Cmd is the rendered argv
    assert container["Config"]["Entrypoint"] == ["vllm", "serve"]
    assert container["State"]["Running"]
    assert args[0] == testbed_vars["vllm_model"]["name"]
    for flag in ("max-model-len", "max-num-seqs", "gpu-memory-utilization"):
        position = args.index(f"--{flag}")
        assert args[position + 1] == str(plan["flags"][flag]), flag
    assert "--enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert args[args.index("--served-model-name") + 1] == testbed_vars["vllm_model"]["served_model_name"]


def test_engine_is_published_on_loopback_only(host):
    bindings = engine_container(host)["HostConfig"]["PortBindings"]["8000/tcp"]
    assert [b["HostIp"] for b in bindings] == ["127.0.0.1"]
    env = engine_container(host)["Config"]["Env"]
    assert "HF_HUB_OFFLINE=1" in env


def test_engine_answers_on_loopback_with_its_own_key_only(host, vault):
    assert host.check_output("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/models") == "401"
    status = host.check_output(
        "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' http://127.0.0.1:8000/v1/models",
        vault["vault_vllm_api_key"],
    )
    assert status == "200"


def test_lan_clients_go_through_the_front_which_refuses_missing_and_unknown_keys(testbed_vars, keys):
    """The box is behind the front gateway (teamserve-front, 10.231.0.30): its gateway port answers the
    front (and, by the testbed's explicit opt-in, the controller), never another LAN host, so nobody goes
    around the front's keys and limits; from that host the front answers, and refuses missing and unknown
    keys."""
    assert curl_status(LAN_CLIENT, gateway_url(testbed_vars) + "/v1/models", key=keys["alice"]) == "000"
    front = f"https://10.231.0.30:{testbed_vars['caddy_listen_port']}/v1/models"
    assert curl_status(LAN_CLIENT, front) == "401"
    assert curl_status(LAN_CLIENT, front, key="sk-ts-" + "0" * 48) == "401"
    assert curl_status(LAN_CLIENT, front, key=keys["alice"]) == "200"


def test_streamed_chat_through_the_gateway_with_the_openai_sdk(testbed_vars, keys, gateway_verify):
    client = openai.OpenAI(base_url=gateway_url(testbed_vars) + "/v1", api_key=keys["alice"],
                           http_client=httpx.Client(verify=gateway_verify), max_retries=0, timeout=60)
    arrivals = []
    stream = client.chat.completions.create(
        model=testbed_vars["vllm_model"]["served_model_name"],
        messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=32, stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    assert len(arrivals) >= 5, "tokens did not stream"
    assert arrivals[-1] - arrivals[0] > 0, "all tokens arrived in one buffered burst"


def test_rate_limit_is_per_user(testbed_vars, keys, gateway_verify):
    """Exhaust carol's small limit: she gets 429 with Retry-After and an OpenAI error; bob is unaffected."""
    url = gateway_url(testbed_vars) + "/v1/models"
    limit = next(u for u in testbed_vars["caddy_users"] if u["name"] == "carol")["rate_limit"]["events"]
    carol = {"Authorization": f"Bearer {keys['carol']}"}
    with httpx.Client(verify=gateway_verify, timeout=10) as http:
        statuses = [http.get(url, headers=carol).status_code for _ in range(limit + 1)]
        assert 429 in statuses, statuses
        refused = http.get(url, headers=carol)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert http.get(url, headers={"Authorization": f"Bearer {keys['bob']}"}).status_code == 200


def test_engine_port_unreachable_from_the_lan(testbed_vars):
    assert curl_status(LAN_CLIENT, f"http://{BOX_LAN}:8000/health") == "000"


def test_gateway_unreachable_from_outside(testbed_vars):
    assert curl_status(WAN_CLIENT, gateway_url(testbed_vars, BOX_WAN) + "/v1/models") == "000"
    assert curl_status(WAN_CLIENT, f"http://{BOX_WAN}:8000/health") == "000"


def test_cold_start_recorded(host):
    lines = host.file("/var/lib/teamserve/cold-start.jsonl").content_string.strip().splitlines()
    records = [json.loads(line) for line in lines]
    deploy = [r for r in records if r["trigger"] == "deploy"]
    restart = [r for r in records if r["trigger"] == "restart"]
    assert deploy and float(deploy[-1]["seconds_to_health"]) > 0
    assert restart and 0 < float(restart[-1]["seconds_to_health"]) < float(restart[-1]["seconds_to_first_token"])
    # The weights' floor: their bytes on the box over a bounded read of them, beside the load vLLM logged.
    floor = restart[-1]["weights_floor"]
    model_dir = "/var/lib/teamserve/vllm/huggingface/hub/models--teamserve--tiny-llama"
    on_disk = int(host.check_output(f"find -L {model_dir}/snapshots -name '*.safetensors' -printf '%s\\n'"
                                    " | awk '{s += $1} END {print s}'"))
    assert floor["bytes"] == on_disk > 0 and floor["read_bytes_per_second"] > 0
    assert floor["floor_seconds"] >= 0 and floor["load_seconds"] == restart[-1]["logged_durations"]["weights_loading"]


def test_site_yml_plans_the_engine_once_per_run():
    """vllm's `plan` entry point runs once per site.yml run (the preflight): the vllm role and the cold start
    read the published vllm_plan / vllm_argv. Counted in the log of every site.yml run of this scenario
    (ANSIBLE_LOG_PATH in molecule.yml; each run's lines carry its process id)."""
    log = pathlib.Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "ansible.log"
    runs: dict[str, list[str]] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = re.search(r" p=(\d+) ", line)
        if match:
            runs.setdefault(match.group(1), []).append(line)
    site_runs = [lines for lines in runs.values()
                 if any("PLAY [Preflight - check every input before anything on the host changes]" in x for x in lines)]
    assert site_runs, f"no site.yml run in {log}"
    counts = [sum("TASK [vllm : Compute the capacity plan]" in x for x in lines) for lines in site_runs]
    # 0 for a run that stopped in its preflight before planning (a bad input); never more than 1.
    assert max(counts) == 1 and set(counts) <= {0, 1}, counts


# Each setting that would open the box (or break the engine), as an admin might put it in the inventory,
# and words its refusal must contain: the field and, where one exists, the opt-in that would make the
# preflight accept it. The engine's settings and the cross-checks are refused only here through a real play; the gateway's paths
# and users (molecule/caddy) and the firewall's networks (tests/firewall) have their own tables, so one
# case of each stands for its role here, at about 6 s of play time per case.
OPENING_SETTINGS = {
    "engine-on-all-addresses": ({"vllm_bind_address": "0.0.0.0"}, ["vllm_bind_address", "vllm_allow_unsafe"]),
    "engine-dev-mode": ({"vllm_env": {"VLLM_SERVER_DEV_MODE": "1"}}, ["VLLM_SERVER_DEV_MODE", "vllm_allow_unsafe"]),
    "engine-runtime-lora": ({"vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}},
                            ["VLLM_ALLOW_RUNTIME_LORA_UPDATING", "vllm_allow_unsafe"]),
    "engine-remote-code": ({"vllm_flags": {"trust-remote-code": True}}, ["trust-remote-code", "vllm_allow_unsafe"]),
    "engine-logs-prompts": ({"vllm_flags": {"enable-log-requests": True}}, ["enable-log-requests", "vllm_allow_unsafe"]),
    # Extra engine args the engine would crash-loop on, or that would replace what the plan or the role sets.
    "engine-extra-serve": ({"vllm_extra_args": ["serve", "--enforce-eager"]}, ["vllm_extra_args", "'serve'"]),
    "engine-extra-host": ({"vllm_extra_args": ["--host", "0.0.0.0"]}, ["'--host'", "vllm_bind_address"]),
    "engine-extra-one-token": ({"vllm_extra_args": ["--max-num-seqs 4"]}, ["one token", "['--max-num-seqs', '4']"]),
    "engine-extra-alias": ({"vllm_extra_args": ["-tp", "2"]}, ["vllm_extra_args[0]", "'--tensor-parallel-size'"]),
    "gateway-proxies-everything": ({"caddy_proxied_paths": ["/*"]},
                                   ["caddy_proxied_paths", "caddy_allow_engine_admin_paths"]),
    "gateway-port-not-opened": ({"caddy_listen_port": 9443, "firewall_gateway_ports": [8443]},
                                ["caddy_listen_port=9443", "firewall_gateway_ports"]),
    "lan-as-two-halves": ({"firewall_lan_cidrs": ["0.0.0.0/1", "128.0.0.0/1"]},
                          ["firewall_lan_cidrs", "firewall_allow_any_lan"]),
    "extra-port-for-everyone": ({"firewall_extra_allowed_ports": [{"port": 9100, "sources": "everyone"}]},
                                ["firewall_extra_allowed_ports", "everyone"]),
    "extra-port-icmp": ({"firewall_extra_allowed_ports": [{"port": 9100, "protocol": "icmp"}]},
                        ["firewall_extra_allowed_ports", "icmp"]),
}


def box_state(host) -> dict:
    """What a run that changed anything would have changed: the live firewall table, the gateway's config
    and start time, the engine container and its start time."""
    engine = engine_container(host)
    return {"table": host.check_output("nft list table inet teamserve"),
            "caddyfile": host.file("/etc/caddy/Caddyfile").sha256sum,
            "caddy": host.check_output("systemctl show caddy -p ExecMainStartTimestampMonotonic"),
            "engine": (engine["Id"], engine["State"]["StartedAt"])}


def test_settings_that_would_open_the_box_are_refused_before_anything_changes(host, tmp_path):
    """One site.yml run, one inventory alias of the box per setting (forks run them side by side): each
    stops in the preflight with a message naming the field (and the opt-in), and the box is unchanged."""
    aliases = {f"refused-{name}": {"ansible_host": "teamserve-box", "ansible_connection": "community.docker.docker",
                                   **overrides} for name, (overrides, _) in OPENING_SETTINGS.items()}
    (tmp_path / "aliases.yml").write_text(json.dumps({"teamserve": {"hosts": aliases}}))
    before = box_state(host)
    run = ansible_playbook(REPO / "site.yml", stdout_callback="ansible.builtin.json", timeout=600,
                           args=("-i", str(tmp_path / "aliases.yml"), "--limit", "refused-*", "--forks", "8"))
    assert run.returncode != 0
    document = json_callback_document(run.stdout)
    refusals: dict[str, list[str]] = {}
    for play in document["plays"]:
        for task in play["tasks"]:
            for alias, result in task["hosts"].items():
                if result.get("failed"):
                    refusals.setdefault(alias, []).append(
                        f"{task['task']['name']}: {result.get('msg', '')} {result.get('argument_errors', '')}")
        assert play["play"]["name"].startswith("Preflight") or not any(
            task["hosts"] for task in play["tasks"]), f"{play['play']['name']} ran on a refused alias"
    missing = {name: words for name, (_, words) in OPENING_SETTINGS.items()
               if not all(word in " ".join(refusals.get(f"refused-{name}", [])) for word in words)}
    assert not missing, {name: refusals.get(f"refused-{name}") for name in missing}
    assert box_state(host) == before
