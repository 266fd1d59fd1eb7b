"""/health, /ping, /ready, /version, /metrics and /debug/stats: what kubelets, routers and Prometheus ask.

/health answers 200 while the engine loads (the port is alive) and 503 once the engine has failed in
a way no single request can be blamed for, so the pod gets restarted. /ready answers 503 until the
weights (and the --lora-modules-file adapters) are in; ``/ready?wait=S`` holds its answer up to S
seconds for them (see keepwarm_api.probes).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from keepwarm_api.probes import READY_PATH, READY_WAIT_MAX_S
from keepwarm_runtime import __version__
from keepwarm_runtime.server.base.errors import NotReady
from keepwarm_runtime.server.base.routes import Route
from keepwarm_runtime.server.base.serving import ServingContext

READY_POLL_S = 0.01  # how often a long-polling /ready looks at the engine (a probe sees ready this late)


async def health(request: Request) -> JSONResponse:
    async_engine = _ctx(request).async_engine
    status = 503 if async_engine.state == "failed" else 200
    return JSONResponse(
        {
            "status": "ok" if status == 200 else "failed",
            "engine": async_engine.state,
            "error": async_engine.error,
        },
        status_code=status,
    )


async def ping(request: Request) -> JSONResponse:
    """Liveness alias of /health (SageMaker and some load balancers probe /ping)."""
    return await health(request)


async def ready(request: Request, wait: float = 0.0) -> JSONResponse:
    """?wait=S long-polls: answers the moment the engine leaves loading, or after S s (capped)."""
    ctx = _ctx(request)

    def adapters_synced() -> bool:
        return ctx.lora_synced is None or ctx.lora_synced.is_set()

    deadline = time.monotonic() + min(max(wait, 0.0), READY_WAIT_MAX_S)
    while not (ctx.async_engine.ready_event.is_set() and adapters_synced()) and time.monotonic() < deadline:
        await asyncio.sleep(READY_POLL_S)
    ctx.engine  # noqa: B018 - raises NotReady (503) while loading
    if not adapters_synced():
        raise NotReady("loading the --lora-modules-file adapters; retry shortly", code="model_not_ready")
    sleeper = request.app.state.sleep_mode
    if sleeper is not None:
        sleeper.check_admitting()  # 503 while draining to sleep
    return JSONResponse({"status": "ready", "model": ctx.served_model_name})


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__, "model": _ctx(request).served_model_name})


async def prometheus(request: Request) -> Response:
    metrics = _ctx(request).metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def debug_stats(request: Request) -> JSONResponse:
    stats = _ctx(request).engine.stats()
    fields = ("num_running", "num_waiting", "kv_cache_usage", "num_preemptions")
    return JSONResponse({f: getattr(stats, f) for f in fields})


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


ROUTES = (
    Route("/health", "GET", health),
    Route("/ping", "GET", ping),
    Route(READY_PATH, "GET", ready),
    Route("/version", "GET", version),
    Route("/metrics", "GET", prometheus),
    Route("/debug/stats", "GET", debug_stats),
)
