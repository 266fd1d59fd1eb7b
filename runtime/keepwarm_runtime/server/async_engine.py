"""The engine behind asyncio: one background thread owns the LLMEngine, requests talk through queues.

The thread builds the engine (loading weights while the HTTP server already answers /health), then
loops: apply queued adds and aborts, ``step()``, hand each output to its request's stream (one
``loop.call_soon_threadsafe`` a step for all of them); with no request running, it gives the engine
its idle work one piece at a time (``work_while_idle``: decode graphs captured), looking at the queue
between pieces. Only that thread touches the engine, so the engine needs no locks.

Failure containment: ``add_request`` errors (prompt too long, bad params) go to that request alone,
and so do the faults the engine pins on one request (``RequestOutput.error``: a constraint or sampling
fault, its audio failing the encoder). An exception escaping ``step()`` cannot be pinned on anyone and
may have left the engine's state inconsistent: every in-flight request gets the error, the state
becomes "failed" (so /health answers 503 and Kubernetes restarts the pod) and no further work is
accepted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keepwarm_runtime.engine.multimodal import AudioFeatures
    from keepwarm_runtime.engine.outputs import EngineStats, RequestOutput
    from keepwarm_runtime.engine.sampling_params import SamplingParams
    from keepwarm_runtime.server.engine_client import EngineClient

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine rejected or failed a request; ``bad_request`` means the client's input is at fault."""

    def __init__(self, message: str, *, bad_request: bool) -> None:
        super().__init__(message)
        self.bad_request = bad_request


