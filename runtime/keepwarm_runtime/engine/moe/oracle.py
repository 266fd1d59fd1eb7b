"""Which MoE backend may run a layer: one pure `(ok, reason)` function per backend, and the `auto` choice.

A fused kernel that silently ignores a SwiGLU clamp gives wrong numbers; refusing one that supports it
loses a large speed-up. So each backend states, from the layer's facts alone (weight format, activation,
which SwiGLU parameters are set, expert count, sizes, GPU capability), whether it computes that layer
exactly, and if not, why. Facts about the FlashInfer kernels (flashinfer.fused_moe):

- `cutlass_fused_moe` (CUTLASS grouped GEMM): bf16 weights on SM80+; FP8 with 128x128 block scales
  (`use_deepseek_fp8_block_scale`) only on Hopper (SM90), with [gate; up] halves keepwarm can reorder
  (interleaved FP8 gate/up has blocks mixing both: refused); per-expert `swiglu_alpha` / `swiglu_beta` /
  `swiglu_limit` tensors only for SwiGLU activations.
- `trtllm_fp8_block_scale_moe` (TRT-LLM generated kernels): Blackwell datacenter parts (SM100/SM103)
  only; e4m3 weights with 128x128 block scales, hidden and intermediate sizes multiples of 128, at most
  256 experts, SwiGLU only; `gemm1_alpha` / `gemm1_beta` / `gemm1_clamp_limit` are per-expert tensors.
- `trtllm_fp8_per_tensor_scale_moe` takes no SwiGLU parameters at all, so per-tensor FP8 with a clamp
  has no correct FlashInfer kernel: refused.

Expert layout (weights.kernel_layout): the torch reference reads both; CUTLASS takes its own
`flashinfer_cutlass` layout as it is and repacks the model layout with a copy; the TRT-LLM kernels
want a layout of their own (none converted yet), so experts converted for CUTLASS are refused there.

The rule shared by every FP8 kernel: SwiGLU parameters are honoured only with block-scaled weights and
a SwiGLU-family activation. keepwarm never loads mxfp8 weights (no converter yet), so every backend
refuses them by name. `auto` takes the first eligible backend in `AUTO_ORDER`; the torch reference is
eligible for everything keepwarm loads, so `auto` always has a correct path. Whether a backend's
package is installed (or, for TRT-LLM, whether keepwarm has its adapter yet: not so far) is the
caller's to say, through `choose_backend(..., unavailable=)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from keepwarm_runtime.weights.layouts import LAYOUTS, MODEL

WEIGHT_FORMATS = ("fp32", "fp16", "bf16", "fp8_per_tensor", "fp8_block128", "mxfp8")
ACTIVATIONS = ("swiglu", "geglu")  # gated SiLU (incl. gpt-oss' clamped form) | gated GELU
SWIGLU_FAMILY = frozenset({"swiglu"})
BACKENDS = ("flashinfer_trtllm", "flashinfer_cutlass", "torch")
AUTO_ORDER = BACKENDS  # fastest first; the torch reference last, always eligible for what keepwarm loads
TRTLLM_MAX_EXPERTS = 256
FP8_BLOCK = 128

Eligibility = tuple[bool, str]  # (ok, reason); the reason names the fact that decided


@dataclass(frozen=True)
class MoELayerFacts:
    """What a backend needs to know about one MoE layer to say whether it computes it exactly."""

    weight_format: str  # one of WEIGHT_FORMATS
    activation: str  # one of ACTIVATIONS
    has_alpha: bool  # SwiGLU gate scale (gpt-oss: x * sigmoid(alpha * x))
    has_beta: bool  # offset added to the up projection (gpt-oss: up + 1)
    has_limit: bool  # clamp of gate (above) and up (both sides)
    num_experts: int
    hidden_size: int
    intermediate_size: int
    capability: tuple[int, int] | None  # CUDA compute capability; None on CPU
    layout: str = MODEL  # expert layout the weights hold (weights.kernel_layout.LAYOUTS)
    interleaved: bool = False  # gate/up columns alternate (gpt-oss) instead of [gate; up] halves

    @property
    def has_swiglu_params(self) -> bool:
        return self.has_alpha or self.has_beta or self.has_limit

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.weight_format!r} is unknown; use one of {WEIGHT_FORMATS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is unknown; use one of {ACTIVATIONS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"expert layout {self.layout!r} is unknown; use one of {LAYOUTS}")


class MoEBackendError(ValueError):
    """An explicitly requested MoE backend cannot run this layer; the message quotes the oracle's reason."""


def _params_rule(facts: MoELayerFacts) -> Eligibility | None:
    """Shared refusals: SwiGLU parameters outside the SwiGLU family, and mxfp8 weights."""
    if facts.weight_format == "mxfp8":
        return False, "mxfp8 weights: keepwarm has no mxfp8 loader"
    if facts.has_swiglu_params and facts.activation not in SWIGLU_FAMILY:
        return False, f"alpha/beta/limit are SwiGLU parameters; activation {facts.activation!r} takes none"
    return None


