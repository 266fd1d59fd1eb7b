"""engine/prefetch.py: the server's background attach is handed to the loader only when it is the
attach the loader would make, and its failures surface in the loader, not in the thread."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.client import CacheAttachError
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.loader import load_model
from keepwarm_runtime.engine.prefetch import WeightPrefetch
from keepwarm_runtime.engine.startup import StartupProfile
from keepwarm_runtime.model_kind import ModelKind


def test_the_loader_uses_the_prefetched_weights_and_says_so(tiny_llama: Path):
    config = EngineConfig(str(tiny_llama), dtype="float32")
    prefetch = WeightPrefetch.start(config, ModelKind.TEXT)
    profile = StartupProfile()
    model, info = load_model(config, profile, prefetch)

    assert profile.weights_prefetched and info.source == "disk"
    assert profile.weights_attach_s == info.seconds > 0
    assert "(disk; attached in the background in " in profile.summary()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert prefetch.take(EngineConfig(str(tiny_llama), dtype="float32")) is None  # handed over once


def test_a_prefetch_for_other_settings_is_not_used(tiny_llama: Path, caplog):
    prefetch = WeightPrefetch.start(EngineConfig(str(tiny_llama), dtype="float32"), ModelKind.TEXT)
    profile = StartupProfile()
    with caplog.at_level(logging.WARNING, "keepwarm_runtime.engine.prefetch"):
        model, _ = load_model(EngineConfig(str(tiny_llama), dtype="bfloat16"), profile, prefetch)

    assert not profile.weights_prefetched and "attached in the background" not in profile.summary()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # attached again, as asked
    assert "do not match the engine's settings" in caplog.text
    assert prefetch.take(EngineConfig(str(tiny_llama), dtype="float32")) is None  # let go, not kept


def test_a_failed_attach_is_raised_where_the_loader_takes_it(tiny_llama: Path, tmp_path: Path):
    config = EngineConfig(str(tiny_llama), cache_socket_dir=str(tmp_path / "no-daemon"), cache_fallback=False)
    prefetch = WeightPrefetch.start(config, ModelKind.TEXT)
    with pytest.raises(CacheAttachError):
        prefetch.take(config)


def test_nothing_is_prefetched_for_settings_the_loader_must_handle(tiny_llama: Path):
    """Online FP8: the cache key depends on the checkpoint's config, so the loader attaches itself."""
    prefetch = WeightPrefetch.start(EngineConfig(str(tiny_llama), quantization="fp8"), ModelKind.TEXT)
    assert prefetch.take(EngineConfig(str(tiny_llama))) is None


def test_nothing_is_prefetched_for_a_speech_model(tiny_llama: Path):
    """Whisper's own engine loads its weights: an attach here would be a second copy nobody takes."""
    prefetch = WeightPrefetch.start(EngineConfig(str(tiny_llama), dtype="float32"), ModelKind.SPEECH)
    assert prefetch.take(EngineConfig(str(tiny_llama), dtype="float32")) is None
