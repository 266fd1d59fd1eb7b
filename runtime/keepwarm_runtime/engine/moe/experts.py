"""keepwarm as transformers' experts implementation: each fused-experts module runs on a chosen MoE backend.

transformers 5 dispatches every `@use_experts_implementation` class (Qwen3-MoE, DeepSeek-V3, gpt-oss,
Mixtral, ...) through `ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`, after the model's own
router (softmax or sigmoid, groups, top-k, shared experts) has run: keepwarm registers "keepwarm" there
and replaces only the expert computation. At load, `prepare_experts` reads each module's facts (weight
format, gate activation, sizes), asks the oracle for a backend and attaches it. A gate keepwarm does not
recognise (checked numerically against the module's own `_apply_gate`) keeps transformers' grouped
implementation: always a correct path, with the reason logged (except for experts converted to the
flashinfer_cutlass layout, which transformers' code would misread: refused by name).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from keepwarm_runtime.engine.moe.activation import GatedActivation, apply_gated
from keepwarm_runtime.engine.moe.oracle import MoEBackendError, MoELayerFacts, choose_backend
from keepwarm_runtime.engine.moe.reference import ExpertWeights, reference_moe
from keepwarm_runtime.weights.fp8 import E4M3
from keepwarm_runtime.weights.kernel_layout import FLASHINFER_CUTLASS, MODEL, UP_FIRST_ATTR
from keepwarm_runtime.weights.quantization import SCALE_SUFFIX  # FP8 block scales: gate_up_proj_scale_inv
from keepwarm_runtime.weights.serving_layout import is_experts_module

log = logging.getLogger(__name__)

IMPLEMENTATION = "keepwarm"
RUNNER_ATTR = "_keepwarm_moe"  # the callable attached to each experts module

HALVES_APART_ATTR = "_keepwarm_gate_up_halves_apart"  # set by the FP8 loader when it merged per-expert scales

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertsChoice:
    """What `prepare_experts` decided for one experts module (logged once, exported as a label)."""

    module: str  # qualified name, e.g. model.layers.1.mlp.experts
    backend: str  # torch | flashinfer_cutlass | flashinfer_trtllm | transformers
    reason: str
    copied: int = 0  # tensors the backend copied into its own layout (0 when the experts hold it)


def expert_weights(module: nn.Module) -> ExpertWeights:
    """The module's own tensors, viewed (never copied) as an ExpertWeights."""
    has_bias = getattr(module, "has_bias", False)
    return ExpertWeights(
        gate_up=module.gate_up_proj,
        down=module.down_proj,
        gate_up_bias=module.gate_up_proj_bias if has_bias else None,
        down_bias=module.down_proj_bias if has_bias else None,
        gate_up_scale_inv=getattr(module, "gate_up_proj" + SCALE_SUFFIX, None),
        down_scale_inv=getattr(module, "down_proj" + SCALE_SUFFIX, None),
        transposed=getattr(module, "is_transposed", False),
        gate_up_halves_apart=getattr(module, HALVES_APART_ATTR, False),
        up_first=getattr(module, UP_FIRST_ATTR, False),
    )


def _candidate_activations(module: nn.Module) -> list[GatedActivation]:
    interleaved = not getattr(module, "is_concatenated", True)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    candidates = [GatedActivation("swiglu", interleaved=interleaved)]
    if alpha is not None or limit is not None:  # gpt-oss' clamped SwiGLU: (up + 1) * glu
        candidates.insert(0, GatedActivation("swiglu", alpha, 1.0, limit, interleaved))
    candidates.append(GatedActivation("geglu", interleaved=interleaved))
    return candidates


def gated_activation(module: nn.Module, dtype: torch.dtype = torch.float32) -> GatedActivation | None:
    """The module's gate as a GatedActivation, or None if none reproduces its own `_apply_gate` exactly
    on a probe wide enough to hit any clamp."""
    if not getattr(module, "has_gate", False) or not hasattr(module, "gate_up_proj"):
        return None
    g = torch.Generator().manual_seed(0)
    probe = (torch.randn(8, 64, generator=g) * 20).to(dtype)
    with torch.no_grad():
        expected = module._apply_gate(probe)
    for act in _candidate_activations(module):
        if torch.equal(apply_gated(probe, act), expected):
            return act
    return None


FLOAT_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def weight_format(weights: ExpertWeights) -> str:
    if weights.gate_up.dtype in FLOAT_FORMATS:
        return FLOAT_FORMATS[weights.gate_up.dtype]
    if weights.gate_up.dtype != E4M3:
        raise MoEBackendError(f"expert weights in {weights.gate_up.dtype} are not a format keepwarm serves")
    scale = weights.gate_up_scale_inv
    return "fp8_per_tensor" if scale is not None and scale.numel() == weights.num_experts else "fp8_block128"


