"""The disk path (weights/arena.py load_from_disk): the same tensors whether converted in parallel or
one by one, equal to safetensors' own load, and a shard changed after its header was read refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keepwarm_runtime.weights import arena as loader
from keepwarm_runtime.weights.checkpoint import CheckpointError, read_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from keepwarm_runtime.modelgen import make_model

    return make_model(tmp_path_factory.mktemp("disk"), arch="llama", params="1M", dtype="bfloat16")


def reference(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        out |= {k: v.to(dtype) for k, v in load_file(str(shard)).items()}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_and_serial_loads_equal_safetensors(checkpoint: Path, dtype, monkeypatch) -> None:
    shards = read_checkpoint(checkpoint)
    monkeypatch.setattr(loader, "DISK_PARALLEL_BYTES", 0)  # every load threaded
    threaded = loader.load_from_disk(shards, dtype)
    monkeypatch.setattr(loader, "DISK_PARALLEL_BYTES", 1 << 60)  # none
    serial = loader.load_from_disk(shards, dtype)
    expected = reference(checkpoint, dtype)
    assert threaded.keys() == serial.keys() == expected.keys()
    for name, tensor in expected.items():
        assert threaded[name].dtype == serial[name].dtype == dtype, name
        assert torch.equal(threaded[name], tensor) and torch.equal(serial[name], tensor), name


def test_a_shard_rewritten_after_its_header_was_read_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    shards = read_checkpoint(copy)
    victim = shards[0].path
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data)  # same bytes, another file: a replaced shard
    with pytest.raises(CheckpointError, match="changed on disk"):
        loader.load_from_disk(shards, torch.float32)
