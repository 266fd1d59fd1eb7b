"""Server-sent events framing as OpenAI streams use it: ``data: <json>`` blocks, then ``data: [DONE]``
(chat, completions); the Responses API names each event (``event: <type>``) and sends no [DONE]."""

from __future__ import annotations

import json
from typing import Any


def sse_event(payload: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"
