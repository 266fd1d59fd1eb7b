"""POST /v1/completions: one engine request per prompt, merged; choice index = prompt * n + choice.

``echo`` with ``logprobs`` puts the prompt's tokens and logprobs before the generated ones (the first
prompt token's logprob null), which is how lm-eval scores a continuation; ``max_tokens: 0`` with
``echo`` scores the prompt and generates nothing. ``prompt_logprobs`` (vLLM) comes back per choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from keepwarm_runtime.engine.outputs import RequestOutput
from keepwarm_runtime.server.base.deltas import DeltaTracker
from keepwarm_runtime.server.base.errors import APIError, BadRequest
from keepwarm_runtime.server.base.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs
from keepwarm_runtime.server.base.metrics import RequestTimer
from keepwarm_runtime.server.base.protocol import CompletionLogprobs, PromptLogprobs, UsageInfo, random_id
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext, race_disconnect, truncate_prompt
from keepwarm_runtime.server.base.sse import StreamHead, sse_done, sse_event
from keepwarm_runtime.server.openai.completions.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)

MAX_PROMPTS = 64  # prompts per request


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Any:
    arrival = time.perf_counter()  # TTFT includes tokenization and grammar compilation
    ctx.check_model(req.model)
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    engine = ctx.engine
    prompts = req.prompts()
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"give between 1 and {MAX_PROMPTS} prompts", param="prompt")
    vocab = engine.vocab_size
    prompt_ids = [
        truncate_prompt(await ctx.encode(p) if isinstance(p, str) else list(p), req.truncate_prompt_tokens)
        for p in prompts
    ]
    for ids in prompt_ids:
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"token-id prompts must be non-empty with ids in [0, {vocab})", param="prompt")
    if req.max_tokens == 0 and not req.echo:
        raise BadRequest("max_tokens 0 needs echo (score the prompt, generate nothing)", param="max_tokens")
    max_tokens = min(ctx.check_length(len(ids), req.token_limit()) for ids in prompt_ids)
    echo_scored = req.logprobs if req.echo else None  # echo + logprobs: the prompt's logprobs too
    if echo_scored is not None or req.prompt_logprobs is not None:
        for ids in prompt_ids:
            ctx.check_prompt_logprobs(len(ids), "prompt_logprobs" if echo_scored is None else "logprobs")
    params = await ctx.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs=echo_scored)
    base_id = random_id("cmpl")
    streams = [
        ctx.stream(
            f"{base_id}-{i}",
            ids,
            params,
            RequestTimer(ctx.metrics, len(ids), arrival=arrival),
            req.priority,
            lora_name=ctx.lora_name(req.model),
            streaming=req.stream,
        )
        for i, ids in enumerate(prompt_ids)
    ]
    merged = _merge(streams)
    echo = [""] * len(prompt_ids)
    if req.echo:
        echo = await ctx.preprocess(
            lambda: [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in prompt_ids]
        )
    n_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if req.stream:
        first = await race_disconnect(anext(merged), raw)
        body = _stream(ctx, req, base_id, n_prompt_tokens, echo, first, merged)
        return StreamingResponse(body, media_type="text/event-stream")
    finals: dict[int, RequestOutput] = await race_disconnect(_collect(merged), raw)
    choices = [
        CompletionChoice(
            index=i * req.n + o.index,
            text=echo[i] + o.text,
            logprobs=_logprobs(ctx, req, finals[i], o.token_ids, o.logprobs or [], len(echo[i]), True),
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            prompt_logprobs=_prompt_logprobs(req, finals[i]),
        )
        for i in sorted(finals)
        for o in finals[i].outputs
    ]
    completion = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
    usage = UsageInfo(
        prompt_tokens=n_prompt_tokens, completion_tokens=completion, total_tokens=n_prompt_tokens + completion
    )
    response = CompletionResponse(
        id=base_id, model=ctx.response_model(req.model), choices=choices, usage=usage
    )
    return JSONResponse(response.model_dump())


def _logprobs(
    ctx: ServingContext,
    req: CompletionRequest,
    output: RequestOutput,
    token_ids: list[int],
    logprobs: list,
    offset: int,
    first: bool,
) -> CompletionLogprobs | None:
    """The choice's (or delta's) logprobs; the ``first`` part of an echoed one starts with the prompt's."""
    if req.logprobs is None:
        return None
    as_ids = req.return_tokens_as_token_ids
    generated = completion_logprobs(token_ids, logprobs, req.logprobs, offset, as_ids)
    if not (req.echo and first) or output.prompt_logprobs is None:
        return generated
    ids = output.prompt_token_ids
    prompt = echo_logprobs(ids, output.prompt_logprobs, req.logprobs, ctx.engine.token_text(ids[0]), as_ids)
    return joined(prompt, generated)


def _prompt_logprobs(req: CompletionRequest, output: RequestOutput) -> PromptLogprobs | None:
    if req.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return prompt_logprobs(output.prompt_logprobs, req.return_tokens_as_token_ids)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave per-prompt streams as (prompt index, output); closing this cancels them all."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, output in merged:
        finals[i] = output
    return finals


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    prompt_tokens: int,
    echo: list[str],
    first: tuple[int, RequestOutput],
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created, model = int(time.time()), ctx.response_model(req.model)
    plain = req.n == 1 and req.logprobs is None  # a chunk that only adds text is written from the head
    head = StreamHead(request_id, "text_completion", created, model)
    tracker = DeltaTracker()
    sent_chars: dict[int, int] = {}  # choice index -> characters of generated text sent (for offsets)
    completion_tokens: dict[int, int] = {}
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            i, output = item
            choices = []
            for o in output.outputs:
                index = i * req.n + o.index
                d = tracker.delta(index, o)
                if d is None:
                    continue
                sent = sent_chars.get(index, 0)
                sent_chars[index] = sent + len(d.text)
                completion_tokens[index] = d.total_tokens
                text = (echo[i] if d.first else "") + d.text
                if plain and d.finish_reason is None:  # most chunks: one choice's new text alone
                    yield head.text(index, text)
                    continue
                logprobs = None
                if req.logprobs is not None and d.logprobs is not None:
                    offset = len(echo[i]) + sent
                    logprobs = _logprobs(ctx, req, output, d.token_ids, d.logprobs, offset, d.first)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=d.finish_reason,
                        stop_reason=d.stop_reason,
                    )
                )
            if choices:
                body = CompletionResponse(id=request_id, created=created, model=model, choices=choices)
                yield sse_event(body.model_dump(exclude_none=True))
            item = await anext(merged, None)
        if req.stream_options and req.stream_options.include_usage:
            completion = sum(completion_tokens.values())
            usage = UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
            )
            body = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
            yield sse_event(body.model_dump(exclude_none=True))
    except APIError as exc:
        yield sse_event(exc.body())
    finally:
        await merged.aclose()
    yield sse_done()


ROUTES = (Route("/v1/completions", "POST", create_completion, body=CompletionRequest, inference=True),)
