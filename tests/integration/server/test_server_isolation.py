"""No request can hurt another: bounds checked before the engine, the engine idle after bad requests."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.integration.server.conftest import engine_is_idle

MESSAGES = [{"role": "user", "content": "Say something."}]


def _post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.proc.url + path, json=body, timeout=60)


def test_overflowing_top_k_is_refused_while_an_innocent_request_succeeds(served):
    client = openai.AsyncOpenAI(base_url=served.proc.url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def main():
        innocent = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0.9, extra_body={"ignore_eos": True}
        )
        attack = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, extra_body={"top_k": 2**70}
        )
        return await asyncio.gather(innocent, attack, return_exceptions=True)

    innocent, attack = asyncio.run(main())
    assert isinstance(attack, openai.BadRequestError) and attack.body["param"] == "top_k"
    assert not isinstance(innocent, Exception), innocent
    assert innocent.choices[0].finish_reason in ("stop", "length") and innocent.usage.completion_tokens > 0
    assert httpx.get(served.proc.url + "/health").status_code == 200


def test_largest_seed_with_n_2_serves_both_sequences_and_leaves_the_engine_idle(served):
    for _ in range(10):
        response = _post(
            served,
            "/v1/chat/completions",
            {"messages": MESSAGES, "n": 2, "seed": 2**64 - 1, "max_tokens": 4, "temperature": 1.0},
        )
        assert response.status_code == 200, response.text
        assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1]
    too_big = _post(served, "/v1/chat/completions", {"messages": MESSAGES, "n": 2, "seed": 2**64})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "seed"
    stats = engine_is_idle(served.proc)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0)


BAD_BODIES = [
    ("/v1/chat/completions", {"messages": MESSAGES, "top_k": 2**70}, "top_k"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2**40}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"99999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["x"] * 100}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "priority": 2**40}, "priority"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "seed": 2**65}, "seed"),
    ("/v1/completions", {"prompt": "x " * 600}, "max_tokens"),
]


@pytest.mark.parametrize(
    "path, body, param", BAD_BODIES, ids=[b[2] + str(i) for i, b in enumerate(BAD_BODIES)]
)
def test_bad_request_is_a_400_naming_the_field(served, path, body, param):
    response = _post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_after_every_bad_request_the_engine_is_idle_and_healthy(served):
    for path, body, _ in BAD_BODIES:
        _post(served, path, body)
    stats = engine_is_idle(served.proc)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0)
    assert httpx.get(served.proc.url + "/health").status_code == 200
    ok = _post(served, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200