@dataclass(eq=False)
class _Stream:
    """One request's channel from the engine thread to its coroutine: what the engine sent, put there
    on the event loop (``put``), and the future the coroutine waits on while nothing is. A list and a
    future, not an ``asyncio.Queue``: the coroutine takes everything at once, and the queue's getters,
    putters and per-item calls cost a stream some microseconds a token on the event loop."""

    loop: asyncio.AbstractEventLoop
    items: list[Any] = field(default_factory=list)  # RequestOutput | EngineRequestError, in order
    waiter: asyncio.Future | None = None  # set while the coroutine waits for items
    finished: bool = False  # the engine sent its last item (engine thread)

    def put(self, items: list[Any]) -> None:
        """Add ``items`` and wake the coroutine (on the event loop's thread)."""
        self.items += items
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Everything put since the last take: at least one item, waited for."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class AsyncEngine:
    """Owns the engine thread. ``state`` is "loading", "ready", "sleeping", "failed" or "stopped"."""

    def __init__(
        self,
        make_engine: Callable[[], EngineClient],
        on_stats: Callable[[EngineStats], None] | None = None,
        on_ready: Callable[[EngineClient], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        self._make_engine = make_engine
        self._on_stats = on_stats  # called with engine.stats() after each step, in the engine thread
        self._on_ready = on_ready  # called with the engine once loaded, in the engine thread
        self._on_abort = on_abort  # called with the id of each request aborted while in flight
        self.engine: EngineClient | None = None  # the LLMEngine once ready; read-only from other threads
        self.state = "loading"
        self.error: str | None = None  # why loading failed
        self._inbox: deque[tuple[str, Any]] = (
            deque()
        )  # ("add", (id, ...)) | ("abort", id) | ("call", (fn, ..))
        self._streams: dict[str, _Stream] = {}  # engine-thread only
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="keepwarm-engine", daemon=True)
        self.ready_event = threading.Event()  # set when state leaves "loading"

    # --- called from the event loop ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def in_flight(self) -> int:
        """Requests the engine thread is streaming now (read between steps by ``call``'s functions)."""
        return len(self._streams)

    def call(self, fn: Callable[[AsyncEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(self)`` in the engine thread between steps (sleep and wake:
        server/openai/sleep/serving.py); the future holds its result or exception.
        Commands queued before it run first."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if (refused := self._not_loaded()) is not None:
            future.set_exception(refused)
            return future
        self._inbox.append(("call", (fn, future)))
        self._wake.set()
        return future

    def loaded_engine(self) -> EngineClient:
        """The engine, for reads of what never changes once it is loaded (LLMEngine.read_lora), from
        any thread; EngineRequestError, as ``call`` gives, while it is not ready or sleeping."""
        if (refused := self._not_loaded()) is not None:
            raise refused
        assert self.engine is not None  # ready or sleeping: loaded
        return self.engine

    def _not_loaded(self) -> EngineRequestError | None:
        if self.state in ("ready", "sleeping"):
            return None
        return EngineRequestError(f"engine is {self.state}", bad_request=False)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        audio: AudioFeatures | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """Yield the request's RequestOutputs (of its params' output kind) until finished, each time
        every output queued by then (at least one, in order): a consumer that fell behind the engine
        (the event loop busy, a client slow to read) takes its backlog in one piece and can send it
        as one chunk. An error raises once the outputs before it are given. The request is aborted
        if the consumer goes away.
        ``audio``: features for the prompt's placeholder tokens, encoded in the engine's step
        (engine/multimodal.py), or None;
        ``lora_name``: the LoRA adapter it runs with (engine/lora), or None for the base model."""
        stream = _Stream(asyncio.get_running_loop())
        self._post(("add", (request_id, prompt_token_ids, params, priority, audio, lora_name, stream)))
        try:
            while True:
                items = await stream.take()
                for i, item in enumerate(items):
                    if isinstance(item, EngineRequestError):  # the last item the engine sends a request
                        if i:
                            yield items[:i]
                        raise item
                yield items
                if items[-1].finished:
                    return
        finally:
            if not stream.finished:  # cancelled (client gone) or closed early: free the sequence
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV blocks; a finished or unknown id is a no-op."""
        if self.state == "ready":
            self._post(("abort", request_id))

    def _post(self, command: tuple[str, Any]) -> None:
        if self.state != "ready":
            raise EngineRequestError(f"engine is {self.state}", bad_request=False)
        self._inbox.append(command)
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            started = time.perf_counter()
            self.engine = self._make_engine()
            logger.info("engine ready in %.2fs", time.perf_counter() - started)
            if self._on_ready is not None:
                self._on_ready(self.engine)
            self.state = "ready"
        except BaseException as exc:
            logger.exception("loading the engine failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            return
        finally:
            self.ready_event.set()
        while not self._stop:
            if not self._wake.is_set() and not self._work_while_idle():
                self._wake.wait()
            self._wake.clear()
            self._drain_inbox()
            while self.engine.has_unfinished_requests() and not self._stop:
                if not self._step():
                    break  # wait for new work instead of spinning on a failing step
                self._drain_inbox()
            self._report_stats()
        if self.state != "failed":
            self.state = "stopped"

    def _work_while_idle(self) -> bool:
        """One piece of the engine's idle work (a decode graph's capture), while no request runs; False
        when there is none left or it failed (logged: requests are served as before)."""
        if self.state != "ready":
            return False
        try:
            return self.engine.work_while_idle()
        except Exception:
            logger.exception("the engine's work between requests failed; serving goes on without it")
            return False

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                request_id, prompt_token_ids, params, priority, audio, lora_name, stream = payload
                # Only what the request set: engines without priorities or audio (WhisperEngine) take neither.
                extra: dict[str, Any] = {} if audio is None else {"audio": audio}
                if priority:
                    extra["priority"] = priority
                if lora_name is not None:
                    extra["lora_name"] = lora_name
                try:
                    self.engine.add_request(request_id, prompt_token_ids, params, **extra)
                except Exception as exc:  # bad params or prompt too long: only this request fails
                    stream.finished = True
                    error = EngineRequestError(str(exc), bad_request=isinstance(exc, ValueError))
                    self._send(stream, [error])
                    continue
                self._streams[request_id] = stream
            elif kind == "call":
                fn, future = payload
                try:
                    future.set_result(fn(self))
                except Exception as exc:
                    future.set_exception(exc)
            else:
                stream = self._streams.pop(payload, None)
                self.engine.abort_request(payload)
                if stream is not None:
                    stream.finished = True
                    if self._on_abort is not None:
                        self._on_abort(payload)

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self.error = f"engine step failed: {type(exc).__name__}: {exc}"
            self.state = "failed"  # /health now answers 503: the pod needs a restart
            self._stop = True
            error = EngineRequestError(self.error, bad_request=False)
            for request_id, stream in list(self._streams.items()):
                self._abort_quietly(request_id)
                stream.finished = True
                self._send(stream, [error])
            self._streams.clear()
            return False
        by_stream: dict[int, tuple[_Stream, list[Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if output.finished:
                stream.finished = True
                del self._streams[output.request_id]
            item = output if output.error is None else EngineRequestError(output.error, bad_request=False)
            by_stream.setdefault(id(stream), (stream, []))[1].append(item)
        self._send_all(list(by_stream.values()))
        self._report_stats()
        return True

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting %s failed", request_id)

    def _report_stats(self) -> None:
        if self._on_stats is None:
            return
        try:
            self._on_stats(self.engine.stats())
        except Exception:
            logger.exception("reporting engine stats failed")

    @classmethod
    def _send(cls, stream: _Stream, items: list[Any]) -> None:
        cls._send_all([(stream, items)])

    @staticmethod
    def _send_all(deliveries: list[tuple[_Stream, list[Any]]]) -> None:
        """Hand each stream its items with one ``call_soon_threadsafe`` per event loop (the server has
        one), not one per stream: each call wakes the loop through its self-pipe, and a step of 64
        streams would write it 64 times from this thread and run 64 callbacks there."""
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[_Stream, list[Any]]]]] = {}
        for stream, items in deliveries:
            by_loop.setdefault(id(stream.loop), (stream.loop, []))[1].append((stream, items))

        def put_all(batch: list[tuple[_Stream, list[Any]]]) -> None:
            for stream, items in batch:
                stream.put(items)

        for loop, batch in by_loop.values():
            with contextlib.suppress(RuntimeError):  # the event loop is closed (shutdown)
                loop.call_soon_threadsafe(put_all, batch)
