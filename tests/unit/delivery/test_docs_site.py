"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, as `make docs` and a
reader's `mkdocs serve` do, and the same configuration fails a build on a broken link or anchor, a nav
entry without its page, a page outside the nav and a missing examples/ file: so none can land."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "mkdocs.yml"
EXAMPLES = ROOT / "examples"


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    argv = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--config-file",
        str(config),
        "-d",
        str(site),
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_the_site_builds_strictly_and_shows_every_example(tmp_path: Path) -> None:
    done = build(CONFIG, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    cluster = (tmp_path / "site" / "getting-started" / "cluster" / "index.html").read_text()
    lora = (tmp_path / "site" / "concepts" / "lora" / "index.html").read_text()
    shown = html.unescape(re.sub(r"<[^>]+>", "", cluster + lora))  # the text, out of the highlighting
    assert "--8<--" not in shown  # every snippet was replaced by its file
    for example in sorted(EXAMPLES.glob("*.yaml")):
        lines = [line for line in example.read_text().splitlines() if line and not line.startswith("#")]
        assert [line for line in lines if line not in shown] == [], example.name


def test_every_page_is_in_the_nav() -> None:
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", CONFIG.read_text(), re.M)
    nav += re.findall(r"^\s*-\s*([\w/.-]+\.md)\s*$", CONFIG.read_text(), re.M)
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(set(nav)) == pages


def small_site(tmp_path: Path, pages: dict[str, str], nav: list[str]) -> Path:
    """A two-page site under the project's own configuration (theme, extensions, validation)."""
    text = CONFIG.read_text().split("\nnav:")[0]
    config = tmp_path / "mkdocs.yml"
    config.write_text(text + "\nnav:\n" + "".join(f"  - {page}\n" for page in nav))
    for name, body in pages.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(body)
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    return config


GOOD = {"index.md": "# Home\n\n[Other](other.md#other)\n", "other.md": "# Other\n"}


@pytest.mark.parametrize(
    ("case", "pages", "nav", "complaint"),
    [
        ("good", GOOD, ["index.md", "other.md"], None),
        (
            "broken link",
            {**GOOD, "other.md": "# Other\n\n[gone](gone.md)\n"},
            ["index.md", "other.md"],
            "gone.md",
        ),
        (
            "broken anchor",
            {**GOOD, "index.md": "# Home\n\n[x](other.md#nowhere)\n"},
            ["index.md", "other.md"],
            "nowhere",
        ),
        ("page outside the nav", GOOD, ["index.md"], "other.md"),
        ("nav without its page", GOOD, ["index.md", "other.md", "missing.md"], "missing.md"),
        (
            "missing example",
            {**GOOD, "other.md": '# Other\n\n```yaml\n--8<-- "examples/nope.yaml"\n```\n'},
            ["index.md", "other.md"],
            "nope.yaml",
        ),
    ],
)
def test_the_configuration_fails_a_build_on(case, pages, nav, complaint, tmp_path: Path) -> None:
    done = build(small_site(tmp_path, pages, nav), tmp_path / "site")
    if complaint is None:
        assert done.returncode == 0, done.stderr[-4000:]
    else:
        assert done.returncode != 0, case
        assert complaint in done.stderr, done.stderr[-4000:]
