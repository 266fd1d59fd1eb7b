"""Server-sent events framing as OpenAI streams use it: ``data: <json>`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"
