"""docs/: the generated reference pages (metrics, custom resources) are what the code declares, the
architecture page names real routes and paths, and the README is short, links pages that exist and
gives each figure its page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.delivery.script_loader import load_script
from tests.unit.delivery.test_dashboards import exported

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
REF = load_script("metrics_reference")
CRDS = load_script("crd_reference")
README_MAX_LINES = 250


def test_metrics_reference_is_generated_from_the_code():
    text = REF.DOC.read_text()
    assert REF.rewrite(text) == text, f"{REF.DOC} drifted: run python scripts/metrics_reference.py"


def test_metrics_reference_lists_every_keepwarm_metric_the_registries_hold():
    section = REF.DOC.read_text().split(REF.BEGIN)[1].split(REF.END)[0]
    listed = set(re.findall(r"^\| `(keepwarm_[a-z0-9_]+?)(?:_bucket/_sum/_count|_total)?`", section, re.M))
    keepwarm = {name for name in exported() if name.startswith("keepwarm_")}
    assert listed == keepwarm
    assert "not plotted: ?" not in section


def test_crd_reference_is_generated_from_the_models():
    text = CRDS.PAGE.read_text()
    assert CRDS.rewrite(text) == text, f"{CRDS.PAGE} drifted: run python scripts/crd_reference.py"
    for field in (
        "`spec.models[].adapters[].source.huggingFace.tokenSecretRef.key`",
        "`spec.lora.maxLoraRank`",
    ):
        assert field in text
    with pytest.raises(ValueError, match="crd:WeightCache"):
        CRDS.rewrite("no markers")


def test_crd_reference_has_a_row_for_every_field_of_every_kind():
    """Every property of the generated schemas, at any depth, is a row (a nested field a walk missed
    would leave users without its description)."""
    from keepwarm_api.crdgen import KINDS, crd

    text = CRDS.PAGE.read_text()
    for kind in KINDS:
        root = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for part in ("spec", "status"):
            for path, _, _ in CRDS.fields(root["properties"][part], part, False):
                if path != part:
                    assert f"| `{path}`" in text, (kind.kind, path)


def test_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make demo" in text and "make test" in text
    assert "docs/architecture.md" in text and "shared/DESIGN.md" not in text


def test_readme_links_pages_that_exist_and_every_figure_links_its_page():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and [link for link in links if not (ROOT / link).exists()] == []
    figures = text.split("## The figures that matter")[1].split("\n## ")[0]
    bullets = re.split(r"\n(?=- )", figures.strip())[1:]
    assert len(bullets) >= 5
    for bullet in bullets:
        assert re.search(r"\]\(docs/(benchmarks|reference)/[a-z-]+\.md\)", bullet), bullet
        assert re.search(r"\d", bullet), bullet


def test_readme_and_the_monitoring_page_show_real_dashboard_pngs():
    monitoring = ROOT / "docs" / "operations" / "monitoring.md"
    for page in (README, monitoring):
        images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())
        assert images and all((page.parent / image).stat().st_size > 10_000 for image in images), page


def test_the_architecture_page_names_every_route_the_server_serves():
    from keepwarm_runtime.server.app import ROUTES

    text = DOC.read_text()
    assert [route for route in ROUTES if f"`{route}`" not in text] == []


def test_paths_the_architecture_page_names_exist():
    """Every repository path in backquotes that looks like a folder or file of the tree is there."""
    top = "runtime|api|operator|testing|charts|bench|docs|tests"
    named = set(re.findall(rf"`((?:{top})/[a-z0-9_./-]+)`", DOC.read_text()))
    assert named and [path for path in sorted(named) if not (ROOT / path).exists()] == []
