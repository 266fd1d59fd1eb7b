"""Fused CPU kernels attached to transformers' modules: RMSNorm, SiLU-and-mul and rotary embedding.

A decode step of a small model in bfloat16 spends a fifth of its CPU time in elementwise operators
(RMSNorm's cast, pow, mean, rsqrt and muls; rotary's muls, cat and neg; SiLU and its mul), each a pass
over the whole activation. keepwarm's compiled CPU library (engine/attention/native.py,
csrc/fused_ops.cpp) does each module's chain in one pass per row. This module is the one place that
decides where they apply: by module type (``families()``: the model classes whose modules compute
exactly what the kernels do, checked against their source by a test), never by names: Llama,
Mistral, Ministral, Qwen2, Qwen3, their MoE kin, SmolLM3 and OLMoE take all four below; Granite,
Mixtral, Phi-3, GLM and DeepSeek-V3 the ones that are Llama's, Phi-3 and GLM their MLP of one
gate-and-up product (``FAMILY_MODULES``); Gemma, Gemma 2 and Gemma 3 their RMSNorm and rotary (their
MLPs are GELU-tanh, their layers' norms Gemma's).

- ``*RMSNorm``: the module's class becomes a subclass whose forward calls ``keepwarm_cpu.rms_norm``
  (Gemma's, which scales by ``1 + w`` in float32 and rounds once: ``keepwarm_cpu.gemma_rms_norm``).
- ``*MLP`` whose ``act_fn`` is SiLU: ``down_proj(silu_and_mul(gate_proj(x), up_proj(x)))``; the
  projections stay the modules they are (packed, LoRA's hooks, tensor-parallel shards). Where both
  would take the AMX kernel and no hook watches them, their products and the activation are one
  operator (``cpu_linear.gate_up_silu``: the same bits, the activation rearranged once, no
  intermediate written and read again). Phi-3's and GLM's MLP, one ``gate_up_proj`` whose halves are
  the gate and the up: ``down_proj(silu_and_mul_halves(gate_up_proj(x)))``.
- ``*Attention``: its forward, the same code, runs with ``apply_rotary_pos_emb`` bound to the fused
  kernel (a copy of the function with its own globals, so transformers' module and every other model
  in the process keep the original). The copy is of the innermost forward, under the decorators
  transformers puts on it (the ``past_key_values`` -> ``cache`` renaming, which keepwarm's calls do
  not need, and the ``kernels`` package's routing of hub kernels, which keepwarm does not use).
- ``*DecoderLayer``: the residual add after attention and the post-attention RMSNorm are one kernel
  (``keepwarm_cpu.add_rms_norm``).

Each fused forward falls back to the module's own for inputs its kernel does not take (another dtype
or device, a non-contiguous activation, partial rotary, autograd), so no input fails for want of a kernel.

Only on CPU and only when the library loads (else one line in the log and nothing changes). The
kernels round where the modules round, so in bfloat16 and float16 a result differs from the module's
only where RMSNorm's sum of squares (summed in another order) or SiLU's exp (a float32 polynomial,
where torch uses Sleef) lands a float32 intermediate on the other side of a 16-bit rounding boundary:
one unit in the last place of the 16-bit result, rarely (28 of 1.9 million RMSNorm outputs over the
unit tests' shapes, no SiLU-and-mul output). In float32 the same two differ from torch's by a few
float32 ulps (at most 4 over those shapes; rotary is exact), as the float32 linear kernel's sums do
(engine/cpu_linear.py): greedy tokens stay the unfused modules' and a logprob moves by float32
rounding (stated tolerance 1e-4 nats, tested against the unfused engine). In a float32 decode step of
a small model these chains were a tenth of the time (10M Llama, 64 x 128 tokens: 1.10x over the
unfused modules in one run).
``--no-cpu-fused-ops`` turns it off.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.cpu_linear import gate_up_silu

log = logging.getLogger(__name__)

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROTARY_NAME = "apply_rotary_pos_emb"  # the global a family's attention forward calls


@dataclass(frozen=True)
class Family:
    """One architecture's module classes that take a fused forward (from its transformers modelling
    module), by kind."""

    classes: dict[str, type[nn.Module]]  # kind -> class


# Kinds a family's classes take, and the class name after the family's prefix. LLAMA: the modules are
# Llama's: RMSNorm ``w * T(x * rsqrt(mean(x^2) + eps))``, MLP ``down(act(gate(x)) * up(x))``, rotary in
# the rotate-half layout and a pre-norm decoder layer. GEMMA: Gemma's RMSNorm (``T(norm(x) * (1 + w))``
# in float32) and Llama's rotary; its MLP is GELU-tanh and Gemma 2's and 3's layers add norms.
LLAMA_KINDS = (
    ("rms_norm", "RMSNorm"),
    ("mlp", "MLP"),
    ("attention", "Attention"),
    ("decoder_layer", "DecoderLayer"),
)
GEMMA_KINDS = (("gemma_rms_norm", "RMSNorm"), ("attention", "Attention"))
GATE_UP_MLP = (("gate_up_mlp", "MLP"),)  # Phi-3's: one product, the gate's half then the up's
# The MLP kinds' activation attribute, which must be SiLU for the kernels to take the module.
ACTIVATION_ATTRS = {"mlp": "act_fn", "gate_up_mlp": "activation_fn"}


def _only(*kinds: str) -> tuple[tuple[str, str], ...]:
    """Some of Llama's kinds: a family whose other modules compute something else."""
    return tuple(entry for entry in LLAMA_KINDS if entry[0] in kinds)


# The families (tests/unit/engine/test_cpu_fused.py compares their sources with Llama's and Gemma's):
# modelling module, prefix, kinds. Their attention may differ around the rotary call (Qwen2's biases
# and window, Qwen3's and Gemma 3's per-head RMSNorm of queries and keys, which are the family's
# RMSNorm too, Gemma 2's softcapping, SmolLM3's layers without rotary, Granite's scale); only that
# call is fused. Left out, what is not Llama's: Mixtral's and Granite's layers (a sparse block, a
# residual multiplier), Phi-3's and GLM's attention (partial rotary), DeepSeek-V3's attention (MLA).
FAMILY_MODULES = (
    ("transformers.models.llama.modeling_llama", "Llama", LLAMA_KINDS),
    ("transformers.models.mistral.modeling_mistral", "Mistral", LLAMA_KINDS),
    ("transformers.models.ministral.modeling_ministral", "Ministral", LLAMA_KINDS),
    ("transformers.models.ministral3.modeling_ministral3", "Ministral3", LLAMA_KINDS),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2", LLAMA_KINDS),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2Moe", LLAMA_KINDS),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3", LLAMA_KINDS),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", LLAMA_KINDS),
    ("transformers.models.smollm3.modeling_smollm3", "SmolLM3", LLAMA_KINDS),
    ("transformers.models.olmoe.modeling_olmoe", "Olmoe", LLAMA_KINDS),
    ("transformers.models.mixtral.modeling_mixtral", "Mixtral", _only("rms_norm", "attention")),
    ("transformers.models.granite.modeling_granite", "Granite", _only("rms_norm", "mlp", "attention")),
    ("transformers.models.phi3.modeling_phi3", "Phi3", _only("rms_norm") + GATE_UP_MLP),
    ("transformers.models.glm.modeling_glm", "Glm", _only("rms_norm", "decoder_layer") + GATE_UP_MLP),
    ("transformers.models.glm4.modeling_glm4", "Glm4", _only("rms_norm") + GATE_UP_MLP),
    (
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3",
        _only("rms_norm", "mlp", "decoder_layer"),
    ),
    ("transformers.models.gemma.modeling_gemma", "Gemma", GEMMA_KINDS),
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2", GEMMA_KINDS),
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3", GEMMA_KINDS),
)


def families() -> tuple[Family, ...]:
    """The families whose modelling module is imported (a loaded model's is), so a start never pays
    for importing another architecture's."""
    return tuple(family(*entry) for entry in FAMILY_MODULES if entry[0] in sys.modules)


@functools.cache
def family(module_name: str, prefix: str, kinds: tuple[tuple[str, str], ...]) -> Family:
    m = importlib.import_module(module_name)
    return Family({kind: getattr(m, f"{prefix}{name}") for kind, name in kinds})


@dataclass
class FusedModules:
    """What ``use_fused_ops`` attached: modules per kind (all zero when it attached nothing)."""

    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _takes(*tensors: torch.Tensor) -> bool:
    """The kernels take these: CPU, one of FUSED_DTYPES, contiguous, no autograd."""
    first = tensors[0]
    if not first.is_cpu or first.dtype not in FUSED_DTYPES:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(t.dtype == first.dtype and t.is_contiguous() for t in tensors)


def rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    native.op("rms_norm")(out, x, module.weight, module.variance_epsilon)
    return out


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _takes(hidden_states, self.weight):
        return super(type(self), self).forward(hidden_states)
    return rms_norm(self, hidden_states)


def _gemma_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _takes(x, self.weight):
        return super(type(self), self).forward(x)
    out = torch.empty_like(x)
    native.op("gemma_rms_norm")(out, x, self.weight, self.eps)
    return out


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if (fused := gate_up_silu(self.gate_proj, self.up_proj, x)) is not None:  # one pass on AMX tiles
        return self.down_proj(fused)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not _takes(gate, up) or gate.shape != up.shape:
        return self.down_proj(self.act_fn(gate) * up)
    out = torch.empty_like(gate)
    native.op("silu_and_mul")(out, gate, up)
    return self.down_proj(out)


def _gate_up_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    up_states = self.gate_up_proj(hidden_states)
    if not _takes(up_states) or up_states.shape[-1] % 2:
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * self.activation_fn(gate))
    out = up_states.new_empty(*up_states.shape[:-1], up_states.shape[-1] // 2)
    native.op("silu_and_mul_halves")(out, up_states)
    return self.down_proj(out)


def _decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """Llama's pre-norm layer with ``residual + attention`` and the post-attention norm fused."""
    if cache is None:  # the name transformers deprecates (its decorator on the layer's own forward)
        cache = kwargs.pop("past_key_values", None)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    norm = self.post_attention_layernorm
    if _takes(hidden_states, residual, norm.weight) and hidden_states.shape == residual.shape:
        summed, normed = torch.empty_like(residual), torch.empty_like(residual)
        native.op("add_rms_norm")(normed, summed, hidden_states, residual, norm.weight, norm.variance_epsilon)
        residual, hidden_states = summed, normed
    else:
        residual = residual + hidden_states
        hidden_states = norm(residual)
    return residual + self.mlp(hidden_states)


def fused_rotary(original: Callable) -> Callable:
    """``apply_rotary_pos_emb`` on the fused kernel, ``original`` for what the kernel does not take."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (
            unsqueeze_dim != 1
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or cos.shape != sin.shape
            or cos.shape[-1] != q.shape[-1]  # partial rotary
            or cos.shape[0] != q.shape[0]
            or cos.shape[1] != q.shape[2]
            or k.shape[0] != q.shape[0]
            or k.shape[2:] != q.shape[2:]
            or not _takes(cos, sin)
            or q.dtype != cos.dtype
            or k.dtype != cos.dtype
            or q.stride(-1) != 1
            or k.stride(-1) != 1
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        ):
            return original(q, k, cos, sin, unsqueeze_dim)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        native.op("rotary_embedding")(q_out, k_out, q, k, cos, sin)
        return q_out, k_out

    return apply_rotary_pos_emb


@functools.cache
def fused_class(cls: type[nn.Module], kind: str) -> type[nn.Module] | None:
    """The subclass of ``cls`` with the fused forward for ``kind``; None when ``cls`` cannot take it
    (an attention forward that does not call ``apply_rotary_pos_emb`` by its global name)."""
    if kind == "rms_norm":
        forward = _rms_norm_forward
    elif kind == "gemma_rms_norm":
        forward = _gemma_rms_norm_forward
    elif kind == "mlp":
        forward = _mlp_forward
    elif kind == "gate_up_mlp":
        forward = _gate_up_mlp_forward
    elif kind == "decoder_layer":
        forward = _decoder_layer_forward
    else:  # attention: its own forward, with the rotary global bound to the kernel
        own = inspect.unwrap(cls.forward)  # under transformers' kwarg renaming and `kernels`' routing
        if not isinstance(own, types.FunctionType) or ROTARY_NAME not in own.__code__.co_names:
            return None
        scope = dict(own.__globals__)
        scope[ROTARY_NAME] = fused_rotary(own.__globals__[ROTARY_NAME])
        forward = types.FunctionType(own.__code__, scope, own.__name__, own.__defaults__, own.__closure__)
        forward.__kwdefaults__ = own.__kwdefaults__
        functools.update_wrapper(forward, own)  # its source, for engine/attention/fuser.py
    return type(f"KeepwarmFused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def _kind(module: nn.Module, known: tuple[Family, ...]) -> str | None:
    """Which fused forward ``module`` can take, by its type (and its MLP's activation)."""
    from transformers.activations import SiLUActivation

    cls = type(module)
    for members in known:
        for kind, member in members.classes.items():
            if cls is member:
                act = ACTIVATION_ATTRS.get(kind)
                if act is not None and type(getattr(module, act, None)) not in (SiLUActivation, nn.SiLU):
                    return None
                return kind
    return None


def use_fused_ops(model: nn.Module, dtype: torch.dtype, kernel_cache: str | None = None) -> FusedModules:
    """Give ``model``'s modules of the families above their fused forwards, when ``dtype`` is one the
    kernels serve and keepwarm's CPU library loads (``kernel_cache``: the node's builds, tried first)."""
    fused = FusedModules()
    if dtype not in FUSED_DTYPES:
        return fused
    try:
        native.load(kernel_cache)
    except native.KernelUnavailable as exc:
        log.info("fused CPU kernels off, keepwarm's CPU library cannot be built here: %s", exc)
        return fused
    known = families()
    for module in model.modules():
        kind = _kind(module, known)
        subclass = fused_class(type(module), kind) if kind is not None else None
        if subclass is not None:
            module.__class__ = subclass
            fused.counts[kind] = fused.counts.get(kind, 0) + 1
    log.info(
        "fused CPU kernels: %s", ", ".join(f"{n} {k}" for k, n in sorted(fused.counts.items())) or "none"
    )
    return fused
