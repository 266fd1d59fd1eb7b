"""Prometheus metrics of the server (prefix ``keepwarm_``), in a registry of its own per app.

Request-level timings (TTFT, time per output token, end-to-end) are observed by the serving code as
outputs reach the client; engine-level gauges (running/waiting sequences, KV-cache usage) are set by
the engine thread after each step; load metrics and start-up phases once, when the engine is ready.
The cache client's attach metrics (``keepwarm_cache_client_*``, kept process-wide by the cache
client) are registered here too, so they appear on the server's /metrics.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from keepwarm_runtime.cache.metrics import client_metrics
from keepwarm_runtime.engine.startup import RESTORE_PHASE
from keepwarm_runtime.server.supervisor import RESTARTS
from keepwarm_runtime.snapshot import outcome

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ADAPTER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """All server metrics; ``render()`` gives the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        cache = client_metrics()
        for collector in (cache.attach_seconds, cache.hits, cache.misses):
            self.registry.register(collector)
        r, m = self.registry, {"model_name": model_name}
        self.requests = Counter(
            "keepwarm_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "keepwarm_time_to_first_token_seconds",
            "Time from request arrival to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "keepwarm_time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "keepwarm_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("keepwarm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("keepwarm_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("keepwarm_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("keepwarm_num_requests_waiting", "Sequences waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("keepwarm_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.preemptions = Gauge("keepwarm_num_preemptions", "Preemptions since start", registry=r)
        self.aborts = Counter(
            "keepwarm_request_aborts", "Requests aborted in flight (client went away)", registry=r
        )
        self.active = Gauge("keepwarm_active_requests", "Requests the server is answering now", registry=r)
        self.weight_load = Gauge(
            "keepwarm_weight_load_seconds",
            "Seconds to attach or load the weights, by where they came from",
            ["source"],
            registry=r,
        )
        self.start_to_ready = Gauge(
            "keepwarm_process_start_to_ready_seconds",
            "Seconds from the serving process's start (a supervised worker's: its fork) to ready",
            registry=r,
        )
        self.startup_phase = Gauge(
            "keepwarm_startup_phase_seconds",
            "Seconds of each start-up phase, process start to ready (engine/startup.py PHASES), and the "
            "parent's restore from a snapshot (RESTORE_PHASE)",
            ["phase"],
            registry=r,
        )
        self.startup_source = Counter(
            "keepwarm_startup_source",
            "How the supervising parent of this process started: restored from a node-local snapshot, "
            "or by importing, and why (snapshot/outcome.py: hit, off, absent, mismatch, digest, ...)",
            ["source", "reason"],
            registry=r,
        )
        started = outcome.recorded()  # the parent's record (a supervised worker inherits it)
        if started is not None:
            self.startup_source.labels(source=started.source.value, reason=started.reason.value).inc()
            if started.restore_s is not None:
                self.startup_phase.labels(phase=RESTORE_PHASE).set(started.restore_s)
        self.moe_layers = Gauge(
            "keepwarm_moe_layers",
            "MoE experts modules by the backend chosen for them at load (engine.moe.oracle)",
            ["backend"],
            registry=r,
        )
        self.lora_requests_info = Gauge(
            "keepwarm_lora_requests_info",
            "LoRA adapters of running and waiting requests, comma-separated (vLLM's lora_requests_info; "
            "value: when it was set)",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self.lora_load = Histogram(
            "keepwarm_lora_load_seconds",
            "Seconds to read and check a LoRA adapter as it is registered, by where its tensors came "
            "from (cache: the node cache's arena, zero-copy; disk)",
            ["source"],
            buckets=_ADAPTER_BUCKETS,
            registry=r,
        )
        self.lora_requests = Counter(
            "keepwarm_lora_requests",
            "Requests served with each LoRA adapter, counted as they end (base-model requests are not)",
            ["adapter"],
            registry=r,
        )
        self.lora_generation_tokens = Counter(
            "keepwarm_lora_generation_tokens",
            "Tokens generated with each LoRA adapter (also counted in keepwarm_generation_tokens)",
            ["adapter"],
            registry=r,
        )
        self.lora_refused = Gauge(
            "keepwarm_lora_adapter_refused",
            "LoRA adapters --lora-modules-file lists that the server cannot serve (value 1; the log names "
            "why); retried while listed",
            ["adapter"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "keepwarm_worker_restarts",
            "Serving workers restarted by the supervising parent, by cause (crash, hang, unhealthy)",
            ["cause"],
            registry=r,
        )
        for cause, count in RESTARTS.by_cause.items():  # inherited from the parent by the fork
            self.worker_restarts.labels(cause=cause).inc(count)
        self.sleep_level = Gauge(
            "keepwarm_sleep_level",
            "0 while awake, else the level the engine sleeps at (POST /sleep, --enable-sleep-mode)",
            registry=r,
        )
        self.info = Gauge("keepwarm_model_info", "The served model (value 1)", list(m), registry=r)
        self.info.labels(**m).set(1)

    def record_load(self, source: str, seconds: float, started_at: float) -> None:
        self.weight_load.labels(source=source).set(seconds)
        self.start_to_ready.set(max(0.0, time.time() - started_at))

    def record_startup(self, seconds: dict[str, float]) -> None:
        """`seconds`: phase -> seconds (StartupProfile.seconds); they sum to process start -> ready."""
        for phase, value in seconds.items():
            self.startup_phase.labels(phase=phase).set(value)

    def record_moe(self, backends: dict[str, str]) -> None:
        """`backends`: experts module name -> backend (LLMEngine.moe_backends)."""
        for backend in set(backends.values()):
            self.moe_layers.labels(backend=backend).set(sum(b == backend for b in backends.values()))

    def record_engine(self, num_running: int, num_waiting: int, kv_usage: float, preemptions: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.preemptions.set(preemptions)

    def record_loras(self, running: tuple[str, ...], waiting: tuple[str, ...], max_loras: int) -> None:
        """One series, as vLLM's: the adapters in use now (routers pick pods that have an adapter loaded)."""
        if not max_loras:
            return
        self.lora_requests_info.clear()
        labels = {"running_lora_adapters": ",".join(running), "waiting_lora_adapters": ",".join(waiting)}
        self.lora_requests_info.labels(**labels, max_lora=str(max_loras)).set(time.time())

    def record_lora_load(self, source: str, seconds: float) -> None:
        """One adapter registered (engine/lora/adapter.py LoraWeights.source and .seconds)."""
        self.lora_load.labels(source=source).observe(seconds)

    def record_lora_refused(self, adapters: tuple[str, ...]) -> None:
        """The --lora-modules-file entries refused now (server/openai/lora/file_sync.py); none: no series."""
        self.lora_refused.clear()
        for adapter in adapters:
            self.lora_refused.labels(adapter=adapter).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request: ``tokens(n)`` when its generated-token count grows, ``done()`` at the end.

    ``adapter``: the LoRA adapter the request runs with (set before its first token), whose own
    request and token counters it also feeds."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, arrival: float | None = None) -> None:
        self.adapter: str | None = None
        self._metrics = metrics
        self._arrival = time.perf_counter() if arrival is None else arrival  # perf_counter() at arrival
        self._first: float | None = None
        self._last = self._arrival
        self._generated = 0
        metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, total_generated: int, first_token_time: float | None = None) -> None:
        """``first_token_time``: when the engine sampled the request's first token (perf_counter), if it
        says; a request that gets only its final output (RequestOutputKind.FINAL_ONLY) is first seen
        here at its end, so its time to first token comes from that, not from now."""
        now = time.perf_counter()
        if total_generated > self._generated:
            if self._first is None:
                self._first = now if first_token_time is None else min(first_token_time, now)
                self._metrics.ttft.observe(self._first - self._arrival)
            self._metrics.generation_tokens.inc(total_generated - self._generated)
            if self.adapter is not None:
                self._metrics.lora_generation_tokens.labels(self.adapter).inc(
                    total_generated - self._generated
                )
            self._generated, self._last = total_generated, now

    def done(self) -> None:
        if self.adapter is not None:
            self._metrics.lora_requests.labels(self.adapter).inc()
        self._metrics.e2e.observe(self._last - self._arrival)
        if self._first is not None and self._generated > 1:
            self._metrics.tpot.observe((self._last - self._first) / (self._generated - 1))
