"""Audio metrics (prefix ``keepwarm_audio_``), registered in the server's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

DECODE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class AudioMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decode_seconds = Histogram(
            "keepwarm_audio_decode_seconds",
            "Wall seconds to decode and resample one upload, by the backend that decoded it",
            ["backend"],
            buckets=DECODE_BUCKETS,
            registry=registry,
        )
        self.processed_seconds = Counter(
            "keepwarm_audio_processed_seconds", "Seconds of audio decoded for requests", registry=registry
        )

    def record(self, backend: str, decode_seconds: float, audio_seconds: float) -> None:
        self.decode_seconds.labels(backend=backend).observe(decode_seconds)
        self.processed_seconds.inc(audio_seconds)
