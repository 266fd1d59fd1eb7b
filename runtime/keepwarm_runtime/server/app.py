"""The FastAPI app: OpenAI routes, health/ready/metrics/version, errors as OpenAI bodies.

The engine loads in its own thread once the app starts, so the port answers /health (alive) at once
while /ready and the inference routes answer 503 until the weights are in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from keepwarm_runtime import __version__
from keepwarm_runtime.server.async_engine import AsyncEngine
from keepwarm_runtime.server.errors import BadRequest, from_validation_error, install_error_handlers
from keepwarm_runtime.server.metrics import ServerMetrics, process_start_time
from keepwarm_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from keepwarm_runtime.server.responses import ModelCard, ModelList
from keepwarm_runtime.server.serving import ServingContext
from keepwarm_runtime.server.serving_audio import ROUTES as AUDIO_ROUTES
from keepwarm_runtime.server.serving_audio import AudioServerSettings, register_audio_routes
from keepwarm_runtime.server.serving_chat import create_chat_completion
from keepwarm_runtime.server.serving_completion import create_completion

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=OpenAIRequest)
ROUTES = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/ready",
    "/metrics",
    "/version",
    "/debug/stats",
    *AUDIO_ROUTES,
)


def create_app(
    make_engine: Callable[[], Any],
    *,
    model_dir: str | Path,
    served_model_name: str | None = None,
    started_at: float | None = None,
    audio: AudioServerSettings | None = None,
) -> FastAPI:
    """An app serving the engine ``make_engine()`` builds (called in the engine thread at startup)."""
    model_dir = Path(model_dir)
    name = served_model_name or model_dir.name
    metrics = ServerMetrics(name)
    started_at = process_start_time() if started_at is None else started_at

    def on_ready(engine: Any) -> None:
        source, seconds = _load_info(engine)
        metrics.record_load(source, seconds, started_at)
        metrics.record_moe(getattr(engine, "moe_backends", {}))
        logger.info(
            "ready: weights from %s in %.2fs, %.2fs after process start",
            source,
            seconds,
            time.time() - started_at,
        )

    def on_stats(stats: Any) -> None:
        metrics.record_engine(
            stats.num_running, stats.num_waiting, stats.kv_cache_usage, getattr(stats, "num_preemptions", 0)
        )

    async_engine = AsyncEngine(
        make_engine, on_stats=on_stats, on_ready=on_ready, on_abort=lambda _: metrics.aborts.inc()
    )
    ctx = ServingContext(
        async_engine=async_engine, metrics=metrics, served_model_name=name, model_dir=model_dir
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="keepwarm", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(_RequestMetrics, metrics=metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = 503 if async_engine.state == "failed" else 200
        return JSONResponse(
            {
                "status": "ok" if status == 200 else "failed",
                "engine": async_engine.state,
                "error": async_engine.error,
            },
            status_code=status,
        )

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ctx.engine  # noqa: B018 - raises NotReady (503) while loading
        return JSONResponse({"status": "ready", "model": name})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__, "model": name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/stats")
    async def debug_stats() -> JSONResponse:
        stats = ctx.engine.stats()
        fields = ("num_running", "num_waiting", "kv_cache_usage", "num_preemptions")
        return JSONResponse({f: getattr(stats, f, None) for f in fields})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        max_len = async_engine.engine.max_model_len if async_engine.ready else None
        card = ModelCard(id=name, root=str(model_dir), max_model_len=max_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        return await create_chat_completion(ctx, await _parse(ctx, raw, ChatCompletionRequest), raw)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        return await create_completion(ctx, await _parse(ctx, raw, CompletionRequest), raw)

    register_audio_routes(app, ctx, audio or AudioServerSettings())
    return app


async def _parse(ctx: ServingContext, raw: Request, model: type[R]) -> R:
    """503 before ready, then 400 for malformed JSON or invalid fields, else the request model."""
    ctx.engine  # noqa: B018
    body = await raw.body()
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _load_info(engine: Any) -> tuple[str, float]:
    info = getattr(engine, "load_info", None)
    if info is None:
        return "disk", 0.0
    if isinstance(info, tuple):
        return str(info[0]), float(info[1])
    return str(info.source), float(info.seconds)


class _RequestMetrics:
    """Pure ASGI middleware (streaming- and disconnect-safe): counts requests by route and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"
        inference = endpoint.startswith("/v1/") and endpoint != "/v1/models"
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if inference:
            self.metrics.active.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            if inference:
                self.metrics.active.dec()
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
