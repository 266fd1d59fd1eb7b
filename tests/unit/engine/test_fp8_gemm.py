"""The block-scaled FP8 GEMM's CPU twin: activation quantization, the emulated product, the fallback rule."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from keepwarm_runtime.engine.quant import fp8_gemm
from keepwarm_runtime.engine.quant.fp8_modules import Fp8Linear
from keepwarm_runtime.weights.fp8 import dequantize_blocks, quantize_blocks


def test_activation_scales_are_per_token_per_128_columns() -> None:
    x = torch.randn(5, 300)
    x[2, 128:256] *= 1000  # one token's second group is much larger: only its scale changes
    q, s = fp8_gemm.quantize_activations(x)
    assert s.shape == (5, 3)
    assert s[2, 1] > 100 * s[2, 0] and s[2, 1] > 100 * s[1, 1]
    back = dequantize_blocks(q, s, torch.float32, (1, 128))
    assert torch.all((back - x).abs() <= x.abs() * 2.0**-4 + s.repeat_interleave(128, 1)[:, :300] * 2.0**-9)


def test_emulation_is_the_product_of_quantized_operands() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(7, 256), torch.randn(384, 256) / 16
    wq, ws = quantize_blocks(w)
    xq, xs = fp8_gemm.quantize_activations(x)
    direct = dequantize_blocks(xq, xs, torch.float32, (1, 128)) @ dequantize_blocks(wq, ws, torch.float32).T
    torch.testing.assert_close(fp8_gemm.emulate(x, wq, ws, torch.float32), direct)
    # activation quantization costs accuracy, but stays within e4m3's relative precision of the exact product
    exact = x @ dequantize_blocks(wq, ws, torch.float32).T
    assert fp8_gemm.relative_error(direct, exact) < 0.05


def test_cpu_uses_the_dequantizing_reference_and_names_why() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(256, 128, bias=True)
    q, s = quantize_blocks(linear.weight.detach())
    ok, why = fp8_gemm.checked_kernel(torch.randn(3, 256), q, s)
    assert not ok and "needs CUDA" in why
    linear.__class__ = Fp8Linear
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.weight_scale_inv = nn.Parameter(s, requires_grad=False)
    x = torch.randn(2, 3, 256)
    expected = F.linear(x, dequantize_blocks(q, s, torch.float32), linear.bias)
    torch.testing.assert_close(linear(x), expected)
    assert linear.gpu_kernel is None  # never decided on CPU


def test_partial_blocks_are_not_for_the_kernel() -> None:
    weight = torch.zeros(200, 256, dtype=torch.float8_e4m3fn)
    assert "needs CUDA" in fp8_gemm.kernel_ineligible(torch.zeros(1, 256), weight)
