"""/tokenize, /detokenize, GET /v1/models/{id}, /ping, the API key, and request bodies in /openapi.json."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.server.conftest import API_KEY


def test_tokenize_and_detokenize_round_trip(served, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    url = served.proc.url
    body = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()
    assert body["tokens"] == tokenizer.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == served.max_model_len
    text = httpx.post(url + "/detokenize", json={"tokens": body["tokens"][1:]}).json()["prompt"]
    assert text == "hello world"
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_model_by_id_and_ping(served):
    client = openai.OpenAI(base_url=served.proc.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert httpx.get(served.proc.url + "/ping").json()["status"] == "ok"


def test_openapi_publishes_the_request_bodies(served):
    spec = httpx.get(served.proc.url + "/openapi.json").json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/tokenize", "TokenizeRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "tools", "tool_choice", "logit_bias", "top_k"} <= set(chat["properties"])
    assert chat["properties"]["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1


def test_api_key_guards_everything_but_probes_and_metrics(served_secure):
    url = served_secure.proc.url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    wrong = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    for path in ("/health", "/ready", "/ping", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_a_trusted_server_renders_the_request_template(served_secure):
    client = openai.OpenAI(
        base_url=served_secure.proc.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    )
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    custom = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=1,
        extra_body={"chat_template": "{{ messages[0]['content'] }}"},
    )
    assert custom.usage.prompt_tokens < plain.usage.prompt_tokens
