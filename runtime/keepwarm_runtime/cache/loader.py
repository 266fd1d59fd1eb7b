"""Filling an arena from a checkpoint (daemon) and the plain disk load (client fallback).

The daemon reads each tensor's bytes once, hashes them into the content digest as they pass, and
writes them into the arena already converted to the serving dtype and laid out as the engine serves
them (expert merges; see keepwarm_runtime.engine.moe.serving_layout), so clients never convert. The
read path is three small steps per tensor (``read_tensor_bytes`` -> digest -> ``write_serving_tensor``)
so that a conversion step has one place to go.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

import torch

from keepwarm_runtime.cache.checkpoint import (
    CONVERTIBLE,
    CheckpointError,
    FileIdentity,
    Shard,
    TensorRecord,
    dtype_name,
    parse_dtype,
)
from keepwarm_runtime.engine.moe import serving_layout

ALIGN = 256  # bytes; satisfies every dtype and CUDA's preferred alignment


@dataclass(frozen=True)
class TensorEntry:
    name: str  # checkpoint tensor name
    dtype: torch.dtype  # dtype in the arena (serving dtype for floats)
    shape: tuple[int, ...]
    offset: int  # byte offset in the arena, ALIGN-aligned
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.name, dtype_name(self.dtype), list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, row: list[Any]) -> TensorEntry:
        name, dtype, shape, offset, nbytes = row
        return cls(str(name), parse_dtype(dtype), tuple(int(d) for d in shape), int(offset), int(nbytes))


@dataclass(frozen=True)
class ArenaLayout:
    entries: tuple[TensorEntry, ...]
    size: int  # bytes needed, before page rounding
    placements: dict[str, serving_layout.Placement] = field(default_factory=dict)  # merged sources


def tensor_serving_dtype(name: str, stored: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """Floats follow the serving dtype, except FP8 block scales (kept float32)."""
    return serving_layout.tensor_dtype(name, stored, serving, CONVERTIBLE)


def plan_layout(shards: list[Shard], serving: torch.dtype) -> ArenaLayout:
    records = [(rec.name, rec.shape, rec.dtype) for shard in shards for rec in shard.tensors]
    rules = serving_layout.merge_rules(shards[0].path.parent) if shards else []
    conversion = serving_layout.plan(records, rules)
    targets = {t.name: t for t in conversion.targets}
    entries, offset = [], 0
    for name, shape, stored in records:
        placement = conversion.placements.get(name)
        if placement is not None:
            target = targets.pop(placement.target, None)
            if target is None:  # already placed with an earlier source
                continue
            name, shape, stored = target.name, target.shape, target.stored
        dtype = tensor_serving_dtype(name, stored, serving)
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        entries.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return ArenaLayout(tuple(entries), offset, conversion.placements)


class WritableArena(Protocol):
    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...


def fill_arena(arena: WritableArena, shards: list[Shard], layout: ArenaLayout) -> str:
    """Copy every tensor into ``arena`` (converting dtype); return the sha256 content digest.

    The digest covers each shard's header and tensor bytes as stored, in file order. Each shard is
    read from a descriptor whose identity must equal the one its header was read with, before and
    after the copy: a file replaced or rewritten meanwhile fails the load instead of mixing bytes.
    """
    by_name = {e.name: e for e in layout.entries}
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(shard.header)
        with open(shard.path, "rb", buffering=0) as f:
            _check_identity(shard, f.fileno())
            for rec in shard.tensors:
                raw = read_tensor_bytes(f, shard, rec)
                digest.update(raw)
                placement = layout.placements.get(rec.name)
                entry = by_name[placement.target if placement else rec.name]
                write_serving_tensor(arena, entry, rec, raw, placement)
                del raw
            _check_identity(shard, f.fileno())
    return digest.hexdigest()


def _check_identity(shard: Shard, fd: int) -> None:
    if FileIdentity.of(os.fstat(fd)) != shard.identity:
        raise CheckpointError(f"{shard.path}: changed on disk while it was being loaded")


def read_tensor_bytes(f: BinaryIO, shard: Shard, rec: TensorRecord) -> bytearray:
    """The stored bytes of one tensor (what the content digest covers)."""
    raw = bytearray(rec.nbytes)
    f.seek(rec.offset)
    got = f.readinto(raw)
    if got != rec.nbytes:
        raise CheckpointError(f"{shard.path}: short read for {rec.name} ({got} of {rec.nbytes} bytes)")
    return raw


def write_serving_tensor(
    arena: WritableArena,
    entry: TensorEntry,
    rec: TensorRecord,
    raw: bytearray,
    placement: serving_layout.Placement | None = None,
) -> None:
    """Convert one stored tensor into its serving layout in the arena: the serving dtype, and for an
    expert merged into a fused 3-D tensor, that expert's slice of it.

    Conversion steps slot in here; they must be named in the key's ``conversion`` field.
    """
    if rec.nbytes == 0:
        return
    src = torch.frombuffer(raw, dtype=torch.uint8).view(rec.dtype).view(rec.shape)
    dest = arena.tensor(entry.offset, entry.dtype, entry.shape)
    if placement is not None:  # one expert's slice of a merged tensor
        dest = dest[placement.expert, placement.rows[0] : placement.rows[1]]
    dest.copy_(src)


def load_from_disk(shards: list[Shard], dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Plain safetensors load, floats converted to ``dtype``: what a client does without the cache."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, t in load_file(str(shard.path), device="cpu").items():
            tensors[name] = t.to(device=device, dtype=tensor_serving_dtype(name, t.dtype, dtype))
    return tensors
