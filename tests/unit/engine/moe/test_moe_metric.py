"""The MoE backend choice is exported as a metric label on the server's /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from keepwarm_runtime.server.base.metrics import ServerMetrics


def test_moe_layers_by_backend() -> None:
    metrics = ServerMetrics("tiny")
    metrics.record_moe(
        {"model.layers.0.mlp.experts": "torch", "model.layers.1.mlp.experts": "torch", "x": "transformers"}
    )
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.labels["backend"]: s.value for s in families["keepwarm_moe_layers"].samples}
    assert samples == {"torch": 2.0, "transformers": 1.0}
