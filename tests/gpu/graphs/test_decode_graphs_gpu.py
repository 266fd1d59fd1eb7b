"""On CUDA: decode steps replayed from CUDA graphs (engine/decode_graphs.py) against the same engine with
--enforce-eager, on FlashInfer (float16, head_dim 64, as test_engine_gpu.py's FlashInfer cases).

Captured buckets must give the eager engine's greedy tokens (the same kernels, replayed); a batch of 5
pads to the bucket of 8 (its padding rows on the reserved KV block), and batches shrink through the
buckets as sequences finish. Gemma 2's alternating windows need two attention plans a pass, which no
graph holds: every bucket falls back to eager, and the tokens are still the eager engine's. Steps are
overlapped by default on CUDA (engine/overlap.py): the same tokens as steps one at a time, greedy
and seeded. Buckets captured by an idle engine, on padding rows alone, serve the same tokens. The
CPU twins run in tests/integration/engine/test_decode_graphs.py and test_overlap.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(model_dir, eager: bool, overlap: bool | None = None):
    """``overlap``: the engine's async_scheduling (None: its default, on for CUDA: engine/overlap.py)."""
    from keepwarm_runtime import LLM

    return LLM(
        model_dir,
        device="cuda",
        dtype="float16",
        attention_backend="flashinfer",
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=16,
        enforce_eager=eager,
        async_scheduling=overlap,
    )


def generate(llm, batch: int, temperature: float = 0.0) -> list[list[int]]:
    """Tokens of ``batch`` requests of different lengths (seeded when sampled)."""
    from keepwarm_runtime import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(10, 2000, (3 + 5 * i,), generator=g).tolist()}
        for i in range(batch)
    ]
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=6 + 3 * i, ignore_eos=True)
        for i in range(batch)
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def run(model_dir, eager: bool, batch: int, overlap: bool | None = None, temperature: float = 0.0):
    """The tokens of a fresh engine, and its graphs."""
    llm = make(model_dir, eager, overlap)
    return generate(llm, batch, temperature), llm.engine.runner.graphs


@pytest.mark.parametrize("batch", [5, 8])
def test_flashinfer_decode_graphs_give_the_eager_tokens(gpu_model, batch) -> None:
    """Eager steps one at a time against graphs with overlapped steps (the default) and graphs one at a
    time: an overlapped decode reads its input token on the device from the step not yet landed."""
    model_dir = gpu_model("llama")
    want, none = run(model_dir, eager=True, batch=batch, overlap=False)
    assert none is None
    got, graphs = run(model_dir, eager=False, batch=batch)
    assert graphs is not None and not graphs.eager, graphs and graphs.eager
    captured = {size for size, entry in graphs.buckets.items() if entry.graph is not None}
    assert 8 in captured and graphs.replays > 0
    assert got == want
    assert run(model_dir, eager=False, batch=batch, overlap=False)[0] == want


def test_seeded_sampling_overlapped_gives_the_tokens_of_steps_one_at_a_time(gpu_model) -> None:
    """The full sampler's path ahead of landing (its tokens copied to the device for the next step)."""
    model_dir = gpu_model("llama")
    want, _ = run(model_dir, eager=True, batch=5, overlap=False, temperature=0.8)
    assert run(model_dir, eager=False, batch=5, temperature=0.8)[0] == want


def test_buckets_captured_while_idle_serve_the_eager_tokens(gpu_model) -> None:
    """Every bucket captured by an idle engine (``work_while_idle``: padding rows alone, on the reserved
    block, FlashInfer planned over it), then replayed with real page tables."""
    model_dir = gpu_model("llama")
    want, _ = run(model_dir, eager=True, batch=5, overlap=False)
    llm = make(model_dir, eager=False)
    while llm.engine.work_while_idle():
        pass
    graphs = llm.engine.runner.graphs
    assert not graphs.eager and all(entry.graph is not None for entry in graphs.buckets.values())
    assert set(graphs.buckets) == set(graphs.sizes)
    assert generate(llm, 5) == want and graphs.replays > 0


def test_gemma2_alternating_windows_run_eagerly_with_the_same_tokens(gpu_model) -> None:
    model_dir = gpu_model("gemma2")
    want, _ = run(model_dir, eager=True, batch=4)
    got, graphs = run(model_dir, eager=False, batch=4)
    assert graphs.eager == set(graphs.sizes) and graphs.replays == 0
    assert got == want
