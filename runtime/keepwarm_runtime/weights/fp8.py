"""FP8 e4m3 block quantization: the DeepSeek-V3 / Hugging Face `fp8` checkpoint format, as pure functions.

A weight `[..., N, K]` is stored as e4m3 values plus `weight_scale_inv` `[..., ceil(N/bn), ceil(K/bk)]`
in float32, one scale per (bn x bk) block (128x128 in every released checkpoint), with
`weight ~= e4m3 * weight_scale_inv` block by block. Edge blocks may be partial (DeepSeek-V3's
`kv_a_proj_with_mqa` has 576 rows = 4.5 blocks). Per-tensor FP8 is the special case of one block.
Quantization multiplies by 448 / amax (448: e4m3's largest finite value; 1 for an all-zero block) and
stores its reciprocal, as transformers' own `Fp8Quantize` does, so online quantization gives the same
bytes as a checkpoint quantized there.
"""

from __future__ import annotations

import torch

from keepwarm_runtime.weights.quantization import BLOCK

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def expand_scales(scale_inv: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales `[..., R, C]` -> per-element `[..., rows, cols]` (edge blocks cropped)."""
    rows, cols = shape[-2], shape[-1]
    if scale_inv.shape[-2:] != _grid(rows, cols, block):
        raise ValueError(
            f"scale grid {tuple(scale_inv.shape[-2:])} does not fit a {rows}x{cols} weight in "
            f"{block[0]}x{block[1]} blocks (expected {_grid(rows, cols, block)})"
        )
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., N, K]` float -> (e4m3 `[..., N, K]`, float32 scale_inv `[..., ceil(N/bn), ceil(K/bk)]`)."""
    if weight.ndim < 2:
        raise ValueError(
            f"only matrices (or stacks of them) are block-quantized, got shape {tuple(weight.shape)}"
        )
    rows, cols = weight.shape[-2:]
    grid_r, grid_c = _grid(rows, cols, block)
    w = weight.to(torch.float32)
    pad = (0, grid_c * block[1] - cols, 0, grid_r * block[0] - rows)
    tiles = (
        torch.nn.functional.pad(w, pad).unflatten(-1, (grid_c, block[1])).unflatten(-3, (grid_r, block[0]))
    )
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., grid_r, grid_c]
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    q = (w * expand_scales(scale, w.shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, 1.0 / scale


def dequantize_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    """e4m3 `[..., N, K]` and its block scales -> `dtype` (products taken in float32, rounded once)."""
    rows, cols = q.shape[-2:]
    scale = scale_inv.to(torch.float32)
    if rows % block[0] or cols % block[1]:  # edge blocks: expand the scales to every element
        return (q.to(torch.float32) * expand_scales(scale, q.shape, block)).to(dtype)
    if scale.shape[-2:] != _grid(rows, cols, block):
        expand_scales(scale, q.shape, block)  # raises, naming the mismatch
    # Whole blocks: view the weight as [..., R, bn, C, bk] and broadcast one scale per block.
    tiles = (
        q.to(torch.float32)
        .unflatten(-1, (cols // block[1], block[1]))
        .unflatten(-3, (rows // block[0], block[0]))
    )
    return (tiles * scale[..., :, None, :, None]).reshape(q.shape).to(dtype)


def dequantize_gate_up(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    halves_apart: bool,
    block: tuple[int, int] = BLOCK,
) -> torch.Tensor:
    """A fused `[..., 2I, H]` gate/up weight. Quantized as one tensor (online), one grid covers all 2I
    rows; concatenated from per-expert checkpoint tensors (`halves_apart`), each half has its own grid,
    which differs from one grid when I % 128 != 0 (and the shapes alone cannot always tell)."""
    if not halves_apart:
        return dequantize_blocks(q, scale_inv, dtype, block)
    half_rows, cols = q.shape[-2] // 2, q.shape[-1]
    half_grid = _grid(half_rows, cols, block)[0]
    gate = dequantize_blocks(q[..., :half_rows, :], scale_inv[..., :half_grid, :], dtype, block)
    up = dequantize_blocks(q[..., half_rows:, :], scale_inv[..., half_grid:, :], dtype, block)
    return torch.cat([gate, up], dim=-2)
