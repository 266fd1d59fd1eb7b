"""Request-facing engine fields: logit_bias, allowed_token_ids, bad words, priority, seeds, isolation."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.block_manager import BlockManager
from keepwarm_runtime.engine.sampler import Sampler
from keepwarm_runtime.engine.sampling_params import SamplingParams
from keepwarm_runtime.engine.scheduler import Scheduler
from keepwarm_runtime.engine.sequence import Sequence

EOS = 0
LOGITS = torch.tensor([0.0, 1.0, 2.0, 3.0, 2.5, -1.0])


def seq(params: SamplingParams, output: tuple[int, ...] = (), rid: str = "r") -> Sequence:
    s = Sequence(rid, 0, [5, 5], params)
    s.token_ids.extend(output)
    return s


def greedy_token(params: SamplingParams, output: tuple[int, ...] = ()) -> int:
    return Sampler({EOS})([seq(params, output)], LOGITS[None].clone())[0].token_id


def test_logit_bias_moves_the_greedy_choice() -> None:
    assert greedy_token(SamplingParams(temperature=0)) == 3
    assert greedy_token(SamplingParams(temperature=0, logit_bias={3: -100})) == 4
    assert greedy_token(SamplingParams(temperature=0, logit_bias={5: 100})) == 5


def test_allowed_token_ids_confine_every_draw() -> None:
    sampler = Sampler({EOS}, seed=3)
    params = SamplingParams(temperature=1.5, allowed_token_ids=[0, 5])
    drawn = {sampler([seq(params)], LOGITS[None].clone())[0].token_id for _ in range(100)}
    assert drawn == {0, 5}


def test_bad_words_ban_single_tokens_and_the_end_of_sequences() -> None:
    assert greedy_token(SamplingParams(temperature=0, bad_words_token_ids=[[3]])) == 4
    two = SamplingParams(temperature=0, bad_words_token_ids=[[1, 3]])
    assert greedy_token(two, output=(1,)) == 4  # "1 3" would complete the bad word
    assert greedy_token(two, output=(2,)) == 3  # a different prefix: 3 is fine


def test_a_failing_row_fails_alone() -> None:
    class Broken:
        def fill_mask(self, logits):
            raise RuntimeError("grammar state corrupt")

    bad = seq(SamplingParams(temperature=0), rid="bad")
    bad.constraint = Broken()
    overflow = seq(SamplingParams(temperature=1.0), rid="overflow")
    overflow.params.top_k = 2**70  # as if validation had been bypassed
    good = seq(SamplingParams(temperature=0), rid="good")
    out = Sampler({EOS})([bad, overflow, good], torch.stack([LOGITS] * 3))
    assert "grammar state corrupt" in out[0].error
    assert out[1].error and "sampling failed" in out[1].error
    assert out[2].error is None and out[2].token_id == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": 2**70},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"logit_bias": {1: 101.0}},
        {"allowed_token_ids": []},
        {"bad_words_token_ids": [[]]},
    ],
)
def test_out_of_range_fields_are_refused_by_name(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_token_ids")[0]):
        SamplingParams(**kwargs)


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    for kwargs in ({"logit_bias": {6: 1.0}}, {"allowed_token_ids": [6]}, {"stop_token_ids": [-1]}):
        with pytest.raises(ValueError, match=r"\[0, 6\)"):
            SamplingParams(**kwargs).validate(vocab_size=6)


def test_the_largest_seed_gives_every_sequence_a_valid_distinct_seed() -> None:
    params = SamplingParams(n=2, seed=2**64 - 1)
    seeds = [params.sequence_seed(i) for i in range(2)]
    assert seeds == [2**64 - 1, 0]
    for seed in seeds:
        torch.Generator().manual_seed(seed)


def test_lower_priority_values_are_admitted_first() -> None:
    scheduler = Scheduler(BlockManager(64, 4, False), max_num_seqs=1, max_num_batched_tokens=64)
    order = [("late", 5), ("urgent", -1), ("normal", 0), ("normal2", 0)]
    for rid, priority in order:
        scheduler.add(Sequence(rid, 0, [1, 2], SamplingParams(), priority=priority))
    assert [s.request_id for s in scheduler.waiting] == ["urgent", "normal", "normal2", "late"]
