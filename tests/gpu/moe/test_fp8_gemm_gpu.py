"""On CUDA (Hopper and newer): torch's block-scaled scaled_mm against the CPU-tested emulation.

Untested on GPU before this file ran; Fp8Linear only trusts the kernel after the same comparison.
"""

from __future__ import annotations

import pytest
import torch

from keepwarm_runtime.engine.quant import fp8_gemm
from keepwarm_runtime.weights.fp8 import quantize_blocks


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_scaled_mm_matches_emulation(tokens) -> None:
    torch.manual_seed(0)
    w = torch.randn(384, 512, device="cuda") / 20
    wq, ws = quantize_blocks(w)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    reason = fp8_gemm.kernel_ineligible(x, wq)
    if reason is not None:
        pytest.skip(reason)
    got = fp8_gemm.scaled_mm(x, wq, ws, torch.bfloat16)
    assert got.shape == (tokens, 384)
    assert fp8_gemm.relative_error(got, fp8_gemm.emulate(x, wq, ws, torch.bfloat16)) < 2e-2
    ok, why = fp8_gemm.checked_kernel(x, wq, ws)
    assert ok, why