def _flashinfer_rule(facts: MoELayerFacts) -> Eligibility | None:
    """Refusals shared by both FlashInfer kernels, decided before the GPU is looked at."""
    refused = _params_rule(facts)
    if refused:
        return refused
    if facts.weight_format == "fp8_per_tensor":
        if facts.has_swiglu_params:
            return False, "per-tensor FP8 kernels take no SwiGLU alpha/beta/limit; the clamp would be ignored"
        return False, "per-tensor FP8 weights: keepwarm's FlashInfer adapter passes block-scaled FP8 only"
    if facts.capability is None:
        return False, "needs a CUDA device"
    return None


def torch_eligible(facts: MoELayerFacts) -> Eligibility:
    """The reference: dequantizes blocks and runs grouped matmuls in the activation dtype, anywhere."""
    refused = _params_rule(facts)
    if refused:
        return refused
    return True, "torch reference computes every loaded format, activation and expert layout"


def flashinfer_cutlass_eligible(facts: MoELayerFacts) -> Eligibility:
    refused = _flashinfer_rule(facts)
    if refused:
        return refused
    cap = facts.capability
    if cap < (8, 0) or cap[0] >= 12:
        return False, f"GPU capability {cap[0]}.{cap[1]} is not a CUTLASS MoE family (SM80-SM103)"
    if facts.weight_format == "fp8_block128":
        if facts.interleaved:
            return False, (
                "FP8 experts with interleaved gate/up (gpt-oss): each 128x128 block mixes gate and up "
                "rows, so no [up; gate] block-scaled fc1 exists for the CUTLASS kernel"
            )
        if cap[0] != 9:
            return (
                False,
                f"GPU capability {cap[0]}.{cap[1]}: CUTLASS FP8 block-scale MoE runs on Hopper (SM90) only",
            )
        if facts.hidden_size % FP8_BLOCK or facts.intermediate_size % FP8_BLOCK:
            return False, f"FP8 block-scale needs hidden and intermediate sizes divisible by {FP8_BLOCK}"
    elif facts.weight_format == "fp32":
        return False, "CUTLASS MoE takes bf16/fp16 (or FP8) weights, not float32"
    elif facts.hidden_size % 16 or facts.intermediate_size % 16:
        return False, "CUTLASS needs hidden and intermediate sizes divisible by 16"
    return True, "CUTLASS fused MoE takes this format; SwiGLU parameters passed per expert"


def flashinfer_trtllm_eligible(facts: MoELayerFacts) -> Eligibility:
    refused = _flashinfer_rule(facts)
    if refused:
        return refused
    cap = facts.capability
    if cap[0] != 10:
        return (
            False,
            f"GPU capability {cap[0]}.{cap[1]} is not Blackwell (SM100/SM103), where TRT-LLM MoE runs",
        )
    if facts.weight_format in ("fp32", "fp16", "bf16"):
        return False, f"the TRT-LLM FP8 block-scale kernel takes e4m3 weights, not {facts.weight_format}"
    if facts.activation not in SWIGLU_FAMILY:
        return False, f"the TRT-LLM FP8 block-scale kernel computes SwiGLU only, not {facts.activation!r}"
    if facts.layout != MODEL:
        return False, f"experts hold the {facts.layout} layout; the TRT-LLM kernel is given none of its own"
    if facts.num_experts > TRTLLM_MAX_EXPERTS:
        return False, f"{facts.num_experts} experts exceed the TRT-LLM routing limit of {TRTLLM_MAX_EXPERTS}"
    if facts.hidden_size % FP8_BLOCK or facts.intermediate_size % FP8_BLOCK:
        return False, f"FP8 block-scale needs hidden and intermediate sizes divisible by {FP8_BLOCK}"
    return True, "TRT-LLM FP8 block-scale MoE; SwiGLU parameters passed as gemm1_alpha/beta/clamp_limit"


ELIGIBILITY: dict[str, Callable[[MoELayerFacts], Eligibility]] = {
    "flashinfer_trtllm": flashinfer_trtllm_eligible,
    "flashinfer_cutlass": flashinfer_cutlass_eligible,
    "torch": torch_eligible,
}


def choose_backend(
    requested: str, facts: MoELayerFacts, unavailable: dict[str, str] | None = None
) -> tuple[str, str]:
    """(backend, reason): `auto` takes the first eligible in AUTO_ORDER; a named ineligible one is an error.

    `unavailable` maps a backend whose package is missing on this machine to why (e.g. flashinfer-python
    not installed); the caller finds that out, so this stays pure."""
    if requested != "auto" and requested not in ELIGIBILITY:
        raise MoEBackendError(
            f"MoE backend {requested!r} is unknown; use auto or one of {', '.join(BACKENDS)}"
        )
    candidates = AUTO_ORDER if requested == "auto" else (requested,)
    reasons = []
    for name in candidates:
        ok, reason = ELIGIBILITY[name](facts)
        if ok and unavailable and name in unavailable:
            ok, reason = False, unavailable[name]
        if ok:
            return name, reason
        reasons.append(f"{name}: {reason}")
    raise MoEBackendError(f"no MoE backend can run this layer ({'; '.join(reasons)})")
