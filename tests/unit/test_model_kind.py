"""model_kind.detect_kind: one answer per checkpoint, from config.json's model_type."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepwarm_runtime.model_kind import ModelKind, detect_kind


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        ('{"model_type": "whisper"}', ModelKind.SPEECH),
        ('{"model_type": "qwen2_audio"}', ModelKind.AUDIO_LANGUAGE),
        ('{"model_type": "voxtral"}', ModelKind.AUDIO_LANGUAGE),
        ('{"model_type": "llama"}', ModelKind.TEXT),
        ("{}", ModelKind.TEXT),
        ("[]", ModelKind.TEXT),  # not an object: the engine names the broken config
        ("{not json", ModelKind.TEXT),
    ],
)
def test_kind_from_config(tmp_path: Path, config: str, kind: ModelKind) -> None:
    (tmp_path / "config.json").write_text(config)
    assert detect_kind(tmp_path) is kind


def test_a_directory_without_config_is_a_text_model(tmp_path: Path) -> None:
    assert detect_kind(tmp_path) is ModelKind.TEXT
    assert detect_kind(tmp_path / "absent") is ModelKind.TEXT


def test_real_checkpoints(tiny_llama: Path) -> None:
    assert detect_kind(tiny_llama) is ModelKind.TEXT
