"""FlashInfer's CUTLASS fused MoE as a keepwarm experts backend (GPU only; untested on GPU so far).

`cutlass_fused_moe` takes the routing the model's own router chose (expert ids as int32, weights as
float32), fc1 weights `[E, 2I, H]` with the up half first ([up; gate], TRT-LLM's w3/w1 order), fc2
`[E, H, I]`, optional per-expert biases, and per-expert `swiglu_alpha` / `swiglu_beta` /
`swiglu_limit` float32 tensors. FP8 128x128 block scales go in `quant_scales` with
`use_deepseek_fp8_block_scale=True` (Hopper). The repack to the kernel's layout is done once, when
the runner is made. The TRT-LLM FP8 block-scale kernel routes tokens itself from router logits, which
would bypass each model's own router; keepwarm has no adapter for it yet and says so as the reason.
"""

from __future__ import annotations

import torch

from keepwarm_runtime.engine.moe.activation import GatedActivation
from keepwarm_runtime.engine.moe.reference import ExpertWeights

EXTRA_HINT = "install keepwarm-runtime[gpu] (flashinfer-python)"
TRTLLM_NOT_WIRED = (
    "keepwarm has no adapter for trtllm_fp8_block_scale_moe yet: it routes from router logits itself, "
    "bypassing the model's own router"
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


def cutlass_layout(weights: ExpertWeights, act: GatedActivation) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 `[E, 2I, H]` as [up; gate], fc2 `[E, H, I]`) from the model's layout: one copy, at load."""
    gate_up, down = weights.gate_up, weights.down
    if weights.transposed:
        gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
    if act.interleaved:
        gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=1)
    return torch.cat([up, gate], dim=1).contiguous(), down.contiguous()


def make_runner(backend: str, module, weights: ExpertWeights, act: GatedActivation):
    if backend != "flashinfer_cutlass":
        raise ValueError(f"{backend}: {TRTLLM_NOT_WIRED}")
    from flashinfer.fused_moe import cutlass_fused_moe

    if weights.is_fp8:
        raise ValueError("FP8 through cutlass_fused_moe needs its block-scale repack, not written yet")
    fc1, fc2 = cutlass_layout(weights, act)
    experts = weights.num_experts
    device = fc1.device

    def per_expert(value: float | None) -> torch.Tensor | None:
        return None if value is None else torch.full((experts,), value, dtype=torch.float32, device=device)

    alpha, beta, limit = per_expert(act.alpha), per_expert(act.beta), per_expert(act.limit)
    bias1 = None
    if weights.gate_up_bias is not None:
        b = weights.gate_up_bias
        gate_b, up_b = (b[:, ::2], b[:, 1::2]) if act.interleaved else b.chunk(2, dim=1)
        bias1 = torch.cat([up_b, gate_b], dim=1).contiguous()

    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = cutlass_fused_moe(
            input=hidden.contiguous(),
            token_selected_experts=top_k_index.to(torch.int32),
            token_final_scales=top_k_weights.to(torch.float32),
            fc1_expert_weights=fc1,
            fc2_expert_weights=fc2,
            output_dtype=hidden.dtype,
            quant_scales=[],
            fc1_expert_biases=bias1,
            fc2_expert_biases=weights.down_bias,
            swiglu_alpha=alpha,
            swiglu_beta=beta,
            swiglu_limit=limit,
        )
        return out[0] if isinstance(out, (list, tuple)) else out

    return run
