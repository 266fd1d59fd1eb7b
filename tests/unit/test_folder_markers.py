"""The markers a test's folder gives it (tests/conftest.py) reach `-m`, and no module restates them: the
folder is the one place a test's kind is said, so a test moved between folders changes kind with it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FOLDER_MARKERS, TESTS, folder_markers


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("integration/server/test_server_api.py", ("integration",)),
        ("e2e/test_journey.py", ("integration",)),
        ("gpu/moe/test_moe_gpu.py", ("gpu",)),
        ("unit/engine/test_sampler.py", ()),
        ("sweep/test_sweep.py", ()),
        ("conftest.py", ()),
        ("../bench/gpu/test_x.py", ()),  # outside tests/: a folder named like one gives nothing
    ],
)
def test_the_folder_gives_the_markers(path: str, expected: tuple[str, ...]) -> None:
    assert folder_markers(TESTS / path) == expected


def _restated(path: Path, names: tuple[str, ...]) -> list[str]:
    """`pytest.mark.<name>` anywhere in the module (pytestmark or a decorator)."""
    return [
        f"{path.relative_to(TESTS)}:{node.lineno} {node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in names
        if isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
    ]


def test_no_module_restates_what_its_folder_gives() -> None:
    restated = [
        line
        for folder, names in FOLDER_MARKERS.items()
        for path in sorted((TESTS / folder).rglob("*.py"))
        for line in _restated(path, names)
    ]
    assert restated == []


def test_minus_m_selects_by_folder() -> None:
    """Collected for real: the conftest hook marks before pytest deselects by `-m`."""
    unit, integration = "tests/unit/test_log_once.py", "tests/integration/server/test_server_imports.py"
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*argv, "-m", "integration", unit, integration],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    selected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert selected == {integration}


def test_every_test_module_has_its_own_basename() -> None:
    """The test folders are not packages, so pytest imports each module by its file name alone: two
    files of one name in different folders stop the whole collection ('import file mismatch')."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} ~ {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert clashes == []
