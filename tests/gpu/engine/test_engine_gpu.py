"""On CUDA: keepwarm's greedy tokens against transformers', per attention backend.

The torch backend runs float32 on every tested architecture. FlashInfer has no float32 kernels and
only kernel head dims (64/128/256, ...), so it runs on models with head_dim 64 in float16, where
greedy parity holds as in float32 (measured on CPU with the torch backend: 8/8 sequences on every
architecture, against 5-7/8 in bfloat16, whose 7-bit mantissa flips near-ties within 8 tokens). In
bfloat16, the serving dtype, only the first token (the prefill's argmax) is held to parity, on Llama
(FlashInfer JIT-compiles each dtype/window/softcap variant on first use: seconds each on the GPU). Gemma 2
alternates sliding and full layers (window 16, softcapping), which the prompts (3 to 45 tokens, 8
more generated) exceed. DeepSeek-V3's tiny MLA head dims (qk 24, v 16) are no FlashInfer kernel
shape: torch backend only.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.engine.reference import transformers_greedy

ARCHS = ["llama", "gemma2", "deepseek_v3"]
FLASHINFER_ARCHS = ["llama", "gemma2"]
NEW_TOKENS = 8


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (3 + 6 * i,), generator=g).tolist() for i in range(8)]


def keepwarm_greedy(model_dir, backend: str, dtype: str) -> list[list[int]]:
    from keepwarm_runtime import LLM, SamplingParams

    llm = LLM(
        model_dir, device="cuda", dtype=dtype, attention_backend=backend, block_size=16, num_kv_blocks=64
    )
    assert llm.engine.attention_backend == backend
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    return [o.outputs[0].token_ids for o in outputs]


def reference(model_dir, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    return transformers_greedy(model, prompts(), NEW_TOKENS)


def agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_backend_matches_transformers_float32(gpu_model, arch, record_property) -> None:
    model_dir = gpu_model(arch)
    got, expected = keepwarm_greedy(model_dir, "torch", "float32"), reference(model_dir, torch.float32)
    record_property("agree", f"{agreeing(got, expected)}/{len(expected)}")
    # TF32/kernels may flip a rare near-tie on GPU; most sequences must agree exactly.
    assert agreeing(got, expected) >= len(expected) - 1, (got, expected)


@pytest.mark.parametrize("arch", FLASHINFER_ARCHS)
def test_flashinfer_matches_torch_backend_and_transformers_float16(gpu_model, arch, record_property) -> None:
    pytest.importorskip("flashinfer", reason="install keepwarm-runtime[gpu]")
    model_dir = gpu_model(arch)
    flashinfer = keepwarm_greedy(model_dir, "flashinfer", "float16")
    torch_backend = keepwarm_greedy(model_dir, "torch", "float16")
    expected = reference(model_dir, torch.float16)
    n = len(expected)
    record_property("agree_torch_backend", f"{agreeing(flashinfer, torch_backend)}/{n}")
    record_property("agree_transformers", f"{agreeing(flashinfer, expected)}/{n}")
    assert agreeing(flashinfer, torch_backend) >= n - 1, (flashinfer, torch_backend)
    assert agreeing(flashinfer, expected) >= n - 1, (flashinfer, expected)


def test_flashinfer_first_tokens_match_in_bfloat16(gpu_model, record_property) -> None:
    pytest.importorskip("flashinfer", reason="install keepwarm-runtime[gpu]")
    model_dir = gpu_model("llama")  # the throughput benchmark's kernels: no extra JIT build
    flashinfer = keepwarm_greedy(model_dir, "flashinfer", "bfloat16")
    expected = reference(model_dir, torch.bfloat16)
    n = len(expected)
    record_property("agree_transformers_whole", f"{agreeing(flashinfer, expected)}/{n}")
    first = sum(a[0] == b[0] for a, b in zip(flashinfer, expected, strict=True))
    assert first >= n - 1, (flashinfer, expected)
