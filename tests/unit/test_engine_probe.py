"""Cold-start phases read from the engine log (roles/vllm/library/vllm_engine_probe.py) and the lock keys."""

from __future__ import annotations

import pathlib

import yaml
from repo_modules import load

from ansible_collections.teamserve.core.plugins.module_utils import vllm_log as log

ROOT = pathlib.Path(__file__).resolve().parents[2]
probe = load("vllm_engine_probe", "roles/vllm/library/vllm_engine_probe.py")

STARTED = probe.parse_docker_time("2026-11-30T10:00:00.000000000Z")

# The shape of a vLLM 0.32 V1 start-up on a GPU (docker logs --timestamps); line texts as vLLM prints them
# (see the markers' sources in the module). The CPU build prints the same lines except graph capture.
GPU_LOG = """\
2026-11-30T10:00:01.500000000Z INFO 11-30 10:00:01 [api_server.py:1000] vLLM API server version 0.32.0
2026-11-30T10:00:30.250000000Z (EngineCore pid=80) INFO 11-30 10:00:30 [default_loader.py:397] Loading weights took 26.93 seconds
2026-11-30T10:00:31.000000000Z (EngineCore pid=80) INFO 11-30 10:00:31 [gpu_model_runner.py:295] Model loading took 7.64 GiB memory and 28.969258 seconds
2026-11-30T10:00:45.000000000Z (EngineCore pid=80) INFO 11-30 10:00:45 [monitor.py:34] torch.compile takes 12.51 s in total
not a log line
2026-11-30T10:00:46.000000000Z (EngineCore pid=80) INFO 11-30 10:00:46 [kv_cache_utils.py:1000] GPU KV cache size: 613,024 tokens
2026-11-30T10:01:03.000000000Z (EngineCore pid=80) INFO 11-30 10:01:03 [gpu_model_runner.py:1608] Graph capturing finished in 17 secs, took 0.48 GiB
2026-11-30T10:01:03.500000000Z (EngineCore pid=80) INFO 11-30 10:01:03 [core.py:162] init engine (profile, create kv cache, warmup model) took 34.11 seconds
2026-11-30T10:01:05.000000000Z (APIServer pid=1) INFO:     Application startup complete.
2026-11-30T10:01:09.000000000Z (EngineCore pid=80) INFO 11-30 10:01:09 [monitor.py:34] torch.compile takes 99.0 s in total
"""


def test_phases_are_seconds_from_container_start():
    phases, logged = probe.parse_start_phases(GPU_LOG.splitlines(), STARTED)
    assert phases == {
        "weights_loaded": 30.25,  # "Loading weights took" comes first
        "compiled": 45.0,
        "graphs_captured": 63.0,
        "engine_initialised": 63.5,
        "api_started": 65.0,
    }
    # The first occurrence counts; later repeats (a second compile) do not move a phase.
    assert logged == {
        "weights_loading": 26.93,
        "model_loading": 28.969258,
        "torch_compile": 12.51,
        "graph_capture": 17.0,
        "engine_init": 34.11,
    }


def test_missing_phases_are_none_not_zero():
    cpu_log = [line for line in GPU_LOG.splitlines() if "Graph capturing" not in line]
    phases, logged = probe.parse_start_phases(cpu_log, STARTED)
    assert phases["graphs_captured"] is None and logged["graph_capture"] is None
    assert phases["api_started"] == 65.0
    assert probe.parse_start_phases([], STARTED) == (dict.fromkeys(probe.PHASE_MARKERS), dict.fromkeys(probe.LOGGED_DURATIONS))


# Lines of the testbed's real vLLM 0.32.0 CPU build (docker logs --timestamps of a restart).
CPU_LOG = """\
2026-11-30T10:00:25.864695545Z (Worker pid=34) INFO 11-30 13:07:05 [cpu_model_runner.py:68] Starting to load model /opt/models/teamserve-tiny...
2026-11-30T10:00:26.096451704Z (Worker pid=34) INFO 11-30 13:07:06 [default_loader.py:501] Loading weights took 0.01 seconds
2026-11-30T10:00:27.408937406Z (Worker pid=34) INFO 11-30 13:07:07 [cpu_model_runner.py:87] Warming up model for the compilation...
2026-11-30T10:00:46.665135334Z (Worker pid=34) INFO 11-30 13:07:26 [cpu_model_runner.py:91] Warming up done.
2026-11-30T10:00:47.286866361Z (EngineCore pid=21) INFO 11-30 13:07:27 [core.py:402] init engine (profile, create kv cache, warmup model) took 19.88 s
2026-11-30T10:00:48.958015225Z INFO:     Application startup complete.
"""


