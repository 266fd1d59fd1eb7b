"""The shared request validator: removed guided_* fields warn once per distinct set; other extras at DEBUG."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from keepwarm_runtime.log_once import clear_once_cache
from keepwarm_runtime.server.base.protocol import StructuredOutputsOptions
from keepwarm_runtime.server.openai.chat.protocol import ChatCompletionRequest
from keepwarm_runtime.server.openai.completions.protocol import CompletionRequest

LOGGER = "keepwarm_runtime.server.base.protocol"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _fresh_once_cache():
    clear_once_cache()
    yield
    clear_once_cache()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_removed_field_warns_once_naming_field_and_replacement(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for _ in range(5):
        request = ChatCompletionRequest.model_validate(CHAT | {"guided_json": {"type": "object"}})
        assert request.messages[0].content == "hi"  # still served
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "guided_json" in message
    assert "structured_outputs" in message and "response_format" in message


def test_each_distinct_set_of_removed_fields_warns_once(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    bodies = [
        CHAT | {"guided_regex": "a+"},
        CHAT | {"guided_regex": "b+"},  # same set of fields: no new warning
        CHAT | {"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"},
        CHAT | {"guided_decoding_backend": "outlines", "guided_choice": ["b"]},  # same set, other order
    ]
    for body in bodies:
        ChatCompletionRequest.model_validate(body)
    CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a+"})  # shared base, same once-cache
    messages = [r.getMessage() for r in _warnings(caplog)]
    assert len(messages) == 2
    assert "guided_regex" in messages[0]
    assert "guided_choice, guided_decoding_backend" in messages[1]


def test_clear_once_cache_lets_the_warning_fire_again(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ChatCompletionRequest.model_validate(CHAT | {"guided_grammar": "root ::= 'a'"})
    clear_once_cache()
    ChatCompletionRequest.model_validate(CHAT | {"guided_grammar": "root ::= 'a'"})
    assert len(_warnings(caplog)) == 2


def test_arbitrary_extra_field_logs_debug_not_warning(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    request = ChatCompletionRequest.model_validate(CHAT | {"frobnicate": 3, "guided_jsonx": 1})
    assert request.model_extra == {"frobnicate": 3, "guided_jsonx": 1}
    assert _warnings(caplog) == []
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("frobnicate" in m for m in debug)


def test_known_fields_log_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ChatCompletionRequest.model_validate(
        CHAT | {"structured_outputs": {"json": {"type": "object"}}, "max_completion_tokens": 4, "seed": 1}
    )
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_invalid_values_raise():
    with pytest.raises(ValidationError, match="temperature"):
        ChatCompletionRequest.model_validate(CHAT | {"temperature": 5})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "n": 0})


def test_structured_outputs_json_alias_and_prompt_shapes():
    options = StructuredOutputsOptions.model_validate({"json": {"type": "integer"}})
    assert options.json_ == {"type": "integer"}
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(prompt="a").token_limit() == 16


def test_content_parts_join_text_and_reject_images():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        }
    )
    assert request.messages[0].text() == "ab"
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    )
    with pytest.raises(ValueError, match="image_url"):
        image.messages[0].text()
