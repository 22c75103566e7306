"""roles/vllm/tasks/cold_start_history.yml: how long a start (deploy, upgrade, rollback) waits for /health.

The wait is (1 + vllm_cold_start_regression_margin) x the last start of the same kind, at least
vllm_ready_timeout_min and at most the budget vllm_ready_timeout; a box with no history of that kind gets
the whole budget. One ansible-playbook run on localhost, one inventory host per case, each with its own
history file.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from repo_modules import run_cases

REPO = pathlib.Path(__file__).resolve().parents[2]


def start(trigger: str, seconds: float | None) -> dict:
    return {"trigger": trigger, "seconds_to_health": seconds}


# case: (history records oldest first, trigger, margin, expected wait in seconds)
CASES: dict[str, tuple[list[dict], str, float, int]] = {
    "no_history_gets_the_budget": ([], "deploy", 2.0, 900),
    "only_restarts_recorded_deploy_gets_the_budget": ([start("restart", 30.0)], "deploy", 2.0, 900),
    "last_deploy_times_one_plus_margin": ([start("deploy", 100.0)], "deploy", 2.0, 300),
    "rounded_up_to_a_whole_second": ([start("deploy", 100.2)], "deploy", 0.5, 151),
    "never_below_the_floor": ([start("deploy", 40.0)], "deploy", 2.0, 150),
    "smaller_margin_reaches_the_floor": ([start("deploy", 90.0)], "deploy", 0.5, 150),
    "never_above_the_budget": ([start("deploy", 400.0)], "deploy", 2.0, 900),
    "the_last_start_of_that_kind_counts": (
        [start("deploy", 300.0), start("restart", 30.0), start("deploy", 80.0), start("restart", 60.0)],
        "deploy", 1.0, 160),
    "restart_reads_restarts": ([start("deploy", 300.0), start("restart", 80.0)], "restart", 1.0, 160),
    "a_failed_start_without_seconds_is_skipped": ([start("deploy", 100.0), start("deploy", None)], "deploy", 1.0, 200),
}

PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_tasks: {tasks}
    - ansible.builtin.copy:
        content: "{{{{ vllm_ready_timeout_effective }}}}"
        dest: "{{{{ out_dir }}}}/{{{{ inventory_hostname }}}}.txt"
        mode: "0600"
"""


@pytest.fixture(scope="module")
def waits(tmp_path_factory) -> dict[str, int]:
    tmp = tmp_path_factory.mktemp("wait")
    hosts = {}
    for name, (records, trigger, margin, _) in CASES.items():
        history = tmp / f"{name}.jsonl"
        if records:
            history.write_text("".join(json.dumps(r) + "\n" for r in records))
        hosts[name] = {"vllm_cold_start_history": str(history), "vllm_history_trigger": trigger,
                       "vllm_ready_timeout": 900, "vllm_ready_timeout_min": 150,
                       "vllm_cold_start_regression_margin": margin}
    playbook = PLAYBOOK.format(tasks=REPO / "roles/vllm/tasks/cold_start_history.yml")
    return {name: int(text) for name, text in run_cases(tmp, hosts, playbook).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_readiness_wait(waits, case):
    assert waits[case] == CASES[case][3]