def test_cpu_build_phases():
    phases, logged = probe.parse_start_phases(CPU_LOG.splitlines(), STARTED)
    assert phases == {"weights_loaded": 26.1, "compiled": 46.67, "graphs_captured": None,
                      "engine_initialised": 47.29, "api_started": 48.96}
    assert logged["weights_loading"] == 0.01 and logged["engine_init"] == 19.88 and logged["torch_compile"] is None


def test_older_model_loading_wording_is_read():
    # vLLM 0.9-era wording, without "memory" (seen in public start-up logs).
    line = "2026-11-30T10:00:02.000000000Z INFO [gpu_model_runner.py:1273] Model loading took 3.4213 GiB and 0.902026 seconds"
    phases, logged = probe.parse_start_phases([line], STARTED)
    assert phases["weights_loaded"] == 2.0 and logged["model_loading"] == 0.902026


def test_lock_files_hold_exactly_the_lock_keys():
    keys = yaml.safe_load((ROOT / "playbooks/vars/lock.yml").read_text())["teamserve_lock_keys"]
    for inventory in ("example", "testbed"):
        lock = yaml.safe_load((ROOT / "inventories" / inventory / "group_vars/teamserve/lock.yml").read_text())
        assert sorted(lock) == sorted(keys), inventory
    gpu_keys = yaml.safe_load((ROOT / "playbooks/vars/lock.yml").read_text())["teamserve_lock_gpu_host_keys"]
    assert set(gpu_keys) <= set(keys)


# --- why an engine failed, from its log ---------------------------------------------------------------------

ARGPARSE_LOG = """\
2026-12-03T09:10:01.100000000Z usage: vllm serve [model_tag] [options]
2026-12-03T09:10:01.100000000Z vllm serve: error: argument --max-logprobs: invalid int value: 'many'
"""

# An engine-core failure: the reason is in the engine process's traceback; the API server's last line only
# points at it (vllm/v1/engine/utils.py, "Engine core initialization failed. See root cause above.").
ENGINE_CORE_LOG = """\
(EngineCore_DP0 pid=80) ERROR 12-03 09:10:30 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=80) ERROR 12-03 09:10:30 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=80) ERROR 12-03 09:10:30 [core.py:708]   File "/usr/lib/python3/vllm/v1/engine/core.py", line 699, in run_engine_core
(EngineCore_DP0 pid=80) ERROR 12-03 09:10:30 [core.py:708] ValueError: Free memory on device (10.2/79.1 GiB) \
on startup is less than desired GPU memory utilization (0.9, 71.2 GiB).
(APIServer pid=1) Traceback (most recent call last):
(APIServer pid=1)   File "/usr/local/bin/vllm", line 10, in <module>
(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""

PYDANTIC_LOG = """\
(APIServer pid=1) Traceback (most recent call last):
(APIServer pid=1)   File "/usr/local/lib/python3.12/dist-packages/vllm/engine/arg_utils.py", line 1200, in create_model_config
(APIServer pid=1) pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
(APIServer pid=1)   Value error, User-specified max_model_len (99999) is greater than the derived max_model_len (2048). [type=value_error]
(APIServer pid=1)     For further information visit https://errors.pydantic.dev/2.11/v/value_error
(APIServer pid=1) INFO 12-03 09:11:00 [launcher.py:80] Shutting down FastAPI HTTP server.
"""


def test_engine_failure_is_argparse_error_first():
    assert log.engine_failure(ARGPARSE_LOG.splitlines()) == (
        "vllm serve: error: argument --max-logprobs: invalid int value: 'many'")


def test_engine_failure_skips_the_pointer_to_the_root_cause():
    assert log.engine_failure(ENGINE_CORE_LOG.splitlines()) == (
        "ValueError: Free memory on device (10.2/79.1 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 71.2 GiB).")


def test_engine_failure_keeps_pydantic_details():
    reason = log.engine_failure(PYDANTIC_LOG.splitlines())
    assert reason.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
                             "Value error, User-specified max_model_len (99999) is greater than")
    assert "Shutting down" not in reason


def test_engine_failure_is_none_without_an_error_and_cut_to_the_limit():
    assert log.engine_failure(["INFO 12-03 09:10:00 [api_server.py:1] vLLM API server version 0.32.0"]) is None
    long = log.engine_failure([f"ValueError: {'x' * 1000}"], limit=100)
    assert len(long) == 100 and long.endswith("…")


def test_the_probe_sends_a_completion_to_a_completions_only_model():
    # a model without a chat template answers chat requests with 400; /v1/completions needs a prompt
    completion = probe.probe_body("https://gw:8443/v1/completions", "tiny")
    assert completion["prompt"] and "messages" not in completion and completion["stream"]
    chat = probe.probe_body("https://gw:8443/v1/chat/completions", "tiny")
    assert chat["messages"][0]["role"] == "user" and "prompt" not in chat
    assert completion["max_tokens"] == chat["max_tokens"] == 8
