"""cache/adapters.py: what the daemon accepts as a LoRA adapter, its key and its plain layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from keepwarm_runtime.cache.adapters import (
    ADAPTER_ARCHITECTURE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_key,
    adapter_layout,
    is_adapter_key,
    read_adapter,
)
from keepwarm_runtime.cache.fingerprint import compute_key
from keepwarm_runtime.weights.arena import ALIGN
from keepwarm_runtime.weights.checkpoint import CheckpointError

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def write_adapter(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({A: torch.randn(4, 64, generator=g), B: torch.randn(48, 4, generator=g)}, path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    return path


def test_only_a_peft_adapter_directory_is_read(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_adapter(tmp_path / "missing")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    save_file({"x": torch.zeros(2)}, no_config / WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match=f"no {CONFIG_FILE}"):
        read_adapter(no_config)
    no_weights = write_adapter(tmp_path / "no-weights")
    (no_weights / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        read_adapter(no_weights)
    truncated = write_adapter(tmp_path / "truncated")
    data = (truncated / WEIGHTS_FILE).read_bytes()
    (truncated / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        read_adapter(truncated)


def test_the_key_marks_an_adapter_and_follows_the_file(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    shards = read_adapter(adapter)
    key = adapter_key(adapter, torch.float32, shards)
    assert key.architecture == ADAPTER_ARCHITECTURE and is_adapter_key(key)
    model_key = compute_key(adapter, torch.float32, shards=shards)
    assert not is_adapter_key(model_key) and {"architecture", "conversion"} <= set(key.diff(model_key))
    assert key.diff(adapter_key(adapter, torch.bfloat16, shards)) == ["dtype"]

    write_adapter(adapter, seed=1)  # same shapes, same header size: rewritten in place
    os.utime(adapter / WEIGHTS_FILE, ns=(shards[0].identity.mtime_ns, shards[0].identity.mtime_ns))
    assert "files" in key.diff(adapter_key(adapter, torch.float32, read_adapter(adapter)))


def test_the_layout_holds_every_tensor_as_stored_in_the_serving_dtype(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    layout = adapter_layout(read_adapter(adapter), torch.bfloat16)
    assert [(e.name, e.dtype, e.shape) for e in layout.entries] == [
        (A, torch.bfloat16, (4, 64)),
        (B, torch.bfloat16, (48, 4)),
    ]
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    assert not layout.placements and not layout.quantized and not layout.up_first
