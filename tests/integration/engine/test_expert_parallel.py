"""MoE models on 2 ranks (engine/parallel, CPU with gloo): experts partitioned (expert parallel) or split.

float32: greedy tokens identical to transformers' on the conformance prompts, for Qwen3-MoE,
DeepSeek-V3 (shared experts, grouped routing) and gpt-oss (biased, interleaved, transposed experts),
with ``enable_expert_parallel`` (each rank runs the experts it holds for the pairs routed to them) and
without (each rank runs its slice of every expert).

FP8 (e4m3, 128x128 block scales), Qwen3-MoE shaped so that every split falls on block boundaries: an
FP8 checkpoint and online quantization, each on 2 ranks against one rank of the same: tokens
identical and top-20 logprobs within 1e-4 nats (test_fp8's tolerance for keepwarm's FP8 against
transformers' FP8 path; measured here: identical bytes per slice, so the difference is the all-reduce's
summation order). A split off the block boundaries is refused, naming the weight, before any rank starts.
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.loader import ModelLoadError
from keepwarm_runtime.engine.moe.experts import RUNNER_ATTR
from keepwarm_runtime.weights.fp8 import E4M3
from tests.integration.engine.fp8_pairs import bf16_and_fp8
from tests.integration.engine.reference import transformers_greedy
from tests.integration.engine.shapes import WHOLE_BLOCKS
from tests.sweep.judge import conditions

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
MOE_ARCHS = ["qwen3_moe", "deepseek_v3", "gpt_oss"]
FP8_TOLERANCE = 1e-4  # nats
# Whole 128-blocks on each of 2 ranks: q/k/v 256 rows (128 each), o_proj 256 columns, experts'
# intermediate 256 (128 each when split), hidden 256.
TWO_RANK_BLOCKS = WHOLE_BLOCKS | {
    "hidden_size": 256,
    "head_dim": 64,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
}


def _prompts() -> list[list[int]]:
    short, long = conditions()[:2]
    return [list(p) for p in (*short.prompts, *long.prompts)]


def _generate(llm: LLM, prompts: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


# `make test` runs experts partitioned on the first architecture; `make test-extended` every case
MOE_CASES = [
    pytest.param(
        arch,
        expert,
        id=f"{arch}-{'expert-parallel' if expert else 'split-experts'}",
        marks=() if (arch, expert) == (MOE_ARCHS[0], True) else pytest.mark.extended,
    )
    for arch in MOE_ARCHS
    for expert in (True, False)
]


@pytest.mark.parametrize(("arch", "expert"), MOE_CASES)
def test_moe_on_two_ranks_gives_transformers_tokens(make_tiny, arch: str, expert: bool) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny(arch)
    prompts = _prompts()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = transformers_greedy(reference, prompts, NEW_TOKENS)
    llm = LLM(
        model_dir,
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=48,
        tensor_parallel_size=2,
        enable_expert_parallel=expert,
    )
    try:
        held = next(m for m in llm.engine.model.modules() if hasattr(m, RUNNER_ATTR)).gate_up_proj.shape
        whole = next(m for m in reference.modules() if hasattr(m, "gate_up_proj")).gate_up_proj.shape
        assert held.numel() * 2 == whole.numel()  # each rank holds half of the experts' weights
        if expert:  # half of the experts, each whole
            assert held[0] * 2 == whole[0] and held[1:] == whole[1:]
        else:  # every expert, half of its intermediate size
            assert held[0] == whole[0]
        got = [o.token_ids for o in _generate(llm, prompts)]
    finally:
        llm.close()
    assert got == expected


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory) -> dict[str, object]:
    made = {}
    for name, shape in (("aligned", TWO_RANK_BLOCKS), ("one-rank-blocks", WHOLE_BLOCKS)):
        made[name], made[f"{name}-fp8"] = bf16_and_fp8(tmp_path_factory, name, "qwen3_moe", **shape)
    return made


def _fp8_pair(model_dir, **settings) -> tuple[list, list]:
    """(one rank's outputs, two ranks') with top-20 logprobs."""
    kwargs = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, **settings}
    prompts = _prompts()
    one = _generate(LLM(model_dir, **kwargs), prompts, logprobs=20)
    two = LLM(model_dir, tensor_parallel_size=2, **kwargs)
    try:
        assert any(p.dtype == E4M3 for p in two.engine.model.parameters()), "no e4m3 weights"
        return one, _generate(two, prompts, logprobs=20)
    finally:
        two.close()


def _assert_close(one: list, two: list) -> None:
    worst = 0.0
    for want, got in zip(one, two, strict=True):
        assert got.token_ids == want.token_ids
        for want_step, got_step in zip(want.logprobs, got.logprobs, strict=True):
            shared = want_step.keys() & got_step.keys()
            assert len(shared) >= 18  # a top-20 that differs in more than its tail is no match
            worst = max(worst, *(abs(want_step[t].logprob - got_step[t].logprob) for t in shared))
    assert worst <= FP8_TOLERANCE


@pytest.mark.parametrize(
    "expert",
    [
        pytest.param(True, id="expert-parallel"),
        pytest.param(False, id="split-experts", marks=pytest.mark.extended),
    ],
)
def test_fp8_checkpoint_on_two_ranks_matches_one_rank(fp8_checkpoints, expert: bool) -> None:
    one, two = _fp8_pair(fp8_checkpoints["aligned-fp8"], enable_expert_parallel=expert)
    _assert_close(one, two)


@pytest.mark.extended
def test_online_fp8_on_two_ranks_matches_one_rank(fp8_checkpoints) -> None:
    one, two = _fp8_pair(fp8_checkpoints["aligned"], quantization="fp8", enable_expert_parallel=True)
    _assert_close(one, two)


def test_an_fp8_split_off_block_boundaries_is_refused_naming_the_weight(fp8_checkpoints) -> None:
    # hidden 128, expert intermediate 128: each rank would hold half a 128-block of the first weight
    refusal = r"model\.layers\.0\.\S+: dimension \d \(128\) does not divide over 2 .* in whole units of 128"
    with pytest.raises(ModelLoadError, match=refusal):
        LLM(fp8_checkpoints["one-rank-blocks-fp8"], dtype="float32", tensor_parallel_size=2)
