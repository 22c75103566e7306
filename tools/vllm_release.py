#!/usr/bin/env python3
"""What a vLLM release changes for this project, on one page: ``python3 tools/vllm_release.py VERSION``.

From the release's GPU wheel on PyPI (the code the official ``vllm/vllm-openai`` image runs) this tool
writes, next to the vllm role's other per-release files in ``roles/vllm/files/``:

* ``vllm-serve-options-<release>.json``: ``vllm serve``'s options, read from vLLM's own parser by
  ``tools/vllm_serve_options.py`` (the wheel unpacked over ``--image``, an image with vLLM's Python
  dependencies, in a ``docker run --rm --network none`` container; skipped with ``--no-options`` or when
  the parse fails, which the report then says, naming the import that failed);
* ``vllm-routes-<release>.json``: the HTTP routes, read from the wheel's source by
  ``tools/vllm_routes.py`` (``ast``, nothing imported);
* ``vllm-architectures-<release>.json``: the model registry (``vllm/model_executor/models/registry.py``),
  the quantisation methods (``vllm/model_executor/layers/quantization/__init__.py``) and the
  architecture-specific rewrites of a checkpoint's ``quant_method``
  (``vllm/model_executor/models/config.py``, ``MODELS_CONFIG_MAP``), all read with ``ast`` (the registry
  module imports torch and transformers at its top);

and the report ``docs/releases/vllm-<release>.md`` against the pinned release (``vllm_version`` of the
lock file ``inventories/example/group_vars/teamserve/lock.yml``, else the vllm role's default): options
added, removed and deprecated; routes added and removed, each classified for the gateway the way
``tests/gateway/test_caddy_paths.py`` sorts them (``caddy_proxied_paths``, ``__caddy_never_proxied``,
``__caddy_user_apis``); architectures and quantisation methods added and removed; and, for every vLLM
function, method or class that ``teamserve_capacity/*.py`` cites in its docstrings and comments, whether
its source changed (a SHA-256 of its ``ast`` without docstrings, in each wheel).

The wheels are fetched with ``pip download --no-deps --only-binary=:all: --platform
manylinux_2_28_x86_64 --python-version 3.11 vllm==<release> -d .cache/wheels`` (kept there) and each one's
SHA-256 is checked against the digest PyPI's JSON API gives for that file; a mismatch stops the tool.

Usage::

    python3 tools/vllm_release.py 0.33.0 --image vllm/vllm-openai:v0.32.0
    python3 tools/vllm_release.py 0.33.0 --no-options            # no Docker: routes, registry, report
    python3 tools/vllm_release.py 0.32.0 --only architectures    # one file of the pinned release

Errors (exit status 1, message on stderr): pip download fails; the wheel's SHA-256 differs from PyPI's or
PyPI lists no such file; the wheel lacks a file the tool reads; a per-release file the report needs is
missing and was not written in this run.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tokenize
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
ROLE_FILES = REPO / "roles" / "vllm" / "files"
REPORTS = REPO / "docs" / "releases"
CACHE = REPO / ".cache" / "wheels"
TOOL_PATH = "tools/vllm_release.py"
PLATFORM_TAG = "manylinux_2_28_x86_64"
PYPI_JSON = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON = "https://pypi.org/pypi/vllm/json"
REGISTRY_FILE = "vllm/model_executor/models/registry.py"
QUANT_FILE = "vllm/model_executor/layers/quantization/__init__.py"
MODEL_CONFIG_FILE = "vllm/model_executor/models/config.py"
# vLLM's --api-key middleware guards these prefixes only (roles/caddy/vars/main.yml says so of
# __caddy_never_proxied); a route outside them answers anyone who reaches the engine.
API_KEY_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
_RELEASE = re.compile(r"^\d+\.\d+\.\d+$")
# Planner modules that mirror no memory accounting: registry.py cites what decides whether vLLM loads a
# model at all (ModelConfig), which the architectures file covers.
NOT_ACCOUNTING = frozenset({"registry.py"})


class ToolError(Exception):
    """A failure the user can act on; ``main`` prints it and exits with status 1."""


def _load_tool(name: str) -> ModuleType:
    """Import a sibling tool (``tools/<name>.py``) by path: tools/ is not a package."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_options = _load_tool("vllm_serve_options")
vllm_routes = _load_tool("vllm_routes")


# --- the wheel -------------------------------------------------------------------------------------

def wheel_name(version: str) -> str:
    """The GPU wheel's file name on PyPI for ``version`` (vLLM publishes one abi3 wheel per platform)."""
    return f"vllm-{version}-cp38-abi3-{PLATFORM_TAG}.whl"


