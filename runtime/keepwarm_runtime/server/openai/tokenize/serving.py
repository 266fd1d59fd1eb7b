"""POST /tokenize and /detokenize: the engine's tokenizer over HTTP (vLLM's routes and shapes).

/tokenize takes a ``prompt`` (tokenized as /v1/completions would) or chat ``messages`` (rendered as
/v1/chat/completions would, without tools); both run in the preprocessing pool, off the event loop.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext
from keepwarm_runtime.server.openai.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


async def tokenize(ctx: ServingContext, req: TokenizeRequest, _: Request) -> JSONResponse:
    ctx.check_model(req.model)
    engine = ctx.engine
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        from keepwarm_runtime.engine.chat import render_chat

        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages or []]
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from exc

        def render() -> list[int]:
            try:
                return render_chat(
                    engine.tokenizer, messages, add_generation_prompt=req.add_generation_prompt
                )
            except Exception as exc:  # the template raised (jinja errors, bad roles)
                raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc

        ids = await ctx.preprocess(render)
    body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)
    return JSONResponse(body.model_dump())


async def detokenize(ctx: ServingContext, req: DetokenizeRequest, _: Request) -> JSONResponse:
    ctx.check_model(req.model)
    engine = ctx.engine
    if any(not 0 <= t < engine.vocab_size for t in req.tokens):
        raise BadRequest(f"token ids must be in [0, {engine.vocab_size})", param="tokens")
    text = await ctx.preprocess(engine.tokenizer.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


ROUTES = (
    Route("/tokenize", "POST", tokenize, body=TokenizeRequest),
    Route("/detokenize", "POST", detokenize, body=DetokenizeRequest),
)
