"""Server-sent events framing as OpenAI streams use it: ``data: <json>`` blocks, then ``data: [DONE]``
(chat, completions); the Responses API names each event (``event: <type>``) and sends no [DONE].

Most chunks of a chat or completions stream add one choice's text and nothing else, one a token:
``StreamHead`` writes those from a prefix encoded once per stream, the bytes pydantic's models would
dump (exclude_none) for them (tests/unit/server/test_sse.py holds the two together). Building the
models and dumping them cost some 9 us a chunk on the event loop; this, 0.1-0.2.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # the string encoder JSONEncoder(ensure_ascii=False) uses
from typing import Any

# One encoder for every chunk: json.dumps with any argument of its own builds a new one per call (a
# small chunk: 3.8 us encoded that way, 2.9 with this one; a stream encodes a chunk a token).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_event(payload: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {_ENCODER.encode(payload)}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


class StreamHead:
    """What every chunk of one stream starts with (``id``, ``object``, ``created``, ``model``, up to
    its first choice's index), encoded once; ``text`` and ``content`` write a chunk of one choice."""

    __slots__ = ("head",)

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        fields = (
            f'"id":{encode_basestring(request_id)},"object":{encode_basestring(object_name)},'
            f'"created":{int(created)},"model":{encode_basestring(model)}'
        )
        self.head = f'data: {{{fields},"choices":[{{"index":'

    def text(self, index: int, text: str) -> str:
        """A completions chunk (CompletionResponse) whose one choice adds ``text``: no logprobs, no
        finish, no usage."""
        return f'{self.head}{index},"text":{encode_basestring(text)}}}]}}\n\n'

    def content(self, index: int, text: str) -> str:
        """A chat chunk (ChatCompletionChunk) whose one choice's delta is ``text`` as content: no
        role, tool calls, logprobs, finish or usage."""
        return f'{self.head}{index},"delta":{{"content":{encode_basestring(text)}}}}}]}}\n\n'
