"""The disk path (weights/arena.py load_from_disk): the same tensors whether converted in parallel or
one by one, equal to safetensors' own load, and a shard changed after its header was read refused;
the serving layout's views of the file only on a cache line, its private arena on huge pages."""

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


def _rewrite_with_data_at(checkpoint: Path, to: Path, misalign: int) -> Path:
    """``checkpoint`` copied with each shard's header padded (safetensors allows trailing spaces) so its
    data starts ``misalign`` bytes past a 64-byte boundary of the file."""
    import json
    import shutil
    import struct

    shutil.copytree(checkpoint, to)
    for shard in to.glob("*.safetensors"):
        tensors = load_file(str(shard))
        header, offset, blobs = {}, 0, []
        for name, tensor in tensors.items():
            blob = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}[tensor.dtype]
            header[name] = {
                "dtype": dtype,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + len(blob)],
            }
            offset += len(blob)
            blobs.append(blob)
        text = json.dumps(header).encode()
        text += b" " * ((misalign - 8 - len(text)) % 64)
        shard.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return to


@pytest.mark.parametrize("misalign", [0, 8, 24])
def test_the_disk_path_serves_file_views_only_on_a_cache_line(
    checkpoint: Path, tmp_path: Path, misalign
) -> None:
    """A tensor served as stored is a view of the file's mapping where it starts on a cache line, else
    a copy in the arena (a CPU kernel's 64-byte loads from a weight between lines touch two each)."""
    model = _rewrite_with_data_at(checkpoint, tmp_path / "model", misalign)
    shards = read_checkpoint(model)
    sizes = {shard.size for shard in shards}
    tensors = loader.load_serving_layout(shards, torch.bfloat16)
    expected = reference(checkpoint, torch.bfloat16)
    assert tensors.keys() == expected.keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name
        assert tensor.data_ptr() % loader.CACHE_LINE == 0, name
        viewed = tensor.untyped_storage().nbytes() in sizes  # the storage is a whole shard's mapping
        assert viewed == (misalign == 0), name


def test_a_cpu_private_arena_asks_for_huge_pages() -> None:
    from keepwarm_runtime.weights.huge_pages import HUGE_PAGE, pmd_mapped_bytes, thp_mode

    arena = loader.PrivateArena(4 * HUGE_PAGE, torch.device("cpu"))
    arena.buffer.fill_(1)
    huge = pmd_mapped_bytes(arena.buffer.data_ptr())
    if thp_mode() in ("always", "madvise"):
        assert huge == 4 * HUGE_PAGE  # the kernel places a whole-huge-page mapping aligned (Linux 6.7)
    else:
        assert huge == 0
