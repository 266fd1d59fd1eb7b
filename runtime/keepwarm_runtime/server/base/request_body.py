"""Request bodies before pydantic: size, JSON syntax, nesting depth and lone surrogates, each a 400/413.

Python's json module accepts ``"\ud800"`` (a lone UTF-16 surrogate, which no UTF-8 tokenizer can
encode) and recurses once per nesting level (100,000 levels exhaust the stack). Both are refused
here, by name, before any other code sees the body.
"""

from __future__ import annotations

import json
import re
from typing import Any

from keepwarm_runtime.server.base.errors import BadRequest

MAX_JSON_DEPTH = 64  # nested arrays/objects; JSON schemas and tool definitions stay far below
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a BadRequest naming what is wrong with it."""
    try:
        data = json.loads(body)
    except RecursionError as exc:
        raise BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    check_json_value(data)
    return data


def check_json_value(data: Any) -> None:
    """Refuse nesting past MAX_JSON_DEPTH and strings (keys too) holding lone surrogates."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            field = re.split(r"[.\[]", path, maxsplit=1)[0]
            raise BadRequest(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", param=field or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, path)
            child = (
                f"{path}.{key}" if path and isinstance(key, str) else f"{path}[{key}]" if path else str(key)
            )
            stack.append((item, child, depth + 1))


def _check_text(text: str, path: str) -> None:
    if _SURROGATE.search(text):
        raise BadRequest(
            "strings must be valid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text",
            param=path or None,
            code="invalid_unicode",
        )
