"""Generate keepwarm's Grafana dashboards (charts/keepwarm/dashboards/*.json), one per audience.

    python scripts/dashboards.py          # rewrite the JSON files; tests fail when they drift

Every panel reads the `${datasource}` variable and carries a unit and legends; histograms show p50
and p99. Every metric the code registers is on some panel or in UNPLOTTED with the reason
(tests/unit/delivery/test_dashboards.py derives the names from the code's registries), and
tests/integration/observability checks every query against a real Prometheus scraping real processes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "charts" / "keepwarm" / "dashboards"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Metrics deliberately left off the dashboards, with why. Standard process/platform collectors
# (process_*, python_*) are left to generic dashboards as well.
UNPLOTTED: dict[str, str] = {
    # The cache's defences against hostile or unlucky clients: labelled counters with no series until
    # the first incident, so they belong in alerts (rate > 0), not on panels that would stay empty.
    "keepwarm_cache_accept_errors": "alert on it: accept() failures backed off from (fd exhaustion)",
    "keepwarm_cache_bad_frames": "alert on it: malformed client frames answered with an error",
    "keepwarm_cache_refused_connections": "alert on it: connections over the overall/per-uid limits",
    "keepwarm_cache_seal_failures": "alert on it: arenas refused because memfd seals failed",
    "keepwarm_cache_changed_on_disk": "alert on it: resident models dropped after a shard changed on disk",
    # The cache's own restarts (hand-off to a successor, recovery from the holder): events of a start,
    # not series to plot; the log of that start says the same.
    "keepwarm_cache_handoffs": "alert on it: hand-offs by role and outcome (refused, abandoned, unconfirmed)",
    "keepwarm_cache_adopted_arenas": "a start-up fact (arenas taken from a predecessor or the holder)",
    "keepwarm_cache_dropped_arenas": "alert on it: handed-over arenas not taken, by source and reason",
    "keepwarm_cache_adopt_seconds": "a start-up fact (seconds to verify and take the handed-over arenas)",
    "keepwarm_cache_start_arenas": "a start-up fact (how warm the start was: resident arenas by origin)",
    "keepwarm_lora_requests_info": "for routers (vLLM's lora_requests_info: adapters running and waiting "
    "now, as labels), not a time series to plot",
    "keepwarm_lora_load_seconds": "an event per adapter registered (by source: cache or disk), read from "
    "/metrics or the log; bench/lora.py measures it",
    "keepwarm_lora_requests": "per adapter: unbounded label values (adapters come and go at runtime); "
    "query it per adapter, e.g. topk by adapter",
    "keepwarm_lora_generation_tokens": "per adapter: unbounded label values (adapters come and go at "
    "runtime); query it per adapter, e.g. topk by adapter",
    "keepwarm_lora_adapter_refused": "alert on it: adapters a pod's --lora-modules-file lists but it cannot "
    "serve (no series while all load)",
    "keepwarm_cache_resident_adapters": "a count beside keepwarm_cache_resident_bytes, which plots adapters "
    "under their names",
    "keepwarm_worker_restarts": "alert on it: serving workers the supervising parent restarted, by cause",
    "keepwarm_sleep_level": "a state (0 awake, else the sleep level) that routers read from /metrics",
    "keepwarm_moe_layers": "a load-time fact (experts backend per module), read from /metrics or the log",
    "keepwarm_startup_source": "a start-up fact (the pod's parent restored from a snapshot, or importing, "
    "and why), read from /metrics or the log; alert on reasons other than hit and off",
    "keepwarm_startup_phase_seconds": "a start-up fact (where start to ready went, by phase), read from "
    "/metrics or the log; the cache dashboard plots start to ready and the weights phase",
}
STANDARD_PREFIXES = ("process_", "python_")


@dataclass
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    unit: str
    targets: list[Target]
    description: str = ""


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[Row]

    def file_name(self) -> str:
        return f"{self.uid}.json"


def quantiles(metric: str, by: str = "", legend: str = "", window: str | None = RATE) -> list[Target]:
    """p50 and p99 of a histogram, aggregated over instances (and `by` labels, when given).

    window=None reads the cumulative buckets of the live processes: for an event that happens once
    per process, before its first scrape (the client's attach), a rate or increase stays empty.
    """
    labels = f"le, {by}" if by else "le"
    suffix = f" {legend}" if legend else ""
    buckets = f"{metric}_bucket" if window is None else f"rate({metric}_bucket[{window}])"
    return [
        Target(f"histogram_quantile({q}, sum by ({labels}) ({buckets}))", f"p{p}{suffix}")
        for q, p in ((0.5, 50), (0.99, 99))
    ]


SERVING = Dashboard(
    "keepwarm-serving",
    "keepwarm / serving",
    "OpenAI-compatible servers (`keepwarm serve`): traffic, latency, tokens, batch and KV cache.",
    [
        Row(
            "Traffic",
            [
                Panel(
                    "Requests/s by endpoint and status",
                    "reqps",
                    [
                        Target(
                            f"sum by (endpoint, status) (rate(keepwarm_http_requests_total[{RATE}]))",
                            "{{endpoint}} {{status}}",
                        )
                    ],
                ),
                Panel(
                    "Tokens/s",
                    "suffix:tok/s",
                    [
                        Target(f"sum(rate(keepwarm_prompt_tokens_total[{RATE}]))", "prompt"),
                        Target(f"sum(rate(keepwarm_generation_tokens_total[{RATE}]))", "generated"),
                    ],
                ),
                Panel(
                    "Aborted requests/s (client went away)",
                    "reqps",
                    [Target(f"sum(rate(keepwarm_request_aborts_total[{RATE}]))", "aborted")],
                ),
                Panel(
                    "Served model",
                    "short",
                    [Target("count by (model_name) (keepwarm_model_info)", "{{model_name}}")],
                    "Number of servers per model.",
                ),
            ],
        ),
        Row(
            "Latency",
            [
                Panel(
                    "Time to first token",
                    "s",
                    quantiles("keepwarm_time_to_first_token_seconds"),
                ),
                Panel(
                    "Time per output token",
                    "s",
                    quantiles("keepwarm_time_per_output_token_seconds"),
                ),
                Panel(
                    "End-to-end request latency",
                    "s",
                    quantiles("keepwarm_e2e_request_latency_seconds"),
                ),
            ],
        ),
        Row(
            "Batch and KV cache",
            [
                Panel(
                    "Sequences running / waiting",
                    "short",
                    [
                        Target("sum(keepwarm_num_requests_running)", "running"),
                        Target("sum(keepwarm_num_requests_waiting)", "waiting"),
                        Target("sum(keepwarm_active_requests)", "HTTP requests in flight"),
                    ],
                ),
                Panel(
                    "KV cache usage",
                    "percentunit",
                    [Target("max by (instance) (keepwarm_kv_cache_usage_ratio)", "{{instance}}")],
                ),
                Panel(
                    "Preemptions since start",
                    "short",
                    [Target("sum by (instance) (keepwarm_num_preemptions)", "{{instance}}")],
                ),
            ],
        ),
    ],
)

# Start-to-ready labelled with where the weights came from (disk = cold, cache = warm): each process
# exports one weight-load series whose `source` label names it.
_READY_BY_SOURCE = (
    "max by (instance, source) (keepwarm_process_start_to_ready_seconds"
    " * on (instance, job) group_left (source) (keepwarm_weight_load_seconds * 0 + 1))"
)

CACHE = Dashboard(
    "keepwarm-cache",
    "keepwarm / cache & restarts",
    "Node weight caches (`keepwarm cache serve`) and how inference processes start: cold from disk or "
    "warm from the cache.",
    [
        Row(
            "Restarts",
            [
                Panel(
                    "Start to ready, cold (disk) vs warm (cache)",
                    "s",
                    [Target(_READY_BY_SOURCE, "{{source}} {{instance}}")],
                ),
                Panel(
                    "Weight load by source",
                    "s",
                    [
                        Target(
                            "max by (instance, source) (keepwarm_weight_load_seconds)",
                            "{{source}} {{instance}}",
                        )
                    ],
                ),
                Panel(
                    "Client attach time by source",
                    "s",
                    quantiles("keepwarm_cache_client_attach_seconds", "source", "{{source}}", window=None),
                    "Across the servers running now: each attaches (or loads from disk) once, at start.",
                ),
                Panel(
                    "Client attaches: cache hits and disk fallbacks",
                    "short",
                    [
                        Target("sum(keepwarm_cache_client_hits_total)", "hits"),
                        Target("sum by (reason) (keepwarm_cache_client_misses_total)", "miss {{reason}}"),
                    ],
                    "Counts per live server process (a restart starts them again).",
                ),
            ],
        ),
        Row(
            "Node cache",
            [
                Panel(
                    "Resident bytes by model and tier",
                    "bytes",
                    [Target("sum by (model, tier) (keepwarm_cache_resident_bytes)", "{{model}} {{tier}}")],
                ),
                Panel(
                    "Daemon hits and misses",
                    "short",
                    [
                        Target("sum by (model) (keepwarm_cache_hits_total)", "hit {{model}}"),
                        Target("sum by (reason) (keepwarm_cache_misses_total)", "miss {{reason}}"),
                    ],
                ),
                Panel(
                    "Daemon get_state time",
                    "s",
                    quantiles("keepwarm_cache_attach_seconds", window="1h"),
                    "Over the last hour: clients ask once per process start.",
                ),
                Panel(
                    "Model load time in the daemon",
                    "s",
                    [Target("max by (model) (keepwarm_cache_load_seconds)", "{{model}}")],
                ),
                Panel(
                    "Descriptor holder connected",
                    "bool_yes_no",
                    [Target("min by (instance) (keepwarm_cache_holder_connected)", "{{instance}}")],
                    "No: a crash of that node's daemon reloads every model from disk instead of "
                    "restarting warm from `keepwarm cache hold`.",
                ),
                Panel(
                    "Evictions, refused peers, failed models",
                    "short",
                    [
                        Target("sum(keepwarm_cache_evictions_total)", "evicted for budget"),
                        Target("sum(keepwarm_cache_refused_peers_total)", "refused by SO_PEERCRED"),
                        Target("sum(keepwarm_cache_failed_models)", "models failed to load"),
                    ],
                ),
            ],
        ),
    ],
)

OPERATOR = Dashboard(
    "keepwarm-operator",
    "keepwarm / operator & agents",
    "The kopf operator's reconciles and the node agents it runs.",
    [
        Row(
            "Operator",
            [
                Panel(
                    "Reconciles/s by kind and trigger",
                    "ops",
                    [
                        Target(
                            f"sum by (kind, trigger) (rate(keepwarm_operator_reconcile_total[{RATE}]))",
                            "{{kind}} {{trigger}}",
                        )
                    ],
                ),
                Panel(
                    "Reconcile duration",
                    "s",
                    quantiles("keepwarm_operator_reconcile_duration_seconds", "kind", "{{kind}}"),
                ),
                Panel(
                    "Failed reconciles by kind and error",
                    "short",
                    [
                        Target(
                            "sum by (kind, error) (keepwarm_operator_reconcile_errors_total)",
                            "{{kind}} {{error}}",
                        )
                    ],
                ),
                Panel(
                    "Server-side applies/s by child kind",
                    "ops",
                    [Target(f"sum by (kind) (rate(keepwarm_operator_applies_total[{RATE}]))", "{{kind}}")],
                ),
            ],
        ),
        Row(
            "Agents",
            [
                Panel(
                    "Stale cache nodes",
                    "short",
                    [Target("sum by (weightcache) (keepwarm_operator_stale_nodes)", "{{weightcache}}")],
                ),
                Panel(
                    "Resident bytes per agent",
                    "bytes",
                    [Target("sum by (instance) (keepwarm_cache_resident_bytes)", "{{instance}}")],
                ),
            ],
        ),
    ],
)

DASHBOARDS = [SERVING, CACHE, OPERATOR]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": 8, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0}, "overrides": []},
        "options": {
            "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom", "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend}
            for i, t in enumerate(panel.targets)
        ],
    }


def dashboard_json(d: Dashboard) -> dict:
    panels: list[dict] = []
    y = 0
    for row in d.rows:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        y += 1
        for i, panel in enumerate(row.panels):
            panels.append(_panel_json(panel, len(panels) + 1, (i % 3) * 8, y + (i // 3) * 8))
        y += 8 * ((len(row.panels) + 2) // 3)
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["keepwarm"],
        "schemaVersion": 39,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    return json.dumps(dashboard_json(d), indent=2) + "\n"


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for d in DASHBOARDS:
        (OUT_DIR / d.file_name()).write_text(render(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
