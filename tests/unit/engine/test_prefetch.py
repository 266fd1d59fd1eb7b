"""engine/prefetch.py: the server's background attach is handed to the loader only when it is the
attach the loader would make, for every checkpoint (online FP8 and kernel expert layouts too: the
request is resolved from the config and checkpoint), and its failures surface in the loader, not in
the thread."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.client import CacheAttachError
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.loader import load_model
from keepwarm_runtime.engine.prefetch import WeightPrefetch, attach_request
from keepwarm_runtime.engine.startup import StartupProfile
from keepwarm_runtime.model_kind import ModelKind
from keepwarm_runtime.weights.fp8 import E4M3
from keepwarm_runtime.weights.kernel_layout import FLASHINFER_CUTLASS, MODEL, UP_FIRST_ATTR
from tests.integration.engine.strict import differing_bytes


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    from keepwarm_runtime.modelgen import make_model

    return make_model(tmp_path_factory.mktemp("tiny-moe"), arch="qwen3_moe", params="400K", vocab_size=2048)


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


def test_an_online_fp8_attach_is_prefetched_and_taken(tiny_llama: Path):
    """The FP8 settings come from config.json and the flag, not the built model: the background
    attach quantizes (here from disk, the daemon's plan) and the loader takes it, bit for bit what it
    would have attached itself."""
    config = EngineConfig(str(tiny_llama), dtype="bfloat16", quantization="fp8")
    prefetch = WeightPrefetch.start(config, ModelKind.TEXT)
    profile = StartupProfile()
    model, info = load_model(config, profile, prefetch)
    alone, _ = load_model(EngineConfig(str(tiny_llama), dtype="bfloat16", quantization="fp8"))

    assert profile.weights_prefetched and (info.source, info.copied_tensors) == ("disk", 0)
    assert any(p.dtype == E4M3 for p in model.parameters())
    assert differing_bytes(model, alone) == []


def test_a_prefetch_without_the_engines_quantization_is_not_used(tiny_llama: Path, caplog):
    prefetch = WeightPrefetch.start(EngineConfig(str(tiny_llama), dtype="bfloat16"), ModelKind.TEXT)
    profile = StartupProfile()
    with caplog.at_level(logging.WARNING, "keepwarm_runtime.engine.prefetch"):
        model, _ = load_model(
            EngineConfig(str(tiny_llama), dtype="bfloat16", quantization="fp8"), profile, prefetch
        )

    assert not profile.weights_prefetched and "do not match the engine's settings" in caplog.text
    assert any(p.dtype == E4M3 for p in model.parameters())  # attached again, quantized as asked


def test_the_request_resolves_the_expert_layout_from_the_checkpoint(tiny_llama: Path, tiny_moe: Path):
    """A kernel layout is asked for where it converts experts (a meta model of config.json says
    where), else the checkpoint is keyed in the model layout, as the daemon keys it."""
    dense = attach_request(EngineConfig(str(tiny_llama), expert_layout=FLASHINFER_CUTLASS))
    moe = attach_request(EngineConfig(str(tiny_moe), expert_layout=FLASHINFER_CUTLASS))
    fp8 = attach_request(EngineConfig(str(tiny_moe), quantization="fp8"))

    assert (dense.expert_layout, dense.online) == (MODEL, None)
    assert (moe.expert_layout, moe.online) == (FLASHINFER_CUTLASS, None)
    assert fp8.expert_layout == MODEL and fp8.online is not None and fp8.online.source == "online"
    assert moe.arguments()["expert_layout"] == FLASHINFER_CUTLASS


def test_a_kernel_layout_attach_is_prefetched_and_its_experts_marked(tiny_moe: Path):
    """CPU twin of a GPU start with --expert-layout flashinfer_cutlass: the background attach converts
    the experts (from disk here), the loader takes it and marks them [up; gate] for their backend."""
    config = EngineConfig(str(tiny_moe), expert_layout=FLASHINFER_CUTLASS)
    prefetch = WeightPrefetch.start(config, ModelKind.TEXT)
    profile = StartupProfile()
    model, info = load_model(config, profile, prefetch)
    alone, _ = load_model(EngineConfig(str(tiny_moe), expert_layout=FLASHINFER_CUTLASS))

    assert profile.weights_prefetched and (info.source, info.copied_tensors) == ("disk", 0)
    assert _up_first(model) and _up_first(model) == _up_first(alone)
    assert differing_bytes(model, alone) == []


def test_nothing_is_prefetched_for_a_speech_model(tiny_llama: Path):
    """Whisper's own engine loads its weights: an attach here would be a second copy nobody takes."""
    prefetch = WeightPrefetch.start(EngineConfig(str(tiny_llama), dtype="float32"), ModelKind.SPEECH)
    assert prefetch.take(EngineConfig(str(tiny_llama), dtype="float32")) is None


def _up_first(model) -> list[str]:
    """Experts modules marked as holding [up; gate] halves."""
    return [name for name, m in model.named_modules() if getattr(m, UP_FIRST_ATTR, False)]
