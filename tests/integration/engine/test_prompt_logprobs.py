"""Prompt logprobs equal transformers' log-softmax of its own forward pass (fp32, within 1e-4), whole or in
chunks, after a prefix-cache hit, after preemption, and with max_tokens=0 (scoring only)."""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.engine import scheduler as scheduler_module
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.llm_engine import LLMEngine

TOP = 3
TOL = 1e-4


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(10, 2000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-softmax over each prompt's positions [len - 1, vocab], each prompt alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1) for p in prompts]


def assert_matches(output, ref: torch.Tensor, top: int = TOP) -> None:
    ids = output.prompt_token_ids
    scored = output.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    for position, (token, entry) in enumerate(zip(ids[1:], scored[1:], strict=True)):
        row = ref[position]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        values, top_ids = row.topk(top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), top_ids.tolist(), strict=True), start=1):
            assert entry[tid].logprob == pytest.approx(value, abs=TOL)
            assert entry[tid].rank == rank or tid == token
        assert set(entry) <= {token, *top_ids.tolist()}
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral", "opt"])
def test_prompt_logprobs_equal_transformers(make_tiny, arch) -> None:
    model_dir = make_tiny(arch)
    prompts = [prompt(23, 1), prompt(9, 2), prompt(40, 3)]
    llm = LLM(model_dir, block_size=4, num_kv_blocks=128)
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [asked, SamplingParams(max_tokens=2), asked]
    )
    refs = reference(model_dir, prompts)
    assert_matches(outputs[0], refs[0])
    assert_matches(outputs[2], refs[2])
    assert outputs[1].prompt_logprobs is None


def test_chunked_prefill_and_a_small_scoring_budget(make_tiny, monkeypatch) -> None:
    model_dir = make_tiny("llama")
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGITS_PER_STEP", 7)
    prompts = [prompt(30, 4), prompt(17, 5), prompt(25, 6)]
    llm = LLM(model_dir, block_size=4, num_kv_blocks=128, max_num_batched_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, ref in zip(outputs, reference(model_dir, prompts), strict=True):
        assert_matches(output, ref)
        assert len(output.outputs[0].token_ids) == 3


def test_a_prefix_cache_hit_does_not_skip_scored_positions(make_tiny) -> None:
    model_dir = make_tiny("llama")
    shared = prompt(26, 7)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=128)
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate({"prompt_token_ids": shared}, plain)[0].num_cached_tokens == 0
    cached = llm.generate({"prompt_token_ids": shared}, plain)[0]
    assert cached.num_cached_tokens >= 20  # the prefix cache holds the prompt
    scored = llm.generate(
        {"prompt_token_ids": shared}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    )[0]
    assert scored.num_cached_tokens == 0
    assert_matches(scored, reference(model_dir, [shared])[0])
    assert scored.outputs[0].token_ids == cached.outputs[0].token_ids


def test_preemption_recomputes_without_duplicates(make_tiny) -> None:
    model_dir = make_tiny("llama")
    prompts = [prompt(12 + i, 10 + i) for i in range(8)]
    tight = LLM(model_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=TOP, ignore_eos=True)
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert tight.engine.stats().num_preemptions > 0
    for output, ref in zip(outputs, reference(model_dir, prompts), strict=True):
        assert_matches(output, ref)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_tiny) -> None:
    model_dir = make_tiny("llama")
    ids = prompt(15, 11)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64)
    output = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert (
        output.finished and output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    )
    assert_matches(output, reference(model_dir, [ids])[0], top=0)
    assert llm.engine.stats().kv_cache_usage == 0


def test_limits_are_refused_by_name(make_tiny) -> None:
    engine = LLMEngine(EngineConfig(str(make_tiny("llama")), num_kv_blocks=16, max_prompt_logprobs_len=10))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("long", prompt(11, 12), SamplingParams(prompt_logprobs=1))
    engine.add_request("short", prompt(10, 12), SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
    assert not engine.requests.get("long")


def test_n_completions_share_one_scored_prompt(make_tiny) -> None:
    model_dir = make_tiny("llama")
    ids = prompt(18, 13)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=128)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert [len(o.token_ids) for o in output.outputs] == [4, 4, 4]
    assert_matches(output, reference(model_dir, [ids])[0], top=1)
