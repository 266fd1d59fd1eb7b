"""Every newly honoured request field changes the output as it should; the rest are refused by name."""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = [1, 17, 33, 57, 88, 121]  # token ids: no tokenizer in the way


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def _complete(client, **extra):
    kwargs = {"model": "tiny", "prompt": PROMPT, "logprobs": 0, "max_tokens": extra.pop("max_tokens", 8)}
    kwargs["temperature"] = extra.pop("temperature", 0.0)
    return client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True, **extra})


def test_return_tokens_as_token_ids_names_tokens_by_id(client):
    choice = _complete(client).choices[0]
    assert choice.logprobs.tokens and all(t.startswith("token_id:") for t in choice.logprobs.tokens)


def test_logit_bias_minus_100_removes_the_greedy_token(client):
    greedy = _ids(_complete(client, max_tokens=1).choices[0])[0]
    biased = _ids(_complete(client, max_tokens=1, logit_bias={str(greedy): -100}).choices[0])[0]
    assert biased != greedy
    forced = _ids(_complete(client, max_tokens=3, logit_bias={"42": 100}).choices[0])
    assert forced == [42, 42, 42]


def test_allowed_token_ids_confine_every_token(client):
    allowed = [5, 6, 7, 99]
    choice = _complete(
        client, max_tokens=24, temperature=1.0, seed=3, allowed_token_ids=allowed, ignore_eos=True
    )
    tokens = _ids(choice.choices[0])
    assert len(tokens) == 24 and set(tokens) <= set(allowed)


def test_bad_words_are_never_generated(client, served):
    greedy = _ids(_complete(client, max_tokens=1).choices[0])[0]
    word = httpx.post(served.proc.url + "/detokenize", json={"tokens": [greedy]}).json()["prompt"]
    if not word.strip():
        pytest.skip("the greedy token is whitespace; bad_words needs a word")
    choice = _complete(client, max_tokens=1, bad_words=[word.strip()]).choices[0]
    assert _ids(choice)[0] != greedy


def test_truncate_prompt_tokens_keeps_the_end(client):
    long_prompt = list(range(3, 83))
    full = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1, temperature=0)
    cut = client.completions.create(
        model="tiny",
        prompt=long_prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5},
    )
    same = client.completions.create(model="tiny", prompt=long_prompt[-5:], max_tokens=1, temperature=0)
    assert full.usage.prompt_tokens == 80 and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == same.choices[0].text


def test_continue_final_message_extends_the_assistant_turn(client, served, tiny_llama):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon"}]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("Once upon")
    assert response.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model="tiny", messages=messages, extra_body={"continue_final_message": True}
        )
    assert both.value.body["param"] == "continue_final_message"


def test_priority_is_accepted_within_bounds(client):
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": -5}
    )
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"best_of": 3}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"suffix": "end"}, "suffix"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, extra_body=extra)
    assert info.value.body["param"] == param


def test_best_of_equal_to_n_is_honoured(client):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, best_of=2, seed=1)
    assert len(response.choices) == 2


def test_schema_keywords_the_grammar_cannot_enforce_are_refused_by_name(client):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "numbers"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
    assert "uniqueItems" in info.value.body["message"] and info.value.body["param"] == "response_format"


def test_a_schema_xgrammar_would_loosen_is_enforced_by_llguidance(client):
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date", "maxLength": 10},
            "n": {"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 9}]},
        },
        "required": ["day", "n"],
        "additionalProperties": False,
    }
    for seed in range(4):
        response = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a date and a number"}],
            response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}},
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        content = response.choices[0].message.content
        jsonschema.validate(json.loads(content), schema, format_checker=jsonschema.FormatChecker())
