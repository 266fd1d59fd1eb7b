"""The torch reference MoE: tokens grouped by expert, FP8 blocks dequantized per expert, one matmul pair each.

Runs on CPU and GPU, for every weight format keepwarm loads; it is the backend `auto` falls back to
and the one the FlashInfer kernels are checked against. Weights are read in the layout the model
holds them (no copy): `[E, 2I, H]` / `[E, H, I]` (out x in), or transposed `[E, H, 2I]` / `[E, I, H]`
(gpt-oss); FP8 weights carry float32 block scales over their (out, in) axes. Experts in the
`flashinfer_cutlass` layout (weights.kernel_layout: gate_up rows, scales and bias with the up half
first) are read back in gate-first order, one expert at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keepwarm_runtime.engine.moe.activation import GatedActivation, apply_gated
from keepwarm_runtime.weights.fp8 import BLOCK, E4M3, dequantize_blocks, dequantize_gate_up


@dataclass
class ExpertWeights:
    """One layer's experts, as views of the model's parameters."""

    gate_up: torch.Tensor  # [E, 2I, H], or [E, H, 2I] when transposed
    down: torch.Tensor  # [E, H, I], or [E, I, H] when transposed
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]
    gate_up_scale_inv: torch.Tensor | None = None  # FP8: block scales over the (out, in) axes
    down_scale_inv: torch.Tensor | None = None
    transposed: bool = False  # weights stored (in, out), as gpt-oss does
    gate_up_halves_apart: bool = False  # FP8: gate and up carry separate block grids (merged per expert)
    up_first: bool = False  # gate_up (scales, bias) hold [up; gate]: the flashinfer_cutlass layout
    block: tuple[int, int] = BLOCK

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def is_fp8(self) -> bool:
        return self.gate_up.dtype == E4M3

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up, down) as `dtype` matrices in (out, in) orientation."""
        gate_up, down = self.gate_up[e], self.down[e]
        if self.transposed:
            gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
        if not self.is_fp8:
            return self._gate_first(gate_up.to(dtype)), down.to(dtype)
        if self.gate_up_scale_inv is None or self.down_scale_inv is None:
            raise ValueError("FP8 expert weights need their weight_scale_inv block scales")
        gu_scale, d_scale = self.gate_up_scale_inv[e], self.down_scale_inv[e]
        if self.transposed:
            gu_scale, d_scale = gu_scale.transpose(-1, -2), d_scale.transpose(-1, -2)
        # Up-first blocks dequantize as they are: each half keeps its own rows of scales.
        return (
            self._gate_first(
                dequantize_gate_up(gate_up, gu_scale, dtype, self.gate_up_halves_apart, self.block)
            ),
            dequantize_blocks(down, d_scale, dtype, self.block),
        )

    def expert_bias(self, e: int) -> torch.Tensor | None:
        """Expert e's gate_up bias `[2I]` in gate-first order, or None."""
        if self.gate_up_bias is None:
            return None
        return self._gate_first(self.gate_up_bias[e])

    def _gate_first(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One expert's `[2I, ...]` rows in the model's [gate; up] order."""
        if not self.up_first:
            return gate_up
        half = gate_up.shape[0] // 2
        return torch.cat([gate_up[half:], gate_up[:half]])


# An expert id meaning "held by another rank" (expert parallel, engine/parallel/layers.py): the pair
# is skipped here and contributes zero; the all-reduce after the experts adds the rank that holds it.
ROUTED_ELSEWHERE = -1


def route_pairs(top_k_index: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(permutation that sorts the flattened (token, slot) pairs by expert, pairs per expert); pairs
    ROUTED_ELSEWHERE sort first and are counted in the first entry, before expert 0's."""
    flat = top_k_index.reshape(-1) + 1  # ROUTED_ELSEWHERE -> bucket 0
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=1).tolist()  # the one host sync per layer
    return order, counts


def reference_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: ExpertWeights,
    act: GatedActivation,
) -> torch.Tensor:
    """`[T, H]` tokens, `[T, k]` chosen experts and their weights -> `[T, H]` weighted expert outputs."""
    tokens, k = top_k_index.shape
    if tokens == 0:
        return torch.zeros_like(hidden)
    if int(top_k_index.max()) >= weights.num_experts or int(top_k_index.min()) < ROUTED_ELSEWHERE:
        raise ValueError(
            f"routed expert ids must lie in [0, {weights.num_experts}) "
            f"(or be ROUTED_ELSEWHERE, {ROUTED_ELSEWHERE})"
        )
    order, (elsewhere, *counts) = route_pairs(top_k_index)
    rows = hidden.repeat_interleave(k, dim=0)[order]  # [T*k, H], grouped by expert
    out = torch.empty_like(rows)
    out[:elsewhere] = 0
    start = elsewhere
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up_w, down_w = weights.expert(e, hidden.dtype)
        x = rows[start : start + n]
        gate_up = x @ gate_up_w.T
        bias = weights.expert_bias(e)
        if bias is not None:
            gate_up = gate_up + bias
        y = apply_gated(gate_up, act) @ down_w.T
        if weights.down_bias is not None:
            y = y + weights.down_bias[e]
        out[start : start + n] = y
        start += n
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    weighted = unsorted.view(tokens, k, -1) * top_k_weights.to(hidden.dtype).unsqueeze(-1)
    return weighted.sum(dim=1)
