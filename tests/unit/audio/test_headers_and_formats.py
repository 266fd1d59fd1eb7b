"""Declared lengths read from WAV/FLAC headers, and the transcript renderings."""

from __future__ import annotations

import pytest

from keepwarm_runtime.audio.headers import declared_duration
from keepwarm_runtime.audio.transcript_formats import Transcript, as_json, as_srt, as_verbose_json, as_vtt
from tests.unit.audio.samples import encode


@pytest.mark.parametrize("fmt", ["wav16", "wav32", "flac"])
@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2)])
def test_declared_duration(fmt: str, rate: int, channels: int) -> None:
    assert declared_duration(encode(fmt, rate, channels, 1.5)) == pytest.approx(1.5)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_formats_without_an_exact_length_declare_none(fmt: str) -> None:
    assert declared_duration(encode(fmt, 16000, 1)) is None


def test_unset_or_cut_headers_declare_none() -> None:
    data = bytearray(encode("wav16", 16000, 1))
    assert declared_duration(bytes(data[:20])) is None  # cut before the data chunk
    data[40:44] = b"\xff\xff\xff\xff"  # a streaming writer's "unknown" size
    assert declared_duration(bytes(data)) is None
    assert declared_duration(b"fLaC\x00") is None
    assert declared_duration(b"") is None


def _transcript(duration: float) -> Transcript:
    return Transcript("transcribe", "en", duration, " hello there", [5, 6, 7], -3.0, 0.0)


def test_renderings() -> None:
    t = _transcript(3725.25)
    assert as_srt(t) == "1\n00:00:00,000 --> 01:02:05,250\nhello there\n\n"
    assert as_vtt(t) == "WEBVTT\n\n00:00:00.000 --> 01:02:05.250\nhello there\n\n"
    assert as_json(t) == {"text": " hello there", "usage": {"type": "duration", "seconds": 3726}}
    verbose = as_verbose_json(t)
    assert verbose["language"] == "english"
    assert verbose["segments"][0]["avg_logprob"] == pytest.approx(-1.0)
    assert verbose["segments"][0]["tokens"] == [5, 6, 7]
