"""/v1/responses through the official `openai` client: text, streaming, function calls, refusals."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.server.conftest import API_KEY
from tests.integration.server.test_server_tools import WEATHER

TOOL = {"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(served_secure):
    return openai.OpenAI(base_url=served_secure.proc.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_text_response_matches_the_chat_answer(client):
    response = client.responses.create(
        model="tiny", input="Say something.", instructions="Be brief.", max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}],
        max_tokens=10,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status in ("completed", "incomplete")


def test_streamed_text_assembles_to_the_whole_answer(client):
    kwargs = dict(model="tiny", input="Say something.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def forced_weather_call(temperature: float) -> dict:
    """A Responses request that must call the weather tool."""
    return dict(
        model="tiny",
        input="Weather in Oslo?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=200,
        temperature=temperature,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_is_valid(client, stream):
    kwargs = forced_weather_call(temperature=1.0)
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1
        arguments = done[0].arguments
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
        arguments = None
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    if arguments is not None:
        assert arguments == call.arguments


def test_a_stream_cut_off_at_max_output_tokens_ends_with_response_incomplete(client):
    kwargs = dict(model="tiny", input="Count to a hundred.", max_output_tokens=3, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    terminal = events[-1]
    assert terminal.type == "response.incomplete" and terminal.response.status == "incomplete"
    assert terminal.response.incomplete_details.reason == "max_output_tokens"
    assert not [e for e in events if e.type == "response.completed"]
    assert terminal.response.output_text == whole.output_text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]


def test_a_forced_call_streams_its_item_events_and_ends_with_response_completed(client):
    kwargs = forced_weather_call(temperature=0)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the helper needs response.completed
    kinds = [e.type for e in events if e.type.startswith("response.output_item") or "arguments" in e.type]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert kinds[-2] == "response.function_call_arguments.done"
    added = next(
        e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"
    )
    done = next(e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
    assert (added.item.status, done.item.status) == ("in_progress", "completed")
    assert added.item.id == done.item.id and done.item.name == "weather"
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert final.output[-1].arguments == done.item.arguments


def test_a_forced_call_with_a_text_format_is_accepted(client):
    """instructor's RESPONSES_TOOLS mode: a named function plus text.format json_schema."""
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response = client.responses.create(
        model="tiny",
        input="Weather in Oslo?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "answer", "schema": answer}},
        max_output_tokens=200,
        temperature=0,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.status == "completed"


def test_function_call_output_round_trip(client):
    response = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert response.output[0].type == "message"


@pytest.mark.parametrize(
    "extra, param",
    [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store")],
)
def test_what_the_server_cannot_keep_is_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", max_output_tokens=2, **extra)
    assert info.value.body["param"] == param
