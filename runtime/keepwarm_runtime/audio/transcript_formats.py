"""The OpenAI transcription ``response_format``s: json, text, verbose_json, srt, vtt.

The engine decodes without timestamp tokens, so a transcript is one segment spanning the whole clip.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TEXT_FORMATS = {"text": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}  # media types


@dataclass(frozen=True)
class Transcript:
    task: str  # "transcribe" | "translate"
    language: str  # ISO code, given or detected
    duration_s: float  # of the decoded audio
    text: str
    token_ids: list[int]
    sum_logprob: float  # of the generated tokens
    temperature: float


def language_name(code: str) -> str:
    """OpenAI reports languages by name ("english"); transformers knows Whisper's table."""
    try:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
    except ImportError:
        return code
    return LANGUAGES.get(code, code)


def as_json(t: Transcript) -> dict:
    return {"text": t.text, "usage": {"type": "duration", "seconds": math.ceil(t.duration_s)}}


def as_verbose_json(t: Transcript) -> dict:
    segment = {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": round(t.duration_s, 3),
        "text": t.text,
        "tokens": t.token_ids,
        "temperature": t.temperature,
        "avg_logprob": t.sum_logprob / max(1, len(t.token_ids)),
        "compression_ratio": compression_ratio(t.text),
    }
    return {
        "task": t.task,
        "language": language_name(t.language),
        "duration": round(t.duration_s, 3),
        "text": t.text,
        "segments": [segment],
        "usage": {"type": "duration", "seconds": math.ceil(t.duration_s)},
    }


def as_srt(t: Transcript) -> str:
    return f"1\n{_clock(0.0, ',')} --> {_clock(t.duration_s, ',')}\n{t.text.strip()}\n\n"


def as_vtt(t: Transcript) -> str:
    return f"WEBVTT\n\n{_clock(0.0, '.')} --> {_clock(t.duration_s, '.')}\n{t.text.strip()}\n\n"


def compression_ratio(text: str) -> float:
    """Whisper's repetition signal: text bytes over zlib-compressed bytes."""
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def _clock(seconds: float, decimal: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"
