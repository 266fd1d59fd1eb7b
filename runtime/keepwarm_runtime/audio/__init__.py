"""Audio decoding for the server: ``load_audio`` over torchcodec, soundfile and PyAV (the ``audio`` extra).

Importing this package loads no backend; each backend imports its library when first used, so a
missing one only matters if it is chosen.
"""

from keepwarm_runtime.audio.errors import (
    AudioError,
    AudioTooLarge,
    AudioTooLong,
    EmptyAudio,
    UnsupportedFormat,
)
from keepwarm_runtime.audio.load import BACKENDS, DecodedAudio, check_backend, load_audio
from keepwarm_runtime.audio.settings import AUTO, AUTO_ORDER, BACKEND_NAMES, ENV_VAR, resolve_backend

__all__ = [
    "AUTO",
    "AUTO_ORDER",
    "BACKENDS",
    "BACKEND_NAMES",
    "ENV_VAR",
    "AudioError",
    "AudioTooLarge",
    "AudioTooLong",
    "DecodedAudio",
    "EmptyAudio",
    "UnsupportedFormat",
    "check_backend",
    "load_audio",
    "resolve_backend",
]
