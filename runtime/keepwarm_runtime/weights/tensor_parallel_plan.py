"""Which split each tensor of a model gets over tensor-parallel ranks (pure; meta-device models).

A group of ``size`` ranks splits a model as transformers' own plan declares it (its config class's
``base_model_tp_plan``, the model class's ``_tp_plan``); where a model declares none for a layer the
engine must split, keepwarm's documented plan (``KEEPWARM_PLANS``) fills in, and the input embedding
and output head (the model's own ``get_input_embeddings``/``get_output_embeddings``) are always
vocabulary-parallel.
The styles keepwarm honours, and what each makes of a module's tensors:

- ``colwise``: a Linear's output features split (weight dim 0, bias dim 0); a bare parameter named by
  the plan (gpt-oss' attention ``sinks``) split along dim 0. Attention heads stay whole: the query,
  key and value projections split on head boundaries, so each rank's KV cache holds its own heads.
- ``rowwise``: input features split (weight dim 1); the bias is held by rank 0 only (zeros elsewhere),
  so the one all-reduce the engine runs after the layer adds it once.
- ``embedding_rowwise``: a vocabulary-parallel embedding: rows split (the last rank may hold fewer);
  each rank looks up the ids it holds and an all-reduce assembles them.
- ``colwise_gather_output``: the vocabulary-parallel LM head: rows split as the embedding's, the
  logits gathered.
- ``replicated_with_grad_allreduce``, ``mla_kv_a_proj``: every rank holds the whole tensor.
- fused experts (``weights.serving_layout.is_experts_module``), keepwarm's own: with expert parallel
  (``Sharding.expert``) the experts themselves are partitioned (dim 0 of every tensor; the router stays
  whole and each rank runs the experts it holds); without, each expert's intermediate size is split
  (``[gate; up]`` halves split apart, interleaved gpt-oss columns in even chunks; the down projection
  along its input, its bias on rank 0 only). Either way one all-reduce after the experts combines them.

Everything else is replicated. A model with no row-parallel layer at all is refused (it declares no
plan and keepwarm has none), as is any other transformers style on a module the model has.

Attention and key/value heads must divide over the ranks (named by layer); so must every split
dimension (weights.tensor_parallel.check_split, naming the tensor). The slicing itself is
weights.tensor_parallel.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from keepwarm_runtime.weights.quantization import SCALE_SUFFIX
from keepwarm_runtime.weights.serving_layout import is_experts_module
from keepwarm_runtime.weights.tensor_parallel import (
    REPLICATED,
    Sharding,
    ShardingError,
    Split,
    check_split,
)

# transformers' style names -> the style keepwarm applies (None: replicated)
COLWISE, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD = (
    "colwise",
    "rowwise",
    "embedding_rowwise",
    "colwise_gather_output",
)
EXPERTS = "experts"  # keepwarm's: fused experts, split per Sharding.expert
TRANSFORMERS_STYLES: dict[str, str | None] = {
    COLWISE: COLWISE,
    ROWWISE: ROWWISE,
    VOCAB_EMBEDDING: VOCAB_EMBEDDING,
    VOCAB_HEAD: VOCAB_HEAD,
    "replicated_with_grad_allreduce": None,
    "mla_kv_a_proj": None,  # DeepSeek's shared latent projection: whole on every rank
}
# Plans keepwarm documents where transformers declares none (keys relative to the base model).
KEEPWARM_PLANS: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "layers.*.self_attn.q_proj": COLWISE,
        "layers.*.self_attn.k_proj": COLWISE,
        "layers.*.self_attn.v_proj": COLWISE,
        "layers.*.self_attn.sinks": COLWISE,  # one sink per query head
        "layers.*.self_attn.o_proj": ROWWISE,
    },
}


@dataclass(frozen=True)
class ShardPlan:
    """The splits of one model for one Sharding (``shard_plan``), keyed by the model's own names."""

    sharding: Sharding
    splits: dict[str, Split] = field(default_factory=dict)  # parameter name -> split (absent: replicated)
    styles: dict[str, str] = field(default_factory=dict)  # module name -> style the engine hooks

    def split_of(self, model_name: str) -> Split:
        """A model tensor's split; an FP8 ``_scale_inv`` has its weight's (``in_blocks`` counts it)."""
        if model_name.endswith(SCALE_SUFFIX):
            return self.splits.get(model_name[: -len(SCALE_SUFFIX)], REPLICATED)
        return self.splits.get(model_name, REPLICATED)


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def declared_styles(model) -> dict[str, str]:
    """Full name pattern -> transformers style name, from the model's own plan and keepwarm's."""
    text = model.config.get_text_config()
    prefix = model.base_model_prefix
    base = dict(getattr(text, "base_model_tp_plan", None) or {})
    base |= KEEPWARM_PLANS.get(text.model_type, {})
    declared = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    declared |= dict(getattr(type(model), "_tp_plan", None) or {})
    return declared


