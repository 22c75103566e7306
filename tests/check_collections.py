"""Check that the installed collections are the versions requirements.yml pins.

Galaxy is unreachable on the testbed, so the collections come from the `ansible` PyPI bundle; this
makes a bundle upgrade that silently changes a collection fail loudly instead.
Usage: python tests/check_collections.py requirements.yml   (exit 1 with the mismatches listed)
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import yaml


def installed_version(name: str) -> str | None:
    """Return the version in ``ansible_collections/<ns>/<name>/MANIFEST.json``, or None if absent."""
    spec = importlib.util.find_spec("ansible_collections")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        manifest = pathlib.Path(root, *name.split("."), "MANIFEST.json")
        if manifest.exists():
            return json.loads(manifest.read_text())["collection_info"]["version"]
    return None


def main(path: str) -> int:
    wanted = yaml.safe_load(pathlib.Path(path).read_text())["collections"]
    bad = []
    for entry in wanted:
        have = installed_version(entry["name"])
        if have != entry["version"]:
            bad.append(f"{entry['name']}: requirements.yml pins {entry['version']}, installed {have}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
