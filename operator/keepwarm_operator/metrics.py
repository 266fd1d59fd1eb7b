"""Operator metrics (prefix keepwarm_operator_), served by prometheus-client on --metrics-port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "keepwarm_operator_reconcile_total", "Reconciles run, by kind and trigger", ["kind", "trigger"]
)
ERRORS = Counter(
    "keepwarm_operator_reconcile_errors_total", "Reconciles that failed, by kind and error", ["kind", "error"]
)
DURATION = Histogram(
    "keepwarm_operator_reconcile_duration_seconds",
    "Wall time of one reconcile",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
APPLIES = Counter("keepwarm_operator_applies_total", "Server-side applies, by kind of child", ["kind"])
STALE_NODES = Gauge(
    "keepwarm_operator_stale_nodes", "WeightCacheNodes marked Stale, by cache", ["weightcache"]
)


@contextmanager
def reconciling(kind: str, trigger: str) -> Iterator[None]:
    """Count and time one reconcile; record the exception type when it fails (and re-raise)."""
    RECONCILES.labels(kind, trigger).inc()
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        ERRORS.labels(kind, type(exc).__name__).inc()
        raise
    finally:
        DURATION.labels(kind).observe(time.perf_counter() - start)
