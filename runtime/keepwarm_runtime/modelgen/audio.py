"""The audio architectures `keepwarm make-model` writes: fixed tiny random checkpoints (a user's
first audio model to serve, and the tests' own), unlike the text ones sized by ``--params``."""

from __future__ import annotations

import importlib
from pathlib import Path

# --arch -> (module, builder): each builder takes (path, seed=, dtype=) and returns the path.
AUDIO_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "whisper": ("keepwarm_runtime.modelgen.whisper", "make_whisper"),  # speech to text
    "qwen2_audio": ("keepwarm_runtime.modelgen.qwen2_audio", "make_qwen2_audio"),  # audio-language
    "voxtral": ("keepwarm_runtime.modelgen.voxtral", "make_voxtral_tekken"),  # audio-language, tekken.json
}


def make_audio_model(out: str | Path, arch: str, dtype: str = "float32", seed: int = 0) -> Path:
    """Write the tiny ``arch`` checkpoint to ``out`` (created) and return its path."""
    if arch not in AUDIO_ARCHITECTURES:
        raise ValueError(f"unknown audio architecture {arch!r}; known: {', '.join(AUDIO_ARCHITECTURES)}")
    module, builder = AUDIO_ARCHITECTURES[arch]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return getattr(importlib.import_module(module), builder)(out, seed=seed, dtype=dtype)
