"""A response that does not stream asks the engine for its final output only
(RequestOutputKind.FINAL_ONLY), and its metrics still time the first token from when the engine
sampled it, not from when the one output arrived; one that streams asks for deltas (DELTA) and reads
them put back together."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from keepwarm_runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput
from keepwarm_runtime.engine.sampling_params import RequestOutputKind, SamplingParams
from keepwarm_runtime.server.base.deltas import Accumulated
from keepwarm_runtime.server.base.metrics import RequestTimer, ServerMetrics
from keepwarm_runtime.server.base.serving import ServingContext, ServingOptions


class _Engine:
    """Stands in for AsyncEngine.generate: one finished output whose first token came 0.25 s
    ago."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *_: Any):
        self.params.append(params)
        completion = CompletionOutput(0, "four tokens", [5, 6, 7, 8], None, None, "length")
        first = time.perf_counter() - 0.25
        yield [RequestOutput(request_id, None, prompt_ids, [completion], True, first_token_time=first)]


def _run(streaming: bool | None, engine: Any = None) -> tuple[Any, ServerMetrics, SamplingParams]:
    engine, metrics = engine or _Engine(), ServerMetrics("unit")
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
        async for output in ctx.stream("r", [1, 2, 3], params, timer, streaming=streaming):
            seen = getattr(engine, "seen", None)
            if seen is not None:  # what the consumer reads at each output, copied
                seen.append((id(output), output.outputs[0].text, list(output.outputs[0].token_ids)))

    asyncio.run(consume())
    return engine, metrics, params


def _sample(metrics: ServerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


def test_a_response_that_does_not_stream_asks_for_the_final_output_only() -> None:
    engine, metrics, params = _run(streaming=False)
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.FINAL_ONLY]
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as they were
    assert _sample(metrics, "keepwarm_generation_tokens_total") == 4
    # the first token's time is the engine's (0.25 s after arrival), not the output's arrival (0.5 s)
    assert _sample(metrics, "keepwarm_time_to_first_token_seconds_sum") == pytest.approx(0.25, abs=0.05)


def test_a_transcription_keeps_its_own_output_kind() -> None:
    engine, _, _ = _run(streaming=None)
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.CUMULATIVE]


class _DeltaEngine:
    """Stands in for AsyncEngine.generate as the engine answers a DELTA request: three deltas
    of one choice, with logprobs, the prompt's logprobs on the first alone; ``batches`` says how many
    came queued together each time (as for a consumer behind the engine)."""

    def __init__(self, batches: tuple[int, ...] = (1, 1, 1)) -> None:
        self.params: list[SamplingParams] = []
        self.seen: list[tuple[int, str, list[int]]] = []
        self.batches = batches

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *_: Any):
        self.params.append(params)
        outputs = list(deltas(request_id, prompt_ids))
        for size in self.batches:
            yield outputs[:size]
            outputs = outputs[size:]


def deltas(request_id: str, prompt_ids: list[int]) -> list[RequestOutput]:
    steps = [("He", [5], None), ("llo", [6, 7], None), ("!", [8], "stop")]
    outputs = []
    for i, (text, ids, reason) in enumerate(steps):
        logprobs = [{t: Logprob(-0.5, 1)} for t in ids]
        completion = CompletionOutput(0, text, ids, -0.5 * (i + 1), logprobs, reason)
        scored = [None, {2: Logprob(-1.0, 1)}] if i == 0 else None
        outputs.append(
            RequestOutput(request_id, None, prompt_ids, [completion], reason is not None, 0, scored)
        )
    return outputs


def test_a_stream_asks_for_deltas_and_reads_them_put_together() -> None:
    engine, metrics, _ = _run(streaming=True, engine=_DeltaEngine())
    assert [p.output_kind for p in engine.params] == [RequestOutputKind.DELTA]
    assert [(text, ids) for _, text, ids in engine.seen] == [
        ("He", [5]),
        ("Hello", [5, 6, 7]),
        ("Hello!", [5, 6, 7, 8]),
    ]
    assert len({key for key, _, _ in engine.seen}) == 1  # one output object, updated in place
    assert _sample(metrics, "keepwarm_generation_tokens_total") == 4


def test_a_stream_behind_the_engine_reads_its_backlog_as_one_output() -> None:
    engine, metrics, _ = _run(streaming=True, engine=_DeltaEngine(batches=(1, 2)))
    assert [(text, ids) for _, text, ids in engine.seen] == [("He", [5]), ("Hello!", [5, 6, 7, 8])]
    assert _sample(metrics, "keepwarm_generation_tokens_total") == 4


def test_put_together_keeps_the_first_prompt_logprobs_and_every_token_logprob() -> None:
    together = Accumulated()
    steps = deltas("r", [1, 2])
    first_logprobs = steps[0].outputs[0].logprobs
    for delta in steps:
        out = together.add(delta)
    choice = out.outputs[0]
    assert out.finished and choice.finish_reason == "stop" and choice.cumulative_logprob == -1.5
    assert [list(lp) for lp in choice.logprobs] == [[5], [6], [7], [8]]
    assert out.prompt_logprobs == [None, {2: Logprob(-1.0, 1)}]
    assert steps[0].outputs[0].logprobs is first_logprobs and len(first_logprobs) == 1  # not appended to


def test_put_together_text_grows_in_place_and_a_reader_keeps_the_text_it_read() -> None:
    """The accumulated text is appended to in place (CPython's append to a string one local holds);
    a reader that still holds an earlier text keeps it as it was, and every choice's text is whole."""
    pieces = [f"{i:04d}" for i in range(3000)]
    together = Accumulated()
    kept: list[tuple[int, str]] = []
    for i, piece in enumerate(pieces):
        completion = CompletionOutput(0, piece, [i], None, None, "length" if i == len(pieces) - 1 else None)
        out = together.add(RequestOutput("r", None, [1], [completion], i == len(pieces) - 1))
        if i % 997 == 0:
            kept.append((i, out.outputs[0].text))  # held across the adds that follow
    assert out.outputs[0].text == "".join(pieces)
    for i, text in kept:
        assert text == "".join(pieces[: i + 1])
