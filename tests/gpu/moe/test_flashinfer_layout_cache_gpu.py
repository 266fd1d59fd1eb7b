"""On CUDA: FlashInfer's CUTLASS MoE served from a gpu-tier arena already in its layout, with no copy.

A gpu-tier daemon started with `--expert-layout flashinfer_cutlass` converts each MoE model's experts
once at load ([up; gate] fc1, FP8 scales alike); an engine asking `moe_backend="flashinfer_cutlass"`
and the same layout attaches them zero-copy (`copied_tensors == 0`: neither the loader nor the kernel
runner copies) and the kernel agrees with the torch reference on the first input (else the runner
logs a warning and serves the reference: failed here). The same kernel given converted experts and
model-layout ones (which it repacks) returns the same bits. CPU twin:
tests/integration/engine/test_moe_kernel_layout_cache.py. Untested where written (no GPU there):
scripts/gpu-check runs it in step tests-flashinfer-moe (opt-in: the kernels JIT-compile for minutes).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from keepwarm_runtime.engine.moe.reference import ExpertWeights
from keepwarm_runtime.weights.kernel_layout import up_first
from scripts.gpucheck.plan import FLASHINFER_MOE_OPT_IN
from tests.gpu.moe.arena import gpu_moe_daemon

pytestmark = pytest.mark.integration

CUTLASS = "flashinfer_cutlass"


def _require_kernel() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if os.environ.get(FLASHINFER_MOE_OPT_IN) != "1":
        pytest.skip(f"set {FLASHINFER_MOE_OPT_IN}=1 (FlashInfer's fused MoE JIT-compiles for minutes)")
    from keepwarm_runtime.engine.moe import flashinfer_backend

    missing = flashinfer_backend.unavailable_reason()
    if missing:
        pytest.skip(missing)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("CUTLASS FP8 block-scale MoE runs on Hopper only (oracle)")


@pytest.fixture(scope="module")
def converting_daemon(tmp_path_factory):
    _require_kernel()
    yield from gpu_moe_daemon(tmp_path_factory.mktemp("cutlass-layout-gpu"), "--expert-layout", CUTLASS)


def test_flashinfer_cutlass_from_a_converted_gpu_arena_is_zero_copy(converting_daemon, caplog) -> None:
    from keepwarm_runtime import LLM, SamplingParams

    model_dir, socket_dir = converting_daemon
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        device="cuda:0",
        moe_backend=CUTLASS,
        expert_layout=CUTLASS,
        num_kv_blocks=64,
        cache_socket_dir=str(socket_dir),
        cache_fallback=False,
    )
    info = llm.engine.load_info
    assert (info.source, info.copied_tensors) == ("cache", 0), info.reason
    assert info.moe and all(c.backend == CUTLASS and c.copied == 0 for c in info.moe)
    with caplog.at_level(logging.WARNING):
        out = llm.generate(
            {"prompt_token_ids": list(range(10, 40))}, SamplingParams(temperature=0, max_tokens=4)
        )
    assert len(out[0].outputs[0].token_ids) == 4
    assert not [r for r in caplog.records if "disagrees with the torch reference" in r.getMessage()]


@pytest.mark.parametrize("fp8", [False, True])
def test_flashinfer_cutlass_gives_the_same_bits_for_converted_and_repacked_experts(fp8) -> None:
    _require_kernel()
    from keepwarm_runtime.engine.moe import flashinfer_backend
    from keepwarm_runtime.engine.moe.activation import GatedActivation
    from keepwarm_runtime.weights.fp8 import quantize_blocks

    g = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 8, 256, 256, 64, 2
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).cuda().bfloat16()
    down = (torch.randn(e, h, inter, generator=g) / inter**0.5).cuda().bfloat16()
    scales = {}
    if fp8:
        (gate_up, gs), (down, ds) = quantize_blocks(gate_up), quantize_blocks(down)
        scales = {"gate_up_scale_inv": gs, "down_scale_inv": ds}
    model_layout = ExpertWeights(gate_up, down, **scales)
    converted = ExpertWeights(
        up_first(gate_up).contiguous(),
        down,
        gate_up_scale_inv=up_first(scales["gate_up_scale_inv"]).contiguous() if fp8 else None,
        down_scale_inv=scales.get("down_scale_inv"),
        up_first=True,
    )
    act = GatedActivation("swiglu", alpha=1.702, beta=1.0, limit=7.0)
    hidden = torch.randn(t, h, generator=g).cuda().bfloat16()
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
    scores = torch.rand(t, k, generator=g).cuda()
    repacked = flashinfer_backend.make_runner(CUTLASS, None, model_layout, act)(hidden, index, scores)
    as_is = flashinfer_backend.make_runner(CUTLASS, None, converted, act)(hidden, index, scores)
    assert torch.equal(repacked, as_is)
