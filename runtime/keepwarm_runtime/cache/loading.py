"""Reading a model or LoRA adapter from disk into a new arena: where the cache daemon uses torch.

The daemon core (core.py) imports this module on the first load it must read from disk, never before:
a daemon that adopted every model it serves never imports torch. A load is planned first (every
header validated, the key computed, the layout planned: nothing allocated or evicted yet, so a bad
shard costs no resident model its place), then filled into the arena the core made room for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from keepwarm_runtime.cache.adapters import adapter_key, adapter_layout, read_adapter
from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key
from keepwarm_runtime.weights.arena import ArenaLayout, fill_arena, plan_layout
from keepwarm_runtime.weights.checkpoint import Shard, parse_dtype, read_checkpoint
from keepwarm_runtime.weights.kernel_layout import MODEL, conversion_id
from keepwarm_runtime.weights.quantization import online_settings
from keepwarm_runtime.weights.tensor_parallel import WHOLE, Sharding


@dataclass(frozen=True)
class LoadPlan:
    """What one load writes, decided before any arena exists."""

    key: WeightCacheKey  # what clients will attach it by
    layout: ArenaLayout  # the arena's tensor table, size and conversions
    shards: tuple[Shard, ...]  # validated headers and the identities they were read with
    quantization: str | None  # online quantization applied ("fp8"), kept for reloads
    notes: str  # what the load converts, for its log line

    @property
    def size(self) -> int:
        return self.layout.size

    def tensors(self) -> list[list[Any]]:
        """The tensor table as the daemon serves it (``get_state``, hand-off records)."""
        return [e.to_wire() for e in self.layout.entries]


def plan_model(
    path: Path, dtype: str, quantization: str | None, expert_layout: str, sharding: Sharding = WHOLE
) -> LoadPlan:
    """A model checkpoint in ``dtype``, quantized online when asked, experts in ``expert_layout``, as
    ``sharding``'s shard (one tensor-parallel rank's slice; the whole model by default)."""
    shards = read_checkpoint(path)  # validates every header before anything is evicted
    online = online_settings(path, quantization)
    conversion = conversion_id(expert_layout, sharding)
    key = compute_key(
        path, dtype, sharding.rank, sharding.size, shards=shards, conversion=conversion, online=online
    )
    layout = plan_layout(shards, parse_dtype(dtype), online, expert_layout, sharding)
    if not layout.up_first:  # a model the expert layout converts nothing in is keyed in the model layout
        key = replace(key, conversion=conversion_id(MODEL, sharding))
    notes = f", {len(layout.quantized)} quantized to fp8 online" if online is not None else ""
    if layout.up_first:
        notes += f", {len(layout.up_first)} in the {expert_layout} layout"
    applied = quantization if online is not None else None
    return LoadPlan(key, layout, tuple(shards), applied, notes)


def plan_adapter(path: Path, dtype: str) -> LoadPlan:
    """A PEFT LoRA adapter: its tensors as stored (floats in ``dtype``), keyed as an adapter."""
    shards = read_adapter(path)
    layout = adapter_layout(shards, parse_dtype(dtype))
    return LoadPlan(adapter_key(path, dtype, shards), layout, tuple(shards), None, "")


def fill(arena, plan: LoadPlan) -> str:
    """Read the plan's tensors into ``arena`` and seal it; returns the content digest. The caller
    closes the arena when this raises."""
    digest = fill_arena(arena, list(plan.shards), plan.layout)
    arena.seal()
    return digest
