"""The FastAPI app: every route group's ``ROUTES`` registered from one list, guards, metrics; errors as
OpenAI bodies.

The engine loads in its own thread once the app starts, so the port answers /health (alive) at once
while /ready and the inference routes answer 503 until the weights are in (server/probes/router.py).
``ROUTES`` (every path, the metrics' ``endpoint`` label) derives from ``ROUTE_GROUPS``.

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
from pydantic import BaseModel, ValidationError

from keepwarm_runtime import __version__
from keepwarm_runtime.audio.metrics import AudioMetrics
from keepwarm_runtime.engine.outputs import EngineStats
from keepwarm_runtime.process_start import process_start_time
from keepwarm_runtime.server.async_engine import AsyncEngine
from keepwarm_runtime.server.base.errors import BadRequest, from_validation_error, install_error_handlers
from keepwarm_runtime.server.base.guards import ApiKey, BodyLimit
from keepwarm_runtime.server.base.linger import LingeringClose
from keepwarm_runtime.server.base.metrics import ServerMetrics
from keepwarm_runtime.server.base.openapi import body_schema, install_openapi
from keepwarm_runtime.server.base.request_body import parse_json_object
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext, ServingOptions
from keepwarm_runtime.server.engine_client import EngineClient
from keepwarm_runtime.server.openai.audio.serving import ROUTES as AUDIO_ROUTES
from keepwarm_runtime.server.openai.audio.serving import AudioServerSettings
from keepwarm_runtime.server.openai.chat.serving import ROUTES as CHAT_ROUTES
from keepwarm_runtime.server.openai.completions.serving import ROUTES as COMPLETIONS_ROUTES
from keepwarm_runtime.server.openai.lora.serving import ROUTES as LORA_ROUTES
from keepwarm_runtime.server.openai.models.router import ROUTES as MODELS_ROUTES
from keepwarm_runtime.server.openai.responses.serving import ROUTES as RESPONSES_ROUTES
from keepwarm_runtime.server.openai.sleep.serving import ROUTES as SLEEP_ROUTES
from keepwarm_runtime.server.openai.sleep.serving import SleepMode
from keepwarm_runtime.server.openai.tokenize.serving import ROUTES as TOKENIZE_ROUTES
from keepwarm_runtime.server.probes.router import ROUTES as PROBES_ROUTES
from keepwarm_runtime.server.supervisor import notify_serving

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)
ROUTE_GROUPS: tuple[tuple[Route, ...], ...] = (  # registration order: also /openapi.json's order
    PROBES_ROUTES,
    MODELS_ROUTES,
    SLEEP_ROUTES,
    CHAT_ROUTES,
    COMPLETIONS_ROUTES,
    RESPONSES_ROUTES,
    TOKENIZE_ROUTES,
    LORA_ROUTES,
    AUDIO_ROUTES,
)
ALL_ROUTES = tuple(route for group in ROUTE_GROUPS for route in group)
ROUTES = tuple(route.path for route in ALL_ROUTES)  # every path the server may serve (docs name each)
INFERENCE_ROUTES = frozenset(route.path for route in ALL_ROUTES if route.inference)
OWN_BODY_LIMIT = frozenset(route.path for route in ALL_ROUTES if route.own_body_limit)


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
    (server/openai/sleep/serving.py); ``wake_on_request``: a request to a sleeping engine wakes it."""
    model_dir = Path(model_dir)
    options = options or ServingOptions()
    name = served_model_name or model_dir.name
    metrics = ServerMetrics(name)
    started_at = process_start_time() if started_at is None else started_at

    def on_ready(engine: EngineClient) -> None:
        info = engine.load_info
        metrics.record_load(info.source, info.seconds, started_at)
        capabilities = engine.capabilities
        metrics.record_moe(capabilities.moe_backends)
        lora = capabilities.lora  # the adapters of --lora-modules, registered at start
        for adapter in lora.adapters.values() if lora is not None else ():
            metrics.record_lora_load(adapter.source, adapter.seconds)
        startup = capabilities.startup  # speech engines keep none
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
    lora_file = None
    if options.lora_modules_file is not None:
        from keepwarm_runtime.server.openai.lora.file_sync import LoraFileSync

        lora_file = LoraFileSync(Path(options.lora_modules_file))
        ctx.lora_synced = lora_file.synced

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        lora_sync = None if lora_file is None else asyncio.create_task(lora_file.run(ctx))
        if load_before_serving:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.ready_event.wait)
            if lora_file is not None and async_engine.state != "failed":
                await lora_file.synced.wait()  # its first request may name any listed adapter
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
    app.add_middleware(BodyLimit, max_bytes=options.max_request_body_bytes, exempt=OWN_BODY_LIMIT)
    if options.api_key:
        app.add_middleware(ApiKey, key=options.api_key)
    app.add_middleware(LingeringClose)  # outermost: every early refusal lets the client finish sending
    app.state.sleep_mode = SleepMode(async_engine, metrics, wake_on_request) if sleep_mode else None
    enabled = {"sleep_mode": sleep_mode, "runtime_lora_updating": options.allow_runtime_lora_updating}
    routes = [route for route in ALL_ROUTES if route.requires is None or enabled[route.requires]]
    for route in routes:
        if route.body is None:
            app.add_api_route(route.path, route.handler, methods=[route.method])
        else:
            endpoint = _body_endpoint(ctx, app.state.sleep_mode, route.handler, route.body)
            app.add_api_route(
                route.path,
                endpoint,
                methods=[route.method],
                name=route.handler.__name__,
                openapi_extra=body_schema(route.body),
            )
    app.state.audio_settings = audio or AudioServerSettings()
    app.state.audio_metrics = AudioMetrics(metrics.registry)  # chat audio parts use them too
    # The runtime LoRA routes' bodies are not published (their $ref stays unresolved, as before).
    install_openapi(app, [r.body for r in routes if r.body is not None and r.requires is None])
    return app


def _body_endpoint(
    ctx: ServingContext,
    sleeper: SleepMode | None,
    handler: Callable[[ServingContext, R, Request], Awaitable[Any]],
    model: type[R],
) -> Callable[[Request], Awaitable[Any]]:
    """The FastAPI endpoint of a route with a JSON body: parse it, admit it past sleep mode, handle it."""

    async def endpoint(raw: Request) -> Any:
        if sleeper is None:
            return await handler(ctx, await _parse(ctx, raw, model), raw)
        async with sleeper.admit():
            return await handler(ctx, await _parse(ctx, raw, model), raw)

    return endpoint


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
        inference = endpoint in INFERENCE_ROUTES
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
