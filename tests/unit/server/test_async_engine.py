"""AsyncEngine: the engine thread, per-request queues, abort on cancel, failures contained.

The engine here is a small scripted stand-in (each request emits one token per step); the thing under
test is the asyncio/thread plumbing around it, which is real.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from keepwarm_runtime.server.async_engine import AsyncEngine, EngineRequestError


class ScriptedEngine:
    """Emits one token per step per request; prompt [666] makes step() raise, [13] fails that request
    (at its first token, [14] at its third), [7] never finishes (one token, again and again, until it
    is aborted)."""

    def __init__(self) -> None:
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt_token_ids, params, priority=0):
        self.thread_ids.add(threading.get_ident())
        if len(prompt_token_ids) > 8:
            raise ValueError("prompt is longer than the context")
        self.requests[request_id] = {"prompt": prompt_token_ids, "done": 0, "max": params.max_tokens}

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def work_while_idle(self):
        return False

    def step(self):
        self.thread_ids.add(threading.get_ident())
        outputs = []
        for request_id, state in list(self.requests.items()):
            if state["prompt"] == [666]:
                state["prompt"] = [0]
                raise RuntimeError("boom")
            state["done"] = 1 if state["prompt"] == [7] else state["done"] + 1
            failing = state["prompt"] == [13] or (state["prompt"] == [14] and state["done"] == 3)
            error = "sampling failed: overflow" if failing else None
            finished = state["done"] >= state["max"] or error is not None
            if finished:
                del self.requests[request_id]
            out = SimpleNamespace(
                index=0, token_ids=list(range(state["done"])), finish_reason="length" if finished else None
            )
            outputs.append(
                SimpleNamespace(request_id=request_id, outputs=[out], finished=finished, error=error)
            )
        return outputs

    def stats(self):
        return SimpleNamespace(
            num_running=len(self.requests), num_waiting=0, kv_cache_usage=0.0, num_preemptions=0
        )


def params(max_tokens: int):
    return SimpleNamespace(max_tokens=max_tokens)


@pytest.fixture
def engine_pair():
    scripted = ScriptedEngine()
    stats = []
    async_engine = AsyncEngine(lambda: scripted, on_stats=stats.append)
    async_engine.start()
    assert async_engine.ready_event.wait(5) and async_engine.ready
    yield async_engine, scripted, stats
    async_engine.shutdown()


async def _collect(async_engine, request_id, prompt, max_tokens):
    return [o async for batch in async_engine.generate(request_id, prompt, params(max_tokens)) for o in batch]


def test_concurrent_requests_stream_to_their_own_queues(engine_pair):
    async_engine, scripted, stats = engine_pair

    async def main():
        return await asyncio.gather(*(_collect(async_engine, f"r{i}", [1, 2], 3 + i) for i in range(10)))

    results = asyncio.run(main())
    for i, outputs in enumerate(results):
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 4 + i))
        assert outputs[-1].finished and all(o.request_id == f"r{i}" for o in outputs)
    assert scripted.thread_ids == {async_engine._thread.ident}  # only the engine thread touches it
    assert stats and stats[-1].num_running == 0


def test_a_step_wakes_the_event_loop_once_for_all_its_streams(engine_pair):
    """Each call_soon_threadsafe writes the loop's self-pipe from the engine thread: a step hands
    every stream its output in one."""
    async_engine, scripted, _ = engine_pair
    calls: list[int] = []
    steps: list[int] = []  # outputs of each step that had any
    step = scripted.step

    def counted_step():
        outputs = step()
        if outputs:
            steps.append(len(outputs))
        return outputs

    scripted.step = counted_step

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            calls.append(threading.get_ident())
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        return await asyncio.gather(*(_collect(async_engine, f"w{i}", [1, 2], 4) for i in range(8)))

    results = asyncio.run(main())
    assert all([len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4] for outputs in results)
    from_engine = [c for c in calls if c == async_engine._thread.ident]
    assert sum(steps) == 32 and len(from_engine) == len(steps) < 32  # one a step, not one an output


def test_a_consumer_behind_the_engine_takes_its_backlog_in_one_batch(engine_pair):
    """generate gives everything queued for the request by then, in order, nothing lost."""
    async_engine, _, _ = engine_pair

    async def main():
        batches = []
        async for batch in async_engine.generate("slow", [1, 2], params(6)):
            batches.append([len(o.outputs[0].token_ids) for o in batch])
            await asyncio.sleep(0.2)  # the engine runs on meanwhile
        return batches

    batches = asyncio.run(main())
    assert [n for batch in batches for n in batch] == [1, 2, 3, 4, 5, 6]
    assert max(len(batch) for batch in batches) > 1


def test_add_error_fails_only_that_request(engine_pair):
    async_engine, _, _ = engine_pair

    async def main():
        good = asyncio.create_task(_collect(async_engine, "good", [1], 5))
        with pytest.raises(EngineRequestError, match="longer than the context") as info:
            await _collect(async_engine, "bad", list(range(20)), 5)
        assert info.value.bad_request
        return await good

    assert asyncio.run(main())[-1].finished


def test_a_request_the_engine_pins_a_fault_on_fails_alone(engine_pair):
    async_engine, _, _ = engine_pair

    async def main():
        good = asyncio.create_task(_collect(async_engine, "good", [1], 5))
        with pytest.raises(EngineRequestError, match="overflow") as info:
            await _collect(async_engine, "faulty", [13], 5)
        assert not info.value.bad_request
        return await good

    assert asyncio.run(main())[-1].finished
    assert async_engine.state == "ready"


def test_a_consumer_behind_the_engine_gets_the_outputs_before_its_error_first(engine_pair):
    """Outputs queued with the error after them (however the steps fall, in one batch or several):
    every output comes, in order, then the error raises."""
    async_engine, _, _ = engine_pair

    async def main():
        batches = []
        with pytest.raises(EngineRequestError, match="overflow"):
            async for batch in async_engine.generate("late-fault", [14], params(6)):
                batches.append([len(o.outputs[0].token_ids) for o in batch])
                await asyncio.sleep(0.3)  # the engine's next steps queue more items meanwhile
        return batches

    assert [n for batch in asyncio.run(main()) for n in batch] == [1, 2]


def test_step_exception_fails_in_flight_requests_and_marks_the_engine_failed(engine_pair):
    async_engine, _, _ = engine_pair

    async def main():
        with pytest.raises(EngineRequestError, match="boom") as info:
            await _collect(async_engine, "bomb", [666], 5)
        assert not info.value.bad_request
        with pytest.raises(EngineRequestError, match="failed"):
            await _collect(async_engine, "after", [1], 2)

    asyncio.run(main())
    assert async_engine.state == "failed" and "boom" in async_engine.error  # /health answers 503


def test_cancelled_consumer_aborts_its_request(engine_pair):
    async_engine, scripted, _ = engine_pair

    async def main():
        async def consume():
            # Endless: a request that could finish might do so before this loop sees it, on a box
            # that leaves the event loop's thread off the CPU while the engine thread steps.
            async for _ in async_engine.generate("slow", [7], params(2)):
                pass

        task = asyncio.create_task(consume())
        while "slow" not in scripted.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if "slow" in scripted.aborted:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert scripted.aborted == ["slow"]
    assert not scripted.requests


def test_failed_load_reports_state_and_rejects_requests():
    def broken():
        raise FileNotFoundError("no config.json in /nowhere")

    async_engine = AsyncEngine(broken)
    async_engine.start()
    assert async_engine.ready_event.wait(5)
    assert async_engine.state == "failed" and "config.json" in async_engine.error

    async def main():
        with pytest.raises(EngineRequestError, match="failed"):
            await _collect(async_engine, "x", [1], 1)

    asyncio.run(main())
    with pytest.raises(EngineRequestError, match="engine is failed"):  # no engine to read from either
        async_engine.loaded_engine()


class IdleWorkEngine(ScriptedEngine):
    """Has ``pieces`` of idle work (as decode graphs to capture); each piece notes whether a request was
    running then, and the first ``failures`` pieces raise."""

    def __init__(self, pieces: int, failures: int = 0) -> None:
        super().__init__()
        self.pieces, self.failures = pieces, failures
        self.done: list[bool] = []  # per piece: was a request unfinished while it ran
        self.first_done = threading.Event()

    def work_while_idle(self):
        self.thread_ids.add(threading.get_ident())
        if self.failures:
            self.failures -= 1
            raise RuntimeError("capture exploded")
        if len(self.done) == self.pieces:
            return False
        self.done.append(self.has_unfinished_requests())
        self.first_done.set()
        threading.Event().wait(0.01)  # a piece takes a while, as a capture does
        return True


def test_idle_work_runs_between_requests_one_piece_at_a_time():
    """The engine's idle work (decode graph captures) runs only while no request runs, on the engine
    thread, and a request that arrives meanwhile is served after at most one piece."""
    engine = IdleWorkEngine(pieces=30)
    async_engine = AsyncEngine(lambda: engine)
    async_engine.start()
    try:
        assert async_engine.ready_event.wait(5) and engine.first_done.wait(5)
        outputs = asyncio.run(_collect(async_engine, "mid", [1, 2], 3))
        assert outputs[-1].finished and len(engine.done) < 30  # served before the idle work was over
        deadline = threading.Event()
        while len(engine.done) < 30 and not deadline.wait(0.05):
            pass
        assert len(engine.done) == 30 and not any(engine.done)
        assert engine.thread_ids == {async_engine._thread.ident}
    finally:
        async_engine.shutdown()


def test_idle_work_that_fails_is_logged_and_serving_goes_on(caplog):
    engine = IdleWorkEngine(pieces=2, failures=1)
    async_engine = AsyncEngine(lambda: engine)
    async_engine.start()
    try:
        assert async_engine.ready_event.wait(5)
        assert asyncio.run(_collect(async_engine, "after", [1], 2))[-1].finished
        assert async_engine.state == "ready"
        assert any("work between requests failed" in r.getMessage() for r in caplog.records)
    finally:
        async_engine.shutdown()
