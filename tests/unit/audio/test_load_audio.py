"""load_audio on audio made here: every format, rate and channel count through each backend."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from keepwarm_runtime.audio import (
    AUTO_ORDER,
    AudioError,
    AudioTooLong,
    EmptyAudio,
    UnsupportedFormat,
    load_audio,
)
from keepwarm_runtime.audio.resample import resampled_length
from tests.unit.audio.samples import FORMATS, encode, encode_m4a, mono_reference, tone

pytest.importorskip("soundfile", reason="needs the audio extra")
pytest.importorskip("av", reason="needs the audio extra")

TARGET = 16000
SECONDS = 1.0
# Lossy codecs add or drop a codec frame of priming/padding at the ends.
LOSSY_LENGTH_SLACK = 0.05

CASES = [(fmt, rate, channels) for fmt, spec in FORMATS.items() for rate in spec.rates for channels in (1, 2)]


def _interior(x: np.ndarray, rate: int) -> slice:
    """Skip 20 ms at each end, where the resampling filter sees the edge of the file."""
    edge = rate // 50
    return slice(edge, len(x) - edge)


@pytest.mark.parametrize("backend", AUTO_ORDER)
@pytest.mark.parametrize(("fmt", "rate", "channels"), CASES)
def test_decodes_resamples_and_downmixes(backend: str, fmt: str, rate: int, channels: int) -> None:
    decoded = load_audio(encode(fmt, rate, channels, SECONDS), sample_rate=TARGET, backend=backend)
    assert decoded.backend == backend
    assert decoded.sample_rate == TARGET
    assert decoded.samples.dtype == torch.float32 and decoded.samples.dim() == 1
    got = decoded.samples.numpy()
    expected_len = resampled_length(round(rate * SECONDS), rate, TARGET)
    if FORMATS[fmt].lossless:
        assert abs(len(got) - expected_len) <= 1
        reference = mono_reference(TARGET, channels, SECONDS)
        inner = _interior(reference, TARGET)
        np.testing.assert_allclose(got[inner], reference[inner], atol=0.02)
    else:
        assert abs(len(got) - expected_len) <= LOSSY_LENGTH_SLACK * TARGET
        rms = float(np.sqrt(np.mean(got[_interior(got, TARGET)] ** 2)))
        expected_rms = float(np.sqrt(np.mean(mono_reference(TARGET, channels, SECONDS) ** 2)))
        assert rms == pytest.approx(expected_rms, rel=0.15)


@pytest.mark.parametrize("backend", AUTO_ORDER)
def test_stereo_kept_when_not_mono(backend: str) -> None:
    decoded = load_audio(encode("wav16", 48000, 2), sample_rate=48000, mono=False, backend=backend)
    assert decoded.samples.shape == (2, 48000)
    original = torch.from_numpy(tone(48000, 2, 1.0).T.copy())
    torch.testing.assert_close(decoded.samples, original, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", AUTO_ORDER)
def test_native_rate_is_bit_exact_for_pcm(backend: str) -> None:
    decoded = load_audio(encode("wav32", 8000, 1), sample_rate=8000, backend=backend)
    np.testing.assert_allclose(decoded.samples.numpy(), tone(8000, 1, 1.0)[:, 0], atol=1e-6)


def test_auto_prefers_torchcodec() -> None:
    assert load_audio(encode("flac", 16000, 1), sample_rate=TARGET).backend == "torchcodec"


def test_env_var_selects_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_AUDIO_BACKEND", "pyav")
    assert load_audio(encode("wav16", 16000, 1), sample_rate=TARGET).backend == "pyav"
    assert (
        load_audio(encode("wav16", 16000, 1), sample_rate=TARGET, backend="soundfile").backend == "soundfile"
    )


def _hide_torchcodec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torchcodec`` fail as it does on a machine without it (or without FFmpeg)."""
    for name in [m for m in sys.modules if m == "torchcodec" or m.startswith("torchcodec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchcodec", None)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)


