"""Chat rendering: template, then tokens, with exactly one BOS.

Chat templates usually emit the BOS token themselves (`{{ bos_token }}...`), so the rendered text is
tokenized with add_special_tokens=False unless the caller's tokenization_kwargs say otherwise.
mistral-common tokenizers (``tekken.json``; transformers' ``MistralCommonBackend``) have no template:
they render and tokenize in one step, and their text form cannot round-trip (tekken encodes the
special-token strings in text as plain bytes), so they are asked for the ids directly.
"""

from __future__ import annotations

from typing import Any


def is_mistral_common(tokenizer: Any) -> bool:
    """True for transformers' MistralCommonBackend (tekken.json), which renders chats without Jinja."""
    return type(tokenizer).__name__ == "MistralCommonBackend"


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenization_kwargs: dict[str, Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    if is_mistral_common(tokenizer):
        return _render_mistral_common(
            tokenizer, messages, add_generation_prompt, tokenization_kwargs, chat_template_kwargs
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
    )
    kwargs = {"add_special_tokens": False} | dict(tokenization_kwargs or {})
    return list(tokenizer(text, **kwargs)["input_ids"])


def _render_mistral_common(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tokenization_kwargs: dict[str, Any] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> list[int]:
    if tokenization_kwargs:
        names = ", ".join(sorted(tokenization_kwargs))
        raise ValueError(f"{names}: mistral-common tokenizers render and tokenize in one step")
    kwargs = dict(chat_template_kwargs or {})
    if kwargs.get("continue_final_message"):
        add_generation_prompt = False  # MistralCommonBackend refuses the two together
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(out["input_ids"])
