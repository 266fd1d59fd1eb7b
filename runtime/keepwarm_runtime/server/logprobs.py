"""OpenAI logprob bodies from the engine's per-token ``{token_id: Logprob}`` dicts.

The engine decodes every token it reports (``Logprob.decoded_token``); this module only formats:
chat's list of objects, the legacy completions' parallel lists, and ``token_id:<id>`` names when a
request sets ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from keepwarm_runtime.engine.outputs import Logprob
from keepwarm_runtime.server.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

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
