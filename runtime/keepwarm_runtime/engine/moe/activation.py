"""Gated expert activations: SiLU-gated (SwiGLU), with gpt-oss' alpha / beta / limit, and GELU-gated.

gpt-oss (transformers' `GptOssExperts._apply_gate`) computes, on the gate and up halves:
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out = (up + beta) * gate * sigmoid(alpha * gate)      with alpha = 1.702, beta = 1, limit = 7
Plain SwiGLU is the case alpha = 1, beta = 0, no limit: silu(gate) * up. These are the parameters
FlashInfer's kernels take as swiglu_alpha / swiglu_beta / swiglu_limit (gemm1_alpha / beta / clamp_limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class GatedActivation:
    kind: str  # "swiglu" | "geglu" (see oracle.ACTIVATIONS)
    alpha: float | None = None  # SwiGLU only: gate * sigmoid(alpha * gate)
    beta: float | None = None  # SwiGLU only: added to the up projection
    limit: float | None = None  # SwiGLU only: gate clamped above, up clamped on both sides
    interleaved: bool = False  # gate/up columns alternate (gpt-oss) instead of [gate; up] halves

    def __post_init__(self) -> None:
        if self.kind not in ("swiglu", "geglu"):
            raise ValueError(f"gated activation {self.kind!r} is unknown; use swiglu or geglu")
        if self.kind != "swiglu" and (self.alpha, self.beta, self.limit) != (None, None, None):
            raise ValueError("alpha/beta/limit are SwiGLU parameters; a GELU gate takes none")

    @property
    def has_params(self) -> tuple[bool, bool, bool]:
        return self.alpha is not None, self.beta is not None, self.limit is not None


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def apply_gated(gate_up: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """`[..., 2I]` gate/up projection -> `[..., I]`."""
    gate, up = split_gate_up(gate_up, act.interleaved)
    if act.kind == "geglu":
        return F.gelu(gate) * up
    if act.limit is not None:
        gate = gate.clamp(max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
    glu = F.silu(gate) if act.alpha is None else gate * torch.sigmoid(gate * act.alpha)
    if act.beta is not None:
        up = up + act.beta
    return up * glu
