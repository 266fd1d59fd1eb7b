"""The serving layout: the tensors the engine uses, planned from a checkpoint's tensor list (pure).

An arena is written in this layout once (the weight-cache daemon's, or a client's private one on a
miss: weights/arena.py), so the engine gets what it serves with no per-process copy either way.
Today that is two conversions:

- expert merges, exactly as transformers' own conversion mapping for the architecture defines them:
  per-expert `mlp.experts.<i>.gate_proj.weight` + `up_proj` stacked over experts and concatenated
  into `mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj` stacked into `[E, H, I]`; FP8 block
  scales (`..._scale_inv`) merged the same way beside them;
- FP8 block scales stay float32 whatever the serving dtype (as transformers keeps them).

A plan says, for each checkpoint tensor, where its bytes land: a target tensor and an index into
it. The disk path gives the same numbers: the engine's loader merges per-expert tensors the same
way (engine/loader.py), so the cache and the disk path are bit-identical. `layouts.CONVERSION_ID`
is part of the weight cache key: a change to this layout must change it. A MoE kernel's own expert layout
(weights.kernel_layout) is one more conversion on top, asked for by name and keyed with it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keepwarm_runtime.weights.quantization import SCALE_SUFFIX

KEEP_FLOAT32_SUFFIXES = (SCALE_SUFFIX,)  # FP8 block scales: never rounded to the serving dtype


@dataclass(frozen=True)
class MergeRule:
    """One of transformers' expert merges: sources (with `*` for the expert index) -> one target."""

    sources: tuple[str, ...]  # e.g. ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")
    target: str  # e.g. "mlp.experts.gate_up_proj"
    concatenated: bool  # sources concatenated along dim 1 after stacking (gate_up); else one source


@dataclass(frozen=True)
class Placement:
    target: str  # arena tensor name
    expert: int  # index along the stacked (first) dimension
    rows: tuple[int, int]  # [start, stop) along dim 1 of the target (the concatenation axis)


@dataclass(frozen=True)
class Target:
    name: str
    shape: tuple[int, ...]
    stored: torch.dtype  # dtype of its sources in the checkpoint


@dataclass(frozen=True)
class ServingPlan:
    targets: tuple[Target, ...] = ()  # merged tensors, in the order of their first source
    placements: dict[str, Placement] = field(default_factory=dict)  # checkpoint name -> where it goes

    def merged(self, name: str) -> bool:
        return name in self.placements


def tensor_dtype(
    name: str, stored: torch.dtype, serving: torch.dtype, convertible: Iterable[torch.dtype]
) -> torch.dtype:
    """The dtype `name` is served in: floats follow the serving dtype, except FP8 block scales."""
    if stored not in convertible or name.endswith(KEEP_FLOAT32_SUFFIXES):
        return stored
    return serving


def with_scales(rules: list[MergeRule]) -> list[MergeRule]:
    """Each merge, plus the same merge for FP8 block scales (`<weight>_scale_inv` -> `<target>_scale_inv`)."""
    scaled = [
        MergeRule(tuple(s + SCALE_SUFFIX for s in r.sources), r.target + SCALE_SUFFIX, r.concatenated)
        for r in rules
    ]
    return [*rules, *scaled]


def _matcher(source: str) -> re.Pattern[str]:
    head, _, tail = source.partition("*")
    return re.compile(rf"^(?P<prefix>.*?){re.escape(head)}(?P<expert>\d+){re.escape(tail)}$")


