"""Prompt logprobs over HTTP with the official `openai` client: lm-eval's echo request, vLLM's
`prompt_logprobs` on completions and chat, scoring only (`max_tokens: 0`), and the bounds refused by name.
Values are held to transformers' log-softmax of its own forward pass on the served checkpoint."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.integration.clients.conftest import MAX_PROMPT_LOGPROBS_LEN

PROMPT = [1, 17, 33, 57, 88, 121, 400, 9, 250, 31]
TOL = 1e-4


@pytest.fixture(scope="module")
def client(client_server):
    return openai.OpenAI(base_url=client_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client_server):
    """transformers' log-softmax at every position of a prompt, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(client_server.model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, reference):
    """lm-eval's local-completions loglikelihood request, verbatim."""
    response = client.completions.create(
        model="tiny", prompt=[PROMPT], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    lp = response.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    ref = reference(PROMPT)
    for position, token in enumerate(PROMPT[1:]):
        assert lp.token_logprobs[position + 1] == pytest.approx(ref[position, token].item(), abs=TOL)
        best = ref[position].max().item()
        assert max(lp.top_logprobs[position + 1].values()) == pytest.approx(best, abs=TOL)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=TOL)  # greedy: the best


def test_max_tokens_zero_with_echo_only_scores(client, reference):
    response = client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0, temperature=0
    )
    choice = response.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(PROMPT) and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0
    ref = reference(PROMPT)
    got = choice.logprobs.token_logprobs[1:]
    assert got == pytest.approx([ref[p, t].item() for p, t in enumerate(PROMPT[1:])], abs=TOL)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_streamed_echo_sends_the_prompt_logprobs_first(client, reference):
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True
    )
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.token_logprobs) >= len(PROMPT)
    ref = reference(PROMPT)
    assert first.token_logprobs[len(PROMPT) - 1] == pytest.approx(ref[-2, PROMPT[-1]].item(), abs=TOL)
    total = sum(len(c.choices[0].logprobs.token_logprobs) for c in chunks if c.choices[0].logprobs)
    assert total == len(PROMPT) + 3


def test_prompt_logprobs_in_vllm_shape_on_completions_and_chat(client, reference):
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    scored = response.choices[0].model_extra["prompt_logprobs"]
    ref = reference(PROMPT)
    assert scored[0] is None and len(scored) == len(PROMPT)
    for position, (token, entry) in enumerate(zip(PROMPT[1:], scored[1:], strict=True)):
        row, value = ref[position], ref[position, token]
        for alternative, item in entry.items():
            assert item["logprob"] == pytest.approx(row[int(alternative)].item(), abs=TOL)
            assert isinstance(item["decoded_token"], str)
        # Ranks and the top two as far as fp32 decides them: the tiny model's logits are nearly flat,
        # and values closer than TOL may order either way (the engine's batch shapes round differently).
        rank = entry[str(token)]["rank"]
        assert int((row > value + TOL).sum()) + 1 <= rank <= int((row > value - TOL).sum()) + 1
        third = row.topk(3).values[2]
        assert {str(t) for t in (row > third + TOL).nonzero().flatten().tolist()} <= set(entry)
        assert len(entry) <= 3
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Score me."}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    chat_scored = chat.model_extra["prompt_logprobs"]
    assert chat_scored[0] is None and len(chat_scored) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in chat_scored[1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": [5] * (MAX_PROMPT_LOGPROBS_LEN + 1), "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": [5] * (MAX_PROMPT_LOGPROBS_LEN + 1), "echo": True, "logprobs": 1}, "logprobs"),
        ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bounds_are_refused_by_name(client, body, param):
    extra = dict(body)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", max_tokens=1, prompt=extra.pop("prompt"), extra_body=extra)
    assert info.value.body["param"] == param


def test_requests_without_prompt_logprobs_return_none(client):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=1)
    assert len(response.choices[0].logprobs.token_logprobs) == 2
    assert response.choices[0].model_extra.get("prompt_logprobs") is None
