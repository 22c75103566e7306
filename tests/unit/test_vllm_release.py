"""The release report tool (tools/vllm_release.py): its pure parts on small fixtures, without network or
Docker (the real wheels are read when a release is added; docs/vllm-versions.md)."""

from __future__ import annotations

import ast
import textwrap
import urllib.error
from pathlib import Path

import pytest
from repo_modules import REPO, load

tool = load("vllm_release", "tools/vllm_release.py")

REGISTRY = '''
import torch.nn as nn

_TEXT_GENERATION_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
_EMBEDDING_MODELS = {
    "BertModel": ("bert", "BertEmbeddingModel"),
    **{
        k: (mod, arch)
        for k, (mod, arch) in _TEXT_GENERATION_MODELS.items()
        if arch == "LlamaForCausalLM"
    },
}
_VLLM_MODELS = {
    **_TEXT_GENERATION_MODELS,
    **_EMBEDDING_MODELS,
}
_PREVIOUSLY_SUPPORTED_MODELS = {"MPTForCausalLM": "0.28.0"}
'''

QUANT = '''
from typing import Literal, get_args
QuantizationMethods = Literal[
    "awq",
    "fp8",
    "mxfp4",
    "gpt_oss_mxfp4",
]
DEPRECATED_QUANTIZATION_METHODS = ["awq"]
'''

MODEL_CONFIG = '''
class GptOssForCausalLMConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config):
        quant_config = getattr(model_config.hf_config, "quantization_config", None)
        if quant_config is not None and quant_config.get("quant_method") == "mxfp4":
            model_config.hf_config.quantization_config["quant_method"] = "gpt_oss_mxfp4"


class KimiConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_model_config(model_config):
        quant_config = model_config.hf_config.quantization_config
        if quant_config.get("quant_method") == "compressed-tensors":
            quant_config["quant_method"] = "mxfp4"


MODELS_CONFIG_MAP: dict[str, type[VerifyAndUpdateConfig]] = {
    "GptOssForCausalLM": GptOssForCausalLMConfig,
    "KimiK3ForConditionalGeneration": KimiConfig,
}
'''


def test_the_registry_is_read_with_its_merged_tables_and_comprehensions():
    found = tool.registry_architectures(REGISTRY)
    assert set(found) == {"LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM", "BertModel"}
    # Listed by both tables (the comprehension repeats Llama-class text models among embeddings).
    assert found["LlamaForCausalLM"] == {"module": "llama", "class": "LlamaForCausalLM",
                                         "kinds": ["text_generation", "embedding"]}
    assert found["GptOssForCausalLM"]["kinds"] == ["text_generation"]


def test_a_registry_table_that_would_run_code_is_refused():
    source = REGISTRY.replace('"BertModel": ("bert", "BertEmbeddingModel"),',
                              '"BertModel": __import__("os").system("true"),')
    with pytest.raises(tool.ToolError, match="without running it"):
        tool.registry_architectures(source)


def test_a_registry_of_another_shape_is_named():
    with pytest.raises(tool.ToolError, match="_VLLM_MODELS is not a merge"):
        tool.registry_architectures("_VLLM_MODELS = build()\n")


def test_quantisation_methods_and_the_deprecated_ones():
    assert tool.quantization_methods(QUANT) == (["awq", "fp8", "gpt_oss_mxfp4", "mxfp4"], ["awq"])


def test_a_method_only_some_architectures_get_is_bound_to_them():
    """gpt_oss_mxfp4 is written for gpt-oss only; mxfp4 is also a checkpoint's own method (read by a hook),
    so it is not bound to Kimi although Kimi's hook writes it."""
    assert tool.quant_rewrites(MODEL_CONFIG) == {"gpt_oss_mxfp4": ["GptOssForCausalLM"]}


def test_architectures_diff():
    old = {"architectures": {"A": {}, "B": {}}, "quantization_methods": ["fp8", "bitsandbytes"]}
    new = {"architectures": {"B": {}, "C": {}}, "quantization_methods": ["fp8", "mxfp8"]}
    assert tool.diff_architectures(old, new) == {"added": ["C"], "removed": ["A"], "quant_added": ["mxfp8"],
                                                 "quant_removed": ["bitsandbytes"]}


LISTS = tool.GatewayLists(proxied=frozenset({"/v1/chat/completions"}), never=frozenset({"/metrics", "/sleep"}),
                          user_apis=frozenset({"/v1/rerank"}))


