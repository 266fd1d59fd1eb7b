"""Where start-up time goes: contiguous phases, each measured from the end of the one before.

The server creates one ``StartupProfile`` whose origin is the process start, so the phases sum to the
time from process start to ready; the engine and loader mark the phase boundaries as they pass them
(``mark`` is cheap and needs no server). ``keepwarm serve`` logs the result once and exports it as
``keepwarm_startup_phase_seconds{phase}`` (server/base/metrics.py).

Work in background threads is not a phase of its own: the server attaches the weights in a thread
that starts before its imports (engine/prefetch.py), so the attach overlaps ``imports``,
``config`` and ``model_meta``. Phases stay the main line's contiguous waits, adding up to start to
ready: ``weights`` is then only what the main line still waited for the attach, plus filling the
model. The attach's own wall time, wherever it ran, is ``weights_attach_s`` here (in the log line)
and ``keepwarm_weight_load_seconds{source}``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# In order. Each is the time since the previous mark, so what runs between two marks is charged to
# the later one; the comments say what that is.
PHASES = (
    "imports",  # process start until the engine's modules are imported (torch, transformers, the
    # app and uvicorn starting: the server builds the engine once it listens)
    "config",  # the checkpoint's config.json, quantization checks, attention registration
    "model_meta",  # the transformers model built on the meta device (imports its model classes)
    "weights",  # attach from the node cache or read from disk (or wait for the prefetch thread doing
    # that), fill parameters, buffers, MoE/FP8 prep
    "tokenizer",  # the tokenizer and generation config
    "attention",  # keepwarm attention fused into the layers, backend chosen
    "kv_alloc",  # KV cache sized and allocated, block manager, scheduler, runner, sampler
    "warmup",  # GPU: one short request through the whole step, so the first client does not pay
    # first-use (CPU: none; the kv_alloc phase's probe ran the model: LLMEngine.warm_up)
    "ready",  # until the server marks itself ready (metrics, callbacks)
)
# The supervising parent's own phase when it was restored from a snapshot (snapshot/): the pod's start
# until the restored parent resumed. It precedes the worker's fork, so it is not one of PHASES (which
# add up to the worker's start to ready); exported beside them, and absent when the parent imported.
RESTORE_PHASE = "restore"


@dataclass
class StartupProfile:
    origin: float = field(default_factory=time.perf_counter)  # perf_counter() at the start of phase one
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in PHASES order
    weights_source: str | None = None  # "cache" | "disk", once the weights phase is marked
    # The attach's own wall time (overlapping earlier phases if prefetched).
    weights_attach_s: float | None = None
    weights_prefetched: bool = False  # attached in the background from process start (engine/prefetch.py)
    _last: float | None = None

    @classmethod
    def since_process_start(cls, process_started_at: float) -> StartupProfile:
        """A profile whose first phase began at ``process_started_at`` (a time.time() value)."""
        return cls(origin=time.perf_counter() - max(0.0, time.time() - process_started_at))

    def mark(self, phase: str) -> float:
        """End ``phase`` now; returns its seconds. Unknown names are refused, so no label goes astray."""
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; one of {', '.join(PHASES)}")
        now = time.perf_counter()
        since = self.origin if self._last is None else self._last
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - since)
        self._last = now
        return self.seconds[phase]

    def total(self) -> float:
        return sum(self.seconds.values())

    def summary(self) -> str:
        """One log line: every marked phase in order, the weights with their source."""
        parts = []
        for phase in PHASES:
            if phase in self.seconds:
                source = f" ({self._weights_note()})" if phase == "weights" and self.weights_source else ""
                parts.append(f"{phase} {self.seconds[phase]:.2f}s{source}")
        return f"startup phases: {', '.join(parts)}; total {self.total():.2f}s"

    def _weights_note(self) -> str:
        """The source, and where the attach ran when it was not all inside the weights phase."""
        if not self.weights_prefetched or self.weights_attach_s is None:
            return str(self.weights_source)
        return f"{self.weights_source}; attached in the background in {self.weights_attach_s:.2f}s"
