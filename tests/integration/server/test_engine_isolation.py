"""The engine side of isolation, with a real LLMEngine: a request enters whole or not at all, and a
fault in one request's constraint fails that request only while the others finish."""

from __future__ import annotations

import pytest

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine
from keepwarm_runtime.engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(str(tiny_llama), num_kv_blocks=64, block_size=4, max_model_len=128))


def _idle(engine: LLMEngine) -> tuple[int, int, float]:
    stats = engine.stats()
    return stats.num_running, stats.num_waiting, stats.kv_cache_usage


class _AllowAll:
    def __init__(self, fail_at: int | None = None) -> None:
        self.calls, self.fail_at = 0, fail_at

    def fill_mask(self, logits) -> None:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("matcher state corrupt")

    def accept(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


def test_a_request_whose_second_sequence_cannot_be_built_queues_nothing(engine):
    made = []

    def factory():
        if made:
            raise RuntimeError("out of matcher memory")
        made.append(_AllowAll())
        return made[-1]

    for i in range(10):
        made.clear()
        with pytest.raises(RuntimeError, match="matcher memory"):
            engine.add_request(f"partial-{i}", [1, 2, 3], SamplingParams(n=2, constraint_factory=factory))
    assert _idle(engine) == (0, 0, 0.0) and not engine.requests
    overflowing = SamplingParams(n=2, seed=0)
    overflowing.seed = 2**64  # set after construction: add_request must still refuse it, whole
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("seed", [1, 2], overflowing)
    assert _idle(engine) == (0, 0, 0.0) and not engine.requests


def test_a_constraint_fault_fails_its_request_alone(engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("innocent", [1, 2, 3, 4], greedy)
    faulty = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, constraint_factory=lambda: _AllowAll(3)
    )
    engine.add_request("faulty", [5, 6, 7], faulty)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert "matcher state corrupt" in finals["faulty"].error
    assert finals["innocent"].error is None and len(finals["innocent"].outputs[0].token_ids) == 12
    assert _idle(engine) == (0, 0, 0.0)
    assert finals["innocent"].outputs[0].logprobs is None


def test_a_failed_final_only_request_reports_the_text_a_cumulative_one_does(engine):
    """A FINAL_ONLY request detokenises nothing before it finishes; when it fails instead, its one
    output still carries the text and tokens up to the fault, as a CUMULATIVE request's last does."""
    finals = {}
    for kind in RequestOutputKind:
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            constraint_factory=lambda: _AllowAll(4),
            output_kind=kind,
        )
        engine.add_request(kind.value, [5, 6, 7, 8, 9], params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                finals.setdefault(output.request_id, []).append(output)
    [failed] = finals["final_only"]
    last = finals["cumulative"][-1]
    assert failed.error and failed.error == last.error and len(finals["cumulative"]) == 4
    assert failed.outputs[0].token_ids == last.outputs[0].token_ids and len(last.outputs[0].token_ids) == 3
    assert failed.outputs[0].text == last.outputs[0].text
    assert _idle(engine) == (0, 0, 0.0)
