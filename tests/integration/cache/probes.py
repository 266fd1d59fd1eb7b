"""What the cache tests read from real daemons: their /metrics, and a condition waited for."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int | str) -> str:
    """The daemon's /metrics text ("" while nothing answers on the port)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.read().decode()
    except OSError:
        return ""


def metric(port: int | str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` on the daemon's real /metrics, or None."""
    for family in text_string_to_metric_families(scrape(port)):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
