"""Expert layouts a fused MoE kernel wants, as pure conversions of the model's fused experts.

`model` is transformers' own layout: `gate_up_proj` `[E, 2I, H]` with the gate half first. FlashInfer's
CUTLASS fused MoE (`cutlass_fused_moe`, engine.moe.flashinfer_backend) wants fc1 with the up half
first ([up; gate], TRT-LLM's w3/w1 order), and with FP8 its 128x128 block scales in the same order;
fc2 (`down_proj` `[E, H, I]`) and its scales are taken as the model holds them. So the
`flashinfer_cutlass` layout is one conversion, `up_first`, of every concatenated, untransposed
experts module's `gate_up_proj` (its FP8 `gate_up_proj_scale_inv` and its bias alike).

The conversion is applied once, into the arena at load (weights/arena.py): the weight-cache daemon's
(its id is part of the cache key's `conversion` field, so a client asking for another layout is a
miss, never a silent mix) or the disk path's private one, from the same plan. The experts then hold [up; gate]
tensors: the CUTLASS runner uses them as they are (no per-process copy), the torch reference reads
them back in gate-first order (engine.moe.reference), and transformers' own expert code, which
assumes gate first, is never run on them.

Order with FP8: the swap applies to the float tensor before online quantization (the daemon swaps
its staging before quantizing it), and to a checkpoint's e4m3 weight and
its per-half scale grids as stored. Those agree whenever the kernel can run at all (I % 128 == 0).

A client asks for the layout a checkpoint is keyed in (``checkpoint_layout``: the asked one where it
converts any experts, else `model`, as the daemon keys it), resolved from the checkpoint's meta-device
model, so the engine's background attach asks the same before the engine has built anything.

gpt-oss style experts (stored transposed `[E, H, 2I]`, gate and up interleaved) are left in the
model layout: the CUTLASS runner repacks them with a copy, counted in `LoadInfo.copied_tensors`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from keepwarm_runtime.weights.layouts import (
    FLASHINFER_CUTLASS,
    LAYOUTS,
    MODEL,
    ExpertLayoutError,
    check_layout,
    conversion_id,
)
from keepwarm_runtime.weights.serving_layout import is_experts_module, meta_model

__all__ = ["FLASHINFER_CUTLASS", "LAYOUTS", "MODEL", "ExpertLayoutError", "check_layout", "conversion_id"]
UP_FIRST_ATTR = "_keepwarm_gate_up_up_first"  # set on an experts module whose gate_up holds [up; gate]


def up_first(gate_up: torch.Tensor) -> torch.Tensor:
    """`[E, 2R, ...]` with the gate half first -> a new tensor with the up half first (dim 1 halves
    swapped). Its own inverse. Works on weights `[E, 2I, H]`, per-half block scales `[E, 2G, Hb]`
    and biases `[E, 2I]`."""
    if gate_up.ndim < 2 or gate_up.shape[1] % 2:
        raise ExpertLayoutError(
            f"a [gate; up] tensor needs an even dimension 1 to swap halves, got shape {tuple(gate_up.shape)}"
        )
    half = gate_up.shape[1] // 2
    return torch.cat([gate_up[:, half:], gate_up[:, :half]], dim=1)


def swap_halves_(gate_up: torch.Tensor) -> None:
    """`up_first` in place, one expert at a time (a load-time step on a writable arena; the temporary
    is one expert, not the stack)."""
    if gate_up.ndim < 2 or gate_up.shape[1] % 2:
        up_first(gate_up)  # raises, naming the shape
    for e in range(gate_up.shape[0]):
        gate_up[e : e + 1].copy_(up_first(gate_up[e : e + 1]))  # cat writes new memory first


def converts(module: nn.Module) -> bool:
    """Whether `flashinfer_cutlass` converts this module: fused experts `[E, 2I, H]` with [gate; up]
    halves (not gpt-oss' transposed, interleaved ones)."""
    return (
        is_experts_module(module)
        and hasattr(module, "gate_up_proj")
        and getattr(module, "has_gate", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
    )


def effective_layout(model: nn.Module, layout: str) -> str:
    """`layout` if it converts anything in `model`, else `model`: a dense model (or gpt-oss) is keyed
    the same whatever layout its client or daemon asks for, so the setting matters only where it acts."""
    return layout if layout_targets(model, layout) else MODEL


def checkpoint_layout(model_dir: str | Path, layout: str) -> str:
    """``effective_layout`` of ``model_dir``'s meta-device model (``serving_layout.meta_model``, the
    model the arena's plan converts): the layout a client of that checkpoint asks the cache for, known
    from config.json alone, before (or without) the engine's own model. ``model`` when transformers
    cannot build it, as the plan then converts nothing. Only a kernel layout builds the meta model."""
    if check_layout(layout) == MODEL:
        return MODEL
    model = meta_model(model_dir)
    return effective_layout(model, layout) if model is not None else MODEL


def layout_targets(model: nn.Module, layout: str) -> list[str]:
    """Model parameter names `layout` converts (before FP8 scales exist: a converted weight's
    `_scale_inv`, where there is one, is converted with it). Defined once, for the daemon (arena) and
    the engine's disk path."""
    if check_layout(layout) == MODEL:
        return []
    names = []
    for name, module in model.named_modules():
        if converts(module):
            prefix = f"{name}." if name else ""
            names.append(prefix + "gate_up_proj")
            if getattr(module, "has_bias", False):
                names.append(prefix + "gate_up_proj_bias")
    return names
