"""openai-agents (the OpenAI Agents SDK) against `keepwarm serve`, with its Responses and chat-completions
models: a forced tool call the SDK runs, then a typed final output (`output_type`), plain and streamed;
a turn cut off at max_tokens is reported by the SDK as such, not taken for an answer.

Tracing is off (OPENAI_AGENTS_DISABLE_TRACING, and set_tracing_disabled): it would export to OpenAI."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow


class Forecast(BaseModel):
    city: Literal["Oslo", "Lima"]
    sunny: bool


def _agent(client_server, api: str, **kwargs):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=client_server.base_url, api_key="unused", max_retries=0, timeout=120)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    calls: list[str] = []

    @function_tool
    def weather(city: Literal["Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    settings = dict(temperature=0.0, max_tokens=120, tool_choice="required") | kwargs.pop("settings", {})
    agent = Agent(
        name="forecaster",
        instructions="Answer with the forecast.",
        model=model_class(model=client_server.model, openai_client=client),
        tools=[weather],
        model_settings=ModelSettings(**settings),
        **kwargs,
    )
    return agent, calls


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_then_a_typed_answer(client_server, api, stream) -> None:
    from agents import Runner

    agent, calls = _agent(client_server, api, output_type=Forecast)

    async def run():
        if not stream:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=4)
        result = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls and set(calls) <= {"Oslo", "Lima"}  # the forced call ran the tool with valid arguments
    assert isinstance(result.final_output, Forecast)  # the next turn's text met the output schema
    items = [item.type for item in result.new_items]
    assert "tool_call_item" in items and "tool_call_output_item" in items


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_off_responses_turn_is_not_taken_for_an_answer(client_server, stream) -> None:
    from agents import Runner
    from agents.exceptions import ModelBehaviorError

    agent, _ = _agent(client_server, "responses", settings={"max_tokens": 2, "tool_choice": "none"})

    async def run():
        if not stream:
            return await Runner.run(agent, "Tell me a long story.", max_turns=2)
        result = Runner.run_streamed(agent, "Tell me a long story.", max_turns=2)
        async for _ in result.stream_events():
            pass
        return result

    with pytest.raises(ModelBehaviorError, match="incomplete"):
        asyncio.run(run())
