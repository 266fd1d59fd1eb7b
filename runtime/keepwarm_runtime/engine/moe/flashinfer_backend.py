"""FlashInfer's CUTLASS fused MoE as a keepwarm experts backend (GPU only; untested on GPU so far).

`cutlass_fused_moe` takes the routing the model's own router chose (expert ids as int32, weights as
float32), fc1 weights `[E, 2I, H]` with the up half first ([up; gate], TRT-LLM's w3/w1 order), fc2
`[E, H, I]`, optional per-expert biases, and per-expert `swiglu_alpha` / `swiglu_beta` /
`swiglu_limit` float32 tensors. FP8 128x128 block scales go in `quant_scales` as
`[fc1_scales [E, 2I/128, H/128] in the same [up; gate] order, fc2_scales [E, H/128, I/128]]` with
`use_deepseek_fp8_block_scale=True` (Hopper only; bf16 activations, quantized inside the kernel).
Experts already in the `flashinfer_cutlass` layout (weights.kernel_layout: converted once by the
weight cache daemon into its arena, or by the engine's disk path) go to the kernel as they are, with
no copy. Experts in the model layout are repacked once, when the runner is made: a second copy of
them on the GPU (the model's own stay, for the reference the runner is checked against), counted by
`kernel_copies` into `LoadInfo.copied_tensors`. `trtllm_fp8_block_scale_moe`
routes tokens itself from router logits, bypassing each model's own router (newer FlashInfer adds a
`..._routed_moe` variant taking packed routing); keepwarm has no adapter for either yet and says so.
A runner is checked against the torch reference on its first input (experts.py) before it is trusted.
"""

from __future__ import annotations

import torch

from keepwarm_runtime.engine.moe.activation import GatedActivation
from keepwarm_runtime.engine.moe.reference import ExpertWeights
from keepwarm_runtime.weights.kernel_layout import up_first

EXTRA_HINT = "install keepwarm-runtime[gpu] (flashinfer-python)"
TRTLLM_NOT_WIRED = (
    "keepwarm has no adapter for trtllm_fp8_block_scale_moe yet: it routes from router logits itself, "
    "bypassing the model's own router (its routed variant is not wired either)"
)


def unavailable_reason() -> str | None:
    try:
        import flashinfer.fused_moe  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"flashinfer-python is not importable ({type(exc).__name__}: {exc}); {EXTRA_HINT}"
    return None


def unavailable_backends() -> dict[str, str]:
    """Backend -> why it cannot run on this machine (package missing, or adapter not written)."""
    reason = unavailable_reason()
    missing = {"flashinfer_trtllm": reason or TRTLLM_NOT_WIRED}
    if reason is not None:
        missing["flashinfer_cutlass"] = reason
    return missing


def _up_first(gate_up: torch.Tensor, interleaved: bool, already: bool) -> torch.Tensor:
    if already:  # converted at load (kernel_layout): the kernel takes it as it is
        return gate_up
    if interleaved:
        gate_up = torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1)
    return up_first(gate_up).contiguous()


def cutlass_layout(weights: ExpertWeights, act: GatedActivation) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 `[E, 2I, H]` as [up; gate], fc2 `[E, H, I]`): the experts' own tensors when they are in
    the flashinfer_cutlass layout already, else a copy made here."""
    gate_up, down = weights.gate_up, weights.down
    if weights.transposed:
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    return _up_first(gate_up, act.interleaved, weights.up_first), down.contiguous()


def cutlass_fp8_scales(weights: ExpertWeights) -> list[torch.Tensor]:
    """`quant_scales` for the DeepSeek block-scale path: fc1 scales in [up; gate] order like fc1."""
    if weights.gate_up_scale_inv is None or weights.down_scale_inv is None:
        raise ValueError("FP8 experts for cutlass_fused_moe need their block scales")
    gate_up, down = weights.gate_up_scale_inv, weights.down_scale_inv
    if weights.transposed:  # block grids transpose with their weights
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    return [_up_first(gate_up, False, weights.up_first), down.contiguous()]


def cutlass_bias(weights: ExpertWeights, act: GatedActivation) -> torch.Tensor | None:
    if weights.gate_up_bias is None:
        return None
    return _up_first(weights.gate_up_bias, act.interleaved, weights.up_first)


def kernel_copies(weights: ExpertWeights) -> int:
    """Tensors `make_runner("flashinfer_cutlass", ...)` copies for the kernel: none for experts in its
    layout; else fc1, its scales and bias (reordered), and fc2 (and its scales) when stored transposed."""
    if weights.up_first:
        return 0
    fp8 = weights.is_fp8 and weights.gate_up_scale_inv is not None
    fc1_side = 1 + fp8 + (weights.gate_up_bias is not None)
    return fc1_side + weights.transposed * (1 + fp8)  # fc2 (and its scales) made contiguous


def make_runner(backend: str, module, weights: ExpertWeights, act: GatedActivation):
    if backend != "flashinfer_cutlass":
        raise ValueError(f"{backend}: {TRTLLM_NOT_WIRED}")
    from flashinfer.fused_moe import cutlass_fused_moe

    if weights.is_fp8 and act.interleaved:
        raise ValueError("FP8 experts with interleaved gate/up are not repacked for cutlass_fused_moe")
    fc1, fc2 = cutlass_layout(weights, act)
    quant_scales = cutlass_fp8_scales(weights) if weights.is_fp8 else []
    experts = weights.num_experts
    device = fc1.device

    def per_expert(value: float | None) -> torch.Tensor | None:
        return None if value is None else torch.full((experts,), value, dtype=torch.float32, device=device)

    alpha, beta, limit = per_expert(act.alpha), per_expert(act.beta), per_expert(act.limit)
    bias1 = cutlass_bias(weights, act)

    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = cutlass_fused_moe(
            input=hidden.contiguous(),
            token_selected_experts=top_k_index.to(torch.int32),
            token_final_scales=top_k_weights.to(torch.float32),
            fc1_expert_weights=fc1,
            fc2_expert_weights=fc2,
            output_dtype=hidden.dtype,
            quant_scales=quant_scales,
            fc1_expert_biases=bias1,
            fc2_expert_biases=weights.down_bias,
            swiglu_alpha=alpha,
            swiglu_beta=beta,
            swiglu_limit=limit,
            **({"use_deepseek_fp8_block_scale": True} if weights.is_fp8 else {}),
        )
        return out[0] if isinstance(out, (list, tuple)) else out

    return run
