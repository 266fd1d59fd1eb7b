"""A response that does not stream asks the engine for its final output only
(RequestOutputKind.FINAL_ONLY), and its metrics still time the first token from when the engine
sampled it, not from when the one output arrived."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from keepwarm_runtime.engine.outputs import CompletionOutput, RequestOutput
from keepwarm_runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from keepwarm_runtime.server.base.metrics import RequestTimer, ServerMetrics
from keepwarm_runtime.server.base.serving import ServingContext, ServingOptions


class _Engine:
    """Stands in for AsyncEngine.generate: one finished output whose first token came 0.25 s ago."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *_: Any):
        self.params.append(params)
        completion = CompletionOutput(0, "four tokens", [5, 6, 7, 8], None, None, "length")
        first = time.perf_counter() - 0.25
        yield RequestOutput(request_id, None, prompt_ids, [completion], True, first_token_time=first)


def _run(final_only: bool) -> tuple[_Engine, ServerMetrics, SamplingParams]:
    engine, metrics = _Engine(), ServerMetrics("unit")
    ctx = ServingContext(
        async_engine=engine,  # type: ignore[arg-type]
        metrics=metrics,
        served_model_name="unit",
        model_dir=Path("/nonexistent"),
        options=ServingOptions(),
    )
    params = SamplingParams(max_tokens=4)
    timer = RequestTimer(metrics, 3, arrival=time.perf_counter() - 0.5)

    async def consume() -> None:
        async for _ in ctx.stream("r", [1, 2, 3], params, timer, final_only=final_only):
            pass

    asyncio.run(consume())
    return engine, metrics, params


def _sample(metrics: ServerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def test_a_response_that_does_not_stream_asks_for_the_final_output_only() -> None:
    engine, metrics, params = _run(final_only=True)
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.FINAL_ONLY]
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as they were
    assert _sample(metrics, "keepwarm_generation_tokens_total") == 4
    # the first token's time is the engine's (0.25 s after arrival), not the output's arrival (0.5 s)
    assert _sample(metrics, "keepwarm_time_to_first_token_seconds_sum") == pytest.approx(0.25, abs=0.05)


def test_a_stream_asks_for_every_output() -> None:
    engine, _, _ = _run(final_only=False)
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.CUMULATIVE]
