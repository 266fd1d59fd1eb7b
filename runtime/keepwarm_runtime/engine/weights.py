"""Where the engine gets named tensors: the node cache's `attach()`, or a plain disk read before it exists."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LocalAttachResult:
    """Same shape as keepwarm_runtime.cache.client.AttachResult."""

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]
    source: str
    reason: str | None
    seconds: float


def attach_weights(
    model_dir: str | Path,
    socket_dir: str | None,
    dtype: torch.dtype,
    device: str,
    mode: str = "zero_copy",
    fallback: bool = True,
):
    try:
        from keepwarm_runtime.cache.client import attach
    except ImportError:
        if socket_dir is not None:
            raise
        return _load_from_disk(Path(model_dir), dtype, device)
    return attach(model_dir, socket_dir, dtype=dtype, device=device, mode=mode, fallback=fallback)


def _load_from_disk(model_dir: Path, dtype: torch.dtype, device: str) -> LocalAttachResult:
    from safetensors.torch import load_file

    started = time.perf_counter()
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    files = files or [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(model_dir / name, device=str(device)).items():
            tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return LocalAttachResult(tensors, {}, "disk", None, time.perf_counter() - started)
