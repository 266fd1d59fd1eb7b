"""Build a transformers causal LM on the meta device and fill it from attached tensors, without a copy.

Parameters become the attached tensors themselves: views of the cache daemon's arena, or of the
private arena the disk path fills from the same plan (weights/arena.py), so they arrive in the serving
layout either way (experts merged, online FP8 quantized, the kernel's expert layout applied) and the
loader never asks where they came from. Tied parameters share one tensor. Non-persistent buffers
(rotary inv_freq, Gemma's embed_scale) are materialised on the target device and recomputed by
transformers' own initialisation, which skips every loaded tensor. Checkpoint names that
transformers 5 renames while loading are handled: regex renamings map names (no copy); an expert
merge the plan could not make (per-expert gate/up/down -> fused 3-D tensors, FP8 block scales alike)
stacks experts here, a copy. Any other conversion is refused with the names involved. FP8
checkpoints and `--quantization fp8` go through engine.quant; fused experts run on the MoE backend
engine.moe chooses per module; `expert_layout="flashinfer_cutlass"` marks the experts whose halves
the attach swapped (weights.kernel_layout). What is attached (online FP8 settings, the expert layout)
is resolved from the config and checkpoint before this model exists (engine/prefetch.py
``attach_request``), so the server's background attach asks the same and the loader takes it.
A tensor-parallel rank gives its meta parameters the shapes of its shard
(weights.tensor_parallel_plan, engine/parallel/layers.py) before attaching that shard, checks that
every rank attached the same checkpoint, and adds the layers' collectives after filling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from keepwarm_runtime.cache.client import attach
from keepwarm_runtime.engine.attention.dispatch import register_keepwarm_attention
from keepwarm_runtime.engine.attention.fuser import IMPLEMENTATION
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.engine.moe.experts import ExpertsChoice, prepare_experts, use_keepwarm_experts
from keepwarm_runtime.engine.multimodal import model_class as multimodal_model_class
from keepwarm_runtime.engine.parallel import group as parallel_group
from keepwarm_runtime.engine.parallel import layers as parallel_layers
from keepwarm_runtime.engine.prefetch import WeightPrefetch, attach_request
from keepwarm_runtime.engine.quant.fp8_modules import prepare_checkpoint_fp8
from keepwarm_runtime.engine.startup import StartupProfile
from keepwarm_runtime.weights import kernel_layout, serving_layout
from keepwarm_runtime.weights.fp8 import E4M3
from keepwarm_runtime.weights.quantization import SCALE_SUFFIX, Fp8Settings, QuantizationError, fp8_settings
from keepwarm_runtime.weights.tensor_parallel import ShardingError
from keepwarm_runtime.weights.tensor_parallel_plan import ShardPlan, shard_plan

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded as-is; the message says what is missing or unsupported."""


@dataclass
class LoadInfo:
    source: str  # "cache" | "disk"
    seconds: float  # attach/load wall time
    reason: str | None  # why the cache was not used, if it was not
    copied_tensors: int = 0  # tensors copied here: disk-path merges, layout, quantization; kernel repacks
    moe: list[ExpertsChoice] = field(default_factory=list)  # backend chosen per experts module, with why


