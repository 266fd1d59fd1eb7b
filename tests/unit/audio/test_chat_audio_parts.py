"""Chat audio parts: splitting messages into template text and audio files, placeholder expansion."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from types import SimpleNamespace

import pytest

from keepwarm_runtime.engine.capabilities import EngineCapabilities
from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.base.protocol import ChatMessage
from keepwarm_runtime.server.openai.chat.audio import (
    AudioRef,
    _expand,
    audio_chat_prompt,
    has_audio_parts,
    resolve_audio,
    split_audio,
)


def _msg(role: str, content: object) -> ChatMessage:
    return ChatMessage.model_validate({"role": role, "content": content})


def test_split_keeps_order_and_places_markers() -> None:
    a, b = b"first-audio", b"second-audio"
    messages = [
        _msg("developer", "be brief"),
        _msg(
            "user",
            [
                {"type": "text", "text": "compare "},
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(a).decode(), "format": "wav"},
                },
                {"type": "text", "text": " and "},
                {
                    "type": "audio_url",
                    "audio_url": {"url": "data:audio/mp3;base64," + base64.b64encode(b).decode()},
                },
            ],
        ),
    ]
    assert has_audio_parts(messages) and not has_audio_parts(messages[:1])
    rendered, audios = split_audio(messages, "<A>")
    assert rendered == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "compare <A> and <A>"},
    ]
    assert audios == [a, b]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "data:,"}}, "not supported"),
        ({"type": "audio_url", "audio_url": {"url": 5}}, "needs {url: string}"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/wav,plain"}}, "base64"),
        ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "data: base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "m4a"}}, "format must be one of"),
        ({"type": "input_audio", "input_audio": {"data": "A@==", "format": "wav"}}, "not valid base64"),
    ],
)
def test_bad_parts_are_refused_by_name(part: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        split_audio([_msg("user", [part])], "<A>")
    assert info.value.param == "messages.0.content.0"


def test_references_are_refused_without_an_allow_list() -> None:
    """http(s) and file: URLs become AudioRefs; with no policy (the default) each is refused by name."""
    parts = [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"x").decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
        {"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}},
        {"type": "audio_url", "audio_url": {"url": "/etc/passwd"}},
    ]
    _, sources = split_audio([_msg("user", parts)], "<A>")
    assert sources[0] == b"x"
    assert sources[1] == AudioRef("https://example.com/a.wav", "messages.0.content.1")
    expected = {
        1: "remote URLs are refused",
        2: "--allowed-local-media-path",
        3: r"data:, http\(s\): or file:",
    }
    for index, message in expected.items():
        with pytest.raises(BadRequest, match=message) as info:
            asyncio.run(resolve_audio([sources[0], sources[index]], None))
        assert info.value.param == f"messages.0.content.{index}"


def test_expand_and_count_mismatch() -> None:
    assert _expand([1, 9, 2, 9, 3], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(BadRequest, match="1 audio placeholders, 2 audio parts"):
        _expand([1, 9, 2], 9, [2, 3])


def test_a_text_model_refuses_audio(tmp_path: Path) -> None:
    engine = SimpleNamespace(capabilities=EngineCapabilities())  # a text model states no audio input
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(BadRequest, match="does not take audio input"):
        asyncio.run(audio_chat_prompt(engine, tmp_path, [_msg("user", [part])], settings=None, metrics=None))
