"""Which audio backend decodes: names, the ``--audio-backend`` / ``KEEPWARM_AUDIO_BACKEND`` choice.

``auto`` tries the backends in ``AUTO_ORDER``: torchcodec decodes and resamples in one call that
releases the GIL, soundfile (libsndfile) reads the common lossless and Ogg/MP3 formats, PyAV decodes
anything FFmpeg knows, frame by frame.

`keepwarm serve` resolves ``KEEPWARM_AUDIO_BACKEND`` with its other settings (server/settings.py) and
passes the name on; ``resolve_backend(None)`` reads the variable here, in one place, by the settings
layer's one rule, for a caller of ``load_audio`` that names no backend (a library user).
"""

from __future__ import annotations

import os

from keepwarm_api.settings import env_name, present

ENV_VAR = env_name("audio_backend")  # KEEPWARM_AUDIO_BACKEND, as `keepwarm serve` declares it
AUTO = "auto"
AUTO_ORDER = ("torchcodec", "soundfile", "pyav")
BACKEND_NAMES = (AUTO, *AUTO_ORDER)


def validate_backend(name: str) -> str:
    """``name`` normalised, or a ValueError that lists the valid names."""
    normal = name.strip().lower()
    if normal not in BACKEND_NAMES:
        raise ValueError(f"unknown audio backend {name!r}; valid: {', '.join(BACKEND_NAMES)}")
    return normal


def resolve_backend(flag: str | None = None) -> str:
    """The configured backend: the flag if given, else ``KEEPWARM_AUDIO_BACKEND`` (empty means unset,
    the settings layer's one rule), else ``auto``."""
    if flag:
        return validate_backend(flag)
    return validate_backend(present(os.environ.get(ENV_VAR)) or AUTO)
