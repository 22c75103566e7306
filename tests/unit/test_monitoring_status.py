"""The status view's per-user counts (roles/monitoring, playbooks/status.yml): exact integers from the counters'
raw samples, a series that starts in the window counted from 0 (a burst of 429s that creates the refusal
series is not 0), a counter reset counted, and the printed view reading those counts from a Prometheus
stand-in answering the role's own queries."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml
from prometheus_stand_in import serve
from repo_modules import REPO, load

status = load("monitoring_status", "roles/monitoring/filter_plugins/monitoring_status.py")
_VARS = yaml.safe_load((REPO / "roles/monitoring/vars/main.yml").read_text())
QUERIES = {**_VARS["__monitoring_status_engine_queries"], **_VARS["__monitoring_status_front_queries"],
           **_VARS["__monitoring_status_user_queries"]}
AT = 1764686400.0


def matrix(metric: dict, *values: float) -> dict:
    """A range-vector series as Prometheus's API returns it (one sample every 15 s up to AT)."""
    return {"metric": metric, "values": [[AT - 15 * (len(values) - 1 - i), f"{v:g}"] for i, v in enumerate(values)]}


def vector(metric: dict, value: float) -> dict:
    return {"metric": metric, "value": [AT, f"{value:g}"]}


def test_a_series_created_by_its_first_events_counts_them():
    # mtail creates carol's refusal series at her first 429s: its first sample is already 3 and stays.
    rows = status.monitoring_counter_counts(
        [matrix({"__name__": "teamserve_gateway_refusals_total", "user": "carol", "kind": "rate_limit_exceeded"},
                3, 3, 3)], [], ["user", "kind"])
    assert rows == [{"metric": {"user": "carol", "kind": "rate_limit_exceeded"}, "value": 3}]


def test_counts_are_the_rise_over_the_sample_before_the_window():
    samples = [matrix({"__name__": "teamserve_gateway_requests_total", "user": "bob", "code": "200"}, 10, 12, 15)]
    before = [vector({"user": "bob", "code": "200"}, 10)]  # last_over_time drops the name
    assert status.monitoring_counter_counts(samples, before) == [{"metric": {"user": "bob"}, "value": 5}]
    assert status.monitoring_counter_counts(samples, before)[0]["value"].__class__ is int


def test_a_reset_counts_the_new_value_and_series_sum_by_the_labels():
    samples = [matrix({"user": "bob", "code": "200"}, 101, 2, 4),  # mtail restarted between 101 and 2
               matrix({"user": "bob", "code": "429"}, 1, 1),
               matrix({"user": "alice", "code": "200"}, 7, 7)]
    before = [vector({"user": "bob", "code": "200"}, 100), vector({"user": "alice", "code": "200"}, 7)]
    assert status.monitoring_counter_counts(samples, before) == [
        {"metric": {"user": "alice"}, "value": 0}, {"metric": {"user": "bob"}, "value": 1 + 2 + 2 + 1}]


def test_float_noise_and_bad_samples_do_not_make_fractions():
    samples = [{"metric": {"user": "dana"}, "values": [[AT - 30, "0.1"], [AT - 15, "NaN"], [AT, "3.0000000001"]]}]
    assert status.monitoring_counter_counts(samples, None) == [{"metric": {"user": "dana"}, "value": 3}]
    assert status.monitoring_counter_counts(None, None) == []


