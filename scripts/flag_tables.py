"""Write the reference pages' flag tables from the programs' settings declarations (keepwarm_api.settings).

    python scripts/flag_tables.py     # rewrites each table between its markers; a test checks drift

docs/reference/flags.md: one table per program, between ``<!-- flags:NAME:begin -->`` and
``<!-- flags:NAME:end -->``: flag, environment variable, default and meaning
(``keepwarm_api.settings.markdown_table``). docs/reference/vllm.md: what `keepwarm serve` does with each
of vLLM's flags it knows (``keepwarm_api.settings.foreign_table``), between ``<!-- flags:vllm:begin -->``
and ``<!-- flags:vllm:end -->``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from keepwarm_api.settings import foreign_table, markdown_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"
FLAGS_PAGE = DOCS / "flags.md"
VLLM_PAGE = DOCS / "vllm.md"
SERVE = "keepwarm_runtime.server.settings:ServeSettings"
# marker name -> "module:SettingsClass"
TABLES = {
    "serve": SERVE,
    "cache-serve": "keepwarm_runtime.cache.settings:CacheServeSettings",
    "cache-hold": "keepwarm_runtime.cache.settings:CacheHoldSettings",
    "bench-restart": "keepwarm_runtime.bench_cli:RestartSettings",
    "bench-recovery": "keepwarm_runtime.bench_cli:RecoverySettings",
    "operator": "keepwarm_operator.settings:OperatorSettings",
}
# page -> marker name -> (settings class, table generator)
PAGES: dict[Path, dict[str, tuple[str, Callable[[type], str]]]] = {
    FLAGS_PAGE: {name: (target, markdown_table) for name, target in TABLES.items()},
    VLLM_PAGE: {"vllm": (SERVE, foreign_table)},
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- flags:{name}:begin -->", f"<!-- flags:{name}:end -->"


def settings_class(target: str) -> type:
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def rewrite(text: str, page: Path = FLAGS_PAGE) -> str:
    """``text`` (of ``page``) with every table replaced by the generated one; a missing marker is a
    ValueError."""
    for name, (target, generate) in PAGES[page].items():
        begin, end = markers(name)
        if begin not in text or end not in text:
            raise ValueError(f"{page.name} lacks the markers {begin} ... {end}")
        start, stop = text.index(begin) + len(begin), text.index(end)
        text = text[:start] + "\n" + generate(settings_class(target)) + "\n" + text[stop:]
    return text


def main() -> int:
    for page in PAGES:
        page.write_text(rewrite(page.read_text(), page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
