"""``load_audio``: encoded bytes -> float32 samples at one rate, through the configured backend.

``auto`` tries torchcodec, soundfile, PyAV in turn, and moves on only when a backend cannot be loaded
or cannot open the container; a corrupt, truncated, empty or over-long file is an ``AudioError``
(a ``ValueError``) from the first backend that could read the format, never a reason to try another.
Limits are checked from the header before decoding and on the samples after.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import torch

from keepwarm_runtime.audio import backend_pyav, backend_soundfile, backend_torchcodec
from keepwarm_runtime.audio.decoded import BackendOutput, Guard
from keepwarm_runtime.audio.errors import (
    AudioError,
    AudioTooLong,
    BackendUnavailable,
    EmptyAudio,
    UnsupportedContainer,
    UnsupportedFormat,
)
from keepwarm_runtime.audio.headers import declared_duration
from keepwarm_runtime.audio.resample import downmix, resample
from keepwarm_runtime.audio.settings import AUTO, AUTO_ORDER, resolve_backend
from keepwarm_runtime.log_once import log_once

logger = logging.getLogger(__name__)

BACKENDS: dict[str, ModuleType] = {m.NAME: m for m in (backend_torchcodec, backend_soundfile, backend_pyav)}
_BYTES_PER_SAMPLE = 4  # float32
_TRUNCATION_TOLERANCE_S = 0.01  # decoders may drop a partial frame at the end
AudioSource = bytes | bytearray | memoryview | str | os.PathLike | BinaryIO


@dataclass(frozen=True)
class DecodedAudio:
    samples: torch.Tensor  # float32 in [-1, 1]: [n] when mono, else [channels, n]
    sample_rate: int  # Hz
    backend: str  # the backend that decoded it
    decode_seconds: float  # wall time spent decoding and resampling

    @property
    def duration_s(self) -> float:
        return self.samples.shape[-1] / self.sample_rate


def load_audio(
    source: AudioSource,
    *,
    sample_rate: int,
    mono: bool = True,
    max_duration_s: float | None = None,
    max_decoded_bytes: int | None = None,
    backend: str | None = None,
) -> DecodedAudio:
    """Decode ``source`` (bytes, a path or a binary file) to ``sample_rate`` Hz float32 samples.

    ``backend`` None means ``KEEPWARM_AUDIO_BACKEND`` or ``auto``. Raises AudioError (bad audio, a
    ValueError) or RuntimeError (no backend installed).
    """
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive (got {sample_rate})")
    name = resolve_backend(backend)
    data = _read(source)
    if not data:
        raise EmptyAudio("the audio is empty (0 bytes)")
    guard = _guard(sample_rate, mono, max_duration_s, max_decoded_bytes)
    declared = declared_duration(data)
    guard(declared, 1)
    started = time.perf_counter()
    used, out = _decode(name, data, sample_rate, guard)
    samples = _finish(out, declared, sample_rate, mono)
    duration = samples.shape[-1] / sample_rate
    if duration == 0:
        raise EmptyAudio("the audio decodes to no samples")
    guard(duration, 1 if samples.dim() == 1 else samples.shape[0])
    return DecodedAudio(samples, sample_rate, used, time.perf_counter() - started)


def check_backend(name: str | None = None) -> str:
    """The resolved backend name; raises RuntimeError at start-up if a forced one cannot be loaded."""
    resolved = resolve_backend(name)
    candidates = AUTO_ORDER if resolved == AUTO else (resolved,)
    reasons = []
    for candidate in candidates:
        try:
            BACKENDS[candidate].available()
            return resolved
        except BackendUnavailable as exc:
            reasons.append(str(exc))
    raise RuntimeError("no audio backend can be loaded: " + "; ".join(reasons))


def _read(source: AudioSource) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    if isinstance(source, str | os.PathLike):
        return Path(source).read_bytes()
    if hasattr(source, "read"):
        return source.read()
    raise TypeError(f"audio source must be bytes, a path or a binary file, not {type(source).__name__}")


def _guard(sample_rate: int, mono: bool, max_duration_s: float | None, max_bytes: int | None) -> Guard:
    def guard(duration_s: float | None, channels: int) -> None:
        if duration_s is None:
            return
        if max_duration_s is not None and duration_s > max_duration_s:
            raise AudioTooLong(f"the audio lasts {duration_s:.2f}s; the limit is {max_duration_s:g}s")
        out_channels = 1 if mono else max(1, channels)
        decoded = int(duration_s * sample_rate) * out_channels * _BYTES_PER_SAMPLE
        if max_bytes is not None and decoded > max_bytes:
            raise AudioTooLong(f"the audio decodes to {decoded} bytes; the limit is {max_bytes} bytes")

    return guard


def _decode(name: str, data: bytes, sample_rate: int, guard: Guard) -> tuple[str, BackendOutput]:
    """(backend used, its output): the forced backend, or the first of ``auto`` that can read it."""
    candidates = AUTO_ORDER if name == AUTO else (name,)
    skipped: list[str] = []
    unavailable = 0
    for candidate in candidates:
        try:
            out = BACKENDS[candidate].decode(data, sample_rate, guard)
        except BackendUnavailable as exc:
            unavailable += 1
            skipped.append(f"{candidate}: {exc}")
            continue
        except UnsupportedContainer as exc:
            skipped.append(f"{candidate}: {exc}")
            continue
        log_once(
            logger,
            logging.INFO,
            ("audio-backend", candidate),
            "audio: decoding with %s (%s)",
            candidate,
            name,
        )
        return candidate, out
    if unavailable == len(candidates):
        raise RuntimeError("no audio backend can be loaded: " + "; ".join(skipped))
    raise UnsupportedFormat("unsupported audio format: " + "; ".join(skipped))


def _finish(out: BackendOutput, declared: float | None, sample_rate: int, mono: bool) -> torch.Tensor:
    """Truncation check, downmix, resample: the [n] or [channels, n] tensor load_audio returns.

    ``declared``: the length the file's own header states (WAV, FLAC), which backends do not report.
    """
    samples = out.samples
    decoded_s = samples.shape[-1] / out.sample_rate if out.sample_rate else 0.0
    claimed = declared if declared is not None else out.header_duration_s if out.header_exact else None
    if claimed is not None and decoded_s < claimed - _TRUNCATION_TOLERANCE_S:
        raise AudioError(f"the audio is truncated: the header says {claimed:.3f}s, it holds {decoded_s:.3f}s")
    if mono:
        samples = downmix(samples)
    samples = resample(samples, out.sample_rate, sample_rate)
    return samples[0] if mono else samples