# What the stand-in Prometheus holds: per query expression, the result at AT.
HELD = {
    QUERIES["user_requests_samples"]: [
        matrix({"__name__": "teamserve_gateway_requests_total", "user": "carol", "code": "200"}, 10, 12, 15),
        matrix({"__name__": "teamserve_gateway_requests_total", "user": "carol", "code": "429"}, 3, 3),
        matrix({"__name__": "teamserve_gateway_requests_total", "user": "bob", "code": "200"}, 101, 2, 4)],
    QUERIES["user_requests_before"]: [vector({"user": "carol", "code": "200"}, 10),
                                      vector({"user": "bob", "code": "200"}, 100)],
    QUERIES["user_refusals_samples"]: [
        matrix({"__name__": "teamserve_gateway_refusals_total", "user": "carol", "kind": "rate_limit_exceeded"}, 3, 3),
        matrix({"__name__": "teamserve_gateway_refusals_total", "user": "bob", "kind": "server_full"}, 2, 2)],
    QUERIES["user_refusals_before"]: [vector({"user": "bob", "kind": "server_full"}, 2)],
    QUERIES["user_tokens_samples"]: [
        matrix({"__name__": "teamserve_gateway_tokens_total", "user": "carol", "kind": "prompt"}, 400, 900, 1000),
        matrix({"__name__": "teamserve_gateway_tokens_total", "user": "carol", "kind": "completion"}, 40, 50)],
    QUERIES["user_tokens_before"]: [vector({"user": "carol", "kind": "prompt"}, 100)],
    QUERIES["engine_up"]: [vector({"job": "vllm"}, 1)],
    QUERIES["running"]: [vector({}, 3)],
    QUERIES["kv_cache_usage"]: [vector({}, 0.25)],
    QUERIES["ttft_p95"]: [vector({}, 0.4)],
    # A front: its gateway up, the box it can read healthy, the box another inventory manages not.
    QUERIES["gateway_up"]: [vector({"job": "caddy"}, 1)],
    QUERIES["box_healthy"]: [vector({"upstream": "10.0.0.10:8443"}, 1), vector({"upstream": "10.0.0.11:8443"}, 0)],
}


@pytest.fixture
def prometheus() -> Iterator[tuple[int, list[str]]]:
    """A stand-in for Prometheus's instant-query API on 127.0.0.1: HELD's results, an empty vector for any
    other expression. Yields (port, the times the queries asked for)."""
    asked: list[str] = []

    def answer(_path: str, params: dict[str, str]) -> list[dict]:
        asked.append(params["time"])
        return HELD.get(params["query"], [])

    with serve(answer) as port:
        yield port, asked


STATUS_PLAY = """
- name: Print the status against the stand-in
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the status entry point
      ansible.builtin.include_role:
        name: monitoring
        tasks_from: status
"""


def run_plays(tmp_path: pathlib.Path, port: int, hosts: dict[str, dict], playbook: str) -> list[dict]:
    """`playbook` against the stand-in at AT, through ansible-playbook with the json callback, one inventory
    host per entry of `hosts` (its variables). Returns the json callback's plays."""
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
              "monitoring_prometheus_port": port, "monitoring_status_time": f"{AT}"}
    (tmp_path / "inventory.yml").write_text(json.dumps({"all": {"hosts": {
        name: {**common, **variables} for name, variables in hosts.items()}}}))
    (tmp_path / "play.yml").write_text(playbook)
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json", "ANSIBLE_CALLBACKS_ENABLED": "ansible.builtin.json",
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(pathlib.Path(sys.executable).parent / "ansible-playbook"), "-i",
                          str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plays: list[dict] = json.loads(run.stdout)["plays"]
    return plays


def tasks_of(play: dict, host: str) -> dict[str, dict]:
    """One host's task results in a play, by task name without the role."""
    return {t["task"]["name"].split(" : ")[-1]: t["hosts"][host] for t in play["tasks"] if host in t["hosts"]}


def run_status(tmp_path: pathlib.Path, port: int) -> tuple[dict, list[str]]:
    """status.yml's entry point on one box. Returns (the published facts, the printed lines)."""
    tasks = tasks_of(run_plays(tmp_path, port, {"box": {}}, STATUS_PLAY)[0], "box")
    return tasks["Collect the figures"]["ansible_facts"], tasks["Print the status"]["msg"]


