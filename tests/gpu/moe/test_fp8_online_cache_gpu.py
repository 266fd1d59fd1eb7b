"""On CUDA: a gpu-tier daemon quantizes a float MoE checkpoint online; the engine attaches it zero-copy.

The daemon quantizes on the CPU and copies into its CUDA arena; the engine's disk path quantizes on
the GPU. The test asks whether both give the same bits (IEEE division and the e4m3 cast, rounded to
nearest even on both devices), and whether the FP8 model then generates. Untested where written
(no GPU there): scripts/gpu-check runs it (step tests-gpu-other).
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.loader import load_model
from tests.gpu.moe.arena import gpu_moe_daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quantizing_daemon(tmp_path_factory):
    yield from gpu_moe_daemon(tmp_path_factory.mktemp("fp8-online-gpu"), "--quantization", "fp8")


def _load(model, socket_dir):
    config = EngineConfig(
        str(model),
        dtype="bfloat16",
        device="cuda:0",
        quantization="fp8",
        # The arena is what is tested here: a FlashInfer runner's repack of model-layout experts would
        # count in copied_tensors (the converted layout: test_flashinfer_layout_cache_gpu.py).
        moe_backend="torch",
        cache_socket_dir=str(socket_dir) if socket_dir else None,
        cache_fallback=False,
    )
    return load_model(config)


def test_online_fp8_gpu_tier_attaches_zero_copy_with_the_disk_paths_bits(quantizing_daemon) -> None:
    model_dir, socket_dir = quantizing_daemon
    cached, info = _load(model_dir, socket_dir)
    disk, _ = _load(model_dir, None)
    assert (info.source, info.copied_tensors) == ("cache", 0), info.reason
    sc, sd = cached.state_dict(), disk.state_dict()
    assert sc.keys() == sd.keys()
    differing = [
        name
        for name in sc
        if sc[name].dtype != sd[name].dtype
        or not torch.equal(sc[name].reshape(-1).view(torch.uint8), sd[name].reshape(-1).view(torch.uint8))
    ]
    assert differing == [], f"CPU (daemon) and CUDA (disk path) quantization differ: {differing[:6]}"
    experts = cached.model.layers[0].mlp.experts
    assert experts.gate_up_proj.is_cuda and experts.gate_up_proj.dtype == torch.float8_e4m3fn


def test_online_fp8_from_the_gpu_tier_generates_what_the_disk_path_does(quantizing_daemon) -> None:
    from keepwarm_runtime import LLM, SamplingParams

    model_dir, socket_dir = quantizing_daemon
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=5)
    outs = []
    for where in (socket_dir, None):
        llm = LLM(model_dir, **_gpu_fp8_engine(where))
        assert llm.engine.load_info.source == ("cache" if where else "disk")
        outs.append(llm.generate({"prompt_token_ids": list(range(10, 40))}, params)[0].outputs[0])
        del llm
    assert outs[0].token_ids == outs[1].token_ids


def test_a_prefetch_attaches_the_gpu_tier_arena_the_engine_takes(quantizing_daemon) -> None:
    """`keepwarm serve --device cuda:0 --quantization fp8`: the background attach (engine/prefetch.py)
    asks the gpu-tier daemon for the quantized arena before the engine exists, and the engine takes
    it. Untested on GPU (written without one); the CPU twin is test_fp8_online_cache.py's prefetch test."""
    from keepwarm_runtime import SamplingParams
    from keepwarm_runtime.engine.llm_engine import LLMEngine
    from tests.integration.engine.strict import prefetched_engine, served

    model_dir, socket_dir = quantizing_daemon

    def config(where) -> EngineConfig:
        return EngineConfig(str(model_dir), moe_backend="torch", **_gpu_fp8_engine(where))

    prompt, params = list(range(10, 40)), SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    engine = prefetched_engine(config(socket_dir))
    info = engine.load_info
    assert engine.startup.weights_prefetched and (info.source, info.copied_tensors) == ("cache", 0)
    got = served(engine, prompt, params)
    del engine
    assert got.token_ids == served(LLMEngine(config(None)), prompt, params).token_ids


def _gpu_fp8_engine(socket_dir) -> dict:
    """The engine settings of these comparisons: online FP8 on cuda:0, from ``socket_dir``'s gpu-tier
    daemon or from disk."""
    return {
        "dtype": "bfloat16",
        "device": "cuda:0",
        "quantization": "fp8",
        "num_kv_blocks": 64,
        "cache_socket_dir": str(socket_dir) if socket_dir else None,
        "cache_fallback": False,
    }
