"""LoRA adapters in the node cache: what an adapter directory is, how it is keyed and laid out.

A PEFT adapter directory holds ``adapter_config.json`` and one small safetensors checkpoint,
``adapter_model.safetensors``. The daemon holds the checkpoint's tensors as stored (floats in the
serving dtype, like a model's), in a plain layout: none of the model conversions apply (expert merges,
online FP8, kernel layouts; ``loader.plain_layout``), so a daemon serving FP8 or a kernel layout still
serves adapters as the engine reads them. The config stays on disk: the engine reads it (a few
hundred bytes) and checks it against its base on every load (engine/lora/adapter.py).

An adapter's key is a model's (``fingerprint.compute_key``: identity by file, so a rewritten
``adapter_model.safetensors`` is a miss and never served stale) with two fields that tell it apart
from any model: ``architecture`` is ``ADAPTER_ARCHITECTURE`` and ``conversion`` is
``ADAPTER_CONVERSION``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key
from keepwarm_runtime.weights.files import CheckpointError, ShardFile, read_shard_file

if TYPE_CHECKING:
    import torch

    from keepwarm_runtime.weights.arena import ArenaLayout
    from keepwarm_runtime.weights.checkpoint import Shard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KIND_MODEL, KIND_ADAPTER = "model", "adapter"  # what a resident entry holds (``list``, ``stats``)
KINDS = (KIND_MODEL, KIND_ADAPTER)
ADAPTER_ARCHITECTURE = "peft-lora"  # the key's architecture field for every adapter
ADAPTER_CONVERSION = "adapter-plain-1"  # the key's conversion field: tensors as stored (plain_layout)


def is_adapter_dir(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file()


def adapter_file(directory: str | Path) -> ShardFile:
    """The adapter's one shard as a file (its header read, not parsed: no torch); CheckpointError
    names what is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if not is_adapter_dir(directory):
        raise CheckpointError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter directory")
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (only safetensors adapters are cached)")
    return read_shard_file(path)


def read_adapter(directory: str | Path) -> list[Shard]:
    """The adapter's one shard, its header validated; CheckpointError names the file."""
    from keepwarm_runtime.weights.checkpoint import parse_shard

    return [parse_shard(adapter_file(directory))]


def adapter_key(directory: str | Path, dtype: torch.dtype | str, shards: list[ShardFile]) -> WeightCacheKey:
    """The key of an adapter served in ``dtype``: its file's identity and header, marked an adapter."""
    key = compute_key(directory, dtype, shards=shards, conversion=ADAPTER_CONVERSION)
    return replace(key, architecture=ADAPTER_ARCHITECTURE, quantization="none")


def is_adapter_key(key: WeightCacheKey) -> bool:
    return key.architecture == ADAPTER_ARCHITECTURE and key.conversion == ADAPTER_CONVERSION


def adapter_layout(shards: list[Shard], dtype: torch.dtype) -> ArenaLayout:
    from keepwarm_runtime.weights.arena import plain_layout

    return plain_layout(shards, dtype)
