"""Filling an arena from a checkpoint (daemon) and the plain disk load (client fallback).

The daemon reads each tensor's bytes once, hashes them into the content digest as they pass, and
writes them into the arena already converted to the serving dtype, so clients never convert. The
read path is three small steps per tensor (``read_tensor_bytes`` -> digest -> ``write_serving_tensor``)
so that a conversion step has one place to go.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import torch

from keepwarm_runtime.cache.checkpoint import (
    CheckpointError,
    FileIdentity,
    Shard,
    TensorRecord,
    dtype_name,
    parse_dtype,
    serving_dtype,
)

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


def plan_layout(shards: list[Shard], serving: torch.dtype) -> ArenaLayout:
    entries, offset = [], 0
    for shard in shards:
        for rec in shard.tensors:
            dtype = serving_dtype(rec.dtype, serving)
            numel = rec.nbytes // rec.dtype.itemsize if rec.dtype.itemsize else 0
            nbytes = numel * dtype.itemsize
            entries.append(TensorEntry(rec.name, dtype, rec.shape, offset, nbytes))
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return ArenaLayout(tuple(entries), offset)


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
                write_serving_tensor(arena, by_name[rec.name], rec, raw)
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


def write_serving_tensor(arena: WritableArena, entry: TensorEntry, rec: TensorRecord, raw: bytearray) -> None:
    """Convert one stored tensor to its serving layout (today: the serving dtype) into the arena.

    Conversion steps (FP8 repacking, renames) slot in here; they must be named in the key's
    ``conversion`` field.
    """
    if rec.nbytes == 0:
        return
    src = torch.frombuffer(raw, dtype=torch.uint8).view(rec.dtype).view(rec.shape)
    arena.tensor(entry.offset, entry.dtype, entry.shape).copy_(src)


def load_from_disk(shards: list[Shard], dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Plain safetensors load, floats converted to ``dtype``: what a client does without the cache."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, t in load_file(str(shard.path), device="cpu").items():
            target = serving_dtype(t.dtype, dtype)
            tensors[name] = t.to(device=device, dtype=target)
    return tensors
