"""vLLM-compatible sleep mode (``--enable-sleep-mode``): ``POST /sleep?level=1|2``, ``POST /wake_up``,
``GET /is_sleeping``.

A router (production-stack, llm-d) puts idle replicas to sleep and wakes them when traffic returns;
what sleeping frees and what waking restores is engine/sleep.py. Both run in the engine thread between
steps (``AsyncEngine.call``), so they never race a step. Sleeping while requests run is a 409 naming
them, unless ``drain=true`` (``POST /sleep?level=1&drain=true``): from that call on, new inference
requests and /ready answer 503 ``model_sleeping`` (as when asleep, so routers route around), the
running ones finish, then the engine sleeps and the call answers. While asleep, inference routes answer
503 ``model_sleeping`` (and /ready 503), unless ``--wake-on-request``, which wakes the engine before
the request runs (not while a drain waits: that sleep was asked for). /health stays 200
(``engine: sleeping``): a sleeping server is alive. ``keepwarm_sleep_level`` shows the state.
A wake that cannot get the weights back (the cache lost the model and ``--no-cache-fallback``) is a
503 ``wake_failed`` with the reason, and the engine stays asleep, so a later wake can retry.
Without ``--enable-sleep-mode`` the routes do not exist (404), as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from keepwarm_api.settings import FALSE_WORDS, TRUE_WORDS
from keepwarm_runtime.server.async_engine import AsyncEngine
from keepwarm_runtime.server.base.errors import BadRequest, Conflict, NotReady
from keepwarm_runtime.server.base.metrics import ServerMetrics
from keepwarm_runtime.server.base.routes import Route

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.01  # how often a drained sleep looks for running requests
T = TypeVar("T")


class SleepMode:
    """The server's side of sleeping: one sleep or wake at a time, the level, the metric."""

    def __init__(self, async_engine: AsyncEngine, metrics: ServerMetrics, wake_on_request: bool) -> None:
        self.async_engine, self.metrics, self.wake_on_request = async_engine, metrics, wake_on_request
        self.level = 0  # 0 awake, else the level it sleeps at
        self.draining = False  # a drained sleep is waiting for running requests: admit no new one
        self._weights_released = False
        self._admitted = 0  # inference requests past admit() whose handler has not returned
        self._lock = asyncio.Lock()

    async def sleep(self, level: int, drain: bool = False) -> None:
        """Sleep at ``level``; a busy engine is a Conflict, or with ``drain`` is waited for."""
        async with self._lock:
            if self.level:
                if level != self.level:
                    raise Conflict(f"the engine already sleeps at level {self.level}; wake it first")
                return
            if not drain:
                await self._sleep_now(level)
                return
            self.draining = True
            logger.info("draining before sleeping at level %d: %s requests running", level, self._running())
            try:
                while self._running():
                    await asyncio.sleep(DRAIN_POLL_S)
                await self._sleep_now(level)
            finally:
                self.draining = False

    def _running(self) -> int:
        """Zero once no request runs: handlers count until they return, the engine's streams until they
        end (a stream outlives its handler, which awaits its first output, so none slips between)."""
        return max(self._admitted, self.async_engine.in_flight)

    async def _sleep_now(self, level: int) -> None:
        from keepwarm_runtime.engine import sleep as engine_sleep

        def put_to_sleep(engine: AsyncEngine) -> engine_sleep.SleepReport:
            if engine.in_flight:
                raise Conflict(f"{engine.in_flight} requests are running; retry once they finish")
            try:
                report = engine_sleep.sleep(engine.engine, level)
            except engine_sleep.SleepError as exc:
                raise Conflict(f"cannot sleep: {exc}") from exc
            engine.state = "sleeping"
            return report

        report = await self._in_engine_thread(put_to_sleep)
        self.level, self._weights_released = level, report.weights_released
        self.metrics.sleep_level.set(level)
        logger.info(
            "asleep at level %d in %.2fs (weights let go: %s)",
            level,
            report.seconds,
            report.weights_released,
        )

    async def wake(self) -> None:
        from keepwarm_runtime.engine import sleep as engine_sleep

        async with self._lock:
            if not self.level:
                return
            released = self._weights_released

            def wake_up(engine: AsyncEngine) -> float:
                seconds = engine_sleep.wake(engine.engine, released)
                engine.state = "ready"
                return seconds

            try:
                seconds = await self._in_engine_thread(wake_up)
            except Exception as exc:  # the cache lost the model and --no-cache-fallback, a bad disk...
                logger.exception("waking failed; the engine stays asleep")
                raise NotReady(
                    f"waking failed, the engine stays asleep: {type(exc).__name__}: {exc}", code="wake_failed"
                ) from exc
            self.level = 0
            self.metrics.sleep_level.set(0)
            logger.info("awake in %.2fs", seconds)

    def check_admitting(self) -> None:
        """503 ``model_sleeping`` while a drained sleep waits (for /ready and new requests)."""
        if self.draining:
            raise NotReady(
                "the model is going to sleep (POST /sleep with drain=true): running requests finish, "
                "new ones go elsewhere",
                code="model_sleeping",
            )

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """One inference request's handler: refused while draining; with --wake-on-request, a request
        to a sleeping engine wakes it first; counted until the handler returns (a drain waits for it)."""
        self.check_admitting()
        if self.level and self.wake_on_request:
            await self.wake()
        self._admitted += 1
        try:
            yield
        finally:
            self._admitted -= 1

    async def _in_engine_thread(self, fn: Callable[[AsyncEngine], T]) -> T:
        state = self.async_engine.state
        if state not in ("ready", "sleeping"):
            raise NotReady(f"the engine is {state}", code="model_not_ready")
        return await asyncio.wrap_future(self.async_engine.call(fn))


async def sleep(request: Request) -> Response:
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise BadRequest(f"level must be 1 or 2, got {raw!r}", param="level")
    drain = request.query_params.get("drain", "false").lower()
    if drain not in TRUE_WORDS | FALSE_WORDS:
        raise BadRequest(f"drain must be true or false, got {drain!r}", param="drain")
    await _mode(request).sleep(int(raw), drain=drain in TRUE_WORDS)
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    await _mode(request).wake()
    return Response(status_code=200)


async def is_sleeping(request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": bool(_mode(request).level)})


def _mode(request: Request) -> SleepMode:
    return request.app.state.sleep_mode


ROUTES = (
    Route("/sleep", "POST", sleep, requires="sleep_mode"),
    Route("/wake_up", "POST", wake_up, requires="sleep_mode"),
    Route("/is_sleeping", "GET", is_sleeping, requires="sleep_mode"),
)
