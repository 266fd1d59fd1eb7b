"""Chat rendering: template, then tokens, with exactly one BOS.

Chat templates usually emit the BOS token themselves (`{{ bos_token }}...`), so the rendered text is
tokenized with add_special_tokens=False unless the caller's tokenization_kwargs say otherwise.
"""

from __future__ import annotations

from typing import Any


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenization_kwargs: dict[str, Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
    )
    kwargs = {"add_special_tokens": False} | dict(tokenization_kwargs or {})
    return list(tokenizer(text, **kwargs)["input_ids"])
