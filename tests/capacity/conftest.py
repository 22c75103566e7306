"""Shared inputs of the capacity planner tests, read from where the deployment reads them.

* published ``config.json`` files: ``models/configs/`` (the example inventory's profiles read theirs
  from there too);
* the GPU and the engine settings: the vllm role's defaults (``vllm_gpu_expected``, ``vllm_engine``);
* the testbed's tiny Llama and its workload: the testbed inventory (what molecule deploys; the model
  itself is written by tests/testbed/engine/make_tiny_model.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).parents[2] / "models" / "configs"

_ROLE_DEFAULTS = yaml.safe_load((REPO / "roles/vllm/defaults/main.yml").read_text())
_TESTBED = yaml.safe_load((REPO / "inventories/testbed/group_vars/teamserve/main.yml").read_text())

# The one GPU the role plans for before nvidia-smi has reported (RTX PRO 6000 Blackwell, 97,887 MiB).
RTX_PRO_6000: dict[str, Any] = dict(_ROLE_DEFAULTS["vllm_gpu_expected"][0])
# The role's engine defaults, with the vLLM release they template in.
ENGINE: dict[str, Any] = dict(_ROLE_DEFAULTS["vllm_engine"], vllm_version=_ROLE_DEFAULTS["vllm_version"])


def load_config(name: str) -> dict[str, Any]:
    """A published config.json from ``models/configs/``, by file stem (``<org>--<repo>``)."""
    config: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return config


def tiny_llama_config() -> dict[str, Any]:
    """The testbed tiny Llama's config, as the testbed inventory gives it to the planner."""
    config: dict[str, Any] = copy.deepcopy(_TESTBED["vllm_model"]["config"])
    return config


@pytest.fixture
def tiny_model() -> dict[str, Any]:
    """The testbed inventory's ``vllm_model`` (a fresh copy per test)."""
    model: dict[str, Any] = copy.deepcopy(_TESTBED["vllm_model"])
    return model


@pytest.fixture
def workload() -> dict[str, Any]:
    """The testbed inventory's ``vllm_workload`` (8 sequences of 1,000 tokens, 2,048 maximum)."""
    wl: dict[str, Any] = copy.deepcopy(_TESTBED["vllm_workload"])
    return wl
