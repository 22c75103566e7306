"""The monitoring role's rendered configuration, checked by the real tools of the pinned Debian packages
(promtool, amtool, mtail; `make unit` unpacks them into $MONITORING_TOOLS): the alert rules rendered from a
real capacity plan pass `promtool check rules` and fire as designed under `promtool test rules`; the
Prometheus and Alertmanager configurations pass their checkers; the textfile metrics parse; the mtail
program counts the gateway's access log per user and refusal kind."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from repo_modules import REPO, example_profile_plans, run_cases

TOOLS = pathlib.Path(os.environ.get("MONITORING_TOOLS", REPO / ".cache" / "monitoring-tools")) / "bin"
ROLE = REPO / "roles" / "monitoring"
TTFT_TARGET = 1.0  # seconds (the vllm role's default workload target)
TPOT_TARGET = 0.05
READY_TIMEOUT = 900  # seconds: vllm_ready_timeout, the engine-down delay
COLD_STARTS = [  # vllm_cold_start_records as the vllm role publishes them (seconds to /health)
    {"trigger": "deploy", "seconds_to_health": 80.0},
    {"trigger": "restart", "seconds_to_health": 40.0},
    {"trigger": "restart", "seconds_to_health": 100.0},
]

RENDER = """
- name: Render the monitoring role's templates
  hosts: all
  gather_facts: false
  vars_files:
    - {role}/vars/main.yml
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{role}/templates/{{{{ item.src }}}}"
        dest: "{{{{ out_dir }}}}/{{{{ inventory_hostname }}}}.{{{{ item.dest }}}}"
        mode: "0600"
      loop:
        - {{src: teamserve.rules.yml.j2, dest: rules.yml}}
        - {{src: prometheus.yml.j2, dest: prometheus.yml}}
        - {{src: alertmanager.yml.j2, dest: alertmanager.yml}}
        - {{src: teamserve.prom.j2, dest: prom}}
    - name: Mark the case done
      ansible.builtin.copy:
        content: ok
        dest: "{{{{ out_dir }}}}/{{{{ inventory_hostname }}}}.txt"
        mode: "0600"
