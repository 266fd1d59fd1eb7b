"""langchain-openai's ChatOpenAI against `keepwarm serve`: invoke, stream, bind_tools with a forced call,
and with_structured_output (json_schema and function_calling), over chat completions and, for invoke
and structured output, the Responses API (use_responses_api)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field


class Forecast(BaseModel):
    """A weather forecast."""

    city: Literal["Oslo", "Lima"]
    sunny: bool
    days: int = Field(ge=1, le=7)


def _chat(client_server, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=client_server.model,
        base_url=client_server.base_url,
        api_key="unused",
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 60),
        max_retries=0,
        timeout=120,
        **kwargs,
    )


@pytest.mark.parametrize("responses", [False, True])
def test_invoke_and_stream(client_server, responses) -> None:
    chat = _chat(client_server, max_tokens=8, use_responses_api=responses)
    message = chat.invoke("Say something.")
    assert message.content and message.usage_metadata["output_tokens"] > 0
    if not responses:
        streamed = "".join(chunk.text for chunk in chat.stream("Say something."))
        assert streamed == message.text


def test_bind_tools_with_a_forced_call(client_server) -> None:
    def weather(city: Literal["Oslo", "Lima"], days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    message = _chat(client_server).bind_tools([weather], tool_choice="weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "weather" and call["args"]["city"] in ("Oslo", "Lima")
    assert isinstance(call["args"]["days"], int)


@pytest.mark.parametrize(
    ("method", "responses"),
    [("json_schema", False), ("function_calling", False), ("json_schema", True)],
)
def test_structured_output(client_server, method, responses) -> None:
    chat = _chat(client_server, use_responses_api=responses)
    forecast = chat.with_structured_output(Forecast, method=method).invoke("Weather in Oslo?")
    assert isinstance(forecast, Forecast)
