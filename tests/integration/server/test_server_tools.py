"""Tool calling through the official `openai` client: forced and named tool_choice always yield calls
that parse and match the function's schema, streamed and not; auto needs a parser; none ignores tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.server.conftest import API_KEY

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "Local time", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
SEEDS = range(4)


@pytest.fixture(scope="module")
def client(served_secure):
    return openai.OpenAI(base_url=served_secure.proc.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _check(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("seed", SEEDS)
def test_named_tool_choice_yields_a_valid_call(client, seed):
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("call_")
    _check("weather", call.function.arguments)


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_choice_yields_valid_calls(client, seed):
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=seed,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls=False
    for call in choice.message.tool_calls:
        _check(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_streamed_tool_calls_assemble_into_valid_calls(client, tool_choice):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=1.0,
        seed=5,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert calls and finish in ("tool_calls", "stop")
    for call in calls.values():
        _check(call["name"], call["arguments"])


def test_auto_streams_content_when_the_model_calls_nothing(client):
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, seed=2, temperature=0
    ).choices[0]
    assert whole.finish_reason in ("stop", "length", "tool_calls")
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=12, seed=2, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    if not whole.message.tool_calls:
        assert text.strip() == (whole.message.content or "").strip()


def test_tool_conversation_round_trip_is_accepted(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert response.choices[0].message.tool_calls in (None, [])


def test_without_a_parser_auto_is_refused_and_none_answers_in_text(served):
    client = openai.OpenAI(base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=3)
    assert info.value.body["param"] == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert plain.choices[0].message.content is not None and not plain.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert unknown.value.body["param"] == "tool_choice"


HERMES_CALL = (
    '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 2, "metric": true}}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call_and_streams_it_whole(client, stream):
    """The random model cannot choose to call a tool, so a regex makes it write one: the parser must
    find the call, and a stream must not leak any of the call's text as content."""
    import re

    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": "Sure\\. " + re.escape(HERMES_CALL)}},
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in calls]
    else:
        content, finish, parts = "", None, {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    parts.setdefault(delta.index, ["", ""])
                    parts[delta.index][0] += delta.function.name or ""
                    parts[delta.index][1] += delta.function.arguments or ""
        calls = [tuple(p) for p in parts.values()]
    assert finish == "tool_calls"
    assert content.strip() == "Sure." and "<tool_call>" not in content
    assert [(name, json.loads(args)) for name, args in calls] == [
        ("weather", {"city": "Oslo", "days": 2, "metric": True})
    ]


ANSWER = {
    "type": "object",
    "properties": {"summary": {"type": "string"}},
    "required": ["summary"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_a_forced_call_with_a_response_format_is_accepted_and_the_call_governs(client, tool_choice):
    """instructor's and openai-agents' pattern: the forced call is the turn's output, the format applies
    to text (of which a forced turn has none)."""
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    calls = response.choices[0].message.tool_calls
    named = isinstance(tool_choice, dict)  # OpenAI ends a named call with "stop", a required one "tool_calls"
    assert calls and response.choices[0].finish_reason == ("stop" if named else "tool_calls")
    for call in calls:
        _check(call.function.name, call.function.arguments)
    if named:
        assert [c.function.name for c in calls] == ["clock"]


def test_a_forced_call_with_a_broken_response_format_is_still_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_schema", "json_schema": {"name": "answer"}},
            max_tokens=20,
        )
    assert info.value.body["param"] == "response_format"
