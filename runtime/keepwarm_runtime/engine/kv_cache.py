"""The paged KV cache tensors: one [num_blocks, block_size, kv_heads, dim] pair per attention layer.

Shapes come from a probe pass (one token through the model with no metadata set: each layer records
what it was handed and the window it was called with; the backend then accepts or refuses each
layer), so MLA's separate key/value widths and per-layer head counts need no model knowledge here.
Sizing: an explicit block count, else a memory budget (CPU) or what is left of the GPU after the weights
(and the decode graphs' estimate: engine/decode_graphs.py).
On CPU the tensors live in fresh anonymous mappings, which the kernel zero-fills page by page on first
touch: allocating is free, and only blocks a sequence ever writes cost memory (torch.zeros wrote every
byte up front: 1.1 GiB took 0.4-1.7 s on a 2-core VM, a large part of a warm restart). A tensor of a
huge page or more asks for huge pages (weights/huge_pages.py ``huge_anonymous``): a decode step reads
each sequence's blocks wherever they lie, a TLB miss per block on 4 KiB pages, and the CPU attention
kernel read cold caches 1-15% faster on 2 MiB pages (docs/performance.md); memory is then taken 2 MiB
at a time as blocks are first written.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from keepwarm_runtime.engine.attention.fuser import AttentionFusionError
from keepwarm_runtime.engine.attention.layer import KeepwarmAttention, KVSpec
from keepwarm_runtime.engine.attention.metadata import use_metadata
from keepwarm_runtime.engine.attention.window import cache_windows
from keepwarm_runtime.engine.block_manager import cdiv
from keepwarm_runtime.engine.config import EngineConfig
from keepwarm_runtime.weights.huge_pages import HUGE_PAGE, huge_anonymous


@torch.inference_mode()
def probe_kv_specs(model: nn.Module, layers: list[KeepwarmAttention], device: torch.device) -> list[KVSpec]:
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    for layer in layers:
        layer.probe_calls = 0
    with use_metadata(None):
        model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1)
    reused = [
        f"{layer.owner} layer_idx {layer.layer_idx} ({layer.probe_calls}x)"
        for layer in layers
        if layer.probe_calls > 1
    ]
    if reused:
        raise AttentionFusionError(
            f"attention runs more than once per forward pass ({', '.join(reused)}): looped or "
            "weight-shared layers need one KV cache per call; keepwarm keeps one per module and refuses "
            "this model"
        )
    missing = [layer.layer_idx for layer in layers if layer.kv_spec is None]
    if missing:
        raise RuntimeError(
            f"attention layers {missing} were never called in a forward pass; cannot size the KV cache"
        )
    text_config = model.config.get_text_config(decoder=True)
    windows = cache_windows(text_config, max(layer.layer_idx for layer in layers) + 1)
    for layer in layers:
        layer.cache_window = windows[layer.layer_idx]
        if layer.backend is not None:
            layer.backend.check_layer(layer)
    return [layer.kv_spec for layer in layers]


def bytes_per_block(specs: list[KVSpec], block_size: int, dtype: torch.dtype) -> int:
    width = sum(s.num_kv_heads * (s.key_dim + s.value_dim) for s in specs)
    return block_size * width * dtype.itemsize


def num_blocks_for(
    config: EngineConfig,
    specs: list[KVSpec],
    max_model_len: int,
    device: torch.device,
    reserved_bytes: int = 0,
) -> int:
    """``reserved_bytes``: CUDA memory kept out of the cache's budget (the decode graphs' pool)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(specs, config.block_size, config.torch_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = max(int(total * config.gpu_memory_utilization) - used - reserved_bytes, 0)
    else:
        budget = int(config.kv_cache_memory_gib * (1 << 30))
    # Never more than every sequence at full length needs.
    ceiling = config.max_num_seqs * cdiv(max_model_len, config.block_size) + 1
    blocks = min(budget // per_block, ceiling)
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache ({budget} bytes budget, {per_block} per block)")
    return int(blocks)


def allocate_kv_cache(
    layers: list[KeepwarmAttention],
    specs: list[KVSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    for layer, spec in zip(layers, specs, strict=True):
        shape = (num_blocks, block_size, spec.num_kv_heads)
        layer.k_cache = zeros((*shape, spec.key_dim), dtype, device)
        layer.v_cache = zeros((*shape, spec.value_dim), dtype, device)


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = True
) -> torch.Tensor:
    """A zero tensor; on CPU backed by its own anonymous mapping, zeroed lazily by the kernel, on huge
    pages where it spans one or more, the kernel gives them and ``huge_pages`` asks (benchmarks compare)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = huge_anonymous(nbytes) if huge_pages and nbytes >= HUGE_PAGE else None
    if memory is None:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mapping alive; a huge one is rounded up to whole huge pages.
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
