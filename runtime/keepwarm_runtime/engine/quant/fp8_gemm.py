"""Block-scaled FP8 GEMM for dense layers: torch's `scaled_mm` on Hopper and newer, with a CPU twin.

The GPU path quantizes activations dynamically, one e4m3 scale per token per 128 columns (the
`activation_scheme: dynamic` of FP8 checkpoints), and calls `torch.nn.functional.scaled_mm` with
`BlockWise1x128` activation scales and the checkpoint's `BlockWise128x128` weight scales. Facts of
that API: the weight goes in as a column-major view (`w.t()`), activation scales `[M, K/128]` stored
column-major, weight scales as the `[K/128, N/128]` view of `weight_scale_inv.t()`; cuBLAS wants M and
the K-block count padded to multiples of 4. `emulate` computes the same quantized product with
dequantized operands, so the CPU tests pin the arithmetic; on a GPU, `Fp8Linear` checks the kernel
against it once per layer before trusting it (untested on GPU so far: a mismatch falls back to the
dequantizing reference and says so).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from keepwarm_runtime.weights.fp8 import BLOCK, E4M3, dequantize_blocks, quantize_blocks

MIN_CAPABILITY = (9, 0)  # block-scaled FP8 GEMM in cuBLAS: Hopper and newer


def quantize_activations(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` -> (e4m3 `[M, K]`, float32 scale_inv `[M, ceil(K/group)]`): one scale per token per group."""
    return quantize_blocks(x, (1, group))


def emulate(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What the kernel computes: quantized activations times quantized weights, accumulated in float32."""
    xq, xs = quantize_activations(x)
    a = dequantize_blocks(xq, xs, torch.float32, (1, BLOCK[1]))
    w = dequantize_blocks(weight, scale_inv, torch.float32, BLOCK)
    return (a @ w.T).to(dtype)


def kernel_ineligible(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `scaled_mm` cannot run this product, or None."""
    if x.device.type != "cuda":
        return "block-scaled FP8 GEMM needs CUDA"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return "this torch has no torch.nn.functional.scaled_mm"
    cap = torch.cuda.get_device_capability(x.device)
    if cap < MIN_CAPABILITY:
        return f"GPU capability {cap[0]}.{cap[1]} has no block-scaled FP8 GEMM (needs 9.0+)"
    rows, cols = weight.shape
    if rows % BLOCK[0] or cols % BLOCK[1]:
        return f"weight {rows}x{cols} is not whole 128x128 blocks"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations in {x.dtype}"
    return None


def scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`[M, K]` activations times an e4m3 `[N, K]` weight with 128x128 block scales, on the GPU."""
    m = x.shape[0]
    pad_m = -m % 4
    xp = F.pad(x, (0, 0, 0, pad_m)) if pad_m else x
    xq, xs = quantize_activations(xp)
    k_blocks = scale_inv.shape[1]
    pad_k = -k_blocks % 4
    ws = F.pad(scale_inv, (0, pad_k)) if pad_k else scale_inv
    xs = F.pad(xs, (0, pad_k)) if pad_k else xs
    out = F.scaled_mm(
        xq,
        weight.view(E4M3).t(),
        xs.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        ws.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=dtype,
    )
    return out[:m]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest expected magnitude."""
    return float((got.float() - expected.float()).abs().max()) / max(
        float(expected.float().abs().max()), 1e-6
    )


def checked_kernel(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, tolerance: float = 2e-2):
    """(True, why) when `scaled_mm` may serve this layer: eligible, runs, and agrees with `emulate` on
    `x`; else (False, why). Called once per layer, on its first CUDA input."""
    reason = kernel_ineligible(x, weight)
    if reason is not None:
        return False, reason
    try:
        got = scaled_mm(x, weight, scale_inv, x.dtype)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return False, f"scaled_mm failed ({type(exc).__name__}: {exc})"
    error = relative_error(got, emulate(x, weight, scale_inv, x.dtype))
    if error > tolerance:
        return False, f"scaled_mm disagrees with the emulation (relative error {error:.3g})"
    return True, f"scaled_mm agrees with the emulation (relative error {error:.3g})"
