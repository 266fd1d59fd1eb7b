"""The function transformers calls as attention implementation "keepwarm"."""

from __future__ import annotations

import math

import torch
from torch import nn

from keepwarm_runtime.engine.attention.fuser import ATTACHED_NAME, IMPLEMENTATION, AttentionFusionError


def keepwarm_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    layer = getattr(module, ATTACHED_NAME, None)
    if layer is None:
        raise AttentionFusionError(
            f"{type(module).__name__} dispatched to keepwarm attention but has no attached layer"
        )
    if kwargs.get("is_causal") is False:
        raise AttentionFusionError(
            f"{type(module).__name__} asks for non-causal attention; keepwarm's attention is causal only"
        )
    if kwargs.get("position_bias") is not None:
        raise AttentionFusionError(
            f"{type(module).__name__} passes position_bias, which keepwarm does not support"
        )
    if (
        scaling is not None
        and layer.scale is not None
        and not math.isclose(scaling, layer.scale, rel_tol=1e-6)
    ):
        raise AttentionFusionError(
            f"{type(module).__name__}: scale {scaling} at call time differs from {layer.scale} "
            "resolved at attach"
        )
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    out = layer(query, key, value, kwargs.get("sliding_window"), kwargs.get("softcap"), sinks)
    return out, None


def register_keepwarm_attention() -> None:
    """Register "keepwarm" with transformers (idempotent); models select it via attn_implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, keepwarm_attention_forward)
