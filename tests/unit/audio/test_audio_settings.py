"""Choosing the audio backend: flag over environment over ``auto``, unknown names refused, logged once."""

from __future__ import annotations

import logging
import sys

import pytest

from keepwarm_runtime.audio import check_backend, load_audio, resolve_backend
from keepwarm_runtime.log_once import clear_once_cache
from tests.unit.audio.samples import encode


def test_flag_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", "pyav")
    assert resolve_backend(None) == "pyav"
    assert resolve_backend("SoundFile") == "soundfile"


def test_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEEPWARM_AUDIO_BACKEND", raising=False)
    assert resolve_backend(None) == "auto"
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", "")
    assert resolve_backend(None) == "auto"


@pytest.mark.parametrize("bad", ["ffmpeg", "torchaudio", "auto,pyav"])
def test_unknown_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    with pytest.raises(ValueError, match=r"valid: auto, torchcodec, soundfile, pyav"):
        resolve_backend(bad)
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", bad)
    with pytest.raises(ValueError, match=bad):
        resolve_backend(None)


def test_check_backend_refuses_a_forced_backend_that_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_backend("torchcodec") == "torchcodec"
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    with pytest.raises(RuntimeError, match="torchcodec cannot be loaded"):
        check_backend("torchcodec")
    assert check_backend("auto") == "auto"  # soundfile and PyAV remain


def test_backend_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clear_once_cache()
    data = encode("wav16", 16000, 1)
    with caplog.at_level(logging.INFO, logger="keepwarm_runtime.audio.load"):
        for _ in range(3):
            load_audio(data, sample_rate=16000, backend="soundfile")
    lines = [r.getMessage() for r in caplog.records if "decoding with" in r.getMessage()]
    assert lines == ["audio: decoding with soundfile (soundfile)"]
