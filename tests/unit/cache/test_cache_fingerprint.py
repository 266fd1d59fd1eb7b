"""WeightCacheKey: header-and-size hash, field-by-field mismatch, no weight bytes read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.checkpoint import read_checkpoint
from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key


def test_identical_weights_in_two_directories_match(tiny_llama: Path, tmp_path: Path):
    copy = shutil.copytree(tiny_llama, tmp_path / "elsewhere")
    assert compute_key(tiny_llama, torch.bfloat16) == compute_key(copy, torch.bfloat16)


def test_weight_bytes_are_not_hashed(tiny_llama: Path, tmp_path: Path):
    copy = shutil.copytree(tiny_llama, tmp_path / "flipped")
    shard = read_checkpoint(copy)[0]
    rec = shard.tensors[-1]
    with open(shard.path, "r+b") as f:  # same size, different weight bytes, same header
        f.seek(rec.offset)
        f.write(bytes(b ^ 0xFF for b in f.read(16)))
        f.seek(rec.offset)
    assert compute_key(copy, torch.bfloat16) == compute_key(tiny_llama, torch.bfloat16)


def test_mismatch_names_the_differing_fields(tiny_llama: Path):
    a = compute_key(tiny_llama, torch.bfloat16)
    b = compute_key(tiny_llama, torch.float32, tp_rank=1, tp_size=2)
    assert a.diff(b) == ["dtype", "tp_rank", "tp_size"]
    assert a.diff(a) == []


def test_changed_header_changes_checkpoint_hash(tiny_llama: Path, tmp_path: Path):
    copy = shutil.copytree(tiny_llama, tmp_path / "renamed")
    shard = read_checkpoint(copy)[0]
    raw = shard.path.read_bytes()
    old = shard.tensors[0].name.encode()
    new = old[:-1] + (b"X" if old[-1:] != b"X" else b"Y")  # same length: offsets stay valid
    shard.path.write_bytes(raw.replace(old, new, 1))
    assert compute_key(tiny_llama, "bfloat16").diff(compute_key(copy, "bfloat16")) == ["checkpoint"]


def test_quantization_and_revision(tiny_llama: Path, tmp_path: Path):
    snap = shutil.copytree(tiny_llama, tmp_path / "snapshots" / "abc123")
    config = json.loads((snap / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (snap / "config.json").write_text(json.dumps(config))
    key = compute_key(snap, "bfloat16")
    assert key.revision == "abc123"
    assert compute_key(tiny_llama, "bfloat16").diff(key) == ["quantization", "revision"]


def test_wire_round_trip_and_missing_fields(tiny_llama: Path):
    key = compute_key(tiny_llama, "bfloat16")
    assert WeightCacheKey.from_dict(key.to_dict()) == key
    partial = key.to_dict()
    del partial["dtype"]
    with pytest.raises(ValueError, match="dtype"):
        WeightCacheKey.from_dict(partial)
