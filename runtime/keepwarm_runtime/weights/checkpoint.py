"""Reading a safetensors checkpoint directory without a framework: shard list, headers, identity.

The daemon and the fingerprint both need the tensor table of every shard; parsing the header
ourselves (8-byte length + JSON) reads no weight bytes and lets the daemon copy each tensor straight
into its arena. Every header is validated here (offsets inside the file, known dtypes, shapes that
match their byte ranges, no overlaps) so that a bad shard is refused, naming the file, before the
daemon evicts or allocates anything. Each shard also carries its file identity from ``fstat`` of
the descriptor its header was read from: the cheap half of "these are the same bytes". The
directory's config.json is read here too (``read_config``), for the key and the quantization.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """The directory is not a readable, well-formed safetensors checkpoint; the message names the file."""


@dataclass(frozen=True)
class FileIdentity:
    """What ``stat`` says about a shard: equal identities mean the same file, unchanged since.

    ``ctime_ns`` cannot be set by a user (any write, chmod or utime moves it), so a rewrite that
    restores size and mtime still changes the identity.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.device, self.inode, self.size, self.mtime_ns, self.ctime_ns)


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
    identity: FileIdentity  # fstat of the descriptor the header was read from


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def shard_paths(model_dir: Path) -> list[Path]:
    """Shards named by ``model.safetensors.index.json`` (or every ``*.safetensors``), sorted."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = {str(name) for name in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        if any("/" in n or n in ("", ".", "..") for n in names):
            raise CheckpointError(f"{index}: shard names must be plain file names in {model_dir}")
        return sorted(model_dir / name for name in names)
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{model_dir} has no *.safetensors files")
    return paths


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
    try:
        with open(path, "rb") as f:
            identity = FileIdentity.of(os.fstat(f.fileno()))
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: {len(raw)} bytes is too short for a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES or 8 + length > identity.size:
                raise CheckpointError(
                    f"{path}: header length {length} is implausible for a {identity.size}-byte file"
                )
            header = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(header) != length:
        raise CheckpointError(f"{path}: file shrank while its header was read")
    return Shard(path, identity.size, header, parse_header(path, header, identity.size), identity)


def read_checkpoint(model_dir: str | Path) -> list[Shard]:
    """Every shard of ``model_dir``, validated; a tensor name in two shards is refused."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory")
    shards = [read_shard(p) for p in shard_paths(model_dir)]
    seen: dict[str, Path] = {}
    for shard in shards:
        for rec in shard.tensors:
            if rec.name in seen:
                raise CheckpointError(f"{shard.path}: tensor {rec.name!r} is also in {seen[rec.name]}")
            seen[rec.name] = shard.path
    return shards


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict ({} without one); invalid JSON raises ValueError naming the file."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def current_identities(shards: list[Shard]) -> list[FileIdentity | None]:
    """``stat`` of each shard path now (None where it is gone): one system call per shard."""
    out: list[FileIdentity | None] = []
    for shard in shards:
        try:
            out.append(FileIdentity.of(os.stat(shard.path)))
        except OSError:
            out.append(None)
    return out


def changed_shards(shards: list[Shard]) -> list[Path]:
    """Shards whose file on disk is no longer the one that was read."""
    now = current_identities(shards)
    return [s.path for s, ident in zip(shards, now, strict=True) if ident != s.identity]


def serving_dtype(stored: torch.dtype, serving: torch.dtype) -> torch.dtype:
    """The dtype a tensor is served in: floats follow the serving dtype, the rest stay as stored."""
    return serving if stored in CONVERTIBLE else stored
