"""StreamHead writes a stream's plain chunks by hand: byte for byte what pydantic's models dump."""

from __future__ import annotations

import json
import random

import pytest

from keepwarm_runtime.server.base.sse import StreamHead, sse_event
from keepwarm_runtime.server.openai.chat.protocol import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from keepwarm_runtime.server.openai.completions.protocol import CompletionChoice, CompletionResponse

TEXTS = [
    "",
    " hello",
    'say "hi"',
    "back\\slash",
    "line\nbreak\ttab\r",
    "\x00\x01\x1f\x7f",
    "ünïcødé 日本語 🦙",
    "\u2028\u2029",
    "</script>",
]
IDS = [("chatcmpl-abc123", "bench"), ('odd "id"\n', "org/model:ünï\\")]


def _random_text(rng: random.Random) -> str:
    return "".join(chr(rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0xD800)])) for _ in range(12))


def _texts() -> list[str]:
    rng = random.Random(7)
    return TEXTS + [_random_text(rng) for _ in range(200)]


@pytest.mark.parametrize(("request_id", "model"), IDS)
def test_a_plain_chat_chunk_is_what_the_model_dumps(request_id: str, model: str) -> None:
    head = StreamHead(request_id, "chat.completion.chunk", 1733560000, model)
    for index in (0, 3):
        for text in _texts():
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=text))
            body = ChatCompletionChunk(id=request_id, created=1733560000, model=model, choices=[choice])
            assert head.content(index, text) == sse_event(body.model_dump(exclude_none=True))


@pytest.mark.parametrize(("request_id", "model"), IDS)
def test_a_plain_completions_chunk_is_what_the_model_dumps(request_id: str, model: str) -> None:
    head = StreamHead(request_id, "text_completion", 1733560000, model)
    for index in (0, 5):
        for text in _texts():
            choice = CompletionChoice(index=index, text=text)
            body = CompletionResponse(id=request_id, created=1733560000, model=model, choices=[choice])
            assert head.text(index, text) == sse_event(body.model_dump(exclude_none=True))


def test_a_chunk_parses_back_to_its_text() -> None:
    head = StreamHead("x", "text_completion", 1, "m")
    for text in _texts():
        event = head.text(0, text)
        assert event.startswith("data: ") and event.endswith("\n\n")
        assert json.loads(event[len("data: ") : -2])["choices"][0]["text"] == text
