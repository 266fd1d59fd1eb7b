"""Request bodies before pydantic: JSON syntax, depth and lone surrogates are 400s that name the field."""

from __future__ import annotations

import pytest

from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.base.request_body import MAX_JSON_DEPTH, parse_json_object


def test_a_plain_object_passes():
    assert parse_json_object(b'{"prompt": "caf\\u00e9", "n": [1, {"a": null}]}') == {
        "prompt": "café",
        "n": [1, {"a": None}],
    }


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
        (b'{"messages": [{"content": "a\\udfffb"}]}', "messages[0].content", "surrogate"),
        (b'{"\\ud800": 1}', None, "surrogate"),
        (
            b'{"logit_bias": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
            "logit_bias",
            "deeper",
        ),
        (b"[" * 100_000 + b"]" * 100_000, None, "deeper"),
        (b"[1, 2]", None, "JSON object"),
        (b'{"a": ', None, "malformed"),
        (b"\xff\xfe", None, "malformed"),
    ],
)
def test_bad_bodies_are_named_400s(body, param, fragment):
    with pytest.raises(BadRequest, match=fragment) as info:
        parse_json_object(body)
    assert info.value.param == param
