"""POST /v1/chat/completions: render the chat with the engine's template (one BOS), generate, answer.

Streaming sends OpenAI chunks over SSE: a role chunk per choice, content deltas, a finish chunk per
choice, an optional usage chunk, then ``data: [DONE]``. The first output is awaited before the 200
goes out, so a request the engine rejects still gets a proper 400.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from keepwarm_runtime.server.chat_audio import audio_chat_prompt, has_audio_parts
from keepwarm_runtime.server.errors import APIError, BadRequest
from keepwarm_runtime.server.metrics import RequestTimer
from keepwarm_runtime.server.protocol import ChatCompletionRequest
from keepwarm_runtime.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from keepwarm_runtime.server.serving import ServingContext, race_disconnect
from keepwarm_runtime.server.sse import sse_done, sse_event

_ROLES = {"developer": "system"}  # OpenAI's newer name; templates know "system"


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Any:
    arrival = time.perf_counter()  # TTFT includes rendering and grammar compilation
    ctx.check_model(req.model)
    from keepwarm_runtime.engine.chat import render_chat

    engine = ctx.engine
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    multimodal = None  # audio parts: embeddings for the placeholder tokens (server/chat_audio.py)
    if has_audio_parts(req.messages):
        prompt_ids, multimodal = await audio_chat_prompt(
            engine,
            ctx.model_dir,
            req.messages,
            settings=getattr(raw.app.state, "audio_settings", None),
            metrics=getattr(raw.app.state, "audio_metrics", None),
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
        )
    else:
        try:
            messages = [{"role": _ROLES.get(m.role, m.role), "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc
        try:
            prompt_ids = render_chat(
                engine.tokenizer,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except Exception as exc:  # the template raised (jinja errors, bad roles)
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc
    max_tokens = ctx.check_length(len(prompt_ids), req.token_limit())
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = await ctx.sampling_params(req, max_tokens, top_n)
    request_id = random_id("chatcmpl")
    timer = RequestTimer(ctx.metrics, len(prompt_ids), arrival=arrival)
    outputs = ctx.stream(request_id, prompt_ids, params, timer, multimodal)
    if req.stream:
        first = await race_disconnect(anext(outputs), raw)
        body = _stream(ctx, req, request_id, len(prompt_ids), first, outputs)
        return StreamingResponse(body, media_type="text/event-stream")
    final = await race_disconnect(_last(outputs), raw)
    choices = [
        ChatChoice(
            index=o.index,
            message=ChatResponseMessage(content=o.text),
            logprobs=_logprobs(ctx, o.token_ids, o.logprobs, top_n) if top_n is not None else None,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for o in final.outputs
    ]
    usage = _usage(len(prompt_ids), final.outputs)
    response = ChatCompletionResponse(
        id=request_id, model=ctx.served_model_name, choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


async def _last(outputs: AsyncIterator[Any]) -> Any:
    final = None
    async for final in outputs:  # noqa: B007 - keep the last
        pass
    return final


def _usage(prompt_tokens: int, outputs: list[Any]) -> UsageInfo:
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
    )


def _logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[dict] | None, top_n: int
) -> ChatLogprobs:
    """OpenAI chat logprobs from the engine's per-token {token_id: Logprob} dicts."""
    content = []
    for token_id, alternatives in zip(token_ids, logprobs or [], strict=False):
        chosen = alternatives.get(token_id)
        text = ctx.token_text(token_id)
        ranked = sorted(alternatives.items(), key=lambda kv: kv[1].rank)[:top_n]
        top = [
            TopLogprob(
                token=(t := ctx.token_text(tid)),
                logprob=_finite(lp.logprob),
                bytes=list(t.encode()),
            )
            for tid, lp in ranked
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=_finite(chosen.logprob if chosen else float("-inf")),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def _finite(value: float) -> float:
    """JSON has no -inf; OpenAI clients expect a number."""
    return max(float(value), -9999.0)


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    prompt_tokens: int,
    first: Any,
    outputs: AsyncIterator[Any],
) -> AsyncIterator[str]:
    created, model = int(time.time()), ctx.served_model_name
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    sent_text: dict[int, int] = {}  # choice index -> characters sent
    sent_tokens: dict[int, int] = {}  # choice index -> tokens whose logprobs were sent
    done: set[int] = set()

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        return sse_event(body.model_dump(exclude_none=True))

    try:
        yield chunk(
            [
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(req.n)
            ]
        )
        output = first
        while output is not None:
            choices = []
            for o in output.outputs:
                if o.index in done:
                    continue
                text, n_sent = o.text[sent_text.get(o.index, 0) :], sent_tokens.get(o.index, 0)
                new_ids = o.token_ids[n_sent:]
                if not text and not new_ids and o.finish_reason is None:
                    continue
                logprobs = None
                if top_n is not None and o.logprobs is not None:
                    logprobs = _logprobs(ctx, new_ids, o.logprobs[n_sent:], top_n)
                sent_text[o.index], sent_tokens[o.index] = len(o.text), len(o.token_ids)
                if o.finish_reason is not None:
                    done.add(o.index)
                choices.append(
                    ChatStreamChoice(
                        index=o.index,
                        delta=DeltaMessage(content=text),
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                )
            if choices:
                yield chunk(choices, _usage(prompt_tokens, output.outputs) if continuous else None)
            last = output
            output = await anext(outputs, None)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(prompt_tokens, last.outputs))
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await outputs.aclose()  # a client that went away aborts its sequence here
    yield sse_done()
