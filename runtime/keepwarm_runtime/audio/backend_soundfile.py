"""The soundfile backend: libsndfile (bundled with the wheel) reads WAV, FLAC, Ogg and MP3, no resampling.

libsndfile saying "format not recognised" or "unsupported encoding" means the container is beyond it
(``auto`` moves on); any other failure means the file is bad.
"""

from __future__ import annotations

import io
from types import ModuleType

import torch

from keepwarm_runtime.audio.decoded import BackendOutput, Guard
from keepwarm_runtime.audio.errors import AudioError, BackendUnavailable, UnsupportedContainer

NAME = "soundfile"
_UNRECOGNISED_FORMAT, _UNSUPPORTED_ENCODING = 1, 4  # libsndfile's SF_ERR_* codes
_EXACT_FORMATS = {"WAV", "WAVEX", "W64", "RF64", "AIFF", "CAF", "FLAC"}


def _module() -> ModuleType:
    try:
        import soundfile
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(f"soundfile cannot be loaded ({exc}); install the audio extra") from exc
    return soundfile


def available() -> None:
    """Raise BackendUnavailable when soundfile cannot be imported."""
    _module()


def decode(data: bytes, sample_rate: int, guard: Guard) -> BackendOutput:
    del sample_rate  # libsndfile does not resample; load_audio does it in torch
    sf = _module()
    try:
        handle = sf.SoundFile(io.BytesIO(data))
    except sf.LibsndfileError as exc:
        if exc.code in (_UNRECOGNISED_FORMAT, _UNSUPPORTED_ENCODING):
            raise UnsupportedContainer(f"soundfile cannot read this format: {exc.error_string}") from exc
        raise AudioError(f"cannot read the audio (corrupt): {exc.error_string}") from exc
    except (RuntimeError, TypeError) as exc:
        raise AudioError(f"cannot read the audio: {exc}") from exc
    with handle:
        rate, frames = handle.samplerate, handle.frames
        duration = frames / rate if rate > 0 and 0 <= frames < 2**62 else None
        guard(duration, handle.channels)
        try:
            array = handle.read(dtype="float32", always_2d=True)  # [n, channels]
        except (RuntimeError, sf.LibsndfileError) as exc:
            raise AudioError(f"cannot decode the audio (corrupt or truncated): {exc}") from exc
    return BackendOutput(
        samples=torch.from_numpy(array.T.copy()),
        sample_rate=rate,
        header_duration_s=duration,
        header_exact=handle.format in _EXACT_FORMATS,
    )