@pytest.mark.parametrize("path,file,expected", [
    ("/v1/chat/completions", "vllm/entrypoints/openai/chat/api_router.py", "proxied"),
    ("/sleep", "vllm/entrypoints/serve/sleep/api_router.py", "never proxied"),
    ("/v1/rerank", "vllm/entrypoints/pooling/api_router.py", "user API, off by default"),
    ("/clear", "vllm/distributed/kv_transfer/hf3fs_metadata_server.py", "side server"),
    ("/v1/decisions", "vllm/entrypoints/openai/decisions/api_router.py", "to decide"),
    ("/flush_everything", "vllm/entrypoints/serve/dev/api_router.py", "to decide"),
])
def test_routes_are_classified_as_the_gateway_test_sorts_them(path, file, expected):
    assert tool.classify_route({"path": path, "file": file, "method": "POST"}, LISTS)[0] == expected


def test_a_route_to_decide_says_whether_the_engines_key_guards_it():
    guarded = tool.classify_route({"path": "/v1/decisions", "file": "vllm/entrypoints/x.py"}, LISTS)[1]
    open_route = tool.classify_route({"path": "/v1x", "file": "vllm/entrypoints/x.py"}, LISTS)[1]
    assert guarded.startswith("behind the engine's --api-key")
    assert open_route.startswith("outside the engine's --api-key prefixes")  # /v1x is not under /v1


def test_the_caddy_role_holds_the_three_lists():
    lists = tool.gateway_lists()
    assert "/v1/chat/completions" in lists.proxied and "/metrics" in lists.never and "/v1/rerank" in lists.user_apis


def test_routes_diff():
    old = {"routes": [{"path": "/a", "method": "GET", "file": "f"}, {"path": "/b", "method": "POST", "file": "f"}]}
    new = {"routes": [{"path": "/a", "method": "GET", "file": "f"}, {"path": "/a", "method": "POST", "file": "f"},
                      {"path": "/c", "method": "GET", "file": "f"}]}
    diff = tool.diff_routes(old, new)
    assert [(r["method"], r["path"]) for r in diff["added"]] == [("POST", "/a"), ("GET", "/c")]
    assert [(r["method"], r["path"]) for r in diff["removed"]] == [("POST", "/b")]


def test_a_hash_ignores_docstrings_comments_and_layout_but_not_code():
    a = "def f(x):\n    '''Doc.'''\n    return x + 1  # one\n"
    b = "def f(x):\n    '''Other words.'''\n    # a comment\n    return (x\n            + 1)\n"
    c = "def f(x):\n    return x + 2\n"
    hashes = [tool.source_hash(ast.parse(src).body[0]) for src in (a, b, c)]
    assert hashes[0] == hashes[1] != hashes[2]
    assert len(hashes[0]) == 16


OLD_SRC = {
    "vllm/v1/kv_cache_interface.py": textwrap.dedent('''
        class AttentionSpec:
            block_size: int

            def page_size_bytes(self):
                return 2 * self.block_size

            def merge(self, other):
                return self
        '''),
    "vllm/v1/core/kv_cache_utils.py": "def max_memory_usage_bytes(x):\n    return x\n",
    "vllm/utils/mem_utils.py": "def memory_profiling():\n    return 1\n",
    "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    def profile_run(self):\n        return 0\n",
}
NEW_SRC = {
    "vllm/v1/kv_cache_interface.py": textwrap.dedent('''
        class AttentionSpec:
            block_size: int
            kernel_block_size: int

            def page_size_bytes(self):
                return 2 * self.kernel_block_size

            def merge(self, other):
                return self

            def alignment(self):
                return 16
        '''),
    "vllm/v1/core/kv_cache_planning.py": "def max_memory_usage_bytes(x):\n    return x\n",
    "vllm/utils/mem_utils.py": "def memory_profiling():\n    return 1\n",
    "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    pass\n",
}


class FakeWheel:
    """What compare_functions and cited_functions read of a wheel: its paths and their text."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.names = sorted(files)

    def text(self, name: str) -> str:
        return self.files[name]


PLANNER = {
    "kv.py": '"""Sources: ``vllm/v1/kv_cache_interface.py``: ``AttentionSpec.page_size_bytes``;\n'
             '``kv_cache_utils.py`` ``max_memory_usage_bytes``."""\n'
             "# the profile run (gpu_model_runner.py profile_run) and mem_utils.py memory_profiling\nX = 1\n",
    "memory.py": 'def f():\n    """Follows ``AttentionSpec`` (kv_cache_interface.py); the word page or merge is prose."""\n',
}


