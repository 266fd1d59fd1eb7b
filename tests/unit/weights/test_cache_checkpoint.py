"""Shard validation: every malformed header is a CheckpointError naming the file, never a traceback."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.weights.checkpoint import CheckpointError, read_checkpoint, read_shard
from keepwarm_runtime.weights.files import changed_shards


def _shard(path: Path, table: object, data: bytes = b"", raw_header: bytes | None = None) -> Path:
    header = raw_header if raw_header is not None else json.dumps(table).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def test_good_shard_parses(tmp_path: Path):
    shard = read_shard(_shard(tmp_path / "m.safetensors", GOOD, bytes(16)))
    (rec,) = shard.tensors
    assert (rec.name, rec.dtype, rec.shape, rec.nbytes) == ("w", torch.float32, (2, 2), 16)
    assert shard.identity.size == shard.size == 8 + len(json.dumps(GOOD)) + 16


@pytest.mark.parametrize(
    ("table", "data", "raw", "message"),
    [
        (None, b"", b"not json", "not valid JSON"),
        (None, b"", b"[" * 60000, "not valid JSON"),
        (["w"], b"", None, "not a JSON object"),
        ({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), None, "unsupported dtype"),
        ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(8), None, "past the end"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, bytes(16), None, "do not hold"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), None, "non-negative"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), None, "past the end"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}}, bytes(4), None, "data_offsets"),
        ({"w": "F32"}, b"", None, "not an object"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            None,
            "overlap",
        ),
    ],
)
def test_malformed_shards_name_the_file(tmp_path: Path, table, data, raw, message):
    path = _shard(tmp_path / "bad.safetensors", table, data, raw)
    with pytest.raises(CheckpointError, match=message) as info:
        read_shard(path)
    assert str(path) in str(info.value)


def test_header_length_beyond_the_file(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match="implausible"):
        read_shard(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_shard(path)


def test_truncated_and_empty_files(tmp_path: Path):
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.safetensors"):
        read_checkpoint(tmp_path)
    good = _shard(tmp_path / "empty.safetensors", GOOD, bytes(16))
    good.write_bytes(good.read_bytes()[:-1])  # truncated by one byte
    with pytest.raises(CheckpointError, match="past the end"):
        read_checkpoint(tmp_path)


def test_tensor_in_two_shards_and_bad_index(tmp_path: Path):
    _shard(tmp_path / "a.safetensors", GOOD, bytes(16))
    _shard(tmp_path / "b.safetensors", GOOD, bytes(16))
    with pytest.raises(CheckpointError, match="also in"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../etc/passwd"}}')
    with pytest.raises(CheckpointError, match="plain file names"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="index"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "gone.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"gone\.safetensors"):
        read_checkpoint(tmp_path)


def test_changed_shards_sees_rewrites_and_removals(tmp_path: Path):
    path = _shard(tmp_path / "m.safetensors", GOOD, bytes(16))
    shards = read_checkpoint(tmp_path)
    assert changed_shards(shards) == []
    with open(path, "r+b") as f:  # same size, same header
        f.seek(-4, 2)
        f.write(b"\x01\x02\x03\x04")
    assert changed_shards(shards) == [path]
    path.unlink()
    assert changed_shards(shards) == [path]
