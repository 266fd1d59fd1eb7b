"""Greedy parity with transformers generate(), per architecture, single prompt and a batch of 16.

The engine runs the batch with small blocks and a small token budget, so prefill is chunked and
decode steps mix with prefill chunks; transformers runs each prompt alone (no padding effects).
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from tests.engine_architectures import ENGINE_ARCHS
from tests.integration.engine.reference import transformers_greedy

NEW_TOKENS = 8


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 37 for i in range(count)]  # 3..39 tokens: crosses the 16-token windows
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return transformers_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_greedy_matches_transformers(make_tiny, arch: str) -> None:
    model_dir = make_tiny(arch)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=96)
    prompts = _prompts(16, llm.engine.vocab_size, seed=len(arch))
    expected = _reference(model_dir, prompts)
    # min_tokens masks EOS exactly like min_new_tokens does in transformers.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

    single = llm.generate({"prompt_token_ids": prompts[-1]}, params)
    assert single[0].outputs[0].token_ids == expected[-1]

    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [out.outputs[0].token_ids for out in batch]
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatched, (
        f"{arch}: prompts {mismatched} differ: {got[mismatched[0]]} != {expected[mismatched[0]]}"
    )
    assert all(out.outputs[0].finish_reason == "length" for out in batch)