def test_cited_definitions_are_found_in_docstrings_and_comments():
    wheel = FakeWheel(OLD_SRC)
    cited = tool.cited_functions(PLANNER, wheel.names, wheel.text)
    assert set(cited) == {
        ("vllm/v1/kv_cache_interface.py", "AttentionSpec.page_size_bytes"),
        ("vllm/v1/kv_cache_interface.py", "AttentionSpec"),
        ("vllm/v1/core/kv_cache_utils.py", "max_memory_usage_bytes"),
        ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.profile_run"),
        ("vllm/utils/mem_utils.py", "memory_profiling"),
    }
    assert cited[("vllm/v1/kv_cache_interface.py", "AttentionSpec")] == ["memory.py"]


def test_a_vague_file_mention_resolves_to_nothing():
    names = [f"vllm/a{i}/utils.py" for i in range(5)] + ["vllm/v1/worker/utils.py"]
    assert tool.resolve_file("utils.py", names) == []
    assert tool.resolve_file("v1/worker/utils.py", names) == ["vllm/v1/worker/utils.py"]


def test_definitions_are_compared_across_releases():
    rows = {r["name"]: r for r in tool.compare_functions(
        [("vllm/v1/kv_cache_interface.py", "AttentionSpec"),
         ("vllm/v1/kv_cache_interface.py", "AttentionSpec.page_size_bytes"),
         ("vllm/v1/core/kv_cache_utils.py", "max_memory_usage_bytes"),
         ("vllm/utils/mem_utils.py", "memory_profiling"),
         ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.profile_run")],
        FakeWheel(OLD_SRC), FakeWheel(NEW_SRC))}
    assert rows["AttentionSpec"]["status"] == "changed"
    assert rows["AttentionSpec"]["members"] == ["page_size_bytes", "+alignment", "(class body)"]
    assert rows["AttentionSpec.page_size_bytes"]["status"] == "changed"
    assert rows["max_memory_usage_bytes"]["status"] == "moved"
    assert rows["max_memory_usage_bytes"]["new_file"] == "vllm/v1/core/kv_cache_planning.py"
    assert rows["memory_profiling"]["status"] == "same"
    assert rows["GPUModelRunner.profile_run"]["status"] == "gone"


def test_the_option_spellings_of_existing_settings_are_told_from_new_options():
    old = {"options": [{"option": "--enable-prefix-caching", "dest": "enable_prefix_caching"}]}
    new = {"options": [{"option": "--enable-prefix-caching", "dest": "enable_prefix_caching"},
                       {"option": "--disable-prefix-caching", "dest": "enable_prefix_caching"},
                       {"option": "--watchdog-config", "dest": "watchdog_config"}]}
    assert tool.option_spellings(old, new, ["--disable-prefix-caching", "--watchdog-config"]) == [
        "--disable-prefix-caching"]


def test_the_pin_is_read_from_the_lock_file_first(tmp_path: Path):
    (tmp_path / "roles/vllm/defaults").mkdir(parents=True)
    (tmp_path / "roles/vllm/defaults/main.yml").write_text('vllm_version: "0.31.0"\n')
    assert tool.read_pin(tmp_path) == ("0.31.0", "roles/vllm/defaults/main.yml")
    lock = tmp_path / "inventories/example/group_vars/teamserve/lock.yml"
    lock.parent.mkdir(parents=True)
    lock.write_text('# vLLM\nvllm_version: "0.33.0"\nvllm_image_digest: ""\n')
    assert tool.read_pin(tmp_path) == ("0.33.0", "inventories/example/group_vars/teamserve/lock.yml")
    assert tool.read_pin(REPO)[1] == "inventories/example/group_vars/teamserve/lock.yml"


def test_pypi_digest_falls_back_to_the_project_listing():
    name = tool.wheel_name("0.33.0")

    def get_json(url: str):
        if url.endswith("/0.33.0/json"):
            raise urllib.error.HTTPError(url, 404, "Not Found", None, None)  # type: ignore[arg-type]
        return {"releases": {"0.33.0": [{"filename": name, "digests": {"sha256": "ab" * 32}}]}}

    assert tool.pypi_digest("0.33.0", name, get_json) == "ab" * 32
    with pytest.raises(tool.ToolError, match="PyPI lists no file"):
        tool.pypi_digest("0.33.0", "vllm-0.33.0-other.whl", get_json)


def test_the_failing_import_is_named():
    log = "Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'uvloop'\n"
    assert tool.failed_import(log) == "ModuleNotFoundError: No module named 'uvloop'"
    assert tool.failed_import("exit 1: something else") is None
