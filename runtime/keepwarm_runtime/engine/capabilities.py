"""``EngineCapabilities``: what an engine offers beyond generating tokens, stated by the engine itself.

The server reads this (server/engine_client.py) instead of probing an engine's attributes, so an
engine that lacks a feature says so by its defaults: no LoRA, no start-up profile, no MoE layers,
no transcription, no audio input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keepwarm_runtime.engine.lora import LoraSlots
    from keepwarm_runtime.engine.multimodal import AudioSpec
    from keepwarm_runtime.engine.startup import StartupProfile


@dataclass(frozen=True)
class EngineCapabilities:
    # Audio-language chat (Qwen2-Audio, Voxtral): requests carry AudioFeatures, the engine's step runs
    # the audio encoder; what a server needs to build them (marker, placeholder, embedding counts).
    audio: AudioSpec | None = None
    transcription: bool = False  # speech to text: /v1/audio/transcriptions and /translations (Whisper)
    lora: LoraSlots | None = None  # its LoRA adapters (--enable-lora), those of --lora-modules at start
    startup: StartupProfile | None = None  # its start-up phases (engine/startup.py), marked while loading
    moe_backends: Mapping[str, str] = field(default_factory=dict)  # experts module -> MoE backend
