"""render_chat: the template's own BOS is the only BOS unless the caller asks for special tokens."""

from __future__ import annotations

import pytest

from keepwarm_runtime.engine.chat import render_chat

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer():
    from keepwarm_runtime.modelgen import build_tokenizer

    tok = build_tokenizer(1024)
    assert tok.chat_template.lstrip().startswith("{{ bos_token }}")
    return tok


def test_chat_has_exactly_one_bos(tokenizer) -> None:
    ids = render_chat(tokenizer, MESSAGES)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_plain_encode_still_adds_bos(tokenizer) -> None:
    assert tokenizer("Hello there")["input_ids"][0] == tokenizer.bos_token_id


def test_explicit_add_special_tokens_is_honoured(tokenizer) -> None:
    ids = render_chat(tokenizer, MESSAGES, tokenization_kwargs={"add_special_tokens": True})
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.bos_token_id]


def test_generation_prompt_is_optional(tokenizer) -> None:
    with_prompt = render_chat(tokenizer, MESSAGES)
    without = render_chat(tokenizer, MESSAGES, add_generation_prompt=False)
    assert len(with_prompt) > len(without) and with_prompt[: len(without)] == without
