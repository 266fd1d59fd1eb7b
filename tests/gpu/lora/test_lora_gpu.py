"""LoRA on CUDA: PEFT's greedy tokens in fp32 from a mixed batch, adapters read from disk and attached
from a gpu-tier node cache (the adapter's arena stays on the GPU; slots copy from it).

The CPU twin is tests/integration/engine/test_lora.py (exact PEFT identity, alone, mixed, evicted and
reloaded) and tests/integration/server/test_server_lora_cache.py (through a host-tier daemon). Here
the tolerance is the GPU engine tests': CUDA's fp32 matmuls sum in another order than the CPU
reference, so a near-tie may flip a late token; most sequences must match whole. Prepared without a GPU
(scripts/gpu-check runs it in step tests-gpu-other); untested on GPU until that step passes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from keepwarm_runtime import LLM, SamplingParams
from keepwarm_runtime.cache.launcher import DaemonProcess
from keepwarm_runtime.engine.llm import LoRARequest
from tests.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.integration

NEW_TOKENS = 6
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ADAPTERS = {
    "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all": {
        "r": 16,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """The base, its adapters, prompts, and PEFT's tokens per adapter (None: the base), on the CPU."""
    from keepwarm_runtime.modelgen import make_model

    root = tmp_path_factory.mktemp("lora-gpu")
    model_dir = make_model(root / "base", arch="llama", params="6M", dtype="float32", vocab_size=2048)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=i, **config)
        for i, (name, config) in enumerate(ADAPTERS.items())
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (5 + 4 * i,), generator=g).tolist() for i in range(3)]
    expected = {n: peft_greedy(model_dir, adapters.get(n), prompts, NEW_TOKENS) for n in [None, *adapters]}
    return model_dir, adapters, prompts, expected


def mixed(llm: LLM, adapters: dict[str, Path], prompts: list[list[int]]) -> dict[tuple, list[int]]:
    """Every prompt under every adapter and the base, interleaved in one generate()."""
    lora = {None: None} | {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    order = [(name, i) for i in range(len(prompts)) for name in lora]
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for _, i in order], PARAMS, lora_request=[lora[n] for n, _ in order]
    )
    return {key: o.outputs[0].token_ids for key, o in zip(order, outs, strict=True)}


def engine(model_dir: Path, socket_dir: Path | None = None) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        device="cuda:0",
        attention_backend="torch",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        cache_socket_dir=None if socket_dir is None else str(socket_dir),
        cache_fallback=False,
    )


def test_mixed_batch_matches_peft_on_cuda(setup, record_property) -> None:
    model_dir, adapters, prompts, expected = setup
    got = mixed(engine(model_dir), adapters, prompts)
    same = sum(tokens == expected[name][i] for (name, i), tokens in got.items())
    record_property("sequences_identical", f"{same}/{len(got)}")
    assert same >= len(got) - 1, f"{same}/{len(got)} sequences match PEFT"


def test_adapters_attached_from_a_gpu_tier_daemon_serve_the_same_tokens(setup) -> None:
    """The daemon holds the base and each adapter in CUDA VMM arenas; the engine attaches the base and
    registers views of the adapters' (no disk read: fallback off) and generates exactly what the
    disk-read engine generates."""
    model_dir, adapters, prompts, _ = setup
    root = Path(tempfile.mkdtemp(prefix="kw-lora-"))  # short: the socket is named after the GPU's UUID
    cached = [arg for path in adapters.values() for arg in ("--adapter", str(path))]
    daemon = DaemonProcess(
        root / "wc", [model_dir], "--device", "cuda:0", "--dtype", "float32", *cached, tier="gpu"
    ).wait_ready()
    try:
        llm = engine(model_dir, root / "wc")
        weights = llm.engine.add_lora("probe", str(adapters["all"]))
        assert weights.source == "cache", weights.reason
        assert next(iter(weights.modules.values()))[0].device.type == "cuda"
        llm.engine.remove_lora("probe")
        assert mixed(llm, adapters, prompts) == mixed(engine(model_dir), adapters, prompts)
    finally:
        daemon.terminate(60)
        shutil.rmtree(root, ignore_errors=True)
