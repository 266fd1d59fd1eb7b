"""A checkpoint directory's files, read without torch: shard list, raw headers, identities, config.json.

The cache key and the daemon's checks need a checkpoint's files, not its tensors: each shard's name,
size, raw safetensors header (8-byte length + JSON, read but not parsed here) and file identity from
``fstat`` of the descriptor the header was read from (the cheap half of "these are the same bytes"),
and the directory's config.json. That is a few small reads per shard and no framework, so a cache
daemon can check and serve arenas it adopted before anything imports torch (cache/core.py).
``checkpoint.py`` parses and validates the headers into tensor records on top of this.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20
# safetensors dtype code -> (torch's name of that dtype, bytes per element); checkpoint.py maps the
# names to torch dtypes, and a tensor table on the wire (TensorEntry.to_wire) carries the names.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
ITEMSIZE = dict(SAFETENSORS_DTYPES.values())  # dtype name -> bytes per element


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
class ShardFile:
    """One shard as a file: what the cache key hashes and the daemon re-checks before each hit."""

    path: Path
    size: int  # file size in bytes
    header: bytes  # raw JSON header (what the fingerprint hashes), not parsed here
    identity: FileIdentity  # fstat of the descriptor the header was read from


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


def read_shard_file(path: Path) -> ShardFile:
    """Raw header and identity of one shard (two small reads; the header is not parsed)."""
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
    return ShardFile(path, identity.size, header, identity)


def read_shard_files(model_dir: str | Path) -> list[ShardFile]:
    """Every shard file of ``model_dir`` (headers read, not parsed: ``checkpoint.read_checkpoint``
    validates them)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory")
    return [read_shard_file(p) for p in shard_paths(model_dir)]


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


def current_identities(shards: list[ShardFile]) -> list[FileIdentity | None]:
    """``stat`` of each shard path now (None where it is gone): one system call per shard."""
    out: list[FileIdentity | None] = []
    for shard in shards:
        try:
            out.append(FileIdentity.of(os.stat(shard.path)))
        except OSError:
            out.append(None)
    return out


def changed_shards(shards: list[ShardFile]) -> list[Path]:
    """Shards whose file on disk is no longer the one that was read."""
    now = current_identities(shards)
    return [s.path for s, ident in zip(shards, now, strict=True) if ident != s.identity]