def plan(records: Iterable[tuple[str, tuple[int, ...], torch.dtype]], rules: list[MergeRule]) -> ServingPlan:
    """Group per-expert checkpoint tensors into merged targets; leave everything else as it is.

    A group merges only when it is complete and regular: experts 0..E-1 present for every source, all
    of one shape and dtype. Anything else stays unmerged (the engine's loader then merges or refuses)."""
    records = list(records)
    found: dict[tuple[int, str], dict[int, dict[int, tuple[str, tuple[int, ...], torch.dtype]]]] = {}
    for name, shape, dtype in records:
        for r_i, rule in enumerate(rules):
            for s_i, source in enumerate(rule.sources):
                match = _matcher(source).match(name)
                if match:
                    group = found.setdefault((r_i, match["prefix"]), {})
                    group.setdefault(s_i, {})[int(match["expert"])] = (name, tuple(shape), dtype)
    order = {name: i for i, (name, _, _) in enumerate(records)}
    targets, placements = [], {}
    for (r_i, prefix), by_source in found.items():
        rule = rules[r_i]
        if len(by_source) != len(rule.sources):
            continue
        experts = len(by_source[0])
        members = [m for s in range(len(rule.sources)) for m in by_source[s].values()]
        if any(sorted(by_source[s]) != list(range(experts)) for s in by_source):
            continue
        if len({(shape, dtype) for _, shape, dtype in members}) != 1 or len(members[0][1]) != 2:
            continue
        rows, cols = members[0][1]
        name = prefix + rule.target
        targets.append(
            (order[members[0][0]], Target(name, (experts, rows * len(rule.sources), cols), members[0][2]))
        )
        for s, source_experts in by_source.items():
            for e, (src, _, _) in source_experts.items():
                placements[src] = Placement(name, e, (s * rows, (s + 1) * rows))
    return ServingPlan(tuple(t for _, t in sorted(targets, key=lambda x: x[0])), placements)


# torch's default dtype is one per process, and transformers' from_config sets it to the model's for
# the build and puts back what it found after. Two builds in two threads (a disk attach's plan in the
# background and the engine's own model, or an in-process daemon's) would interleave and leave one
# build's dtype behind for every later torch.zeros. Every model build in keepwarm holds this lock.
BUILD_LOCK = threading.RLock()


def meta_model(model_dir: str | Path):
    """The model of `model_dir` built on the meta device (no weights read), or None when there is no
    config.json or transformers cannot build it."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        return None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        json.loads(config_path.read_text())  # a broken config is "no model", not a daemon crash
        config = AutoConfig.from_pretrained(model_dir)
        with BUILD_LOCK, torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture transformers cannot build: serve the checkpoint as stored
        return None


def _conversion_mapping(model) -> list:
    if model is None:
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return list(get_model_conversion_mapping(model))
    except Exception:  # an older transformers without conversion mappings
        return []


def merge_rules(model) -> list[MergeRule]:
    """transformers' expert merges for `model` (from `meta_model`). Empty for a model without merges,
    or None (transformers could not build it)."""
    try:
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return []
    rules = []
    for transform in _conversion_mapping(model):
        if not isinstance(transform, WeightConverter) or len(transform.target_patterns) != 1:
            continue
        ops = [type(op) for op in transform.operations]
        stacked_on_0 = ops and ops[0] is MergeModulelist and transform.operations[0].dim == 0
        if ops == [MergeModulelist] and stacked_on_0:
            rules.append(MergeRule(tuple(transform.source_patterns), transform.target_patterns[0], False))
        elif ops == [MergeModulelist, Concatenate] and stacked_on_0 and transform.operations[1].dim == 1:
            rules.append(MergeRule(tuple(transform.source_patterns), transform.target_patterns[0], True))
    return with_scales(rules)


def renamings(mapping: Iterable) -> list[tuple[str, str]]:
    """transformers' regex renamings (checkpoint name -> model name) among a conversion mapping."""
    try:
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    pairs = []
    for transform in mapping:
        if isinstance(transform, WeightRenaming):
            targets = transform.target_patterns * len(transform.source_patterns)
            pairs += list(zip(transform.source_patterns, targets, strict=False))
    return pairs


def model_renamings(model) -> list[tuple[str, str]]:
    return renamings(_conversion_mapping(model))


def model_name(checkpoint_name: str, pairs: list[tuple[str, str]]) -> str:
    """The model's name for a checkpoint (or arena) tensor name, after transformers' renamings."""
    for pattern, repl in pairs:
        checkpoint_name = re.sub(pattern, repl, checkpoint_name)
    return checkpoint_name


def is_experts_module(module) -> bool:
    """A module transformers' `@use_experts_implementation` prepared (it sets `has_gate`): fused experts,
    whatever their layout (engine.moe serves them; the plans here convert them)."""
    return hasattr(module, "has_gate") and hasattr(module, "down_proj")
