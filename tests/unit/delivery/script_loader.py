"""Import the repository's scripts (scripts/*.py are programs, not a package) for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as module `name` (scripts import each other by bare name, as when run)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and sibling imports resolve it by name
    spec.loader.exec_module(module)
    return module
