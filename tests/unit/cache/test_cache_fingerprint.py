"""WeightCacheKey: headers plus file identity, field-by-field mismatch, no weight bytes read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache.fingerprint import WeightCacheKey, compute_key
from keepwarm_runtime.weights.checkpoint import read_checkpoint


def test_a_copy_has_equal_headers_but_other_files(tiny_llama: Path, tmp_path: Path):
    # Equal content in another directory is not the same key: only the daemon, having read both,
    # may say the bytes are equal.
    copy = shutil.copytree(tiny_llama, tmp_path / "elsewhere")
    assert compute_key(tiny_llama, torch.bfloat16).diff(compute_key(copy, torch.bfloat16)) == ["files"]


def test_same_architecture_other_seed_never_collides(tmp_path: Path):
    from keepwarm_runtime.modelgen import make_model

    one = make_model(tmp_path / "seed1", arch="llama", params="1M", dtype="bfloat16", seed=1)
    two = make_model(tmp_path / "seed2", arch="llama", params="1M", dtype="bfloat16", seed=2)
    a, b = compute_key(one, "bfloat16"), compute_key(two, "bfloat16")
    assert a.checkpoint == b.checkpoint  # identical headers and sizes: the case that used to collide
    assert a.diff(b) == ["files"]


def test_in_place_byte_flip_changes_the_key(tiny_llama: Path, tmp_path: Path):
    copy = shutil.copytree(tiny_llama, tmp_path / "flipped")
    before = compute_key(copy, torch.bfloat16)
    shard = read_checkpoint(copy)[0]
    rec = shard.tensors[-1]
    with open(shard.path, "r+b") as f:  # same size, same header, other weight bytes
        f.seek(rec.offset)
        data = f.read(16)
        f.seek(rec.offset)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(shard.path, ns=(shard.identity.mtime_ns, shard.identity.mtime_ns))  # even with mtime restored
    assert before.diff(compute_key(copy, torch.bfloat16)) == ["files"]


def test_key_reads_headers_not_weights(tmp_path: Path):
    """A restart must not read the weights to compute its key: count the bytes read (/proc rchar)."""
    from safetensors.torch import save_file

    (tmp_path / "big").mkdir()
    save_file({"w": torch.zeros(4096, 4096)}, tmp_path / "big" / "model.safetensors")  # 64 MiB

    def rchar() -> int:
        text = Path("/proc/self/io").read_text()
        return int(next(line for line in text.splitlines() if line.startswith("rchar:")).split()[1])

    before = rchar()
    compute_key(tmp_path / "big", "float32")
    assert rchar() - before < 1 << 20


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
    assert compute_key(tiny_llama, "bfloat16").diff(compute_key(copy, "bfloat16")) == ["checkpoint", "files"]


def test_quantization_and_revision(tiny_llama: Path, tmp_path: Path):
    snap = shutil.copytree(tiny_llama, tmp_path / "snapshots" / "abc123")
    config = json.loads((snap / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (snap / "config.json").write_text(json.dumps(config))
    key = compute_key(snap, "bfloat16")
    assert key.revision == "abc123"
    assert compute_key(tiny_llama, "bfloat16").diff(key) == ["files", "quantization", "revision"]


def test_online_quantization_is_its_own_key(tiny_llama: Path):
    from keepwarm_runtime.weights.quantization import Fp8Settings, fp8_settings

    online = fp8_settings(None, "fp8")
    plain, quantized = compute_key(tiny_llama, "bfloat16"), compute_key(tiny_llama, "bfloat16", online=online)
    assert plain.diff(quantized) == ["quantization"]
    assert quantized.quantization == "online:fp8:block=128x128:skip=lm_head:quantizer-v1"
    other = Fp8Settings("online", not_converted=("lm_head", "gate"))  # other settings, another key
    assert compute_key(tiny_llama, "bfloat16", online=other).diff(quantized) == ["quantization"]
    assert WeightCacheKey.from_dict(quantized.to_dict()) == quantized


def test_wire_round_trip_and_missing_fields(tiny_llama: Path):
    key = compute_key(tiny_llama, "bfloat16")
    assert WeightCacheKey.from_dict(key.to_dict()) == key
    partial = key.to_dict()
    del partial["dtype"]
    with pytest.raises(ValueError, match="dtype"):
        WeightCacheKey.from_dict(partial)
    for field, bad in (
        ("tp_rank", "0"),
        ("tp_rank", True),
        ("dtype", 3),
        ("files", ["x"]),
        ("dtype", "x" * 300),
    ):
        with pytest.raises(ValueError, match=field):
            WeightCacheKey.from_dict(key.to_dict() | {field: bad})
    with pytest.raises(ValueError, match="object"):
        WeightCacheKey.from_dict(["checkpoint"])
