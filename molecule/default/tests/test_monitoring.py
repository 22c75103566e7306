"""Monitoring on the converged box: Prometheus holds the engine's, the gateway's, the host's and the per-user
series; a context-creep alert (the testbed's short window) reaches a webhook receiver; the status view
prints what Prometheus holds; every dashboard query reads metrics Prometheus scraped; and none of the
monitoring ports answers from the LAN or the outside client."""

from __future__ import annotations

import base64
import json
import pathlib
import re
import sys
import time

import httpx2 as httpx
import pytest
import testinfra
from conftest import GATEWAY, GATEWAY_CA, REPO, ansible_playbook, json_callback_document, prometheus_query

sys.path.insert(0, str(REPO))
from tests.promql import dashboard_queries, metric_names  # noqa: E402

testinfra_hosts = ["ansible://teamserve-box"]
LAN_CLIENT = testinfra.get_host("docker://teamserve-lan-client")
WAN_CLIENT = testinfra.get_host("docker://teamserve-wan-client")
MONITORING_PORTS = (9090, 9093, 9094, 9100, 3903, 2020)  # Prometheus, Alertmanager (web, cluster), node, mtail, Caddy
WEBHOOK = REPO / "tests" / "testbed" / "webhook_receiver.py"
DASHBOARD = REPO / "roles" / "monitoring" / "files" / "grafana" / "teamserve-dashboard.json"


# Series that must be present once the box has served a request. Caddy's appear only after a request
# since its last reload (each reload starts a fresh registry), so the test waits for every one of them.
EXPECTED_SERIES = (
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket", "caddy_http_requests_total",
    "node_memory_MemAvailable_bytes", 'teamserve_gateway_requests_total{user="alice"}',
    'teamserve_gateway_refusals_total{user="anonymous",kind="invalid_api_key"}',
    "teamserve_plan_avg_context_tokens", 'teamserve_engine_cold_start_seconds{trigger="deploy"}')
JOBS = ("vllm", "caddy", "node", "mtail", "prometheus", "alertmanager")


def test_prometheus_holds_engine_gateway_host_and_per_user_series(host, keys):
    with httpx.Client(verify=str(GATEWAY_CA), timeout=30) as http:  # one answer and one refusal for alice
        http.get(GATEWAY + "/v1/models", headers={"Authorization": f"Bearer {keys['alice']}"}).raise_for_status()
        assert http.get(GATEWAY + "/v1/models", headers={"Authorization": "Bearer sk-ts-unknown"}).status_code == 401
    deadline = time.monotonic() + 60  # 12 scrapes at the testbed's 5 s interval
    while True:
        up = {r["metric"]["job"]: r["value"][1] for r in prometheus_query(host, "up")}
        missing = [expr for expr in EXPECTED_SERIES if not prometheus_query(host, expr)]
        if (all(up.get(job) == "1" for job in JOBS) and not missing) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert up == dict.fromkeys(JOBS, "1")
    assert not missing, f"Prometheus has none of {missing} 60 s after the requests"
    (plan_avg,) = prometheus_query(host, "teamserve_plan_avg_context_tokens")
    assert float(plan_avg["value"][1]) == 1000  # the testbed workload's avg_context_tokens, through the plan


@pytest.fixture
def webhook(host):
    """The testbed's webhook receiver on the box's loopback (what Alertmanager posts to), for at most 10 min."""
    host.run("systemctl stop teamserve-test-webhook")
    encoded = base64.b64encode(WEBHOOK.read_bytes()).decode()
    host.check_output("echo %s | base64 -d > /usr/local/bin/teamserve-webhook-receiver", encoded)
    host.check_output("rm -f /run/teamserve-alerts.jsonl && systemd-run --unit teamserve-test-webhook "
                      "--property=RuntimeMaxSec=600 /usr/bin/python3 /usr/local/bin/teamserve-webhook-receiver "
                      "127.0.0.1 9099 /run/teamserve-alerts.jsonl")
    yield pathlib.PurePosixPath("/run/teamserve-alerts.jsonl")
    host.run("systemctl stop teamserve-test-webhook")


def firing(posts: list[dict]) -> list[dict]:
    """The firing TeamserveContextCreep alerts in Alertmanager's webhook posts (a resolved one from an
    earlier run may come first)."""
    return [a for post in posts for a in post["alerts"]
            if a["labels"]["alertname"] == "TeamserveContextCreep" and a["status"] == "firing"]