def load_model(
    config: EngineConfig, profile: StartupProfile | None = None, prefetch: WeightPrefetch | None = None
) -> tuple[nn.Module, LoadInfo]:
    """The model with its weights attached; ``profile`` gets the config, model_meta and weights marks.

    ``prefetch``: an attach the server began in the background (engine/prefetch.py); used when it
    asked for what this config asks for, else the weights are attached here. Either way the attach
    is ``attach_request(config)``: resolved from the config and checkpoint, not from this model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    profile = profile or StartupProfile()
    hf_config = AutoConfig.from_pretrained(config.model_dir)
    quantization = _quantization(hf_config, config)
    _refuse_unsupported(hf_config)
    register_keepwarm_attention()
    profile.mark("config")
    try:
        with serving_layout.BUILD_LOCK, torch.device("meta"):  # the default dtype is per process
            attn, cls = attention_implementations(hf_config), multimodal_model_class(hf_config)
            if cls is not None:  # audio-language models: not registered with AutoModelForCausalLM
                model = cls._from_config(hf_config, dtype=config.torch_dtype, attn_implementation=attn)
            else:
                model = AutoModelForCausalLM.from_config(
                    hf_config, dtype=config.torch_dtype, attn_implementation=attn
                )
    except (KeyError, ValueError, NotImplementedError) as exc:  # e.g. GIT picks attention classes by name
        raise ModelLoadError(
            f"{hf_config.model_type}: transformers cannot build this model with "
            f"attn_implementation={IMPLEMENTATION!r} ({type(exc).__name__}: {exc}); its attention does "
            "not go through the transformers registry, so keepwarm cannot run it"
        ) from exc
    model.eval()
    plan = _shard(model, config, cls is not None)
    profile.mark("model_meta")
    try:
        prefetched = prefetch.take(config) if prefetch is not None else None
        profile.weights_prefetched = prefetched is not None
        if prefetched is None:
            request = attach_request(config)  # from the config and checkpoint, as the prefetch asks
            prefetched = request, attach(**request.arguments())
    except ShardingError as exc:  # a shard off the FP8 block boundaries, found planning the arena
        raise ModelLoadError(str(exc)) from exc
    request, res = prefetched
    if plan.styles:  # a rank of a group
        if res.reason is not None:
            log.warning(
                "rank %d of %d: its shard loads from disk (%s)",
                plan.sharding.rank,
                plan.sharding.size,
                res.reason,
            )
        parallel_group.check_same_checkpoint(res.files, res.source)
    # The attach quantized online FP8 and converted the expert layout (from the cache or from disk,
    # the same plan: weights/arena.py), so the model only declares what its tensors now are.
    if quantization is not None:
        _prepare_fp8(model, quantization, res)
    copied = fill_parameters(model, res.tensors, res.aliases)
    materialize_buffers(model, torch.device(config.device))
    mark_expert_layout(model, request.expert_layout)
    _check_fp8_scales(model)
    moe = _prepare_moe(model, config)
    if plan.styles:
        parallel_layers.install(model, plan, moe)
    copied += sum(choice.copied for choice in moe)
    profile.weights_source, profile.weights_attach_s = res.source, res.seconds
    weights_s = profile.mark("weights")
    if plan.styles:  # each rank's own line (bench/_restart_group.py reads it)
        log.info(
            "rank %d of %d: weights from %s in %.4fs (attach %.4fs)",
            plan.sharding.rank,
            plan.sharding.size,
            res.source,
            weights_s,
            res.seconds,
        )
    return model, LoadInfo(res.source, res.seconds, res.reason, copied, moe)


def _shard(model: nn.Module, config: EngineConfig, multimodal: bool) -> ShardPlan:
    """This rank's plan (weights.tensor_parallel), its meta parameters shaped as the rank holds them;
    a model that cannot be split so is refused by name before any weight is read."""
    sharding = config.sharding
    if sharding.sharded and multimodal:
        raise ModelLoadError(
            f"{type(model).__name__}: keepwarm serves audio-language models on one rank only "
            f"(tensor_parallel_size {sharding.size})"
        )
    try:
        plan = shard_plan(model, sharding, grouped=config.distributed_init_method is not None)
    except ShardingError as exc:
        raise ModelLoadError(str(exc)) from exc
    parallel_layers.shard_parameters(model, plan)
    return plan


def mark_expert_layout(model: nn.Module, layout: str) -> None:
    """Mark the experts whose tensors `layout` (the attach request's, resolved for the checkpoint)
    converted (the attach did, from cache or disk), so their MoE backend reads [up; gate] halves."""
    for full in kernel_layout.layout_targets(model, layout):
        module_name = full.rpartition(".")[0]
        setattr(model.get_submodule(module_name), kernel_layout.UP_FIRST_ATTR, True)


def _prepare_moe(model: nn.Module, config: EngineConfig) -> list[ExpertsChoice]:
    """Route transformers' fused experts through keepwarm's MoE backends (engine.moe)."""
    if not use_keepwarm_experts(model):
        return []
    return prepare_experts(model, config.moe_backend, torch.device(config.device))


def attention_implementations(hf_config) -> str | dict[str, str]:
    """keepwarm for the text model only; a vision or audio encoder keeps transformers' own default
    (SDPA where that encoder supports it, eager where not: forcing SDPA fails on e.g. GIT's vision)."""
    sub_configs = getattr(hf_config, "sub_configs", None) or {}
    if not sub_configs:
        return IMPLEMENTATION
    text = hf_config.get_text_config()
    choice = {name: IMPLEMENTATION for name in sub_configs if getattr(hf_config, name, None) is text}
    choice[""] = IMPLEMENTATION
    return choice


def _quantization(hf_config, config: EngineConfig) -> Fp8Settings | None:
    """FP8 settings from the checkpoint's quantization_config or --quantization; any other method refused."""
    try:
        return fp8_settings(getattr(hf_config, "quantization_config", None), config.quantization)
    except QuantizationError as exc:
        raise ModelLoadError(f"{hf_config.model_type}: {exc}") from exc


def _prepare_fp8(model: nn.Module, quantization: Fp8Settings, res) -> None:
    """FP8 weights (a checkpoint's, or the attach's online quantization): e4m3 + block-scale placeholders
    wherever the attached tensors carry scales, asked by model name through transformers' renamings
    (Mixtral's `block_sparse_moe.experts.*` are the model's `mlp.experts.*`)."""
    lookup = _Lookup(res.tensors, res.aliases, _conversions(model))
    try:
        prepare_checkpoint_fp8(model, quantization, lambda name: lookup.unmerged(name) is not None)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from exc


def _check_fp8_scales(model: nn.Module) -> None:
    """Every e4m3 weight must have its block scales: e4m3 read as if it were float is silently wrong."""
    unscaled = [
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if param.dtype == E4M3 and not hasattr(module, name + SCALE_SUFFIX)
    ]
    if unscaled:
        raise ModelLoadError(
            f"{len(unscaled)} FP8 weights have no block scales (weight_scale_inv) in the checkpoint or "
            f"cache: {', '.join(unscaled[:6])}"
        )


def _refuse_unsupported(hf_config) -> None:
    text = hf_config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or [])
    unsupported = layer_types - {"full_attention", "sliding_attention"}
    if unsupported:
        raise ModelLoadError(
            f"{hf_config.model_type}: layer types {sorted(unsupported)} are not attention through the "
            "transformers registry (linear/recurrent/chunked layers); keepwarm refuses this model"
        )


def fill_parameters(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> int:
    """Point every parameter and persistent buffer at an attached tensor; return how many were copies."""
    lookup = _Lookup(tensors, aliases, _conversions(model))
    groups: dict[int, list[tuple[nn.Module, str, str, torch.Tensor]]] = {}  # tied weights share an id
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            groups.setdefault(id(param), []).append((module, name, full, param))
    missing: list[str] = []
    for members in groups.values():
        found = next((t for t in (lookup.get(full) for _, _, full, _ in members) if t is not None), None)
        if found is None:
            missing.append(members[0][2])
            continue
        expected = members[0][3]
        if tuple(found.shape) != tuple(expected.shape):
            raise ModelLoadError(
                f"{members[0][2]}: checkpoint shape {tuple(found.shape)} != model {tuple(expected.shape)}"
            )
        new = nn.Parameter(found, requires_grad=False)
        new._is_hf_initialized = True  # transformers' init must never write into (read-only) attached memory
        for module, name, _, _ in members:
            module._parameters[name] = new
    non_persistent = {
        f"{mn}.{bn}" if mn else bn for mn, m in model.named_modules() for bn in m._non_persistent_buffers_set
    }
    for full, buffer in list(model.named_buffers()):
        if full in non_persistent or buffer is None:
            continue
        found = lookup.get(full)
        if found is None:
            missing.append(full)
            continue
        found._is_hf_initialized = True
        _set(model, full, found, buffer=True)
    if missing:
        raise ModelLoadError(
            f"{len(missing)} tensors of {type(model).__name__} are not in the checkpoint (or need a weight "
            f"conversion keepwarm does not implement): {', '.join(missing[:8])}"
        )
    return lookup.copied


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers were built on meta: allocate them and let transformers recompute them."""
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
    model.initialize_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ModelLoadError(f"{name} is still on the meta device after loading")


def _set(model: nn.Module, full: str, tensor: torch.Tensor, buffer: bool) -> None:
    module_name, _, name = full.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    (module._buffers if buffer else module._parameters)[name] = tensor


class _Lookup:
    """Model tensor name -> attached tensor, through aliases, renamings and expert merges."""

    def __init__(self, tensors, aliases, conversions):
        self.tensors, self.aliases = tensors, aliases
        self.renamings, self.merges = conversions
        self.copied = 0
        self._renamed: dict[str, str] | None = None

    def get(self, name: str) -> torch.Tensor | None:
        found = self.unmerged(name)
        if found is not None:
            return found
        for merge in self.merges:
            # Experts are looked up by their renamed names: Mixtral's checkpoint says
            # `block_sparse_moe.experts.0.w1`, the merge asks for `mlp.experts.0.w1`.
            merged = merge(name, self.unmerged)
            if merged is not None:
                self.copied += 1
                return merged
        return None

    def unmerged(self, name: str) -> torch.Tensor | None:
        direct = self._direct(name)
        if direct is not None:
            return direct
        if self._renamed is None:
            self._renamed = {}
            for ckpt in [*self.tensors, *self.aliases]:
                target = serving_layout.model_name(ckpt, self.renamings)
                if target != ckpt:
                    self._renamed[target] = ckpt
        renamed = self._renamed.get(name)
        return self._direct(renamed) if renamed is not None else None

    def _direct(self, name: str) -> torch.Tensor | None:
        if name in self.tensors:
            return self.tensors[name]
        if name in self.aliases:
            return self.tensors.get(self.aliases[name])
        return None


def _conversions(model: nn.Module):
    """transformers' own load-time conversions for this model, as (renamings, merge functions)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:  # an older transformers without conversion mappings
        return [], []
    mapping = get_model_conversion_mapping(model)
    merges = []
    for transform in mapping:
        if isinstance(transform, WeightConverter):
            ops = [type(op) for op in transform.operations]
            if (
                ops not in ([MergeModulelist], [MergeModulelist, Concatenate])
                or len(transform.target_patterns) != 1
            ):
                merges.append(_refusal(transform))
                continue
            merges.append(_expert_merge(transform))
            merges.append(_expert_merge(_fp8_scales_of(transform)))
    return serving_layout.renamings(mapping), merges


def _fp8_scales_of(transform):
    """The same expert merge for FP8 block scales: `experts.*.gate_proj.weight_scale_inv` + up ->
    `experts.gate_up_proj_scale_inv` (stacked and concatenated exactly like the weights)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        source_patterns=[p + SCALE_SUFFIX for p in transform.source_patterns],
        target_patterns=[p + SCALE_SUFFIX for p in transform.target_patterns],
        operations=transform.operations,
    )


def _expert_merge(transform):
    """`mlp.experts.*.gate_proj.weight` + `...up_proj.weight` -> stacked (and concatenated) `gate_up_proj`."""
    target = transform.target_patterns[0]
    stack_dim = transform.operations[0].dim
    cat_dim = transform.operations[1].dim if len(transform.operations) > 1 else None

    def merge(name: str, direct) -> torch.Tensor | None:
        if not name.endswith(target):
            return None
        prefix = name[: -len(target)]
        parts = []
        for source in transform.source_patterns:
            experts = []
            for i in range(1 << 16):
                tensor = direct(prefix + source.replace("*", str(i)))
                if tensor is None:
                    break
                experts.append(tensor)
            if not experts:
                return None
            parts.append(torch.stack(experts, dim=stack_dim))
        return torch.cat(parts, dim=cat_dim) if cat_dim is not None else parts[0]

    return merge


def _refusal(transform):
    def refuse(name: str, direct) -> None:
        if any(name.endswith(t) for t in transform.target_patterns):
            raise ModelLoadError(
                f"{name}: transformers converts checkpoint tensors {transform.source_patterns} with "
                f"{[type(op).__name__ for op in transform.operations]}, which keepwarm does not implement"
            )
        return None

    return refuse
