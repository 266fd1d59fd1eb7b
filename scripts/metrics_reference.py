"""Write the metrics reference, docs/reference/metrics.md, from the code's own metric objects.

    python scripts/metrics_reference.py     # rewrites the table between the markers; a test checks drift

Each row: name as PromQL sees it, type, labels, help text, the process that exposes it, and the
dashboard panel that plots it (or why none does, from scripts/dashboards.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from dashboards import DASHBOARDS, UNPLOTTED
from prometheus_client.metrics import MetricWrapperBase

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md"
BEGIN, END = "<!-- metrics-reference:begin -->", "<!-- metrics-reference:end -->"
SUFFIX = {"counter": "_total", "histogram": "_bucket/_sum/_count", "gauge": "", "summary": "_sum/_count"}


def _wrappers(*objects: object) -> list[MetricWrapperBase]:
    return [v for o in objects for v in vars(o).values() if isinstance(v, MetricWrapperBase)]


def _server() -> list[MetricWrapperBase]:
    from keepwarm_runtime.cache.metrics import client_metrics
    from keepwarm_runtime.server.base.metrics import ServerMetrics

    return _wrappers(ServerMetrics("model"), client_metrics())


def _daemon() -> list[MetricWrapperBase]:
    from keepwarm_runtime.cache.metrics import DaemonMetrics

    return _wrappers(DaemonMetrics())


def _operator() -> list[MetricWrapperBase]:
    import keepwarm_operator.metrics as operator_metrics

    return _wrappers(operator_metrics)


# Where each set of metrics is served.
SOURCES: list[tuple[str, Callable[[], list[MetricWrapperBase]]]] = [
    ("`keepwarm serve` `/metrics`", _server),
    ("`keepwarm cache serve --metrics-port`", _daemon),
    ("`keepwarm-operator --metrics-port`", _operator),
]


def panels_by_metric() -> dict[str, list[str]]:
    """metric token in a panel query -> ["dashboard / panel", ...]"""
    found: dict[str, list[str]] = {}
    for d in DASHBOARDS:
        for row in d.rows:
            for panel in row.panels:
                for token in {m for t in panel.targets for m in re.findall(r"\bkeepwarm_\w+", t.expr)}:
                    where = f"{d.title.removeprefix('keepwarm / ')}: {panel.title}"
                    found.setdefault(token, []).append(where)
    return found


def rows(sources: Iterable[tuple[str, Callable[[], list[MetricWrapperBase]]]] = SOURCES) -> list[str]:
    plotted = panels_by_metric()
    lines = []
    for where, load in sources:
        for metric in sorted(load(), key=lambda m: m.describe()[0].name):
            family = metric.describe()[0]
            suffix = SUFFIX.get(family.type, "")
            names = [family.name + s for s in suffix.split("/")] if suffix else [family.name]
            shown = sorted({p for n in names for p in plotted.get(n, [])})
            panel = "; ".join(shown) or f"not plotted: {UNPLOTTED.get(family.name, '?')}"
            labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "-"
            cells = [f"`{family.name}{suffix}`", family.type, labels, family.documentation, where, panel]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def table() -> str:
    head = [
        "| metric | type | labels | meaning | exposed by | dashboard panel |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join([BEGIN, *head, *rows(), END])


def rewrite(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + table() + text[end:]


def main() -> int:
    DOC.write_text(rewrite(DOC.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
