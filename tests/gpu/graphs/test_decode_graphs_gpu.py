"""On CUDA: decode steps replayed from CUDA graphs (engine/decode_graphs.py) against the same engine with
--enforce-eager, on FlashInfer (float16, head_dim 64, as test_engine_gpu.py's FlashInfer cases).

Captured buckets must give the eager engine's greedy tokens (the same kernels, replayed); a batch of 5
pads to the bucket of 8 (its padding rows on the reserved KV block), and batches shrink through the
buckets as sequences finish. Gemma 2's alternating windows need two attention plans a pass, which no
graph holds: every bucket falls back to eager, and the tokens are still the eager engine's. The CPU
twin of all of it runs in tests/integration/engine/test_decode_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(model_dir, eager: bool, batch: int):
    from keepwarm_runtime import LLM, SamplingParams

    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float16",
        attention_backend="flashinfer",
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=16,
        enforce_eager=eager,
    )
    g = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(10, 2000, (3 + 5 * i,), generator=g).tolist()}
        for i in range(batch)
    ]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(batch)]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.engine.runner.graphs


@pytest.mark.parametrize("batch", [5, 8])
def test_flashinfer_decode_graphs_give_the_eager_tokens(gpu_model, batch) -> None:
    model_dir = gpu_model("llama")
    want, none = run(model_dir, eager=True, batch=batch)
    assert none is None
    got, graphs = run(model_dir, eager=False, batch=batch)
    assert graphs is not None and not graphs.eager, graphs and graphs.eager
    captured = {size for size, entry in graphs.buckets.items() if entry.graph is not None}
    assert 8 in captured and graphs.replays > 0
    assert got == want


def test_gemma2_alternating_windows_run_eagerly_with_the_same_tokens(gpu_model) -> None:
    model_dir = gpu_model("gemma2")
    want, _ = run(model_dir, eager=True, batch=4)
    got, graphs = run(model_dir, eager=False, batch=4)
    assert graphs.eager == set(graphs.sizes) and graphs.replays == 0
    assert got == want