def layer_facts(weights: ExpertWeights, act: GatedActivation, capability) -> MoELayerFacts:
    alpha, beta, limit = act.has_params
    gate_up = weights.gate_up.transpose(-1, -2) if weights.transposed else weights.gate_up
    return MoELayerFacts(
        weight_format=weight_format(weights),
        activation=act.kind,
        has_alpha=alpha,
        has_beta=beta,
        has_limit=limit,
        num_experts=weights.num_experts,
        hidden_size=gate_up.shape[-1],
        intermediate_size=gate_up.shape[-2] // 2,
        capability=capability,
        layout=FLASHINFER_CUTLASS if weights.up_first else MODEL,
        interleaved=act.interleaved,
    )


def _torch_runner(module: nn.Module, act: GatedActivation) -> Runner:
    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return reference_moe(hidden, top_k_index, top_k_weights, expert_weights(module), act)

    return run


def checked(name: str, backend: str, kernel: Runner, reference: Runner, tolerance: float) -> Runner:
    """`kernel`, trusted only after it agrees with `reference` on its first input; else the reference
    from then on, with the reason logged. A fused kernel is never the only witness of its own output."""
    state: dict[str, Runner] = {}

    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if "use" in state:
            return state["use"](hidden, top_k_index, top_k_weights)
        expected = reference(hidden, top_k_index, top_k_weights)
        try:
            got = kernel(hidden, top_k_index, top_k_weights)
            want, have = expected.detach().float(), got.detach().float()
            error = float((have - want).abs().max()) / max(float(want.abs().max()), 1e-6)
            problem = None if error <= tolerance else f"relative error {error:.3g} > {tolerance}"
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            state["use"] = kernel
            return got
        log.warning(
            "%s: %s disagrees with the torch reference (%s); using the reference", name, backend, problem
        )
        state["use"] = reference
        return expected

    return run


def _transformers_runner(module: nn.Module) -> Runner:
    from transformers.integrations.moe import grouped_mm_experts_forward

    def run(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return grouped_mm_experts_forward(module, hidden, top_k_index, top_k_weights)

    return run


def prepare_experts(model: nn.Module, requested: str, device: torch.device) -> list[ExpertsChoice]:
    """Attach a backend to every experts module of `model`; log the choice once per model."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    unavailable = {}
    if capability is not None:
        from keepwarm_runtime.engine.moe import flashinfer_backend

        unavailable = flashinfer_backend.unavailable_backends()
    choices = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        act = gated_activation(module)
        if act is None and getattr(module, UP_FIRST_ATTR, False):
            raise MoEBackendError(
                f"{name}: the experts hold the {FLASHINFER_CUTLASS} layout ([up; gate]), but keepwarm "
                f"does not "
                f"recognise their gate ({type(module).__name__}) and transformers' code reads [gate; up]; "
                "serve this model in the model layout"
            )
        if act is None:
            if requested != "auto":
                raise MoEBackendError(
                    f"{name}: moe_backend={requested!r}, but keepwarm does not recognise this expert gate "
                    f"({type(module).__name__}); use moe_backend='auto'"
                )
            setattr(module, RUNNER_ATTR, _transformers_runner(module))
            reason = f"gate of {type(module).__name__} is not one keepwarm reproduces exactly"
            choices.append(ExpertsChoice(name, "transformers", reason))
            continue
        weights = expert_weights(module)
        backend, reason = choose_backend(requested, layer_facts(weights, act, capability), unavailable)
        copied = 0
        if backend == "torch":
            runner = _torch_runner(module, act)
        else:
            from keepwarm_runtime.engine.moe import flashinfer_backend

            kernel = flashinfer_backend.make_runner(backend, module, weights, act)
            copied = flashinfer_backend.kernel_copies(weights)
            tolerance = 0.1 if weights.is_fp8 else 0.03  # the FP8 kernels also quantize activations
            runner = checked(name, backend, kernel, _torch_runner(module, act), tolerance)
        setattr(module, RUNNER_ATTR, runner)
        choices.append(ExpertsChoice(name, backend, reason, copied))
    if choices:
        summary = sorted({(c.backend, c.reason) for c in choices})
        log.info("MoE backends for %s: %s", type(model).__name__, "; ".join(f"{b} ({r})" for b, r in summary))
    return choices


def keepwarm_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    runner = getattr(module, RUNNER_ATTR, None)
    if runner is None:
        raise RuntimeError(
            f"{type(module).__name__} dispatched to keepwarm experts before prepare_experts attached one"
        )
    return runner(hidden_states, top_k_index, top_k_weights)


def use_keepwarm_experts(model: nn.Module) -> bool:
    """Register "keepwarm" with transformers and select it for `model`; False if the model has no
    dispatchable experts (dense models, or MoE classes without `@use_experts_implementation`)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, keepwarm_experts_forward)
    if not any(is_experts_module(m) for m in model.modules()):
        return False
    model.set_experts_implementation(IMPLEMENTATION)
    return True
