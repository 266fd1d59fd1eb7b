"""Audio made in the tests: a tone per channel, encoded by soundfile (WAV/FLAC/MP3/Ogg) or PyAV (M4A)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

FREQ_HZ = 440.0
AMPLITUDE = 0.5


@dataclass(frozen=True)
class Format:
    name: str
    container: str  # soundfile format, or "M4A" (PyAV)
    subtype: str | None
    lossless: bool
    rates: tuple[int, ...]  # sample rates the encoder accepts


FORMATS = {
    "wav16": Format("wav16", "WAV", "PCM_16", True, (8000, 16000, 44100, 48000)),
    "wav32": Format("wav32", "WAV", "PCM_32", True, (8000, 16000, 44100, 48000)),
    "flac": Format("flac", "FLAC", "PCM_16", True, (8000, 16000, 44100, 48000)),
    "mp3": Format("mp3", "MP3", "MPEG_LAYER_III", False, (8000, 16000, 44100, 48000)),
    "opus": Format("opus", "OGG", "OPUS", False, (8000, 16000, 48000)),
}


def tone(rate: int, channels: int, seconds: float) -> np.ndarray:
    """[n, channels] float32: channel c is the tone scaled by (c + 1) / channels."""
    t = np.arange(round(rate * seconds)) / rate
    x = AMPLITUDE * np.sin(2 * np.pi * FREQ_HZ * t)
    return np.stack([x * (c + 1) / channels for c in range(channels)], axis=1).astype(np.float32)


def mono_reference(rate: int, channels: int, seconds: float) -> np.ndarray:
    """The tone as a mono downmix (mean of the channels) of ``tone`` should be, at ``rate``."""
    return tone(rate, channels, seconds).mean(axis=1)


def encode(fmt: str, rate: int, channels: int, seconds: float = 1.0) -> bytes:
    spec = FORMATS[fmt]
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, tone(rate, channels, seconds), rate, format=spec.container, subtype=spec.subtype)
    return buf.getvalue()


def encode_m4a(rate: int = 16000, seconds: float = 1.0) -> bytes:
    """AAC in an MP4 container: FFmpeg reads it, libsndfile does not."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=rate, layout="mono")
        samples = tone(rate, 1, seconds).T  # [1, n]
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
