"""On CUDA: the torch reference MoE and FlashInfer's CUTLASS fused MoE agree with the CPU reference.

The FlashInfer path has never run on a GPU before these tests: they are its first check (fc1 [up; gate]
order, per-expert swiglu_alpha/beta/limit, biases, FP8 block scales). Skipped without CUDA; FlashInfer
cases run only with KEEPWARM_GPU_FLASHINFER_MOE=1 (their first call compiles kernels for minutes; the
gpu-check step tests-flashinfer-moe sets it) and skip where the oracle refuses the device or
flashinfer-python is missing, with the oracle's reason.
"""

from __future__ import annotations

import os

import pytest
import torch

from keepwarm_runtime.engine.moe.activation import GatedActivation
from keepwarm_runtime.engine.moe.experts import layer_facts
from keepwarm_runtime.engine.moe.oracle import ELIGIBILITY
from keepwarm_runtime.engine.moe.reference import ExpertWeights, reference_moe
from keepwarm_runtime.weights.fp8 import quantize_blocks
from scripts.gpucheck.plan import FLASHINFER_MOE_OPT_IN

# Opt-in (its own gpu-check step, tests-flashinfer-moe, sets it): keeps the other pytest steps' budgets safe.
RUN_FLASHINFER_MOE = FLASHINFER_MOE_OPT_IN

E, H, INTER, T, K = 8, 256, 256, 64, 2
ACTS = {
    "swiglu": GatedActivation("swiglu"),
    "gpt_oss": GatedActivation("swiglu", alpha=1.702, beta=1.0, limit=0.75),
}


def _layer(biased: bool):
    g = torch.Generator().manual_seed(0)
    weights = ExpertWeights(
        torch.randn(E, 2 * INTER, H, generator=g) / H**0.5,
        torch.randn(E, H, INTER, generator=g) / INTER**0.5,
        gate_up_bias=torch.randn(E, 2 * INTER, generator=g) / 10 if biased else None,
        down_bias=torch.randn(E, H, generator=g) / 10 if biased else None,
    )
    hidden = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return weights, hidden, index, torch.rand(T, K, generator=g)


def _to(weights: ExpertWeights, device, dtype) -> ExpertWeights:
    moved = {k: (v.to(device, dtype) if isinstance(v, torch.Tensor) else v) for k, v in vars(weights).items()}
    return ExpertWeights(**moved)


@pytest.mark.parametrize("fp8", [False, True])
def test_torch_reference_on_cuda_matches_cpu(fp8) -> None:
    weights, hidden, index, scores = _layer(biased=False)
    if fp8:
        (gu, gs), (d, ds) = quantize_blocks(weights.gate_up), quantize_blocks(weights.down)
        weights = ExpertWeights(gu, d, gate_up_scale_inv=gs, down_scale_inv=ds)
    act = ACTS["gpt_oss"]
    cpu = reference_moe(hidden, index, scores, weights, act)
    moved = ExpertWeights(
        **{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(weights).items()}
    )
    gpu = reference_moe(hidden.cuda(), index.cuda(), scores.cuda(), moved, act)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("act_name", sorted(ACTS))
@pytest.mark.parametrize("biased", [False, True])
def test_flashinfer_cutlass_matches_reference(act_name, biased, fp8) -> None:
    from keepwarm_runtime.engine.moe import flashinfer_backend

    if os.environ.get(RUN_FLASHINFER_MOE) != "1":
        pytest.skip(
            f"set {RUN_FLASHINFER_MOE}=1: the first call JIT-compiles FlashInfer's fused MoE (minutes); "
            "scripts/gpu-check --only tests-flashinfer-moe sets it"
        )
    act = ACTS[act_name]
    weights, hidden, index, scores = _layer(biased)
    bf16 = _to(weights, "cuda", torch.bfloat16)
    if fp8:  # DeepSeek block scales on Hopper: the kernel also quantizes activations (1x128)
        (gu, gs), (d, ds) = quantize_blocks(bf16.gate_up), quantize_blocks(bf16.down)
        bf16 = ExpertWeights(gu, d, bf16.gate_up_bias, bf16.down_bias, gs, ds)
    ok, reason = ELIGIBILITY["flashinfer_cutlass"](layer_facts(bf16, act, torch.cuda.get_device_capability()))
    missing = flashinfer_backend.unavailable_reason()
    if not ok or missing:
        pytest.skip(missing or reason)
    run = flashinfer_backend.make_runner("flashinfer_cutlass", None, bf16, act)
    got = run(hidden.cuda().bfloat16(), index.cuda(), scores.cuda()).float().cpu()
    expected = reference_moe(hidden.cuda().bfloat16(), index.cuda(), scores.cuda(), bf16, act).float().cpu()
    error = float((got - expected).abs().max()) / float(expected.abs().max())
    assert error < (0.1 if fp8 else 3e-2), f"relative error {error:.3g}"
