"""Which kind of model a checkpoint is, decided once at start from its ``config.json``.

The kind picks the engine (the paged LLMEngine, or Whisper's own engine) and what the server does
around it (prefetching the weights, preloading model classes, checking the audio backend). The
server calls ``detect_kind`` once and hands the answer down, so no part of serving reads the config
again to ask. Standard library only: the engine, audio and the server all import it.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path


class ModelKind(StrEnum):
    TEXT = "text"  # a causal LM: LLMEngine (also what an unreadable config is taken for)
    SPEECH = "speech"  # speech to text (Whisper): audio.whisper_engine.WhisperEngine
    AUDIO_LANGUAGE = "audio_language"  # audio in, text out (Qwen2-Audio, Voxtral): LLMEngine + encoder


# model_type -> the transformers class the engine builds (not registered with AutoModelForCausalLM).
AUDIO_LANGUAGE_MODELS = {
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    "voxtral": "VoxtralForConditionalGeneration",
}
SPEECH_MODELS = frozenset({"whisper"})  # model_type values WhisperEngine serves


def kind_of(model_type: object) -> ModelKind:
    """The kind of a config's ``model_type`` (anything unknown is a text model: the engine judges it)."""
    if model_type in SPEECH_MODELS:
        return ModelKind.SPEECH
    if model_type in AUDIO_LANGUAGE_MODELS:
        return ModelKind.AUDIO_LANGUAGE
    return ModelKind.TEXT


def detect_kind(model_dir: str | Path) -> ModelKind:
    """The kind of the checkpoint in ``model_dir``. A missing or unreadable ``config.json`` is TEXT:
    the engine then fails its load with its own message about the checkpoint."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ModelKind.TEXT
    return kind_of(config.get("model_type") if isinstance(config, dict) else None)
