"""Which card a playbook plans for, outside site.yml.

site.yml's preflight runs before the driver reports the GPUs, and users.yml, upgrade.yml, verify.yml,
sweep.yml and cold_start.yml never run the driver at all: they used to plan for the inventory's
vllm_gpu_expected (an RTX PRO 6000 by default) whatever card the box has. The vllm role now records the plan
its engine runs, with the GPUs it was made for (vllm_plan_record), and both entry points take the card
from there. Each case is a "box" (a localhost inventory host) whose record says an H200 (the nvidia-smi
fields measured on one), or that has no record.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from repo_modules import run_cases

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/main.yml").read_text())["vllm_model"]
LOCAL_MODEL = {k: v for k, v in TINY.items() if k != "revision"} | {"name": "/opt/models/teamserve-tiny"}
WORKLOAD = {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 2048}
# nvidia-smi --query-gpu=index,name,memory.total,compute_cap,driver_version on an H200.
H200 = [{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "compute_cap": "9.0",
         "driver_version": "580.159.04"}]
EXPECTED = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"  # the vllm role's vllm_gpu_expected

PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: vllm
        tasks_from: plan
      when: entry_point == 'plan'
    - ansible.builtin.include_role:
        name: vllm
        tasks_from: deployed
      when: entry_point == 'deployed'
    - ansible.builtin.copy:
        content: "{{ {'gpu': vllm_plan.numbers.gpu, 'max_num_seqs': vllm_plan.flags['max-num-seqs'],
                      'argv': vllm_argv, 'total': (vllm_plan.numbers.sources | default({})).total | default(''),
                      'shape': __vllm_planned_gpus | default(none)} | to_json }}"
        dest: "{{ out_dir }}/{{ inventory_hostname }}.txt"
        mode: "0600"
      delegate_to: localhost
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("gpus")
    recorded = {"gpus": H200, "plan": {"numbers": {"gpu": "NVIDIA H200"}, "flags": {"max-num-seqs": 7}},
                "argv": ["recorded"], "ceilings": {}, "max_model_len": 2048, "engine_url": "http://127.0.0.1:8000",
                "api_endpoint": "/v1/chat/completions", "engine_ports": [8000], "model": LOCAL_MODEL}
    (tmp / "h200.json").write_text(json.dumps(recorded))
    common = {"vllm_api_key": "k" * 40, "vllm_image": "vllm/vllm-openai:v0.32.0@sha256:" + "ab" * 32,
              "vllm_model": LOCAL_MODEL, "vllm_workload": WORKLOAD, "vllm_data_dir": str(tmp / "data")}
    hosts = {
        "plan_on_an_h200_box": dict(common, entry_point="plan", vllm_plan_record=str(tmp / "h200.json")),
        "plan_on_a_new_box": dict(common, entry_point="plan", vllm_plan_record=str(tmp / "none.json")),
        "plan_after_the_driver_reported": dict(common, entry_point="plan", vllm_plan_record=str(tmp / "h200.json"),
                                               nvidia_driver_gpus=[dict(H200[0], name="NVIDIA H100 80GB HBM3",
                                                                        memory_total_mib=81559)]),
        "plan_after_the_driver_reported_memory_reserved": dict(
            common, entry_point="plan", vllm_plan_record=str(tmp / "h200.json"),
            nvidia_driver_gpus=[dict(H200[0], memory_reserved_mib=616)]),
        "deployed_on_an_h200_box": dict(common, entry_point="deployed", vllm_plan_record=str(tmp / "h200.json")),
        "deployed_on_a_box_without_record": dict(common, entry_point="deployed",
                                                 vllm_plan_record=str(tmp / "none.json")),
    }
    return {name: json.loads(text) for name, text in run_cases(tmp, hosts, PLAYBOOK).items()}


def test_a_playbook_outside_site_yml_plans_for_the_card_the_box_has(planned):
    assert planned["plan_on_an_h200_box"]["gpu"] == "NVIDIA H200"


def test_a_new_box_is_planned_for_the_expected_card(planned):
    assert planned["plan_on_a_new_box"]["gpu"] == EXPECTED


def test_what_the_driver_reports_in_the_run_wins(planned):
    assert planned["plan_after_the_driver_reported"]["gpu"] == "NVIDIA H100 80GB HBM3"


def test_the_drivers_memory_reserved_gives_the_exact_total(planned):
    """nvidia_driver_gpus' memory_reserved_mib reaches the planner; it is part of what a re-plan compares."""
    got = planned["plan_after_the_driver_reported_memory_reserved"]
    assert got["total"] == "nvidia-smi: memory.total 143,771 MiB - memory.reserved 616 MiB"
    assert got["shape"] == [[143771, 616, "9.0"]]


def test_a_plan_recorded_without_memory_reserved_is_still_read(planned):
    """GPU lists recorded before the driver role read memory.reserved plan with the GPU table's total."""
    got = planned["plan_on_an_h200_box"]
    assert got["total"].startswith("139.80 GiB measured") and got["shape"] == [[143771, None, "9.0"]]


def test_deployed_reads_the_recorded_plan_without_planning(planned):
    """The record's own numbers come back (a re-plan would give the tiny model's 8 sequences)."""
    assert planned["deployed_on_an_h200_box"] == {"gpu": "NVIDIA H200", "max_num_seqs": 7, "argv": ["recorded"],
                                                  "total": "", "shape": None}


def test_deployed_without_a_record_plans_from_the_inventory(planned):
    got = planned["deployed_on_a_box_without_record"]
    assert got["gpu"] == EXPECTED and got["max_num_seqs"] == 8 and "--max-num-seqs" in got["argv"]