"""


def tool(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run one of the unpacked Debian tools; returns the completed process (not checked)."""
    path = TOOLS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make unit` (it unpacks the pinned Debian packages there)")
    return subprocess.run([str(path), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def plan() -> dict:
    """The capacity plan of the example inventory's default profile (a 96 GB card), as the vllm role makes it."""
    return example_profile_plans()["llama-3.1-8b-bf16"]


@pytest.fixture(scope="module")
def rendered(plan, tmp_path_factory) -> dict[str, pathlib.Path]:
    """The role's four templates rendered for one box by ansible-playbook, by file kind."""
    box = {
        "vllm_plan": plan, "vllm_engine_url": "http://127.0.0.1:8000",
        "caddy_metrics_url": "http://127.0.0.1:2020/metrics", "caddy_access_log_path": "/var/log/caddy/access.log",
        "vllm_workload": {"ttft_p95_seconds": TTFT_TARGET, "tpot_seconds": TPOT_TARGET},
        "vllm_ready_timeout": READY_TIMEOUT, "vllm_cold_start_regression_margin": 1.0,
        "vllm_cold_start_records": COLD_STARTS, "monitoring_dcgm_exporter_enabled": True,
        "monitoring_alertmanager_receivers": [
            {"name": "team-chat", "webhook_url": "https://chat.example.org/hooks/teamserve"},
            {"name": "admin", "email_to": "admin@example.org", "send_resolved": False}],
        "monitoring_alertmanager_smtp": {"smarthost": "mail.example.org:587", "from": "teamserve@example.org",
                                         "auth_username": "teamserve", "auth_password": "not-a-real-password"},
    }
    return render(tmp_path_factory.mktemp("monitoring"), "box", box)


def render(tmp: pathlib.Path, name: str, host_vars: dict) -> dict[str, pathlib.Path]:
    """The role's four templates rendered by ansible-playbook for one host `name` with `host_vars` over the
    role's defaults (as host variables: play vars_files would override them), by file kind."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    run_cases(tmp, {name: {**defaults, **host_vars}}, RENDER.format(role=ROLE))
    return {kind: tmp / f"{name}.{kind}" for kind in ("rules.yml", "prometheus.yml", "alertmanager.yml", "prom")}


def test_promtool_and_amtool_accept_the_rendered_files(rendered, tmp_path):
    rules = tool("promtool", "check", "rules", str(rendered["rules.yml"]))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    # The config names the rules file at its place on the box; check it against the rendered copy.
    config = yaml.safe_load(rendered["prometheus.yml"].read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/teamserve.rules.yml"]
    config["rule_files"] = [str(rendered["rules.yml"])]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = tool("promtool", "check", "config", str(tmp_path / "prometheus.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    alertmanager = tool("amtool", "check-config", str(rendered["alertmanager.yml"]))
    assert alertmanager.returncode == 0, alertmanager.stdout + alertmanager.stderr
    metrics = tool("promtool", "check", "metrics", stdin=rendered["prom"].read_text())
    assert metrics.returncode == 0, metrics.stdout + metrics.stderr


def test_prometheus_scrapes_only_loopback_targets(rendered):
    config = yaml.safe_load(rendered["prometheus.yml"].read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in config["scrape_configs"]}
    assert targets == {"prometheus": "127.0.0.1:9090", "alertmanager": "127.0.0.1:9093", "node": "127.0.0.1:9100",
                       "mtail": "127.0.0.1:3903", "vllm": "127.0.0.1:8000", "caddy": "127.0.0.1:2020",
                       "dcgm": "127.0.0.1:9400"}
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]


def test_alertmanager_sends_to_every_receiver(rendered):
    config = yaml.safe_load(rendered["alertmanager.yml"].read_text())
    (receiver,) = config["receivers"]
    assert config["route"]["receiver"] == receiver["name"]
    assert [w["url"] for w in receiver["webhook_configs"]] == ["https://chat.example.org/hooks/teamserve"]
    assert [(m["to"], m["send_resolved"]) for m in receiver["email_configs"]] == [("admin@example.org", False)]
    assert config["global"]["smtp_smarthost"] == "mail.example.org:587"


def _rules(rendered) -> dict[str, dict]:
    groups = yaml.safe_load(rendered["rules.yml"].read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule for group in groups for rule in group["rules"]}


def test_thresholds_are_the_plans_and_the_targets(rendered, plan):
    rules = _rules(rendered)
    creep = math.ceil(plan["numbers"]["avg_context_tokens"] * 1.5)
    assert rules["TeamserveContextCreep"]["expr"] == f"teamserve:vllm_prompt_tokens:mean > {creep}"
    assert rules["TeamserveTTFTAboveTarget"]["expr"].endswith(f"> {TTFT_TARGET}")
    assert rules["TeamserveTPOTAboveTarget"]["expr"].endswith(f"> {TPOT_TARGET}")
    assert rules["TeamserveEngineDown"]["for"] == f"{READY_TIMEOUT}s"
    assert str(plan["flags"]["max-num-seqs"]) in rules["TeamserveRequestsQueued"]["annotations"]["summary"]
    for name, rule in rules.items():
        if "alert" in rule:
            assert rule["annotations"]["runbook"].strip(), f"{name} has no runbook line"


def test_textfile_metrics_carry_the_plan_and_the_cold_starts(rendered, plan):
    samples = dict(line.rsplit(" ", 1) for line in rendered["prom"].read_text().splitlines()
                   if line and not line.startswith("#"))
    assert float(samples["teamserve_plan_avg_context_tokens"]) == plan["numbers"]["avg_context_tokens"]
    assert float(samples["teamserve_plan_max_num_seqs"]) == plan["flags"]["max-num-seqs"]
    assert float(samples["teamserve_target_ttft_p95_seconds"]) == TTFT_TARGET
    assert float(samples['teamserve_engine_cold_start_seconds{trigger="restart"}']) == 100.0
    assert float(samples['teamserve_engine_cold_start_previous_seconds{trigger="restart"}']) == 40.0
    assert float(samples['teamserve_engine_cold_start_seconds{trigger="deploy"}']) == 80.0
    assert 'teamserve_engine_cold_start_previous_seconds{trigger="deploy"}' not in samples


def _alert(name: str, at: str, labels: dict | None = None) -> dict:
    return {"eval_time": at, "alertname": name,
            "exp_alerts": [{"exp_labels": {"alertname": name, **(labels or {})}}] if labels is not None else []}


def test_alerts_fire_as_designed(rendered, plan, tmp_path):
    """promtool test rules on the rendered rules (annotations dropped: promtool compares them verbatim, and
    `promtool check rules` above already parses their templates)."""
    groups = yaml.safe_load(rendered["rules.yml"].read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    creep = math.ceil(plan["numbers"]["avg_context_tokens"] * 1.5)
    vllm = '{job="vllm"}'
    cases = [
        {   # 10 requests a minute, mean prompt 100 tokens above the threshold: fires once held 15 min.
            "interval": "1m",
            "input_series": [
                {"series": f"vllm:request_prompt_tokens_sum{vllm}", "values": f"0+{10 * (creep + 100)}x120"},
                {"series": f"vllm:request_prompt_tokens_count{vllm}", "values": "0+10x120"},
                {"series": f"vllm:num_requests_waiting{vllm}", "values": "3x10 0 3x20"},
                {"series": f"vllm:kv_cache_usage_perc{vllm}", "values": "0.95x30"},
                {"series": 'up{job="vllm"}', "values": "0x30"},
                {"series": 'up{job="caddy"}', "values": "1x30"},
            ],
            "alert_rule_test": [
                _alert("TeamserveContextCreep", "70m", {"severity": "ticket"}),
                _alert("TeamserveRequestsQueued", "8m", {"severity": "page", "job": "vllm"}),
                _alert("TeamserveRequestsQueued", "14m"),  # the queue emptied at 11m: the clock restarted
                _alert("TeamserveKVCacheNearlyFull", "12m", {"severity": "ticket"}),
                _alert("TeamserveEngineDown", "14m"),  # within the cold-start budget: no page
                _alert("TeamserveEngineDown", "16m", {"severity": "page", "job": "vllm"}),
                _alert("TeamserveGatewayDown", "20m"),
            ],
        },
        {   # A restart 75 % slower than the one before, within the +100 % margin: no alert.
        "interval": "1m",
        "input_series": [
            {"series": 'teamserve_engine_cold_start_seconds{trigger="restart"}', "values": "70x30"},
            {"series": 'teamserve_engine_cold_start_previous_seconds{trigger="restart"}', "values": "40x30"},
        ],
        "alert_rule_test": [_alert("TeamserveColdStartRegression", "5m")],
    },
    {   # Mean prompt 100 tokens below the threshold: never fires.
            "interval": "1m",
            "input_series": [
                {"series": f"vllm:request_prompt_tokens_sum{vllm}", "values": f"0+{10 * (creep - 100)}x120"},
                {"series": f"vllm:request_prompt_tokens_count{vllm}", "values": "0+10x120"},
            ],
            "alert_rule_test": [_alert("TeamserveContextCreep", "110m")],
        },
        {   # Every first token took 0.1-10 s (p95 about 9.5 s): above the 1 s target, for 10 min.
            "interval": "1m",
            "input_series": [
                {"series": 'vllm:time_to_first_token_seconds_bucket{job="vllm",le="0.1"}', "values": "0x30"},
                {"series": 'vllm:time_to_first_token_seconds_bucket{job="vllm",le="10"}', "values": "0+10x30"},
                {"series": 'vllm:time_to_first_token_seconds_bucket{job="vllm",le="+Inf"}', "values": "0+10x30"},
            ],
            "alert_rule_test": [_alert("TeamserveTTFTAboveTarget", "9m"),
                                _alert("TeamserveTTFTAboveTarget", "20m", {"severity": "page"})],
        },
        {   # bob: 30 requests in 15 min, 20 refused (concurrency); alice: 30, none refused. Then cold starts.
            "interval": "1m",
            "input_series": [
                {"series": 'teamserve_gateway_requests_total{user="bob",code="429"}', "values": "0+1.333x30"},
                {"series": 'teamserve_gateway_requests_total{user="bob",code="200"}', "values": "0+0.667x30"},
                {"series": 'teamserve_gateway_refusals_total{user="bob",kind="concurrency_limit_exceeded"}',
                 "values": "0+1.333x30"},
                {"series": 'teamserve_gateway_requests_total{user="alice",code="200"}', "values": "0+2x30"},
                {"series": 'teamserve_engine_cold_start_seconds{trigger="restart"}', "values": "100x30"},
                {"series": 'teamserve_engine_cold_start_previous_seconds{trigger="restart"}', "values": "40x30"},
                {"series": 'teamserve_engine_cold_start_seconds{trigger="deploy"}', "values": "80x30"},
            ],
            "alert_rule_test": [
                _alert("TeamserveUserRefused", "20m", {"severity": "ticket", "user": "bob"}),
                _alert("TeamserveColdStartRegression", "5m",
                       {"severity": "ticket", "trigger": "restart"}),
                _alert("TeamserveServerFull", "20m"),
            ],
        },
        {   # carol: a burst of 25 requests, all refused, between two scrapes at minute 10, then nothing; erin
            # 5 requests answered server_full at the same time. The series are born at their counts, so
            # increase() or rate() alone read 0; born in the window they count whole, and once the window
            # (15 min) has passed their birth, only what they grew counts again.
            "interval": "1m",
            "input_series": [
                {"series": 'teamserve_gateway_requests_total{user="carol",code="429"}', "values": "_x9 25x40"},
                {"series": 'teamserve_gateway_refusals_total{user="carol",kind="rate_limit_exceeded"}',
                 "values": "_x9 25x40"},
                {"series": 'teamserve_gateway_requests_total{user="erin",code="503"}', "values": "_x9 5x40"},
                {"series": 'teamserve_gateway_refusals_total{user="erin",kind="server_full"}', "values": "_x9 5x40"},
                {"series": 'teamserve_gateway_requests_total{user="dana",code="200"}', "values": "0+1x40"},
            ],
            "alert_rule_test": [
                _alert("TeamserveUserRefused", "8m"),
                _alert("TeamserveUserRefused", "12m", {"severity": "ticket", "user": "carol"}),
                _alert("TeamserveUserRefused", "35m"),
                _alert("TeamserveServerFull", "8m"),
                _alert("TeamserveServerFull", "12m", {"severity": "ticket"}),
                _alert("TeamserveServerFull", "35m"),
            ],
        },
    ]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": cases}))
    result = tool("promtool", "test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


FRONT_BOXES = [{"name": "teamserve-box", "url": "https://10.0.0.10:8443", "max_inflight": 8},
               {"name": "teamserve-box-b", "url": "https://10.0.0.11:8443", "max_inflight": 4}]


@pytest.fixture(scope="module")
def rendered_front(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The role's templates rendered for a front gateway (no engine, no plan): its boxes as front.yml passes them."""
    front = {"caddy_metrics_url": "http://127.0.0.1:2020/metrics", "caddy_access_log_path": "/var/log/caddy/access.log",
             "monitoring_dcgm_exporter_enabled": False, "monitoring_front": True, "monitoring_front_boxes": FRONT_BOXES}
    return render(tmp_path_factory.mktemp("monitoring-front"), "front", front)


def test_a_front_watches_its_gateway_and_boxes_not_an_engine(rendered_front, tmp_path):
    rules = tool("promtool", "check", "rules", str(rendered_front["rules.yml"]))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = yaml.safe_load(rendered_front["prometheus.yml"].read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == {"prometheus", "alertmanager", "node", "mtail", "caddy"}
    config["rule_files"] = [str(rendered_front["rules.yml"])]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = tool("promtool", "check", "config", str(tmp_path / "prometheus.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    metrics = tool("promtool", "check", "metrics", stdin=rendered_front["prom"].read_text())
    assert metrics.returncode == 0, metrics.stdout + metrics.stderr
    text = rendered_front["prom"].read_text()
    assert 'teamserve_front_box_info{box="teamserve-box",upstream="10.0.0.10:8443"} 1' in text
    assert 'teamserve_front_box_max_inflight{box="teamserve-box-b"} 4' in text
    assert "teamserve_plan_" not in text
    alerts = {name for name, rule in _rules(rendered_front).items() if "alert" in rule}
    assert alerts == {"TeamserveGatewayDown", "TeamserveMonitoringTargetDown", "TeamserveServerFull",
                      "TeamserveUserRefused", "TeamserveBoxUnhealthy"}
    assert not [r for r in _rules(rendered_front).values() if "vllm" in r["expr"]]


def test_a_box_failing_the_fronts_health_checks_pages_after_a_cold_starts_budget(rendered_front, tmp_path):
    groups = yaml.safe_load(rendered_front["rules.yml"].read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    info = "teamserve_front_box_info{{box=\"{}\",upstream=\"{}\"}}"
    cases = [{
        "interval": "1m",
        "input_series": [  # box-b fails from minute 5 on; the box stays healthy; a drain of 3 min at minute 40
            {"series": 'caddy_reverse_proxy_upstreams_healthy{upstream="10.0.0.10:8443"}', "values": "1x39 0x3 1x20"},
            {"series": 'caddy_reverse_proxy_upstreams_healthy{upstream="10.0.0.11:8443"}', "values": "1x4 0x60"},
            {"series": info.format("teamserve-box", "10.0.0.10:8443"), "values": "1x65"},
            {"series": info.format("teamserve-box-b", "10.0.0.11:8443"), "values": "1x65"},
            # The same textfile under a second instance (Debian's default config until the role's replaces it).
            {"series": info.format("teamserve-box-b", "10.0.0.11:8443")[:-1] + ',instance="localhost:9100"}',
             "values": "1x65"},
        ],
        "alert_rule_test": [
            _alert("TeamserveBoxUnhealthy", "15m"),  # within the cold-start budget (900 s): no page
            _alert("TeamserveBoxUnhealthy", "21m", {"severity": "page", "box": "teamserve-box-b",
                                                    "upstream": "10.0.0.11:8443"}),
            _alert("TeamserveBoxUnhealthy", "43m", {"severity": "page", "box": "teamserve-box-b",
                                                    "upstream": "10.0.0.11:8443"}),  # a drain does not page
        ],
    }]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": cases}))
    result = tool("promtool", "test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


ACCESS_LOG = [
    {"status": 200, "user": "alice", "duration": 0.53, "size": 2048, "prompt_tokens": 31, "completion_tokens": 7},
    {"status": 200, "user": "alice", "duration": 12.5, "size": 9000, "prompt_tokens": 1200, "completion_tokens": 0},
    {"status": 200, "user": "bob", "duration": 0.1, "size": 300, "prompt_tokens": 5, "completion_tokens": 2},
    {"status": 429, "user": "alice", "duration": 0.0001, "size": 180, "refused": "concurrency_limit_exceeded"},
    {"status": 429, "user": "bob", "duration": 0.0002, "size": 190, "refused": "rate_limit_exceeded"},
    {"status": 503, "user": "bob", "duration": 0.0003, "size": 200, "refused": "server_full"},
    {"status": 401, "duration": 1.2e-05, "size": 150, "refused": "invalid_api_key"},
]


def test_mtail_counts_the_access_log_per_user_refusal_kind_and_tokens(tmp_path):
    lines = []
    for n, entry in enumerate(ACCESS_LOG):
        # Caddy's JSON access log entry; a request URI that mimics the fields must not be counted.
        record = {"level": "info", "ts": 1764686400 + n, "logger": "http.log.access.log0", "msg": "handled request",
                  "request": {"method": "POST",
                              "uri": '/v1/chat/completions?q="user":"mallory","status":500,"prompt_tokens":99999',
                              "headers": {"User-Agent": ["OpenAI/Python 1.99"]}},
                  "bytes_read": 120, "user_id": "", **{k: v for k, v in entry.items() if k in ("duration", "size", "status")},
                  "resp_headers": {"Content-Type": ["application/json"]}}
        record.update({k: entry[k] for k in ("user", "refused", "prompt_tokens", "completion_tokens") if k in entry})
        lines.append(json.dumps(record, separators=(",", ":")))
    (tmp_path / "access.log").write_text("\n".join(lines) + "\n")
    progs = tmp_path / "progs"
    progs.mkdir()
    (progs / "teamserve_gateway.mtail").write_text((ROLE / "files" / "teamserve_gateway.mtail").read_text())
    run = tool("mtail", "--one_shot", "--one_shot_format", "prometheus", "--progs", str(progs),
               "--logs", str(tmp_path / "access.log"))
    assert run.returncode == 0, run.stderr[-2000:]
    samples = {}
    for line in run.stdout.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.replace(',prog="teamserve_gateway.mtail"', "").replace('prog="teamserve_gateway.mtail",', "")] = float(value)
    assert samples['teamserve_gateway_requests_total{code="200",user="alice"}'] == 2
    assert samples['teamserve_gateway_requests_total{code="429",user="alice"}'] == 1
    assert samples['teamserve_gateway_requests_total{code="401",user="anonymous"}'] == 1
    assert samples['teamserve_gateway_refusals_total{kind="concurrency_limit_exceeded",user="alice"}'] == 1
    assert samples['teamserve_gateway_refusals_total{kind="rate_limit_exceeded",user="bob"}'] == 1
    assert samples['teamserve_gateway_refusals_total{kind="server_full",user="bob"}'] == 1
    assert samples['teamserve_gateway_refusals_total{kind="invalid_api_key",user="anonymous"}'] == 1
    assert samples['teamserve_gateway_response_bytes_total{user="alice"}'] == 2048 + 9000 + 180
    assert samples['teamserve_gateway_tokens_total{kind="prompt",user="alice"}'] == 31 + 1200
    assert samples['teamserve_gateway_tokens_total{kind="completion",user="alice"}'] == 7
    assert samples['teamserve_gateway_tokens_total{kind="prompt",user="bob"}'] == 5
    assert not any(name.startswith("teamserve_gateway_tokens_total") and "anonymous" in name for name in samples)
    assert samples['teamserve_gateway_request_duration_seconds_count{user="alice"}'] == 3
    assert samples['teamserve_gateway_request_duration_seconds_bucket{user="alice",le="1"}'] == 2
    assert not any("mallory" in name or 'code="500"' in name for name in samples)


def test_the_mtail_program_compiles():
    run = tool("mtail", "--compile_only", "--progs", str(ROLE / "files" / "teamserve_gateway.mtail"))
    assert run.returncode == 0, run.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


ASSERT_PLAY = """
- name: Check the monitoring role's inputs, one case per host
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the assert entry point
      block:
        - name: Check
          ansible.builtin.include_role:
            name: monitoring
            tasks_from: assert
        - name: Record a pass
          ansible.builtin.copy: {content: ok, dest: "{{ out_dir }}/{{ inventory_hostname }}.txt", mode: "0600"}
      rescue:
        - name: Record the refusal
          ansible.builtin.copy:
            content: "{{ ansible_failed_result.msg }}"
            dest: "{{ out_dir }}/{{ inventory_hostname }}.txt"
            mode: "0600"
"""
GOOD = {"vllm_plan": {"numbers": {"avg_context_tokens": 1000, "kv_tokens": 2_000_000},
                      "flags": {"max-num-seqs": 8, "max-model-len": 2048}},
        "vllm_engine_url": "http://127.0.0.1:8000", "caddy_metrics_url": "http://127.0.0.1:2020/metrics",
        "caddy_access_log_path": "/var/log/caddy/access.log", "monitoring_dcgm_exporter_enabled": False}
REFUSALS = {
    "ok_small_cold_start_margin": ({"vllm_cold_start_regression_margin": 0.5}, None),
    "ok_webhook": ({"monitoring_alertmanager_receivers": [{"name": "chat", "webhook_url": "http://127.0.0.1:9099/a"}]},
                   None),
    "receiver_without_target": ({"monitoring_alertmanager_receivers": [{"name": "chat"}]},
                                r"exactly one of webhook_url .* or email_to.*Not usable: \['chat'\]"),
    "receiver_not_http": ({"monitoring_alertmanager_receivers": [{"name": "chat", "webhook_url": "ftp://x"}]},
                          r"Not usable: \['chat'\]"),
    "mail_without_relay": ({"monitoring_alertmanager_receivers": [{"name": "admin", "email_to": "a@example.org"}]},
                           "e-mail receivers also need monitoring_alertmanager_smtp with smarthost and from"),
    "engine_off_loopback": ({"vllm_engine_url": "http://10.0.0.5:8000"},
                            "monitoring_engine_metrics_url=http://10.0.0.5:8000/metrics and .* must be http:// URLs on loopback"),
    "no_plan": ({"vllm_plan": {}}, r"monitoring_plan must be the capacity plan .*got keys \[\]"),
    "port_clash": ({"monitoring_mtail_port": 9090}, r"ports \[9090, 9093, 9100, 9090, 9400\] must be distinct"),
    "ok_front": ({"vllm_plan": {}, "vllm_engine_url": "", "monitoring_front": True,
                  "monitoring_front_boxes": FRONT_BOXES}, None),
    "front_box_without_url": ({"vllm_plan": {}, "monitoring_front": True,
                               "monitoring_front_boxes": [{"name": "b", "url": "10.0.0.11:8443", "max_inflight": 4}]},
                              r"monitoring_front makes this host a front gateway, which needs the boxes it balances "
                              r"over \(monitoring_front_boxes, each with its gateway's https://host:port; got "
                              r"\['10.0.0.11:8443'\]\)"),
    # A front whose pool came out empty is not taken for a box (which would ask for an engine and a plan).
    "front_without_boxes": ({"vllm_plan": {}, "vllm_engine_url": "", "monitoring_front": True},
                            r"monitoring_front makes this host a front gateway, which needs the boxes .*got \[\]\)"),
    "dcgm_without_digest": ({"monitoring_dcgm_exporter_enabled": True},
                            "monitoring_dcgm_exporter_image=.*must name NVIDIA's DCGM exporter by tag and digest"
                            ".*monitoring_dcgm_exporter_enabled: false"),
}


def test_bad_input_is_refused_naming_the_field_and_the_fix(tmp_path):
    outcomes = run_cases(tmp_path, {name: {**GOOD, **case} for name, (case, _) in REFUSALS.items()}, ASSERT_PLAY)
    for name, (_, expected) in REFUSALS.items():
        if expected is None:
            assert outcomes[name] == "ok", (name, outcomes[name])
        else:
            assert re.search(expected, " ".join(outcomes[name].split())), (name, outcomes[name])
