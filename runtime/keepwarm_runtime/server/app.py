"""The FastAPI app: OpenAI routes, tokenizer routes, probes, metrics; errors as OpenAI bodies.

The engine loads in its own thread once the app starts, so the port answers /health (alive) at once
while /ready and the inference routes answer 503 until the weights are in (`/ready?wait=S` holds its
answer up to S seconds for them: see keepwarm_api.probes). /health also answers 503 once the engine
has failed in a way no single request can be blamed for, so the pod gets restarted.

Request bodies are parsed here (``request_body``) rather than by FastAPI, so size, depth and Unicode
checks come first; the pydantic request models are still published in /openapi.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from keepwarm_api.probes import READY_PATH, READY_WAIT_MAX_S
from keepwarm_runtime import __version__
from keepwarm_runtime.engine.outputs import EngineStats
from keepwarm_runtime.server.async_engine import AsyncEngine
from keepwarm_runtime.server.engine_client import EngineClient
from keepwarm_runtime.server.errors import BadRequest, NotReady, from_validation_error, install_error_handlers
from keepwarm_runtime.server.guards import ApiKey, BodyLimit
from keepwarm_runtime.server.linger import LingeringClose
from keepwarm_runtime.server.lora import (
    LOAD_ROUTE,
    UNLOAD_ROUTE,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from keepwarm_runtime.server.metrics import ServerMetrics, process_start_time
from keepwarm_runtime.server.openapi import body_schema, install_openapi
from keepwarm_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIRequest,
    TokenizeRequest,
)
from keepwarm_runtime.server.protocol_responses import ResponsesRequest
from keepwarm_runtime.server.request_body import parse_json_object
from keepwarm_runtime.server.responses import ModelCard, ModelList
from keepwarm_runtime.server.serving import ServingContext, ServingOptions
from keepwarm_runtime.server.serving_audio import ROUTES as AUDIO_ROUTES
from keepwarm_runtime.server.serving_audio import AudioServerSettings, register_audio_routes
from keepwarm_runtime.server.serving_chat import create_chat_completion
from keepwarm_runtime.server.serving_completion import create_completion
from keepwarm_runtime.server.serving_responses import create_response
from keepwarm_runtime.server.serving_tokens import detokenize, tokenize
from keepwarm_runtime.server.sleep_mode import ROUTES as SLEEP_ROUTES
from keepwarm_runtime.server.sleep_mode import SleepMode, register_sleep_routes
from keepwarm_runtime.server.supervisor import notify_serving

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=OpenAIRequest)
ROUTES = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/ping",
    "/metrics",
    "/version",
    "/debug/stats",
    LOAD_ROUTE,
    UNLOAD_ROUTE,
    *AUDIO_ROUTES,
    *SLEEP_ROUTES,
)
NOT_INFERENCE = ("/v1/models", LOAD_ROUTE, UNLOAD_ROUTE)
READY_POLL_S = 0.01  # how often a long-polling /ready looks at the engine (a probe sees ready this late)


def create_app(
    make_engine: Callable[[], EngineClient],
    *,
    model_dir: str | Path,
    served_model_name: str | None = None,
    started_at: float | None = None,
    options: ServingOptions | None = None,
    audio: AudioServerSettings | None = None,
    load_before_serving: bool = False,
    sleep_mode: bool = False,
    wake_on_request: bool = False,
) -> FastAPI:
    """An app serving the engine ``make_engine()`` builds (called in the engine thread at startup).

    ``load_before_serving``: startup waits until the engine is loaded (or failed), so uvicorn accepts
    no connection before; a restarted worker (server/supervisor.py) leaves them in the listen backlog
    meanwhile instead of answering 503. ``sleep_mode``: the /sleep, /wake_up and /is_sleeping routes
    (server/sleep_mode.py); ``wake_on_request``: a request to a sleeping engine wakes it."""
    model_dir = Path(model_dir)
    options = options or ServingOptions()
    name = served_model_name or model_dir.name
    metrics = ServerMetrics(name)
    started_at = process_start_time() if started_at is None else started_at

    def on_ready(engine: EngineClient) -> None:
        info = engine.load_info
        metrics.record_load(info.source, info.seconds, started_at)
        metrics.record_moe(getattr(engine, "moe_backends", {}))
        lora = getattr(engine, "lora", None)  # the adapters of --lora-modules, registered at start
        for adapter in lora.adapters.values() if lora is not None else ():
            metrics.record_lora_load(adapter.source, adapter.seconds)
        startup = getattr(engine, "startup", None)  # engine/startup.py; speech engines keep none
        if startup is not None:
            startup.mark("ready")
            metrics.record_startup(startup.seconds)
            logger.info("%s", startup.summary())
        logger.info(
            "ready: weights from %s in %.2fs, %.2fs after process start; %d intra-op threads",
            info.source,
            info.seconds,
            time.time() - started_at,
            torch.get_num_threads(),
        )

    def on_stats(stats: EngineStats) -> None:
        metrics.record_engine(
            stats.num_running, stats.num_waiting, stats.kv_cache_usage, stats.num_preemptions
        )
        metrics.record_loras(stats.running_loras, stats.waiting_loras, stats.max_loras)

    async_engine = AsyncEngine(
        make_engine, on_stats=on_stats, on_ready=on_ready, on_abort=lambda _: metrics.aborts.inc()
    )
    ctx = ServingContext(
        async_engine=async_engine,
        metrics=metrics,
        served_model_name=name,
        model_dir=model_dir,
        options=options,
        loras={m.name: m for m in options.lora_modules},
    )
    if options.lora_modules_file is not None:
        from keepwarm_runtime.server.lora_file import LoraFileSync

        ctx.lora_file = LoraFileSync(Path(options.lora_modules_file))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        lora_sync = None if ctx.lora_file is None else asyncio.create_task(ctx.lora_file.run(ctx))
        if load_before_serving:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.ready_event.wait)
            if ctx.lora_file is not None and async_engine.state != "failed":
                await ctx.lora_file.synced.wait()  # its first request may name any listed adapter
        notify_serving()  # a supervised worker's parent judges its /health from now on
        yield
        if lora_sync is not None:
            lora_sync.cancel()
        async_engine.shutdown()
        ctx.close()

    app = FastAPI(title="keepwarm", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(_RequestMetrics, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=options.max_request_body_bytes, exempt=frozenset(AUDIO_ROUTES))
    if options.api_key:
        app.add_middleware(ApiKey, key=options.api_key)
    app.add_middleware(LingeringClose)  # outermost: every early refusal lets the client finish sending
    sleeper = SleepMode(async_engine, metrics, wake_on_request) if sleep_mode else None

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

    @app.get("/ping")
    async def ping() -> JSONResponse:
        """Liveness alias of /health (SageMaker and some load balancers probe /ping)."""
        return await health()

    def adapters_synced() -> bool:
        return ctx.lora_file is None or ctx.lora_file.synced.is_set()

    @app.get(READY_PATH)
    async def ready(wait: float = 0.0) -> JSONResponse:
        """?wait=S long-polls: answers the moment the engine leaves loading, or after S s (capped)."""
        deadline = time.monotonic() + min(max(wait, 0.0), READY_WAIT_MAX_S)
        while not (async_engine.ready_event.is_set() and adapters_synced()) and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
        ctx.engine  # noqa: B018 - raises NotReady (503) while loading
        if not adapters_synced():
            raise NotReady("loading the --lora-modules-file adapters; retry shortly", code="model_not_ready")
        if sleeper is not None:
            sleeper.check_admitting()  # 503 while draining to sleep
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
        return JSONResponse({f: getattr(stats, f) for f in fields})

    def card() -> ModelCard:
        engine = async_engine.engine
        max_len = engine.max_model_len if async_engine.ready and engine is not None else None
        return ModelCard(id=name, root=str(model_dir), max_model_len=max_len)

    def lora_card(adapter: str) -> ModelCard:
        return ModelCard(id=adapter, root=ctx.loras[adapter].path, parent=name)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card(), *map(lora_card, list(ctx.loras))]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        ctx.check_model(model_id)
        return JSONResponse((lora_card(model_id) if ctx.lora_name(model_id) else card()).model_dump())

    if sleeper is not None:
        register_sleep_routes(app, sleeper)

    def post(
        path: str, model: type[R], handler: Callable[[ServingContext, R, Request], Awaitable[Any]]
    ) -> None:
        async def route(raw: Request) -> Any:
            if sleeper is None:
                return await handler(ctx, await _parse(ctx, raw, model), raw)
            async with sleeper.admit():
                return await handler(ctx, await _parse(ctx, raw, model), raw)

        app.post(path, openapi_extra=body_schema(model), name=handler.__name__)(route)

    post("/v1/chat/completions", ChatCompletionRequest, create_chat_completion)
    post("/v1/completions", CompletionRequest, create_completion)
    post("/v1/responses", ResponsesRequest, create_response)
    post("/tokenize", TokenizeRequest, tokenize)
    post("/detokenize", DetokenizeRequest, detokenize)
    if options.allow_runtime_lora_updating:
        post(LOAD_ROUTE, LoadLoraAdapterRequest, load_lora_adapter)
        post(UNLOAD_ROUTE, UnloadLoraAdapterRequest, unload_lora_adapter)
    register_audio_routes(app, ctx, audio or AudioServerSettings())
    bodies = [ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
    install_openapi(app, bodies)
    return app


async def _parse(ctx: ServingContext, raw: Request, model: type[R]) -> R:
    """503 before ready, then 400 for malformed JSON or invalid fields, else the request model.

    Parsing and validating (up to --max-request-body-bytes of JSON) run in the preprocessing pool, so a
    large body does not hold the event loop."""
    ctx.engine  # noqa: B018
    return await ctx.preprocess(_validate, await raw.body(), model)


def _validate(body: bytes, model: type[R]) -> R:
    data = parse_json_object(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    except RecursionError as exc:
        raise BadRequest("the request is nested too deeply", code="invalid_json") from exc


class _RequestMetrics:
    """Pure ASGI middleware (streaming- and disconnect-safe): counts requests by route and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"
        inference = endpoint.startswith("/v1/") and endpoint not in NOT_INFERENCE
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
