"""Dashboards and scrape objects: generated JSON in sync, every panel well-formed, every metric the code
registers plotted or deliberately unplotted, ConfigMaps/PodMonitors/ServiceMonitor that select right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_operator.builders.agent import agent_children
from keepwarm_operator.builders.meta import agent_labels, runtime_labels
from tests.unit.delivery.script_loader import load_script

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "keepwarm"
METRIC = re.compile(r"\b(?:keepwarm|process|python)_[a-z0-9_]+\b")


GEN = load_script("dashboards")


def sample_names(family_name: str, family_type: str) -> set[str]:
    """The series names a family produces (what PromQL can name), without `_created`."""
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "summary": ["_sum", "_count"],
    }
    return {family_name + s for s in suffixes.get(family_type, [""])}


def exported() -> dict[str, set[str]]:
    """Every metric family the code registers (server incl. cache client, daemon, operator)."""
    import keepwarm_operator.metrics  # noqa: F401 (registers the operator's metrics)
    from keepwarm_runtime.cache.metrics import DaemonMetrics
    from keepwarm_runtime.server.base.metrics import ServerMetrics

    registries: list[CollectorRegistry] = [ServerMetrics("m").registry, DaemonMetrics().registry, REGISTRY]
    return {f.name: sample_names(f.name, f.type) for r in registries for f in r.collect()}


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def all_exprs() -> list[str]:
    return [t["expr"] for d in DASHBOARDS.values() for p in panels(d) for t in p["targets"]]


def test_committed_json_is_what_the_generator_writes():
    assert set(DASHBOARDS) == {d.file_name() for d in GEN.DASHBOARDS}
    for d in GEN.DASHBOARDS:
        on_disk = (CHART / "dashboards" / d.file_name()).read_text()
        assert on_disk == GEN.render(d), f"{d.file_name()} drifted: run python scripts/dashboards.py"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_use_the_datasource_variable_units_legends_and_quantiles(name):
    dashboard = DASHBOARDS[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert panels(dashboard)
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["options"]["legend"]["showLegend"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["legendFormat"], (panel["title"], target["expr"])
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if "_bucket" in exprs:
            assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs, panel["title"]


def test_every_exported_metric_is_plotted_or_deliberately_unplotted():
    families = exported()
    used = {m for e in all_exprs() for m in METRIC.findall(e)}
    missing = [
        name
        for name, samples in sorted(families.items())
        if not name.startswith(GEN.STANDARD_PREFIXES) and not samples & used and name not in GEN.UNPLOTTED
    ]
    assert missing == [], f"not on any panel and not in UNPLOTTED (scripts/dashboards.py): {missing}"
    assert set(GEN.UNPLOTTED) <= set(families), "UNPLOTTED names a metric the code no longer has"
    known = set().union(*families.values())
    assert used <= known, f"panels name metrics the code does not export: {sorted(used - known)}"


def test_the_coverage_check_sees_a_new_metric():
    """A metric added to a registry but to no panel must be reported: the derivation is not static."""
    from prometheus_client import Gauge

    probe = Gauge("keepwarm_probe_unplotted_metric", "test-only", registry=REGISTRY)
    try:
        assert "keepwarm_probe_unplotted_metric" in exported()
    finally:
        REGISTRY.unregister(probe)


def test_cache_client_metrics_are_on_the_servers_metrics():
    from keepwarm_runtime.cache.metrics import client_metrics
    from keepwarm_runtime.server.base.metrics import ServerMetrics

    client_metrics().misses.labels(reason="absent").inc()
    text = ServerMetrics("m").render().decode()
    values = {
        (s.name, s.labels.get("reason")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values[("keepwarm_cache_client_misses_total", "absent")] >= 1
    assert ("keepwarm_cache_client_hits_total", None) in values


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name="kw", namespace="keepwarm-system", is_install=True)
    return [
        d
        for name, text in sorted(out.items())
        if name.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]


def test_one_dashboard_configmap_each_with_the_sidecar_label():
    docs = render(
        {"grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "keepwarm"}}}}
    )
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == len(DASHBOARDS)
    shipped = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "keepwarm"}
        shipped.update({k: json.loads(v) for k, v in cm["data"].items()})
    assert shipped == DASHBOARDS
    assert not [d for d in render({}) if d["kind"] == "ConfigMap"], "off by default"


def test_servicemonitor_selects_the_metrics_service_by_selector_labels():
    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics"))
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector == service["spec"]["selector"], "the ServiceMonitor selects what the Service selects"
    assert selector.items() <= service["metadata"]["labels"].items()
    assert not any("version" in k or k.startswith("helm.sh/") for k in selector), selector
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def test_podmonitors_select_the_pods_the_operator_creates():
    docs = render({"metrics": {"podMonitor": {"enabled": True}}, "operator": {"agentNamespace": "agents"}})
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    agents, runtime = monitors["kw-keepwarm-agents"], monitors["kw-keepwarm-runtime"]
    assert agents["spec"]["selector"]["matchLabels"].items() <= agent_labels("any-cache").items()
    assert runtime["spec"]["selector"]["matchLabels"].items() <= runtime_labels("any-idep").items()
    assert agents["spec"]["namespaceSelector"] == {"matchNames": ["agents"]}
    spec = WeightCacheSpec.model_validate({"models": [{"name": "m", "source": {"path": "/m"}}]})
    daemonset = next(c for c in agent_children("c", spec, "agents", None) if c["kind"] == "DaemonSet")
    ports = {
        p["name"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    }
    assert agents["spec"]["podMetricsEndpoints"][0]["port"] in ports
    assert not [d for d in render({}) if d["kind"] == "PodMonitor"], "off by default"
