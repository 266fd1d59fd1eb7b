"""The PyAV backend: the wheel's own FFmpeg decodes frame by frame in Python, ``av.AudioResampler`` resamples.

The slowest backend under concurrency (each frame returns to Python), but it needs nothing from the OS.
The duration guard runs as frames arrive, so a file whose header lies about its length still stops.
"""

from __future__ import annotations

import io
from types import ModuleType
from typing import Any

import numpy as np
import torch

from keepwarm_runtime.audio.decoded import BackendOutput, Guard, exact_codec
from keepwarm_runtime.audio.errors import AudioError, BackendUnavailable

NAME = "pyav"


def _module() -> ModuleType:
    try:
        import av
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(f"PyAV cannot be loaded ({exc}); install the audio extra") from exc
    return av


def available() -> None:
    """Raise BackendUnavailable when PyAV cannot be imported."""
    _module()


def decode(data: bytes, sample_rate: int, guard: Guard) -> BackendOutput:
    av = _module()
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise AudioError(f"cannot read the audio (corrupt or not audio): {exc}") from exc
    with container:
        if not container.streams.audio:
            raise AudioError("the file has no audio stream")
        stream = container.streams.audio[0]
        duration = _duration(stream, container, av.time_base)
        channels = stream.codec_context.channels or 1
        guard(duration, channels)
        resampler = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=sample_rate)
        chunks: list[np.ndarray] = []
        decoded = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                    decoded += out.samples
                guard(decoded / sample_rate, channels)
            chunks.extend(out.to_ndarray() for out in resampler.resample(None))
        except (av.FFmpegError, ValueError) as exc:
            raise AudioError(f"cannot decode the audio (corrupt or truncated): {exc}") from exc
        codec = stream.codec_context.name
    array = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)
    return BackendOutput(
        samples=torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)),
        sample_rate=sample_rate,
        header_duration_s=duration,
        header_exact=exact_codec(codec),
    )


def _duration(stream: Any, container: Any, time_base: int) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / time_base
    return None
