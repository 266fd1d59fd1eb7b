"""The preprocessing pool: prompt work runs off the event loop and is cut off by a named 400."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from keepwarm_runtime.server.async_engine import AsyncEngine
from keepwarm_runtime.server.base.errors import BadRequest
from keepwarm_runtime.server.base.metrics import ServerMetrics
from keepwarm_runtime.server.base.serving import ServingContext, ServingOptions, truncate_prompt


def _context(timeout: float) -> ServingContext:
    return ServingContext(
        async_engine=AsyncEngine(lambda: None),
        metrics=ServerMetrics("unit"),
        served_model_name="unit",
        model_dir=Path("/nonexistent"),
        options=ServingOptions(preprocess_timeout_s=timeout),
    )


def test_work_runs_in_a_worker_thread_and_the_loop_stays_free():
    ctx = _context(timeout=5)

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        thread = await ctx.preprocess(lambda: (time.sleep(0.3), threading.current_thread().name)[1])
        ticker.cancel()
        return thread, ticks

    thread, ticks = asyncio.run(main())
    ctx.close()
    assert thread.startswith("keepwarm-prep") and ticks >= 10


def test_work_past_the_bound_is_a_named_400():
    ctx = _context(timeout=0.1)
    with pytest.raises(BadRequest, match=r"longer than 0\.1s") as info:
        asyncio.run(ctx.preprocess(time.sleep, 1.0))
    ctx.close()
    assert info.value.code == "preprocess_timeout"


def test_truncate_prompt_keeps_the_last_tokens():
    assert truncate_prompt([1, 2, 3, 4], 2) == [3, 4]
    assert truncate_prompt([1, 2], 5) == [1, 2] and truncate_prompt([1, 2], None) == [1, 2]


def test_prompt_logprobs_are_refused_by_name_where_the_engine_cannot_or_the_prompt_is_too_long():
    from types import SimpleNamespace

    ctx = _context(timeout=5)
    ctx.async_engine.state = "ready"
    ctx.async_engine.engine = SimpleNamespace(max_prompt_logprobs_len=8)
    ctx.check_prompt_logprobs(8, "prompt_logprobs")
    with pytest.raises(BadRequest) as too_long:
        ctx.check_prompt_logprobs(9, "logprobs")
    assert too_long.value.param == "logprobs" and "at most 8" in too_long.value.message
    ctx.async_engine.engine = SimpleNamespace(max_prompt_logprobs_len=0)  # scores no prompts (e.g. speech)
    with pytest.raises(BadRequest) as cannot:
        ctx.check_prompt_logprobs(2, "prompt_logprobs")
    assert cannot.value.param == "prompt_logprobs" and "does not compute" in cannot.value.message
