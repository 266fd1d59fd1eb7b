"""Prometheus metrics of the cache (prefix ``keepwarm_cache_``).

The daemon keeps its own registry (several daemons may live in one test process); the client's
metrics go to the default registry, which the runtime's ``/metrics`` endpoint exposes. A process
running one daemon per GPU (``--all-gpus``) serves them on one port, each sample labelled with the
GPU its daemon serves (``gpu``; PerGPUCollector).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)
GPU_LABEL = "gpu"  # per-GPU daemons: the UUID of the GPU the sample's daemon serves

# Label values of the hand-off metrics: bounded sets, named once here (the code passes only these).
PREDECESSOR, SUCCESSOR = "predecessor", "successor"  # a daemon's role in a hand-off
HOLDER, DISK = "holder", "disk"  # with PREDECESSOR: where a resident arena came from
ARENA_SOURCES = (PREDECESSOR, HOLDER, DISK)
COMMITTED = "committed"  # the successor serves; the predecessor stopped accepting
UNCONFIRMED = "unconfirmed"  # successor: the predecessor exited before confirming the commit
ABANDONED = "abandoned"  # predecessor: the successor went away before committing; still serving
REFUSED = "refused"  # predecessor: refused by name (another uid, a malformed request, busy)
HANDOFF_OUTCOMES = (COMMITTED, UNCONFIRMED, ABANDONED, REFUSED)
# Why a handed-over arena was not taken (adopt.py): the check that failed.
DROP_REASONS = (
    "record",  # the record is malformed
    "format",  # the whole stream is in a record format this daemon does not read
    "resident",  # a model of that name is resident already
    "tier",  # another tier
    "gpu",  # another GPU
    "size",  # a nonsensical size
    "seals",  # the memfd is not sealed as recorded (it could have been written)
    "files",  # the checkpoint cannot be read
    "changed_on_disk",  # a shard's identity differs from the one recorded at load
    "key",  # another serving configuration (dtype, expert layout, ...)
    "layout",  # the tensor table is not one this version writes
    "budget",  # it does not fit beside the arenas taken before it
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.resident_bytes = Gauge(
            "keepwarm_cache_resident_bytes", "Bytes held per model and tier", ["model", "tier"], registry=r
        )
        self.hits = Counter(
            "keepwarm_cache_hits_total", "get_state answered with weights", ["model"], registry=r
        )
        self.misses = Counter(
            "keepwarm_cache_misses_total",
            "get_state without weights, by reason (absent, mismatch)",
            ["reason"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "keepwarm_cache_attach_seconds",
            "Daemon time to answer a get_state",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.load_seconds = Gauge(
            "keepwarm_cache_load_seconds",
            "Seconds the daemon spent loading each model",
            ["model"],
            registry=r,
        )
        self.evictions = Counter("keepwarm_cache_evictions_total", "Models evicted for budget", registry=r)
        self.refused_peers = Counter(
            "keepwarm_cache_refused_peers_total",
            "Connections refused by the peer check (uid and groups)",
            registry=r,
        )
        self.refused_connections = Counter(
            "keepwarm_cache_refused_connections_total",
            "Connections refused by a limit (busy: too many overall or for one uid)",
            ["reason"],
            registry=r,
        )
        self.accept_errors = Counter(
            "keepwarm_cache_accept_errors_total",
            "accept() failures the daemon backed off from, by errno (EMFILE, ENFILE, ...)",
            ["errno"],
            registry=r,
        )
        self.bad_frames = Counter(
            "keepwarm_cache_bad_frames_total",
            "Client frames answered with an error and a close, by code",
            ["code"],
            registry=r,
        )
        self.resident_adapters = Gauge(
            "keepwarm_cache_resident_adapters",
            "LoRA adapters resident (each is also in keepwarm_cache_resident_bytes under its name)",
            registry=r,
        )
        self.failed_models = Gauge(
            "keepwarm_cache_failed_models",
            "1 for each model that failed to load (reason in `keepwarm cache ls`/stats)",
            ["model"],
            registry=r,
        )
        self.seal_failures = Counter(
            "keepwarm_cache_seal_failures_total",
            "Arenas refused because their memfd seals could not be set",
            registry=r,
        )
        self.changed_on_disk = Counter(
            "keepwarm_cache_changed_on_disk_total",
            "Resident models dropped because a shard changed on disk after load",
            registry=r,
        )

        self.handoffs = Counter(
            "keepwarm_cache_handoffs_total",
            "Hand-offs between daemons on one socket, by this daemon's role and the outcome "
            f"({', '.join(HANDOFF_OUTCOMES)})",
            ["role", "outcome"],
            registry=r,
        )
        self.adopted_arenas = Counter(
            "keepwarm_cache_adopted_arenas_total",
            "Handed-over arenas verified and served without reading the weights, by source "
            f"({PREDECESSOR}, {HOLDER})",
            ["source"],
            registry=r,
        )
        self.dropped_arenas = Counter(
            "keepwarm_cache_dropped_arenas_total",
            "Handed-over arenas not taken (reloaded if wanted), by source and reason "
            f"({', '.join(DROP_REASONS)})",
            ["source", "reason"],
            registry=r,
        )
        self.adopt_seconds = Gauge(
            "keepwarm_cache_adopt_seconds",
            "Seconds spent verifying and taking the arenas handed over at start, by source",
            ["source"],
            registry=r,
        )
        self.holder_connected = Gauge(
            "keepwarm_cache_holder_connected",
            "1 while the descriptor holder (keepwarm cache hold) answers this daemon, so a crash restarts "
            "warm; 0 without one: a crash reloads every model from disk",
            registry=r,
        )
        self.start_arenas = Gauge(
            "keepwarm_cache_start_arenas",
            "Arenas resident when the daemon began serving, by where they came from "
            f"({', '.join(ARENA_SOURCES)})",
            ["source"],
            registry=r,
        )

    def serve(self, port: int, took_over: bool = False) -> None:
        from prometheus_client import start_http_server

        start_metrics(lambda: start_http_server(port, registry=self.registry), port, took_over)


def start_metrics(start: Callable[[], object], port: int, took_over: bool) -> None:
    """Start a /metrics server now. A daemon that took over from another may find the port still
    held by it (on one host, while it drains): it then serves /metrics as soon as the port is free,
    instead of failing after the commit. Otherwise a port in use is an error, as before."""
    try:
        start()
        return
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or not took_over:
            raise
    log.warning("metrics port %d is still the predecessor's; serving /metrics once it is free", port)

    def retry() -> None:
        while True:
            time.sleep(0.2)
            try:
                start()
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                log.error("cannot serve /metrics on port %d: %s", port, exc)
                return
            log.info("serving /metrics on port %d", port)
            return

    threading.Thread(target=retry, daemon=True, name="metrics-port").start()


class PerGPUCollector(Collector):
    """Several daemons' registries as one: each family once, its samples labelled gpu=<UUID>."""

    def __init__(self, registries: dict[str, CollectorRegistry]) -> None:
        self.registries = registries  # GPU UUID -> that daemon's registry

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for gpu, registry in self.registries.items():
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {**sample.labels, GPU_LABEL: gpu}
                    out.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp))
        yield from merged.values()


def serve_per_gpu(registries: dict[str, CollectorRegistry], port: int, took_over: bool = False) -> None:
    """One /metrics for the daemons of several GPUs (``--all-gpus``)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(PerGPUCollector(registries))
    start_metrics(lambda: start_http_server(port, registry=registry), port, took_over)


class ClientMetrics:
    def __init__(self) -> None:
        self.attach_seconds = Histogram(
            "keepwarm_cache_client_attach_seconds",
            "Client attach/load time by source",
            ["source"],
            buckets=_LATENCY_BUCKETS,
        )
        self.hits = Counter("keepwarm_cache_client_hits_total", "Attaches served by the cache")
        self.misses = Counter(
            "keepwarm_cache_client_misses_total",
            "Attaches that fell back to disk, by reason (absent, mismatch, unavailable, error)",
            ["reason"],
        )


_client: ClientMetrics | None = None
_client_lock = threading.Lock()


def client_metrics() -> ClientMetrics:
    global _client
    with _client_lock:
        if _client is None:
            _client = ClientMetrics()
        return _client
