"""GET /v1/models (the served model, then its LoRA adapters) and /v1/models/{model}, OpenAI's shapes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext
from keepwarm_runtime.server.openai.models.protocol import ModelCard, ModelList


def _card(ctx: ServingContext) -> ModelCard:
    engine = ctx.async_engine.engine
    max_len = engine.max_model_len if ctx.async_engine.ready and engine is not None else None
    return ModelCard(id=ctx.served_model_name, root=str(ctx.model_dir), max_model_len=max_len)


def _lora_card(ctx: ServingContext, adapter: str) -> ModelCard:
    return ModelCard(id=adapter, root=ctx.loras[adapter].path, parent=ctx.served_model_name)


async def models(request: Request) -> JSONResponse:
    ctx: ServingContext = request.app.state.ctx
    cards = [_card(ctx), *(_lora_card(ctx, adapter) for adapter in list(ctx.loras))]
    return JSONResponse(ModelList(data=cards).model_dump())


async def model(request: Request, model_id: str) -> JSONResponse:
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(model_id)
    return JSONResponse((_lora_card(ctx, model_id) if ctx.lora_name(model_id) else _card(ctx)).model_dump())


ROUTES = (
    Route("/v1/models", "GET", models),
    Route("/v1/models/{model_id:path}", "GET", model),
)
