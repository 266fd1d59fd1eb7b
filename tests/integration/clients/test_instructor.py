"""instructor against `keepwarm serve`: a typed object out of chat completions in TOOLS mode (a forced
named call) and JSON_SCHEMA mode (response_format), and out of /v1/responses in RESPONSES_TOOLS mode
(a forced call plus text.format), plain and streamed (partial objects)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


class Forecast(BaseModel):
    city: Literal["Oslo", "Lima"]
    sunny: bool
    days: int = Field(ge=1, le=7)  # bounded: the answer fits in max_tokens


def _client(client_server, mode_name: str):
    import instructor
    from openai import OpenAI

    openai_client = OpenAI(base_url=client_server.base_url, api_key="unused", max_retries=0, timeout=120)
    return instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode_name))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_a_typed_object_comes_back(client_server, mode) -> None:
    client = _client(client_server, mode)
    forecast, raw = client.chat.completions.create_with_completion(
        model=client_server.model,
        messages=MESSAGES,
        response_model=Forecast,
        max_tokens=120,
        temperature=0,
        max_retries=0,  # one attempt: a retry would hide a malformed first answer
    )
    assert isinstance(forecast, Forecast)
    if mode == "RESPONSES_TOOLS":
        assert raw.object == "response" and raw.status == "completed"
        assert [item.type for item in raw.output] == ["function_call"]
    else:
        assert raw.object == "chat.completion"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_partial_objects_stream(client_server, mode) -> None:
    client = _client(client_server, mode)
    partials = list(
        client.chat.completions.create_partial(
            model=client_server.model,
            messages=MESSAGES,
            response_model=Forecast,
            max_tokens=120,
            temperature=0,
            max_retries=0,
        )
    )
    assert partials and Forecast.model_validate(partials[-1].model_dump())
