"""Sampler: greedy, temperature/top-k/top-p/min-p, seeds, penalties, min_tokens, logprobs, constraints."""

from __future__ import annotations

import math

import pytest
import torch

from keepwarm_runtime.engine.sampler import Sampler
from keepwarm_runtime.engine.sampling_params import SamplingParams, TokenConstraint
from keepwarm_runtime.engine.sequence import Sequence

EOS = 0


def seq(params: SamplingParams, prompt=(5, 6), output=(), seed_gen: bool = True) -> Sequence:
    s = Sequence("r", 0, list(prompt), params)
    s.token_ids.extend(output)
    if params.seed is not None and seed_gen:
        s.generator = torch.Generator().manual_seed(params.seed)
    return s


def draw(params: SamplingParams, logits: torch.Tensor, n: int = 200, **kw) -> list[int]:
    sampler = Sampler({EOS}, seed=1)
    return [sampler([seq(params, **kw)], logits[None].clone())[0].token_id for _ in range(n)]


LOGITS = torch.tensor([0.0, 1.0, 2.0, 3.0, 2.5, -1.0])


def test_greedy_is_argmax() -> None:
    assert set(draw(SamplingParams(temperature=0), LOGITS, n=5)) == {3}


def test_top_k_keeps_only_the_k_most_likely() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), LOGITS)) == {3, 4}


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.softmax(LOGITS, -1)
    top_two = (probs[3] + probs[4]).item()
    assert set(draw(SamplingParams(temperature=1.0, top_p=top_two - 0.01), LOGITS)) == {3, 4}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.01), LOGITS)) == {3}


def test_min_p_drops_unlikely_tokens() -> None:
    # p(2)/p(3) = e^-1 ~ 0.37, p(4)/p(3) ~ 0.61
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.5), LOGITS)) == {3, 4}


def test_temperature_sampling_follows_the_distribution() -> None:
    tokens = draw(SamplingParams(temperature=1.0), LOGITS, n=2000)
    share = tokens.count(3) / len(tokens)
    assert abs(share - torch.softmax(LOGITS, -1)[3].item()) < 0.05
    assert len(set(tokens)) >= 4


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    flat = torch.zeros(1000)
    a = [Sampler({EOS}, seed=0)([seq(SamplingParams(seed=7))], flat[None])[0].token_id for _ in range(3)]
    b = [Sampler({EOS}, seed=99)([seq(SamplingParams(seed=7))], flat[None])[0].token_id for _ in range(3)]
    c = Sampler({EOS}, seed=0)([seq(SamplingParams(seed=8))], flat[None])[0].token_id
    assert a == b and len(set(a)) == 1  # the request seed wins over the engine seed
    assert c != a[0]


def test_penalties() -> None:
    logits = torch.tensor([0.0, 2.0, 2.0, -2.0, 1.9])
    # repetition: token 1 was in the prompt, 2.0 / 2 = 1.0 -> token 2 wins
    assert draw(SamplingParams(temperature=0, repetition_penalty=2.0), logits, n=1, prompt=(1,)) == [2]
    # negative logits are multiplied: token 3 gets pushed further down
    s = seq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(3,))
    assert Sampler({EOS})._process([s], logits[None].clone())[0, 3].item() == -4.0
    # presence and frequency count generated tokens only
    p = SamplingParams(temperature=0, presence_penalty=0.05, frequency_penalty=0.05)
    processed = Sampler({EOS})._process([seq(p, prompt=(4,), output=(1, 1, 2))], logits[None].clone())[0]
    assert processed.tolist() == pytest.approx([0.0, 2.0 - 0.15, 2.0 - 0.1, -2.0, 1.9])


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([5.0, 4.0, 1.0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert draw(p, logits, n=1) == [2]
    assert draw(p, logits, n=1, output=(2, 2)) == [0]


def test_logprobs_are_raw_with_ranks() -> None:
    p = SamplingParams(temperature=0, logprobs=2, repetition_penalty=10.0)
    sampled = Sampler({EOS})([seq(p, prompt=(3,))], LOGITS[None].clone())[0]
    raw = torch.log_softmax(LOGITS, -1)
    assert sampled.token_id == 4  # 3 was penalised
    assert sampled.logprob == pytest.approx(raw[4].item())
    assert sampled.logprobs[4].rank == 2
    assert sampled.logprobs[3].rank == 1 and math.isclose(
        sampled.logprobs[3].logprob, raw[3].item(), rel_tol=1e-6
    )
    assert set(sampled.logprobs) == {3, 4}


class OnlyEven:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_mask(self, logits: torch.Tensor) -> None:
        logits[1::2] = float("-inf")

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return False


def test_constraint_mask_applies_before_sampling() -> None:
    assert isinstance(OnlyEven(), TokenConstraint)
    s = seq(SamplingParams(temperature=0))
    s.constraint = OnlyEven()
    assert Sampler({EOS})([s], LOGITS[None].clone())[0].token_id == 4


def test_mixed_batch_rows_are_independent() -> None:
    rows = [seq(SamplingParams(temperature=0)), seq(SamplingParams(temperature=1.0, top_k=1))]
    out = Sampler({EOS})(rows, torch.stack([LOGITS, LOGITS.flip(0)]))
    assert [t.token_id for t in out] == [3, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": -1},
        {"min_tokens": 5, "max_tokens": 2},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 21},
        {"logprobs": 21},
        {"stop": [""]},
        {"repetition_penalty": 0},
    ],
)
def test_bad_params_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_argmax_rows_agrees_with_torch_on_ties_nans_and_strided_rows() -> None:
    from keepwarm_runtime.engine.sampler import argmax_rows

    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    x[1, 7] = x[1, 9] = float("nan")  # NaN counts as largest; the first one wins
    x[2, :] = 1.0  # all tied: the first index
    x[3, 3] = x[3, 250] = 100.0
    with torch.inference_mode():  # logits arrive from the model as inference tensors
        logits = x.clone()
    for rows in (logits, logits[:, ::3], logits[1:4], logits.double(), logits.bfloat16()):
        assert argmax_rows(rows) == rows.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1:4] == [7, 0, 3]


