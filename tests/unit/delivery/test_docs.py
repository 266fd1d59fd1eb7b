"""docs/: the architecture page's metrics reference is what the code registers, and the README links
the page and shows a dashboard image that exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.delivery.script_loader import load_script
from tests.unit.delivery.test_dashboards import exported

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
REF = load_script("metrics_reference")


def test_metrics_reference_is_generated_from_the_code():
    text = DOC.read_text()
    assert REF.rewrite(text) == text, "docs/architecture.md drifted: run python scripts/metrics_reference.py"


def test_metrics_reference_lists_every_keepwarm_metric_the_registries_hold():
    section = DOC.read_text().split(REF.BEGIN)[1].split(REF.END)[0]
    listed = set(re.findall(r"^\| `(keepwarm_[a-z0-9_]+?)(?:_bucket/_sum/_count|_total)?`", section, re.M))
    keepwarm = {name for name in exported() if name.startswith("keepwarm_")}
    assert listed == keepwarm
    assert "not plotted: ?" not in section


def test_readme_links_the_architecture_page_and_shows_a_real_dashboard_png():
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme and "shared/DESIGN.md" not in readme
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme)
    assert images and all((ROOT / image).stat().st_size > 10_000 for image in images)
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", DOC.read_text()):
        assert (DOC.parent / image).exists(), image


def test_the_architecture_page_names_every_route_the_server_serves():
    from keepwarm_runtime.server.app import ROUTES

    text = DOC.read_text()
    assert [route for route in ROUTES if f"`{route}`" not in text] == []


def test_paths_the_architecture_page_names_exist():
    """Every repository path in backquotes that looks like a folder or file of the tree is there."""
    top = "runtime|api|operator|testing|charts|bench|docs|tests"
    named = set(re.findall(rf"`((?:{top})/[a-z0-9_./-]+)`", DOC.read_text()))
    assert named and [path for path in sorted(named) if not (ROOT / path).exists()] == []