def test_context_creep_alert_reaches_the_webhook(host, keys, webhook):
    """Prompts of 1,900 tokens against the plan's 1,000 (threshold 1,500 with the 0.5 margin), one every
    3 s for at most 40 requests (2 min), until Alertmanager posts TeamserveContextCreep."""
    received: list[dict] = []
    with httpx.Client(verify=str(GATEWAY_CA), timeout=60) as http:
        for _ in range(40):
            answer = http.post(GATEWAY + "/v1/completions", headers={"Authorization": f"Bearer {keys['bob']}"},
                               json={"model": "tiny", "prompt": [7] * 1900, "max_tokens": 1})
            assert answer.status_code == 200, answer.text[:300]
            posted = host.run("cat %s", str(webhook)).stdout
            received = [json.loads(line) for line in posted.splitlines() if line.strip()]
            if firing(received):
                break
            time.sleep(3)
    alerts = firing(received)
    assert alerts, f"no firing context-creep alert posted ({received}); Prometheus says {prometheus_query(host, 'ALERTS')}"
    assert "the plan assumed 1000" in alerts[0]["annotations"]["summary"]
    assert alerts[0]["annotations"]["runbook"]


def test_status_view_prints_what_prometheus_holds(host, keys):
    """A burst of 429s (carol's 5/1m limit) is shown as rate_limit_exceeded refusals, however new the series,
    and every per-user count is an integer equal to what Prometheus holds at the view's instant."""
    refusals = 'teamserve_gateway_refusals_total{user="carol",kind="rate_limit_exceeded"}'
    held_before = sum(float(r["value"][1]) for r in prometheus_query(host, refusals))
    with httpx.Client(verify=str(GATEWAY_CA), timeout=30) as http:
        answers = [http.get(GATEWAY + "/v1/models", headers={"Authorization": f"Bearer {keys['carol']}"}).status_code
                   for _ in range(8)]
    limited = answers.count(429)
    assert limited >= 3, answers
    deadline = time.monotonic() + 60  # mtail counts the log lines, Prometheus scrapes them every 5 s
    while sum(float(r["value"][1]) for r in prometheus_query(host, refusals)) < held_before + limited:
        assert time.monotonic() < deadline, f"Prometheus holds {prometheus_query(host, refusals)} after {limited} 429s"
        time.sleep(2)
    run = ansible_playbook(REPO / "playbooks" / "status.yml", stdout_callback="ansible.builtin.json", timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    document = json_callback_document(run.stdout)
    # Task names as the json callback gives them ("monitoring : Collect the figures"), without the role.
    tasks = {t["task"]["name"].split(" : ")[-1]: next(iter(t["hosts"].values())) for t in document["plays"][0]["tasks"]}
    facts = tasks["Collect the figures"]["ansible_facts"]
    printed = "\n".join(tasks["Print the status"]["msg"])
    at = float(facts["monitoring_status_time_used"])
    # The same expressions, evaluated by Prometheus at the same instant, give the figures (the per-user
    # counts are computed from the counters' raw samples read this way).
    for name, expr in (("waiting", 'sum(vllm:num_requests_waiting{job="vllm"})'),
                       ("mean_prompt_tokens", "teamserve:vllm_prompt_tokens:mean"),
                       ("plan_avg_context_tokens", "teamserve_plan_avg_context_tokens"),
                       ("user_refusals_samples", "teamserve_gateway_refusals_total[1h]"),
                       ("user_refusals_before", "last_over_time(teamserve_gateway_refusals_total[1h] offset 1h)"),
                       ("user_requests_samples", "teamserve_gateway_requests_total[1h]"),
                       ("user_requests_before", "last_over_time(teamserve_gateway_requests_total[1h] offset 1h)")):
        assert facts["monitoring_status"][name] == prometheus_query(host, expr, at), name
    counts = {(r["metric"]["user"], r["metric"]["kind"]): r["value"] for r in facts["monitoring_status"]["user_refusals"]}
    requests = {r["metric"]["user"]: r["value"] for r in facts["monitoring_status"]["user_requests"]}
    assert all(type(v) is int for v in [*counts.values(), *requests.values()])
    assert counts[("carol", "rate_limit_exceeded")] >= limited
    assert requests["carol"] >= len(answers) and requests.get("bob", 0) > 0
    # Without a counter reset in the hour, a count is the counter's value now less its value before the hour.
    for user, kind in (("carol", "rate_limit_exceeded"), ("anonymous", "invalid_api_key")):
        series = f'teamserve_gateway_refusals_total{{user="{user}",kind="{kind}"}}'
        if any(float(r["value"][1]) for r in prometheus_query(host, f"resets({series}[1h])", at)):
            continue
        now = sum(float(r["value"][1]) for r in prometheus_query(host, series, at))
        before = sum(float(r["value"][1]) for r in prometheus_query(host, f"last_over_time({series}[1h] offset 1h)", at))
        assert counts.get((user, kind), 0) == round(now - before), (user, kind)
    assert f"carol: {requests['carol']} requests" in printed
    assert f"; {counts[('carol', 'rate_limit_exceeded')]} rate_limit_exceeded" in printed
    assert f"bob: {requests['bob']} requests" in printed
    assert not re.search(r"\d\.\d+ (requests|[a-z_]+_exceeded)", printed), printed  # whole numbers only
    assert "Engine up:              yes" in printed
    assert "(plan 1000.0)" in printed
    # Then the fleet from the front: each box's health as the front sees it, beside the box's own figures
    # read above (teamserve-box-b is another inventory's box: its health only).
    front = {t["task"]["name"].split(" : ")[-1]: t["hosts"]["teamserve-front"] for t in document["plays"][1]["tasks"]
             if "teamserve-front" in t["hosts"]}
    fleet = {row["box"]: row for row in front["Collect each box's figures"]["ansible_facts"]["monitoring_fleet"]}
    assert fleet["teamserve-box"]["healthy"] is True and fleet["teamserve-box"]["engine_up"] is True
    for figure, expr in (("waiting", 'sum(vllm:num_requests_waiting{job="vllm"})'),
                         ("running", 'sum(vllm:num_requests_running{job="vllm"})')):
        assert fleet["teamserve-box"][figure] == round(float(prometheus_query(host, expr, at)[0]["value"][1])), figure
    assert fleet["teamserve-box-b"]["healthy"] is True and fleet["teamserve-box-b"]["running"] is None
    front_printed = front["Print the status"]["msg"]
    assert "Gateway up:             yes" in front_printed
    assert [line for line in front_printed if line.startswith("  teamserve-box (10.231.0.10:8443): healthy; engine up")]


def test_usage_report_as_the_readme_runs_it(host, tmp_path):
    """playbooks/usage.yml with the role's defaults (no monitoring_usage_days) reports on the box and the front:
    every whole day the box's Prometheus keeps, a CSV each, and alice's tokens on the box (the cold start
    streamed through the gateway as her). The CSVs go to tmp_path rather than the directory the tests run in."""
    retention = re.search(r"--storage\.tsdb\.retention\.time=(\d+)d", host.file("/etc/default/prometheus").content_string)
    assert retention, host.file("/etc/default/prometheus").content_string
    run = ansible_playbook(REPO / "playbooks" / "usage.yml",
                           {"monitoring_usage_csv": f"{tmp_path}/usage-{{{{ inventory_hostname }}}}.csv"},
                           stdout_callback="ansible.builtin.json", timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    tasks = {t["task"]["name"].split(" : ")[-1]: t["hosts"] for t in json_callback_document(run.stdout)["plays"][0]["tasks"]}
    for box in ("teamserve-box", "teamserve-front"):
        bounds = tasks["Fix the days the report covers"][box]["ansible_facts"]["__monitoring_usage_bounds"]
        assert len(bounds) == int(retention.group(1)) + 1, (box, bounds)
        csv = (tmp_path / f"usage-{box}.csv").read_text().splitlines()
        assert csv[0] == "day,user,prompt_tokens,completion_tokens", (box, csv)
        if box == "teamserve-box":
            assert any(row.split(",")[1] == "alice" for row in csv[1:]), csv


def test_every_dashboard_query_reads_scraped_metrics(host):
    """DCGM_ metrics come from NVIDIA's exporter, which the testbed (no GPU) does not run."""
    scraped = set(json.loads(host.check_output("curl -sf http://127.0.0.1:9090/api/v1/label/__name__/values"))["data"])
    missing = {}
    for title, expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        names = {n for n in metric_names(expr) if not n.startswith("DCGM_")}
        if names - scraped:
            missing[title] = sorted(names - scraped)
    assert not missing, missing


@pytest.mark.parametrize("client", [LAN_CLIENT, WAN_CLIENT], ids=["lan", "wan"])
def test_monitoring_ports_are_not_reachable_from_outside_the_box(host, client):
    box = "10.231.0.10" if client is LAN_CLIENT else "10.232.0.10"
    # Every port at once (a dropped SYN costs the whole --max-time): one "port code" line each.
    probes = " ".join(f"echo {port} $(curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 http://{box}:{port}/) &"
                      for port in MONITORING_PORTS)
    answers = dict(line.split() for line in client.run(f"{probes} wait").stdout.splitlines() if line.strip())
    assert answers == {str(port): "000" for port in MONITORING_PORTS}, f"from {client.backend.name}: {answers}"
    # ...while they do answer on the box's loopback.
    for port in (9090, 9093, 9100, 3903, 2020):
        assert host.run(f"curl -s -o /dev/null --max-time 3 http://127.0.0.1:{port}/metrics").rc == 0, port
