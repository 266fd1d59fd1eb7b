"""Draw a dashboard's panels from Prometheus range queries with matplotlib (one PNG per dashboard), so
docs/ shows what the shipped panels plot from real scraped data."""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tests.integration.observability.prometheus import Series

COLUMNS = 3
GAP_S = 1.0  # the range queries' step
UNIT_LABELS = {
    "short": "count",
    "s": "seconds",
    "bytes": "bytes",
    "percentunit": "ratio",
    "reqps": "req/s",
    "ops": "ops/s",
    "bool_yes_no": "1 yes, 0 no",
}


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or "value"


def with_gaps(points: list[tuple[float, float]], start: float) -> tuple[list[float], list[float]]:
    """x (seconds since start) and y, with a NaN wherever the series stopped, so no line bridges a
    restart or a stretch without samples."""
    xs: list[float] = []
    ys: list[float] = []
    for t, v in points:
        if xs and t - start - xs[-1] > 2 * GAP_S:
            xs.append(xs[-1] + GAP_S)
            ys.append(math.nan)
        xs.append(t - start)
        ys.append(v)
    return xs, ys


def render_dashboard(
    dashboard: dict, results: dict[int, list[tuple[str, list[Series]]]], start: float, path: Path
) -> Path:
    """results: panel id -> [(legend template, series)] in target order."""
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for template, series_list in results[panel["id"]]:
            for series in series_list:
                xs, ys = with_gaps(series.points, start)
                if xs:
                    ax.plot(xs, ys, label=legend(template, series.labels), linewidth=1.4)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(UNIT_LABELS.get(unit, unit.removeprefix("suffix:")), fontsize=8)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']} (real scrape: keepwarm serve, cache serve, operator)", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
