"""Structured outputs and the removed-field warning, end to end through a real server."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
        "climate": {"enum": ["dry", "wet", "cold"]},
    },
    "required": ["city", "population", "capital", "climate"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
WARNING = re.compile(r" WARNING keepwarm_runtime\.server\.base\.protocol: (.*)")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_outputs_parse_for_20_seeded_requests(served):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    client = openai.AsyncOpenAI(
        base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def ask(seed: int):
        response = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=response_format, seed=seed, max_tokens=120
        )
        return response.choices[0]

    async def main():
        try:
            return await asyncio.gather(*(ask(seed) for seed in range(20)))  # batched: one engine step each
        finally:
            await client.close()

    choices = asyncio.run(main())
    assert len({c.message.content for c in choices}) > 1  # seeds differ, outputs differ
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_regex_choice_and_json_object(client):
    regex = client.completions.create(
        model="tiny",
        prompt="id:",
        max_tokens=20,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{3}"}},
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{3}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=4,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["north", "south"]}},
    )
    assert {c.message.content for c in choice.choices} <= {"north", "south"}
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, seed=3, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")


def test_invalid_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="tiny", prompt="x", extra_body={"structured_outputs": {"regex": "(["}}
        )


def _warnings(served) -> list[str]:
    return WARNING.findall(served.proc.log_text())


def test_removed_field_warns_once_across_requests_and_is_still_served(served, client):
    before = len(_warnings(served))
    for seed in range(4):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, seed=seed, extra_body={"guided_json": SCHEMA}
        )
        assert response.choices[0].message.content is not None
    new = _warnings(served)[before:]
    assert len(new) == 1, new
    assert "guided_json" in new[0] and "structured_outputs" in new[0]
    # A different set of removed fields is news once more; completions share the same validator.
    for _ in range(3):
        client.completions.create(
            model="tiny",
            prompt="x",
            max_tokens=2,
            extra_body={"guided_regex": "a+", "guided_decoding_backend": "x"},
        )
    newer = _warnings(served)[before + 1 :]
    assert len(newer) == 1 and "guided_decoding_backend, guided_regex" in newer[0]


def test_arbitrary_extra_field_logs_no_warning(served, client):
    before = served.proc.log_text()
    client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": 1}
    )
    after = served.proc.log_text()[len(before) :]
    assert "frobnicate" not in after and " WARNING " not in after