def test_the_status_view_prints_exact_counts_at_one_instant(tmp_path, prometheus):
    port, asked = prometheus
    facts, printed = run_status(tmp_path, port)
    assert facts["monitoring_status"]["user_requests"] == [
        {"metric": {"user": "bob"}, "value": 5}, {"metric": {"user": "carol"}, "value": 8}]
    assert facts["monitoring_status"]["user_refusals"] == [
        {"metric": {"user": "bob", "kind": "server_full"}, "value": 0},
        {"metric": {"user": "carol", "kind": "rate_limit_exceeded"}, "value": 3}]
    assert facts["monitoring_status"]["user_tokens"] == [
        {"metric": {"user": "carol", "kind": "completion"}, "value": 50},
        {"metric": {"user": "carol", "kind": "prompt"}, "value": 900}]
    assert "  bob: 5 requests" in printed  # no tokens or refusal in the hour: none printed
    assert "  carol: 8 requests; 900 prompt + 50 completion tokens; 3 rate_limit_exceeded" in printed
    assert "Engine up:              yes" in printed
    assert "Requests running:       3 (max-num-seqs n/a)" in printed  # whole requests, not 3.0
    assert set(asked) == {f"{AT}"}  # every figure read at the one instant


# Each box first, then the fronts, as playbooks/status.yml runs them.
FLEET_PLAY = "".join(STATUS_PLAY.replace("hosts: all", f"hosts: {hosts}") for hosts in ("box", "front:front-without-pool"))


def test_the_front_shows_each_boxs_health_beside_the_boxs_own_figures(tmp_path, prometheus):
    port, asked = prometheus
    boxes = [{"name": "box", "url": "https://10.0.0.10:8443", "max_inflight": 8},
             {"name": "box-b", "url": "https://10.0.0.11:8443", "max_inflight": 4}]
    plays = run_plays(tmp_path, port, {"box": {}, "front": {"monitoring_front": True, "monitoring_front_boxes": boxes},
                                       "front-without-pool": {"monitoring_front": True}}, FLEET_PLAY)
    tasks = tasks_of(plays[1], "front")
    fleet = tasks["Collect each box's figures"]["ansible_facts"]["monitoring_fleet"]
    assert fleet == [
        {"box": "box", "upstream": "10.0.0.10:8443", "max_inflight": 8, "healthy": True, "engine_up": True,
         "running": 3, "waiting": None, "kv_cache_usage": 0.25, "ttft_p95": 0.4},
        {"box": "box-b", "upstream": "10.0.0.11:8443", "max_inflight": 4, "healthy": False, "engine_up": None,
         "running": None, "waiting": None, "kv_cache_usage": None, "ttft_p95": None}]
    printed = tasks["Print the status"]["msg"]
    assert "Gateway up:             yes" in printed
    assert "Fleet capacity:         12 sequences (the boxes' max-num-seqs)" in printed
    assert "  box (10.0.0.10:8443): healthy; engine up running 3 of 8, waiting n/a, KV cache 0.25, TTFT p95 0.4 s" in printed
    assert "  box-b (10.0.0.11:8443): UNHEALTHY; running n/a of 4, waiting n/a, KV cache n/a, TTFT p95 n/a" in printed
    assert not [line for line in printed if line.startswith("Engine up")]  # the front has no engine
    assert "  carol: 8 requests; 900 prompt + 50 completion tokens; 3 rate_limit_exceeded" in printed
    assert set(asked) == {f"{AT}"}
    # A front with no recorded pool still shows a front's view, and says what is missing.
    bare = tasks_of(plays[1], "front-without-pool")
    assert "  (none recorded on the front: run site.yml)" in bare["Print the status"]["msg"]
    assert not [line for line in bare["Print the status"]["msg"] if line.startswith("Engine up")]


def test_fleet_rows_without_samples_say_so():
    rows = status.monitoring_fleet_rows([{"box": "a", "upstream": "10.0.0.1:8443", "max_inflight": 2}], None, None)
    assert rows == [{"box": "a", "upstream": "10.0.0.1:8443", "max_inflight": 2, "healthy": None, "engine_up": None,
                     "running": None, "waiting": None, "kv_cache_usage": None, "ttft_p95": None}]
    nan = [{"metric": {"upstream": "10.0.0.1:8443"}, "value": [AT, "NaN"]}]
    assert status.monitoring_fleet_rows([{"box": "a", "upstream": "10.0.0.1:8443"}], nan)[0]["healthy"] is None