def sha256_of(path: Path) -> str:
    """SHA-256 (hex) of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as answer:  # noqa: S310 - a fixed https URL
        return json.load(answer)


def pypi_digest(version: str, filename: str, get_json: Callable[[str], Any] = _get_json) -> str:
    """The SHA-256 PyPI's JSON API gives for ``filename`` of release ``version``.

    Reads ``/pypi/vllm/<version>/json`` (``urls``), and ``/pypi/vllm/json`` (``releases[version]``) when
    the first is not served. ``get_json``: URL -> parsed JSON (tests pass a stub). Raises ToolError when
    PyPI lists no such file.
    """
    try:
        files = get_json(PYPI_JSON.format(version=version)).get("urls", [])
    except urllib.error.HTTPError:
        files = get_json(PYPI_PROJECT_JSON).get("releases", {}).get(version, [])
    for entry in files:
        if entry.get("filename") == filename:
            return str(entry["digests"]["sha256"])
    raise ToolError(f"PyPI lists no file {filename} for vllm {version}; is {version} released for {PLATFORM_TAG}?")


def fetch_wheel(version: str, cache: Path = CACHE) -> tuple[Path, str]:
    """Download (unless cached) and verify the GPU wheel of ``version``.

    Output: (path, SHA-256 hex). Raises ToolError when pip fails or the digest differs from PyPI's.
    """
    path = cache / wheel_name(version)
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "--platform", PLATFORM_TAG, "--python-version", "3.11", f"vllm=={version}",
                              "-d", str(cache), "-q"], capture_output=True, text=True, check=False)
        if run.returncode != 0 or not path.is_file():
            raise ToolError(f"pip download vllm=={version} failed: {(run.stderr or run.stdout).strip()[-1500:]}")
    digest = sha256_of(path)
    expected = pypi_digest(version, path.name)
    if digest != expected:
        raise ToolError(f"{path}: SHA-256 {digest} differs from PyPI's {expected}; delete the file and rerun")
    return path, digest


class Wheel:
    """The Python sources of an unpacked-on-demand wheel: ``text(path)`` for ``vllm/...`` paths."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self.names = sorted(n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py"))

    def text(self, name: str) -> str:
        """Source of ``name``; raises ToolError when the wheel has no such file."""
        try:
            return self._zip.read(name).decode("utf-8", errors="replace")
        except KeyError as exc:
            raise ToolError(f"{self.path.name} has no {name}; has vLLM moved it?") from exc

    def sources(self) -> Iterable[tuple[str, str]]:
        """(path, source) of every Python file under ``vllm/``."""
        for name in self.names:
            yield name, self.text(name)


# --- the model registry ----------------------------------------------------------------------------

# Node types a registry table may use: literals, and dict comprehensions over another table's ``.items()``
# (0.32.0's _EMBEDDING_MODELS repeats every text model whose class is LlamaForCausalLM).
_TABLE_NODES = (ast.Expression, ast.Dict, ast.DictComp, ast.comprehension, ast.Constant, ast.Tuple, ast.List,
                ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Call, ast.Compare, ast.Eq, ast.NotEq, ast.In,
                ast.NotIn, ast.BoolOp, ast.And, ast.Or)


def table_value(node: ast.expr, tables: Mapping[str, Any]) -> Any:
    """Evaluate a data expression of vLLM's source: a literal, or dicts merged and filtered from the
    ``tables`` already read (names -> values). Anything else (a call other than ``.items()``, an import,
    an attribute other than ``items``) raises ToolError, so nothing from the wheel runs beyond that."""
    for inner in ast.walk(node):
        if not isinstance(inner, _TABLE_NODES) or (isinstance(inner, ast.Attribute) and inner.attr != "items") or (
                isinstance(inner, ast.Call) and not (isinstance(inner.func, ast.Attribute) and not inner.args)):
            raise ToolError(f"cannot read `{ast.unparse(node)[:80]}` without running it; read it by hand")
    code = compile(ast.Expression(body=node), "<vllm table>", "eval")
    return eval(code, {"__builtins__": {}}, dict(tables))  # noqa: S307 - checked above: data only


