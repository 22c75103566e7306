"""Load the project's plugin and module files (roles/*/library, roles/*/filter_plugins, tests/testbed) by path:
they are not importable packages. Shared by the unit tests of this directory. The shared module_utils/
files are registered as ``ansible.module_utils.<name>``, where Ansible puts them for modules."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

REPO = pathlib.Path(__file__).resolve().parents[2]


def load(name: str, relative_path: str) -> ModuleType:
    """Import the Python file at REPO/relative_path as module `name`; raises FileNotFoundError if it is absent."""
    path = REPO / relative_path
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register_module_utils() -> None:
    for path in sorted((REPO / "module_utils").glob("*.py")):
        name = f"ansible.module_utils.{path.stem}"
        if name not in sys.modules:
            sys.modules[name] = load(name, str(path.relative_to(REPO)))


_register_module_utils()
