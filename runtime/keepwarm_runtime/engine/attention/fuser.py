"""Find the attention call inside transformers modules and attach a KeepwarmAttention to each.

For every module class, the forward source is parsed once: the call made through transformers'
attention registry (`ALL_ATTENTION_FUNCTIONS.get_interface(...)` or `ALL_ATTENTION_FUNCTIONS[...]`,
usually via a local variable) must be unique, and its `scaling=` argument must be a constant or
`self.<attr>`, which is read from the module at attach time. A class whose attention cannot be
resolved (the registry used some other way, or a transformers forward without readable source) is
refused by name, never skipped. The layer index is the module's own
`layer_idx` (LongCat-Flash style decoders hold two attentions per layer, 2L and 2L+1), never a count.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from keepwarm_runtime.engine.attention.layer import KeepwarmAttention

REGISTRY_NAME = "ALL_ATTENTION_FUNCTIONS"
ATTACHED_NAME = "keepwarm_attn"
IMPLEMENTATION = "keepwarm"


class AttentionFusionError(ValueError):
    """A model's attention cannot be run by keepwarm; the message names the class and the reason."""


@dataclass(frozen=True)
class AttentionCall:
    class_name: str
    scaling_kind: str  # "const" | "attr" | "default" (no scaling= argument, or scaling=None)
    scaling_value: float | str | None  # the constant, or the attribute name for "attr"


def _is_registry_lookup(node: ast.AST) -> bool:
    """`ALL_ATTENTION_FUNCTIONS[...]` or `ALL_ATTENTION_FUNCTIONS.get_interface(...)` / `.get(...)`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Name) and node.value.id == REGISTRY_NAME
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        return isinstance(owner, ast.Name) and owner.id == REGISTRY_NAME
    return False


def _attention_calls(tree: ast.AST) -> list[ast.Call]:
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and node.value is not None
        and _is_registry_lookup(node.value)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ((isinstance(node.func, ast.Name) and node.func.id in aliases) or _is_registry_lookup(node.func))
    ]


@functools.cache
def analyze_class(cls: type) -> AttentionCall | None:
    """The registry call in `cls.forward`, or None when the class does not dispatch attention itself."""
    forward = getattr(cls, "forward", None)
    if forward is None or cls.forward is nn.Module.forward:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(forward)))
    except (OSError, TypeError):
        if cls.__module__.startswith("transformers."):
            raise AttentionFusionError(
                f"{cls.__name__}.forward has no readable source; keepwarm cannot tell whether it "
                "dispatches attention, so it refuses the model rather than skip the module"
            ) from None
        return None
    if REGISTRY_NAME not in source:
        return None
    tree = ast.parse(source)
    if not any(isinstance(node, ast.Name) and node.id == REGISTRY_NAME for node in ast.walk(tree)):
        return None  # named in a comment or string only
    calls = _attention_calls(tree)
    if not calls:
        raise AttentionFusionError(
            f"{cls.__name__}.forward uses {REGISTRY_NAME} but not as a call keepwarm can resolve "
            "(e.g. handed to a helper); keepwarm refuses the model rather than skip the module"
        )
    if len(calls) > 1:
        raise AttentionFusionError(
            f"{cls.__name__}.forward calls the attention registry {len(calls)} times; "
            "keepwarm needs exactly one"
        )
    scaling = next((kw.value for kw in calls[0].keywords if kw.arg == "scaling"), None)
    if scaling is None or (isinstance(scaling, ast.Constant) and scaling.value is None):
        return AttentionCall(cls.__name__, "default", None)
    if isinstance(scaling, ast.Constant) and isinstance(scaling.value, (int, float)):
        return AttentionCall(cls.__name__, "const", float(scaling.value))
    if (
        isinstance(scaling, ast.Attribute)
        and isinstance(scaling.value, ast.Name)
        and scaling.value.id == "self"
    ):
        return AttentionCall(cls.__name__, "attr", scaling.attr)
    raise AttentionFusionError(
        f"{cls.__name__}: cannot resolve the softmax scale from `scaling={ast.unparse(scaling)}`; "
        "keepwarm accepts a constant or self.<attribute>"
    )


def resolve_scale(module: nn.Module, call: AttentionCall) -> float | None:
    if call.scaling_kind == "const":
        return float(call.scaling_value)
    if call.scaling_kind == "attr":
        value = getattr(module, call.scaling_value, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
            value = value.item()
        if not isinstance(value, (int, float)):
            raise AttentionFusionError(
                f"{call.class_name}: scaling=self.{call.scaling_value} is {value!r}, not a number"
            )
        return float(value)
    return None


def fuse_attention(root: nn.Module) -> list[KeepwarmAttention]:
    """Attach one KeepwarmAttention under every attention module in `root`; return them by layer index."""
    attached: dict[int, tuple[str, KeepwarmAttention]] = {}
    for name, module in list(root.named_modules()):
        if isinstance(module, KeepwarmAttention):
            continue
        call = analyze_class(type(module))
        if call is None:
            continue
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
            raise AttentionFusionError(
                f"{call.class_name} at '{name}' has no integer layer_idx (got {layer_idx!r}); "
                "keepwarm takes KV-cache layer indices from the module, never from layer counts"
            )
        if getattr(module, "is_causal", True) is False:
            raise AttentionFusionError(
                f"{call.class_name} at '{name}' is not causal (is_causal=False: an encoder, cross-"
                "attention, or a BERT-style model without is_decoder); keepwarm's attention is causal only"
            )
        if layer_idx in attached:
            raise AttentionFusionError(
                f"layer_idx {layer_idx} is used by both '{attached[layer_idx][0]}' and '{name}'; "
                "every attention module needs its own index"
            )
        layer = KeepwarmAttention(layer_idx, resolve_scale(module, call), call.class_name)
        setattr(module, ATTACHED_NAME, layer)
        attached[layer_idx] = (name, layer)
    if not attached:
        raise AttentionFusionError(
            f"no module under {type(root).__name__} dispatches attention through transformers' registry; "
            "keepwarm cannot run this model"
        )
    return [layer for _, (_, layer) in sorted(attached.items())]