def _assigned(tree: ast.Module, name: str, tables: Mapping[str, Any] | None = None) -> Any:
    """The value of the module-level assignment ``name = ...`` in ``tree`` (:func:`table_value`), else None."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(t, ast.Name) and t.id == name for t in _targets(node)):
            return table_value(node.value, tables or {})
    return None


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def registry_architectures(registry_source: str) -> dict[str, dict[str, Any]]:
    """Architectures of vLLM's model registry, read with ``ast`` from ``registry.py``'s source.

    ``_VLLM_MODELS`` is built as ``{**_TEXT_GENERATION_MODELS, **_EMBEDDING_MODELS, ...}``: each merged
    table is a literal ``{"<architecture>": ("<module>", "<class>")}``. Output: architecture ->
    ``{"module", "class", "kinds"}``: module and class of the last table listing it (as in the merged
    dict), kinds every table that lists it, by its name without ``_`` and ``_MODELS`` in lower case
    ("text_generation", "embedding", "multimodal", "transformers_backend", ...).
    Raises ToolError when ``_VLLM_MODELS`` is not such a merge (the registry's layout changed).
    """
    tree = ast.parse(registry_source)
    merged = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "_VLLM_MODELS" for t in node.targets)), None)
    if not isinstance(merged, ast.Dict) or not merged.keys or any(k is not None for k in merged.keys):
        raise ToolError("registry.py: _VLLM_MODELS is not a merge of literal tables; read it by hand")
    found: dict[str, dict[str, Any]] = {}
    tables: dict[str, Any] = {}
    for part in merged.values:
        if not isinstance(part, ast.Name):
            raise ToolError(f"registry.py: _VLLM_MODELS merges {ast.unparse(part)}, not a named table")
        table = _assigned(tree, part.id, tables)
        if not isinstance(table, dict):
            raise ToolError(f"registry.py: {part.id} is not a dict")
        tables[part.id] = table
        kind = part.id.strip("_").removesuffix("_MODELS").lower()
        for architecture, (module, cls) in table.items():
            kinds = found.get(architecture, {}).get("kinds", [])
            found[architecture] = {"module": module, "class": cls, "kinds": [*kinds, kind]}
    return dict(sorted(found.items()))


def quantization_methods(quant_source: str) -> tuple[list[str], list[str]]:
    """``QuantizationMethods`` (a ``Literal[...]``) and ``DEPRECATED_QUANTIZATION_METHODS`` of
    ``vllm/model_executor/layers/quantization/__init__.py`` -> (methods, deprecated), each sorted.
    Raises ToolError when ``QuantizationMethods`` is not a ``Literal`` of strings."""
    tree = ast.parse(quant_source)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "QuantizationMethods"
                                                 for t in node.targets) and isinstance(node.value, ast.Subscript)):
            elements = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            methods = sorted(e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str))
            deprecated = _assigned(tree, "DEPRECATED_QUANTIZATION_METHODS") or []
            return methods, sorted(str(d) for d in deprecated)
    raise ToolError("quantization/__init__.py: no QuantizationMethods = Literal[...]; read it by hand")


def quant_rewrites(config_source: str) -> dict[str, list[str]]:
    """Quantisation methods vLLM assigns to a checkpoint only for given architectures.

    ``vllm/model_executor/models/config.py`` maps architectures to classes (``MODELS_CONFIG_MAP``) whose
    hooks rewrite ``quantization_config["quant_method"]`` (gpt-oss: ``mxfp4`` -> ``gpt_oss_mxfp4``).
    Output: rewritten-to method -> the architectures whose hook writes it, sorted. Methods a hook also
    reads as a checkpoint's own (``mxfp4``) are left out: those are not bound to one architecture.
    """
    tree = ast.parse(config_source)
    written: dict[str, set[str]] = {}  # class -> methods it writes
    read: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and any(
                        isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                        and t.slice.value == "quant_method" for t in node.targets)):
                written.setdefault(cls.name, set()).add(node.value.value)
            # quant_cfg.get("quant_method") == "<method>": a method the hook reads from the checkpoint.
            left = node.left if isinstance(node, ast.Compare) else None
            if (isinstance(node, ast.Compare) and isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute)
                    and left.func.attr == "get" and left.args and isinstance(left.args[0], ast.Constant)
                    and left.args[0].value == "quant_method"):
                read.update(str(c.value) for c in node.comparators if isinstance(c, ast.Constant))
    mapping: dict[str, list[str]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Dict):
            continue
        if any(isinstance(t, ast.Name) and t.id == "MODELS_CONFIG_MAP" for t in _targets(node)):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Name):
                    for method in written.get(value.id, set()) - read:
                        mapping.setdefault(method, []).append(str(key.value))
    return {m: sorted(a) for m, a in sorted(mapping.items())}


def architectures_snapshot(wheel: Wheel, version: str, sha256: str) -> dict[str, Any]:
    """The ``vllm-architectures-<release>.json`` object (see docs/vllm-versions.md for its keys)."""
    tree = ast.parse(wheel.text(REGISTRY_FILE))
    methods, deprecated = quantization_methods(wheel.text(QUANT_FILE))
    return {
        "generated_from": {"wheel": {"file": wheel.path.name, "sha256": sha256}, "source": "PyPI",
                           "files": [REGISTRY_FILE, QUANT_FILE, MODEL_CONFIG_FILE], "tool": TOOL_PATH,
                           "date": datetime.datetime.now(datetime.UTC).date().isoformat()},
        "vllm_version": version,
        "architectures": registry_architectures(wheel.text(REGISTRY_FILE)),
        "previously_supported": dict(sorted((_assigned(tree, "_PREVIOUSLY_SUPPORTED_MODELS") or {}).items())),
        "out_of_tree": dict(sorted((_assigned(tree, "_OOT_SUPPORTED_MODELS") or {}).items())),
        "quantization_methods": methods,
        "deprecated_quantization_methods": deprecated,
        "architecture_quantization": quant_rewrites(wheel.text(MODEL_CONFIG_FILE)),
    }


def diff_architectures(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, list[str]]:
    """Architectures and quantisation methods added and removed from ``old`` to ``new`` (two
    ``vllm-architectures-*.json`` objects) -> ``{"added", "removed", "quant_added", "quant_removed"}``,
    each sorted."""
    before, after = set(old["architectures"]), set(new["architectures"])
    qb, qa = set(old.get("quantization_methods", [])), set(new.get("quantization_methods", []))
    return {"added": sorted(after - before), "removed": sorted(before - after),
            "quant_added": sorted(qa - qb), "quant_removed": sorted(qb - qa)}


# --- routes and the gateway ------------------------------------------------------------------------

class GatewayLists(NamedTuple):
    """How the project sorts the engine's routes (roles/caddy/defaults/main.yml, roles/caddy/vars/main.yml)."""

    proxied: frozenset[str]
    never: frozenset[str]
    user_apis: frozenset[str]


def gateway_lists(repo: Path = REPO) -> GatewayLists:
    """Read ``caddy_proxied_paths``, ``__caddy_never_proxied`` and ``__caddy_user_apis`` from the caddy
    role. Raises ToolError when one is missing."""
    import yaml  # the project venv's PyYAML; only the report needs it

    defaults = yaml.safe_load((repo / "roles/caddy/defaults/main.yml").read_text())
    role_vars = yaml.safe_load((repo / "roles/caddy/vars/main.yml").read_text())
    try:
        return GatewayLists(frozenset(defaults["caddy_proxied_paths"]), frozenset(role_vars["__caddy_never_proxied"]),
                            frozenset(role_vars["__caddy_user_apis"]))
    except KeyError as exc:
        raise ToolError(f"the caddy role has no {exc.args[0]}; the route classification reads it") from exc


def classify_route(route: Mapping[str, str], lists: GatewayLists) -> tuple[str, str]:
    """Where the gateway puts one route -> (class, note).

    Classes: "proxied" (in ``caddy_proxied_paths``), "never proxied" (the engine's own,
    ``__caddy_never_proxied``), "user API, off by default" (``__caddy_user_apis``: an admin adds it for a
    model that serves it), "side server" (declared outside ``vllm/entrypoints/``: a KV-connector or other
    helper server, not the OpenAI server the gateway fronts), else "to decide". The note of a route to
    decide says whether the engine's ``--api-key`` guards it (prefixes :data:`API_KEY_PREFIXES`).
    """
    path = route["path"]
    if not route.get("file", "").startswith("vllm/entrypoints/"):
        return "side server", f"declared in {route.get('file')}: not a route of the OpenAI server"
    if path in lists.proxied:
        return "proxied", "in caddy_proxied_paths"
    if path in lists.never:
        return "never proxied", "in __caddy_never_proxied"
    if path in lists.user_apis:
        return "user API, off by default", "in __caddy_user_apis"
    guarded = any(path == p or path.startswith(p + "/") for p in API_KEY_PREFIXES)
    return "to decide", ("behind the engine's --api-key: a user API, or an engine route to keep in "
                         "__caddy_never_proxied" if guarded else
                         "outside the engine's --api-key prefixes: answers anyone, so __caddy_never_proxied "
                         "unless it is a user API")


def diff_routes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Routes (method, path) added and removed from ``old`` to ``new`` (two route snapshots) ->
    ``{"added", "removed"}``, lists of route dicts sorted by path and method."""
    before = {(r["path"], r["method"]): r for r in old["routes"]}
    after = {(r["path"], r["method"]): r for r in new["routes"]}
    return {"added": [after[k] for k in sorted(set(after) - set(before))],
            "removed": [before[k] for k in sorted(set(before) - set(after))]}


# --- functions the planner mirrors -----------------------------------------------------------------

_FILE = re.compile(r"(?<![\w/.])((?:[\w]+/)*[\w]+\.py)\b")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def text_blocks(source: str) -> list[str]:
    """The docstrings and comment runs of one Python source, one string each (module docstring first)."""
    tree = ast.parse(source)
    blocks = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                blocks.append(doc)
    run: list[str] = []
    last_line = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] != last_line + 1 and run:
                blocks.append(" ".join(run))
                run = []
            run.append(tok.string.lstrip("# "))
            last_line = tok.start[0]
    if run:
        blocks.append(" ".join(run))
    return blocks


def resolve_file(mention: str, names: Iterable[str]) -> list[str]:
    """Wheel paths a file mention (``gpu_model_runner.py``, ``v1/worker/utils.py``, ``vllm/config/vllm.py``)
    stands for: the exact path, else every path ending in ``/<mention>``; empty when more than 3 match
    (too vague, e.g. ``utils.py``)."""
    names = list(names)
    if mention in names:
        return [mention]
    found = [n for n in names if n.endswith("/" + mention)]
    return found if len(found) <= 3 else []


def definitions(source: str) -> dict[str, ast.AST]:
    """Functions, methods and classes defined in one module, by qualified name (``Class.method``)."""
    found: dict[str, ast.AST] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + node.name, node)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, prefix + node.name + ".")

    visit(ast.parse(source).body, "")
    return found


def _code_like(token: str) -> bool:
    """A token that names code rather than an English word: dotted, snake_case or CamelCase."""
    return "." in token or "_" in token.strip("_") or any(c.isupper() for c in token[1:])


def cited_functions(planner_sources: Mapping[str, str], wheel_names: Iterable[str],
                    read: Callable[[str], str]) -> dict[tuple[str, str], list[str]]:
    """The vLLM definitions the planner cites.

    Inputs: ``planner_sources``, module name -> source (``teamserve_capacity/*.py``); ``wheel_names``,
    the wheel's ``vllm/**.py`` paths; ``read``, path -> source. A citation is a code-like name (dotted,
    snake_case or CamelCase) in a docstring or comment run that is defined in a file named in the same
    block or in the module's docstring. Output: (wheel path, qualified name) -> citing modules, sorted.
    A bare method name counts when one class of the file defines it.
    """
    names = list(wheel_names)
    index: dict[str, dict[str, ast.AST]] = {}
    found: dict[tuple[str, str], set[str]] = {}
    for module, source in sorted(planner_sources.items()):
        blocks = text_blocks(source)
        module_doc = ast.get_docstring(ast.parse(source), clean=False) or ""
        module_files = [p for m in _FILE.findall(module_doc) for p in resolve_file(m, names)]
        for block in blocks:
            files = sorted(set(module_files + [p for m in _FILE.findall(block) for p in resolve_file(m, names)]))
            tokens = {t for t in _NAME.findall(_FILE.sub(" ", block)) if _code_like(t)}
            for path in files:
                if path not in index:
                    index[path] = definitions(read(path))
                defs = index[path]
                for token in tokens:
                    hits = [token] if token in defs else [q for q in defs if q.endswith("." + token)]
                    if len(hits) == 1:
                        found.setdefault((path, hits[0]), set()).add(module)
    return {k: sorted(v) for k, v in sorted(found.items())}


def _strip_docstrings(node: ast.AST) -> ast.AST:
    """A copy of ``node`` without docstrings (they document, they do not account)."""
    copy = ast.parse(ast.unparse(node)).body[0]
    for inner in ast.walk(copy):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(inner):
            inner.body = inner.body[1:] or [ast.Pass()]
    return copy


def source_hash(node: ast.AST) -> str:
    """SHA-256 (first 16 hex digits) of a definition's ``ast.dump`` without docstrings or positions:
    formatting and comments do not change it, code does."""
    dumped = ast.dump(_strip_docstrings(node), include_attributes=False)
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]


def changed_members(before: ast.ClassDef, after: ast.ClassDef) -> list[str]:
    """Names of a class's methods that differ between two versions of it (added ones marked "+", removed
    "-"), and "(class body)" when its other statements (fields, class attributes, bases) differ."""
    def parts(cls: ast.ClassDef) -> tuple[dict[str, str], str]:
        methods = {n.name: source_hash(n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        rest = [n for n in cls.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))]
        header = "".join(ast.dump(n, include_attributes=False) for n in [*cls.bases, *cls.decorator_list, *rest])
        return methods, header
    (old_methods, old_rest), (new_methods, new_rest) = parts(before), parts(after)
    out = [m for m in sorted(set(old_methods) & set(new_methods)) if old_methods[m] != new_methods[m]]
    out += [f"+{m}" for m in sorted(set(new_methods) - set(old_methods))]
    out += [f"-{m}" for m in sorted(set(old_methods) - set(new_methods))]
    if old_rest != new_rest:
        out.append("(class body)")
    return out


def compare_functions(cited: Iterable[tuple[str, str]], old: Wheel | Any, new: Wheel | Any) -> list[dict[str, Any]]:
    """Hash each cited definition in both wheels.

    ``old``/``new``: objects with ``names`` (paths) and ``text(path)``. Output: one dict per definition,
    ``{"file", "name", "old", "new", "status", "new_file", "members"}`` (members: for a changed class, its
    methods and class-level statements that differ, :func:`changed_members`); status is "same", "changed", "moved" (same
    name in one other file, hashes compared there: "moved, changed" when they differ), "gone" or
    "not in the pin" (cited, but absent from the old wheel). Sorted changed-first, then by file and name.
    """
    cache: dict[tuple[int, str], dict[str, ast.AST]] = {}

    def defs(wheel: Any, path: str) -> dict[str, ast.AST]:
        key = (id(wheel), path)
        if key not in cache:
            cache[key] = definitions(wheel.text(path)) if path in wheel.names else {}
        return cache[key]

    rows = []
    for path, name in cited:
        before = defs(old, path).get(name)
        after, new_path = defs(new, path).get(name), path
        if after is None:
            elsewhere = [p for p in new.names if p != path and name in defs(new, p)] if before is not None else []
            if len(elsewhere) == 1:
                new_path, after = elsewhere[0], defs(new, elsewhere[0])[name]
        old_hash = source_hash(before) if before is not None else None
        new_hash = source_hash(after) if after is not None else None
        if old_hash is None:
            status = "not in the pin"
        elif new_hash is None:
            status = "gone"
        elif new_path != path:
            status = "moved" if old_hash == new_hash else "moved, changed"
        else:
            status = "same" if old_hash == new_hash else "changed"
        members: list[str] = []
        if isinstance(before, ast.ClassDef) and isinstance(after, ast.ClassDef) and old_hash != new_hash:
            members = changed_members(before, after)
        rows.append({"file": path, "name": name, "old": old_hash, "new": new_hash, "status": status,
                     "new_file": new_path, "members": members})
    return sorted(rows, key=lambda r: (r["status"] == "same", r["file"], r["name"]))


# --- the pin and the report ------------------------------------------------------------------------

def read_pin(repo: Path = REPO) -> tuple[str, str]:
    """The pinned vLLM release and where it was read: the lock file's ``vllm_version``
    (inventories/example/group_vars/teamserve/lock.yml, what site.yml deploys), else the vllm role's
    default. Raises ToolError when neither states one."""
    for relative in ("inventories/example/group_vars/teamserve/lock.yml", "roles/vllm/defaults/main.yml"):
        text = (repo / relative).read_text() if (repo / relative).is_file() else ""
        match = re.search(r'^vllm_version:\s*"?([0-9][^"\s]*)"?\s*$', text, re.MULTILINE)
        if match:
            return match.group(1), relative
    raise ToolError("no vllm_version in the lock file or roles/vllm/defaults/main.yml")


# vllm_serve_options.describe's note on an option string the parser accepts but hides from help.
HIDDEN_NOTE = "hidden from vLLM's help"


def failed_import(error_text: str) -> str | None:
    """The last ``ModuleNotFoundError``/``ImportError`` line of a traceback, else None."""
    lines = [ln.strip() for ln in error_text.splitlines() if re.match(r"\s*(ModuleNotFoundError|ImportError)\b", ln)]
    return lines[-1] if lines else None


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def _short(note: str | None, width: int = 160) -> str:
    text = " ".join((note or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def render_report(*, version: str, pin: str, pin_source: str, wheels: Mapping[str, tuple[str, str]],
                  options: dict[str, Any] | None, options_note: str, routes: dict[str, list[dict[str, str]]],
                  lists: GatewayLists, architectures: dict[str, list[str]], functions: list[dict[str, Any]],
                  counts: Mapping[str, int], command: str) -> str:
    """The one-page Markdown report. ``wheels``: release -> (file, sha256); ``options``: the
    :func:`vllm_serve_options.diff_snapshots` result, or None with ``options_note`` saying why;
    ``options`` may carry "new_forms" (:func:`option_spellings`); ``counts``: "options", "routes",
    "architectures" of the new release."""
    changed = [f for f in functions if f["status"] != "same"]
    added_routes = [(r, *classify_route(r, lists)) for r in routes["added"]]
    to_decide = [r for r, c, _ in added_routes if c == "to decide"]
    lines = [f"# vLLM {version} against the pin ({pin})", "",
             f"Written by `{command}` on {datetime.datetime.now(datetime.UTC).date().isoformat()}; the pin is "
             f"`vllm_version` of `{pin_source}`. Both GPU wheels come from PyPI, their SHA-256 checked against "
             "PyPI's JSON API:", ""]
    lines += _table([[release, f"`{file}`", f"`{digest}`"] for release, (file, digest) in wheels.items()],
                    ["release", "wheel", "SHA-256"])
    lines += ["", "## Summary", ""]
    if options is not None:
        lines.append(f"- options: {len(options['added'])} added, {len(options['removed'])} removed, "
                     f"{len(options['deprecated'])} newly deprecated, {len(options['choices'])} with changed "
                     f"choices ({counts.get('options', 0)} option strings in {version})")
    else:
        lines.append(f"- options: not compared ({options_note})")
    lines += [f"- routes: {len(routes['added'])} added ({len(to_decide)} for the gateway to decide), "
              f"{len(routes['removed'])} removed ({counts.get('routes', 0)} in {version})",
              f"- architectures: {len(architectures['added'])} added, {len(architectures['removed'])} removed "
              f"({counts.get('architectures', 0)} in {version}); quantisation methods: "
              f"{len(architectures['quant_added'])} added, {len(architectures['quant_removed'])} removed",
              f"- functions the planner cites: {len(changed)} of {len(functions)} changed, moved or gone", ""]
    lines += ["## Options", ""]
    if options is None:
        lines += [options_note, ""]
    else:
        lines += [f"Read from {options['source']}.", ""] if options.get("source") else []
        lines += ["Removed (the pin's deprecation note):", ""]
        lines += [f"- `{o['option']}`: {_short(o['note']) or 'no note'}" for o in options["removed"]] or ["- none"]
        new_forms = set(options.get("new_forms", []))
        fresh = [o for o in options["added"] if o not in new_forms]
        hidden = [o["option"] for o in options["deprecated"] if HIDDEN_NOTE in (o["note"] or "")]
        lines += ["", "Added: " + (", ".join(f"`{o}`" for o in fresh) or "none")]
        if new_forms:
            lines += ["", f"Added as another spelling of an option the pin already has ({len(new_forms)}): "
                      + ", ".join(f"`{o}`" for o in sorted(new_forms))]
        lines += ["", "Newly deprecated:", ""]
        lines += [f"- `{o['option']}`: {_short(o['note'])}" for o in options["deprecated"]
                  if o["option"] not in hidden] or ["- none"]
        if hidden:
            lines += [f"- still accepted but hidden from help ({len(hidden)}): " + ", ".join(f"`{o}`" for o in hidden)]
        lines += ["", "Choice values:", ""]
        lines += [f"- `{c['option']}`: removed {', '.join(c['removed']) or 'none'}; added "
                  f"{', '.join(c['added']) or 'none'}" for c in options["choices"]] or ["- none"]
        lines.append("")
    lines += ["## Routes", "", "Added, classified as tests/gateway/test_caddy_paths.py sorts them:", ""]
    lines += _table([[r["method"], f"`{r['path']}`", cls, note, f"`{r['file']}`"] for r, cls, note in added_routes],
                    ["method", "path", "gateway", "why", "declared in"]) if added_routes else ["none"]
    lines += ["", "Removed: " + (", ".join(f"{r['method']} `{r['path']}`" for r in routes["removed"]) or "none"), ""]
    lines += ["## Architectures", "",
              "Added: " + (", ".join(f"`{a}`" for a in architectures["added"]) or "none"), "",
              "Removed: " + (", ".join(f"`{a}`" for a in architectures["removed"]) or "none"), "",
              "Quantisation methods added: " + (", ".join(f"`{q}`" for q in architectures["quant_added"]) or "none")
              + "; removed: " + (", ".join(f"`{q}`" for q in architectures["quant_removed"]) or "none"), ""]
    lines += ["## Memory accounting the planner mirrors", "",
              "Each vLLM definition `teamserve_capacity/*.py` cites, hashed (SHA-256 of its `ast` without "
              "docstrings, first 16 hex digits) in both wheels. A changed one needs reading before the planner "
              "claims the release (`SUPPORTED_VLLM`, teamserve_capacity/planner.py).", ""]
    lines += _table([[f"`{f['file'] if f['new_file'] == f['file'] else f['file'] + ' → ' + f['new_file']}`",
                      f"`{f['name']}`", f["status"] + (f" ({', '.join(f['members'])})" if f.get("members") else ""),
                      f"`{f['old']}`" if f["old"] else "-",
                      f"`{f['new']}`" if f["new"] else "-"] for f in changed],
                    ["file", "definition", "status", pin, version]) if changed else ["None changed."]
    same = [f"`{f['name']}`" for f in functions if f["status"] == "same"]
    lines += ["", f"Unchanged ({len(same)}): " + (", ".join(same) or "none"), ""]
    return "\n".join(lines)


# --- the command -----------------------------------------------------------------------------------

def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)


def options_snapshot(version: str, wheel: Path, image: str) -> tuple[dict[str, Any] | None, str]:
    """The option snapshot of ``version`` via ``vllm_serve_options.snapshot_in_image`` (``--platform cpu``,
    the wheel over ``image``) -> (snapshot, "") or (None, why: the failing import when there is one)."""
    try:
        snapshot: dict[str, Any] = serve_options.snapshot_in_image(image, "PyPI", True, False, wheel)
    except serve_options.ToolError as exc:
        culprit = failed_import(str(exc))
        reason = (f"the parse of vLLM {version}'s parser over {image} failed on `{culprit}`" if culprit else
                  f"the parse over {image} failed: {_short(str(exc), 300)}")
        return None, reason
    return snapshot, ""


def option_spellings(old: Mapping[str, Any], new: Mapping[str, Any], added: Iterable[str]) -> list[str]:
    """Of the option strings ``added`` in snapshot ``new``, those whose argparse dest the ``old``
    snapshot already has: another spelling of an existing option (0.33's ``--disable-x`` beside
    ``--enable-x``), not a new setting. Sorted."""
    old_dests = {o["dest"] for o in old["options"]}
    by_option = {o["option"]: o for o in new["options"]}
    return sorted(o for o in added if by_option.get(o, {}).get("dest") in old_dests)


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring. Returns the exit status."""
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    cli.add_argument("version", help="the vLLM release, X.Y.Z")
    cli.add_argument("--against", help="the release to compare with (default: the pin)")
    cli.add_argument("--image", default="vllm/vllm-openai:v0.32.0",
                     help="image with vLLM's Python dependencies for the option parse (default: the testbed's engine)")
    cli.add_argument("--no-options", action="store_true", help="skip the option parse (no Docker)")
    cli.add_argument("--only", choices=["architectures", "routes", "options"],
                     help="write this one file of VERSION and no report")
    args = cli.parse_args(argv)
    try:
        if not _RELEASE.match(args.version):
            raise ToolError(f"version {args.version!r} is not X.Y.Z")
        new_path, new_sha = fetch_wheel(args.version)
        new = Wheel(new_path)
        written: dict[str, Any] = {}
        if args.only in (None, "architectures"):
            written["architectures"] = architectures_snapshot(new, args.version, new_sha)
            _write_json(ROLE_FILES / f"vllm-architectures-{args.version}.json", written["architectures"])
        if args.only in (None, "routes"):
            routes = {"vllm_version": args.version, "distribution": "vllm", "image": None,
                      "wheel": {"file": new_path.name, "sha256": new_sha},
                      "routes": vllm_routes.routes_from(new.sources())}
            written["routes"] = routes
            _write_json(ROLE_FILES / f"vllm-routes-{args.version}.json", routes)
        options_note = "skipped (--no-options)"
        if args.only in (None, "options") and not args.no_options:
            snapshot, options_note = options_snapshot(args.version, new_path, args.image)
            if snapshot is not None:
                written["options"] = snapshot
                _write_json(ROLE_FILES / f"vllm-serve-options-{args.version}.json", snapshot)
            else:
                print(f"vllm_release: options not written: {options_note}", file=sys.stderr)
        if args.only:
            return 0 if args.only in written else 1

        pin, pin_source = read_pin()
        against = args.against or pin
        if against == args.version:
            raise ToolError(f"{args.version} is the pin; give --against <older release>")
        old_path, old_sha = fetch_wheel(against)
        old = Wheel(old_path)

        def role_json(kind: str, release: str) -> dict[str, Any]:
            path = ROLE_FILES / f"vllm-{kind}-{release}.json"
            if not path.is_file():
                raise ToolError(f"{path.relative_to(REPO)} is missing: run `{TOOL_PATH} {release} --only "
                                f"{kind.removeprefix('serve-')}` first")
            data: dict[str, Any] = json.loads(path.read_text())
            return data

        option_diff = None
        new_options = written.get("options")
        if new_options is None and args.no_options and (ROLE_FILES / f"vllm-serve-options-{args.version}.json").is_file():
            new_options, options_note = role_json("serve-options", args.version), ""
        if new_options is not None:
            old_options = role_json("serve-options", against)
            option_diff = serve_options.diff_snapshots(old_options, new_options)
            option_diff["new_forms"] = option_spellings(old_options, new_options, option_diff["added"])
            made = new_options.get("generated_from", {})
            option_diff["source"] = (f"`vllm serve`'s parser ({new_options.get('parser')}) built from "
                                     f"{(made.get('wheel') or {}).get('file', made.get('build'))} over the image "
                                     f"{made.get('image')} (platform {made.get('platform')}), {made.get('date')}")
        old_arch = (role_json("architectures", against) if (ROLE_FILES / f"vllm-architectures-{against}.json").is_file()
                    else architectures_snapshot(old, against, old_sha))
        planner = {p.name: p.read_text() for p in sorted((REPO / "teamserve_capacity").glob("*.py"))
                   if p.name not in NOT_ACCOUNTING}
        cited = cited_functions(planner, old.names, old.text)
        command = f"python3 {TOOL_PATH} {' '.join(argv if argv is not None else sys.argv[1:])}"
        report = render_report(
            version=args.version, pin=against, pin_source=pin_source if against == pin else "--against",
            wheels={against: (old_path.name, old_sha), args.version: (new_path.name, new_sha)},
            options=option_diff, options_note=options_note,
            routes=diff_routes(role_json("routes", against), written["routes"]), lists=gateway_lists(),
            architectures=diff_architectures(old_arch, written["architectures"]),
            functions=compare_functions(cited, old, new),
            counts={"options": len((new_options or {}).get("options", [])),
                    "routes": len(written["routes"]["routes"]),
                    "architectures": len(written["architectures"]["architectures"])},
            command=command)
        REPORTS.mkdir(parents=True, exist_ok=True)
        target = REPORTS / f"vllm-{args.version}.md"
        target.write_text(report)
        print(f"wrote {target.relative_to(REPO)}", file=sys.stderr)
    except ToolError as exc:
        print(f"vllm_release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