def _module_styles(model, declared: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(module name -> keepwarm style, bare parameter name -> keepwarm style)."""
    patterns = [(_pattern(key), style) for key, style in declared.items()]
    modules: dict[str, str] = {}
    params: dict[str, str] = {}
    for name, module in model.named_modules():
        if is_experts_module(module):
            modules[name] = EXPERTS
            continue
        for pattern, style in patterns:
            if pattern.fullmatch(name):
                modules[name] = _keepwarm_style(name, style)
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            for pattern, style in patterns:
                if pattern.fullmatch(full):
                    params[full] = _keepwarm_style(full, style)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is embeddings:
            modules[name] = VOCAB_EMBEDDING
        elif module is head and head is not None:
            modules[name] = VOCAB_HEAD
    return {n: s for n, s in modules.items() if s is not None}, {n: s for n, s in params.items() if s}


def _keepwarm_style(name: str, style: str) -> str | None:
    if style not in TRANSFORMERS_STYLES:
        raise ShardingError(
            f"{name}: transformers' tensor-parallel style {style!r} is not one keepwarm implements "
            f"({', '.join(sorted(TRANSFORMERS_STYLES))})"
        )
    return TRANSFORMERS_STYLES[style]


def _linear_splits(style: str) -> dict[str, Split]:
    return {
        COLWISE: {"weight": Split(0), "bias": Split(0)},
        ROWWISE: {"weight": Split(1), "bias": Split(first_rank_only=True)},
        VOCAB_EMBEDDING: {"weight": Split(0, uneven=True)},
        VOCAB_HEAD: {"weight": Split(0, uneven=True), "bias": Split(0, uneven=True)},
    }[style]


def expert_splits(module, sharding: Sharding) -> dict[str, Split]:
    """A fused experts module's tensors: partitioned by expert, or each expert's intermediate split."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if sharding.expert:
        return {n: Split(0) for n in names}
    transposed = getattr(module, "is_transposed", False)
    concatenated = getattr(module, "is_concatenated", True)
    if not getattr(module, "has_gate", False) or not hasattr(module, "gate_up_proj"):
        raise ShardingError(
            f"{type(module).__name__}: experts without a fused gate keepwarm splits only by expert; "
            "serve with expert parallel"
        )
    out_dim = 2 if transposed else 1  # gate_up: [E, 2I, H], or [E, H, 2I] transposed
    gate_up = Split(out_dim, 2 if concatenated else 1, granule=1 if concatenated else 2)
    return {
        "gate_up_proj": gate_up,
        "gate_up_proj_bias": Split(1, gate_up.parts, granule=gate_up.granule),
        "down_proj": Split(1 if transposed else 2),  # [E, H, I], or [E, I, H] transposed
        "down_proj_bias": Split(first_rank_only=True),
    }


def shard_plan(model, sharding: Sharding, grouped: bool = False) -> ShardPlan:
    """The splits of ``model`` (built on the meta device) for ``sharding``; ShardingError, naming the
    layer, where the model cannot be split so (no plan, heads or experts that do not divide). One rank
    has no plan unless ``grouped`` (a group of one: every split whole, every collective run)."""
    if not sharding.sharded and not grouped:
        return ShardPlan(sharding)
    model_type = model.config.get_text_config().model_type
    modules, bare = _module_styles(model, declared_styles(model))
    if ROWWISE not in modules.values():
        raise ShardingError(
            f"{model_type}: no tensor-parallel plan: transformers declares no base_model_tp_plan for it "
            "and keepwarm has none (weights.tensor_parallel_plan.KEEPWARM_PLANS)"
        )
    _check_heads(model, modules, sharding)
    splits: dict[str, Split] = {}
    for name, style in modules.items():
        module = model.get_submodule(name)
        rules = expert_splits(module, sharding) if style == EXPERTS else _linear_splits(style)
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            split = rules.get(pname)
            if split is None:
                raise ShardingError(
                    f"{full}: a {style} layer holds a tensor keepwarm does not know how to split"
                )
            check_split(full, tuple(param.shape), split, sharding)
            splits[full] = split
    for full, style in bare.items():
        if full in splits:
            continue
        split = Split(0) if style == COLWISE else _linear_splits(style)["weight"]
        param = model.get_parameter(full)
        check_split(full, tuple(param.shape), split, sharding)
        splits[full] = split
    return ShardPlan(sharding, splits, modules)


def _check_heads(model, modules: dict[str, str], sharding: Sharding) -> None:
    """Attention heads split whole: both head counts must divide over the ranks, named by layer."""
    text = model.config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    split_attention = sorted(
        name.rpartition(".")[0] for name, style in modules.items() if style == COLWISE and "attn" in name
    )
    if not split_attention or not isinstance(heads, int):
        return
    layer = split_attention[0]
    for count, what in (
        (heads, "attention heads (num_attention_heads)"),
        (kv_heads, "key/value heads (num_key_value_heads)"),
    ):
        if count % sharding.size:
            raise ShardingError(
                f"{layer}: {count} {what} do not divide over {sharding.size} tensor-parallel ranks"
            )


def experts_held(num_experts: int, sharding: Sharding) -> tuple[int, int]:
    """(first expert, count) this rank holds under expert parallel."""
    each = num_experts // sharding.size
    return sharding.rank * each, each


def fp8_weights(names: Iterable[str]) -> set[str]:
    """The weights among ``names`` that carry block scales (their ``_scale_inv`` is there too)."""
    names = set(names)
    return {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)} & names
