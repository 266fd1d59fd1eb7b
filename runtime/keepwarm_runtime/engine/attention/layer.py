"""KeepwarmAttention: the layer attached under each transformers attention module.

It is a child module (`<attention module>.keepwarm_attn`), so it shows up in `named_modules()`, moves
with `.to()` and is visible to weight post-processing. It owns no parameters; the KV cache views are
plain attributes, so they never enter a state dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from keepwarm_runtime.engine.attention.metadata import get_metadata
from keepwarm_runtime.engine.attention.window import effective_window


def write_kv(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Row t of ``rows`` ([T, kv_heads, dim]) into slot ``slots[t]`` of ``cache`` ([slots, kv_heads,
    dim]): the backends' way unless they have a faster one (the cpu backend's kernel)."""
    cache.index_copy_(0, slots, rows)


@dataclass(frozen=True)
class KVSpec:
    num_kv_heads: int
    key_dim: int
    value_dim: int  # differs from key_dim for MLA (DeepSeek) without the latent trick
    dtype: torch.dtype


class KeepwarmAttention(nn.Module):
    def __init__(self, layer_idx: int, scale: float | None, owner: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = (
            scale  # softmax scale resolved from the owner's `scaling=` argument; None: head_dim**-0.5
        )
        self.owner = owner  # class name of the transformers module, for error messages
        self.backend = None  # an attention backend (torch_backend / flashinfer_backend), set by the engine
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, key_dim]
        self.v_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, value_dim]
        self.kv_spec: KVSpec | None = None  # recorded by the probe pass
        self.probe_calls = 0  # calls during the probe pass: one KV cache serves exactly one call per step
        self.probe_window: int | None = None  # the call's sliding_window= during the probe pass
        self.probe_sinks = False  # whether the probe call passed attention sinks
        self.cache_window: int | None = None  # generate()'s cache window for this layer (attention/window.py)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, scale={self.scale}, owner={self.owner}"

    def forward(
        self,
        query: torch.Tensor,  # [1, heads, T, key_dim]
        key: torch.Tensor,  # [1, kv_heads, T, key_dim]
        value: torch.Tensor,  # [1, kv_heads, T, value_dim]
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [1, T, heads, value_dim]
        meta = get_metadata()
        if meta is None:  # probe pass: learn the KV shapes, compute nothing
            self.kv_spec = KVSpec(key.shape[1], key.shape[-1], value.shape[-1], key.dtype)
            self.probe_window = sliding_window
            self.probe_sinks = sinks is not None
            self.probe_calls += 1
            return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
        if query.shape[0] != 1:
            raise RuntimeError("keepwarm attention expects packed sequences (batch dimension 1)")
        scale = self.scale if self.scale is not None else query.shape[-1] ** -0.5
        # Every backend reads the paged cache, so the new tokens' K/V go in here, once, for all of them.
        for cache, new in ((self.k_cache, key), (self.v_cache, value)):
            flat = cache.view(-1, new.shape[1], new.shape[-1])  # [slots, kv_heads, dim]
            self.backend.write_kv(flat, meta.slot_mapping, new[0].transpose(0, 1).to(cache.dtype))
        if meta.backend_metadata is None:  # the model runner builds it; a bare caller (tests) gets it here
            meta.backend_metadata = self.backend.build(meta)
        window = effective_window(sliding_window, self.cache_window)
        return self.backend.forward(
            self, query, key, value, meta.backend_metadata, scale, window, softcap, sinks
        )