def test_logprobs_of_a_batch_match_each_row_taken_alone() -> None:
    """Rows asking for logprobs are scored together (one read back per quantity); each row's value,
    rank and alternatives are what scoring it alone gives."""
    from keepwarm_runtime.engine.sampler import _logprobs

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=2),
    ]
    seqs = [seq(p) for p in params]
    sampled = Sampler(set(), seed=0)(seqs, logits)
    raw = torch.log_softmax(logits, dim=-1)
    assert sampled[1].logprobs is None and sampled[1].logprob is None
    for row in (0, 2, 3):
        token = sampled[row].token_id
        assert (sampled[row].logprob, sampled[row].logprobs) == _logprobs(
            raw[row], token, params[row].logprobs
        )
    assert len(sampled[2].logprobs) in (5, 6) and len(sampled[0].logprobs) == 1


PLAIN = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, stop=["x"], stop_token_ids=[2], max_tokens=3, seed=5, ignore_eos=True),
]
NOT_PLAIN = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0, logprobs=0),
    SamplingParams(temperature=0, min_tokens=1),
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(temperature=0, presence_penalty=0.5),
    SamplingParams(temperature=0, frequency_penalty=0.5),
    SamplingParams(temperature=0, logit_bias={1: 5.0}),
    SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
    SamplingParams(temperature=0, bad_words_token_ids=[[3]]),
]


def test_greedy_tokens_are_the_full_samplers_tokens_for_plain_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PLAIN) * 3, 50, generator=g)
    logits[0, 7] = logits[0, 9] = 100.0  # a tie: the first index wins in both paths
    logits[1, 11] = float("nan")  # NaN counts as the largest in both
    rows = [seq(PLAIN[i % len(PLAIN)]) for i in range(logits.shape[0])]
    assert all(r.plain_greedy for r in rows)
    fast = Sampler({EOS}).greedy_tokens(rows, logits.clone())
    full = [t.token_id for t in Sampler({EOS})(rows, logits.clone())]
    assert fast == full and fast[0] == 7 and fast[1] == 11


@pytest.mark.parametrize("params", NOT_PLAIN)
def test_one_row_that_needs_more_than_an_argmax_sends_the_batch_to_the_full_sampler(params) -> None:
    rows = [seq(SamplingParams(temperature=0)), seq(params)]
    assert not rows[1].plain_greedy
    assert Sampler({EOS}).greedy_tokens(rows, torch.stack([LOGITS, LOGITS])) is None


def test_a_constraint_sends_the_batch_to_the_full_sampler() -> None:
    s = seq(SamplingParams(temperature=0))
    s.constraint = OnlyEven()
    assert s.plain_greedy and Sampler({EOS}).greedy_tokens([s], LOGITS[None].clone()) is None