def test_auto_falls_back_when_torchcodec_is_unimportable(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_torchcodec(monkeypatch)
    decoded = load_audio(encode("flac", 44100, 2), sample_rate=TARGET)
    assert decoded.backend == "soundfile"
    assert abs(decoded.samples.shape[0] - TARGET) <= 1
    with pytest.raises(RuntimeError, match="torchcodec cannot be loaded"):
        load_audio(encode("flac", 44100, 2), sample_rate=TARGET, backend="torchcodec")


def test_auto_falls_back_when_soundfile_cannot_read_the_container(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode_m4a(16000)
    _hide_torchcodec(monkeypatch)
    decoded = load_audio(data, sample_rate=TARGET)
    assert decoded.backend == "pyav"
    assert decoded.duration_s == pytest.approx(1.0, abs=0.1)
    with pytest.raises(UnsupportedFormat, match="soundfile cannot read this format"):
        load_audio(data, sample_rate=TARGET, backend="soundfile")


def test_every_backend_unavailable_is_a_server_error(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode("wav16", 16000, 1)
    _hide_torchcodec(monkeypatch)
    monkeypatch.setitem(sys.modules, "soundfile", None)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(RuntimeError, match="no audio backend can be loaded") as info:
        load_audio(data, sample_rate=TARGET)
    assert not isinstance(info.value, ValueError)


BACKENDS_AND_AUTO = ("auto", *AUTO_ORDER)


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
def test_garbage_is_a_value_error_not_a_fallback(backend: str) -> None:
    garbage = np.random.default_rng(0).bytes(4096)
    with pytest.raises(AudioError):
        load_audio(garbage, sample_rate=TARGET, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
@pytest.mark.parametrize("fmt", ["wav16", "flac"])
def test_truncated_file_is_a_value_error(backend: str, fmt: str) -> None:
    data = encode(fmt, 16000, 1, 2.0)
    with pytest.raises(AudioError, match=r"truncated|corrupt"):
        load_audio(data[: len(data) // 2], sample_rate=TARGET, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
def test_corrupt_flac_frames_are_a_value_error(backend: str) -> None:
    data = bytearray(encode("flac", 16000, 1, 2.0))
    middle = len(data) // 2
    data[middle : middle + 2048] = np.random.default_rng(1).bytes(2048)
    with pytest.raises(AudioError):
        load_audio(bytes(data), sample_rate=TARGET, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
def test_empty_audio(backend: str) -> None:
    with pytest.raises(EmptyAudio):
        load_audio(b"", sample_rate=TARGET, backend=backend)
    with pytest.raises(EmptyAudio):
        load_audio(encode("wav16", 16000, 1, 0.0), sample_rate=TARGET, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
@pytest.mark.parametrize("fmt", ["wav16", "flac", "mp3", "opus"])
def test_too_long(backend: str, fmt: str) -> None:
    data = encode(fmt, 16000, 1, 2.0)
    with pytest.raises(AudioTooLong, match="limit is 1s"):
        load_audio(data, sample_rate=TARGET, max_duration_s=1.0, backend=backend)
    assert load_audio(data, sample_rate=TARGET, max_duration_s=3.0, backend=backend).duration_s > 1.5


@pytest.mark.parametrize("backend", BACKENDS_AND_AUTO)
def test_too_many_decoded_bytes(backend: str) -> None:
    data = encode("wav16", 8000, 2, 1.0)
    # 1 s at 16 kHz mono float32 is 64,000 bytes; keeping both channels doubles it.
    assert (
        load_audio(data, sample_rate=TARGET, max_decoded_bytes=64_100, backend=backend).samples.numel()
        == 16000
    )
    with pytest.raises(AudioTooLong, match="bytes"):
        load_audio(data, sample_rate=TARGET, max_decoded_bytes=64_100, mono=False, backend=backend)
    with pytest.raises(AudioTooLong, match="bytes"):
        load_audio(data, sample_rate=TARGET, max_decoded_bytes=60_000, backend=backend)


def test_pyav_guard_stops_a_stream_whose_header_does_not_say_its_length() -> None:
    # A WAV with its sizes unset (as streaming writers leave them) declares no length up front.
    data = bytearray(encode("wav16", 16000, 1, 3.0))
    data[4:8] = b"\xff\xff\xff\xff"
    data[40:44] = b"\xff\xff\xff\xff"
    with pytest.raises(AudioTooLong):
        load_audio(bytes(data), sample_rate=TARGET, max_duration_s=1.0, backend="pyav")


def test_path_and_file_sources(tmp_path: Path) -> None:
    path = tmp_path / "a.flac"
    path.write_bytes(encode("flac", 16000, 1))
    assert load_audio(path, sample_rate=TARGET).samples.shape == (16000,)
    with path.open("rb") as f:
        assert load_audio(f, sample_rate=TARGET).samples.shape == (16000,)


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: auto, torchcodec, soundfile, pyav"):
        load_audio(encode("wav16", 16000, 1), sample_rate=TARGET, backend="ffmpeg")
