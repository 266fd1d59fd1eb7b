"""Reading a safetensors checkpoint directory without a framework's loader: tensor tables, validated.

The daemon and the engine's disk path both need the tensor table of every shard; parsing the header
ourselves (8-byte length + JSON) reads no weight bytes and lets the daemon copy each tensor straight
into its arena. Every header is validated here (offsets inside the file, known dtypes, shapes that
match their byte ranges, no overlaps) so that a bad shard is refused, naming the file, before the
daemon evicts or allocates anything. The files themselves (shard list, raw headers, identities,
config.json) are read by ``files.py``, which needs no torch; this module turns them into tensor
records with torch dtypes.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keepwarm_runtime.weights import files
from keepwarm_runtime.weights.files import CheckpointError, ShardFile, read_shard_file, read_shard_files

# safetensors dtype code -> torch dtype (files.SAFETENSORS_DTYPES names them)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for code, (name, _) in files.SAFETENSORS_DTYPES.items()
}
# Floating dtypes that are converted to the serving dtype; others (ints, fp8 quantized) stay as stored.
CONVERTIBLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


@dataclass(frozen=True)
class TensorRecord:
    name: str  # checkpoint tensor name
    dtype: torch.dtype  # dtype as stored in the file
    shape: tuple[int, ...]
    file: Path  # shard that holds it
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


@dataclass(frozen=True)
class Shard(ShardFile):
    """A shard file with its header parsed and validated."""

    tensors: tuple[TensorRecord, ...]  # in file order


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _record(path: Path, name: str, info: Any, base: int, size: int) -> TensorRecord:
    """One validated tensor entry of a header; raises CheckpointError naming the file and tensor."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: entry is not an object")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CheckpointError(f"{where}: unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if begin > end or base + end > size:
        raise CheckpointError(f"{where}: bytes {begin}..{end} run past the end of the file ({size} bytes)")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{where}: {end - begin} bytes do not hold shape {shape} of {dtype}")
    return TensorRecord(name, dtype, tuple(shape), path, base + begin, end - begin)


def parse_header(path: Path, header: bytes, size: int) -> tuple[TensorRecord, ...]:
    """Tensor records of a shard whose JSON header is ``header`` and whose file has ``size`` bytes."""
    try:
        table = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    base = 8 + len(header)
    records = sorted(
        (_record(path, name, info, base, size) for name, info in table.items() if name != "__metadata__"),
        key=lambda r: (r.offset, r.nbytes),
    )
    for prev, cur in itertools.pairwise(records):
        if cur.offset < prev.offset + prev.nbytes:
            raise CheckpointError(f"{path}: tensors {prev.name!r} and {cur.name!r} overlap")
    return tuple(records)


def read_shard(path: Path) -> Shard:
    """Header, tensor table and identity of one shard (a few small reads; no weight bytes)."""
    return parse_shard(read_shard_file(path))


def parse_shard(f: ShardFile) -> Shard:
    """``f`` with its header parsed and validated (CheckpointError names the file)."""
    return Shard(f.path, f.size, f.header, f.identity, parse_header(f.path, f.header, f.size))


def read_checkpoint(model_dir: str | Path) -> list[Shard]:
    """Every shard of ``model_dir``, validated; a tensor name in two shards is refused."""
    return parse_checkpoint(read_shard_files(model_dir))


def parse_checkpoint(shard_files: list[ShardFile]) -> list[Shard]:
    """The shard files of one checkpoint, parsed and validated; a tensor name in two is refused."""
    shards = [parse_shard(f) for f in shard_files]
    seen: dict[str, Path] = {}
    for shard in shards:
        for rec in shard.tensors:
            if rec.name in seen:
                raise CheckpointError(f"{shard.path}: tensor {rec.name!r} is also in {seen[rec.name]}")
            seen[rec.name] = shard.path
    return shards


def serving_dtype(stored: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """The dtype a tensor is served in: floats follow the serving dtype, the rest stay as stored."""
    return serving if stored in CONVERTIBLE else stored
