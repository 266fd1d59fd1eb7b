"""Reading a safetensors checkpoint directory without a framework: shard list, headers, dtypes.

The daemon and the fingerprint both need the tensor table of every shard; parsing the header
ourselves (8-byte length + JSON) reads no weight bytes and lets the daemon copy each tensor straight
into its arena.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype code -> torch dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# Floating dtypes that are converted to the serving dtype; others (ints, fp8 quantized) stay as stored.
CONVERTIBLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(Exception):
    """The directory is not a readable safetensors checkpoint."""


@dataclass(frozen=True)
class TensorRecord:
    name: str  # checkpoint tensor name
    dtype: torch.dtype  # dtype as stored in the file
    shape: tuple[int, ...]
    file: Path  # shard that holds it
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


@dataclass(frozen=True)
class Shard:
    path: Path
    size: int  # file size in bytes
    header: bytes  # raw JSON header (what the fingerprint hashes)
    tensors: tuple[TensorRecord, ...]  # in file order


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def shard_paths(model_dir: Path) -> list[Path]:
    """Shards named by ``model.safetensors.index.json`` (or every ``*.safetensors``), sorted."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{model_dir} has no *.safetensors files")
    return paths


def read_shard(path: Path) -> Shard:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header of {length} bytes is implausible")
        header = f.read(length)
    size = path.stat().st_size
    table = json.loads(header)
    base = 8 + length
    records = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
        records.append(
            TensorRecord(
                name, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), path, base + begin, end - begin
            )
        )
    records.sort(key=lambda r: r.offset)
    return Shard(path, size, header, tuple(records))


def read_checkpoint(model_dir: str | Path) -> list[Shard]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory")
    return [read_shard(p) for p in shard_paths(model_dir)]


def serving_dtype(stored: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """The dtype a tensor is served in: floats follow the serving dtype, the rest stay as stored."""
    return serving if stored in CONVERTIBLE else stored
