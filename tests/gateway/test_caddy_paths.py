"""The gateway's endpoint allowlist (caddy_proxied_paths) against the pinned vLLM's own route table
(roles/vllm/files/vllm-routes-<version>.json, written by tools/vllm_routes.py from vLLM's source).

When the vLLM pin moves, these tests ask for the new release's snapshot and for every route it adds to
be sorted: proxied by default, never proxied (the engine's own routes), or a user API the admin may add.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from repo_modules import load  # noqa: E402

paths = load("caddy_paths", "roles/caddy/filter_plugins/caddy_paths.py")
DEFAULTS = yaml.safe_load((REPO / "roles/caddy/defaults/main.yml").read_text())
NEVER = yaml.safe_load((REPO / "roles/caddy/vars/main.yml").read_text())["__caddy_never_proxied"]
# User APIs a text-chat box does not serve by default (roles/caddy/vars/main.yml says why).
LEFT_TO_THE_ADMIN = set(yaml.safe_load((REPO / "roles/caddy/vars/main.yml").read_text())["__caddy_user_apis"])


def pinned_version() -> str:
    return yaml.safe_load((REPO / "inventories/example/group_vars/teamserve/lock.yml").read_text())["vllm_version"]


# Every release the vllm role has an option snapshot for may be deployed (and upgraded from).
SUPPORTED = sorted(p.name.removeprefix("vllm-serve-options-").removesuffix(".json")
                   for p in (REPO / "roles/vllm/files").glob("vllm-serve-options-*.json"))


def pinned_routes(version: str) -> dict:
    snapshot = REPO / "roles/vllm/files" / f"vllm-routes-{version}.json"
    assert snapshot.exists(), (f"no route snapshot for vLLM {version}: run "
                               f"`python3 tools/vllm_routes.py --image vllm/vllm-openai:v{version} --write`")
    return json.loads(snapshot.read_text())


def server_routes(version: str) -> set[str]:
    """Paths the OpenAI-compatible server declares (KV-connector side servers left out)."""
    return {r["path"] for r in pinned_routes(version)["routes"] if r["file"].startswith("vllm/entrypoints/")}


def test_the_pinned_vllm_is_supported():
    assert pinned_version() in SUPPORTED


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_default_path_is_a_route_of_each_supported_vllm(version):
    assert set(DEFAULTS["caddy_proxied_paths"]) <= server_routes(version)


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_route_of_each_supported_vllm_is_sorted(version):
    unsorted = server_routes(version) - set(DEFAULTS["caddy_proxied_paths"]) - set(NEVER) - LEFT_TO_THE_ADMIN
    assert not unsorted, f"new engine routes: decide for each whether the gateway may proxy it: {sorted(unsorted)}"


def test_the_default_list_reaches_none_of_the_engines_own_routes():
    assert paths.caddy_paths_exposing(DEFAULTS["caddy_proxied_paths"], NEVER) == []
    assert not set(DEFAULTS["caddy_proxied_paths"]) & set(NEVER)


@pytest.mark.parametrize("pattern,hit", [
    ("/*", "/metrics"), ("/v1/*", "/v1/load_lora_adapter"), ("/metrics", "/metrics"), ("*invocations", "/invocations"),
    ("/V1/Load_Lora_Adapter", "/v1/load_lora_adapter"), ("/reset_*", "/reset_prefix_cache"),
    ("/v1/responses/*", "/v1/responses/{response_id}")])
def test_patterns_that_reach_the_engines_own_routes_are_named(pattern, hit):
    [found] = paths.caddy_paths_exposing(["/v1/models", pattern], NEVER)
    assert found.startswith(f"{pattern} (matches ") and hit in found


def test_user_endpoints_an_admin_adds_pass():
    assert paths.caddy_paths_exposing(["/v1/audio/transcriptions", "/v1/rerank", "/v1/embeddings"], NEVER) == []


def test_the_route_tool_reads_decorators_calls_and_mounts():
    tool = load("vllm_routes", "tools/vllm_routes.py")
    source = '''
@router.post(
    "/v1/chat/completions",
    dependencies=[Depends(validate_json_request)],
)
async def create_chat_completion(request): ...

@app.get("/health")
async def health(): ...

app.add_api_route("/version", show_version, methods=["GET", "HEAD"])
app.routes.append(Mount("/metrics", make_asgi_app()))
logger.info("see /docs for the API")
'''
    found = {(r["method"], r["path"]) for r in tool.routes_in(source, "vllm/entrypoints/x.py")}
    assert found == {("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/version"), ("HEAD", "/version"),
                     ("MOUNT", "/metrics")}
