"""MoE models through keepwarm's experts backends: greedy tokens identical to transformers in fp32.

transformers runs its own experts implementation; the engine runs the model's own router and keepwarm's
torch reference MoE (the backend `auto` picks on CPU). gpt-oss adds biased, interleaved, transposed
experts with the clamped SwiGLU (its tiny preset lowers the limit so the clamp bites) and attention sinks.
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine.moe.experts import IMPLEMENTATION, RUNNER_ATTR
from keepwarm_runtime.weights.serving_layout import is_experts_module
from tests.integration.engine.reference import transformers_greedy

NEW_TOKENS = 8
MOE_ARCHS = ["qwen3_moe", "deepseek_v3", "gpt_oss"]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (4, 13, 29, 40)]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_matches_transformers(make_tiny, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny(arch)
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=48)
    model = llm.engine.model
    experts = [m for m in model.modules() if is_experts_module(m)]
    assert experts and model.config._experts_implementation == IMPLEMENTATION
    assert all(getattr(m, RUNNER_ATTR, None) is not None for m in experts)
    assert set(llm.engine.moe_backends.values()) == {"torch"} and len(llm.engine.moe_backends) == len(experts)

    prompts = _prompts(llm.engine.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = transformers_greedy(reference, prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected
