"""Fused CPU kernels attached to transformers' modules: RMSNorm, the gated MLPs' activation-and-mul and
rotary embedding.

A decode step of a small model in bfloat16 spends a fifth of its CPU time in elementwise operators
(RMSNorm's cast, pow, mean, rsqrt and muls; rotary's muls, cat and neg; SiLU and its mul), each a pass
over the whole activation. keepwarm's compiled CPU library (engine/attention/native.py,
csrc/fused_ops.cpp) does each module's chain in one pass per row. This module is the one place that
decides where they apply: by what a module computes, never by names. Each kind of kernel has a
reference, the transformers module whose computation it reproduces (``REFERENCES``: Llama's RMSNorm,
MLP and decoder layer, Gemma's RMSNorm, Gemma 2's decoder layer, Phi-3's MLP of one gate-and-up
product, and the rotary functions of Llama, Phi-3, GLM-4.5 and GLM); a model's module takes a kernel
when its class's forward is the reference's, compared as code (``same_computation``: bytecode,
constants, defaults and the globals it reads), so Qwen, Mistral, Gemma, Phi-3, Granite, SmolLM3,
the Qwen-VL text models and the other architectures built from Llama's modules are found without a
list, and a transformers release that changes one simply stops fusing it.

- RMSNorm: the module's class becomes a subclass whose forward calls ``keepwarm_cpu.rms_norm``
  (Gemma's, which scales by ``1 + w`` in float32 and rounds once: ``keepwarm_cpu.gemma_rms_norm``).
- MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` whose ``act_fn`` is SiLU:
  ``down_proj(silu_and_mul(gate_proj(x), up_proj(x)))``; GELU's tanh form (Gemma's):
  ``gelu_tanh_and_mul``. The projections stay the modules they are (packed, LoRA's hooks,
  tensor-parallel shards). Where both would take the AMX kernel and no hook watches them, a SiLU
  MLP's products and activation are one operator (``cpu_linear.gate_up_silu``: the same bits, the
  activation rearranged once, no intermediate written and read again). Phi-3's and GLM's MLP, one
  ``gate_up_proj`` whose halves are the gate and the up: ``down_proj(silu_and_mul_halves(gate_up_proj(x)))``.
- Attention whose forward calls an ``apply_rotary_pos_emb`` that is Llama's (the whole head), Phi-3's
  or GLM-4.5's (its first dims, the rest passed through) or GLM's (its first dims turned in pairs):
  its forward, the same code, runs with that global bound to the fused kernel (a copy of the function
  with its own globals, so transformers' module and every other model in the process keep the
  original), and DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (pairs in, halves out), which its
  attention calls instead where its config's ``rope_interleave`` is on, too. The copy is of the
  innermost forward, under the decorators transformers puts on it (the ``past_key_values`` ->
  ``cache`` renaming, which keepwarm's calls do not need, and the ``kernels`` package's routing of hub
  kernels, which keepwarm does not use).
- Decoder layer: the residual add after attention and the post-attention RMSNorm are one kernel
  (``keepwarm_cpu.add_rms_norm``; ``add_gemma_rms_norm`` where that norm is Gemma's, as in Gemma's
  layer, which is Llama's code). Gemma 2's and 3's layer puts a norm after each sublayer as well
  (the reference is Gemma 2's): the norm after the attention, the residual add and the norm before the
  MLP are one kernel (``gemma_norm_add_norm``), the norm after the MLP and its residual add another
  (``gemma_norm_add``).

Each fused forward falls back to the module's own for inputs its kernel does not take (another dtype
or device, a non-contiguous activation, a rotary of another shape, autograd), so no input fails for
want of a kernel.

Only on CPU and only when the library loads (else one line in the log and nothing changes). The kernels
round where the modules round, so in bfloat16 and float16 a result differs from the module's only where
RMSNorm's sum of squares (summed in another order) or an activation's exp (a float32 polynomial, where
torch uses Sleef) lands a float32 intermediate on the other side of a 16-bit rounding boundary: one unit
in the last place of the 16-bit result, rarely (28 of 1.9 million RMSNorm outputs over the unit tests'
shapes, no SiLU-and-mul output). GELU's tanh form is computed as the sigmoid it equals, exact where
torch's ``1 + tanh`` cancels (gates below -1: 1e-5 relative at -3, up to 100% below it, where ours agree
with float64): there the two differ by up to 2^-23 of the gate. In float32 the others differ from
torch's by a few float32 ulps (at most 4 over those shapes; rotary is exact), as the float32 linear
kernel's sums do (engine/cpu_linear.py): greedy tokens stay the unfused modules' and a logprob moves by
float32 rounding (stated tolerance 1e-4 nats, tested against the unfused engine). In a float32 decode
step of a small model these chains were a tenth of the time (10M Llama, 64 x 128 tokens: 1.10x over the
unfused modules in one run).
``--no-cpu-fused-ops`` turns it off.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from keepwarm_runtime.engine.attention import native
from keepwarm_runtime.engine.cpu_linear import gate_up_silu

log = logging.getLogger(__name__)

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROTARY_NAME = "apply_rotary_pos_emb"  # the global an attention forward calls
LLAMA = "transformers.models.llama.modeling_llama"
GEMMA = "transformers.models.gemma.modeling_gemma"
GEMMA2 = "transformers.models.gemma2.modeling_gemma2"
PHI3 = "transformers.models.phi3.modeling_phi3"
GLM4_MOE = "transformers.models.glm4_moe.modeling_glm4_moe"
GLM = "transformers.models.glm.modeling_glm"
DEEPSEEK_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"
INTERLEAVE_NAME = "apply_rotary_pos_emb_interleave"  # DeepSeek-V3's, beside ROTARY_NAME in its attention


# The norms around a sandwich layer's sublayers (Gemma 2's and 3's), which its fused forward replaces.
SANDWICH_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# The decoder layer kind by its post-attention norm's kind: the residual add and that norm as one kernel.
LAYER_BY_NORM = {"rms_norm": "decoder_layer", "gemma_rms_norm": "gemma_decoder_layer"}


@dataclass(frozen=True)
class Reference:
    """What a kind's kernel computes: a transformers class's methods (the forward, and what it calls on
    self), and the attributes they read, which a module must have before its class is compared."""

    module: str  # modelling module, imported only when a model has a module with ``attrs``
    cls: str
    methods: tuple[str, ...]
    attrs: tuple[str, ...]


REFERENCES = {
    "rms_norm": Reference(LLAMA, "LlamaRMSNorm", ("forward",), ("weight", "variance_epsilon")),
    "gemma_rms_norm": Reference(GEMMA, "GemmaRMSNorm", ("forward", "_norm"), ("weight", "eps")),
    "mlp": Reference(LLAMA, "LlamaMLP", ("forward",), ("gate_proj", "up_proj", "down_proj", "act_fn")),
    "gate_up_mlp": Reference(PHI3, "Phi3MLP", ("forward",), ("gate_up_proj", "down_proj", "activation_fn")),
    "decoder_layer": Reference(
        LLAMA,
        "LlamaDecoderLayer",
        ("forward",),
        ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),
    ),
    "sandwich_layer": Reference(
        GEMMA2,
        "Gemma2DecoderLayer",
        ("forward",),
        (*SANDWICH_NORMS, "self_attn", "mlp", "input_layernorm"),
    ),
}
# The rotary functions the kernels compute, by attention kind, tried in this order: Llama's rotates the
# whole head; Phi-3's the first dims of it (cos's width), passing the rest through, and GLM-4.5's
# (GLM-4-MoE's: GPT-NeoX, MiniMax-M2 and others share it) is the same computation in other code; GLM's
# turns its first dims in pairs (x[2i], x[2i + 1]) rather than as two halves.
PARTIAL_ROTARY = "partial_rotary_attention"
PAIRS_ROTARY = "pairs_rotary_attention"  # GLM's and GLM 4's: the rotary dims turned in pairs
ROTARY_REFERENCES = (
    ("attention", LLAMA),
    (PARTIAL_ROTARY, PHI3),
    (PARTIAL_ROTARY, GLM4_MOE),
    (PAIRS_ROTARY, GLM),
)
# The MLP kinds: the activation attribute and, per kernel, the kind it becomes (GELU-tanh: Gemma's).
MLP_KINDS = {
    "mlp": ("act_fn", {"silu": "mlp", "gelu_tanh": "gelu_tanh_mlp"}),
    "gate_up_mlp": ("activation_fn", {"silu": "gate_up_mlp"}),
}
# The norm kinds' epsilon attribute (their forwards read it by name).
NORM_EPS = {"rms_norm": "variance_epsilon", "gemma_rms_norm": "eps"}
_DOCSTRING_FLAG = 0x4000000  # CO_HAS_DOCSTRING (Python 3.14): flags the docstring's own constant


@dataclass
class FusedModules:
    """What ``use_fused_ops`` attached: modules per kind (all zero when it attached nothing)."""

    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def plain_function(obj: object) -> types.FunctionType | None:
    """The Python function ``obj`` runs: itself, or the one a ``kernels`` hub wrapper (an nn.Module
    transformers puts around some functions, which calls it while no hub kernel is active, and keepwarm
    activates none) holds; None for anything else."""
    if isinstance(obj, types.FunctionType):
        return obj
    forward = getattr(type(obj), "forward", None)
    if isinstance(obj, nn.Module) and isinstance(forward, types.FunctionType) and forward.__closure__:
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=True))
        if "func" in cells and isinstance(held := cells["func"].cell_contents, types.FunctionType):
            return held
    return None


def _same_code(a: types.CodeType, b: types.CodeType, doc_a: object = None, doc_b: object = None) -> bool:
    """One bytecode, names, variables and constants (a function's docstring aside: ``doc_*``)."""
    if (
        a.co_code != b.co_code
        or a.co_names != b.co_names
        or a.co_varnames != b.co_varnames
        or a.co_freevars != b.co_freevars
        or a.co_cellvars != b.co_cellvars
        or a.co_exceptiontable != b.co_exceptiontable
        or (a.co_argcount, a.co_posonlyargcount, a.co_kwonlyargcount)
        != (b.co_argcount, b.co_posonlyargcount, b.co_kwonlyargcount)
        or (a.co_flags & ~_DOCSTRING_FLAG) != (b.co_flags & ~_DOCSTRING_FLAG)
    ):
        return False
    consts_a, consts_b = list(a.co_consts), list(b.co_consts)
    for consts, doc in ((consts_a, doc_a), (consts_b, doc_b)):
        if consts and consts[0] is doc:  # the docstring (None without one, before Python 3.14)
            consts.pop(0)
    if len(consts_a) != len(consts_b):
        return False
    for x, y in zip(consts_a, consts_b, strict=True):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it read (globals among them)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def same_computation(a: Callable, b: Callable, depth: int = 4) -> bool:
    """Whether functions ``a`` and ``b`` compute the same, whatever their names, docstrings and
    modules: one bytecode and constants, the same defaults and closure, and every global they read
    the same object in both or (functions, ``depth`` deep) the same computation. False when unsure."""
    a, b = plain_function(a), plain_function(b)
    if a is None or b is None:
        return False
    if a is b:
        return True
    if (
        depth <= 0
        or a.__defaults__ != b.__defaults__
        or a.__kwdefaults__ != b.__kwdefaults__
        or not _same_code(a.__code__, b.__code__, a.__doc__, b.__doc__)
    ):
        return False
    cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
    if any(x.cell_contents is not y.cell_contents for x, y in zip(cells_a, cells_b, strict=True)):
        return False
    for name in _names(a.__code__):
        in_a, in_b = name in a.__globals__, name in b.__globals__
        if in_a != in_b:
            return False
        if in_a:
            x, y = a.__globals__[name], b.__globals__[name]
            if x is not y and not same_computation(x, y, depth - 1):
                return False
    return True


def _reference_class(kind: str) -> type:
    ref = REFERENCES[kind]
    return getattr(importlib.import_module(ref.module), ref.cls)


@functools.cache
def computes(cls: type[nn.Module], kind: str) -> bool:
    """Whether ``cls``'s methods are ``kind``'s reference's, as code (under the decorators on them)."""
    reference = _reference_class(kind)
    for method in REFERENCES[kind].methods:
        mine, theirs = getattr(cls, method, None), getattr(reference, method, None)
        if (
            mine is None
            or theirs is None
            or not same_computation(inspect.unwrap(mine), inspect.unwrap(theirs))
        ):
            return False
    return True


@functools.cache
def rotary_kind(cls: type[nn.Module]) -> str | None:
    """The attention kind of ``cls``: its forward calls a global ``apply_rotary_pos_emb`` that computes
    what one of ``ROTARY_REFERENCES`` does; None otherwise."""
    own = plain_function(inspect.unwrap(getattr(cls, "forward", None)))
    if own is None or ROTARY_NAME not in own.__code__.co_names or ROTARY_NAME not in own.__globals__:
        return None
    rotary = own.__globals__[ROTARY_NAME]
    for kind, module in ROTARY_REFERENCES:
        if same_computation(rotary, getattr(importlib.import_module(module), ROTARY_NAME)):
            return kind
    return None


def interleaves(forward: types.FunctionType) -> bool:
    """Whether ``forward`` also calls a global ``apply_rotary_pos_emb_interleave`` that computes what
    DeepSeek-V3's does (its reference is imported only for a forward that names it)."""
    if INTERLEAVE_NAME not in forward.__code__.co_names or INTERLEAVE_NAME not in forward.__globals__:
        return False
    reference = getattr(importlib.import_module(DEEPSEEK_V3), INTERLEAVE_NAME)
    return same_computation(forward.__globals__[INTERLEAVE_NAME], reference)


def _activation(act: object) -> str | None:
    """Which kernel computes ``act``: SiLU, GELU's tanh form as torch computes it, or none."""
    from transformers.activations import GELUTanh, SiLUActivation

    if type(act) in (SiLUActivation, nn.SiLU):
        return "silu"
    if type(act) is nn.GELU and act.approximate == "tanh":
        return "gelu_tanh"
    partial = getattr(act, "act", None) if type(act) is GELUTanh else None
    if isinstance(partial, functools.partial) and partial.func is torch.nn.functional.gelu:
        return "gelu_tanh" if partial.keywords == {"approximate": "tanh"} else None  # not its Python form
    return None


def module_kind(module: nn.Module) -> str | None:
    """The fused forward ``module`` takes, by what its class computes (and its MLP's activation; and
    for a decoder layer, which RMSNorm its post-attention norm is, which the fused add takes the place
    of: Gemma's layer is Llama's, its norm Gemma's; a sandwich layer's three norms must be Gemma's)."""
    cls = type(module)
    if (fused := FUSED_KINDS.get(cls)) is not None:
        return fused
    for kind, ref in REFERENCES.items():
        if all(hasattr(module, attr) for attr in ref.attrs) and computes(cls, kind):
            if kind in MLP_KINDS:
                attr, kernels = MLP_KINDS[kind]
                return kernels.get(_activation(getattr(module, attr)))
            if kind == "decoder_layer":
                return LAYER_BY_NORM.get(module_kind(module.post_attention_layernorm))
            if kind == "sandwich_layer":
                norms = {module_kind(getattr(module, name)) for name in SANDWICH_NORMS}
                return kind if norms == {"gemma_rms_norm"} else None
            if kind in NORM_EPS and not _norm_fits(module, NORM_EPS[kind]):
                return None
            return kind
    return rotary_kind(cls) if callable(getattr(cls, "forward", None)) else None


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


def _norm_fits(norm: nn.Module, eps: str) -> bool:
    """A norm module the kernels can serve: a [hidden] weight (not one that broadcasts) and a number
    eps, looked at once when it is fused (its calls check only what varies: the input)."""
    weight = norm.weight
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.numel() > 1
        and isinstance(getattr(norm, eps), (float, int))
    )


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
    return _act_and_mul(self, "silu_and_mul", x)


def _gelu_tanh_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(self, "gelu_tanh_and_mul", x)


def _act_and_mul(mlp: nn.Module, op: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if not _takes(gate, up) or gate.shape != up.shape:
        return mlp.down_proj(mlp.act_fn(gate) * up)
    out = torch.empty_like(gate)
    native.op(op)(out, gate, up)
    return mlp.down_proj(out)


def _gate_up_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    up_states = self.gate_up_proj(hidden_states)
    if not _takes(up_states) or up_states.shape[-1] % 2:
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * self.activation_fn(gate))
    out = up_states.new_empty(*up_states.shape[:-1], up_states.shape[-1] // 2)
    native.op("silu_and_mul_halves")(out, up_states)
    return self.down_proj(out)


def _attend(layer: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict, **named) -> torch.Tensor:
    """A pre-norm layer's input norm and attention, called as its reference calls them (``named``);
    ``cache`` may come under the name transformers deprecates (the layer's own forward renames it)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    normed = layer.input_layernorm(hidden_states)
    out, _ = layer.self_attn(hidden_states=normed, cache=cache, **named, **kwargs)
    return out


def _pre_norm_layer(op: str, eps: str) -> Callable:
    """Llama's pre-norm layer with ``residual + attention`` and the post-attention norm fused: kernel
    ``op`` for the norm's kind, whose epsilon attribute is ``eps``."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = _attend(
            self,
            hidden_states,
            cache,
            kwargs,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
        )
        norm = self.post_attention_layernorm
        if _takes(hidden_states, residual, norm.weight) and hidden_states.shape == residual.shape:
            summed, normed = torch.empty_like(residual), torch.empty_like(residual)
            native.op(op)(normed, summed, hidden_states, residual, norm.weight, getattr(norm, eps))
            residual, hidden_states = summed, normed
        else:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        return residual + self.mlp(hidden_states)

    return forward


