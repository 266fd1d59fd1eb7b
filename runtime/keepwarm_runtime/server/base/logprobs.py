"""OpenAI logprob bodies from the engine's per-token ``{token_id: Logprob}`` dicts.

The engine decodes every token it reports (``Logprob.decoded_token``); this module only formats:
chat's list of objects, the legacy completions' parallel lists (with ``echo``, the prompt's tokens
first, the first of them without a logprob, as vLLM and lm-eval expect), vLLM's ``prompt_logprobs``,
and ``token_id:<id>`` names when a request sets ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.server.base.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

JSON_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number


def _finite(value: float) -> float:
    return max(float(value), JSON_MIN_LOGPROB)


def _name(token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
    if as_ids or logprob is None or logprob.decoded_token is None:
        return f"token_id:{token_id}"
    return logprob.decoded_token


def _ranked(alternatives: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    return sorted(alternatives.items(), key=lambda kv: kv[1].rank)[:top_n]


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, as_ids: bool = False
) -> ChatLogprobs:
    content = []
    for token_id, alternatives in zip(token_ids, logprobs, strict=False):
        chosen = alternatives.get(token_id)
        text = _name(token_id, chosen, as_ids)
        top = [
            TopLogprob(
                token=(t := _name(tid, lp, as_ids)), logprob=_finite(lp.logprob), bytes=list(t.encode())
            )
            for tid, lp in _ranked(alternatives, top_n)
        ]
        logprob = _finite(chosen.logprob if chosen else float("-inf"))
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    """Legacy completions logprobs; ``offset`` is the text offset of the first token."""
    result = CompletionLogprobs()
    for token_id, alternatives in zip(token_ids, logprobs, strict=False):
        chosen = alternatives.get(token_id)
        text = _name(token_id, chosen, as_ids)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
        result.top_logprobs.append(
            {_name(tid, lp, as_ids): _finite(lp.logprob) for tid, lp in _ranked(alternatives, top_n)}
        )
        result.text_offset.append(offset)
        offset += len(chosen.decoded_token or "") if chosen else 0
    return result


def echo_logprobs(
    prompt_ids: list[int],
    scored: list[dict[int, Logprob] | None],
    top_n: int,
    first_text: str,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs; ``first_text`` is the first token's text."""
    result = completion_logprobs(prompt_ids[1:], scored[1:], top_n, len(first_text), as_ids)  # type: ignore[arg-type]
    result.tokens.insert(0, f"token_id:{prompt_ids[0]}" if as_ids else first_text)
    result.token_logprobs.insert(0, None)
    result.top_logprobs.insert(0, None)
    result.text_offset.insert(0, 0)
    return result


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def prompt_logprobs(scored: list[dict[int, Logprob] | None], as_ids: bool = False) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, ``{"<token id>": {logprob, rank, decoded_token}}``."""
    return [
        None
        if entry is None
        else {
            str(tid): PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=_name(tid, lp, as_ids)
            )
            for tid, lp in entry.items()
        }
        for entry in scored
    ]
