"""The Grafana dashboard (roles/monitoring/files/grafana/teamserve-dashboard.json) reads metrics that exist,
and the PromQL metric-name extractor it is checked with (tests/promql.py) reads PromQL correctly.

The engine's names are checked against the real vLLM 0.32 /metrics the testbed served
(fixtures/verify/metrics-after.txt); the gateway's and the plan's against the monitoring role's mtail
program and textfile template, which produce them. The provisioning files grafana.yml writes are
rendered with ansible-core's Templar and checked against the dashboard (datasource uid, folder path).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from repo_modules import trust

from ansible_collections.teamserve.core.plugins.module_utils import prometheus

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.promql, as the molecule verifiers import it
from tests.promql import dashboard_queries, metric_names  # noqa: E402

ROLE = REPO / "roles" / "monitoring"
DASHBOARD_FILE = ROLE / "files" / "grafana" / "teamserve-dashboard.json"
GRAFANA_TASKS = ROLE / "tasks" / "grafana.yml"
METRICS_AFTER = pathlib.Path(__file__).resolve().parent / "fixtures" / "verify" / "metrics-after.txt"


# --- metric_names -----------------------------------------------------------------------------------

@pytest.mark.parametrize("expr,names", [
    pytest.param("histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))",
                 {"vllm:time_to_first_token_seconds_bucket"}, id="histogram_quantile-by-le"),
    pytest.param("histogram_quantile(0.99, sum(rate(x_bucket[5m])) by (le, user))", {"x_bucket"},
                 id="by-after-the-aggregation"),
    pytest.param("rate(vllm:request_prompt_tokens_sum[5m]) / rate(vllm:request_prompt_tokens_count[5m])",
                 {"vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count"}, id="division"),
    pytest.param('sum(rate(http_requests_total{path=~"/v1/(chat|completions)", code!="200,429", job=\'caddy\'}[5m]))',
                 {"http_requests_total"}, id="matchers-regex-and-commas-in-strings"),
    pytest.param('x{a="}", b=~"[", c="\\"by (le)\\""}', {"x"}, id="brackets-and-escaped-quotes-in-strings"),
    pytest.param('{__name__="up", job="node"}', {"up"}, id="__name__-selector"),
    pytest.param('{__name__=~"vllm:.*"}', set(), id="__name__-regex-names-no-metric"),
    pytest.param('{"http.server.duration", env="prod"}', {"http.server.duration"}, id="quoted-utf8-name"),
    pytest.param("vllm:num_requests_waiting > bool 4", {"vllm:num_requests_waiting"}, id="colon-names-and-bool"),
    pytest.param("teamserve:vllm_ttft_seconds:p95 > on() group_left max(teamserve_target_ttft_p95_seconds)",
                 {"teamserve:vllm_ttft_seconds:p95", "teamserve_target_ttft_p95_seconds"}, id="recording-rule"),
    pytest.param("a * on(instance, job) group_left(node, pod) b", {"a", "b"}, id="on-group_left-labels"),
    pytest.param("a / ignoring(code) group_right b", {"a", "b"}, id="ignoring-group_right"),
    pytest.param("a and b or c unless d atan2 e", {"a", "b", "c", "d", "e"}, id="binary-keywords"),
    pytest.param("sum without (instance) (x)", {"x"}, id="without"),
    pytest.param("SUM BY (le) (Rate (x[5m]))", {"x"}, id="keywords-any-case-function-then-space"),
    pytest.param("topk(5, sum by (user) (increase(teamserve_gateway_requests_total[1h])))",
                 {"teamserve_gateway_requests_total"}, id="topk-increase"),
    pytest.param('count_values("version", build_info) + quantile(0.9, y)', {"build_info", "y"}, id="parameters"),
    pytest.param('label_replace(up, "dst", "$1", "src", "(.*):.*")', {"up"}, id="label_replace-strings"),
    pytest.param("max_over_time(rate(x[5m])[1h:30s])", {"x"}, id="subquery"),
    pytest.param("x offset -1h30m + y @ 1609746000 + z @ start()", {"x", "y", "z"}, id="offset-and-at"),
    pytest.param('rate(x{job="$job"}[${__rate_interval}]) * $__interval_ms', {"x"}, id="grafana-variables"),
    pytest.param('1 - avg by (instance) (rate(node_cpu_seconds_total{mode="idle"}[5m]))',
                 {"node_cpu_seconds_total"}, id="number-minus-expression"),
    pytest.param("2 * 1e3 + 0x1F - 1.5e-3 + Inf - NaN + vector(1) + time()", set(), id="constants-only"),
    pytest.param("up # a comment naming not_a_metric", {"up"}, id="comment"),
    pytest.param("node_memory_MemAvailable_bytes\n  / node_memory_MemTotal_bytes",
                 {"node_memory_MemAvailable_bytes", "node_memory_MemTotal_bytes"}, id="multi-line"),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", [
    'rate(x[5m]',
    'x{job="a"',
    'rate(x[5m)',
    'x)',
    'x]',
    'x}',
    '"unterminated',
    'x; y',
])
def test_metric_names_refuses_broken_promql(expr: str) -> None:
    with pytest.raises(ValueError):
        metric_names(expr)


def test_metric_names_refuses_a_non_string() -> None:
    with pytest.raises(TypeError):
        metric_names(None)  # type: ignore[arg-type]


# --- dashboard_queries ------------------------------------------------------------------------------

def test_dashboard_queries_walks_rows_collapsed_rows_and_legacy_rows() -> None:
    dashboard = {
        "panels": [
            {"type": "row", "title": "open row", "panels": []},
            {"type": "timeseries", "title": "top", "targets": [{"refId": "A", "expr": "a"}, {"refId": "B", "expr": "b"}]},
            {"type": "row", "title": "collapsed", "collapsed": True, "panels": [
                {"type": "stat", "title": "nested", "targets": [{"refId": "A", "expr": "c"}]},
                {"type": "text", "title": "notes"},
            ]},
            {"type": "timeseries", "title": "no expr", "targets": [{"refId": "A"}]},
        ],
        "rows": [{"panels": [{"type": "graph", "title": "legacy", "targets": [{"expr": "d"}]}]}],
    }
    assert dashboard_queries(dashboard) == [("top", "a"), ("top", "b"), ("nested", "c"), ("no expr", ""),
                                            ("legacy", "d")]


def test_dashboard_queries_refuses_what_is_not_a_dashboard() -> None:
    with pytest.raises(TypeError):
        dashboard_queries([])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dashboard_queries({"panels": ["not a panel"]})


# --- the dashboard file -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_all_panels(panel.get("panels") or []))
    return out


def _dashboard_names(dashboard: dict[str, Any]) -> set[str]:
    return {name for _, expr in dashboard_queries(dashboard) for name in metric_names(expr)}


def test_the_dashboard_is_the_provisioned_teamserve_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "teamserve"
    assert 39 <= dashboard["schemaVersion"] < 50
    assert dashboard.get("id") is None  # provisioning assigns the database id
    panels = _all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {p["type"] for p in panels} <= {"row", "timeseries", "stat"}


def test_every_panel_queries_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    expected = {"type": "prometheus", "uid": "teamserve-prometheus"}
    for panel in _all_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == expected, panel["title"]
        assert panel.get("targets"), f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_query_reads_a_metric(dashboard: dict[str, Any]) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    for title, expr in queries:
        assert metric_names(expr), f"{title}: {expr!r} reads no metric"


def test_the_engine_metrics_exist_in_vllm_0_32(dashboard: dict[str, Any]) -> None:
    served = {sample.name for sample in prometheus.samples(METRICS_AFTER.read_text(encoding="utf-8"))}
    used = {name for name in _dashboard_names(dashboard) if name.startswith("vllm:")}
    assert used, "the dashboard reads no engine metric"
    assert used <= served, f"not in the engine's /metrics: {sorted(used - served)}"


def test_the_gateway_and_plan_metrics_are_the_ones_the_role_produces(dashboard: dict[str, Any]) -> None:
    mtail = ROLE / "files" / "teamserve_gateway.mtail"
    textfile = ROLE / "templates" / "teamserve.prom.j2"
    if not (mtail.is_file() and textfile.is_file()):
        pytest.skip("the monitoring role's mtail program or textfile template is not there yet")
    produced = set(re.findall(r"^(?:counter|gauge|histogram|timer)\s+(\w+)", mtail.read_text(), re.MULTILINE))
    produced |= {f"{name}{suffix}" for name in set(produced) for suffix in ("_bucket", "_sum", "_count")}
    produced |= set(re.findall(r"^# TYPE (\w+) ", textfile.read_text(), re.MULTILINE))
    used = {name for name in _dashboard_names(dashboard) if name.startswith("teamserve_")}
    assert used <= produced, f"produced by neither mtail nor the textfile: {sorted(used - produced)}"


@pytest.mark.parametrize("name", [
    pytest.param("vllm:num_requests_waiting", id="queue-depth"),
    pytest.param("vllm:num_requests_running", id="running"),
    pytest.param("vllm:time_to_first_token_seconds_bucket", id="ttft"),
    pytest.param("vllm:request_time_per_output_token_seconds_bucket", id="tpot"),
    pytest.param("vllm:kv_cache_usage_perc", id="kv-cache-usage"),
    pytest.param("vllm:generation_tokens_total", id="generation-tokens"),
    pytest.param("vllm:prompt_tokens_total", id="prompt-tokens"),
    pytest.param("teamserve_gateway_requests_total", id="per-user-requests"),
    pytest.param("teamserve_gateway_refusals_total", id="per-user-refusals"),
    pytest.param("DCGM_FI_DEV_FB_USED", id="gpu-memory"),
])
def test_the_dashboard_covers(dashboard: dict[str, Any], name: str) -> None:
    assert name in _dashboard_names(dashboard)


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    """Within the top level and within each collapsed row (its panels show when it opens)."""
    groups = [dashboard["panels"]] + [p["panels"] for p in dashboard["panels"] if p["type"] == "row" and p["panels"]]
    for panels in groups:
        cells: dict[tuple[int, int], str] = {}
        for panel in panels:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, panel["title"]
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = panel["title"]


# --- what grafana.yml provisions --------------------------------------------------------------------

LOADER = DataLoader()


@pytest.fixture(scope="module")
def grafana_tasks() -> dict[str, dict[str, Any]]:
    tasks: dict[str, dict[str, Any]] = {}
    for task in LOADER.load_from_file(str(GRAFANA_TASKS)):
        tasks[task["name"]] = task
        for inner in task.get("block") or []:
            tasks[inner["name"]] = inner
    return tasks


def _render(task: dict[str, Any], value: Any, facts: dict[str, Any]) -> Any:
    variables = {"ansible_managed": "Ansible managed", "monitoring_grafana_port": 3000,
                 "monitoring_prometheus_url": "http://127.0.0.1:9090", "monitoring_scrape_interval": "15s",
                 **facts, **trust(task.get("vars") or {})}
    return Templar(loader=LOADER, variables=variables).template(trust(value))


def test_grafana_provisions_the_datasource_and_folder_the_dashboard_uses(
        dashboard: dict[str, Any], grafana_tasks: dict[str, dict[str, Any]]) -> None:
    facts_task = grafana_tasks["Note where Grafana keeps the password and the dashboard, and where it answers"]
    facts = _render(facts_task, facts_task["ansible.builtin.set_fact"], {})

    task = grafana_tasks["Provision the Prometheus datasource"]
    datasources = yaml.safe_load(_render(task, task["ansible.builtin.copy"]["content"], facts))
    assert datasources["apiVersion"] == 1
    [source] = datasources["datasources"]
    first_panel = next(p for p in dashboard["panels"] if p["type"] != "row")
    assert source["uid"] == first_panel["datasource"]["uid"] == "teamserve-prometheus"
    assert (source["type"], source["url"], source["jsonData"]["timeInterval"]) == (
        "prometheus", "http://127.0.0.1:9090", "15s")

    task = grafana_tasks["Provision the dashboard provider"]
    providers = yaml.safe_load(_render(task, task["ansible.builtin.copy"]["content"], facts))
    [provider] = providers["providers"]
    task = grafana_tasks["Install the teamserve dashboard"]
    dest = pathlib.PurePosixPath(_render(task, task["ansible.builtin.copy"]["dest"], facts))
    assert provider["type"] == "file"
    assert provider["options"]["path"] == str(dest.parent) == "/var/lib/grafana/dashboards/teamserve"
    assert (ROLE / "files" / task["ansible.builtin.copy"]["src"]) == DASHBOARD_FILE


def test_grafana_reads_the_admin_password_from_the_file_it_writes(grafana_tasks: dict[str, dict[str, Any]]) -> None:
    facts_task = grafana_tasks["Note where Grafana keeps the password and the dashboard, and where it answers"]
    facts = _render(facts_task, facts_task["ansible.builtin.set_fact"], {})
    task = grafana_tasks["Keep the admin password in a file only root and Grafana read"]
    assert task["no_log"] is True
    assert task["ansible.builtin.copy"]["mode"] == "0640"
    password_file = _render(task, task["ansible.builtin.copy"]["dest"], facts)

    task = grafana_tasks["Set Grafana's listen address, port and admin password source in grafana.ini"]
    settings = {(i["section"], i["option"]): str(_render(task, i["value"], facts)) for i in task["loop"]}
    assert settings == {("server", "http_addr"): "127.0.0.1", ("server", "http_port"): "3000",
                        ("security", "admin_password"): f"$__file{{{password_file}}}"}
    assert task["community.general.ini_file"]["backup"] is True
    for name, task in grafana_tasks.items():
        if "block" in task or "ansible.builtin.assert" in task:
            continue
        if "monitoring_grafana_admin_password" in json.dumps(task):
            assert task.get("no_log") is True, name