def _sandwich_layer_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    **kwargs,
) -> torch.Tensor:
    """Gemma 2's and 3's layer: the norm after the attention, the residual add and the norm before the
    MLP are one kernel, the norm after the MLP and the residual add another (Gemma's RMSNorm, each step
    rounded where the modules round)."""
    residual = hidden_states
    hidden_states = _attend(
        self,
        hidden_states,
        cache,
        kwargs,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
    )
    post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
    if _takes(hidden_states, residual, post.weight, pre.weight) and hidden_states.shape == residual.shape:
        summed, normed = torch.empty_like(residual), torch.empty_like(residual)
        native.op("gemma_norm_add_norm")(
            normed, summed, hidden_states, residual, post.weight, post.eps, pre.weight, pre.eps
        )
        residual, hidden_states = summed, normed
    else:
        residual = residual + post(hidden_states)
        hidden_states = pre(residual)
    hidden_states = self.mlp(hidden_states)
    last = self.post_feedforward_layernorm
    if _takes(hidden_states, residual, last.weight) and hidden_states.shape == residual.shape:
        summed = torch.empty_like(residual)
        native.op("gemma_norm_add")(summed, hidden_states, residual, last.weight, last.eps)
        return summed
    return residual + last(hidden_states)


def fused_rotary(original: Callable, kind: str = "attention") -> Callable:
    """``apply_rotary_pos_emb`` on the fused kernel, ``original`` for what the kernel does not take.
    ``kind``: which reference ``original`` computes (``ROTARY_REFERENCES``, or ``INTERLEAVE_NAME`` for
    DeepSeek-V3's interleaved function); Phi-3's, GLM-4.5's and GLM's rotate cos's width of each head
    and pass the rest, Llama's and DeepSeek-V3's the whole head."""
    partial = kind in (PARTIAL_ROTARY, PAIRS_ROTARY)
    kernel = {PAIRS_ROTARY: "rotary_embedding_pairs", INTERLEAVE_NAME: "rotary_embedding_interleave"}.get(
        kind, "rotary_embedding"
    )
    if kind == INTERLEAVE_NAME:  # its signature: position_ids before unsqueeze_dim, unused as in DeepSeek's

        def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        rotary_dims = cos.shape[-1] if cos.dim() else 0
        if (
            unsqueeze_dim != 1
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or cos.shape != sin.shape
            or (rotary_dims > q.shape[-1] or rotary_dims % 2 if partial else rotary_dims != q.shape[-1])
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
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        native.op(kernel)(q_out, k_out, q, k, cos, sin)
        return q_out, k_out

    return apply_rotary_pos_emb_interleave if kind == INTERLEAVE_NAME else apply_rotary_pos_emb


FORWARDS = {
    "rms_norm": _rms_norm_forward,
    "gemma_rms_norm": _gemma_rms_norm_forward,
    "mlp": _mlp_forward,
    "gelu_tanh_mlp": _gelu_tanh_mlp_forward,
    "gate_up_mlp": _gate_up_mlp_forward,
    "decoder_layer": _pre_norm_layer("add_rms_norm", NORM_EPS["rms_norm"]),
    "gemma_decoder_layer": _pre_norm_layer("add_gemma_rms_norm", NORM_EPS["gemma_rms_norm"]),
    "sandwich_layer": _sandwich_layer_forward,
}


FUSED_KINDS: dict[type[nn.Module], str] = {}  # each fused class made below -> its kind


@functools.cache
def fused_class(cls: type[nn.Module], kind: str) -> type[nn.Module]:
    """The subclass of ``cls`` with the fused forward for ``kind`` (one of ``module_kind``'s)."""
    forward = FORWARDS.get(kind)
    if forward is None:  # attention: its own forward, with the rotary global bound to the kernel
        own = plain_function(inspect.unwrap(cls.forward))  # under the kwarg renaming and `kernels`' routing
        assert own is not None and kind in dict(ROTARY_REFERENCES), (cls, kind)
        scope = dict(own.__globals__)
        scope[ROTARY_NAME] = fused_rotary(own.__globals__[ROTARY_NAME], kind)
        if interleaves(own):  # DeepSeek-V3's attention calls it where its config's rope_interleave is on
            scope[INTERLEAVE_NAME] = fused_rotary(own.__globals__[INTERLEAVE_NAME], INTERLEAVE_NAME)
        forward = types.FunctionType(own.__code__, scope, own.__name__, own.__defaults__, own.__closure__)
        forward.__kwdefaults__ = own.__kwdefaults__
        functools.update_wrapper(forward, own)  # its source, for engine/attention/fuser.py
    # the model's class name (its refusals, logs and repr name the model's classes), this module's
    namespace = {"forward": forward, "__module__": __name__, "__qualname__": cls.__qualname__}
    fused = type(cls.__name__, (cls,), namespace)
    FUSED_KINDS[fused] = kind
    return fused


def use_fused_ops(model: nn.Module, dtype: torch.dtype, kernel_cache: str | None = None) -> FusedModules:
    """Give ``model``'s modules that compute what a kernel does their fused forwards, when ``dtype`` is
    one the kernels serve and keepwarm's CPU library loads (``kernel_cache``: the node's builds, tried
    first)."""
    fused = FusedModules()
    if dtype not in FUSED_DTYPES:
        return fused
    try:
        native.load(kernel_cache)
    except native.KernelUnavailable as exc:
        log.info("fused CPU kernels off, keepwarm's CPU library cannot be built here: %s", exc)
        return fused
    for module in model.modules():
        if type(module) in FUSED_KINDS:  # fused by an earlier call: its forward is already the kernel's
            continue
        kind = module_kind(module)
        if kind is not None:
            module.__class__ = fused_class(type(module), kind)
            fused.counts[kind] = fused.counts.get(kind, 0) + 1
    log.info(
        "fused CPU kernels: %s", ", ".join(f"{n} {k}" for k, n in sorted(fused.counts.items())) or "none"
    )
    return fused
